"""1-D geometry: offsets in a window of f positions (centred or causal), targets that are real shifts
of a sequence, the causal mask, every recipe and the softness knob on sequences, artifacts that
record the geometry, and the keys of 2-D artifacts left as they were."""

import dataclasses
import json

import numpy as np
import pytest
import torch
from conftest import says

from structinit.errors import UsageError
from structinit.geometry.grid import Grid, parse_grid
from structinit.geometry.targets import (
    causal_mask,
    centre_first_order_1d,
    check_geometry,
    draw_offsets,
    impulse_columns,
    impulse_matrix,
    kernel_offset_1d,
    window_offsets,
)
from structinit.solver.artifact import read_artifact
from structinit.solver.cache import shipped_cache_dir
from structinit.solver.config import SolveConfig
from structinit.solver.run import compute, solve


def test_window_offsets_centred_and_causal():
    assert [kernel_offset_1d(k, 5) for k in range(5)] == [(0, -2), (0, -1), (0, 0), (0, 1), (0, 2)]
    assert [kernel_offset_1d(k, 3, causal=True)[1] for k in range(3)] == [-2, -1, 0]
    assert window_offsets(3, ndim=1).tolist() == [[0, -1], [0, 0], [0, 1]]
    assert window_offsets(4, ndim=1, causal=True)[:, 1].tolist() == [-3, -2, -1, 0]
    assert window_offsets(3, ndim=2).shape == (9, 2)
    # int32 as documented, for sequences and images alike
    assert window_offsets(3, ndim=1).dtype == np.int32 and window_offsets(3, ndim=2).dtype == np.int32
    # Centre first: the current token, then the nearest (earlier first on a tie).
    dx = [kernel_offset_1d(k, 5)[1] for k in centre_first_order_1d(5)]
    assert dx == [0, -1, 1, -2, 2]
    assert [kernel_offset_1d(k, 4, True)[1] for k in centre_first_order_1d(4, causal=True)] == [0, -1, -2, -3]


@pytest.mark.parametrize("causal", [False, True])
def test_drawn_1d_offsets_stay_in_the_window(causal):
    off = draw_offsets(7, heads=16, layers=5, seed=2, ndim=1, causal=causal)
    assert off.shape == (5, 16, 2) and off.dtype == np.int32
    assert (off[..., 0] == 0).all()
    lo, hi = (-6, 0) if causal else (-3, 3)
    assert off[..., 1].min() >= lo and off[..., 1].max() <= hi
    assert len(np.unique(off[..., 1])) > 3  # the draw covers the window, not one position
    every = draw_offsets(7, heads=7, layers=2, seed=0, order="centre", ndim=1, causal=causal)
    assert sorted(every[0, :, 1].tolist()) == sorted(window_offsets(7, 1, causal)[:, 1].tolist())
    assert (every[0] == every[1]).all()


def test_2d_offsets_are_drawn_exactly_as_before():
    # The 1-D option must not change the 2-D draw (shipped artifacts depend on it).
    rng = np.random.default_rng(4)
    ks = rng.integers(0, 9, size=(3, 6))
    want = np.stack([np.stack([(k // 3 - 1, k % 3 - 1) for k in row]) for row in ks])
    assert (draw_offsets(3, 6, 3, seed=4) == want).all()


@pytest.mark.parametrize("dx", [-3, -1, 0, 2])
@pytest.mark.parametrize("padding", ["zero", "circular"])
def test_1d_target_is_a_shift_of_a_real_sequence(dx, padding):
    seq = np.random.default_rng(0).normal(size=11).astype(np.float32)
    got = impulse_matrix(Grid(11), (0, dx), padding) @ seq
    if padding == "circular":
        want = np.roll(seq, -dx)
    else:
        want = np.array([seq[i + dx] if 0 <= i + dx < 11 else 0.0 for i in range(11)], dtype=np.float32)
    np.testing.assert_array_equal(got, want)
    cols = impulse_columns(Grid(11), np.array([0, dx]), padding)
    assert cols.shape == (11,)


def test_causal_mask_and_geometry_errors():
    m = causal_mask(Grid(5))
    assert m.dtype == bool and m[3, 3] and m[3, 0] and not m[0, 3] and m.sum() == 15
    assert causal_mask(Grid(5), causal=False) is None
    with pytest.raises(UsageError) as e:
        check_geometry(Grid((4, 4)), causal=True)
    assert says(e.value.render(lambda n: f"<{n}>"), "<causal>", "sequences", "4x4 image grid")
    with pytest.raises(UsageError) as e:
        check_geometry(Grid(8), "circular", causal=True)
    assert e.value.render(lambda n: f"<{n}>").startswith("<causal> needs zero padding: circular <padding> wraps ")


def test_drawing_causal_offsets_for_an_image_grid_is_refused_by_name():
    with pytest.raises(UsageError) as e:
        draw_offsets(3, heads=2, layers=1, seed=0, ndim=2, causal=True)
    assert says(e.value.render(lambda n: f"<{n}>"), "<causal>", "sequences", "only")


@pytest.mark.parametrize("kwargs, message", [
    (dict(grid=(40,), dim=64, heads=4, filter=41), "filter 41 is longer than the sequence of 40 tokens"),
    (dict(grid=(8, 8), dim=64, heads=4, causal=True), "causal applies to sequences"),
    (dict(grid=(40,), dim=64, heads=4, causal=True, padding="circular"), "needs zero padding"),
    (dict(grid=(40,), dim=63, heads=3), "divisible by 2"),
])
def test_impossible_1d_configs(kwargs, message):
    with pytest.raises(UsageError, match=message):
        SolveConfig(**kwargs)


def test_parse_grid_sequence_and_tokens_conflict():
    assert parse_grid(grid="40") == Grid(40) and parse_grid(grid="40").ndim == 1
    with pytest.raises(UsageError, match="tokens gives a square image grid"):
        parse_grid(tokens=64, grid="64")


def test_keys_of_2d_configs_ignore_the_new_setting_and_causal_changes_the_key():
    base = SolveConfig(grid=(16, 16), dim=192, heads=3)
    assert "causal" not in base.canonical_json()
    seq = SolveConfig(grid=(40,), dim=64, heads=4)
    causal = dataclasses.replace(seq, causal=True)
    assert json.loads(causal.canonical_json())["causal"] is True and causal.key != seq.key
    assert SolveConfig.from_dict(causal.to_dict()) == causal
    assert seq.filename.startswith("s40-d64-h4-f3-")
    assert seq.geometry()["window"] == [[0, -1], [0, 0], [0, 1]] and causal.geometry()["causal"]


def test_shipped_artifacts_are_still_cache_hits():
    files = sorted(shipped_cache_dir().glob("*.safetensors"))
    assert len(files) == 4
    for path in files:
        art = read_artifact(path)
        assert path.name == art.config.filename  # the key recomputed from the config is the one it was written with
        assert not art.config.causal
        assert solve(art.config).cached


@pytest.mark.parametrize("recipe, params", [("fast", {}), ("fast", {"target_mass": 0.7}),
                                            ("paper", {"iters": 300, "lr": 1e-2}), ("released", {"iters": 200}),
                                            ("closed-form", {})])
@pytest.mark.parametrize("causal", [False, True])
def test_every_recipe_solves_sequences(recipe, params, causal):
    config = SolveConfig(grid=(24,), dim=32, heads=4, filter=5, layers=2, recipe=recipe, params=params,
                         causal=causal)
    art = compute(config, "cpu")
    assert art.q.shape == (2, 4, 32, 8) and art.offsets.shape == (2, 4, 2)
    assert (art.offsets[..., 0] == 0).all()
    assert (art.offsets[..., 1] <= 0).all() if causal else (np.abs(art.offsets[..., 1]) <= 2).all()
    s = art.stats["summary"]
    if recipe == "fast":  # the softness knob holds in 1-D, with or without the mask
        assert s["target_mass"] == pytest.approx(params.get("target_mass", 0.3), abs=1e-3)
        assert s["hit_rate"] > 0.95
    if recipe == "paper":  # Algorithm 1 goes sharp, as on images
        assert s["target_mass"] > 0.9
    # Measured under the mask: no causal head puts any attention on a later token.
    if causal:
        from structinit.analysis.quality import artifact_attention

        attn = artifact_attention(art, 0)
        assert float(np.triu(attn, k=1).max()) == 0.0


def test_causal_mask_changes_what_the_solve_calibrates():
    # Without the mask in the calibration, a causal head's masked attention would be sharper than asked.
    from structinit.analysis.quality import measure
    from structinit.geometry.embedding import pseudo_input
    from structinit.solver.algorithms import solve_fast

    grid = Grid(24)
    x = torch.from_numpy(pseudo_input("pe", grid, 32))[None]
    offs = draw_offsets(3, 4, 1, seed=0, ndim=1, causal=True)
    mask = torch.from_numpy(causal_mask(grid))
    cols = impulse_columns(grid, offs)
    t = torch.from_numpy(cols)
    q, k = solve_fast(x, t, 8, 4, None, target_mass=0.4, mask=mask)
    assert measure(x, q, k, cols, mask).target_mass.mean() == pytest.approx(0.4, abs=1e-3)
    q0, k0 = solve_fast(x, t, 8, 4, None, target_mass=0.4)
    assert measure(x, q0, k0, cols, mask).target_mass.mean() > 0.45


def test_causal_artifact_round_trip(tmp_path):
    art = solve(SolveConfig(grid=(20,), dim=16, heads=2, filter=3, causal=True), cache_dir=tmp_path).artifact
    back = read_artifact(art.path)
    assert back.config.causal and back.config.grid == Grid(20) and back.key == art.key
    assert json.loads(back.config.canonical_json())["grid"] == [20]


def test_geometry_refusals_name_their_parameters_whole():
    def said(fn, *args, **kw):
        with pytest.raises(UsageError) as e:
            fn(*args, **kw)
        return e.value.render(lambda n: f"<{n}>")

    assert said(check_geometry, Grid(8), "mirror").startswith("unknown <padding> 'mirror'")
    assert said(check_geometry, Grid(8), "circular", causal=True) == (
        "<causal> needs zero padding: circular <padding> wraps the first tokens' window around to the end of the "
        "sequence, which a causal mask hides")
    assert said(draw_offsets, 3, heads=2, layers=1, seed=0, ndim=3) == "a grid has 1 or 2 dimensions, got 3"


def test_a_zero_padded_window_past_the_edge_marks_its_row_minus_one():
    """Impulse columns ``[..., N]``: the key token of each query row, or -1 (as documented) where
    the offset points outside a zero-padded grid."""
    from structinit.geometry.targets import impulse_columns

    cols = impulse_columns(Grid((3, 3)), np.array([[0, 1], [-1, 0]]), "zero")
    assert cols.tolist() == [[1, 2, -1, 4, 5, -1, 7, 8, -1], [-1, -1, -1, 0, 1, 2, 3, 4, 5]]
