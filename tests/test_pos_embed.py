"""Writing and recognising a sin-cos position embedding, value by value: a sequence model's
``[P, D]`` table (all P positions, the first N told), an image model's ``[1, prefix + N, D]``
(prefix rows kept or zeroed), in the table's own dtype; and what ``pe_kind`` calls sin-cos:
a scale within tolerance relative to it, half precision, integer tables."""

import pytest
import timm
import torch
from conftest import says

from structinit.errors import UsageError
from structinit.geometry.embedding import sincos, sincos_1d
from structinit.init.pos_embed import pe_kind, set_sincos_pos_embed, write_sincos


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_sequence_table_gets_every_position_in_its_own_dtype(dtype):
    wpe = torch.full((12, 8), 7.0, dtype=dtype)
    assert write_sincos(wpe, (10,), scale=0.5, name="wpe.weight") == "wpe.weight[0:12]"
    assert wpe.dtype == dtype
    torch.testing.assert_close(wpe, (0.5 * torch.from_numpy(sincos_1d(12, 8))).to(dtype))
    assert write_sincos(wpe, (12,)) == "pos_embed[0:12]"  # as many tokens as positions: fits
    assert pe_kind(wpe, (8,)) == "sincos"  # its first 8 rows are the 8-token table
    assert pe_kind(wpe[4:], (8,)) == "other"  # rows 4.. are not


@pytest.mark.parametrize("grid", [(13,), (3, 3)])
def test_a_sequence_table_refuses_what_it_cannot_hold(grid):
    wpe = torch.zeros(12, 8)
    with pytest.raises(UsageError) as e:
        write_sincos(wpe, grid, name="wpe.weight")
    from structinit.geometry.grid import Grid

    assert says(str(e.value), "wpe.weight", "[12, 8]", "12 positions", f"{Grid(grid).describe()} grid")
    assert torch.equal(wpe, torch.zeros(12, 8))


def test_an_image_table_keeps_or_zeroes_its_prefix_rows():
    pe = torch.full((1, 10, 8), 3.0, dtype=torch.float16)
    assert write_sincos(pe, (3, 3), scale=2.0) == "pos_embed[0, 1:10]"
    torch.testing.assert_close(pe[0, 1:], (2 * torch.from_numpy(sincos((3, 3), 8))).half())
    assert torch.equal(pe[0, 0], torch.full((8,), 3.0, dtype=torch.float16))
    assert pe_kind(pe, (3, 3)) == "sincos x2"
    write_sincos(pe, (3, 3), zero_prefix=True)
    assert torch.equal(pe[0, 0], torch.zeros(8, dtype=torch.float16)) and pe_kind(pe, (3, 3)) == "sincos"


def test_a_model_without_a_position_table_is_refused_and_the_prefix_is_kept_by_default():
    with pytest.raises(UsageError) as e:
        set_sincos_pos_embed(torch.nn.Linear(2, 2))
    assert says(str(e.value), "no pos_embed tensor")
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=1, num_classes=3)
    with torch.no_grad():
        model.pos_embed.fill_(0.25)
    assert set_sincos_pos_embed(model) == "pos_embed[0, 1:17]"
    assert torch.equal(model.pos_embed[0, 0], torch.full((192,), 0.25)) and not model.pos_embed.requires_grad


def test_what_is_called_sin_cos_and_at_what_scale():
    table = torch.from_numpy(sincos((4, 4), 8))[None]
    assert pe_kind(table, (4, 4)) == "sincos"
    assert pe_kind(table * 100, (4, 4)) == "sincos x100"
    assert pe_kind(table * 100 + 5e-3, (4, 4)) == "sincos x100"  # within 1e-4 relative to the scale
    assert pe_kind(table * 100 + 5e-2, (4, 4)) == "other"
    for off, kind in ((1.5e-4, "other"), (0.5e-4, "sincos")):  # at scale 1 the tolerance is 1e-4
        nudged = table.clone()
        nudged[0, 5, 3] += off
        assert pe_kind(nudged, (4, 4)) == kind, off
    assert pe_kind(-table, (4, 4)) == "other"  # a negative scale is no sin-cos table
    assert pe_kind(table.half(), (4, 4)) == "sincos"  # half precision's rounding is tolerated
    eps = torch.finfo(torch.float16).eps
    for off, kind in ((3.5 * eps, "sincos"), (4.5 * eps, "other")):  # ... up to 4 eps of it
        nudged = table.clone()
        nudged[0, 0, 0] += off  # a sin(0): exact in half precision, nudge included
        assert pe_kind(nudged.half(), (4, 4)) == kind, off
    assert pe_kind(table.bfloat16(), (4, 4)) == "sincos"
    assert pe_kind(torch.round(10 * table).to(torch.int64), (4, 4)) == "other"  # integers: no rounding slack
    assert pe_kind(torch.zeros(1, 16, 8), (4, 4)) == "other"
