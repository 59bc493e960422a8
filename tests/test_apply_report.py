"""apply_checkpoint's report and refusals, field by field and message by message: the plan a dry run
returns, the stages it logs, every refusal of a bad output name or position-embedding setting
compared whole, and the in-place and exclusive writes when the file changes under it."""

import errno
import os
from pathlib import Path

import pytest
import torch
from conftest import digest, says

from structinit.apply.checkpoint import apply_checkpoint
from structinit.errors import StructinitError

DIM, HEADS = 16, 2
PLAIN = dict(heads=HEADS, data_fit=0)  # the impulse init without a fit to real inputs (a file has none)


def vit_sd(rows=None, cls=False, learned=False):
    """A timm ViT's state dict (dim 16, 2 heads, 2 blocks) with a sin-cos position embedding for a
    4x4 grid (a learned-looking one with ``learned``), ``rows`` rows, a class token with ``cls``."""
    import timm

    from structinit.init.pos_embed import write_sincos

    torch.manual_seed(0)
    m = timm.create_model("vit_tiny_patch16_224", img_size=8, patch_size=2, embed_dim=DIM, depth=2, num_heads=HEADS,
                          class_token=cls, global_pool="token" if cls else "avg", num_classes=3)
    sd = m.state_dict()
    rows = 16 + int(cls) if rows is None else rows
    if rows != sd["pos_embed"].shape[1]:
        sd["pos_embed"] = torch.zeros(1, rows, DIM)
    if not learned and rows == 16 + int(cls):
        write_sincos(sd["pos_embed"], (4, 4))
    return sd


def refusal(path, **kwargs) -> str:
    with pytest.raises(StructinitError) as e:
        apply_checkpoint(path, **kwargs)
    return e.value.render(lambda n: f"--{n.replace('_', '-')}")


@pytest.fixture
def src(tmp_path):
    path = tmp_path / "vit.pth"
    torch.save({"model": vit_sd(), "epoch": 3}, path)
    return path


def test_a_dry_run_plan_is_the_files_shape_and_the_settings(src):
    plan = apply_checkpoint(src, dry_run=True, **PLAIN)
    assert plan["output"] == str(src.with_name("vit.impulse.pth")) and plan["input"] == str(src)
    assert (plan["in_place"], plan["backup"], plan["dry_run"]) == (False, None, True)
    assert (plan["format"], plan["output_format"], plan["state_dicts"]) == ("torch", "torch", ["model"])
    assert (plan["layout"], plan["prefix"], plan["dim"], plan["heads"], plan["depth"]) == ("timm-vit", "", DIM, 2, 2)
    assert (plan["grid"], plan["prefix_tokens"], plan["pos_embed"]) == ([4, 4], 0, "pos_embed")
    assert (plan["method"], plan["seed"], plan["set_pe"], plan["pe_scale"]) == ("impulse", 0, None, None)
    assert plan["pos_embed_kind"] == "sincos" and plan["hints"] == {}
    assert [r["layer"] for r in plan["layers"]] == [0, 1] and "pos_embed_replaced" not in plan
    assert not src.with_name("vit.impulse.pth").exists()
    scaled = apply_checkpoint(src, dry_run=True, set_pe="sincos", **PLAIN)
    assert (scaled["set_pe"], scaled["pe_scale"], scaled["pos_embed_replaced"]) == ("sincos", 1.0, "pos_embed")
    assert apply_checkpoint(src, dry_run=True, set_pe="sincos", pe_scale=0.5, **PLAIN)["pe_scale"] == 0.5
    bare = src.with_name("bare.pth")
    torch.save(vit_sd(), bare)
    tensors = apply_checkpoint(bare, dry_run=True, out=src.with_name("v.safetensors"), spec="mimetic", heads=HEADS)
    assert (tensors["format"], tensors["output_format"]) == ("torch", "safetensors")


def test_a_learned_embedding_is_refused_by_the_dry_run_already(tmp_path):
    path = tmp_path / "learned.pth"
    torch.save(vit_sd(learned=True), path)
    msg = refusal(path, dry_run=True, **PLAIN)
    assert "learned" in msg and "--set-pe" in msg
    assert apply_checkpoint(path, dry_run=True, set_pe="sincos", **PLAIN)["pos_embed_kind"] == "other"


def test_the_log_names_each_stage_and_each_copy_of_the_model(tmp_path):
    path = tmp_path / "ema.pth"
    torch.save({"state_dict": vit_sd(), "state_dict_ema": vit_sd()}, path)
    said = []
    rep = apply_checkpoint(path, log=said.append, **PLAIN)
    out = path.with_name("ema.impulse.pth")
    assert said == ["solving", "writing state_dict (1/2)", "writing state_dict_ema (2/2)", f"writing {out}"]
    said.clear()
    apply_checkpoint(path, out=tmp_path / "again.pth", artifact=rep["artifact"]["path"], log=said.append, **PLAIN)
    assert said == ["reading the artifact", "writing state_dict (1/2)", "writing state_dict_ema (2/2)",
                    f"writing {tmp_path / 'again.pth'}"]
    said.clear()
    apply_checkpoint(path, out=tmp_path / "m.pth", spec="mimetic", heads=HEADS, log=said.append)
    assert said[0] == "writing state_dict (1/2)"  # nothing to solve
    said.clear()
    apply_checkpoint(src_of_one(tmp_path), log=said.append, **PLAIN)
    assert said == ["solving", "writing model", f"writing {tmp_path / 'one.impulse.pth'}"]  # one copy: no count


def src_of_one(tmp_path):
    path = tmp_path / "one.pth"
    torch.save({"model": vit_sd()}, path)
    return path


def test_progress_follows_the_solve_then_each_copys_layers(tmp_path):
    path = tmp_path / "ema.pth"
    torch.save({"state_dict": vit_sd(), "state_dict_ema": vit_sd()}, path)
    events = []
    apply_checkpoint(path, log=events.append, progress=lambda done, total: events.append((done, total)), **PLAIN)
    first, second = events.index("writing state_dict (1/2)"), events.index("writing state_dict_ema (2/2)")
    solve = events[1:first]
    assert events[0] == "solving" and len(solve) > 2 and all(isinstance(e, tuple) for e in solve)
    total = solve[-1][1]
    assert solve[-1] == (total, total) and {t for _, t in solve} == {total}
    assert events[first + 1:second] == [(1, 2), (2, 2)] and events[second + 1:-1] == [(1, 2), (2, 2)]


def test_a_copy_of_the_model_gets_the_first_copys_weights_whatever_its_embedding(tmp_path):
    """An EMA copy lags the model: its position embedding need not be the sin-cos table the first
    copy was checked against, and it is not checked again; it gets the same Q/K."""
    ema = vit_sd()
    ema["pos_embed"] = ema["pos_embed"] + 0.05 * torch.randn_like(ema["pos_embed"])
    path = tmp_path / "ema.pth"
    torch.save({"state_dict": vit_sd(), "state_dict_ema": ema}, path)
    rep = apply_checkpoint(path, **PLAIN)
    out = torch.load(rep["output"], weights_only=True)
    for layer in range(2):
        key = f"blocks.{layer}.attn.qkv.weight"
        assert torch.equal(out["state_dict"][key][:2 * DIM], out["state_dict_ema"][key][:2 * DIM])
        assert not torch.equal(out["state_dict"][key][:2 * DIM], vit_sd()[key][:2 * DIM])
    assert torch.equal(out["state_dict_ema"]["pos_embed"], ema["pos_embed"])


def test_the_seed_reaches_a_random_init(tmp_path):
    path = src_of_one(tmp_path)
    written = {}
    for seed, name in ((1, "a.pth"), (1, "b.pth"), (2, "c.pth")):
        rep = apply_checkpoint(path, spec="trunc-normal", heads=HEADS, seed=seed, out=tmp_path / name)
        assert rep["seed"] == seed
        written[name] = torch.load(tmp_path / name, weights_only=True)["model"]["blocks.0.attn.qkv.weight"]
    assert torch.equal(written["a.pth"], written["b.pth"]) and not torch.equal(written["a.pth"], written["c.pth"])


def test_a_grid_given_for_a_file_that_has_none_is_the_plans(tmp_path):
    mha = tmp_path / "mha.pt"
    torch.save(torch.nn.MultiheadAttention(DIM, HEADS).state_dict(), mha)
    plan = apply_checkpoint(mha, grid=(4, 4), dry_run=True, **PLAIN)
    assert plan["grid"] == [4, 4] and plan["pos_embed"] is None and plan["pos_embed_kind"] is None


def test_output_names_that_are_refused(src, tmp_path):
    (tmp_path / "folder").mkdir()
    folder = tmp_path / "folder"
    assert says(refusal(src, out=folder, **PLAIN), f"--out {folder}", "is a folder", "file name")
    assert says(refusal(src, out=src, **PLAIN), f"--out {src}", "is the input file", "--in-place")
    os.link(src, tmp_path / "hard.pth")  # the same file under another name
    assert says(refusal(src, out=tmp_path / "hard.pth", force=True, **PLAIN), f"--out {tmp_path / 'hard.pth'}",
                "is the input file", "--in-place")
    missing = tmp_path / "no" / "x.pth"
    assert says(refusal(src, out=missing, **PLAIN), f"--out {missing}", f"folder {missing.parent}", "does not exist")
    apply_checkpoint(src, **PLAIN)
    default = src.with_name("vit.impulse.pth")
    assert says(refusal(src, **PLAIN), str(default), "already exists", "default output name", "--out", "--force")
    assert says(refusal(src, out=default, **PLAIN), str(default), "already exists", "--force")
    assert "default output name" not in refusal(src, out=default, **PLAIN)  # it was named: not the default
    os.mkfifo(tmp_path / "pipe.pth")
    assert says(refusal(src, out=tmp_path / "pipe.pth", force=True, **PLAIN), f"--out {tmp_path / 'pipe.pth'}",
                "not a regular file")
    # an input that is missing is refused as missing, whatever the output
    gone = tmp_path / "gone.pth"
    assert says(refusal(gone, out=default, force=True, **PLAIN), str(gone), "no such file")
    assert "--out" not in refusal(gone, out=default, force=True, **PLAIN)


@pytest.mark.parametrize("scale", [0, -1.0, float("inf"), float("nan"), True, "2"])
def test_bad_pe_scales_are_refused_by_name(src, scale):
    assert says(refusal(src, set_pe="sincos", pe_scale=scale, **PLAIN), "--pe-scale", "positive finite",
                f"got {scale!r}")


def test_position_embedding_settings_that_are_refused(src, tmp_path):
    assert says(refusal(src, set_pe="learned", **PLAIN), "--set-pe", "sincos", "'learned'")
    assert says(refusal(src, pe_scale=2.0, **PLAIN), "--pe-scale", "--set-pe")
    mha = tmp_path / "mha.pt"
    torch.save(torch.nn.MultiheadAttention(DIM, HEADS).state_dict(), mha)
    assert says(refusal(mha, set_pe="sincos", grid=(4, 4), **PLAIN), "--set-pe", "torch-mha", "no position embedding")
    said = []
    with_extra = refusal(src, out=tmp_path / "v.safetensors", log=said.append, **PLAIN)
    assert said == []  # refused before any work
    assert says(with_extra, str(tmp_path / "v.safetensors"), ".safetensors", "also holds model, epoch", ".pt/.pth")
    assert not (tmp_path / "v.safetensors").exists()


def test_a_method_that_needs_no_grid_applies_where_the_file_cannot_tell_it(tmp_path):
    path = tmp_path / "odd.pth"
    torch.save(vit_sd(rows=10), path)  # 10 rows: no square grid
    rep = apply_checkpoint(path, spec="mimetic", heads=HEADS)
    assert rep["written"] and rep["grid"] is None and [r["layer"] for r in rep["layers"]] == [0, 1]
    assert says(refusal(path, spec="mimetic", heads=HEADS, set_pe="sincos", out=tmp_path / "s.pth"), "timm-vit",
                "token grid", "10 rows", "not a square grid", "--grid")


def test_an_output_another_writer_creates_meanwhile_is_not_replaced(src, tmp_path):
    out = tmp_path / "race.pth"

    def other_writer(message):
        if message == f"writing {out}":
            out.write_bytes(b"theirs")

    msg = refusal(src, out=out, log=other_writer, **PLAIN)
    assert msg == f"{out} appeared while this was being written (another process?); it was not replaced, and nothing " \
                  "was written"
    assert out.read_bytes() == b"theirs"
    apply_checkpoint(src, out=out, force=True, **PLAIN)  # asked to replace: replaced
    assert out.read_bytes() != b"theirs"


def test_an_input_that_changes_in_place_is_not_replaced(src, tmp_path):
    def editor(message):
        if message == "solving":
            torch.save({"model": vit_sd(), "epoch": 4}, src)  # someone saves over it meanwhile

    msg = refusal(src, in_place=True, log=editor, **PLAIN)
    assert msg == f"{src} changed while it was being initialized (another process?); it was not replaced"
    assert torch.load(src, weights_only=True)["epoch"] == 4
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["vit.pth"]  # no backup either


def test_a_backup_that_cannot_be_kept_stops_the_in_place_write(src, tmp_path, monkeypatch):
    import structinit.atomic

    def no_space(path):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(structinit.atomic, "claim_backup", no_space)
    before = digest(src)
    msg = refusal(src, in_place=True, **PLAIN)
    assert msg == f"cannot keep a backup of {src}: No space left on device; the input was not replaced"
    assert digest(src) == before and sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["vit.pth"]


def test_in_place_reports_its_backup(src):
    before = digest(src)
    rep = apply_checkpoint(src, in_place=True, **PLAIN)
    assert rep["in_place"] and rep["output"] == str(src.resolve()) and rep["backup"] == str(src) + ".bak"
    assert digest(rep["backup"]) == before and digest(src) != before


def test_a_method_other_than_impulse_is_measured_on_the_written_file(tmp_path):
    path = src_of_one(tmp_path)
    rep = apply_checkpoint(path, spec="mimetic", heads=HEADS)
    assert rep["measured_on"] == "pos_embed (sincos), LayerNorm'd"
    assert all(0 <= r["hit_rate"] <= 1 and "offsets" in r and "target_mass" in r for r in rep["layers"])
    mha = tmp_path / "mha.pt"
    torch.save(torch.nn.MultiheadAttention(DIM, HEADS).state_dict(), mha)
    given = apply_checkpoint(mha, spec="mimetic", heads=HEADS, grid=(4, 4))  # the grid only the caller knows
    assert given["measured_on"] == "the LayerNorm'd sin-cos table (no position embedding)"
    assert [r["layer"] for r in given["layers"]] == [0] and "hit_rate" in given["layers"][0]


def test_the_report_says_what_the_embedding_is_after_the_write(tmp_path):
    path = tmp_path / "learned.pth"
    torch.save(vit_sd(learned=True), path)
    rep = apply_checkpoint(path, set_pe="sincos", **PLAIN)
    assert rep["pos_embed_kind"] == "sincos" and rep["pos_embed_replaced"] == "pos_embed"
    assert apply_checkpoint(path, spec="mimetic", heads=HEADS, out=tmp_path / "m.pth")["pos_embed_kind"] == "other"


def test_an_impulse_reports_its_solved_offsets_even_where_the_solve_missed_them(tmp_path):
    """Five iterations of the paper's recipe leave the heads short of their offsets: the report
    keeps each head's solved offset and its (low) hit rate there, not the offset the head happens
    to follow most, which is what describing the file finds."""
    from structinit.init.checkpoints import describe_checkpoint
    from structinit.solver.artifact import read_artifact

    rep = apply_checkpoint(src_of_one(tmp_path), recipe="paper", recipe_params={"iters": 5}, **PLAIN)
    solved = read_artifact(Path(rep["artifact"]["path"])).offsets.tolist()
    assert [r["offsets"] for r in rep["layers"]] == solved
    assert max(r["hit_rate"] for r in rep["layers"]) < 0.5
    found = describe_checkpoint(rep["output"], heads=HEADS)["layers"]
    assert [r["offsets"] for r in found] != solved and min(r["hit_rate"] for r in found) > 0.2


def test_the_grid_a_structinit_checkpoint_tells_reaches_every_method(tmp_path):
    """A 1-D sequence of 40 tokens in a timm-vit layout: the weights alone cannot tell the grid
    (40 rows are no square); the ``shape`` entry structinit train writes does, for every method."""
    sd = vit_sd(rows=40)
    path = tmp_path / "seq.pt"
    torch.save({"state_dict": sd, "shape": {"grid": [40], "heads": HEADS}}, path)
    for spec in ("mimetic", "impulse"):
        plan = apply_checkpoint(path, spec=spec, dry_run=True, set_pe="sincos", data_fit=0) if spec == "impulse" \
            else apply_checkpoint(path, spec=spec, dry_run=True)
        assert (plan["grid"], plan["heads"], plan["hints"]["shape"]) == ([40], HEADS, {"grid": [40], "heads": HEADS})
    # A grid the caller gives wins over the file's (the same 40 tokens, read as an image grid).
    assert apply_checkpoint(path, spec="mimetic", grid=(5, 8), dry_run=True)["grid"] == [5, 8]
    bare = tmp_path / "bare.pt"
    torch.save({"state_dict": sd}, bare)
    assert apply_checkpoint(bare, spec="mimetic", heads=HEADS, dry_run=True)["grid"] is None
