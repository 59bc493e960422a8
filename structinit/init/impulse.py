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

from structinit.fit.settings import FIT_DEFAULTS as _FIT
from structinit.init.base import InitSpec, register
from structinit.init.impulse_checks import ImpulseRefusals, check_given_artifact, check_impulse_params
from structinit.init.impulse_fit import ImpulseDataFit
from structinit.init.impulse_notices import PLAIN_SOLVE_NOTE, ImpulseNotices
from structinit.init.mimetic import vproj_keys
from structinit.init.report import FitRecord, InitReport
from structinit.solver.recipes import (
    DEFAULT_FILTER,
    DEFAULT_OFFSET_ORDER,
    DEFAULT_PADDING,
    DEFAULT_PSEUDO_INPUT,
    DEFAULT_RECIPE,
)


@register
@dataclass(frozen=True)
class ImpulseInit(ImpulseDataFit, ImpulseRefusals, ImpulseNotices, InitSpec):
    """Impulse init's parameters.

    Solve settings (see :class:`~structinit.solver.config.SolveConfig`): ``filter``, ``recipe``,
    ``target_mass`` (the ``fast`` recipe's softness: mean attention on the target token),
    ``recipe_params`` (any other recipe parameter, e.g. ``{"iters": 2000}``), ``share``,
    ``offset_order``, ``padding``, ``causal`` (sequences: offsets only in the past, for a decoder's
    causal mask), ``pseudo_input``, ``pseudo_input_rest``; or ``artifact`` (a path or cache key) to
    use a solved one. ``mimetic_vproj`` (default on) also sets V/proj as mimetic init does
    (``alpha2``, ``beta2``); ``value_init="conditioned"`` sets V as conditioned init does instead
    (the rectangular identity per head, its bias zeroed) and leaves the output projection at
    ``base``. ``pe_scale`` (models only) writes the sin-cos position embedding times it (a learned
    embedding stays learnable, starting from the table). ``fit_pe`` solves Q/K for
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
    reports_offsets = True
    fits_data = True
    writes = ("Q/K rows and biases; V and output projection (mimetic_vproj; V and its bias alone with "
              "value_init=conditioned); pos_embed (pe_scale)")
    needs_grid = True
    filter: int = DEFAULT_FILTER
    recipe: str = DEFAULT_RECIPE
    target_mass: Optional[float] = None
    recipe_params: Dict[str, Any] = field(default_factory=dict)
    share: bool = False
    offset_order: str = DEFAULT_OFFSET_ORDER
    padding: str = DEFAULT_PADDING
    pseudo_input: str = DEFAULT_PSEUDO_INPUT
    pseudo_input_rest: Optional[str] = None
    artifact: Optional[Any] = None
    mimetic_vproj: bool = True
    alpha2: float = 0.4
    beta2: float = 0.4
    pe_scale: Optional[float] = None
    fit_pe: bool = False
    tolerance: float = 0.02
    causal: bool = False
    data_fit: int = _FIT.steps
    data_fit_mass: float = _FIT.mass
    data_fit_l2: float = _FIT.l2
    data_fit_lr: float = _FIT.lr
    data_fit_norm: float = _FIT.norm
    data_fit_samples: int = _FIT.samples
    self_weight: float = _FIT.self_weight
    data_fit_version: int = _FIT.version
    data_fit_batch: int = _FIT.batch
    data_fit_inputs: str = "data"
    pe_factor: Optional[float] = None
    base: str = "model"
    has_base = True
    position_subspace: bool = False
    position_dims: int = 0
    position_rest: bool = False
    position_keep_norms: bool = False
    content_qk: str = "none"
    content_scale: float = 1.0
    content_zero_keys: bool = False
    value_init: str = "mimetic"

    #: Parameters added after run keys were in use: left out of :meth:`to_dict` at their defaults.
    optional_defaults = ("data_fit", "data_fit_mass", "data_fit_l2", "data_fit_lr", "data_fit_norm",
                         "data_fit_samples", "self_weight", "data_fit_version", "data_fit_batch", "data_fit_inputs",
                         "pe_factor", "base", "position_subspace", "position_dims", "position_rest",
                         "position_keep_norms",
                         "content_qk", "content_scale", "content_zero_keys", "value_init")
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
        if not self.mimetic_vproj:
            return super().planned(slot)
        if self.value_init == "conditioned":
            from structinit.init.conditioned import value_keys

            return super().planned(slot) + value_keys(slot)
        return super().planned(slot) + vproj_keys(slot)

    # ---- the data fit (its settings: ImpulseDataFit)

    def with_fit_samples(self, samples: int) -> "ImpulseInit":
        return dataclasses.replace(self, data_fit_samples=samples) if self.data_fit else self

    def is_causal(self) -> bool:
        """``causal``: offsets only in the past, solved under a decoder's mask."""
        return self.causal

    def without_fit(self) -> "ImpulseInit":
        """This spec with the data fit off (what a resumed run re-applies for the settings beside the
        weights, which its checkpoint holds): ``data_fit=0`` and the fit-only parameters at rest."""
        if not self.data_fit:
            return self
        from structinit.init.impulse_checks import FIT_ONLY_PARAMS

        rest: Dict[str, Any] = {f.name: f.default for f in dataclasses.fields(self) if f.name in FIT_ONLY_PARAMS}
        return dataclasses.replace(self, data_fit=0, **rest)

    def writes_every_layer(self) -> bool:
        """With ``position_subspace``: the subspace is kept out of every layer's writes."""
        return self.position_subspace

    # ---- refusals (the others: ImpulseRefusals)

    def check_shape(self, grid, dim: int, heads: int, depth: int, seed: int = 0, cache_dir=None) -> None:
        """A solve's settings for this shape (refused by :meth:`solve_config`), or the given artifact."""
        if self.artifact is None:
            self.solve_config(grid, dim, heads, depth, seed)
        else:
            check_given_artifact(self.artifact, cache_dir, grid, dim, heads)

    # ---- the solve

    def solve_config(self, grid, dim: int, heads: int, depth: int, seed: int = 0, embedding=None):
        """See :func:`structinit.init.impulse_solve.solve_config`."""
        from structinit.init.impulse_solve import solve_config

        return solve_config(self, grid, dim, heads, depth, seed, embedding)

    def presolves(self, shape, seed: int = 0) -> List[Any]:
        """The plain solve of a model of ``shape()``'s ``(grid, dim, heads, depth)`` (none for a given artifact)."""
        if self.artifact is not None:
            return []
        grid, dim, heads, depth = shape()
        return [self.solve_config(grid, dim, heads, depth, seed)]

    def artifact_for(self, t, seed: int = 0, cache_dir=None, device: str = "cpu", progress=None):
        """See :func:`structinit.init.impulse_solve.artifact_for`."""
        from structinit.init.impulse_solve import artifact_for

        return artifact_for(self, t, seed, cache_dir, device, progress)

    # ---- the steps

    def prepare(self, target, *, seed: int = 0, cache_dir=None, device: str = "cpu", data=None,
                source: Optional[str] = None, progress=None, fit_progress=None, log=None, stage=None,
                artifact=None, cached: Optional[bool] = None, check_pe: bool = True):
        """See :func:`structinit.init.impulse_write.prepare`: the base, the position table, the
        artifact (solved, read or ``artifact`` as given, with ``cached``; a fitted one is written as
        it is) and, on a model, the data fit. ``data``: a batch of real, normalized model inputs
        (``[B, C, H, W]`` images or ``[B, L]`` sequences); without it the fit runs on noise inputs of
        the model's input shape (see :mod:`structinit.fit.inputs`), and on a state dict, which holds
        no model, it is skipped. ``check_pe=False`` skips :meth:`check_pos_embed` (for a copy of a
        model already checked, e.g. an EMA state dict, which gets the same weights)."""
        from structinit.init.impulse_write import prepare

        return prepare(self, target, seed=seed, cache_dir=cache_dir, device=device, artifact=artifact, cached=cached,
                       progress=progress, check_pe=check_pe, data=data, fit_progress=fit_progress, log=log,
                       source=source, stage=stage)

    def write(self, target, prepared=None, *, seed: int = 0, cache_dir=None, device: str = "cpu") -> InitReport:
        """See :func:`structinit.init.impulse_write.write`."""
        from structinit.init.impulse_write import write

        return write(self, target, prepared, seed)

    def write_copy(self, target, shared, *, first: bool, seed: int = 0, cache_dir=None, device: str = "cpu",
                   progress=None, stage=None) -> InitReport:
        """The artifact ``shared`` holds (fitted on the model the checkpoint describes, or solved for
        its first copy), written into ``target`` as it is: no solve, no fit, no second check of
        the position embedding; the report's ``data_fit`` is the model's fit, and ``data_source`` the
        inputs it ran on in this call (a fit read from the cache says so in ``data_fit``)."""
        from structinit.init.impulse_write import fit_record

        cached = shared.fit_cached if shared.on_model else shared.cached
        report = self.apply(target, seed=seed, cache_dir=cache_dir, device=device, artifact=shared.artifact,
                            cached=cached, check_pe=False)
        if shared.on_model:
            fit = fit_record(self, shared)
            report.fit = FitRecord.from_dict(fit) if fit is not None else None
            if shared.inputs is not None:
                report.data_source = shared.inputs.source
        return report

    # ---- what the user is told: ImpulseNotices


__all__ = ["ImpulseInit", "PLAIN_SOLVE_NOTE"]
