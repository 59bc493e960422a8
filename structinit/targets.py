"""Impulse filters as attention targets.

Tokens are numbered row-major on an ``H x W`` patch grid: token ``(y, x)`` is index ``y * W + x``
(the order timm's patch embedding flattens in). An impulse filter with offset ``(dy, dx)`` makes
token ``(y, x)`` attend to token ``(y + dy, x + dx)``. Kernel position ``k`` of an ``f x f`` filter
has offset ``(k // f - f // 2, k % f - f // 2)``.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import numpy as np

from .errors import UsageError
from .shapes import Grid

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


def draw_offsets(filter_size: int, heads: int, layers: int, seed: int, order: str = "random") -> np.ndarray:
    """Offsets for every head: int32 ``[layers, heads, 2]`` as ``(dy, dx)``.

    ``random``: each head draws a kernel position uniformly (independently per layer), from a
    NumPy generator seeded with ``seed``. ``centre``: head ``h`` takes the ``h``-th position of
    :func:`centre_first_order` (cycling when there are more heads than positions), in every layer.
    """
    if order not in OFFSET_ORDERS:
        raise UsageError(f"unknown offset order {order!r}; choose one of {', '.join(OFFSET_ORDERS)}")
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


def impulse_matrix(grid: Grid, offset: Sequence[int], padding: str = "zero") -> np.ndarray:
    """The ``N x N`` float32 impulse convolution matrix ``T`` for one offset.

    ``T @ vec(img)`` is the image shifted so that ``out[y, x] = img[y + dy, x + dx]``; with
    ``zero`` padding a row whose source falls outside the grid is all zeros, with ``circular``
    padding the source wraps around (a BCCB matrix).
    """
    if padding not in PADDINGS:
        raise UsageError(f"unknown padding {padding!r}; choose one of {', '.join(PADDINGS)}")
    h, w = grid
    dy, dx = int(offset[0]), int(offset[1])
    ys, xs = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    sy, sx = ys + dy, xs + dx
    rows = (ys * w + xs).ravel()
    if padding == "circular":
        sy, sx = sy % h, sx % w
        keep = np.ones(h * w, dtype=bool)
    else:
        keep = ((sy >= 0) & (sy < h) & (sx >= 0) & (sx < w)).ravel()
    cols = (sy * w + sx).ravel()
    t = np.zeros((h * w, h * w), dtype=np.float32)
    t[rows[keep], cols[keep]] = 1.0
    return t


def impulse_targets(grid: Grid, offsets: np.ndarray, padding: str = "zero") -> np.ndarray:
    """Targets for every head: float32 ``[..., N, N]`` from offsets ``[..., 2]``."""
    offsets = np.asarray(offsets)
    lead = offsets.shape[:-1]
    flat = offsets.reshape(-1, 2)
    n = grid[0] * grid[1]
    mats = np.stack([impulse_matrix(grid, o, padding) for o in flat]) if len(flat) else np.zeros((0, n, n), np.float32)
    return mats.reshape(*lead, n, n)
