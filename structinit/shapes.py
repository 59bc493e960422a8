"""Patch-grid shapes: parsing ``--tokens`` / ``--grid`` and validating (grid, dim, heads, filter)."""

from __future__ import annotations

import math
import re
from typing import Optional, Tuple

from .errors import UsageError

Grid = Tuple[int, int]


def parse_grid(tokens: Optional[int] = None, grid: Optional[str] = None) -> Grid:
    """Return the patch grid ``(H, W)`` from a token count (a perfect square) or an ``HxW`` string."""
    if grid is not None:
        m = re.fullmatch(r"\s*(\d+)\s*[xX*,]\s*(\d+)\s*", str(grid))
        if not m:
            raise UsageError(f"--grid must look like HxW (e.g. 16x16), got {grid!r}")
        h, w = int(m.group(1)), int(m.group(2))
        if h < 1 or w < 1:
            raise UsageError(f"--grid sides must be positive, got {grid!r}")
        if tokens is not None and tokens != h * w:
            raise UsageError(f"--tokens {tokens} does not match --grid {h}x{w} ({h * w} tokens)")
        return h, w
    if tokens is None:
        raise UsageError("give --tokens N (a perfect square) or --grid HxW")
    if tokens < 1:
        raise UsageError(f"--tokens must be positive, got {tokens}")
    side = math.isqrt(tokens)
    if side * side != tokens:
        raise UsageError(f"--tokens {tokens} is not a perfect square; give the grid with --grid HxW")
    return side, side


def validate_shape(grid: Grid, dim: int, heads: int, filter_size: int, layers: int = 1) -> int:
    """Check a solve shape and return ``head_dim = dim // heads``; raises :class:`UsageError`."""
    h, w = grid
    for name, value in (("--dim", dim), ("--heads", heads), ("--filter", filter_size), ("--layers", layers)):
        if value < 1:
            raise UsageError(f"{name} must be a positive integer, got {value}")
    if dim % heads:
        raise UsageError(f"--dim {dim} is not divisible by --heads {heads}")
    if dim % 4:
        raise UsageError(f"--dim {dim} must be divisible by 4 (2-D sin-cos position embedding)")
    if filter_size > min(h, w):
        raise UsageError(f"--filter {filter_size} is larger than the {h}x{w} grid")
    return dim // heads


def grid_label(grid: Grid) -> str:
    """``n{N}`` for a square grid, ``g{H}x{W}`` otherwise (used in artifact file names)."""
    h, w = grid
    return f"n{h * w}" if h == w else f"g{h}x{w}"
