"""Impulse initialization ("Structured Initialization for Attention in Vision Transformers"): Q/K
of every selected layer from a solved artifact, so that each head's attention starts as an
impulse filter (one offset in an ``f x f`` window).

The artifact is given (an :class:`~structinit.solver.artifact.Artifact`, a path or a cache key) or
solved now (and cached) for the target's shape with the spec's settings (:meth:`ImpulseInit.solve_config`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from structinit.errors import UsageError, param
from structinit.init.base import InitSpec
from structinit.init.impulse_checks import check_causal, check_impulse_params
from structinit.init.mimetic import vproj_keys
from structinit.solver.recipes import recipe_params

#: The hit rate on the fit's batch below which a layer's structure is reported as weak.
STRUCTURE_FLOOR = 0.9


#: What the weak-structure warning advises (when the fit used less): steps per layer, and a sharper target mass.
SUGGESTED_STEPS, SUGGESTED_MASS = 1000, 0.8


def structure_warning(report: Dict[str, Any], hint: Optional[str] = None) -> Optional[str]:
    """The warning for an impulse report whose data fit left a layer below :data:`STRUCTURE_FLOOR`
    on the inputs it was fitted to, a batch of real inputs or noise (``None`` when every layer is at
    or above it, or no fit ran), with each layer's figure and what to try: the position subspace
    first where it is off (the one setting measured to structure every layer where a token's content
    fills the stream), then more steps or a sharper target than those used, then inputs; ``hint``
    names how this target takes a stronger position signal (see :func:`position_hint`): it lifts
    the hit rate most, but more structure is not always more accuracy, so it comes last."""
    fit = report.get("data_fit") or {}
    rows = [r for r in fit.get("layers") or [] if r.get("hit_rate") is not None]
    weak = [r for r in rows if r["hit_rate"] < STRUCTURE_FLOOR]
    if not weak:
        return None
    worst = min(weak, key=lambda r: r["hit_rate"])
    noise = fit.get("inputs") == "noise"
    where = "its noise inputs" if noise else "the batch"
    per_layer = " ".join(f"{r['hit_rate']:.2f}" for r in rows)
    others = f" ({len(weak)} layers below {STRUCTURE_FLOOR}; per layer {per_layer})" if len(weak) > 1 else ""
    ways = []
    if not report.get("position_subspace"):
        ways.append(f"the position subspace ({param('position_subspace')}=true: the position table in directions "
                    "nothing else writes, which structures every layer where a token's content fills the stream)")
    steps, mass = fit.get("steps"), fit.get("mass")  # a setting at or past the advice is not advised again
    if not isinstance(steps, (int, float)) or steps < SUGGESTED_STEPS:
        ways.append(f"more steps ({param('data_fit')}={SUGGESTED_STEPS})")
    if not isinstance(mass, (int, float)) or mass < SUGGESTED_MASS:
        ways.append(f"a sharper fit target ({param('data_fit_mass')}={SUGGESTED_MASS:g})")
    ways.append(f"real inputs ({param('data')})" if noise else "more inputs")
    if hint:
        ways.append(f"a stronger position signal ({hint}; compare on validation)")
    tries = f"{', '.join(ways[:-1])} or {ways[-1]}" if len(ways) > 1 else ways[0]
    return (f"the data fit left layer {worst['layer']} hitting its offsets in {worst['hit_rate']:.2f} of the rows on "
            f"{where}{others}: the init is only partly structured; try {tries}")


def fitted_structure_warning(fit: Dict[str, Any]) -> Optional[str]:
    """:func:`structure_warning` for a fitted artifact's ``fit`` record (its identity and report), as
    ``structinit inspect`` shows it."""
    ident = fit.get("identity") or {}
    settings = ident.get("fit") or {}
    inputs = ident.get("inputs")
    kind = inputs.get("kind") if isinstance(inputs, dict) else "data"
    report = {"data_fit": {"layers": (fit.get("report") or {}).get("layers"), "inputs": kind,
                           "steps": settings.get("data_fit"), "mass": settings.get("data_fit_mass")}}
    if settings.get("position_dims"):
        report["position_subspace"] = {"dims": settings["position_dims"]}
    return structure_warning(report)


def position_hint(pe_scale: Optional[float], checkpoint: bool) -> str:
    """How to write the sin-cos position table at twice the scale used (``pe_scale``; ``None``: x1),
    which lifts the deeper layers' hit rate on real inputs (docs/results/stock-models; on stock digits
    it trains as well, on Fashion-MNIST below x1): on a model ``pe_scale``, on a checkpoint
    ``set_pe=sincos`` with ``pe_scale``."""
    scale = 2.0 * (1.0 if pe_scale is None else float(pe_scale))
    if checkpoint:
        return f"{param('set_pe')}=sincos with {param('pe_scale')}={scale:g}"
    return f"{param('pe_scale')}={scale:g}: the sin-cos table x{scale:g}"


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
    misplaced. ``base`` (``model``, ``pytorch``, ``pytorch-mlp`` or ``pytorch-head``:
    :data:`~structinit.init.baselines.BASES`) is what every weight the init does not write starts
    from (``pytorch`` resets the model's modules first, as the authors' code leaves them).

    ``data_fit`` (default 300): Adam steps that refine each layer's Q/K on the inputs a batch gives
    that layer at init (:mod:`structinit.fit`; ``data_fit_*`` tune it, ``data_fit_samples`` caps the
    batch), so the impulse structure survives the content embedding. It runs on the batch given
    (``data``: ``structinit train`` passes its first training inputs) and, without one, on Gaussian
    noise inputs of the model's input shape (no dataset needed; on digits this trains within half a
    point of the fit on real images); a state dict, which holds no model, keeps the plain solve, and
    the report's ``data_fit`` says why. ``data_fit=0`` asks for the plain solve, which real inputs
    wash out (measured to train below mimetic init). The defaults (data fit + mimetic V/proj) are the
    setting chosen on the validation split of the digits learning curve; see ``docs/results``.
    ``data_fit_version`` (default 2; 1 steps on the whole batch) is the fit's algorithm,
    ``data_fit_batch`` version 2's inputs per step (0: 1,024 query rows per head), ``data_fit_inputs``
    what the fit runs on when a batch is given: the batch (``data``) or noise of its shape
    (``noise``). The fit's result is a cached fitted artifact (:mod:`structinit.fit.artifact`); a
    layer it leaves below a hit rate of 0.9 on its inputs is warned about.

    ``self_weight`` (default 0, off; ``0 <= self_weight < 1``): self + shift, every head's
    ``Q_h K_h^T`` mixed with a mimetic-style identity term of this share, so that a head attends to
    its offset and to itself (:mod:`structinit.solver.self_shift`). It is mixed in after the data fit
    and before its calibration to ``target_mass``; without a data fit, into the solve as written.

    The solve assumes the target's first layer sees the LayerNorm'd sin-cos table on position
    alone. A model whose position embedding is something else (timm's learned one, drawn with std
    0.02, which tells the layers almost nothing of position) gets the sin-cos table in its place, as
    ``pe_scale=1`` writes it (kept learnable; the report's ``pos_embed_written`` says so), unless
    ``fit_pe`` solves for the embedding it has (scaled by ``pe_factor`` first when given) or
    ``pe_scale`` chooses another scale; ``apply_checkpoint`` does the same to a checkpoint whose
    model it builds. A bare state dict with such an embedding is refused unless ``fit_pe`` says what
    to do: its weights are not changed beyond what was asked. The report's hit rate and target mass are measured on the
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
    position_subspace: bool = False
    position_dims: int = 0
    position_rest: bool = False

    #: Parameters added after run keys were in use: left out of :meth:`to_dict` at their defaults.
    optional_defaults = ("data_fit", "data_fit_mass", "data_fit_l2", "data_fit_lr", "data_fit_norm",
                         "data_fit_samples", "self_weight", "data_fit_version", "data_fit_batch", "data_fit_inputs",
                         "pe_factor", "base", "position_subspace", "position_dims", "position_rest")
    #: ``data_fit`` was 0 (off) when run keys began to carry it: a key leaves out 0, not the default;
    #: ``data_fit_version`` was 1 before it was a parameter: keys leave out 1, so version 1's runs keep
    #: theirs and version 2 gets keys of its own.
    legacy_defaults = {"data_fit": 0, "data_fit_version": 1}

    def validate(self) -> None:
        check_impulse_params(self)
        if self.artifact is not None and not isinstance(self.artifact, str) and not hasattr(self.artifact, "config"):
            object.__setattr__(self, "artifact", str(self.artifact))  # a path

    def params(self) -> Dict[str, Any]:
        out = super().params()
        art = self.artifact
        if art is not None and hasattr(art, "config"):
            out["artifact"] = str(art.path) if art.path else art.key
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
                             "a model, not a checkpoint or state dict (apply_checkpoint builds the one a checkpoint "
                             "describes)")
        for i in target.layers:
            owner = projection_module(model, target.det.slots[i].q.key)
            attn = model.blocks[i].attn if hasattr(model, "blocks") else owner
            if any(type(getattr(attn, n, None)).__name__ not in ("Identity", "NoneType") for n in ("q_norm", "k_norm")):
                raise UsageError(f"impulse parameter {param('data_fit')} fits q and k as linear maps; layer {i} "
                                 "normalizes them (q_norm/k_norm)")

    def solve_config(self, grid, dim: int, heads: int, depth: int, seed: int = 0, embedding=None):
        """See :func:`structinit.init.impulse_solve.solve_config`."""
        from structinit.init.impulse_solve import solve_config

        return solve_config(self, grid, dim, heads, depth, seed, embedding)

    def artifact_for(self, t, seed: int = 0, cache_dir=None, device: str = "cpu", progress=None):
        """See :func:`structinit.init.impulse_solve.artifact_for`."""
        from structinit.init.impulse_solve import artifact_for

        return artifact_for(self, t, seed, cache_dir, device, progress)

    def check_embedding(self, t, art=None) -> None:
        """See :func:`structinit.init.impulse_solve.check_embedding`."""
        from structinit.init.impulse_solve import check_embedding

        check_embedding(self, t, art)

    def apply(self, target, *, seed: int = 0, cache_dir=None, device: str = "cpu", artifact=None,
              cached: Optional[bool] = None, progress=None, check_pe: bool = True, data=None,
              fit_progress=None, log=None, source: Optional[str] = None) -> Dict[str, Any]:
        """Write the init into ``target`` and return its report (see :mod:`structinit.init.impulse_write`:
        :func:`~structinit.init.impulse_write.prepare` makes the artifact, the data fit included,
        and :func:`~structinit.init.impulse_write.write` writes it). ``artifact`` (with ``cached``)
        is written instead of solving, a fitted one as it is (no fit runs); ``progress(done, total)``
        follows the solve; ``check_pe=False`` skips :meth:`check_embedding` (for a copy of a model
        already checked, e.g. an EMA state dict, which gets the same weights). ``data``: a batch of
        real, normalized model inputs (``[B, C, H, W]`` images or ``[B, L]`` sequences) for the data
        fit; without it the fit runs on noise inputs of the model's input shape (see
        :mod:`structinit.fit.inputs`), and on a state dict, which holds no model, it is skipped.
        ``fit_progress(done, total)`` follows the fit step by step (it may raise to stop it),
        ``log(message)`` hears its estimated time and a line per layer, ``source`` says in words
        where ``data`` came from."""
        from structinit.init.impulse_write import prepare, write

        prepared = prepare(self, target, seed=seed, cache_dir=cache_dir, device=device, artifact=artifact,
                           cached=cached, progress=progress, check_pe=check_pe, data=data, fit_progress=fit_progress,
                           log=log, source=source)
        return write(self, target, prepared, seed)

    def without_fit(self) -> "ImpulseInit":
        """This spec with the data fit off (what a resumed run re-applies for the settings beside the
        weights, which its checkpoint holds): ``data_fit=0`` and the fit-only parameters at rest."""
        return dataclasses.replace(self, data_fit=0, data_fit_inputs="data", data_fit_batch=0)

    def fit_settings(self, subspace=None):
        """The data fit's :class:`~structinit.fit.settings.FitSettings` from this spec's parameters
        (``subspace``: the target's :class:`~structinit.init.position_subspace.PositionSubspace`,
        whose size and gain change what each layer sees)."""
        from structinit.fit.settings import FitSettings

        writes = {"mimetic_vproj": self.mimetic_vproj, "alpha2": self.alpha2, "beta2": self.beta2}
        if subspace is not None:
            writes.update(position_dims=subspace.dims, position_gain=round(subspace.gain, 9))
            if subspace.rest_scale:
                writes.update(position_rest=subspace.rest_scale)
        return FitSettings(steps=self.data_fit, mass=self.data_fit_mass, l2=self.data_fit_l2, lr=self.data_fit_lr,
                           norm=self.data_fit_norm, samples=self.data_fit_samples, version=self.data_fit_version,
                           batch=self.data_fit_batch, self_weight=self.self_weight,
                           calibrated_to=self.calibration_mass(),
                           writes=writes)

    def calibration_mass(self) -> float:
        """The mean attention on the target token that ``data_fit`` calibrates each head to:
        ``target_mass``, or the ``fast`` recipe's default."""
        if self.target_mass is not None:
            return float(self.target_mass)
        return float(recipe_params("fast", {})["target_mass"])
