"""The settings of one solve, their canonical JSON and the artifact key derived from it."""

from __future__ import annotations

import dataclasses
import hashlib
import re
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import numpy as np
import numpy.typing as npt

from structinit.errors import UsageError, param
from structinit.geometry.embedding import PSEUDO_INPUTS
from structinit.geometry.grid import Grid, validate_shape
from structinit.geometry.targets import OFFSET_ORDERS, PADDINGS, check_choice, check_geometry
from structinit.keys import canonical_json, text_key
from structinit.solver.recipes import (
    DEFAULT_FILTER,
    DEFAULT_OFFSET_ORDER,
    DEFAULT_PADDING,
    DEFAULT_PSEUDO_INPUT,
    DEFAULT_RECIPE,
    check_recipe,
    recipe_params,
)

FORMAT = "structinit/1"
#: Settings newer than the format: written into the config (and the key) only when not at these defaults.
OPTIONAL_DEFAULTS: Dict[str, Any] = {"causal": False, "pos_embed": None, "algorithm": 1}


@dataclass(frozen=True)
class SolveConfig:
    """Every setting that changes a solve's result (and nothing else: no device, no paths).

    ``grid`` is the token :class:`~structinit.geometry.grid.Grid` (``(H, W)`` for an image grid,
    ``(L,)`` for a sequence; a tuple is accepted); ``filter`` the window (``f x f`` on an image grid,
    ``f`` positions on a sequence); ``causal`` (sequences only) keeps every offset in the past, for a
    decoder whose causal mask hides later tokens (the solve and its measures then apply that mask);
    ``layers`` the number of attention layers; ``share`` solves once and reuses the
    result for every layer (the released code's default); ``pseudo_input_rest`` is the pseudo input
    of layers after the first (``None``: same as first); ``offset_order`` is ``random`` (a uniform
    draw per head and layer) or ``centre``; ``params`` the recipe's parameters
    (:func:`~structinit.solver.recipes.recipe_params` fills in the defaults); ``pos_embed`` is
    ``None`` for the fixed sin-cos table in a ``pe`` pseudo input, or the
    :func:`embedding_digest` of another position embedding ``[N, D]`` that takes its place (a
    model's own, e.g. a learned one; the solve is then given the array, and the artifact stores
    the pseudo input made from it). ``pos_embed`` is left out of the canonical JSON when ``None``,
    so the keys of sin-cos solves do not depend on it. ``algorithm``: the recipe's version
    (:data:`~structinit.solver.recipes.RECIPE_VERSIONS`; ``None``: the current one), left out of the
    key at 1.
    """

    grid: Grid
    dim: int
    heads: int
    filter: int = DEFAULT_FILTER
    layers: int = 1
    share: bool = False
    recipe: str = DEFAULT_RECIPE
    params: Dict[str, Any] = field(default_factory=dict)
    pseudo_input: str = DEFAULT_PSEUDO_INPUT
    pseudo_input_rest: Optional[str] = None
    padding: str = DEFAULT_PADDING
    offset_order: str = DEFAULT_OFFSET_ORDER
    seed: int = 0
    pos_embed: Optional[str] = None
    causal: bool = False
    algorithm: Optional[int] = None

    def __post_init__(self) -> None:
        from structinit.solver.recipes import RECIPE_VERSIONS

        object.__setattr__(self, "grid", Grid(self.grid))
        validate_shape(self.grid, self.dim, self.heads, self.filter, self.layers)
        check_recipe(self.recipe)
        if self.algorithm is None:
            object.__setattr__(self, "algorithm", RECIPE_VERSIONS[self.recipe])
        if not isinstance(self.algorithm, int) or isinstance(self.algorithm, bool) or self.algorithm < 1:
            raise UsageError(f"{param('algorithm')} must be a positive integer (a recipe's version), got "
                             f"{self.algorithm!r}")
        object.__setattr__(self, "params", recipe_params(self.recipe, self.params))
        check_choice("pseudo_input", self.pseudo_input, PSEUDO_INPUTS)
        if self.pseudo_input_rest is not None:
            check_choice("pseudo_input_rest", self.pseudo_input_rest, PSEUDO_INPUTS)
        if self.pseudo_input_rest == self.pseudo_input:
            object.__setattr__(self, "pseudo_input_rest", None)
        check_choice("padding", self.padding, PADDINGS)
        check_choice("offset_order", self.offset_order, OFFSET_ORDERS)
        if not isinstance(self.causal, bool):
            raise UsageError(f"{param('causal')} must be true or false, got {self.causal!r}")
        check_geometry(self.grid, self.padding, self.causal)
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
        """Every setting as JSON-able values, plus ``format``. Settings added after the format was
        fixed (:data:`OPTIONAL_DEFAULTS`) appear only when they differ from their default, so the
        keys of artifacts written before them stay valid."""
        d = dataclasses.asdict(self)
        d["grid"] = list(self.grid)
        d["format"] = FORMAT
        for name, default in OPTIONAL_DEFAULTS.items():
            if d[name] == default:
                del d[name]
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "SolveConfig":
        """Inverse of :meth:`to_dict`; a dict without ``algorithm`` is version 1 (made before versions
        were recorded), whatever the recipe's version is now."""
        d = {k: v for k, v in d.items() if k != "format"}
        d["grid"] = Grid(d["grid"])
        d.setdefault("algorithm", 1)
        return cls(**d)

    def canonical_json(self) -> str:
        """Sorted-key, whitespace-free JSON of :meth:`to_dict` (what the key hashes)."""
        return canonical_json(self.to_dict())

    @property
    def key(self) -> str:
        """The key (:mod:`structinit.keys`) of the canonical JSON."""
        return text_key(self.canonical_json())

    @property
    def filename(self) -> str:
        """``n{N}-d{D}-h{heads}-f{f}-{key}.safetensors`` (``g{H}x{W}`` for non-square grids)."""
        return f"{self.grid.label}-d{self.dim}-h{self.heads}-f{self.filter}-{self.key}.safetensors"

    def describe(self) -> str:
        share = " shared" if self.share else ""
        where = (f"sequence of {self.grid[0]}" if self.grid.ndim == 1 else f"{self.grid.describe()} grid")
        window = f"filter {self.filter}" + (" causal" if self.causal else "")
        pe = f", fitted to position embedding {self.pos_embed[7:19]}" if self.pos_embed else ""
        return (f"{where}, dim {self.dim}, {self.heads} heads, {window}, "
                f"{self.layers} layer(s){share}, recipe {self.recipe}{pe}")

    def geometry(self) -> Dict[str, Any]:
        """The token geometry in one record: ``ndim``, ``grid``, ``tokens``, ``filter``, ``padding``,
        ``causal`` and the window's ``offsets`` (every offset a head may be given)."""
        from structinit.geometry.targets import window_offsets

        return {"ndim": self.grid.ndim, "grid": list(self.grid), "tokens": self.tokens, "filter": self.filter,
                "padding": self.padding, "causal": self.causal,
                "window": window_offsets(self.filter, self.grid.ndim, self.causal).tolist()}


def embedding_digest(embedding: npt.ArrayLike) -> str:
    """``sha256:<hex>`` of a position embedding ``[N, D]`` as float32 (shape included): the value of
    :attr:`SolveConfig.pos_embed` for a solve on it."""
    arr = np.ascontiguousarray(np.asarray(embedding, dtype=np.float32))
    h = hashlib.sha256(f"{list(arr.shape)}:".encode())
    h.update(arr.tobytes())
    return "sha256:" + h.hexdigest()
