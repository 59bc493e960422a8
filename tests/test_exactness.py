"""``bench exactness``: impulse-initialized multi-head attention equals a convolution in the limit
(Cordonnier et al., Lemma 1), measured against conv1d/conv2d; the convolution reference itself is
checked against a plain loop."""

import json

import numpy as np
import pytest
import torch
from conftest import error_line

from structinit.benchmarks.exactness import attention_conv, conv_reference, default_dim, kernel_taps, run_exactness
from structinit.errors import UsageError
from structinit.geometry.grid import Grid
from structinit.geometry.targets import impulse_targets, window_offsets


def loop_conv(x, kernel, grid, padding, causal=False):
    """out[p] = sum over taps of kernel[:, :, tap] @ x[p + offset(tap)], by hand."""
    h, w = Grid(grid).hw
    f = kernel.shape[-1]
    offsets = window_offsets(f, Grid(grid).ndim, causal)
    out = torch.zeros(h * w, kernel.shape[0], dtype=x.dtype)
    for i in range(h * w):
        y, xx = divmod(i, w)
        for t, (dy, dx) in enumerate(offsets):
            sy, sx = y + dy, xx + dx
            if padding == "circular":
                sy, sx = sy % h, sx % w
            elif not (0 <= sy < h and 0 <= sx < w):
                continue
            tap = kernel[:, :, t] if kernel.dim() == 3 else kernel[:, :, t // f, t % f]
            out[i] += tap @ x[sy * w + sx]
    return out


@pytest.mark.parametrize("grid, f, causal, padding", [
    ((5, 6), 3, False, "zero"), ((5, 6), 3, False, "circular"), ((4, 4), 4, False, "zero"),
    ((4, 4), 4, False, "circular"), ((9,), 5, False, "zero"), ((9,), 5, False, "circular"), ((9,), 3, True, "zero")])
def test_conv_reference_is_the_convolution_the_offsets_describe(grid, f, causal, padding):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(Grid(grid).tokens, 3, generator=g, dtype=torch.float64)
    kernel = torch.randn((2, 3) + (f,) * Grid(grid).ndim, generator=g, dtype=torch.float64)
    got = conv_reference(x, kernel, Grid(grid), padding, causal)
    torch.testing.assert_close(got, loop_conv(x, kernel, grid, padding, causal))
    # Hard impulse attention (the exact targets) with the kernel's taps as values is that convolution.
    offsets = window_offsets(f, Grid(grid).ndim, causal)
    attn = torch.from_numpy(impulse_targets(Grid(grid), offsets, padding)).double()
    torch.testing.assert_close(attention_conv(attn, x, kernel_taps(kernel, offsets, causal)), got)


@pytest.mark.parametrize("grid, f", [((6, 6), 3), ((24,), 5)])
def test_attention_converges_to_the_convolution(grid, f):
    result = run_exactness(grid, f)
    rows = {(r["padding"], r["target_mass"]): r for r in result["rows"]}
    assert result["monotone"] == {"zero": True, "circular": True}
    assert rows[("circular", 0.9999)]["rel_error"] < 1e-3 and rows[("zero", 0.9999)]["rel_error"] < 1e-3
    assert rows[("circular", 0.9)]["rel_error"] > 0.05  # soft attention is not yet a convolution
    assert all(r["hit_rate"] == 1.0 and r["reached_mass"] == pytest.approx(r["target_mass"], abs=1e-4)
               for r in result["rows"])
    n = Grid(grid).tokens
    assert rows[("circular", 0.9)]["positions"] == n and rows[("zero", 0.9)]["positions"] < n
    assert result["setup"]["heads"] == (f if len(grid) == 1 else f * f)


def test_causal_sequence_and_default_dims():
    result = run_exactness((20,), 3, causal=True, paddings=["zero"], masses=(0.99, 0.9999))
    assert result["rows"][-1]["rel_error"] < 1e-3 and result["monotone"]["zero"]
    assert default_dim(Grid(40), 5) == 5 * 32 and default_dim(Grid(64), 3) == 3 * 64
    assert default_dim(Grid(100), 3) == 300
    assert default_dim(Grid((8, 8)), 9) == 9 * 32


@pytest.mark.parametrize("kwargs, message", [
    (dict(masses=(0.9, 1.0)), "strictly between 0 and 1"),
    (dict(paddings=["reflect"]), "unknown padding"),
    (dict(causal=True), "needs zero padding"),
    (dict(channels=0), "channels must be a positive integer"),
])
def test_bad_settings(kwargs, message):
    with pytest.raises(UsageError, match=message):
        run_exactness((12,), 3, **kwargs)


def test_cli_json_and_errors(cli):
    r = cli("bench", "exactness", "--grid", "16", "--filter", "3", "--masses", "0.99,0.9999", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert [row["target_mass"] for row in out["rows"]] == [0.99, 0.9999, 0.99, 0.9999]
    assert out["rows"][-1]["rel_error"] < 1e-3 and out["setup"]["grid"] == [16]
    text = cli("bench", "exactness", "--grid", "16", "--masses", "0.9,0.9999")
    assert text.returncode == 0 and "Lemma 1" in text.stdout and "falls monotonically" in text.stdout
    for args, message in [(("--grid", "8x8", "--causal"), "--causal applies to sequences"),
                          (("--grid", "16", "--filter", "17"), "--filter 17 is longer than the sequence"),
                          (("--masses", "0.9,x"), "--masses must be comma-separated numbers"),
                          (("--paddings", "reflect"), "unknown --paddings")]:
        bad = cli("bench", "exactness", *args)
        assert bad.returncode == 2 and message in error_line(bad.stderr), bad.stderr


def test_kernel_taps_follow_the_offsets():
    kernel = torch.arange(2 * 1 * 9, dtype=torch.float64).reshape(2, 1, 3, 3)
    taps = kernel_taps(kernel, np.array([[-1, -1], [0, 0], [1, 0]]))
    assert taps.shape == (3, 1, 2)
    assert taps[0, 0].tolist() == [0.0, 9.0] and taps[1, 0].tolist() == [4.0, 13.0] and taps[2, 0].tolist() == [7.0,
                                                                                                                 16.0]
