"""Attention equals convolution, measured: Lemma 1 of "On the Relationship between Self-Attention
and Convolutional Layers" (Cordonnier, Loukas and Jaggi) on structinit's own solved attention.

A multi-head attention layer with one head per shift of an ``f x f`` kernel (``f`` heads on a
sequence), each head impulse-initialized at its shift, and the value/output weights of head ``h``
set to the kernel's tap at that shift, computes

    out[q] = sum_h sum_k softmax(A_h)[q, k] x[k] W_h  ->  sum_h x[q + shift_h] W_h = conv(x)[q]

as every head's attention mass on its target goes to 1. :func:`run_exactness` builds exactly that:
the attention of each head comes from the ``fast`` recipe's solve on the LayerNorm'd sin-cos
position embedding (the pseudo input, i.e. the attention a freshly initialized model computes from
position alone) at a series of target masses, the values from random inputs ``x``; the output is
compared with ``torch.nn.functional.conv2d`` (``conv1d``) of ``x`` with a random kernel. With zero
padding the comparison covers the positions away from the border (where every shift lands inside
the grid; at the border a softmax cannot put its mass on a missing token); with circular padding it
covers every position.

Example::

    from structinit.benchmarks.exactness import run_exactness
    result = run_exactness((8, 8), 3)
    [(r["padding"], r["target_mass"], r["rel_error"]) for r in result["rows"]]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from structinit.errors import StructinitError, UsageError, param
from structinit.geometry.grid import Grid
from structinit.geometry.targets import PADDINGS, check_choice, check_geometry

DEFAULT_MASSES = (0.9, 0.99, 0.999, 0.9999)
#: Per-head dimension of the attention when ``dim`` is not given.
DEFAULT_HEAD_DIM = 32
#: The fast recipe's ridge used here. Its default (1e-5) keeps weights small by giving up the weakest
#: directions of the position embedding, which the wrap-around rows of circular padding need in the
#: hard-attention limit this check is about; 1e-9 keeps them (measured: 1e-5 misses wrap-around rows
#: on sequences of 40 and 8x8 grids with 5x5 kernels; 1e-9 with 32 dims per head is exact to ~2e-4 up
#: to 64 tokens in 1-D and 16x16 grids in 2-D).
DEFAULT_RIDGE = 1e-9


def default_dim(grid: Grid, heads: int) -> int:
    """The attention dim used when none is given: :data:`DEFAULT_HEAD_DIM` per head, and on a
    sequence at least 3 per position (measured: the hard impulse fit on the 1-D sin-cos embedding of
    64 or 128 positions needs about ``3 N`` dimensions; 2-D grids up to 16x16 need no more than 32
    per head)."""
    head_dim = DEFAULT_HEAD_DIM
    if Grid(grid).ndim == 1:
        head_dim = max(head_dim, -(-3 * Grid(grid).tokens // heads))
        head_dim += head_dim % 2
    return heads * head_dim


def conv_reference(x, kernel, grid: Grid, padding: str = "zero", causal: bool = False):
    """The convolution (cross-correlation, as PyTorch's) of tokens ``x: [N, C_in]`` with ``kernel``
    ``[C_out, C_in, f, f]`` (an image grid) or ``[C_out, C_in, f]`` (a sequence), 'same' output with
    zero or circular padding: ``out[y, x] = sum_k kernel[:, :, k] . x[(y, x) + offset(k)]`` with
    :func:`~structinit.geometry.targets.kernel_offset` (``kernel_offset_1d`` on a sequence).
    Returns ``[N, C_out]``."""
    import torch.nn.functional as F

    grid = Grid(grid)
    f = kernel.shape[-1]
    left = f - 1 if causal else f // 2
    right = f - 1 - left
    mode = "circular" if padding == "circular" else "constant"
    if grid.ndim == 1:
        inp = F.pad(x.T.reshape(1, x.shape[1], grid[0]), (left, right), mode=mode)
        return F.conv1d(inp, kernel)[0].T
    h, w = grid
    inp = F.pad(x.T.reshape(1, x.shape[1], h, w), (left, right, left, right), mode=mode)
    return F.conv2d(inp, kernel)[0].reshape(kernel.shape[0], h * w).T


def kernel_taps(kernel, offsets: np.ndarray, causal: bool = False):
    """The tap of ``kernel`` at each head's offset ``[heads, 2]`` as a value-output matrix
    ``W_h: [heads, C_in, C_out]`` (so that head ``h`` contributes ``x[q + offset_h] @ W_h``)."""
    import torch

    f = kernel.shape[-1]
    left = f - 1 if causal else f // 2
    taps = []
    for dy, dx in np.asarray(offsets):
        tap = kernel[:, :, int(dx) + left] if kernel.dim() == 3 else kernel[:, :, int(dy) + f // 2, int(dx) + f // 2]
        taps.append(tap.T)
    return torch.stack(taps)


def attention_conv(attn, x, taps):
    """Multi-head attention with per-head value-output maps: ``sum_h attn[h] @ x @ taps[h]``.
    ``attn: [heads, N, N]``, ``x: [N, C_in]``, ``taps: [heads, C_in, C_out]`` -> ``[N, C_out]``."""
    return (attn @ x.unsqueeze(0) @ taps).sum(0)


def exactness_memory(tokens: int, heads: int, ndim: int, filter_size: int, channels: int, out_channels: int) -> int:
    """Bytes the comparison itself holds at its peak (float64): the inputs, the kernel and its taps,
    the attention maps, each head's values ``[heads, N, C_in]`` and outputs ``[heads, N, C_out]``,
    the convolution and the difference."""
    n = tokens
    kernel = out_channels * channels * filter_size ** ndim
    return 8 * (n * channels + 2 * kernel + heads * n * n + heads * n * (channels + out_channels)
                + 3 * n * out_channels)


def _check_memory(grid: Grid, heads: int, dim: int, filter_size: int, channels: int, out_channels: int, *,
                  padding: str, device: str, causal: bool, ridge: float, seed: int) -> None:
    """Refuse, before anything is allocated, a comparison that cannot fit in the memory ``device``
    has free (as ``solve`` refuses a solve)."""
    from structinit.solver.config import SolveConfig
    from structinit.solver.run import available_memory
    from structinit.solver.run import estimate_memory as solve_memory

    config = SolveConfig(grid=grid, dim=dim, heads=heads, filter=filter_size, recipe="fast",
                         params={"target_mass": 0.9, "ridge": ridge}, padding=padding, offset_order="centre",
                         seed=seed, causal=causal)
    need = exactness_memory(grid.tokens, heads, grid.ndim, filter_size, channels, out_channels) + solve_memory(config)
    free = available_memory(device)
    if free is not None and need > free:
        gib = 2 ** 30
        raise StructinitError(f"the comparison on {grid.tokens} tokens with {channels} input and {out_channels} "
                              f"output channels needs about {need / gib:.1f} GiB of memory on {device}, and only "
                              f"{free / gib:.1f} GiB is free; try fewer {param('channels')} or "
                              f"{param('out_channels')}")


def run_exactness(grid, filter_size: int = 3, *, masses: Sequence[float] = DEFAULT_MASSES,
                  paddings: Iterable[str] = PADDINGS, channels: int = 4, out_channels: Optional[int] = None,
                  dim: Optional[int] = None, causal: bool = False, ridge: float = DEFAULT_RIDGE, seed: int = 0,
                  device: str = "cpu",
                  on_row: Optional[Callable[[Dict], None]] = None) -> Dict:
    """Compare impulse-initialized multi-head attention with a convolution (see the module
    docstring) at every target mass in ``masses`` and every padding in ``paddings``.

    One head per shift of the window (``f * f`` heads on an image grid, ``f`` on a sequence,
    ``causal``: the past ``f`` positions); ``dim`` defaults to :func:`default_dim`; ``ridge`` is the fast
    recipe's (see :data:`DEFAULT_RIDGE`). ``x: [N, channels]`` and
    the kernel ``[out_channels, channels, f(, f)]`` are standard normal, drawn from ``seed``.

    Returns ``{"setup": {...}, "rows": [...], "monotone": {padding: bool}}``; each row has
    ``padding``, ``target_mass`` (asked), ``reached_mass`` and ``hit_rate`` (the solve's, mean over
    heads), ``rel_error`` (``|attn - conv|_F / |conv|_F`` over the compared positions),
    ``max_abs_error``, ``positions`` (how many were compared) and ``seconds`` (the solve).
    ``monotone[padding]`` says whether ``rel_error`` falls strictly as the mass rises.
    """
    import torch

    from structinit.geometry.targets import causal_mask, window_offsets
    from structinit.solver.config import SolveConfig
    from structinit.solver.run import compute

    grid = Grid(grid)
    paddings, masses = _check_arguments(grid, paddings, masses, channels, out_channels, filter_size, causal)
    heads = filter_size if grid.ndim == 1 else filter_size * filter_size
    dim = dim or default_dim(grid, heads)
    out_channels = out_channels or channels
    _check_memory(grid, heads, dim, filter_size, channels, out_channels, padding=paddings[0], device=device,
                  causal=causal, ridge=ridge, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(grid.tokens, channels, generator=gen, dtype=torch.float64)
    kshape = (out_channels, channels) + (filter_size,) * grid.ndim
    kernel = torch.randn(kshape, generator=gen, dtype=torch.float64)
    inputs = _Inputs(grid, causal, x, kernel, causal_mask(grid, causal), window_offsets(filter_size, grid.ndim, causal))
    rows: List[Dict[str, Any]] = []
    for padding in paddings:
        conv = conv_reference(x, kernel, grid, padding, causal)
        for mass in masses:
            config = SolveConfig(grid=grid, dim=dim, heads=heads, filter=filter_size, recipe="fast",
                                 params={"target_mass": mass, "ridge": ridge}, padding=padding,
                                 offset_order="centre", seed=seed, causal=causal)
            row = inputs.compare(compute(config, device), padding, mass, conv)
            rows.append(row)
            if on_row:
                on_row(row)
    monotone = {}
    for padding in paddings:
        errs = [r["rel_error"] for r in sorted((r for r in rows if r["padding"] == padding),
                                               key=lambda r: r["target_mass"])]
        monotone[padding] = all(b < a for a, b in zip(errs, errs[1:]))
    setup = {"grid": list(grid), "tokens": grid.tokens, "filter": filter_size, "heads": heads, "dim": dim,
             "head_dim": dim // heads, "channels": channels, "out_channels": out_channels, "causal": causal,
             "seed": seed, "recipe": "fast", "ridge": ridge, "offset_order": "centre"}
    return {"setup": setup, "rows": rows, "monotone": monotone}


def _check_arguments(grid: Grid, paddings: Iterable[str], masses: Sequence[float], channels: int,
                     out_channels: Optional[int], filter_size: int, causal: bool) -> Tuple[List[str], List[float]]:
    """:func:`run_exactness`'s paddings and masses as lists, each checked (known, given once; masses
    strictly between 0 and 1), and the channel counts and filter (positive integers); raises
    :class:`UsageError` naming the first that is not."""
    paddings = list(paddings)
    for p in paddings:
        check_choice("padding", p, PADDINGS)
        check_geometry(grid, p, causal)
    if not paddings:
        raise UsageError(f"give at least one {param('padding')}")
    twice = sorted({p for p in paddings if paddings.count(p) > 1})
    if twice:
        raise UsageError(f"{param('padding')} {twice[0]} is given twice; each padding is compared once")
    masses = [float(m) for m in masses]
    if not masses or any(not 0 < m < 1 for m in masses):
        raise UsageError(f"{param('masses')} must be numbers strictly between 0 and 1, got {masses}")
    twice_mass = sorted({m for m in masses if masses.count(m) > 1})
    if twice_mass:
        raise UsageError(f"{param('masses')} {twice_mass[0]:g} is given twice; the verdict compares each mass with the "
                         "next larger one, so give each once")
    for name, value in (("channels", channels), ("out_channels", out_channels), ("filter", filter_size)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise UsageError(f"{param(name)} must be a positive integer, got {value!r}")
    return paddings, masses


@dataclass
class _Inputs:
    """What every row of :func:`run_exactness` compares on: the tokens ``x: [N, C_in]`` and the
    ``kernel: [C_out, C_in, f(, f)]`` (float64), the attention ``mask`` (``causal``; ``None`` when
    not) and the window's ``shifts: [heads, 2]``, one head each."""

    grid: Grid
    causal: bool
    x: Any
    kernel: Any
    mask: Any
    shifts: np.ndarray

    def compare(self, art: Any, padding: str, mass: float, conv: Any) -> Dict[str, Any]:
        """One row: the attention of the solved artifact ``art`` (at ``mass``, with ``padding``) through
        the kernel's taps, against the convolution ``conv: [N, C_out]`` on the positions where every
        shift lands inside the grid."""
        import torch

        from structinit.analysis.quality import attention_maps
        from structinit.geometry.targets import impulse_columns

        offsets = art.offsets[0]
        if sorted(map(tuple, offsets.tolist())) != sorted(map(tuple, self.shifts.tolist())):
            raise StructinitError(f"the solve did not give one head per shift: {offsets.tolist()}")
        attn = attention_maps(torch.from_numpy(art.pseudo_input).unsqueeze(0), torch.from_numpy(art.q[0]),
                              torch.from_numpy(art.k[0]), self.mask).double()
        out = attention_conv(attn, self.x, kernel_taps(self.kernel, offsets, self.causal))
        inside = (impulse_columns(self.grid, offsets, padding) >= 0).all(0)  # every shift lands in the grid
        keep = torch.from_numpy(inside)
        diff = (out - conv)[keep]
        return {"padding": padding, "target_mass": mass,
                "reached_mass": float(art.stats["summary"]["target_mass"]),
                "hit_rate": float(art.stats["summary"]["hit_rate"]),
                "rel_error": float(diff.norm() / conv[keep].norm().clamp(min=1e-300)),
                "max_abs_error": float(diff.abs().max()) if diff.numel() else 0.0,
                "positions": int(keep.sum()), "seconds": float(art.stats["seconds"])}


def exactness_table(result: Dict) -> str:
    """Plain-text table of :func:`run_exactness`'s result."""
    s = result["setup"]
    where = f"a sequence of {s['tokens']}" if len(s["grid"]) == 1 else f"the {'x'.join(map(str, s['grid']))} grid"
    window = (f"{s['filter']}" if len(s["grid"]) == 1 else f"{s['filter']}x{s['filter']}") + \
        (" causal" if s["causal"] else "")
    lines = [f"attention = convolution (Cordonnier et al., Lemma 1) on {where}: {s['heads']} heads, one per shift of "
             f"the {window} kernel, dim {s['dim']} ({s['head_dim']} per head), {s['channels']} -> "
             f"{s['out_channels']} channels, fast recipe with ridge {s['ridge']:g}, seed {s['seed']}",
             f"{'padding':<9} {'mass':>7} {'reached':>8} {'hit':>6} {'rel error':>10} {'max |diff|':>11} "
             f"{'positions':>9}"]
    for r in result["rows"]:
        lines.append(f"{r['padding']:<9} {r['target_mass']:>7.4g} {r['reached_mass']:>8.5f} {r['hit_rate']:>6.3f} "
                     f"{r['rel_error']:>10.3e} {r['max_abs_error']:>11.3e} {r['positions']:>9}")
    for padding, ok in result["monotone"].items():
        lines.append(f"{padding} padding: the error {'falls' if ok else 'does NOT fall'} monotonically as the mass "
                     "rises" + ("" if padding == "circular" else " (compared away from the border)"))
    return "\n".join(lines)
