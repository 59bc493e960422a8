"""Checkpoint layouts, safe loading, and round trips through Hugging Face ViT and nn.MultiheadAttention."""

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import digest, says

from structinit.apply.checkpoint import apply_checkpoint
from structinit.errors import UsageError
from structinit.geometry.embedding import pseudo_input, sincos_2d
from structinit.geometry.targets import impulse_targets
from structinit.init.checkpoints import CheckpointError, describe_checkpoint, load_checkpoint
from structinit.init.layouts import LAYOUTS, detect_layout

DIM, HEADS = 64, 4


def small_vit(depth=2, class_token=False):
    import timm

    from structinit.init.pos_embed import set_sincos_pos_embed

    torch.manual_seed(0)
    m = timm.create_model("vit_tiny_patch16_224", img_size=16, patch_size=2, embed_dim=DIM, depth=depth,
                          num_heads=HEADS, class_token=class_token, global_pool="avg" if not class_token else "token",
                          num_classes=10)
    set_sincos_pos_embed(m)
    return m


class _CreatesFile:
    """Unpickling this would create ``path`` (builtins.open in write mode)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_layout_table_is_one_table_with_the_documented_names():
    """Every layout of the table has its own name, documented on the apply page."""
    from conftest import REPO

    names = [l.name for l in LAYOUTS]
    page = (REPO / "docs" / "apply.md").read_text(encoding="utf-8")
    assert len(names) == len(set(names)) and {"timm-vit", "hf-vit", "hf-bert", "hf-gpt2", "torch-mha"} <= set(names)
    assert [n for n in names if f"`{n}`" not in page] == []


def test_detects_timm_shape_and_prefixes():
    sd = {"module." + k: v for k, v in small_vit(class_token=True).state_dict().items()}
    det = detect_layout(sd)
    assert (det.layout.name, det.model_prefix, det.dim, det.depth, det.prefix_tokens, det.grid) == \
        ("timm-vit", "module.", DIM, 2, 1, (8, 8))
    assert det.heads is None  # a timm state dict does not record heads
    assert det.slots[1].q.key == "module.blocks.1.attn.qkv.weight"
    assert (det.slots[1].k.start, det.slots[1].k.stop) == (DIM, 2 * DIM)


def test_malicious_pickle_is_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "pwned.txt"
    bad = tmp_path / "evil.pth"
    torch.save({"state_dict": {"x": torch.zeros(1)}, "payload": _CreatesFile(marker)}, bad)
    assert not marker.exists()
    with pytest.raises(CheckpointError, match="refusing to load.*nothing of it was run"):
        load_checkpoint(bad)
    assert not marker.exists()


def test_bad_files(tmp_path):
    with pytest.raises(CheckpointError, match="no such file"):
        load_checkpoint(tmp_path / "missing.pt")
    good = tmp_path / "ok.pt"
    torch.save(small_vit().state_dict(), good)
    trunc = tmp_path / "trunc.pt"
    trunc.write_bytes(good.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=r"not a readable checkpoint \(not a torch or safetensors file, or "
                                              r"truncated\)"):
        load_checkpoint(trunc)
    text = tmp_path / "notes.pt"
    text.write_text("garbage, not a pickle")
    with pytest.raises(CheckpointError, match=r"not a checkpoint \(neither a torch.save file nor safetensors\)") as err:
        load_checkpoint(text)
    assert "refusing" not in str(err.value)  # not mistaken for a pickle that needs code
    st = tmp_path / "trunc.safetensors"
    st.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\":")
    with pytest.raises(CheckpointError, match="not a readable safetensors"):
        load_checkpoint(st)
    other = tmp_path / "other.pt"
    torch.save({"encoder.weight": torch.zeros(3, 3), "epoch": 1}, other)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(other)
    assert says(str(err.value), "unknown checkpoint layout", "encoder.weight, epoch")


@pytest.mark.slow
def test_hugging_face_vit_round_trip(tmp_path):
    from transformers import ViTConfig, ViTModel

    cfg = ViTConfig(hidden_size=DIM, num_hidden_layers=2, num_attention_heads=HEADS, intermediate_size=128,
                    image_size=16, patch_size=2)
    torch.manual_seed(0)
    ViTModel(cfg).save_pretrained(tmp_path / "hf")
    src = tmp_path / "hf" / "model.safetensors"
    before = digest(src)
    from safetensors.torch import load_file

    orig = load_file(src)
    rep = apply_checkpoint(src, set_pe="sincos", seed=4, mimetic_vproj=False, data_fit=0)  # heads: its config.json
    assert digest(src) == before
    out = Path(rep["output"])
    assert out.name == "model.impulse.safetensors" and rep["layout"] == "hf-vit" and rep["heads"] == HEADS
    new = load_file(out)
    assert set(new) == set(orig)
    changed = {k for k in orig if not torch.equal(orig[k], new[k])}
    qk = {f"encoder.layer.{i}.attention.attention.{p}.{w}" for i in range(2) for p in ("query", "key")
          for w in ("weight", "bias")}
    assert changed - {k for k in qk if k.endswith("bias")} == {k for k in qk if k.endswith("weight")} | {
        "embeddings.position_embeddings"}  # HF's biases start at zero, which is what apply writes
    assert all(torch.count_nonzero(new[k]) == 0 for k in qk if k.endswith("bias"))
    assert torch.equal(new["embeddings.position_embeddings"][0, 0], orig["embeddings.position_embeddings"][0, 0])
    assert np.array_equal(new["embeddings.position_embeddings"][0, 1:].numpy(), sincos_2d((8, 8), DIM))

    # the real HF class loads it and its own projections give the impulse attention
    (tmp_path / "hf" / "model.safetensors").unlink()
    out.rename(tmp_path / "hf" / "model.safetensors")
    model, info = ViTModel.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    x = torch.from_numpy(pseudo_input("pe", (8, 8), DIM))
    d = DIM // HEADS
    for i, row in enumerate(rep["layers"]):
        att = model.encoder.layer[i].attention.attention if hasattr(model, "encoder") else model.layers[i].attention
        qp = getattr(att, "query", None) or att.q_proj
        kp = getattr(att, "key", None) or att.k_proj
        with torch.no_grad():
            q = qp(x).reshape(64, HEADS, d).transpose(0, 1)
            k = kp(x).reshape(64, HEADS, d).transpose(0, 1)
            attn = torch.softmax(q @ k.transpose(-1, -2) / d ** 0.5, -1)
        t = torch.from_numpy(impulse_targets((8, 8), np.array(row["offsets"])))
        has = t.sum(-1) > 0
        assert bool(((attn.argmax(-1) == t.argmax(-1)) | ~has).all())
        assert abs(float((attn * t).sum(-1)[has].mean()) - 0.3) < 0.01


def test_multihead_attention_round_trip(tmp_path):
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(DIM, HEADS, batch_first=True)
    src = tmp_path / "mha.pt"
    torch.save(mha.state_dict(), src)
    before = digest(src)
    with pytest.raises(UsageError, match="give it with grid"):
        apply_checkpoint(src, heads=HEADS)
    with pytest.raises(UsageError, match="give it with heads"):
        apply_checkpoint(src, grid=(8, 8))
    assert not (tmp_path / "mha.impulse.pt").exists()
    rep = apply_checkpoint(src, heads=HEADS, grid=(8, 8), offset_order="centre", mimetic_vproj=False)
    assert digest(src) == before and rep["layout"] == "torch-mha"
    fresh = torch.nn.MultiheadAttention(DIM, HEADS, batch_first=True)
    fresh.load_state_dict(torch.load(rep["output"], weights_only=True), strict=True)
    assert torch.equal(fresh.in_proj_weight[2 * DIM:], mha.in_proj_weight[2 * DIM:])
    assert torch.equal(fresh.out_proj.weight, mha.out_proj.weight)
    x = torch.from_numpy(pseudo_input("pe", (8, 8), DIM))[None]
    with torch.no_grad():
        _, attn = fresh(x, x, x, need_weights=True, average_attn_weights=False)  # PyTorch's own attention
    t = torch.from_numpy(impulse_targets((8, 8), np.array(rep["layers"][0]["offsets"])))
    has = t.sum(-1) > 0
    assert bool(((attn[0].argmax(-1) == t.argmax(-1)) | ~has).all())
    assert abs(float((attn[0] * t).sum(-1)[has].mean()) - 0.3) < 0.01


def test_describe_checkpoint_reads_the_structure_back(tmp_path):
    src = tmp_path / "vit.pth"
    torch.save({"model": small_vit().state_dict(), "epoch": 7}, src)
    plain = describe_checkpoint(src, heads=HEADS)
    assert plain["layout"] == "timm-vit" and plain["grid"] == [8, 8] and plain["depth"] == 2
    assert plain["pos_embed_kind"] == "sincos"
    assert max(r["hit_rate"] for r in plain["layers"]) < 0.6  # trunc-normal Q/K: no impulse structure
    rep = apply_checkpoint(src, "impulse", heads=HEADS, filter=5, target_mass=0.5, data_fit=0)
    desc = describe_checkpoint(rep["output"], heads=HEADS)
    for got, want in zip(desc["layers"], rep["layers"]):
        assert got["offsets"] == want["offsets"]  # the closest offset found is the solved one
        assert got["hit_rate"] == 1.0 and abs(got["target_mass"] - 0.5) < 1e-3
    from structinit.analysis.text import checkpoint_report

    text = checkpoint_report(desc)
    assert "timm-vit" in text and "grid 8x8" in text and "1.000" in text
    with pytest.raises(UsageError, match="give it with heads"):
        describe_checkpoint(src)


def test_heads_from_timm_arch_of_a_training_checkpoint(tmp_path):
    import timm

    from structinit.families.timm_vit import timm_arch_heads as _timm_arch_heads

    assert _timm_arch_heads("vit_small_patch16_224", 384) == 6
    assert _timm_arch_heads("vit_small_patch16_224", 64) is None  # another width: no hint
    assert _timm_arch_heads("no_such_model", 64) is None
    with torch.device("meta"):
        shape = {k: v.shape for k, v in timm.create_model("vit_small_patch16_224").state_dict().items()}
    src = tmp_path / "train.pth"
    one_block = {k: torch.zeros(s) for k, s in shape.items()
                 if not k.startswith("blocks.") or k.startswith("blocks.0.")}
    torch.save({"state_dict": one_block, "arch": "vit_small_patch16_224"}, src)
    plan = apply_checkpoint(src, dry_run=True, set_pe="sincos")  # its all-zero embedding is no sin-cos table
    got = (plan["heads"], plan["depth"], plan["grid"], plan["hints"]["arch"])
    assert got == (6, 1, [14, 14], "vit_small_patch16_224")
