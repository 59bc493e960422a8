"""Position embeddings in models and state dicts: the one writer of the fixed sin-cos table, and
the check of which embedding a tensor holds.

A position-embedding tensor is ``[1, prefix + N, D]``: ``prefix`` class/register token rows, then
one row per token of the grid; or, in sequence models (BERT, GPT-2), a table ``[P, D]`` with one row
per position ``0 .. P-1`` of which a sequence of ``N <= P`` tokens uses the first ``N``. The sin-cos
table is :func:`structinit.geometry.embedding.sincos` (1-D for a sequence, 2-D for an image grid),
the same one the solvers fit attention on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import numpy as np

from structinit.errors import UsageError, param
from structinit.geometry.grid import Grid, GridLike
from structinit.init.family import model_grid

if TYPE_CHECKING:
    import torch


def write_sincos(pe: torch.Tensor, grid: GridLike, scale: float = 1.0, zero_prefix: bool = False,
                 name: str = "pos_embed") -> str:
    """Write ``scale * sincos(grid, D)`` into the last ``N`` rows of ``pe [1, prefix + N, D]`` in
    place (its own dtype and device); ``zero_prefix`` also zeroes the prefix rows. Returns what was
    replaced, e.g. ``pos_embed[0, 1:65]``.

    A sequence model's table ``pe [P, D]`` (``grid`` a sequence of ``N <= P``) gets the 1-D table of
    all ``P`` positions (its first ``N`` rows are exactly ``sincos(grid, D)``: a position's 1-D
    sin-cos row does not depend on the sequence length); returns e.g. ``wpe.weight[0:1024]``."""
    import torch

    from structinit.geometry.embedding import sincos, sincos_1d

    grid = Grid(grid)
    scale = float(scale)
    if not np.isfinite(scale):
        raise UsageError(f"{param('pe_scale')} must be finite, got {scale}")
    if pe.dim() == 2:
        if grid.ndim != 1 or grid.tokens > pe.shape[0]:
            raise UsageError(f"{name} of shape {list(pe.shape)} is a table of {pe.shape[0]} positions; it cannot hold "
                             f"the {grid.describe()} grid")
        table = torch.from_numpy(sincos_1d(pe.shape[0], pe.shape[1])) * scale
        with torch.no_grad():
            pe.copy_(table)  # copy_ casts to pe's dtype and device
        return f"{name}[0:{pe.shape[0]}]"
    n = grid.tokens
    if pe.dim() != 3 or pe.shape[1] < n:
        raise UsageError(f"{name} of shape {list(pe.shape)} cannot hold a {grid.describe()} grid")
    table = torch.from_numpy(sincos(grid, pe.shape[-1])) * scale
    start = pe.shape[1] - n
    with torch.no_grad():
        if zero_prefix and start:
            pe[0, :start].zero_()
        pe[0, start:].copy_(table)
    return f"{name}[0, {start}:{pe.shape[1]}]"


def set_sincos_pos_embed(model: torch.nn.Module, grid: Optional[GridLike] = None, scale: float = 1.0,
                         zero_prefix: bool = False) -> str:
    """Write the sin-cos table (times ``scale``) into ``model.pos_embed`` and freeze it
    (``requires_grad=False``); ``grid`` defaults to the model's patch grid."""
    import torch

    pe = getattr(model, "pos_embed", None)
    if not isinstance(pe, torch.Tensor):
        raise UsageError("the model has no pos_embed tensor (create it with a position embedding)")
    written = write_sincos(pe, grid if grid is not None else model_grid(model), scale, zero_prefix)
    pe.requires_grad_(False)
    return written


def pe_kind(pe: torch.Tensor, grid: GridLike) -> str:
    """Which embedding ``pe [1, prefix + N, D]`` holds in its last ``N`` rows (a sequence model's
    table ``[P, D]``: in its first ``N``): ``sincos``, ``sincos xS`` (scaled by S), or ``other``."""
    import torch

    from structinit.geometry.embedding import sincos

    grid = Grid(grid)
    eps = torch.finfo(pe.dtype).eps if pe.is_floating_point() else 0.0  # a table stored in half precision
    rows = pe.detach().to("cpu", dtype=torch.float32).reshape(-1, pe.shape[-1]).numpy()
    patch = rows[:grid.tokens] if pe.dim() == 2 else rows[rows.shape[0] - grid.tokens:]
    table = sincos(grid, rows.shape[-1])
    scale = float((patch * table).sum() / max(float((table * table).sum()), 1e-12))
    tol = max(1e-4, 4 * eps)  # relative; half precision rounds each value by up to an eps
    if scale > 0 and np.allclose(patch, scale * table, atol=tol * max(1.0, abs(scale))):
        return "sincos" if abs(scale - 1) < tol else f"sincos x{scale:.4g}"
    return "other"
