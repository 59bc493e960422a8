"""Initialize a model or a state dict with an init method: the entry points every path goes
through (``structinit train``, ``apply_checkpoint`` writes its copies with the spec's own ``apply``).

Example::

    report = initialize_model(model, "impulse")                    # fitted on noise inputs (no data)
    report = initialize_model(model, "impulse", data=images[:256]) # fitted to real inputs
    report = initialize(state_dict, "mimetic", heads=3)            # a state dict: heads where it cannot tell
"""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING, Any, Callable, MutableMapping, Optional, Sequence, Union

from structinit.errors import SYNTAX, StructinitWarning, UsageError
from structinit.geometry.grid import GridLike
from structinit.init.base import InitSpec
from structinit.init.changes import changed, snapshot
from structinit.init.registry import init_spec
from structinit.init.report import InitReport

if TYPE_CHECKING:
    import torch


def initialize(target: Union[torch.nn.Module, MutableMapping[str, Any]], spec: Union[str, InitSpec], *,
               grid: Optional[GridLike] = None, heads: Optional[int] = None,
               layers: Union[None, str, Sequence[int]] = None, seed: int = 0,
               cache_dir: Union[str, os.PathLike, None] = None, device: str = "cpu",
               data: Optional[torch.Tensor] = None, progress: Optional[Callable[[int, int], None]] = None,
               log: Optional[Callable[[str], None]] = None, source: Optional[str] = None,
               **params: Any) -> InitReport:
    """Initialize a model or a state dict (written in place) with ``spec`` (a spec, or a method name
    with ``params``) and return its :class:`~structinit.init.report.InitReport` (its JSON form:
    ``report.to_dict()``); its ``changed`` names every tensor whose values the init changed (read
    from the tensors, before against after).

    ``grid``/``heads`` are needed only where the target does not tell; ``layers`` selects attention
    layers (``None``: all; a spec such as ``"0-3,5"`` or a list of indices). ``data``: a batch of
    real, normalized inputs for a method that fits to them (impulse, whose ``data_fit`` is on by
    default); the others do not use it. Without ``data`` the fit runs on Gaussian noise inputs of
    the model's input shape, and one line says so (to ``log``, else a
    :class:`~structinit.errors.StructinitWarning`); a state dict, which holds no model, gets the
    plain solve and a warning, as does a fit that leaves a layer hitting its offsets in under 0.9 of
    its inputs' rows. ``progress(done, total)``
    follows that fit step by step (raise from it to stop the fit), ``log(message)`` gets a line
    per fitted layer, and ``source`` (words) says where ``data`` came from, for the fitted artifact.
    """
    from structinit.init.attention_target import AttentionTarget
    from structinit.init.finite import (
        attention_keys,
        check_finite,
        check_finite_inputs,
        check_float_weights,
        model_tensors,
    )

    spec = init_spec(spec, **params)
    t = AttentionTarget(target, grid, heads, layers, need_grid=spec.needs_grid)
    spec.check_target(t)
    where = "the model" if hasattr(target, "named_parameters") else "the state dict"
    check_float_weights(((k, t.sd.get(k)) for k in attention_keys(t.det)), where)
    check_finite(model_tensors(target), where)  # a diverged model would give NaN Q/K in every layer
    if data is not None and spec.uses_data:
        check_finite_inputs(data)
    before = snapshot(t.sd)
    report = spec.apply(t, seed=seed, cache_dir=cache_dir, device=device, data=data, fit_progress=progress, log=log,
                        source=source)
    report.changed = changed(before, target.state_dict() if hasattr(target, "state_dict") else t.sd)
    for line in spec.warnings(report, t):
        if line.loggable and log is not None:
            log(("warning: " if line.warning else "") + StructinitWarning(line.text).render(SYNTAX.get()))
        else:
            warnings.warn(StructinitWarning(line.text), stacklevel=3)
    return _with_base_note(spec, report)


def _with_base_note(spec: InitSpec, report: InitReport) -> InitReport:
    """``report`` with ``base_note`` where the init kept the other weights (see
    :func:`~structinit.init.baselines.base_note`)."""
    from structinit.init.baselines import base_note

    note = base_note(spec)
    if note is not None:
        report.base_note = StructinitWarning(note).render()
    return report


def initialize_model(model: torch.nn.Module, spec: Union[str, InitSpec], *, grid: Optional[GridLike] = None,
                     seed: int = 0, data: Optional[torch.Tensor] = None,
                     progress: Optional[Callable[[int, int], None]] = None,
                     log: Optional[Callable[[str], None]] = None, source: Optional[str] = None,
                     **params: Any) -> InitReport:
    """Initialize a timm-style model in place (``grid`` defaults to ``model.patch_embed.grid_size``)
    and return its :class:`~structinit.init.report.InitReport`; ``data``: real inputs for a method
    that fits to them, ``progress``, ``log`` and ``source`` go with that fit (see :func:`initialize`).
    Example::

        model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=2,
                                  class_token=False, global_pool="avg", num_classes=10)
        set_sincos_pos_embed(model)
        report = initialize_model(model, "impulse", data=images[:256])  # fitted to real inputs
        report = initialize_model(model, "impulse")             # fitted to noise inputs: no data needed
        report = initialize_model(model, "impulse", data_fit=0)  # the plain solve (measured to lose)
    """
    from structinit.init.attention_target import is_module

    if not is_module(model):
        raise UsageError("initialize_model needs an nn.Module; use initialize() for a state dict")
    return initialize(model, spec, grid=grid, seed=seed, data=data, progress=progress, log=log, source=source,
                      **params)
