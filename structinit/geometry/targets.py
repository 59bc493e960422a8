"""Impulse filters as attention targets.

An impulse filter with offset ``(dy, dx)`` makes token ``(y, x)`` attend to token
``(y + dy, x + dx)`` (see :mod:`structinit.geometry.grid` for the token order; a sequence is a
``1 x L`` grid with offsets ``(0, dx)``). Kernel position ``k`` of an ``f x f`` filter has offset
``(k // f - f // 2, k % f - f // 2)``.

A target is kept in two forms: its column per query row, int64 ``[..., N]`` with ``-1`` where the
source falls outside the grid (:func:`impulse_columns`, O(N)), and the dense ``N x N`` 0/1 matrix
(:func:`impulse_matrix`) for the solvers that need it.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import numpy as np

from structinit.errors import UsageError, param
from structinit.geometry.grid import Grid

OFFSET_ORDERS = ("random", "centre")
PADDINGS = ("zero", "circular")

# The authors' later code assigns 3x3 kernel positions deterministically, centre first.
_CENTRE_FIRST_3X3 = (4, 1, 5, 3, 7, 0, 2, 6, 8)


def kernel_offset(k: int, filter_size: int) -> Tuple[int, int]:
    """Offset ``(dy, dx)`` of kernel position ``k`` (0-based, row-major) of an ``f x f`` filter."""
    return k // filter_size - filter_size // 2, k % filter_size - filter_size // 2


def centre_first_order(filter_size: int) -> List[int]:
    """Kernel positions centre first (the authors' 4,1,5,3,7,0,2,6,8 for f=3), then ring by ring."""
    if filter_size == 3:
        return list(_CENTRE_FIRST_3X3)

    def rank(k: int):
        dy, dx = kernel_offset(k, filter_size)
        return (max(abs(dy), abs(dx)), abs(dy) + abs(dx), k)

    return sorted(range(filter_size * filter_size), key=rank)


def check_choice(name: str, value: str, choices: Sequence[str]) -> str:
    """``value`` if it is one of ``choices``, else a :class:`UsageError` naming parameter ``name``."""
    if value not in choices:
        raise UsageError(f"unknown {param(name)} {value!r}; choose one of {', '.join(choices)}")
    return value


def draw_offsets(filter_size: int, heads: int, layers: int, seed: int, order: str = "random") -> np.ndarray:
    """Offsets for every head: int32 ``[layers, heads, 2]`` as ``(dy, dx)``.

    ``random``: each head draws a kernel position uniformly (independently per layer), from a
    NumPy generator seeded with ``seed``. ``centre``: head ``h`` takes the ``h``-th position of
    :func:`centre_first_order` (cycling when there are more heads than positions), in every layer.
    """
    check_choice("offset_order", order, OFFSET_ORDERS)
    if order == "random":
        rng = np.random.default_rng(seed)
        ks = rng.integers(0, filter_size * filter_size, size=(layers, heads))
    else:
        seq = centre_first_order(filter_size)
        ks = np.array([[seq[h % len(seq)] for h in range(heads)]] * layers)
    out = np.zeros((layers, heads, 2), dtype=np.int32)
    for l in range(layers):
        for h in range(heads):
            out[l, h] = kernel_offset(int(ks[l, h]), filter_size)
    return out


def impulse_columns(grid: Grid, offsets: np.ndarray, padding: str = "zero") -> np.ndarray:
    """The target column of every query row: int64 ``[..., N]`` from offsets ``[..., 2]``.

    Row ``(y, x)`` targets ``(y + dy, x + dx)``; with ``zero`` padding a source outside the grid
    gives ``-1`` (no target), with ``circular`` padding it wraps around.
    """
    check_choice("padding", padding, PADDINGS)
    h, w = Grid(grid).hw
    offsets = np.asarray(offsets, dtype=np.int64)
    ys, xs = np.divmod(np.arange(h * w), w)
    sy = ys + offsets[..., 0:1]
    sx = xs + offsets[..., 1:2]
    if padding == "circular":
        return (sy % h) * w + (sx % w)
    inside = (sy >= 0) & (sy < h) & (sx >= 0) & (sx < w)
    return np.where(inside, sy * w + sx, -1)


def impulse_matrix(grid: Grid, offset: Sequence[int], padding: str = "zero") -> np.ndarray:
    """The ``N x N`` float32 impulse convolution matrix ``T`` for one offset.

    ``T @ vec(img)`` is the image shifted so that ``out[y, x] = img[y + dy, x + dx]``; with
    ``zero`` padding a row whose source falls outside the grid is all zeros, with ``circular``
    padding the source wraps around (a BCCB matrix).
    """
    return impulse_targets(grid, np.asarray(offset)[None], padding)[0]


def impulse_targets(grid: Grid, offsets: np.ndarray, padding: str = "zero") -> np.ndarray:
    """Dense targets for every head: float32 ``[..., N, N]`` from offsets ``[..., 2]``."""
    cols = impulse_columns(grid, offsets, padding)
    n = Grid(grid).tokens
    out = np.zeros(cols.shape + (n,), dtype=np.float32)
    lead = np.indices(cols.shape)
    keep = cols >= 0
    out[tuple(ix[keep] for ix in lead) + (cols[keep],)] = 1.0
    return out
