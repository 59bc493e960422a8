"""What an impulse spec and its artifact must satisfy: the spec's parameters
(:func:`check_impulse_params`), and, before an artifact is written into a target, the model's shape
and layers (:func:`check_artifact`) and its attention mask (:func:`check_causal`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

from structinit.errors import UsageError, param, setting
from structinit.fit.settings import FIT_VERSIONS
from structinit.geometry.embedding import PSEUDO_INPUTS
from structinit.geometry.grid import Grid
from structinit.geometry.targets import OFFSET_ORDERS, PADDINGS, check_choice
from structinit.init.baselines import BASES
from structinit.solver.recipes import check_recipe, recipe_params

#: What the data fit runs on when a batch is given: the batch (``data``), or Gaussian noise inputs of
#: its shape (``noise``; see :mod:`structinit.fit.inputs`). Without a batch it runs on noise.
DATA_FIT_INPUTS = ("data", "noise")
#: The parameters that tune the data fit only: with ``data_fit=0`` (no fit) each must stay at its
#: default, since it would change nothing.
#: (``data_fit_version`` is left out: no key carries it without a fit, and every version fits nothing then.)
FIT_ONLY_PARAMS = ("data_fit_mass", "data_fit_l2", "data_fit_lr", "data_fit_norm", "data_fit_samples",
                   "data_fit_batch", "data_fit_inputs")


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


def check_given_artifact(artifact, cache_dir, grid: Grid, dim: int, heads: int) -> None:
    """Read the ``artifact`` an impulse spec names (a path or key in ``cache_dir``): a missing or
    damaged one is refused before any work, as the write would refuse it; so is one of another shape."""
    from structinit.solver.cache import resolve_artifact

    check_artifact(resolve_artifact(artifact, cache_dir), grid, dim, heads, [0])


def check_subspace_layers(spec, target) -> None:
    """The position subspace rewrites the embeddings every layer reads (and keeps each layer's
    writes out of it): refused unless every layer of ``target`` is selected."""
    if spec.position_subspace and len(target.layers) != target.depth:
        raise UsageError(f"impulse parameter {param('position_subspace')} writes the position table into the "
                         "embedding every layer reads and keeps each layer's writes out of it, so the layers "
                         f"{param('layers')} leaves out would change too: select every layer, or leave "
                         "position_subspace out")


def check_content_target(spec, target) -> None:
    """``content_qk`` fills the head columns the position subspace leaves free: refused where the
    subspace (``position_dims``, or its automatic size) is as wide as the target's heads."""
    if spec.content_qk == "none":
        return
    from structinit.init.position_subspace import auto_dims

    head_dim = target.dim // target.heads
    dims = spec.position_dims or auto_dims(target.dim, target.heads, target.grid.ndim)
    if dims >= head_dim:
        raise UsageError(f"impulse parameter {param('content_qk')} fills the columns of each head that the "
                         f"position part leaves free, and {param('position_dims')} {dims} leaves none of the "
                         f"head dim {head_dim}: give position_dims below {head_dim}")


def check_fit_only(spec) -> None:
    """Refuse a data-fit parameter away from its default when ``data_fit`` is 0: it would change
    nothing (the message names the parameter)."""
    if spec.data_fit:
        return
    defaults = {f.name: f.default for f in dataclasses.fields(spec)}
    for name in FIT_ONLY_PARAMS:
        if getattr(spec, name) != defaults[name]:
            raise UsageError(f"impulse parameter {param(name)} tunes the data fit, and data_fit is 0 (no fit): "
                             "leave it out")


def check_causal(target, causal: bool) -> None:
    """Raise :class:`UsageError` when causal offsets meet a model that attends both ways, or
    non-causal ones a decoder that masks later tokens (``target.causal``; ``None`` accepts both)."""
    if target.causal is True and not causal:
        raise UsageError(f"the {target.layout} model attends only to earlier tokens (a causal mask); pass "
                         f"{param('causal')} so that every offset lies in the past")
    if target.causal is False and causal:
        raise UsageError(f"{param('causal')} solves for a decoder's causal mask, but the {target.layout} model "
                         "attends in both directions")


def check_impulse_params(spec) -> None:
    """Raise :class:`UsageError` for an impulse spec whose parameters are out of range or cannot go
    together (each message names the parameter)."""
    spec.check_positive("filter", "pe_scale")
    spec.check_positive("tolerance", "data_fit", "data_fit_l2", allow_zero=True)
    spec.check_positive("data_fit_lr", "data_fit_norm", "data_fit_samples")
    if not 0 <= spec.self_weight < 1:
        raise UsageError(f"impulse parameter {param('self_weight')} must lie in [0, 1) (the identity term's "
                         f"share of each head), got {spec.self_weight}")
    if not 0 < spec.data_fit_mass < 1:
        raise UsageError(f"impulse parameter {param('data_fit_mass')} must lie strictly between 0 and 1, "
                         f"got {spec.data_fit_mass}")
    if spec.data_fit_version not in FIT_VERSIONS:
        raise UsageError(f"impulse parameter {param('data_fit_version')} must be one of "
                         f"{', '.join(map(str, FIT_VERSIONS))}, got {spec.data_fit_version}")
    spec.check_positive("data_fit_batch", "pe_factor", allow_zero=True)
    if spec.data_fit_inputs not in DATA_FIT_INPUTS:
        raise UsageError(f"impulse parameter {param('data_fit_inputs')} must be one of "
                         f"{', '.join(DATA_FIT_INPUTS)}, got {spec.data_fit_inputs!r}")
    check_fit_only(spec)
    if spec.pe_factor is not None and (not spec.fit_pe or spec.pe_factor == 0):
        raise UsageError(f"impulse parameter {param('pe_factor')} scales the target's own position embedding "
                         f"for {param('fit_pe')}: give fit_pe=true and a positive factor")
    if spec.data_fit_batch and spec.data_fit_version == 1:
        raise UsageError(f"impulse parameter {param('data_fit_batch')} sets the images of a version-2 fit step, "
                         "and version 1 steps on the whole batch: leave it out")
    check_value_params(spec)
    check_choice("base", spec.base, BASES)
    check_subspace_params(spec)
    check_recipe(spec.recipe)
    recipe_params(spec.recipe, {**spec.recipe_params, "target_mass": spec.target_mass}
                  if spec.target_mass is not None else spec.recipe_params)  # refuse bad values now
    check_choice("offset_order", spec.offset_order, OFFSET_ORDERS)
    check_choice("padding", spec.padding, PADDINGS)
    check_choice("pseudo_input", spec.pseudo_input, PSEUDO_INPUTS)
    if spec.pseudo_input_rest is not None:
        check_choice("pseudo_input_rest", spec.pseudo_input_rest, PSEUDO_INPUTS)
    if spec.target_mass is not None and spec.recipe != "fast":
        raise UsageError(f"impulse parameter {param('target_mass')} is the fast recipe's; recipe "
                         f"{spec.recipe!r} has no softness knob")
    if spec.fit_pe:
        if spec.artifact is not None:
            raise UsageError(f"impulse parameters {param('fit_pe')} and {param('artifact')} exclude each other: "
                             "fit_pe solves for the target's own position embedding")
        if spec.pe_scale is not None:
            raise UsageError(f"impulse parameters {param('fit_pe')} and {param('pe_scale')} exclude each other: "
                             "pe_scale writes the sin-cos table, fit_pe fits the embedding the target has")
        if not any(k.startswith("pe") for k in (spec.pseudo_input, spec.pseudo_input_rest) if k):
            raise UsageError(f"impulse parameter {param('fit_pe')} needs a 'pe' {param('pseudo_input')}, got "
                             f"{spec.pseudo_input!r}")


#: What ``value_init`` may name: mimetic init's V/proj, or conditioned init's V (the identity per head).
VALUE_INITS = ("mimetic", "conditioned")


def check_value_params(spec) -> None:
    """``alpha2``/``beta2`` tune the mimetic V/proj, which ``mimetic_vproj=false`` and
    ``value_init=conditioned`` do not write; ``value_init`` replaces what ``mimetic_vproj`` writes,
    so it needs it on."""
    check_choice("value_init", spec.value_init, VALUE_INITS)
    if not spec.mimetic_vproj and spec.value_init != "mimetic":
        raise UsageError(f"impulse parameter {param('value_init')} sets V in place of the mimetic V/proj, which "
                         f"{setting('mimetic_vproj', False)} keeps as it is: give one of them")
    defaults = {f.name: f.default for f in dataclasses.fields(spec)}
    unused = [name for name in ("alpha2", "beta2") if getattr(spec, name) != defaults[name]]
    if not unused or (spec.mimetic_vproj and spec.value_init == "mimetic"):
        return
    what = f"impulse parameter {', '.join(param(n) for n in unused)} {'sets' if len(unused) == 1 else 'set'} the " \
           "mimetic V/proj, which"
    if not spec.mimetic_vproj:
        raise UsageError(f"{what} {setting('mimetic_vproj', False)} keeps as it is: give "
                         f"{setting('mimetic_vproj', True)}, or leave them out")
    raise UsageError(f"{what} {setting('value_init', 'conditioned')} does not write: leave them out")


def check_subspace_params(spec) -> None:
    """``position_dims`` sizes the subspace ``position_subspace`` turns on, and the subspace writes
    its own table: it excludes ``fit_pe`` and a given ``artifact``."""
    spec.check_positive("position_dims", allow_zero=True)
    if spec.position_dims and not spec.position_subspace:
        raise UsageError(f"impulse parameter {param('position_dims')} sizes the position subspace, which is off: "
                         "give position_subspace=true, or leave position_dims out")
    if spec.position_rest and not spec.position_subspace:
        raise UsageError(f"impulse parameter {param('position_rest')} changes the position subspace, which is off: "
                         "give position_subspace=true, or leave position_rest out")
    if spec.position_keep_norms and not spec.position_subspace:
        raise UsageError(f"impulse parameter {param('position_keep_norms')} rescales the tensors the position "
                         f"subspace projects, and the subspace is off: give {setting('position_subspace', True)}, "
                         "or leave position_keep_norms out")
    if spec.position_subspace and not spec.mimetic_vproj:
        raise UsageError(f"impulse parameter {param('position_subspace')} projects every layer's output projection "
                         f"out of its directions, which {setting('mimetic_vproj', False)} would keep as it is: give "
                         "one of them")
    check_content_params(spec)
    if spec.position_subspace:
        for other in ("fit_pe", "artifact"):
            if getattr(spec, other):
                raise UsageError(f"impulse parameters {param('position_subspace')} and {param(other)} exclude each "
                                 "other: the subspace writes its own position table and solves for it")


def check_content_params(spec) -> None:
    """``content_qk`` fills the head columns the position subspace leaves free, and ``content_scale``
    scales what it writes: each needs the one before it."""
    from structinit.init.content_qk import CONTENT_QK

    if spec.content_qk not in CONTENT_QK:
        raise UsageError(f"impulse parameter {param('content_qk')} must be one of {', '.join(CONTENT_QK)}, "
                         f"got {spec.content_qk!r}")
    spec.check_positive("content_scale")
    if spec.content_qk != "none" and not spec.position_subspace:
        raise UsageError(f"impulse parameter {param('content_qk')} writes Q/K on the directions the position "
                         "subspace leaves to content, and the subspace is off: give "
                         f"{setting('position_subspace', True)}, or leave content_qk out")
    if spec.content_scale != 1.0 and spec.content_qk == "none":
        raise UsageError(f"impulse parameter {param('content_scale')} scales the content Q/K that content_qk writes, "
                         f"and content_qk is none: give {setting('content_qk', 'mimetic')} or "
                         f"{setting('content_qk', 'conditioned')}, or leave content_scale out")
    if spec.content_qk != "none" and spec.self_weight:
        raise UsageError(f"impulse parameters {param('content_qk')} and {param('self_weight')} exclude each other: "
                         "the self term's identity would be mixed into every head's columns, content ones "
                         "included; leave one of them out")
    if spec.content_zero_keys and spec.content_qk == "none":
        raise UsageError(f"impulse parameter {param('content_zero_keys')} zeroes the content keys that content_qk "
                         f"writes, and content_qk is none: give {setting('content_qk', 'mimetic')} or "
                         f"{setting('content_qk', 'conditioned')}, or leave content_zero_keys out")


__all__ = ["check_artifact", "check_causal", "check_content_params", "check_content_target", "check_given_artifact",
           "check_impulse_params", "check_subspace_layers", "check_subspace_params"]


class ImpulseRefusals:
    """Impulse init's refusals of a target (a mixin of :class:`~structinit.init.impulse.ImpulseInit`,
    which holds the parameters named here): causal offsets where the model's mask asks for them and
    only there, a data fit only on a model whose q and k are linear maps, the position embedding it
    solves for."""

    artifact: Optional[Any]
    causal: bool
    data_fit: int
    pe_scale: Optional[float]
    fit_pe: bool

    def check_target(self, target) -> None:
        """A decoder that masks later tokens (GPT-2) needs causal offsets; a model known to attend
        both ways (BERT) must not get them (they were solved under a mask it does not apply). An
        artifact given by path or key is checked once it is read (in :meth:`prepare`)."""
        if self.artifact is None:
            check_causal(target, self.causal)
        elif hasattr(self.artifact, "config"):
            check_causal(target, self.artifact.config.causal)
        check_subspace_layers(self, target)
        check_content_target(self, target)

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
            why = target.family.qk_not_linear(model, projection_module(model, target.det.slots[i].q.key), i)
            if why is not None:
                raise UsageError(f"impulse parameter {param('data_fit')} fits q and k as linear maps; {why}")

    def check_pos_embed(self, target, art=None) -> None:
        """See :func:`structinit.init.impulse_solve.check_pos_embed`."""
        from structinit.init.impulse_solve import check_pos_embed

        check_pos_embed(self, target, art)

    def replaces_pos_embed(self, target) -> bool:
        """A learned position embedding (timm's trunc normal 0.02, ``[1, T, D]``) tells the layers
        almost nothing of position: unless ``pe_scale``, ``fit_pe`` or ``artifact`` says otherwise,
        the sin-cos table takes its place (kept learnable; docs/results/stock-models)."""
        return (self.pe_scale is None and not self.fit_pe and self.artifact is None and target.pos_key is not None
                and target.pos_embed_kind() == "other" and target.sd[target.pos_key].dim() == 3)

    # ---- the solve
