"""The settings of one solve, their canonical JSON and the artifact key derived from it."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import numpy as np

from structinit.errors import UsageError, param
from structinit.geometry.embedding import PSEUDO_INPUTS
from structinit.geometry.grid import Grid, validate_shape
from structinit.geometry.targets import OFFSET_ORDERS, PADDINGS, check_choice
from structinit.solver.recipes import check_recipe, recipe_params

FORMAT = "structinit/1"
KEY_LENGTH = 12


@dataclass(frozen=True)
class SolveConfig:
    """Every setting that changes a solve's result (and nothing else: no device, no paths).

    ``grid`` is the token :class:`~structinit.geometry.grid.Grid` (``(H, W)``; a tuple is
    accepted); ``layers`` the number of attention layers; ``share`` solves once and reuses the
    result for every layer (the released code's default); ``pseudo_input_rest`` is the pseudo input
    of layers after the first (``None``: same as first); ``offset_order`` is ``random`` (a uniform
    draw per head and layer) or ``centre``; ``params`` the recipe's parameters
    (:func:`~structinit.solver.recipes.recipe_params` fills in the defaults); ``pos_embed`` is
    ``None`` for the fixed sin-cos table in a ``pe`` pseudo input, or the
    :func:`embedding_digest` of another position embedding ``[N, D]`` that takes its place (a
    model's own, e.g. a learned one; the solve is then given the array, and the artifact stores
    the pseudo input made from it). ``pos_embed`` is left out of the canonical JSON when ``None``,
    so the keys of sin-cos solves do not depend on it.
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
    pos_embed: Optional[str] = None

    def __post_init__(self):
        object.__setattr__(self, "grid", Grid(self.grid))
        validate_shape(self.grid, self.dim, self.heads, self.filter, self.layers)
        check_recipe(self.recipe)
        object.__setattr__(self, "params", recipe_params(self.recipe, self.params))
        check_choice("pseudo_input", self.pseudo_input, PSEUDO_INPUTS)
        if self.pseudo_input_rest is not None:
            check_choice("pseudo_input_rest", self.pseudo_input_rest, PSEUDO_INPUTS)
        if self.pseudo_input_rest == self.pseudo_input:
            object.__setattr__(self, "pseudo_input_rest", None)
        check_choice("padding", self.padding, PADDINGS)
        check_choice("offset_order", self.offset_order, OFFSET_ORDERS)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise UsageError(f"{param('seed')} must be a non-negative integer, got {self.seed!r}")
        if self.pos_embed is not None:
            if not (isinstance(self.pos_embed, str) and re.fullmatch(r"sha256:[0-9a-f]{64}", self.pos_embed)):
                raise UsageError(f"{param('pos_embed')} must be an embedding digest 'sha256:<64 hex digits>' "
                                 f"(see embedding_digest), got {self.pos_embed!r}")
            if not any(kind.startswith("pe") for kind in (self.pseudo_input, self.pseudo_input_rest) if kind):
                raise UsageError(f"{param('pos_embed')} replaces the sin-cos table of a 'pe' pseudo input, but "
                                 f"{param('pseudo_input')} {self.pseudo_input!r} uses no position embedding")

    @property
    def tokens(self) -> int:
        return self.grid.tokens

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    def to_dict(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        if d["pos_embed"] is None:
            del d["pos_embed"]  # sin-cos solves keep the keys they had before the field existed
        d["grid"] = list(self.grid)
        d["format"] = FORMAT
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "SolveConfig":
        d = {k: v for k, v in d.items() if k != "format"}
        d["grid"] = Grid(d["grid"])
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
        return f"{self.grid.label}-d{self.dim}-h{self.heads}-f{self.filter}-{self.key}.safetensors"

    def describe(self) -> str:
        share = " shared" if self.share else ""
        pe = f", fitted to position embedding {self.pos_embed[7:19]}" if self.pos_embed else ""
        return (f"{self.grid.describe()} grid, dim {self.dim}, {self.heads} heads, filter {self.filter}, "
                f"{self.layers} layer(s){share}, recipe {self.recipe}{pe}")


def embedding_digest(embedding) -> str:
    """``sha256:<hex>`` of a position embedding ``[N, D]`` as float32 (shape included): the value of
    :attr:`SolveConfig.pos_embed` for a solve on it."""
    arr = np.ascontiguousarray(np.asarray(embedding, dtype=np.float32))
    h = hashlib.sha256(f"{list(arr.shape)}:".encode())
    h.update(arr.tobytes())
    return "sha256:" + h.hexdigest()
