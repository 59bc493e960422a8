"""``apply`` on real timm checkpoints: round trips, preservation of everything else, in-place,
dry run, errors that leave the input untouched, and the CLI."""

import argparse
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import digest, error_line
from test_checkpoints import _CreatesFile  # a pickle whose loading would create a file

from structinit.apply.checkpoint import apply_checkpoint
from structinit.errors import StructinitError, UsageError
from structinit.geometry.targets import impulse_targets
from structinit.init.pos_embed import set_sincos_pos_embed

DIM, HEADS, DEPTH = 64, 4, 3


def paper_vit(seed=0):
    import timm

    torch.manual_seed(seed)
    m = timm.create_model("vit_tiny_patch16_224", img_size=16, patch_size=2, embed_dim=DIM, depth=DEPTH,
                          num_heads=HEADS, class_token=False, global_pool="avg", num_classes=10)
    set_sincos_pos_embed(m)
    return m


def timm_hits(model, offsets_per_layer, grid):
    """Per layer, (all rows hit, mean target mass) of timm's own attention on the position embedding."""
    out = []
    for blk, offsets in zip(model.blocks, offsets_per_layer):
        seen = []
        blk.attn.fused_attn = False
        h = blk.attn.attn_drop.register_forward_hook(lambda m, i, o, seen=seen: seen.append(o.detach()))
        with torch.no_grad():
            blk.attn(blk.norm1(model.pos_embed[:, model.num_prefix_tokens if not model.no_embed_class else 0:]))
        h.remove()
        t = torch.from_numpy(impulse_targets(grid, np.array(offsets)))
        has = t.sum(-1) > 0
        attn = seen[0][0]
        out.append((bool(((attn.argmax(-1) == t.argmax(-1)) | ~has).all()), float((attn * t).sum(-1)[has].mean())))
    return out


def assert_same(a, b, path="ckpt", skip=(), ordered=True):
    """Every entry equal bit for bit, with the same dtype and device (``skip``: keys allowed to differ)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.device == b.device, path
        if path not in skip:
            assert torch.equal(a, b), path
        return
    if isinstance(a, dict):
        assert (list(a) == list(b)) if ordered else (sorted(a) == sorted(b)), path
        for k in a:
            assert_same(a[k], b[k], k if path in ("ckpt", "state_dict", "state_dict_ema", "model") else f"{path}.{k}",
                        skip, ordered)
        return
    assert a == b, path


@pytest.mark.slow  # over 10 s on one core: a full training or Hugging Face round trip, or many CLI calls
def test_timm_training_checkpoint_round_trip(tmp_path):
    m = paper_vit()
    sd = m.state_dict()
    ema = {k: v.clone() + (0.01 if v.is_floating_point() else 0) for k, v in sd.items()}
    ckpt = {"epoch": 12, "arch": "vit_tiny_patch16_224", "state_dict": sd, "state_dict_ema": ema,
            "optimizer": {"state": {}, "param_groups": [{"lr": 1e-3}]}, "version": 2,
            "args": argparse.Namespace(model="vit", lr=1e-3, layers=[1, 2])}
    src = tmp_path / "train.pth.tar"
    torch.save(ckpt, src)
    before = digest(src)
    rep = apply_checkpoint(src, heads=HEADS, layers="1-2", target_mass=0.35, mimetic_vproj=False,
                           data_fit=0)  # Q/K only
    assert digest(src) == before and rep["output"] == str(tmp_path / "train.impulse.pth.tar")
    assert rep["state_dicts"] == ["state_dict", "state_dict_ema"]
    assert [r["layer"] for r in rep["layers"]] == [1, 2] and all(r["hit_rate"] == 1.0 for r in rep["layers"])
    assert rep["layers"][0]["replaced"] == ["blocks.1.attn.qkv.weight[0:64]", "blocks.1.attn.qkv.weight[64:128]",
                                            "blocks.1.attn.qkv.bias[0:64]", "blocks.1.attn.qkv.bias[64:128]"]
    new = torch.load(rep["output"], weights_only=False)
    qkv = {f"blocks.{i}.attn.qkv.{w}" for i in (1, 2) for w in ("weight", "bias")}
    assert_same(ckpt, new, skip=qkv)
    for name in ("state_dict", "state_dict_ema"):
        for key in qkv:
            assert torch.equal(new[name][key][2 * DIM:], ckpt[name][key][2 * DIM:])  # v rows kept
        key = "blocks.1.attn.qkv.weight"
        assert torch.equal(new[name][key][:2 * DIM], new["state_dict"][key][:2 * DIM])
    model = paper_vit(seed=1)
    model.load_state_dict(new["state_dict"], strict=True)
    offsets = [rep["layers"][0]["offsets"], rep["layers"][1]["offsets"]]
    model.blocks = torch.nn.ModuleList([model.blocks[1], model.blocks[2]])  # the replaced layers
    for ok, mass in timm_hits(model, offsets, (8, 8)):
        assert ok and abs(mass - 0.35) < 0.01


def test_stock_vit_tiny_safetensors_with_sincos(tmp_path):
    import timm
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    m = timm.create_model("vit_tiny_patch16_224")  # class token, learned PE [1, 197, 192], 3 heads, 12 blocks
    orig = {k: v.clone() for k, v in m.state_dict().items()}
    src = tmp_path / "vit_tiny.safetensors"
    save_file(orig, src, metadata={"note": "kept"})
    plan = apply_checkpoint(src, heads=3, dry_run=True, set_pe="sincos")
    assert plan["grid"] == [14, 14] and plan["prefix_tokens"] == 1 and plan["depth"] == 12 and plan["dry_run"]
    assert not Path(plan["output"]).exists() and not any(Path(tmp_path / "user-cache").glob("*.safetensors"))
    rep = apply_checkpoint(src, heads=3, share=True, set_pe="sincos", out=tmp_path / "out.safetensors", data_fit=0)
    new = load_file(tmp_path / "out.safetensors")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "out.safetensors"), "pt") as fh:
        assert fh.metadata() == {"note": "kept"}
    # the default writes mimetic V/proj too (qkv's v rows and proj); data_fit=0 asks for the plain solve
    proj = {f"blocks.{i}.attn.proj.weight" for i in range(12)}
    skip = {f"blocks.{i}.attn.qkv.{w}" for i in range(12) for w in ("weight", "bias")} | {"pos_embed"} | proj
    assert_same(orig, new, skip=skip, ordered=False)  # safetensors stores keys sorted
    assert all(not torch.equal(new[k], orig[k]) for k in proj) and rep["mimetic_vproj"] is True
    assert rep["data_fit"] is None and rep["params"]["data_fit"] == 0
    assert torch.equal(new["pos_embed"][0, 0], orig["pos_embed"][0, 0])  # class-token position kept
    m.load_state_dict(new, strict=True)
    assert all(r["hit_rate"] == 1.0 for r in rep["layers"])
    assert len({str(r["offsets"]) for r in rep["layers"]}) == 1  # shared: one solve for every layer
    for ok, mass in timm_hits(m, [r["offsets"] for r in rep["layers"]], (14, 14)):
        assert ok and abs(mass - 0.3) < 0.01


def test_half_precision_dtype_kept_and_mimetic(tmp_path):
    sd = {k: v.half() for k, v in paper_vit().state_dict().items()}
    src = tmp_path / "half.pt"
    torch.save({"model": sd}, src)
    rep = apply_checkpoint(src, "mimetic", heads=HEADS, layers="0")
    new = torch.load(rep["output"], weights_only=True)["model"]
    assert all(v.dtype == torch.float16 for v in new.values())
    assert_same(sd, new, skip={"blocks.0.attn.qkv.weight", "blocks.0.attn.qkv.bias", "blocks.0.attn.proj.weight"})
    w = new["blocks.0.attn.qkv.weight"].float()
    vp = w[2 * DIM:].T @ new["blocks.0.attn.proj.weight"].float().T
    assert abs(float(vp.diagonal().mean()) + 0.4) < 0.03
    assert rep["layers"][0]["replaced"][-2:] == ["blocks.0.attn.qkv.weight[128:192]", "blocks.0.attn.proj.weight"]
    assert torch.equal(new["blocks.0.attn.proj.bias"], sd["blocks.0.attn.proj.bias"])


def test_in_place_keeps_a_backup(tmp_path):
    src = tmp_path / "vit.pt"
    torch.save(paper_vit().state_dict(), src)
    before = src.read_bytes()
    rep = apply_checkpoint(src, heads=HEADS, in_place=True, data_fit=0)  # the solve alone: the fit is not tested here
    assert rep["output"] == str(src) and Path(rep["backup"]).read_bytes() == before
    assert src.read_bytes() != before
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["vit.pt", "vit.pt.bak"]
    with pytest.raises(UsageError, match="use in_place"):
        apply_checkpoint(src, heads=HEADS, out=src)


def test_errors_leave_input_untouched_and_write_nothing(tmp_path):
    from structinit.init.impulse import ImpulseInit
    from structinit.solver.run import solve

    src = tmp_path / "vit.pt"
    torch.save(paper_vit().state_dict(), src)
    before = digest(src)
    art = solve(ImpulseInit().solve_config((8, 8), 128, HEADS, 1), cache_dir=tmp_path / "c").artifact
    cases = [
        (dict(heads=HEADS, layers="0-5"), "out of range"),
        (dict(heads=HEADS, artifact=art.path), "dim 128 vs 64"),
        (dict(heads=3), "does not divide"),
        (dict(), "give it with heads"),
        (dict(heads=HEADS, grid=(4, 4)), "16 tokens"),
        (dict(heads=HEADS, spec="xavier"), "unknown init method"),
    ]
    for kwargs, match in cases:
        with pytest.raises(StructinitError, match=match):
            apply_checkpoint(src, **kwargs)
    assert digest(src) == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["vit.pt"]


def test_cli_apply_json_dry_run_and_refusals(tmp_path, cli):
    src = tmp_path / "vit.pth"
    torch.save({"state_dict": paper_vit().state_dict(), "epoch": 1}, src)
    before = digest(src)
    r = cli("apply", src, "--heads", HEADS, "--filter", "5", "--layers", "0,2", "--data-fit", "0", "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["written"] and [x["layer"] for x in rep["layers"]] == [0, 2] and rep["hit_rate"] == 1.0
    assert rep["artifact"]["config"]["filter"] == 5 and Path(rep["output"]).exists()

    from structinit.cli.apply import format_report, format_verbose

    plan = apply_checkpoint(src, "mimetic", heads=HEADS, dry_run=True, out=tmp_path / "m.pth")
    assert format_report(plan).startswith("plan (dry run, nothing written): mimetic init of 3 layer(s)")
    text = format_verbose(plan)
    assert "plan (dry run" in text and "blocks.2.attn.proj.weight" in text and not (tmp_path / "m.pth").exists()

    marker = tmp_path / "pwned.txt"
    evil = tmp_path / "evil.pth"
    torch.save({"x": _CreatesFile(marker)}, evil)
    r = cli("apply", evil, "--heads", HEADS)
    assert r.returncode != 0 and "refusing to load" in error_line(r.stderr)
    assert not marker.exists() and not (tmp_path / "evil.impulse.pth").exists()

    r = cli("apply", src, "--heads", HEADS, "--layers", "7", "--out", tmp_path / "l7.pth")
    assert r.returncode == 2 and r.stderr.strip().startswith("error: --layers [7] out of range")
    assert digest(src) == before

