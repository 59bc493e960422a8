"""Impulse filters as attention targets.

An impulse filter with offset ``(dy, dx)`` makes token ``(y, x)`` attend to token
``(y + dy, x + dx)`` (see :mod:`structinit.geometry.grid` for the token order; a sequence is a
``1 x L`` grid with offsets ``(0, dx)``). Kernel position ``k`` of an ``f x f`` filter has offset
``(k // f - f // 2, k % f - f // 2)``; on a sequence, position ``k`` of a length-``f`` window has
offset ``(0, k - f // 2)``, or ``(0, k - (f - 1))`` when the window is *causal* (only the current
and past tokens, what a decoder's attention mask lets a query see).

A target is kept in two forms: its column per query row, int64 ``[..., N]`` with ``-1`` where the
source falls outside the grid (:func:`impulse_columns`, O(N)), and the dense ``N x N`` 0/1 matrix
(:func:`impulse_matrix`) for the solvers that need it.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

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


def kernel_offset_1d(k: int, filter_size: int, causal: bool = False) -> Tuple[int, int]:
    """Offset ``(0, dx)`` of position ``k`` (0-based) of a length-``f`` window on a sequence:
    ``dx = k - f // 2`` (centred), or ``dx = k - (f - 1)`` (causal: ``-(f - 1) .. 0``)."""
    return 0, k - (filter_size - 1 if causal else filter_size // 2)


def centre_first_order_1d(filter_size: int, causal: bool = False) -> List[int]:
    """Window positions of a sequence filter, the current token first, then by distance (the earlier
    token first on a tie): ``dx = 0, -1, +1, -2, +2, ...``; causal: ``0, -1, -2, ...``."""

    def rank(k: int):
        dx = kernel_offset_1d(k, filter_size, causal)[1]
        return (abs(dx), dx > 0, k)

    return sorted(range(filter_size), key=rank)


def window_offsets(filter_size: int, ndim: int = 2, causal: bool = False) -> np.ndarray:
    """Every offset of the filter window, int32 ``[f * f, 2]`` (image grids, row-major) or
    ``[f, 2]`` (sequences), in kernel-position order."""
    if ndim == 1:
        offs = [kernel_offset_1d(k, filter_size, causal) for k in range(filter_size)]
    else:
        offs = [kernel_offset(k, filter_size) for k in range(filter_size * filter_size)]
    return np.array(offs, dtype=np.int32).reshape(-1, 2)


def check_geometry(grid: Grid, padding: str = "zero", causal: bool = False) -> None:
    """Raise :class:`UsageError` for a geometry that cannot exist: a causal window on an image grid,
    or a causal window with circular padding (wrapping would point at future tokens, which a causal
    mask hides)."""
    check_choice("padding", padding, PADDINGS)
    if causal and Grid(grid).ndim != 1:
        raise UsageError(f"{param('causal')} applies to sequences (a 1-D grid such as 40), not the "
                         f"{Grid(grid).describe()} image grid")
    if causal and padding == "circular":
        raise UsageError(f"{param('causal')} needs zero padding: circular {param('padding')} wraps the first "
                         "tokens' window around to the end of the sequence, which a causal mask hides")


def check_choice(name: str, value: str, choices: Sequence[str]) -> str:
    """``value`` if it is one of ``choices``, else a :class:`UsageError` naming parameter ``name``."""
    if value not in choices:
        raise UsageError(f"unknown {param(name)} {value!r}; choose one of {', '.join(choices)}")
    return value


def draw_offsets(filter_size: int, heads: int, layers: int, seed: int, order: str = "random", ndim: int = 2,
                 causal: bool = False) -> np.ndarray:
    """Offsets for every head: int32 ``[layers, heads, 2]`` as ``(dy, dx)`` (``dy = 0`` on a sequence).

    The window is ``f x f`` on an image grid (``ndim=2``) and ``f`` positions on a sequence
    (``ndim=1``; ``causal``: the current and ``f - 1`` past tokens). ``random``: each head draws a
    window position uniformly (independently per layer), from a NumPy generator seeded with
    ``seed``. ``centre``: head ``h`` takes the ``h``-th position of :func:`centre_first_order`
    (:func:`centre_first_order_1d` on a sequence), cycling when there are more heads than positions,
    in every layer; with as many heads as positions every offset is used once.
    """
    check_choice("offset_order", order, OFFSET_ORDERS)
    if ndim not in (1, 2):
        raise UsageError(f"a grid has 1 or 2 dimensions, got {ndim}")
    if causal and ndim != 1:
        raise UsageError(f"{param('causal')} applies to sequences (1-D grids) only")
    positions = filter_size * filter_size if ndim == 2 else filter_size
    if order == "random":
        rng = np.random.default_rng(seed)
        ks = rng.integers(0, positions, size=(layers, heads))
    else:
        seq = centre_first_order(filter_size) if ndim == 2 else centre_first_order_1d(filter_size, causal)
        ks = np.array([[seq[h % len(seq)] for h in range(heads)]] * layers)
    out = np.zeros((layers, heads, 2), dtype=np.int32)
    for l in range(layers):
        for h in range(heads):
            k = int(ks[l, h])
            out[l, h] = kernel_offset(k, filter_size) if ndim == 2 else kernel_offset_1d(k, filter_size, causal)
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


def causal_mask(grid: Grid, causal: bool = True) -> Optional[np.ndarray]:
    """The keys each query may attend to under a decoder's causal mask: bool ``[N, N]``, ``True`` on
    and below the diagonal (key position <= query position); ``None`` when not ``causal``."""
    if not causal:
        return None
    n = Grid(grid).tokens
    return np.tril(np.ones((n, n), dtype=bool))


def impulse_targets(grid: Grid, offsets: np.ndarray, padding: str = "zero") -> np.ndarray:
    """Dense targets for every head: float32 ``[..., N, N]`` from offsets ``[..., 2]``."""
    cols = impulse_columns(grid, offsets, padding)
    n = Grid(grid).tokens
    out = np.zeros(cols.shape + (n,), dtype=np.float32)
    keep = cols >= 0
    out[np.nonzero(keep) + (cols[keep],)] = 1.0  # the leading indices of every kept column, then the column
    return out
