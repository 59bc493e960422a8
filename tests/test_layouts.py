"""Layout detection on state dicts built key by key: what a position embedding's rows say about the
token grid (and, when they cannot say, why, in the error a user reads), the order of layers past 9,
and every refusal of ``resolve_shape`` compared whole."""

import pytest
import torch
from conftest import says

from structinit.errors import StructinitError, UsageError
from structinit.geometry.grid import Grid
from structinit.init.layouts import detect_layout, resolve_shape

D = 8


def timm_vit(rows=None, cls=False, depth=2, prefix="", pos_shape=None, registers=0):
    """A timm-vit state dict of zeros: ``depth`` fused-qkv blocks, a position embedding
    ``[1, rows, D]`` (or ``pos_shape``), a class token when ``cls``, ``registers`` register tokens."""
    sd = {}
    for i in range(depth):
        sd[f"{prefix}blocks.{i}.attn.qkv.weight"] = torch.zeros(3 * D, D)
        sd[f"{prefix}blocks.{i}.attn.proj.weight"] = torch.zeros(D, D)
    if rows is not None or pos_shape is not None:
        sd[prefix + "pos_embed"] = torch.zeros(pos_shape or (1, rows, D))
    if cls:
        sd[prefix + "cls_token"] = torch.zeros(1, 1, D)
    if registers:
        sd[prefix + "reg_token"] = torch.zeros(1, registers, D)
    return sd


def gpt2(positions):
    """A one-block GPT-2 state dict (Conv1D weights ``[in, out]``) with ``positions`` rows of wpe."""
    return {"h.0.attn.c_attn.weight": torch.zeros(D, 3 * D), "h.0.attn.c_attn.bias": torch.zeros(3 * D),
            "h.0.attn.c_proj.weight": torch.zeros(D, D), "wpe.weight": torch.zeros(positions, D)}


def refusal(fn, *args, **kwargs) -> str:
    with pytest.raises(UsageError) as e:
        fn(*args, **kwargs)
    return e.value.render(lambda n: f"--{n}")


@pytest.mark.parametrize("rows, cls, grid", [
    (16, False, [4, 4]),   # a square grid, no prefix token
    (17, True, [4, 4]),    # 16 + the class token's row
    (21, True, [4, 4]),    # ... + four register tokens' rows (below)
    (1, False, [1, 1]),    # one patch: 1 is a square too
])
def test_a_position_embedding_that_tells_the_grid(rows, cls, grid):
    registers = rows - 17 if rows > 17 else 0
    det = detect_layout(timm_vit(rows, cls, registers=registers))
    assert det.grid == Grid(grid) and det.grid_note is None
    assert det.pos_rows == rows and det.prefix_tokens == int(cls) + registers
    assert resolve_shape(det, heads=2) == (Grid(grid), 2)


@pytest.mark.parametrize("sd, note", [
    (timm_vit(10), "its position embedding has 10 rows, which is not a square grid"),
    (timm_vit(11, cls=True), "its position embedding has 11 rows for 1 prefix token(s) and a grid, which is not "
                             "square"),
    (timm_vit(16, cls=True), "its position embedding has 16 rows and it has 1 prefix token(s): a 4x4 grid whose "
                             "prefix tokens have no position (timm's no_embed_class), or 15 tokens after the prefix "
                             "rows (e.g. a non-square grid)"),
    (timm_vit(1, cls=True), "its position embedding has 1 rows and it has 1 prefix token(s): a 1x1 grid whose prefix "
                            "tokens have no position (timm's no_embed_class), or 0 tokens after the prefix rows (e.g. "
                            "a non-square grid)"),
    (timm_vit(2, cls=True, registers=1), "its position embedding has 2 rows for 2 prefix token(s) and a grid, "
                                         "which is not square"),  # no rows left for a grid: not a 0x0 one
    (timm_vit(pos_shape=(16, D)), "its position embedding has shape [16, 8]"),
    (timm_vit(pos_shape=(1, 16, 2 * D)), "its position embedding has shape [1, 16, 16]"),
])
def test_a_position_embedding_that_cannot_tell_says_why_in_the_refusal(sd, note):
    det = detect_layout(sd)
    assert det.grid is None and det.grid_note == note
    assert says(refusal(resolve_shape, det, heads=2), "timm-vit", "token grid", f"({note})", "--grid")
    assert resolve_shape(det, heads=2, need_grid=False) == (None, 2)


def test_without_a_position_embedding_the_refusal_has_no_reason_to_give():
    det = detect_layout(torch.nn.MultiheadAttention(D, 2).state_dict())
    assert det.layout.name == "torch-mha" and det.grid is None and det.grid_note is None
    assert says(refusal(resolve_shape, det, 2), "torch-mha", "token grid", "--grid") and "(" not in refusal(
        resolve_shape, det, 2).split(";")[0]  # no reason in brackets: it has none to give
    assert refusal(resolve_shape, det, 2, None, True) == refusal(resolve_shape, det, 2)  # need_grid defaults to True


def test_a_given_grid_must_account_for_the_position_rows():
    with_cls = detect_layout(timm_vit(17, cls=True))
    assert says(refusal(resolve_shape, with_cls, 2, Grid((3, 3))), "--grid 3x3", "9 tokens", "17 rows", "1 of them")
    plain = detect_layout(timm_vit(16))
    assert says(refusal(resolve_shape, plain, 2, Grid((3, 3))), "--grid 3x3", "9 tokens", "16 rows")
    assert "prefix" not in refusal(resolve_shape, plain, 2, Grid((3, 3)))
    # all the rows (a no_embed_class model's would be the grid's alone), or all but the prefix rows
    assert resolve_shape(detect_layout(timm_vit(16, cls=True)), 2, Grid((4, 4))) == (Grid((4, 4)), 2)
    assert resolve_shape(with_cls, 2, Grid((4, 4))) == (Grid((4, 4)), 2)


def test_heads_the_checkpoint_tells_are_used_and_held_to():
    det = detect_layout(timm_vit(16))
    assert says(refusal(resolve_shape, det), "timm-vit", "number of heads", "--heads", "dim 8")
    det.heads = 2  # what a config.json, a timm arch or a structinit train checkpoint tells
    assert resolve_shape(det) == (Grid((4, 4)), 2)
    assert resolve_shape(det, heads=2) == (Grid((4, 4)), 2)
    assert says(refusal(resolve_shape, det, heads=4), "--heads 4", "contradicts", "2 heads")
    det.heads = None
    assert says(refusal(resolve_shape, det, heads=3), "--heads 3", "does not divide", "dim 8")


def test_a_sequence_models_length_is_its_position_table():
    det = detect_layout(gpt2(32))
    assert det.layout.name == "hf-gpt2" and det.grid == Grid((32,)) and det.pos_key == "wpe.weight"
    assert resolve_shape(det, 2) == (Grid((32,)), 2)
    assert resolve_shape(det, 2, Grid((20,))) == (Grid((20,)), 2)  # a shorter sequence is fine
    assert says(refusal(resolve_shape, det, 2, Grid((40,))), "--grid 40", "longer", "32 positions")
    assert says(refusal(resolve_shape, det, 2, Grid((4, 8))), "hf-gpt2", "sequence model", "--grid", "length L",
                "4x8")
    assert detect_layout(gpt2(1)).grid == Grid((1,))
    empty = detect_layout(gpt2(0))
    assert empty.grid is None and empty.pos_key is None
    assert says(refusal(resolve_shape, empty, 2), "hf-gpt2", "no position embedding", "sequence length", "--grid L")


def test_layers_past_nine_keep_their_numeric_order():
    """nn.MultiheadAttention keys carry no layer group, so the layers are sorted by their names:
    ``layers.10`` after ``layers.9``, not after ``layers.1``."""
    enc = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(D, 2, dim_feedforward=16), 12,
                                      enable_nested_tensor=False)
    sd = dict(reversed(list(enc.state_dict().items())))  # the file's order must not matter
    det = detect_layout(sd)
    assert det.layout.name == "torch-mha" and det.depth == 12
    assert [s.block for s in det.slots] == [f"layers.{i}.self_attn." for i in range(12)]
    assert [s.index for s in det.slots] == list(range(12))
    timm12 = detect_layout(dict(reversed(list(timm_vit(16, depth=12).items()))))
    assert [s.block for s in timm12.slots] == [f"blocks.{i}." for i in range(12)]


def test_the_summary_names_what_was_found():
    det = detect_layout(timm_vit(17, cls=True, prefix="module."))
    assert det.summary() == {"layout": "timm-vit", "description": "timm VisionTransformer (fused qkv)",
                             "prefix": "module.", "dim": D, "heads": None, "depth": 2, "grid": [4, 4],
                             "prefix_tokens": 1, "pos_embed": "module.pos_embed"}
    det.heads = 2
    assert det.summary()["heads"] == 2
    assert detect_layout(timm_vit(10)).summary()["grid"] is None


def failure(sd) -> str:
    with pytest.raises(StructinitError) as e:
        detect_layout(sd)
    return str(e.value)


def test_state_dicts_that_are_not_one_model_are_refused_whole():
    two = {**timm_vit(16, prefix="student."), **timm_vit(16, prefix="teacher.")}
    assert failure(two) == ("the checkpoint holds several timm-vit models (key prefixes ['student.', 'teacher.']); "
                            "extract one state dict first")
    gap = timm_vit(16, depth=3)
    for name in [k for k in gap if k.startswith("blocks.1.")]:
        gap[name.replace("blocks.1.", "blocks.3.")] = gap.pop(name)
    assert failure(gap) == ("timm-vit: the checkpoint has no blocks.1.attn.qkv.weight (attention layers 0, 2, 3 have "
                            "theirs): a tensor is missing, or the layers are not numbered from 0")
    lost = timm_vit(16, depth=4)  # one qkv tensor missing, the rest of its block there
    del lost["blocks.2.attn.qkv.weight"]
    assert failure(lost).startswith("timm-vit: the checkpoint has no blocks.2.attn.qkv.weight (attention layers 0, 1, "
                                    "3 have theirs)")
    late = {k.replace("blocks.0.", "blocks.2."): v for k, v in timm_vit(16, depth=1).items()}
    assert failure(late).startswith("timm-vit: the checkpoint has no blocks.0.attn.qkv.weight, "
                                    "blocks.1.attn.qkv.weight (attention layers 2 have theirs)")
    narrow = timm_vit(16)
    narrow["blocks.1.attn.qkv.weight"] = torch.zeros(2 * D, D)
    assert failure(narrow) == "blocks.1.attn.qkv.weight: shape [16, 8] does not fit dim 8 (q)"
    short_bias = timm_vit(16)
    short_bias["blocks.0.attn.qkv.bias"] = torch.zeros(D)
    assert failure(short_bias) == "blocks.0.attn.qkv.bias: shape [8] does not fit dim 8 (q bias)"


def hf_vit(key_shape=(D, D), drop=None):
    """A one-layer Hugging Face ViT state dict of zeros (separate query/key/value), the key weight
    of ``key_shape``, without tensor ``drop``."""
    pre = "encoder.layer.0.attention."
    sd = {pre + f"attention.{n}.weight": torch.zeros(D, D) for n in ("query", "key", "value")}
    sd[pre + "attention.key.weight"] = torch.zeros(key_shape)
    sd[pre + "output.dense.weight"] = torch.zeros(D, D)
    sd.pop(drop, None)
    return sd


def test_separate_projections_that_do_not_fit_are_refused_whole():
    assert detect_layout(hf_vit()).layout.name == "hf-vit"
    assert failure(hf_vit((D, 2 * D))) == (
        "encoder.layer.0.attention.attention.key.weight: shape [8, 16] does not fit dim 8")
    assert failure(hf_vit(drop="encoder.layer.0.attention.attention.key.weight")) == (
        "hf-vit: missing tensor encoder.layer.0.attention.attention.key.weight")
    assert failure({"blocks.0.attn.qkv.weight": torch.zeros(3 * D)}) == (
        "blocks.0.attn.qkv.weight: expected a 2-D weight, got shape [24]")


def test_slots_say_where_the_output_projection_is_and_how_weights_are_stored():
    det = detect_layout(timm_vit(16))
    assert [(s.proj, s.transposed) for s in det.slots] == [("blocks.0.attn.proj.weight", False),
                                                           ("blocks.1.attn.proj.weight", False)]
    no_proj = {k: v for k, v in timm_vit(16).items() if ".proj." not in k}
    assert [s.proj for s in detect_layout(no_proj).slots] == [None, None]
    gpt = detect_layout(gpt2(16))
    assert [(s.proj, s.transposed) for s in gpt.slots] == [("h.0.attn.c_proj.weight", True)]
    assert gpt.slots[0].q.transposed and (gpt.slots[0].k.start, gpt.slots[0].k.stop) == (D, 2 * D)
