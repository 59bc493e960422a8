"""Reading and writing checkpoint files, message by message and field by field: what an unknown
layout's refusal lists, the hints a Hugging Face config.json gives, what describe_checkpoint
reports (a decoder measured under its causal mask), and the safetensors writes: refusals,
exclusive creation and permission bits."""

import json
import os
import stat

import pytest
import torch

from structinit.errors import UsageError
from structinit.init.checkpoints import (
    Checkpoint,
    CheckpointError,
    _first_line,
    describe_checkpoint,
    load_checkpoint,
    safetensors_dict,
    save_checkpoint,
)

D = 8


def failure(fn, *args, **kwargs) -> str:
    with pytest.raises(CheckpointError) as e:
        fn(*args, **kwargs)
    return str(e.value)


def test_an_unknown_layout_lists_the_keys_it_saw(tmp_path):
    path = tmp_path / "x.pt"
    head = "unknown checkpoint layout (no timm, Hugging Face ViT/BERT/GPT-2 or nn.MultiheadAttention attention " \
           "weights); keys seen: "
    cases = [
        ({"model": {f"w{i}": torch.zeros(1) for i in range(14)}, "epoch": 3},
         "model: {w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, ...}, epoch"),
        ({"model": {f"w{i}": torch.zeros(1) for i in range(12)}}, "model: {w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, "
                                                                  "w10, w11}"),
        ({"optimizer": {"a": 1}, "step": 2}, "optimizer, step"),  # not a container of weights: not opened
        ({f"k{i}": i for i in range(12)}, ", ".join(f"k{i}" for i in range(12)) + ", ..."),
        ({f"k{i}": i for i in range(11)}, ", ".join(f"k{i}" for i in range(11))),
        ({}, "(empty)"),
        ([torch.zeros(2)], "a list, not a dict"),
    ]
    for obj, seen in cases:
        torch.save(obj, path)
        assert failure(load_checkpoint, path) == f"{path}: {head}{seen}"


def test_an_error_is_reported_by_its_first_line():
    assert _first_line(ValueError("\n  bad header\nat byte 8\n")) == "bad header"
    assert _first_line(ValueError("x" * 300)) == "x" * 200
    assert _first_line(KeyError()) == "KeyError"


def hf_vit_files(folder, config):
    """A one-layer Hugging Face ViT state dict (zeros, dim 8) saved as model.safetensors, with
    ``config`` as the config.json beside it (none when ``None``)."""
    import safetensors.torch

    pre = "encoder.layer.0.attention."
    sd = {pre + f"attention.{n}.{w}": torch.zeros(D, D) if w == "weight" else torch.zeros(D)
          for n in ("query", "key", "value") for w in ("weight", "bias")}
    sd[pre + "output.dense.weight"] = torch.zeros(D, D)
    sd["embeddings.position_embeddings"] = torch.zeros(1, 17, D)
    sd["embeddings.cls_token"] = torch.zeros(1, 1, D)
    folder.mkdir()
    safetensors.torch.save_file(sd, str(folder / "model.safetensors"))
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder / "model.safetensors"


@pytest.mark.parametrize("config, heads", [
    ({"num_attention_heads": 2, "hidden_size": D}, 2),
    ({"n_head": 4, "n_embd": D}, 4),                      # GPT-2's names
    ({"num_attention_heads": 2, "hidden_size": 2 * D}, None),  # another model's config: no hint
    ({"num_attention_heads": "2", "hidden_size": D}, None),
    ([2, D], None),
    (None, None),
])
def test_a_config_json_beside_the_weights_tells_the_heads(tmp_path, config, heads):
    path = hf_vit_files(tmp_path / "vit", config)
    ckpt = load_checkpoint(path)
    assert ckpt.detected.heads == heads
    assert ckpt.extra == ({"config.json": str(path.parent / "config.json")} if heads else {})


def test_describe_checkpoint_reports_the_file_and_the_given_shape(tmp_path):
    mha = tmp_path / "mha.pt"
    torch.save({"state_dict": torch.nn.MultiheadAttention(D, 2).state_dict()}, mha)
    desc = describe_checkpoint(mha, heads=2, grid=(3, 3))
    assert (desc["path"], desc["format"], desc["state_dicts"], desc["hints"]) == (str(mha), "torch",
                                                                                  ["state_dict"], {})
    assert (desc["grid"], desc["tokens"], desc["heads"], desc["layout"]) == ([3, 3], 9, 2, "torch-mha")
    assert desc["measured_on"] == "the LayerNorm'd sin-cos table (no position embedding)"
    vit = hf_vit_files(tmp_path / "vit", {"num_attention_heads": 2, "hidden_size": D})
    told = describe_checkpoint(vit)
    assert (told["format"], told["state_dicts"], told["hints"]) == ("safetensors", ["(top level)"],
                                                                    {"config.json": str(vit.parent / "config.json")})


def gpt2_sd(positions=12):
    from structinit.geometry.embedding import sincos_1d

    torch.manual_seed(0)
    return {"h.0.attn.c_attn.weight": 0.3 * torch.randn(D, 3 * D), "h.0.attn.c_attn.bias": torch.zeros(3 * D),
            "h.0.attn.c_proj.weight": torch.zeros(D, D), "wpe.weight": torch.from_numpy(sincos_1d(positions, D))}


def test_a_decoder_is_described_under_its_causal_mask(tmp_path):
    """Described through its causal mask, a GPT-2 head's attention never looks ahead: its closest
    offsets are in the past and its measured mass is what the impulse init wrote on that mask."""
    from structinit.apply.checkpoint import apply_checkpoint

    src = tmp_path / "gpt2.pt"
    torch.save(gpt2_sd(), src)
    rep = apply_checkpoint(src, heads=2, data_fit=0, target_mass=0.4, causal=True)
    desc = describe_checkpoint(rep["output"], heads=2)
    row = desc["layers"][0]
    # A sequence's offsets are (0, dx): dx <= 0 is the past.
    assert row["offsets"] == rep["layers"][0]["offsets"] and all(o[0] == 0 and o[1] <= 0 for o in row["offsets"])
    wrote = rep["layers"][0]
    assert row["hit_rate"] == pytest.approx(wrote["hit_rate"]) and row["hit_rate"] > 0.9
    assert row["target_mass"] == pytest.approx(wrote["target_mass"]) == pytest.approx(0.4, abs=0.01)
    plain = describe_checkpoint(src, heads=2)["layers"][0]
    # Even random weights: only the past is visible (unmasked, their second head's argmax key is 5 ahead).
    assert plain["offsets"] == [[0, 0], [0, -1]]


def test_q_and_k_norms_are_the_weights(tmp_path):
    sd = gpt2_sd()
    src = tmp_path / "a.pt"
    torch.save(sd, src)
    before = describe_checkpoint(src, heads=2)["layers"][0]
    sd["h.0.attn.c_attn.weight"][:, :D] *= 2  # the q block (Conv1D [in, out]: columns 0:D)
    torch.save(sd, src)
    after = describe_checkpoint(src, heads=2)["layers"][0]
    assert after["q_norm"] == pytest.approx(2 * before["q_norm"], rel=1e-5)
    assert after["k_norm"] == pytest.approx(before["k_norm"], rel=1e-6)


def ckpt_of(obj, fmt="torch", path="in.pt"):
    return Checkpoint(path=path, format=fmt, obj=obj, state_dicts=[], detected=None, metadata=None)


def test_what_a_safetensors_file_cannot_hold_is_named(tmp_path):
    out = tmp_path / "o.safetensors"
    entries = lambda n: {**{f"e{i}": i for i in range(n)}, "w": torch.zeros(1)}  # noqa: E731
    tail = "; choose a .pt/.pth output name (or extract the state dict first)"
    head = f"{out}: a .safetensors file holds a flat map of tensors, and this checkpoint also holds "
    assert str(pytest.raises(UsageError, safetensors_dict, ckpt_of(entries(6)), out).value) == (
        head + "e0, e1, e2, e3, e4, e5" + tail)
    assert str(pytest.raises(UsageError, safetensors_dict, ckpt_of(entries(7)), out).value) == (
        head + "e0, e1, e2, e3, e4, e5 ..." + tail)
    assert str(pytest.raises(UsageError, safetensors_dict, ckpt_of([torch.zeros(1)]), out).value) == (
        f"{out}: a .safetensors file holds a flat map of tensors; the checkpoint is a list. Choose a .pt/.pth "
        "output name")
    assert str(pytest.raises(UsageError, save_checkpoint, ckpt_of(entries(1)), out).value) == (
        head + "e0" + tail)
    assert not out.exists()


def test_a_safetensors_write_is_exclusive_when_asked_and_keeps_the_mode(tmp_path):
    out = tmp_path / "o.safetensors"
    ckpt = ckpt_of({"w": torch.ones(2)})
    save_checkpoint(ckpt, out, file_mode=0o640)
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o640
    before = out.read_bytes()
    assert failure(save_checkpoint, ckpt_of({"w": torch.zeros(2)}), out, exclusive=True) == (
        f"{out} appeared while this was being written (another process?); it was not replaced, and nothing was "
        "written")
    assert out.read_bytes() == before
    save_checkpoint(ckpt_of({"w": torch.zeros(2)}), out)  # not exclusive: replaced
    assert out.read_bytes() != before


def test_given_offsets_are_the_ones_measured(tmp_path):
    """describe_state_dict measures against ``offsets`` when given, not against the ones the heads
    follow most."""
    import numpy as np

    from structinit.init.checkpoints import describe_state_dict

    src = tmp_path / "gpt2.pt"
    torch.save(gpt2_sd(), src)
    ckpt = load_checkpoint(src)
    sd, det = ckpt.state_dicts[0][1], ckpt.detected
    closest = describe_state_dict(sd, det, heads=2)["layers"][0]
    assert closest["offsets"] == [[0, 0], [0, -1]]
    given = describe_state_dict(sd, det, heads=2, offsets=np.array([[[0, -3], [0, -3]]]))["layers"][0]
    assert given["offsets"] == [[0, -3], [0, -3]]
    assert given["hit_rate"] < closest["hit_rate"]  # the heads do not follow -3 most


def timm_training_checkpoint(path, **entries):
    """A one-block vit_tiny_patch16_224 state dict (zeros; dim 192, 3 heads in timm's registry)
    saved under ``state_dict`` with ``entries`` beside it."""
    torch.save({"state_dict": timm_training_checkpoint_sd(), **entries}, path)
    return path


def test_the_timm_arch_hint_is_taken_past_an_unusable_shape_entry(tmp_path):
    arch = "vit_tiny_patch16_224"
    for shape in ({"grid": "bogus", "heads": 4}, {"grid": [3, 3], "heads": 4}, ["not", "a", "map"]):
        ckpt = load_checkpoint(timm_training_checkpoint(tmp_path / "t.pth", arch=arch, shape=shape))
        assert (ckpt.detected.heads, ckpt.extra) == (3, {"arch": arch}), shape
    fits = {"grid": [14, 14], "heads": 4}
    ckpt = load_checkpoint(timm_training_checkpoint(tmp_path / "t.pth", arch=arch, shape=fits))
    assert (ckpt.detected.heads, ckpt.extra) == (4, {"shape": {"grid": [14, 14], "heads": 4}})  # it fits: it wins


def test_a_timm_arch_is_no_hint_for_another_layout(tmp_path):
    """An ``arch`` entry names a timm model: beside nn.MultiheadAttention weights of the same width
    it tells nothing about their heads."""
    src = tmp_path / "mha.pt"
    torch.save({"state_dict": torch.nn.MultiheadAttention(192, 4).state_dict(), "arch": "vit_tiny_patch16_224"}, src)
    ckpt = load_checkpoint(src)
    assert (ckpt.detected.layout.name, ckpt.detected.dim, ckpt.detected.heads, ckpt.extra) == ("torch-mha", 192,
                                                                                                None, {})


def structinit_checkpoint(path, sd, shape):
    torch.save({"state_dict": sd, "epoch": 1, "shape": shape}, path)
    return load_checkpoint(path)


def test_a_structinit_shape_entry_is_taken_only_where_it_fits_the_weights(tmp_path):
    """The ``shape`` entry of a ``structinit train`` checkpoint gives grid and heads unless its grid
    disagrees with the rows of the position embedding (prefix tokens not counted); a heads count
    that does not divide the width is left out."""
    from structinit.geometry.grid import Grid

    path = tmp_path / "run.pt"
    vit = timm_training_checkpoint_sd()  # 197 rows: a class token and 14x14
    for shape, grid, heads in (({"grid": [14, 14], "heads": 4}, (14, 14), 4),
                               ({"grid": [7, 28], "heads": 1}, (7, 28), 1),    # the same 196 tokens
                               ({"grid": [14, 14], "heads": 5}, (14, 14), None),  # 5 does not divide 192
                               ({"grid": [14, 14], "heads": 0}, (14, 14), None),
                               ({"grid": [14, 14], "heads": "4"}, (14, 14), None),
                               ({"grid": [14, 14]}, (14, 14), None)):
        ckpt = structinit_checkpoint(path, vit, shape)
        assert (ckpt.detected.grid, ckpt.detected.heads) == (Grid(grid), heads), shape
        assert ckpt.extra == {"shape": {"grid": list(grid), "heads": heads}}
    for grid in ([14, 15], [197], [13, 13]):  # 197 would count the class token as a position
        ckpt = structinit_checkpoint(path, vit, {"grid": grid, "heads": 4})
        assert (ckpt.detected.grid, ckpt.detected.heads, ckpt.extra) == (Grid((14, 14)), None, {}), grid

    gpt2 = gpt2_sd(positions=12)  # a [12, D] table, no prefix tokens
    assert structinit_checkpoint(path, gpt2, {"grid": [12], "heads": 2}).extra == {"shape": {"grid": [12], "heads": 2}}
    assert structinit_checkpoint(path, gpt2, {"grid": [11], "heads": 2}).extra == {}
    mha = torch.nn.MultiheadAttention(D, 2).state_dict()  # no position embedding: nothing to disagree with
    ckpt = structinit_checkpoint(path, mha, {"grid": [3, 3], "heads": 2})
    assert (ckpt.detected.grid, ckpt.detected.heads) == (Grid((3, 3)), 2)
    for odd in (torch.zeros(192), 7):  # a position entry with no rows to count: the entry is taken
        ckpt = structinit_checkpoint(path, {**vit, "pos_embed": odd}, {"grid": [5, 5], "heads": 4})
        assert (ckpt.detected.grid, ckpt.detected.heads) == (Grid((5, 5)), 4)


def timm_training_checkpoint_sd():
    """vit_tiny_patch16_224's first block and embeddings, all zeros."""
    import timm

    with torch.device("meta"):
        shapes = {k: v.shape for k, v in timm.create_model("vit_tiny_patch16_224").state_dict().items()}
    return {k: torch.zeros(s) for k, s in shapes.items() if not k.startswith("blocks.") or k.startswith("blocks.0.")}


def test_what_a_file_is_told_by_its_first_bytes(tmp_path):
    from structinit.init.checkpoints import sniff_format

    path = tmp_path / "f"
    torch.save({"w": torch.ones(1)}, path)
    assert sniff_format(path) == "torch"
    torch.save({"w": torch.ones(1)}, path, _use_new_zipfile_serialization=False)  # the legacy pickle format
    assert sniff_format(path) == "torch" and load_checkpoint_obj(path) == {"w": torch.ones(1)}
    for length, told in ((1, None), (2, "safetensors"), (100_000_000, "safetensors"), (100_000_001, None)):
        path.write_bytes(length.to_bytes(8, "little") + b'{"__metadata__": {}}')
        assert sniff_format(path) == told, length
    path.write_bytes((16).to_bytes(8, "little") + b"[1, 2, 3, 4, 5, 6, 7]")  # a length, then no JSON object
    assert sniff_format(path) is None
    path.write_bytes(b"\x02\x00\x00")
    assert sniff_format(path) is None


def load_checkpoint_obj(path):
    from structinit.init.checkpoints import read_object

    obj, fmt, meta = read_object(path)
    assert (fmt, meta) == ("torch", None)
    return {k: v for k, v in obj.items()}


def test_an_unreadable_file_is_one_line_that_says_why(tmp_path):
    import socket

    from structinit.init.checkpoints import read_object

    def why(path):
        return failure(read_object, path)

    assert why(tmp_path) == f"{tmp_path}: is a folder; give the checkpoint file inside it"
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    assert why(empty) == f"{empty}: not a checkpoint (neither a torch.save file nor safetensors; the file is empty)"
    text = tmp_path / "notes.pt"
    text.write_text("not weights")
    assert why(text) == f"{text}: not a checkpoint (neither a torch.save file nor safetensors)"
    sock = tmp_path / "s.pt"  # exists, is no folder, and cannot be opened
    server = socket.socket(socket.AF_UNIX)
    try:
        server.bind(str(sock))
        assert why(sock) == f"{sock}: a socket, not a regular file"
    finally:
        server.close()
    garbage = tmp_path / "g.pt"
    garbage.write_bytes(b"\x80\x02\xff\xff")  # a pickle's first byte, then none
    assert why(garbage) == f"{garbage}: not a readable checkpoint (not a torch or safetensors file, or truncated)"
    st = tmp_path / "cut.safetensors"
    import safetensors.torch

    safetensors.torch.save_file({"w": torch.ones(64)}, str(st))
    st.write_bytes(st.read_bytes()[:-100])
    told = why(st)
    assert told.startswith(f"{st}: not a readable safetensors file (truncated or corrupt: ") and told.endswith(")")
    assert len(told) > len(f"{st}: not a readable safetensors file (truncated or corrupt: )") + 10  # the reason


def test_a_pickle_that_asks_for_code_is_refused_whatever_the_environment_says(tmp_path, monkeypatch):
    import pathlib

    path = tmp_path / "train.pth"  # a training script that kept its output folder as a Path
    torch.save({"state_dict": torch.nn.MultiheadAttention(D, 2).state_dict(), "out": pathlib.PosixPath("runs/a")},
               path)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    assert failure(load_checkpoint, path) == (
        f"{path}: refusing to load a pickle that asks to run code: it asks for pathlib.PosixPath (only tensors and "
        "plain containers are loaded; nothing of it was run). Re-save it as a plain state dict (or .safetensors) "
        "from a trusted environment")
    class Call:
        def __reduce__(self):
            return os.system, ("true",)  # harmless, were it ever run

    torch.save({"state_dict": torch.nn.MultiheadAttention(D, 2).state_dict(), "hook": Call()}, path)
    assert failure(load_checkpoint, path).startswith(f"{path}: refusing to load a pickle that asks to run code: it "
                                                     "asks for posix.system (only tensors")
    import pickle

    from structinit.init.checkpoints import read_object

    plain = tmp_path / "plain.pkl"  # protocol 4: torch's reader stops at an opcode it does not take, before the code
    plain.write_bytes(pickle.dumps({"a": 1, "hook": Call()}, protocol=4))
    assert failure(read_object, plain).startswith(f"{plain}: refusing to load a pickle that asks to run code: it "
                                                  "asks for posix.system (only tensors")


def saved_on_a_gpu(src, dst):
    """``src`` (a torch.save zip) as a GPU would have saved it: every storage's location ``cuda:0``."""
    import zipfile

    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for name in zin.namelist():
            data = zin.read(name)
            if name.endswith("/data.pkl"):
                assert b"X\x03\x00\x00\x00cpu" in data
                data = data.replace(b"X\x03\x00\x00\x00cpu", b"X\x06\x00\x00\x00cuda:0")
            zout.writestr(name, data)
    return dst


@pytest.mark.skipif(torch.cuda.is_available(), reason="shows what a machine without a GPU does")
def test_a_checkpoint_saved_on_a_gpu_opens_on_a_machine_without_one(tmp_path):
    from structinit.apply.checkpoint import apply_checkpoint

    plain = tmp_path / "plain.pt"
    torch.save({"state_dict": gpt2_sd()}, plain)
    src = saved_on_a_gpu(plain, tmp_path / "gpu.pt")
    with pytest.raises(RuntimeError, match="deserialize object on a CUDA device"):
        torch.load(src, weights_only=True)  # what torch alone does here
    ckpt = load_checkpoint(src)
    assert ckpt.state_dicts[0][1]["wpe.weight"].device.type == "cpu"
    assert torch.equal(ckpt.state_dicts[0][1]["wpe.weight"], gpt2_sd()["wpe.weight"])
    rep = apply_checkpoint(src, heads=2, data_fit=0, causal=True)
    assert rep["layers"][0]["hit_rate"] > 0.9
    assert torch.load(rep["output"], weights_only=True)["state_dict"]["wpe.weight"].device.type == "cpu"


def test_a_checkpoint_cut_short_says_so(tmp_path):
    path = tmp_path / "cut.pt"
    torch.save({"state_dict": gpt2_sd()}, path)
    whole = path.read_bytes()
    torch.save({"epoch": 1}, path, _use_new_zipfile_serialization=False)
    legacy = path.read_bytes()
    for cut in (whole[:1000], whole[:10], legacy[:len(legacy) // 2], b"\x80\x02abc", b"\x80\x02\xff\xff"):
        path.write_bytes(cut)
        assert failure(load_checkpoint, path) == (f"{path}: not a readable checkpoint (not a torch or safetensors "
                                                  "file, or truncated)"), cut
    path.write_bytes(legacy[:40] + b"\xff" * 20)  # a legacy pickle whose strings are not text: the reader's reason
    assert failure(load_checkpoint, path) == (f"{path}: not a readable checkpoint (truncated or corrupt: 'utf-8' "
                                              "codec can't decode byte 0xff in position 8: invalid start byte)")


def test_state_dicts_in_one_file_must_agree(tmp_path):
    path = tmp_path / "two.pt"
    torch.save({"state_dict": torch.nn.MultiheadAttention(D, 2).state_dict(),
                "state_dict_ema": torch.nn.MultiheadAttention(2 * D, 2).state_dict()}, path)
    assert failure(load_checkpoint, path) == (f"{path}: the state dicts in the file disagree (state_dict_ema is a "
                                              f"torch-mha of dim {2 * D}, depth 1)")


def test_the_pickle_outline_says_why_a_file_cannot_be_read(tmp_path):
    """pickle_outline (read without torch, running nothing) names the reason in one line: a folder
    cannot be read, a pickle naming code is refused with the global it names, a pickle cut short
    says what the unpickler raised; a plain pickle is read. check_checkpoint_path refuses a missing
    path and a folder and gives the file back as a Path."""
    from structinit.init.checkpoints import CheckpointNotFound, check_checkpoint_path, pickle_outline

    assert failure(pickle_outline, tmp_path) == f"{tmp_path}: a folder, not a regular file"
    (tmp_path / "code.pkl").write_bytes(b"\x80\x02cbuiltins\neval\nq\x00.")
    assert failure(pickle_outline, tmp_path / "code.pkl") == (
        f"{tmp_path / 'code.pkl'} was refused: unpickling it would run code (builtins.eval); nothing of it was run")
    (tmp_path / "cut.pkl").write_bytes(b"\x80\x02}q\x00(X\x01\x00\x00\x00a")
    assert failure(pickle_outline, tmp_path / "cut.pkl") == (
        f"{tmp_path / 'cut.pkl'} is not a readable checkpoint (EOFError: Ran out of input)")
    (tmp_path / "plain.pkl").write_bytes(b"\x80\x02}q\x00X\x01\x00\x00\x00aK\x01s.")
    assert pickle_outline(str(tmp_path / "plain.pkl")) == {"a": 1}

    with pytest.raises(CheckpointNotFound, match=r"nothere\.pt: no such file$"):
        check_checkpoint_path(tmp_path / "nothere.pt")
    with pytest.raises(CheckpointNotFound, match="is a folder; give the checkpoint file inside it"):
        check_checkpoint_path(str(tmp_path))
    found = check_checkpoint_path(str(tmp_path / "plain.pkl"))
    assert isinstance(found, type(tmp_path)) and found == tmp_path / "plain.pkl"


def test_the_refusal_line_names_the_code_only_when_known():
    from structinit.init.checkpoints import refused_for_code

    tail = ("(only tensors and plain containers are loaded; nothing of it was run). Re-save it as a plain state "
            "dict (or .safetensors) from a trusted environment")
    assert refused_for_code("m.pt", None) == f"m.pt: refusing to load a pickle that asks to run code {tail}"
    assert refused_for_code("m.pt", "os.system") == (
        f"m.pt: refusing to load a pickle that asks to run code: it asks for os.system {tail}")


def test_a_zip_that_is_no_whole_torch_save_file_is_one_line(tmp_path):
    """The zip side of the outline: a data.pkl at the top or in a folder is read; a zip without one,
    a file that is neither pickle nor zip, and a compressed member whose data is corrupt (zlib's
    error, which escaped as a traceback from a run folder's integrity check) each say so."""
    import pickle
    import zipfile

    from structinit.init.checkpoints import pickle_outline
    from structinit.training.rundir import checkpoint_info

    with zipfile.ZipFile(tmp_path / "top.pt", "w") as zf:
        zf.writestr("data.pkl", pickle.dumps({"epoch": 3}, protocol=2))
    assert pickle_outline(tmp_path / "top.pt") == {"epoch": 3}
    with zipfile.ZipFile(tmp_path / "notes.pt", "w") as zf:
        zf.writestr("notes.txt", "not a checkpoint")
    assert failure(pickle_outline, tmp_path / "notes.pt") == (
        f"{tmp_path / 'notes.pt'} is not a torch.save file (it holds no data.pkl)")
    (tmp_path / "text.pt").write_text("hello")
    assert failure(pickle_outline, tmp_path / "text.pt") == (
        f"{tmp_path / 'text.pt'} is not a whole torch.save file (truncated or corrupt)")
    with zipfile.ZipFile(tmp_path / "deflated.pt", "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("run/data.pkl", pickle.dumps({"epoch": list(range(2000))}, protocol=2))
    raw = bytearray((tmp_path / "deflated.pt").read_bytes())
    start = 30 + len("run/data.pkl") + 10  # inside the compressed data of the first member
    raw[start:start + 20] = bytes(b ^ 0xFF for b in raw[start:start + 20])
    (tmp_path / "deflated.pt").write_bytes(bytes(raw))
    why = failure(pickle_outline, tmp_path / "deflated.pt")
    assert why.startswith(f"{tmp_path / 'deflated.pt'} is not a whole torch.save file (Error -3 while decompressing")
    with pytest.raises(CheckpointError, match="is not a whole torch.save file"):
        checkpoint_info(tmp_path / "deflated.pt")
