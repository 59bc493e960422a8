"""``apply_checkpoint()``: initialize the attention of a saved checkpoint and write a new file, with
the init that a model of the same weights gets from ``initialize_model``.

Example::

    from structinit import apply_checkpoint
    report = apply_checkpoint("vit.pth")                    # impulse, fitted on noise inputs: no data
    report = apply_checkpoint("vit.pth", data="digits", out="vit-fit.pth")   # fitted on real inputs
    report = apply_checkpoint("vit.pth", "mimetic", heads=3, layers="0-5")
    report["output"]        # vit.impulse.pth, beside the input
    report["layers"][0]     # {"layer": 0, "replaced": [...], "hit_rate": ..., "target_mass": ...}

The impulse init's data fit runs through the model the checkpoint describes
(:mod:`structinit.apply.models`: a timm ViT, a Hugging Face ViT/DeiT, BERT or GPT-2,
a ``structinit train`` run), exactly as :func:`~structinit.init.initialize.initialize_model` runs it on
that model (:func:`structinit.init.impulse_write.prepare`): on the inputs ``data`` names
(:mod:`structinit.apply.inputs`), else on noise inputs of the model's input shape. A learned
position embedding gets the sin-cos table in its place (kept learnable), as on a model. The fitted
Q/K (a cached fitted artifact) are then written into every copy of the model in the file. A
checkpoint whose model structinit cannot build (``nn.MultiheadAttention``), or a model of token ids
without ``data``, gets the plain solve, and the report's ``data_fit`` says why.

Only the Q/K rows (and biases) of the selected layers change, plus V/proj where the spec says so
(mimetic, or impulse with ``mimetic_vproj``) and the position embedding (``set_pe``, or the table
for a learned one); every other tensor and entry is written back as loaded. Files are written as
:mod:`structinit.apply.files` says (nothing the user has is replaced unless asked).
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable, Dict, List, Optional, Union

from structinit.apply.files import LoadedCheckpoint, load_for_apply, write_output, write_position_table
from structinit.apply.options import ApplyOptions, split_settings
from structinit.errors import StructinitError, StructinitWarning, UsageError, param
from structinit.geometry.grid import Grid
from structinit.init.attention_target import AttentionTarget
from structinit.init.base import DEFAULT_METHOD, InitSpec
from structinit.init.changes import changed, snapshot
from structinit.init.checkpoints import describe_state_dict
from structinit.init.family import family_for_checkpoint
from structinit.init.registry import init_spec
from structinit.init.report import FitRecord, InitReport

#: The words of the position table written in place of a learned embedding.
TABLE_IN_PLACE = "sin-cos table x1 in place of the checkpoint's own {key}, kept learnable"


def apply_checkpoint(path: Union[str, os.PathLike], spec: Union[str, InitSpec] = DEFAULT_METHOD,
                     options: Optional[ApplyOptions] = None, *,
                     progress: Optional[Callable[[int, int], None]] = None,
                     log: Optional[Callable[[str], None]] = None,
                     fit_progress: Optional[Callable[[int, int], None]] = None, **settings: Any) -> Dict[str, Any]:
    """Initialize checkpoint ``path`` with ``spec`` (a spec, or a method name) and write the result
    (see the module docstring). ``options`` (:class:`~structinit.apply.options.ApplyOptions`) says where
    and how; ``settings`` are more options by name (``out=...``, ``data=...``) or the init's
    parameters (``filter=5``). ``progress(done, total)`` follows the solve and the layers,
    ``fit_progress`` the data fit, ``log(message)`` hears each stage (and the fit's estimated time).
    Returns a JSON-able report; with ``dry_run`` the plan only (nothing solved, built or written)."""
    options, params = split_settings(options, settings)
    spec = init_spec(spec, **params)
    if options.samples is not None and options.data is not None and spec.uses_data:
        spec = spec.with_fit_samples(options.samples)  # the fit reads the inputs it is given, as the report says
    loaded = load_for_apply(path, spec, options)
    fits = spec.uses_data
    model_path = fits and _can_fit(loaded, options)
    replaces = options.set_pe is None and spec.replaces_pos_embed(loaded.first)
    table = model_path and replaces
    missing = family_for_checkpoint(loaded.ckpt).unavailable()
    if fits and not model_path and replaces and missing is not None:
        # the model path would write the table in place of the learned embedding: the cause is the missing extra
        raise UsageError(f"the {loaded.ckpt.detected.layout.name} checkpoint's model is built by {missing}; without "
                         f"it the data fit cannot run, nor the sin-cos table replace its learned "
                         f"{loaded.ckpt.detected.pos_key} as it would on the model. Install it, or write the plain "
                         f"solve on the table with {param('set_pe')} sincos")
    if options.set_pe is None and not table:
        spec.check_pos_embed(loaded.first)  # a learned embedding it will not replace needs set_pe or fit_pe
    if table:
        loaded.plan["pos_embed_written"] = TABLE_IN_PLACE.format(key=loaded.ckpt.detected.pos_key)
    if options.dry_run:
        loaded.plan["dry_run"] = True
        loaded.plan["data_fit"] = "through the model the checkpoint describes" if model_path else None
        return loaded.plan
    say = log or (lambda message: None)
    before = [snapshot(sd) for _, sd in loaded.ckpt.state_dicts]
    if spec.needs_model:
        return _apply_through_model(loaded, spec, options, say, before)
    if options.set_pe:
        write_position_table(loaded, loaded.plan["pe_scale"])
    elif table:
        write_position_table(loaded, 1.0)
    prepared = _prepare_on_model(loaded, spec, options, say, progress, fit_progress) if model_path else None
    report = write_checkpoint(loaded, spec, options, prepared, progress, log, before)
    if fits and not model_path:
        report["data_fit"] = FitRecord(skipped=_why_no_fit(loaded)).to_dict()
    from structinit.init.baselines import base_note

    note = base_note(spec)
    if note is not None:
        report["base_note"] = StructinitError(note).render()
    return report


def write_checkpoint(loaded: LoadedCheckpoint, spec: InitSpec, options: ApplyOptions,
                     prepared: Any = None,
                     progress: Optional[Callable[[int, int], None]] = None,
                     log: Optional[Callable[[str], None]] = None,
                     before: Optional[List[Dict[str, Any]]] = None) -> Dict[str, Any]:
    """Initialize every copy of the model in ``loaded`` with ``spec`` and write the output file:
    with ``prepared`` (what :meth:`~structinit.init.base.InitSpec.prepare` made on the model the file
    describes: say, a fitted artifact) every copy gets it (:meth:`~structinit.init.base.InitSpec.write_copy`);
    without it the first copy is prepared and what it makes serves every other (one solve for
    all). Returns the report (the plan, with what was written; ``changed``: each state dict's
    changed tensors, read against ``before``, a :func:`~structinit.init.changes.snapshot` of each
    taken before anything was written, default now)."""
    if before is None:
        before = [snapshot(sd) for _, sd in loaded.ckpt.state_dicts]
    say = log or (lambda message: None)
    plan, views, first = loaded.plan, loaded.views, loaded.first
    common: Dict[str, Any] = {"seed": options.seed, "cache_dir": options.cache_dir, "device": options.device}
    shared = prepared
    if shared is None:
        first.progress = progress
        shared = spec.prepare(first, progress=progress, stage=say, **common)
    reports = []
    for i, view in enumerate(views):
        say(f"writing {plan['state_dicts'][i]}" + (f" ({i + 1}/{len(views)})" if len(views) > 1 else ""))
        view.progress = progress
        if prepared is None and i == 0:
            reports.append(spec.write(view, shared, **common))
        else:
            reports.append(spec.write_copy(view, shared, first=i == 0, progress=progress, stage=say, **common))
    report = reports[0]
    for line in spec.warnings(report, first, checkpoint=True, pe_scale=plan["pe_scale"]):
        warnings.warn(StructinitWarning(line.text), stacklevel=2)
    rows = {row.layer: row for row in report.layers}
    if not spec.reports_offsets and first.grid is not None:
        measured = describe_state_dict(loaded.ckpt.state_dicts[0][1], loaded.ckpt.detected, first.heads, first.grid)
        for got in measured["layers"]:
            row = rows.get(got["layer"])
            if row is not None:
                row.hit_rate, row.target_mass, row.mse = got["hit_rate"], got["target_mass"], got["mse"]
                row.offsets = got["offsets"]
        plan["measured_on"] = measured["measured_on"]
    plan["changed"] = _changed(loaded, before)
    say(f"writing {loaded.target}")
    write_output(loaded, options, plan)
    report.layers = [rows[i] for i in first.layers]
    _add_report(plan, report)
    plan["pos_embed_kind"] = first.pos_embed_kind()
    plan["written"] = True
    return plan


def _apply_through_model(loaded: LoadedCheckpoint, spec: InitSpec, options: ApplyOptions,
                         say: Callable[[str], None], before: List[Dict[str, Any]]) -> Dict[str, Any]:
    """A method that needs the model (:attr:`~structinit.init.base.InitSpec.needs_model`): build the
    model the checkpoint describes, initialize it as ``initialize_model`` does, and write every weight
    of the model back into every copy of it in the file (in the file's dtypes); entries the model
    does not hold are kept as loaded."""
    import torch

    from structinit.apply.models import checkpoint_model
    from structinit.init.initialize import initialize

    first = loaded.first
    say("building the model")
    built = checkpoint_model(loaded.ckpt, first.sd, model_name=options.model_name, config=options.config,
                             heads=first.heads, grid=first.grid)
    report = initialize(built.model, spec, grid=first.grid or built.grid, heads=first.heads, layers=options.layers,
                        seed=options.seed, cache_dir=options.cache_dir, device=options.device)
    prefix = loaded.ckpt.detected.model_prefix
    state = built.model.state_dict()
    for _, sd in loaded.ckpt.state_dicts:
        for name, value in state.items():
            key = prefix + name
            if isinstance(sd.get(key), torch.Tensor):
                sd[key] = value.detach().to(device=sd[key].device, dtype=sd[key].dtype).clone()
    plan = loaded.plan
    plan["changed"] = _changed(loaded, before)
    say(f"writing {loaded.target}")
    write_output(loaded, options, plan)
    _add_report(plan, report)
    if report.base_note is not None:
        plan["base_note"] = report.base_note
    plan.update(model=built.how, written=True, pos_embed_kind=first.pos_embed_kind())
    return plan


def _add_report(plan: Dict[str, Any], report: InitReport) -> None:
    """Add what the init reported (``report``, the first copy's) to ``apply``'s report ``plan``: the
    layers, their mean attention and what it was measured on, the position table written, the
    data fit and its inputs, and every one of the method's own values (:attr:`InitReport.extra`)
    under its name where the plan does not hold that name already."""
    plan["layers"] = [row.to_dict() for row in report.layers]
    if report.hit_rate is not None:
        plan.update(hit_rate=report.hit_rate, target_mass=report.target_mass)
    if report.measured_on is not None:
        plan["measured_on"] = report.measured_on
    if report.pos_embed_written:
        plan["pos_embed_written"] = report.pos_embed_written
    if report.holds("fit"):
        plan["data_fit"] = report.fit.to_dict() if report.fit is not None else None
    if report.data_source is not None:
        plan["data_source"] = report.data_source
    for name, value in report.extra.items():
        plan.setdefault(name, value)


def init_report_of(plan: Dict[str, Any]) -> InitReport:
    """The init's part of an ``apply`` report (:func:`apply_checkpoint`'s ``plan``), typed: what the
    command's summary (:meth:`~structinit.init.base.InitSpec.summary`) and notes read. The plan's
    ``changed`` (per state dict) and a dry run's planned ``data_fit`` (words) are left out."""
    keep = {k: v for k, v in plan.items() if k != "changed" and not (k == "data_fit" and isinstance(v, str))}
    return InitReport.from_dict(keep)


def _changed(loaded: LoadedCheckpoint, before: List[Dict[str, Any]]) -> Dict[str, List[str]]:
    """Each state dict's changed tensors (by its name), read against ``before``, its snapshots."""
    return {name: changed(old, sd) for name, (_, sd), old in zip(loaded.ckpt.where, loaded.ckpt.state_dicts, before)}


def _can_fit(loaded: LoadedCheckpoint, options: ApplyOptions) -> bool:
    """Whether the data fit can run on this checkpoint: its model can be built, and it takes
    inputs that noise can stand for or ``data`` gives. With ``data``, a checkpoint whose model
    cannot be built is refused."""
    family = family_for_checkpoint(loaded.ckpt)
    if options.data is not None:
        if not family.builds:
            raise UsageError(f"{param('data')} runs inputs through the model the checkpoint describes, and "
                             f"structinit cannot build the model of a {loaded.ckpt.detected.layout.name} checkpoint "
                             "(timm ViTs, Hugging Face ViT/DeiT, BERT and GPT-2, and structinit train checkpoints "
                             "it can)")
        return True
    if family.unavailable() is not None:
        return False  # said in the report (see _why_no_fit)
    return family.builds and family.takes_noise  # noise cannot stand for token ids


def _why_no_fit(loaded: LoadedCheckpoint) -> str:
    """Why the data fit did not run on a checkpoint (the report's ``data_fit.skipped``)."""
    layout = loaded.ckpt.detected.layout
    family = family_for_checkpoint(loaded.ckpt)
    plain = ("so Q/K are the plain solve on the position embedding alone, which real inputs mostly wash out "
             "(data_fit=0 asks for it explicitly)")
    if family.builds and not family.takes_noise:
        return (f"not run: the {layout.name} checkpoint's model takes token ids, which noise cannot stand for; give "
                f"data (token ids [B, L]) to fit them; {plain}")
    missing = family.unavailable()
    if missing is not None:
        return f"not run: the {layout.name} checkpoint's model is built by {missing}, {plain}"
    return f"not run: structinit cannot build and run the model of a {layout.name} checkpoint, {plain}"


def _regrid(loaded: LoadedCheckpoint, grid: Grid, options: ApplyOptions) -> None:
    """See every copy of the model in ``loaded`` on ``grid`` (a sequence's length, from its inputs)."""
    loaded.views = [AttentionTarget(view.sd, grid, view.heads, options.layers) for view in loaded.views]
    loaded.plan["grid"] = list(grid)


def _prepare_on_model(loaded: LoadedCheckpoint, spec: InitSpec, options: ApplyOptions, say: Callable[[str], None],
                      progress: Optional[Callable[[int, int], None]],
                      fit_progress: Optional[Callable[[int, int], None]]) -> Any:
    """Build the checkpoint's model from its first state dict (position table already written) and
    prepare the init on it as ``initialize_model`` does (for the impulse init: the fitted artifact)."""
    from structinit.apply.inputs import NOISE, fit_inputs_for
    from structinit.apply.models import checkpoint_model

    first = loaded.first
    say("building the model")
    built = checkpoint_model(loaded.ckpt, first.sd, model_name=options.model_name, config=options.config,
                             heads=first.heads, grid=first.grid)
    data, source = None, None
    if options.data is not None and not (isinstance(options.data, str) and options.data == NOISE):
        inputs = fit_inputs_for(options.data, built, spec.fit_samples, options.data_dir)
        data, source = inputs.x, inputs.source
    if built.inputs.ids and options.grid is None and data is not None:
        _regrid(loaded, Grid((int(data.shape[-1]),)), options)  # a sequence model's grid is the inputs' length
        first = loaded.first
    if data is not None:
        data = built.inputs.as_model_batch(data)
    view = AttentionTarget(built.model, first.grid, first.heads, options.layers, inputs=built.inputs)
    grids = [g.describe() if g is not None else "unknown" for g in (view.grid, first.grid)]
    if grids[0] != grids[1] or (view.dim, view.depth) != (first.dim, first.depth):
        raise StructinitError(f"the model built for {loaded.path} ({built.how}) has grid {grids[0]}, dim "
                              f"{view.dim}, depth {view.depth}; the checkpoint has grid {grids[1]}, dim "
                              f"{first.dim}, depth {first.depth}")
    spec.check_target(view)
    prepared = spec.prepare(view, seed=options.seed, cache_dir=options.cache_dir, device=options.device,
                            progress=progress, data=data, fit_progress=fit_progress, log=say, source=source,
                            stage=say)
    loaded.plan["model"] = built.how
    return prepared


__all__ = ["apply_checkpoint", "write_checkpoint", "init_report_of", "TABLE_IN_PLACE"]
