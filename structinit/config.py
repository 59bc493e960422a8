"""The settings of one solve, their canonical JSON and the artifact key derived from it."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from .errors import UsageError
from .pseudo_input import PSEUDO_INPUTS
from .shapes import Grid, grid_label, validate_shape
from .recipes import RECIPES, recipe_params
from .targets import OFFSET_ORDERS, PADDINGS

FORMAT = "structinit/1"
KEY_LENGTH = 12


@dataclass(frozen=True)
class SolveConfig:
    """Every setting that changes a solve's result (and nothing else: no device, no paths).

    ``grid`` is the ``(H, W)`` patch grid; ``layers`` the number of attention layers; ``share``
    solves once and reuses the result for every layer (the released code's default);
    ``pseudo_input_rest`` is the pseudo input of layers after the first (``None``: same as first);
    ``offset_order`` is ``random`` (a uniform draw per head and layer) or ``centre``.
    """

    grid: Grid
    dim: int
    heads: int
    filter: int = 3
    layers: int = 1
    share: bool = False
    recipe: str = "fast"
    params: Dict[str, Any] = field(default_factory=dict)
    pseudo_input: str = "pe"
    pseudo_input_rest: Optional[str] = None
    padding: str = "zero"
    offset_order: str = "random"
    seed: int = 0

    def __post_init__(self):
        object.__setattr__(self, "grid", (int(self.grid[0]), int(self.grid[1])))
        validate_shape(self.grid, self.dim, self.heads, self.filter, self.layers)
        if self.recipe not in RECIPES:
            raise UsageError(f"unknown recipe {self.recipe!r}; choose one of {', '.join(RECIPES)}")
        object.__setattr__(self, "params", recipe_params(self.recipe, self.params))
        for name, value in (("pseudo input", self.pseudo_input), ("pseudo input (rest)", self.pseudo_input_rest)):
            if value is not None and value not in PSEUDO_INPUTS:
                raise UsageError(f"unknown {name} {value!r}; choose one of {', '.join(PSEUDO_INPUTS)}")
        if self.pseudo_input_rest == self.pseudo_input:
            object.__setattr__(self, "pseudo_input_rest", None)
        if self.padding not in PADDINGS:
            raise UsageError(f"unknown padding {self.padding!r}; choose one of {', '.join(PADDINGS)}")
        if self.offset_order not in OFFSET_ORDERS:
            raise UsageError(f"unknown offset order {self.offset_order!r}; choose one of {', '.join(OFFSET_ORDERS)}")

    @property
    def tokens(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    def to_dict(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        d["grid"] = list(self.grid)
        d["format"] = FORMAT
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "SolveConfig":
        d = {k: v for k, v in d.items() if k != "format"}
        d["grid"] = tuple(d["grid"])
        return cls(**d)

    def canonical_json(self) -> str:
        """Sorted-key, whitespace-free JSON of :meth:`to_dict` (what the key hashes)."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @property
    def key(self) -> str:
        """Short hash (12 hex digits of SHA-256) of the canonical JSON."""
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()[:KEY_LENGTH]

    @property
    def filename(self) -> str:
        """``n{N}-d{D}-h{heads}-f{f}-{key}.safetensors`` (``g{H}x{W}`` for non-square grids)."""
        return f"{grid_label(self.grid)}-d{self.dim}-h{self.heads}-f{self.filter}-{self.key}.safetensors"

    def describe(self) -> str:
        h, w = self.grid
        share = " shared" if self.share else ""
        return (f"{h}x{w} grid, dim {self.dim}, {self.heads} heads, filter {self.filter}, "
                f"{self.layers} layer(s){share}, recipe {self.recipe}")
