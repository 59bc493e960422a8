"""Token grids, one type for sequences and images: ``Grid((L,))`` or ``Grid((H, W))``.

Tokens are numbered row-major: token ``(y, x)`` of an ``H x W`` grid is index ``y * W + x`` (the
order timm's patch embedding flattens in); a sequence of ``L`` tokens behaves as a ``1 x L`` grid
(:attr:`Grid.hw`) wherever offsets and shifts are computed.
"""

from __future__ import annotations

import math
import re
from typing import Iterable, Optional, Tuple, Union

from structinit.errors import UsageError, param

#: What a function that takes a grid accepts: a :class:`Grid`, its sides, or one side (a sequence).
GridLike = Union[int, Iterable[int]]


class Grid(tuple):
    """A token grid: ``(L,)`` (a sequence) or ``(H, W)`` (an image's patch grid). A tuple, so
    ``h, w = grid`` works for 2-D grids and a grid compares equal to the tuple of its sides."""

    def __new__(cls, sides: GridLike) -> Grid:
        if isinstance(sides, Grid):
            return sides
        try:
            dims = (int(sides),) if isinstance(sides, int) else tuple(int(s) for s in sides)
        except (TypeError, ValueError):
            raise UsageError(f"{param('grid')} must be one side (a sequence) or two (H, W), got {sides!r}") from None
        if len(dims) not in (1, 2) or any(d < 1 for d in dims):
            raise UsageError(f"{param('grid')} must be one side (a sequence) or two (H, W), each positive, "
                             f"got {sides!r}")
        return super().__new__(cls, dims)

    @property
    def ndim(self) -> int:
        """1 for a sequence, 2 for an image grid."""
        return len(self)

    @property
    def tokens(self) -> int:
        """Number of tokens ``N`` (``L`` or ``H * W``)."""
        return math.prod(self)

    @property
    def hw(self) -> Tuple[int, int]:
        """``(H, W)``; a sequence of ``L`` tokens is ``(1, L)``."""
        return (1, self[0]) if len(self) == 1 else (self[0], self[1])

    @property
    def label(self) -> str:
        """File-name label: ``n{N}`` for a square grid, ``g{H}x{W}`` otherwise, ``s{L}`` for a sequence."""
        if len(self) == 1:
            return f"s{self[0]}"
        h, w = self
        return f"n{h * w}" if h == w else f"g{h}x{w}"

    def describe(self) -> str:
        """``16x16`` or ``40`` (a sequence)."""
        return "x".join(str(s) for s in self)

    def __repr__(self) -> str:
        return f"Grid({self.describe()})"


def parse_grid(tokens: Optional[int] = None, grid: Optional[str] = None) -> Grid:
    """A :class:`Grid` from a token count (a perfect square: a square image grid) or a string:
    ``HxW`` (an image grid) or ``L`` (a sequence of ``L`` tokens)."""
    if grid is not None:
        text = str(grid).strip()
        m2 = re.fullmatch(r"(\d+)\s*[xX*,]\s*(\d+)", text)
        m1 = re.fullmatch(r"\d+", text)
        if not (m1 or m2):
            raise UsageError(f"{param('grid')} must look like HxW (e.g. 16x16) or L (a sequence), got {grid!r}")
        g = Grid((int(m2.group(1)), int(m2.group(2))) if m2 else (int(text),))
        if tokens is not None and g.ndim == 1:
            raise UsageError(f"{param('tokens')} gives a square image grid; a sequence is {param('grid')} L alone "
                             f"(got {param('tokens')} {tokens} with {param('grid')} {g.describe()})")
        if tokens is not None and tokens != g.tokens:
            raise UsageError(f"{param('tokens')} {tokens} does not match {param('grid')} {g.describe()} "
                             f"({g.tokens} tokens)")
        return g
    if tokens is None:
        raise UsageError(f"give {param('tokens')} N (a perfect square) or {param('grid')} HxW")
    if tokens < 1:
        raise UsageError(f"{param('tokens')} must be positive, got {tokens}")
    side = math.isqrt(tokens)
    if side * side != tokens:
        raise UsageError(f"{param('tokens')} {tokens} is not a perfect square; give the grid with {param('grid')} "
                         "HxW (or L for a sequence)")
    return Grid((side, side))


def validate_shape(grid: Grid, dim: int, heads: int, filter_size: int, layers: int = 1) -> int:
    """Check a solve shape and return ``head_dim = dim // heads``; raises :class:`UsageError`.

    ``dim`` must be divisible by 4 on a 2-D grid (the 2-D sin-cos embedding) and by 2 on a sequence;
    the ``filter`` window must fit in the grid.
    """
    grid = Grid(grid)
    for name, value in (("dim", dim), ("heads", heads), ("filter", filter_size), ("layers", layers)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UsageError(f"{param(name)} must be a positive integer, got {value!r}")
    if dim % heads:
        raise UsageError(f"{param('dim')} {dim} is not divisible by {param('heads')} {heads}")
    multiple = 4 if grid.ndim == 2 else 2
    if dim % multiple:
        raise UsageError(f"{param('dim')} {dim} must be divisible by {multiple} (the {grid.ndim}-D sin-cos "
                         "position embedding)")
    if filter_size > min(grid):
        if grid.ndim == 1:
            raise UsageError(f"{param('filter')} {filter_size} is longer than the sequence of {grid[0]} tokens")
        raise UsageError(f"{param('filter')} {filter_size} is larger than the {grid.describe()} grid")
    return dim // heads
