import numpy as np
import pytest

from structinit.errors import UsageError
from structinit.geometry.targets import centre_first_order, draw_offsets, impulse_matrix, impulse_targets, kernel_offset


def shifted(img, dy, dx, circular=False):
    """Reference shift: out[y, x] = img[y + dy, x + dx], zero (or wrapped) outside."""
    if circular:
        return np.roll(img, shift=(-dy, -dx), axis=(0, 1))
    h, w = img.shape
    out = np.zeros_like(img)
    for y in range(h):
        for x in range(w):
            if 0 <= y + dy < h and 0 <= x + dx < w:
                out[y, x] = img[y + dy, x + dx]
    return out


@pytest.mark.parametrize("grid", [(5, 5), (4, 7)])
@pytest.mark.parametrize("offset", [(0, 0), (1, 0), (0, -1), (-1, 1), (2, -2)])
@pytest.mark.parametrize("padding", ["zero", "circular"])
def test_target_is_a_shift_of_a_real_image(grid, offset, padding):
    rng = np.random.default_rng(1)
    img = rng.normal(size=grid).astype(np.float32)
    t = impulse_matrix(grid, offset, padding)
    got = (t @ img.reshape(-1)).reshape(grid)
    np.testing.assert_allclose(got, shifted(img, *offset, circular=padding == "circular"))


def test_zero_padding_rows_outside_are_empty_and_others_have_one_impulse():
    t = impulse_matrix((4, 4), (1, 1))
    sums = t.sum(1).reshape(4, 4)
    assert sums[3].sum() == 0 and sums[:, 3].sum() == 0  # sources below / right of the grid
    assert (sums[:3, :3] == 1).all()
    assert impulse_matrix((4, 4), (1, 1), "circular").sum(1).min() == 1


def test_kernel_offsets_and_centre_first_order():
    assert kernel_offset(4, 3) == (0, 0)
    assert kernel_offset(0, 3) == (-1, -1)
    assert kernel_offset(8, 3) == (1, 1)
    assert centre_first_order(3) == [4, 1, 5, 3, 7, 0, 2, 6, 8]
    order5 = centre_first_order(5)
    assert order5[0] == 12 and sorted(order5) == list(range(25))
    off = draw_offsets(3, heads=9, layers=2, seed=0, order="centre")
    assert off.shape == (2, 9, 2) and off.dtype == np.int32
    assert off[0, 0].tolist() == [0, 0] and off[0, 1].tolist() == [-1, 0] and (off[0] == off[1]).all()


def test_random_offsets_are_seeded_in_range_and_differ_per_layer():
    a = draw_offsets(5, heads=8, layers=6, seed=3)
    assert (a == draw_offsets(5, heads=8, layers=6, seed=3)).all()
    assert not (a == draw_offsets(5, heads=8, layers=6, seed=4)).all()
    assert a.min() >= -2 and a.max() <= 2
    assert len({tuple(map(tuple, a[l])) for l in range(6)}) > 1


def test_targets_batch_shape_and_bad_padding():
    off = draw_offsets(3, heads=2, layers=3, seed=0)
    t = impulse_targets((4, 4), off)
    assert t.shape == (3, 2, 16, 16)
    with pytest.raises(UsageError):
        impulse_matrix((4, 4), (0, 0), "reflect")
