"""What an impulse artifact must fit before it is written into a target: the model's shape and
layers (:func:`check_artifact`) and its attention mask (:func:`check_causal`)."""

from __future__ import annotations

from typing import Sequence

from structinit.errors import UsageError, param
from structinit.geometry.grid import Grid


def check_artifact(artifact, grid: Grid, dim: int, heads: int, layers: Sequence[int]) -> None:
    """Raise :class:`UsageError` unless ``artifact`` fits a model of this shape and these layers
    (an artifact of one layer is reused for every layer)."""
    c = artifact.config
    problems = []
    if c.dim != dim:
        problems.append(f"dim {c.dim} vs {dim}")
    if c.heads != heads:
        problems.append(f"heads {c.heads} vs {heads}")
    if tuple(c.grid) != tuple(grid):
        problems.append(f"grid {c.grid.describe()} vs {Grid(grid).describe()}")
    if problems:
        raise UsageError(f"the {param('artifact')} does not fit the model: {'; '.join(problems)} (artifact vs model)")
    if c.layers != 1 and max(layers) >= c.layers:
        raise UsageError(f"the {param('artifact')} has {c.layers} layers but layer {max(layers)} was asked for")


def check_causal(target, causal: bool) -> None:
    """Raise :class:`UsageError` when causal offsets meet a model that attends both ways, or
    non-causal ones a decoder that masks later tokens (``target.causal``; ``None`` accepts both)."""
    if target.causal is True and not causal:
        raise UsageError(f"the {target.layout} model attends only to earlier tokens (a causal mask); pass "
                         f"{param('causal')} so that every offset lies in the past")
    if target.causal is False and causal:
        raise UsageError(f"{param('causal')} solves for a decoder's causal mask, but the {target.layout} model "
                         "attends in both directions")


__all__ = ["check_artifact", "check_causal"]
