"""Impulse initialization ("Structured Initialization for Attention in Vision Transformers"): Q/K
of every selected layer from a solved artifact, so that each head's attention starts as an
impulse filter (one offset in an ``f x f`` window).

The artifact is given (an :class:`~structinit.solver.artifact.Artifact`, a path or a cache key) or
solved now (and cached) for the target's shape with the spec's settings (:meth:`ImpulseInit.solve_config`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from structinit.errors import StructinitError, UsageError, param
from structinit.geometry.embedding import PSEUDO_INPUTS
from structinit.geometry.grid import Grid
from structinit.geometry.targets import OFFSET_ORDERS, PADDINGS, check_choice
from structinit.init.base import InitSpec
from structinit.init.baselines import BASES, apply_base, generator
from structinit.init.mimetic import mimetic_v_proj, vproj_keys
from structinit.solver.recipes import check_recipe, recipe_params

#: What the data fit runs on: the batch given (``data``), or Gaussian noise inputs in the model's
#: normalized input space (``noise``: no dataset needed; see :func:`noise_inputs`).
DATA_FIT_INPUTS = ("data", "noise")
#: The hit rate on the fit's batch below which a layer's structure is reported as weak.
STRUCTURE_FLOOR = 0.9
#: The scale of the sin-cos table written in place of a learned position embedding (see ``pe_scale``).
AUTO_PE_SCALE = 1.0


def model_input_shape(model):
    """One input's shape for a timm-style model: ``(C, H, W)`` from ``patch_embed`` (its ``img_size``
    and the projection's channels), ``(C, L)`` for a sequence model (``grid_size == (L,)``); ``None``
    when the model does not tell."""
    pe = getattr(model, "patch_embed", None)
    proj = getattr(pe, "proj", None)
    chans = getattr(proj, "in_channels", None)
    if chans is None:
        return None
    grid = tuple(getattr(pe, "grid_size", ()) or ())
    if len(grid) == 1:
        return (int(chans), int(grid[0]))
    size = getattr(pe, "img_size", None)
    return (int(chans), int(size[0]), int(size[1])) if size is not None else None


def noise_inputs(shape, samples: int, seed: int):
    """``samples`` Gaussian inputs ``N(0, 1)`` of one input's ``shape`` (normalized inputs have that
    mean and spread), from a generator seeded with ``seed``: float32 ``[samples, *shape]``."""
    import torch

    return torch.randn(int(samples), *shape, generator=torch.Generator().manual_seed(int(seed) + 7_000_001))


def structure_warning(report: Dict[str, Any], hint: Optional[str] = None) -> Optional[str]:
    """The warning for an impulse report whose data fit left a layer below :data:`STRUCTURE_FLOOR`
    on its batch (``None`` when every layer is at or above it, or no fit ran). ``hint`` names how this
    target takes a stronger position signal (see :func:`position_hint`): it lifts the hit rate most,
    but more structure is not always more accuracy, so it comes last."""
    rows = (report.get("data_fit") or {}).get("layers") or []
    weak = [r for r in rows if r.get("hit_rate") is not None and r["hit_rate"] < STRUCTURE_FLOOR]
    if not weak:
        return None
    worst = min(weak, key=lambda r: r["hit_rate"])
    others = f" ({len(weak)} layers below {STRUCTURE_FLOOR})" if len(weak) > 1 else ""
    ways = [f"more steps ({param('data_fit')}=1000)", f"a sharper fit target ({param('data_fit_mass')}=0.8)",
            "more inputs"]
    if hint:
        ways.append(f"a stronger position signal ({hint}; compare on validation)")
    return (f"the data fit left layer {worst['layer']} hitting its offsets in {worst['hit_rate']:.2f} of the rows on "
            f"the batch{others}: the init is only partly structured; try {', '.join(ways[:-1])} or {ways[-1]}")


def position_hint(pe_scale: Optional[float], checkpoint: bool) -> str:
    """How to write the sin-cos position table at twice the scale used (``pe_scale``; ``None``: x1),
    which lifts the deeper layers' hit rate on real inputs (docs/results/stock-models; on stock digits
    it trains as well, on Fashion-MNIST below x1): on a model ``pe_scale``, on a checkpoint
    ``set_pe=sincos`` with ``pe_scale``."""
    scale = 2.0 * (1.0 if pe_scale is None else float(pe_scale))
    if checkpoint:
        return f"{param('set_pe')}=sincos with {param('pe_scale')}={scale:g}"
    return f"{param('pe_scale')}={scale:g}: the sin-cos table x{scale:g}"


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


@dataclass(frozen=True)
class ImpulseInit(InitSpec):
    """Impulse init's parameters.

    Solve settings (see :class:`~structinit.solver.config.SolveConfig`): ``filter``, ``recipe``,
    ``target_mass`` (the ``fast`` recipe's softness: mean attention on the target token),
    ``recipe_params`` (any other recipe parameter, e.g. ``{"iters": 2000}``), ``share``,
    ``offset_order``, ``padding``, ``causal`` (sequences: offsets only in the past, for a decoder's
    causal mask), ``pseudo_input``, ``pseudo_input_rest``; or ``artifact`` (a path or cache key) to
    use a solved one. ``mimetic_vproj`` (default on) also sets V/proj as mimetic init does
    (``alpha2``, ``beta2``). ``pe_scale`` (models only) writes the sin-cos position embedding times
    it (a learned embedding stays learnable, starting from the table). ``fit_pe`` solves Q/K for
    the position embedding the model or checkpoint has (LayerNorm'd, prefix-token rows dropped; a
    learned one, say) instead of the sin-cos table. ``tolerance``: the largest difference between
    the solver's and the written weights' hit rate or target mass before the write is reported as
    misplaced. ``base`` (``model`` or ``pytorch``) is what every weight the init does not write
    starts from (:data:`~structinit.init.baselines.BASES`; ``pytorch`` resets the model's modules
    first, as the authors' code leaves them).

    ``data_fit`` (default 300): Adam steps that refine each layer's Q/K on the inputs a batch of
    real training data gives that layer at init (:mod:`structinit.init.data_fit`; ``data_fit_*``
    tune it, ``data_fit_samples`` caps the batch), so the impulse structure survives the content
    embedding. It runs when a batch is given (``data``: ``structinit train`` passes its first
    training inputs); without one (a checkpoint, or a model initialized without ``data``) Q/K keep
    the plain solve, a :class:`UserWarning` says so and the report's ``data_fit`` holds the reason.
    ``data_fit=0`` pins the plain solve. The defaults (data fit + mimetic V/proj) are the setting
    chosen on the validation split of the digits learning curve; see ``docs/results``.
    ``data_fit_version`` (default 2; 1 steps on the whole batch) is the fit's algorithm,
    ``data_fit_batch`` version 2's inputs per step (0: 1,024 query rows per head), ``data_fit_inputs``
    what the fit runs on: the batch (``data``) or Gaussian noise inputs of the model's input shape
    (``noise``: no dataset needed). The fit's result is a cached fitted artifact
    (:mod:`structinit.init.fitted`); a layer it leaves below a hit rate of 0.9 on its batch is
    warned about.

    ``self_weight`` (default 0, off; ``0 <= self_weight < 1``): self + shift, every head's
    ``Q_h K_h^T`` mixed with a mimetic-style identity term of this share, so that a head attends to
    its offset and to itself (:mod:`structinit.init.self_shift`). It is mixed in after the data fit
    and before its calibration to ``target_mass``; without a data fit, into the solve as written.

    The solve assumes the target's first layer sees the LayerNorm'd sin-cos table on position
    alone. A model whose position embedding is something else (timm's learned one, drawn with std
    0.02, which tells the layers almost nothing of position) gets the sin-cos table in its place, as
    ``pe_scale=1`` writes it (kept learnable; the report's ``pos_embed_written`` says so), unless
    ``fit_pe`` solves for the embedding it has (scaled by ``pe_factor`` first when given) or
    ``pe_scale`` chooses another scale. A checkpoint or state dict with such an embedding is refused
    unless ``fit_pe`` or, for ``apply_checkpoint``, ``set_pe`` says what to do: its weights are not
    changed beyond what was asked. The report's hit rate and target mass are measured on the
    target's own LayerNorm'd position embedding (where it has one), after the write.
    """

    method = "impulse"
    writes = "Q/K rows and biases; V and output projection (mimetic_vproj); pos_embed (pe_scale)"
    needs_grid = True
    filter: int = 3
    recipe: str = "fast"
    target_mass: Optional[float] = None
    recipe_params: Dict[str, Any] = field(default_factory=dict)
    share: bool = False
    offset_order: str = "random"
    padding: str = "zero"
    pseudo_input: str = "pe"
    pseudo_input_rest: Optional[str] = None
    artifact: Optional[Any] = None
    mimetic_vproj: bool = True
    alpha2: float = 0.4
    beta2: float = 0.4
    pe_scale: Optional[float] = None
    fit_pe: bool = False
    tolerance: float = 0.02
    causal: bool = False
    data_fit: int = 300
    data_fit_mass: float = 0.6
    data_fit_l2: float = 1e-4
    data_fit_lr: float = 1e-2
    data_fit_norm: float = 5.0
    data_fit_samples: int = 256
    self_weight: float = 0.0
    data_fit_version: int = 2
    data_fit_batch: int = 0
    data_fit_inputs: str = "data"
    pe_factor: Optional[float] = None
    base: str = "model"

    #: Parameters added after run keys were in use: left out of :meth:`to_dict` at their defaults.
    optional_defaults = ("data_fit", "data_fit_mass", "data_fit_l2", "data_fit_lr", "data_fit_norm",
                         "data_fit_samples", "self_weight", "data_fit_version", "data_fit_batch", "data_fit_inputs",
                         "pe_factor", "base")
    #: ``data_fit`` was 0 (off) when run keys began to carry it: a key leaves out 0, not the default;
    #: ``data_fit_version`` was 1 before it was a parameter: keys leave out 1, so version 1's runs keep
    #: theirs and version 2 gets keys of its own.
    legacy_defaults = {"data_fit": 0, "data_fit_version": 1}

    def validate(self) -> None:
        from structinit.solver.artifact import Artifact

        self.check_positive("filter", "pe_scale")
        self.check_positive("tolerance", "data_fit", "data_fit_l2", allow_zero=True)
        self.check_positive("data_fit_lr", "data_fit_norm", "data_fit_samples")
        if not 0 <= self.self_weight < 1:
            raise UsageError(f"impulse parameter {param('self_weight')} must lie in [0, 1) (the identity term's "
                             f"share of each head), got {self.self_weight}")
        if not 0 < self.data_fit_mass < 1:
            raise UsageError(f"impulse parameter {param('data_fit_mass')} must lie strictly between 0 and 1, "
                             f"got {self.data_fit_mass}")
        from structinit.init.data_fit import FIT_VERSIONS

        if self.data_fit_version not in FIT_VERSIONS:
            raise UsageError(f"impulse parameter {param('data_fit_version')} must be one of "
                             f"{', '.join(map(str, FIT_VERSIONS))}, got {self.data_fit_version}")
        self.check_positive("data_fit_batch", "pe_factor", allow_zero=True)
        if self.data_fit_inputs not in DATA_FIT_INPUTS:
            raise UsageError(f"impulse parameter {param('data_fit_inputs')} must be one of "
                             f"{', '.join(DATA_FIT_INPUTS)}, got {self.data_fit_inputs!r}")
        if self.data_fit_inputs != "data" and not self.data_fit:
            raise UsageError(f"impulse parameter {param('data_fit_inputs')} chooses the data fit's inputs, and "
                             "data_fit is 0: leave it out")
        if self.pe_factor is not None and (not self.fit_pe or self.pe_factor == 0):
            raise UsageError(f"impulse parameter {param('pe_factor')} scales the target's own position embedding "
                             f"for {param('fit_pe')}: give fit_pe=true and a positive factor")
        if self.data_fit_batch and (not self.data_fit or self.data_fit_version == 1):
            why = "data_fit is 0" if not self.data_fit else "version 1 steps on the whole batch"
            raise UsageError(f"impulse parameter {param('data_fit_batch')} sets the images of a version-2 fit step, "
                             f"and {why}: leave it out")
        check_choice("base", self.base, BASES)
        check_recipe(self.recipe)
        recipe_params(self.recipe, {**self.recipe_params, "target_mass": self.target_mass}
                      if self.target_mass is not None else self.recipe_params)  # refuse bad values now
        check_choice("offset_order", self.offset_order, OFFSET_ORDERS)
        check_choice("padding", self.padding, PADDINGS)
        check_choice("pseudo_input", self.pseudo_input, PSEUDO_INPUTS)
        if self.pseudo_input_rest is not None:
            check_choice("pseudo_input_rest", self.pseudo_input_rest, PSEUDO_INPUTS)
        if self.artifact is not None and not isinstance(self.artifact, (str, Artifact)):
            object.__setattr__(self, "artifact", str(self.artifact))
        if self.target_mass is not None and self.recipe != "fast":
            raise UsageError(f"impulse parameter {param('target_mass')} is the fast recipe's; recipe "
                             f"{self.recipe!r} has no softness knob")
        if self.fit_pe:
            if self.artifact is not None:
                raise UsageError(f"impulse parameters {param('fit_pe')} and {param('artifact')} exclude each other: "
                                 "fit_pe solves for the target's own position embedding")
            if self.pe_scale is not None:
                raise UsageError(f"impulse parameters {param('fit_pe')} and {param('pe_scale')} exclude each other: "
                                 "pe_scale writes the sin-cos table, fit_pe fits the embedding the target has")
            if not any(k.startswith("pe") for k in (self.pseudo_input, self.pseudo_input_rest) if k):
                raise UsageError(f"impulse parameter {param('fit_pe')} needs a 'pe' {param('pseudo_input')}, got "
                                 f"{self.pseudo_input!r}")

    def params(self) -> Dict[str, Any]:
        out = super().params()
        if hasattr(self.artifact, "config"):
            out["artifact"] = str(self.artifact.path) if self.artifact.path else self.artifact.key
        return out

    def algorithms(self) -> Dict[str, int]:
        """The solve recipe's version and, with a data fit, the fit's (``data_fit_version``)."""
        from structinit.solver.recipes import RECIPE_VERSIONS

        out = {f"recipe {self.recipe}": RECIPE_VERSIONS[self.recipe]}
        if self.data_fit:
            out["data fit"] = self.data_fit_version
        return out

    def to_dict(self) -> Dict[str, Any]:
        """As :meth:`InitSpec.to_dict`; without a data fit (``data_fit=0``) its version and step
        size are left out, as they change nothing (the fit's version is a parameter, so it is not
        repeated under ``algorithms``)."""
        out = super().to_dict()
        if not self.data_fit:
            for name in ("data_fit_version", "data_fit_batch"):
                out["params"].pop(name, None)
        newer = {k: v for k, v in out.pop("algorithms", {}).items() if k != "data fit"}
        if newer:
            out["algorithms"] = newer
        return out

    def planned(self, slot) -> List[str]:
        return super().planned(slot) + (vproj_keys(slot) if self.mimetic_vproj else [])

    @property
    def uses_data(self) -> bool:
        """Whether :meth:`apply` takes a batch of real inputs (``data_fit``; without one it keeps
        the plain solve)."""
        return self.data_fit > 0

    def check_target(self, target) -> None:
        """A decoder that masks later tokens (GPT-2) needs causal offsets; a model known to attend
        both ways (BERT) must not get them (they were solved under a mask it does not apply). An
        artifact given by path or key is checked once it is read (in :meth:`apply`)."""
        if self.artifact is None:
            check_causal(target, self.causal)
        elif hasattr(self.artifact, "config"):
            check_causal(target, self.artifact.config.causal)

    def check_data_target(self, target) -> None:
        """``data_fit`` on a batch needs a model (it runs the inputs through it) whose q and k are
        plain linear maps of each layer's input (no q/k norms)."""
        if not self.data_fit:
            return
        from structinit.analysis.capture import projection_module

        model = target.model
        if model is None:
            raise UsageError(f"impulse parameter {param('data_fit')} runs real inputs through the model, so it needs "
                             "a model, not a checkpoint or state dict (apply_checkpoint builds one with build)")
        for i in target.layers:
            owner = projection_module(model, target.det.slots[i].q.key)
            attn = model.blocks[i].attn if hasattr(model, "blocks") else owner
            if any(type(getattr(attn, n, None)).__name__ not in ("Identity", "NoneType") for n in ("q_norm", "k_norm")):
                raise UsageError(f"impulse parameter {param('data_fit')} fits q and k as linear maps; layer {i} "
                                 "normalizes them (q_norm/k_norm)")

    def solve_config(self, grid, dim: int, heads: int, depth: int, seed: int = 0, embedding=None):
        """The :class:`~structinit.solver.config.SolveConfig` for a model of this shape (fitted to
        position ``embedding [N, D]`` when given)."""
        from structinit.solver.config import SolveConfig, embedding_digest

        params = dict(self.recipe_params)
        if self.target_mass is not None:
            params["target_mass"] = self.target_mass
        return SolveConfig(grid=grid, dim=dim, heads=heads, filter=self.filter, layers=depth, share=self.share,
                           recipe=self.recipe, params=params, pseudo_input=self.pseudo_input,
                           pseudo_input_rest=self.pseudo_input_rest, padding=self.padding,
                           offset_order=self.offset_order, seed=seed, causal=self.causal,
                           pos_embed=embedding_digest(embedding) if embedding is not None else None)

    def artifact_for(self, t, seed: int = 0, cache_dir=None, device: str = "cpu", progress=None):
        """``(artifact, cached)`` for target ``t``: the given one (``cached`` ``None``) or solved
        (for ``t``'s own position embedding with ``fit_pe``). Raises :class:`UsageError` when the
        artifact was solved for another position embedding than the one ``t`` has (see the class
        docstring)."""
        from structinit.solver.cache import resolve_artifact
        from structinit.solver.run import solve

        if self.artifact is not None:
            art, cached = resolve_artifact(self.artifact, cache_dir), None
        else:
            embedding = None
            if self.fit_pe:
                embedding = t.pos_embed()
                if embedding is None:
                    raise UsageError(f"impulse parameter {param('fit_pe')}: the {t.layout} target has no position "
                                     "embedding to fit")
            config = self.solve_config(t.grid, t.dim, t.heads, t.depth, seed, embedding)  # refuses bad settings
            if not self.fit_pe:
                self.check_embedding(t)
            result = solve(config, cache_dir=cache_dir, device=device, progress=progress, embedding=embedding)
            art, cached = result.artifact, result.cached
        self.check_embedding(t, art)
        return art, cached

    def check_embedding(self, t, art=None) -> None:
        """Raise :class:`UsageError` when target ``t``'s position embedding is not the one the
        solve is for: ``art``'s (a fitted one must be ``t``'s own), or the sin-cos table."""
        from structinit.solver.config import embedding_digest

        kind = t.pos_embed_kind()
        if kind is None or (art is None and (self.fit_pe or self.artifact is not None)):
            return
        fitted = art.config.pos_embed if art is not None else None
        if fitted is not None:
            if embedding_digest(t.pos_embed()) != fitted:
                raise UsageError(f"the {param('artifact')} was solved for another position embedding than the "
                                 f"target's {t.pos_key}; solve again with {param('fit_pe')}")
            return
        uses_pe = (art.config.pseudo_input if art is not None else self.pseudo_input).startswith("pe")
        if kind == "other" and uses_pe:
            raise UsageError(
                f"the target's position embedding {t.pos_key} is not the sin-cos table the impulse solve assumes "
                f"(a learned one?), so Q/K solved on the table would not give impulse attention on it; give "
                f"{param('fit_pe')} to solve for the embedding it has, or write the sin-cos table first "
                f"({param('set_pe')} sincos for a checkpoint, {param('pe_scale')} for a model)")

    def apply(self, target, *, seed: int = 0, cache_dir=None, device: str = "cpu", artifact=None,
              cached: Optional[bool] = None, progress=None, check_pe: bool = True, data=None,
              fit_progress=None, log=None, source: Optional[str] = None) -> Dict[str, Any]:
        """Write the artifact's Q/K (``artifact`` if given, else :meth:`artifact_for`) into
        ``target``. The report's per-layer ``hit_rate``/``target_mass``/``mse`` are measured from
        the written weights on the target's own LayerNorm'd position embedding (``measured_on``
        says which input), ``solved`` on the artifact's pseudo input (where the write is checked
        against the solve). ``progress(done, total)`` follows the solve. ``check_pe=False`` skips
        :meth:`check_embedding` (for a copy of a model already checked, e.g. an EMA state dict,
        which gets the same weights). ``data``: a batch of real, normalized model inputs (``[B, C, H, W]``
        images or ``[B, L]`` sequences) that ``data_fit`` fits to; without it the fit is skipped and the
        report's ``data_fit`` says why. ``fit_progress(done, total)`` follows the fit step by step (it
        may raise to stop it: nothing is then left half-written but the model's weights, which the
        caller discards); ``log(message)`` gets a line per fitted layer; ``source`` says in words where
        ``data`` came from. The fit's result is a fitted artifact (:mod:`structinit.init.fitted`),
        cached: the same model, batch and settings are fitted once. An ``artifact`` that is a fitted
        one is written as it is (no fit runs)."""
        import torch

        from structinit.analysis.quality import measure
        from structinit.geometry.targets import causal_mask, impulse_columns
        from structinit.init.inject import read_qk, write_qk
        from structinit.init.pos_embed import set_sincos_pos_embed
        from structinit.init.self_shift import add_self_term

        t = target
        given_fit = artifact is not None and bool(getattr(artifact, "fit", None))
        base_reset = apply_base(t, self.base, seed, self.method)
        if self.data_fit and self.data_fit_inputs == "noise" and t.model is not None and not given_fit:
            shape = tuple(data.shape[1:]) if data is not None else model_input_shape(t.model)
            if shape is None:
                raise UsageError(f"impulse parameter {param('data_fit_inputs')} noise needs the inputs' shape: the "
                                 "model does not tell it, so give data (only its shape is used)")
            data = noise_inputs(shape, self.data_fit_samples, seed)
            source = f"noise: {self.data_fit_samples} Gaussian inputs N(0, 1) of shape {list(shape)}"
        fit = bool(self.data_fit) and data is not None
        skipped = None
        if fit:
            self.check_data_target(t)
            data = data[: self.data_fit_samples]
        elif self.data_fit and not given_fit:
            why = ("a checkpoint holds no model to run real inputs through" if t.model is None
                   else "no real inputs were given (data)")
            skipped = (f"not run: {why}, so Q/K are the plain solve on the position embedding alone, whose "
                       "structure real inputs mostly wash out (data_fit=0 asks for this explicitly)")
        pe_written = None
        if self.pe_scale is None and not self.fit_pe and self.artifact is None and artifact is None \
                and t.model is not None and t.pos_embed_kind() == "other" and isinstance(
                    getattr(t.model, "pos_embed", None), torch.Tensor):
            # A learned embedding (timm's trunc normal 0.02) tells the layers almost nothing of position: the
            # sin-cos table takes its place, learnable as it was (see docs/results/stock-models).
            pe_scale = AUTO_PE_SCALE
            pe_written = f"sin-cos table x{AUTO_PE_SCALE:g} in place of the model's own {t.pos_key}, kept learnable"
        else:
            pe_scale = self.pe_scale
        if pe_scale is not None:
            if t.model is None:
                raise UsageError(f"impulse parameter {param('pe_scale')} needs a model; on a checkpoint write the "
                                 "embedding with set_pe")
            learned = bool(getattr(t.model.pos_embed, "requires_grad", False))
            set_sincos_pos_embed(t.model, t.grid, scale=pe_scale)
            t.model.pos_embed.requires_grad_(learned)  # a learned embedding stays learnable
            pe_written = pe_written or f"sin-cos table x{pe_scale:g} (pe_scale)"
        if self.pe_factor is not None:
            if t.model is None or not isinstance(getattr(t.model, "pos_embed", None), torch.Tensor):
                raise UsageError(f"impulse parameter {param('pe_factor')} scales a model's pos_embed; the target has "
                                 "none (on a checkpoint, scale it before)")
            with torch.no_grad():
                t.model.pos_embed.mul_(self.pe_factor)
            pe_written = f"the model's own {t.pos_key} x{self.pe_factor:g} (pe_factor)"
        if artifact is None:
            artifact, cached = self.artifact_for(t, seed, cache_dir, device, progress)
        elif check_pe:
            self.check_embedding(t, artifact)
        plain = artifact
        check_artifact(plain, t.grid, t.dim, t.heads, t.layers)
        check_causal(t, plain.config.causal)
        fit_cached = None
        if fit:
            from structinit.init.fitted import load_or_fit

            artifact, fit_cached = load_or_fit(self, t, plain, data, seed, cache_dir, fit_progress, log,
                                               source=source)
        elif given_fit:
            fit_cached = cached
        art = artifact
        mask = causal_mask(art.config.grid, art.config.causal)
        own = t.own_input()
        measured_on = (f"{t.pos_key} ({t.pos_embed_kind()}), LayerNorm'd" if own is not None
                       else f"the artifact's pseudo input ({art.config.pseudo_input}; the target has no position "
                            "embedding)")
        gen = generator(seed + 1)
        solved = art.stats.get("layers", [])
        rows = []
        for slot in t.slots:
            src = 0 if art.depth == 1 else slot.index
            keys, rq, rk = self.write_layer(t, slot, art, gen)
            cols = impulse_columns(art.config.grid, art.offsets[src], art.config.padding)
            placed = measure(art.layer_input(src), rq, rk, cols, mask)
            if src < len(solved):
                for name in ("hit_rate", "target_mass"):
                    want = float(np.mean([h[name] for h in solved[src]]))
                    got = float(getattr(placed, name).mean())
                    if abs(want - got) > self.tolerance:
                        raise StructinitError(
                            f"layer {slot.index}: the written weights give {name} {got:.3f} but the solve has "
                            f"{want:.3f}; the Q/K rows were not placed as the layout expects")
            if self.self_weight and not art.fit:  # a fitted artifact has the self term mixed in already
                write_qk(t.sd, slot, *add_self_term(rq, rk, self.self_weight))
                rq, rk = read_qk(t.sd, slot, t.heads)
                placed = measure(art.layer_input(src), rq, rk, cols, mask)
            same = own is None or np.allclose(own, art.layer_input(src), atol=1e-5)
            got = placed if same else measure(own, rq, rk, cols, mask)
            row = {"layer": slot.index, "replaced": keys, "offsets": art.offsets[src].tolist(), **got.layer_row(),
                   "solved": {m: float(getattr(placed, m).mean()) for m in ("hit_rate", "target_mass")}}
            rows.append(row)
        fitted = {"skipped": skipped} if skipped else None
        if art.fit:
            fitted = dict(art.fit["report"])
            fitted.update(steps=self.data_fit, mass=self.data_fit_mass, l2=self.data_fit_l2, lr=self.data_fit_lr,
                          norm=self.data_fit_norm, calibrated_to=self.calibration_mass(),
                          version=self.data_fit_version, source=art.fit.get("source"),
                          artifact={"key": art.key, "path": str(art.path) if art.path else None,
                                    "cached": fit_cached})
        return {"method": "impulse", "layout": t.layout, "grid": list(t.grid), "dim": t.dim, "heads": t.heads,
                "artifact": ({"key": plain.key, "path": str(plain.path) if plain.path else None, "cached": cached,
                              "config": plain.config.to_dict()} if not given_fit else
                             {"key": plain.fit["identity"]["plain"], "path": None, "cached": None,
                              "config": plain.config.to_dict()}),
                "mimetic_vproj": self.mimetic_vproj, "pe_scale": self.pe_scale, "fit_pe": self.fit_pe,
                "pos_embed_written": pe_written,
                "self_weight": self.self_weight, "data_fit": fitted,
                **({"base_reset": base_reset} if base_reset is not None else {}),
                "measured_on": measured_on, "layers": rows,
                "hit_rate": float(np.mean([r["hit_rate"] for r in rows])),
                "target_mass": float(np.mean([r["target_mass"] for r in rows]))}

    def write_layer(self, t, slot, art, gen):
        """Write ``art``'s Q/K of layer ``slot`` into ``t`` (and mimetic V/proj, drawn from ``gen``):
        ``(keys written, q, k)`` with ``q, k`` read back ``[H, D, d]``."""
        import torch

        from structinit.init.inject import read_qk, write_qk, write_vproj

        src = 0 if art.depth == 1 else slot.index
        keys = write_qk(t.sd, slot, torch.from_numpy(art.q[src]), torch.from_numpy(art.k[src]))
        if self.mimetic_vproj:
            w_v, w_p, _ = mimetic_v_proj(t.dim, self.alpha2, self.beta2, gen)
            keys += write_vproj(t.sd, slot, w_v, w_p)
        rq, rk = read_qk(t.sd, slot, t.heads)
        return keys, rq, rk

    def calibration_mass(self) -> float:
        """The mean attention on the target token that ``data_fit`` calibrates each head to:
        ``target_mass``, or the ``fast`` recipe's default."""
        if self.target_mass is not None:
            return float(self.target_mass)
        return float(recipe_params("fast", {})["target_mass"])


def prefixed_columns(columns, tokens: int):
    """Grid target columns ``[H, N]`` as columns over all ``tokens`` (``T = prefix + N``) of a
    model with prefix tokens (a class token) first: prefix rows get ``-1`` (no target: not fitted),
    grid targets shift by the prefix. ``[H, T]`` int64."""
    import torch

    cols = torch.as_tensor(np.asarray(columns)).long()
    prefix = int(tokens) - int(cols.shape[1])
    if prefix < 0:
        raise UsageError(f"the model has {tokens} tokens, fewer than the {cols.shape[1]} of the grid")
    if not prefix:
        return cols
    shifted = torch.where(cols >= 0, cols + prefix, cols)
    return torch.cat([torch.full((cols.shape[0], prefix), -1, dtype=torch.long), shifted], dim=1)


def prefixed_mask(mask, tokens: int):
    """A grid's visible-key mask ``[N, N]`` (or ``None``) over all ``tokens`` with prefix tokens
    first (they see and are seen by every token), as a bool tensor ``[T, T]``."""
    import torch

    if mask is None:
        return None
    m = torch.as_tensor(np.asarray(mask)).bool()
    prefix = int(tokens) - int(m.shape[0])
    if not prefix:
        return m
    full = torch.ones(tokens, tokens, dtype=torch.bool)
    full[prefix:, prefix:] = m
    return full


class _Fitter:
    """Runs the data fit of one :meth:`ImpulseInit.apply`, layer by layer in increasing order
    (see :mod:`structinit.init.data_fit`): captures each layer's input on the batch as the
    earlier, already written layers make it, refines, calibrates and writes the layer."""

    def __init__(self, spec: "ImpulseInit", t, data, seed: int, progress=None, log=None):
        self.spec, self.t, self.data, self.seed = spec, t, data, seed
        self.progress, self.log = progress, log
        self.total = len(t.layers) * (spec.data_fit + 1)
        self.done = 0
        self.inputs = None
        self.seconds = 0.0
        self.streamed = False
        self.step_images = None
        self.measured: List[Dict[str, Any]] = []
        self.measured_on = 0

    def tick(self) -> None:
        self.done += 1
        self.poll()

    def poll(self) -> None:
        if self.progress is not None:
            self.progress(self.done, self.total)

    def layer_input(self, index: int):
        if self.spec.data_fit_version == 1:  # the whole model on the whole batch for every layer, as it was
            from structinit.analysis.capture import attention_inputs

            return attention_inputs(self.t.model, self.data)[index].float()
        if self.inputs is None:
            from structinit.analysis.capture import LayerInputs, projection_module

            modules = [projection_module(self.t.model, s.q.key) for s in self.t.det.slots]
            self.inputs = LayerInputs(self.t.model, self.data, modules, between=self.poll)
            self.streamed = self.inputs.streamed
        return self.inputs(index)

    def fit(self, slot, q, k, cols, mask) -> None:
        """Refine layer ``slot`` from ``q, k`` (the written plain solve), mix in the self term
        (``self_weight``), calibrate and write it."""
        import time

        from structinit.init import data_fit
        from structinit.init.inject import write_qk

        spec = self.spec
        start = time.perf_counter()
        x = self.layer_input(slot.index)
        columns = prefixed_columns(cols, x.shape[1])
        visible = prefixed_mask(mask, x.shape[1])
        if spec.data_fit_version == 1:
            q, k = data_fit.refine_qk(x, q, k, columns, steps=spec.data_fit, mass=spec.data_fit_mass,
                                      l2=spec.data_fit_l2, lr=spec.data_fit_lr, norm=spec.data_fit_norm, mask=visible)
            self.done += spec.data_fit
        else:
            self.step_images = min(data_fit.step_images(x.shape[1], spec.data_fit_batch), int(x.shape[0]))
            q, k = data_fit.refine_qk_minibatch(
                x, q, k, columns, steps=spec.data_fit, mass=spec.data_fit_mass, l2=spec.data_fit_l2,
                lr=spec.data_fit_lr, norm=spec.data_fit_norm, batch=spec.data_fit_batch, mask=visible,
                seed=self.seed * 1_000_003 + slot.index, tick=self.tick)
        if spec.self_weight:
            from structinit.init.self_shift import add_self_term

            q, k = add_self_term(q, k, spec.self_weight)
        calibrate = data_fit.calibrate_on_batch if spec.data_fit_version == 1 else data_fit.calibrate
        q, k = calibrate(x, q, k, columns, spec.calibration_mass(), visible)
        write_qk(self.t.sd, slot, q, k)
        if spec.data_fit_version > 1:
            self.measure(slot.index, x, q, k, columns, visible)
        self.tick()
        took = time.perf_counter() - start
        self.seconds += took
        if self.log is not None:
            self.log(f"data fit: layer {slot.index} ({self.t.layers.index(slot.index) + 1}/{len(self.t.layers)}) "
                     f"on {int(x.shape[0])} inputs in {took:.1f}s")

    def measure(self, index: int, x, q, k, columns, visible) -> None:
        """Layer ``index``'s attention with the written ``q, k`` on (the first
        :data:`~structinit.init.data_fit.CALIBRATION_SAMPLES` of) its fitted inputs ``x``: hit rate,
        target mass (per head too) and the share inside the filter's window, over grid queries."""
        from structinit.analysis.fidelity import window_mask
        from structinit.analysis.quality import attention_maps, attention_quality
        from structinit.init.data_fit import CALIBRATION_SAMPLES

        sub = x[:CALIBRATION_SAMPLES]
        prefix = int(x.shape[1]) - self.t.grid.tokens
        attn = attention_maps(sub[:, None], q[None].to(sub.device), k[None].to(sub.device),
                              None if visible is None else visible.to(sub.device))[:, :, prefix:, :]
        got = attention_quality(attn, columns[:, prefix:].to(sub.device))
        import torch

        window = torch.from_numpy(window_mask(self.t.grid, self.spec.filter, prefix)).to(attn.device)
        heads = {m: [round(float(v), 6) for v in got[m].mean(0)] for m in ("hit_rate", "target_mass")}
        self.measured.append({"layer": index, **{m: float(np.mean(v)) for m, v in heads.items()},
                              "window_mass": float((attn * window).sum(-1).mean()), "heads": heads})
        self.measured_on = int(sub.shape[0])

    def report(self, rows, config) -> Dict[str, Any]:
        """The fit's record for the init report: per layer the attention on the fitted inputs
        (version 1: the whole batch through the model; version 2: measured as each layer was written)."""
        if self.spec.data_fit_version == 1:
            from structinit.analysis.fidelity import data_attention_quality

            return data_attention_quality(self.t.model, self.data, [r["offsets"] for r in rows], config.grid,
                                          padding=config.padding, causal=config.causal,
                                          layers=[r["layer"] for r in rows])
        layers = self.measured
        mean = {m: float(np.mean([r[m] for r in layers])) for m in ("hit_rate", "target_mass", "window_mass")}
        return {"samples": int(self.data.shape[0]), "measured_on": self.measured_on, "layers": layers, **mean}
