"""Grids, sin-cos embeddings, pseudo inputs and impulse targets: every property their docstrings
state, checked against the stated formula, and every refusal with the parameter it names."""

import math

import numpy as np
import pytest

from structinit.errors import UsageError
from structinit.geometry.embedding import layer_norm, pseudo_input, sincos, sincos_1d, sincos_2d
from structinit.geometry.grid import Grid, parse_grid, validate_shape
from structinit.geometry.targets import (
    centre_first_order,
    check_choice,
    draw_offsets,
    impulse_columns,
    impulse_targets,
    kernel_offset,
)


def message(fn, *args, **kwargs):
    with pytest.raises(UsageError) as exc:
        fn(*args, **kwargs)
    return exc.value.render(lambda n: f"<{n}>")


# --------------------------------------------------------------------------- grids

def test_grid_of_a_sequence_and_of_an_image():
    seq, img, wide = Grid(12), Grid((4, 6)), Grid([8, 8])
    assert seq == (12,) and seq.ndim == 1 and seq.tokens == 12 and seq.hw == (1, 12)
    assert img == (4, 6) and img.ndim == 2 and img.tokens == 24 and img.hw == (4, 6)
    assert (seq.label, img.label, wide.label) == ("s12", "g4x6", "n64")
    assert (seq.describe(), img.describe(), repr(img)) == ("12", "4x6", "Grid(4x6)")
    assert Grid(img) is img and Grid(("3", 5.0)) == (3, 5)
    h, w = img
    assert (h, w) == (4, 6)


@pytest.mark.parametrize("sides", [(), (1, 2, 3), (0, 4), (4, -1), ("a", 2), None, 0])
def test_impossible_grids(sides):
    assert message(Grid, sides).startswith("<grid> must be one side (a sequence) or two (H, W)")


@pytest.mark.parametrize("text, grid", [("16x16", (16, 16)), ("8X12", (8, 12)), ("4*6", (4, 6)), (" 3 , 5 ", (3, 5)),
                                        ("12", (12,)), (" 7 ", (7,))])
def test_parse_grid_forms(text, grid):
    g = parse_grid(grid=text)
    assert g == grid and isinstance(g, Grid)
    if g.ndim == 2:
        assert parse_grid(tokens=g.tokens, grid=text) == grid  # agreeing token count
    else:  # tokens means a square image grid: never with a sequence length
        assert message(parse_grid, tokens=g.tokens, grid=text) == (
            f"<tokens> gives a square image grid; a sequence is <grid> L alone (got <tokens> {g.tokens} with "
            f"<grid> {g.describe()})")


def test_parse_grid_from_tokens_and_its_refusals():
    assert parse_grid(tokens=64) == (8, 8) and parse_grid(tokens=1) == (1, 1)
    assert message(parse_grid, tokens=63, grid="8x8") == "<tokens> 63 does not match <grid> 8x8 (64 tokens)"
    assert message(parse_grid, grid="16by16") == ("<grid> must look like HxW (e.g. 16x16) or L (a sequence), got "
                                                  "'16by16'")
    assert message(parse_grid, grid="4x").startswith("<grid> must look like HxW")
    assert message(parse_grid) == "give <tokens> N (a perfect square) or <grid> HxW"
    assert message(parse_grid, tokens=0) == "<tokens> must be positive, got 0"
    assert message(parse_grid, tokens=-4) == "<tokens> must be positive, got -4"
    assert message(parse_grid, tokens=50) == ("<tokens> 50 is not a perfect square; give the grid with <grid> HxW "
                                              "(or L for a sequence)")


def test_validate_shape_returns_head_dim_and_names_each_problem():
    assert validate_shape((4, 4), 32, 4, 3) == 8 and validate_shape((12,), 6, 3, 3, layers=2) == 2
    assert type(validate_shape((4, 4), 32, 4, 3)) is int  # a width, used as a shape
    assert validate_shape((3, 3), 4, 1, 3) == 4  # a filter as large as the grid fits
    for name, kwargs in (("dim", dict(dim=0)), ("heads", dict(heads=-1)), ("filter", dict(filter_size=0)),
                         ("layers", dict(layers=0)), ("dim", dict(dim=True)), ("heads", dict(heads=2.0))):
        args = dict(grid=(4, 4), dim=32, heads=4, filter_size=3, layers=1)
        args.update(kwargs)
        got = message(validate_shape, **args)
        assert got == f"<{name}> must be a positive integer, got {list(kwargs.values())[0]!r}"
    pe = "sin-cos position embedding)"
    assert message(validate_shape, (4, 4), 30, 5, 3) == f"<dim> 30 must be divisible by 4 (the 2-D {pe}"
    assert message(validate_shape, (12,), 9, 3, 3) == f"<dim> 9 must be divisible by 2 (the 1-D {pe}"
    assert message(validate_shape, (4, 4), 32, 3, 3) == "<dim> 32 is not divisible by <heads> 3"
    assert message(validate_shape, (4, 6), 32, 4, 5) == "<filter> 5 is larger than the 4x6 grid"


# --------------------------------------------------------------------------- embeddings

def test_sincos_1d_is_the_stated_formula():
    pe = sincos_1d(7, 12, temperature=100.0)
    assert pe.shape == (7, 12) and pe.dtype == np.float32
    w = 100.0 ** (-np.arange(6) / 6)
    t = np.arange(7)[:, None]
    np.testing.assert_allclose(pe, np.concatenate([np.sin(t * w), np.cos(t * w)], axis=1), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.linalg.norm(pe, axis=1), math.sqrt(6), rtol=1e-6)  # sqrt(dim / 2)
    assert np.array_equal(sincos_1d(7, 12), sincos_1d(7, 12, temperature=10000.0))
    assert np.array_equal(sincos((7,), 12), sincos_1d(7, 12))
    assert message(sincos_1d, 7, 11) == "<dim> 11 must be even for a 1-D sin-cos position embedding"


def test_sincos_2d_is_the_stated_formula():
    pe = sincos_2d((3, 5), 16, temperature=50.0)
    assert pe.shape == (15, 16) and pe.dtype == np.float32
    w = 50.0 ** (-np.arange(4) / 4)
    ys, xs = np.divmod(np.arange(15), 5)
    ax, ay = xs[:, None] * w, ys[:, None] * w
    want = np.concatenate([np.sin(ax), np.cos(ax), np.sin(ay), np.cos(ay)], axis=1)
    np.testing.assert_allclose(pe, want, rtol=1e-6, atol=1e-7)
    assert np.array_equal(sincos((3, 5), 16), sincos_2d((3, 5), 16))
    assert message(sincos_2d, (3, 5), 18) == "<dim> 18 must be divisible by 4 for a 2-D sin-cos position embedding"


def test_layer_norm_without_affine():
    x = np.array([[1.0, 2.0, 3.0, 6.0], [5.0, 5.0, 5.0, 5.0]])
    y = layer_norm(x)
    assert y.dtype == np.float32
    want = (x[0] - 3.0) / math.sqrt(np.var(x[0]) + 1e-6)
    np.testing.assert_allclose(y[0], want, rtol=1e-6)
    np.testing.assert_allclose(y[1], 0.0)
    np.testing.assert_allclose(layer_norm(x, eps=1.0)[0], (x[0] - 3.0) / math.sqrt(np.var(x[0]) + 1.0), rtol=1e-6)


def _truncated_normal(rng, shape):
    g = rng.standard_normal(size=shape)
    while np.any(np.abs(g) > 2):
        bad = np.abs(g) > 2
        g[bad] = rng.standard_normal(size=int(bad.sum()))
    return g


@pytest.mark.parametrize("grid", [(4, 6), (10,)])
def test_pseudo_inputs_are_the_documented_draws(grid):
    """Each kind from its definition, with the noise of a NumPy generator seeded with ``seed``:
    the artifact key relies on these being reproducible."""
    dim, seed = 16, 7
    n = Grid(grid).tokens
    pe = sincos(grid, dim).astype(np.float64)
    uniform = np.random.default_rng(seed).uniform(-1.0, 1.0, size=(n, dim))
    gauss = math.sqrt(0.5) * _truncated_normal(np.random.default_rng(seed), (n, dim))
    want = {"pe": pe, "uniform": uniform, "gaussian": gauss, "pe+uniform": pe + uniform, "pe+gaussian": pe + gauss}
    for kind, raw in want.items():
        got = pseudo_input(kind, grid, dim, seed=seed)
        assert got.shape == (n, dim) and got.dtype == np.float32
        np.testing.assert_allclose(got, layer_norm(raw), rtol=1e-5, atol=1e-5, err_msg=kind)
    assert message(pseudo_input, "laplace", grid, dim) == ("unknown <pseudo_input> 'laplace'; choose one of pe, "
                                                           "uniform, gaussian, pe+uniform, pe+gaussian")


# --------------------------------------------------------------------------- targets

def test_kernel_offsets_cover_the_window_row_major():
    for f in (1, 3, 5):
        offs = [kernel_offset(k, f) for k in range(f * f)]
        r = f // 2
        assert offs == [(dy, dx) for dy in range(-r, r + 1) for dx in range(-r, r + 1)]


def test_centre_first_order_goes_ring_by_ring():
    assert centre_first_order(3) == [4, 1, 5, 3, 7, 0, 2, 6, 8]
    order = centre_first_order(5)
    assert sorted(order) == list(range(25))
    assert order[:9] == [12, 7, 11, 13, 17, 6, 8, 16, 18]  # centre, its 4 neighbours, the 4 corners of ring 1
    rank = [(max(abs(dy), abs(dx)), abs(dy) + abs(dx)) for dy, dx in (kernel_offset(k, 5) for k in order)]
    assert rank == sorted(rank)
    assert centre_first_order(1) == [0]


def test_random_offsets_cover_every_position_of_the_window():
    for f in (3, 5):
        off = draw_offsets(f, heads=64, layers=8, seed=0)
        assert off.shape == (8, 64, 2) and off.dtype == np.int32
        seen = {tuple(o) for o in off.reshape(-1, 2)}
        r = f // 2
        assert seen == {(dy, dx) for dy in range(-r, r + 1) for dx in range(-r, r + 1)}  # uniform: all appear
        counts = np.bincount([(dy + r) * f + dx + r for dy, dx in off.reshape(-1, 2)], minlength=f * f)
        assert counts.min() > 0.5 * counts.mean()
    assert np.array_equal(draw_offsets(3, 4, 2, seed=1), draw_offsets(3, 4, 2, seed=1, order="random"))


def test_centre_offsets_cycle_and_repeat_per_layer():
    off = draw_offsets(3, heads=11, layers=3, seed=5, order="centre")
    order = [kernel_offset(k, 3) for k in centre_first_order(3)]
    assert [tuple(o) for o in off[0]] == order + order[:2]  # cycling past 9 heads
    assert (off == off[0]).all()  # every layer the same


def test_centre_offsets_on_a_causal_sequence_look_only_back():
    off = draw_offsets(3, heads=3, layers=2, seed=0, order="centre", ndim=1, causal=True)
    assert [tuple(o) for o in off[1]] == [(0, 0), (0, -1), (0, -2)]  # the current token, then the past
    both = draw_offsets(3, heads=3, layers=1, seed=0, order="centre", ndim=1)
    assert [tuple(o) for o in both[0]] == [(0, 0), (0, -1), (0, 1)]
    assert message(draw_offsets, 3, 2, 1, 0, "spiral") == ("unknown <offset_order> 'spiral'; choose one of random, "
                                                            "centre")


@pytest.mark.parametrize("grid", [(4, 5), (9,)])
def test_impulse_columns_agree_with_the_dense_targets_and_count_rows(grid):
    h, w = Grid(grid).hw
    for dy in (-1, 0, 1):
        for dx in (-2, 0, 1):
            for padding in ("zero", "circular"):
                cols = impulse_columns(grid, np.array([dy, dx]), padding)
                dense = impulse_targets(grid, np.array([[dy, dx]]), padding)[0]
                assert cols.shape == (h * w,) and cols.dtype == np.int64
                has = cols >= 0
                assert np.array_equal(has, dense.sum(1) > 0) and np.array_equal(dense.argmax(1)[has], cols[has])
                assert dense.dtype == np.float32 and set(np.unique(dense)) <= {0.0, 1.0}
                if padding == "circular":
                    assert has.all() and sorted(cols) == list(range(h * w))  # a permutation
                else:
                    assert int(has.sum()) == max(h - abs(dy), 0) * max(w - abs(dx), 0)
                for q in np.flatnonzero(has):
                    y, x = divmod(int(q), w)
                    assert cols[q] == ((y + dy) % h) * w + (x + dx) % w
    assert message(impulse_columns, grid, np.array([0, 0]), "reflect") == ("unknown <padding> 'reflect'; choose one "
                                                                         "of zero, circular")


def test_batched_targets_keep_leading_axes():
    off = np.array([[[0, 1], [1, 0]], [[-1, -1], [0, 0]]])  # [layers 2, heads 2, 2]
    cols = impulse_columns((3, 3), off)
    dense = impulse_targets((3, 3), off)
    assert cols.shape == (2, 2, 9) and dense.shape == (2, 2, 9, 9)
    for l in range(2):
        for h in range(2):
            assert np.array_equal(cols[l, h], impulse_columns((3, 3), off[l, h]))


def test_check_choice():
    assert check_choice("padding", "zero", ("zero", "circular")) == "zero"
    assert message(check_choice, "mode", "x", ("a", "b")) == "unknown <mode> 'x'; choose one of a, b"
