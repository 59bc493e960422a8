"""``apply_checkpoint()``: initialize the attention of a saved checkpoint and write a new file.

Example::

    from structinit import apply_checkpoint
    report = apply_checkpoint("vit.pth", "impulse", filter=3, layers="0-5")
    report["output"]        # vit.impulse.pth, beside the input
    report["layers"][0]     # {"layer": 0, "replaced": [...], "hit_rate": 1.0, "target_mass": 0.3, ...}

Only the Q/K rows (and Q/K biases) of the selected layers change, plus V/proj where the spec says
so (``mimetic``, or ``impulse`` with ``mimetic_vproj``) and the position embedding with
``set_pe='sincos'``; every other tensor and entry is written back as loaded. Every copy of the
model in the file (e.g. ``state_dict`` and ``state_dict_ema``) gets the same weights.

Files: the output's format follows its name (``.safetensors``: safetensors, anything else a
``torch.save`` file) and it gets the input's permission bits. Nothing the user has is replaced
unless asked: an existing output is refused (``force`` replaces it), a new one is created
exclusively (of two runs writing the same name, one wins and the other is told), and
``in_place`` keeps the original as ``CKPT.bak`` (``CKPT.bak.1``, ... when that exists: a backup is
never overwritten) and then replaces the input atomically.

The reported hit rate and target mass are measured from the written weights on the checkpoint's
own position embedding, LayerNorm'd (``measured_on`` says so), after ``set_pe``: a learned
embedding is refused for the impulse method unless ``set_pe='sincos'`` or ``fit_pe=True`` says
what to do (see :class:`~structinit.init.impulse.ImpulseInit`).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Sequence, Union

from structinit.errors import StructinitError, UsageError, param
from structinit.geometry.grid import Grid
from structinit.init.base import InitSpec
from structinit.init.checkpoints import (
    CheckpointError,
    check_checkpoint_path,
    describe_state_dict,
    load_checkpoint,
    output_format,
    safetensors_dict,
    save_checkpoint,
)
from structinit.init.specs import init_spec
from structinit.init.target import AttentionTarget

PE_KINDS = ("sincos",)
#: File-name endings of checkpoints, kept after the method's name in a default output name.
CHECKPOINT_SUFFIXES = (".pt", ".pth", ".bin", ".tar", ".ckpt", ".safetensors", ".gz")


def default_output(path: Path, method: str) -> Path:
    """``NAME.METHOD.EXT`` beside the input, ``EXT`` being its checkpoint endings (``vit.pth`` ->
    ``vit.impulse.pth``, ``run.pth.tar`` -> ``run.impulse.pth.tar``)."""
    name, ends = path.name, ""
    while Path(name).suffix.lower() in CHECKPOINT_SUFFIXES and Path(name).stem:
        ends = Path(name).suffix + ends
        name = Path(name).stem
    return path.with_name(f"{name}.{method}{ends}")


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (b.exists() and os.path.samefile(a, b))
    except OSError:
        return False


def _output_path(path: Path, method: str, out: Optional[os.PathLike], in_place: bool, force: bool) -> Path:
    if in_place and out is not None:
        raise UsageError(f"give either {param('out')} or {param('in_place')}, not both")
    if in_place:
        return path.resolve()  # a symlink's file is replaced, not the link
    if out is not None and str(out).strip() == "":
        raise UsageError(f"{param('out')} needs a file name")
    target = Path(out).expanduser() if out is not None else default_output(path, method)
    if target.is_dir():
        raise UsageError(f"{param('out')} {target} is a folder; give a file name")
    if _same_file(path, target):
        raise UsageError(f"{param('out')} {target} is the input file; use {param('in_place')} to replace it "
                         "(a backup is kept)")
    if not target.parent.is_dir():
        raise UsageError(f"{param('out')} {target}: folder {target.parent} does not exist")
    if target.exists() and not force:
        how = "" if out is not None else f" (the default output name; choose another with {param('out')})"
        raise UsageError(f"{target} already exists{how}; pass {param('force')} to replace it")
    if target.exists() and not target.is_file():
        raise UsageError(f"{param('out')} {target} exists and is not a regular file")
    return target


def _check_pe_scale(pe_scale: Optional[float], set_pe: Optional[str]) -> None:
    if pe_scale is None:
        return
    if set_pe is None:
        raise UsageError(f"{param('pe_scale')} scales the embedding {param('set_pe')} writes; give set_pe too")
    if isinstance(pe_scale, bool) or not isinstance(pe_scale, (int, float)) or not math.isfinite(pe_scale) \
            or pe_scale <= 0:
        raise UsageError(f"{param('pe_scale')} must be a positive finite number, got {pe_scale!r}")


def apply_checkpoint(path: Union[str, os.PathLike], spec: Union[str, InitSpec] = "impulse", *,
                     out: Optional[os.PathLike] = None, in_place: bool = False, dry_run: bool = False,
                     force: bool = False, layers: Union[None, str, Sequence[int]] = None,
                     heads: Optional[int] = None, grid=None, set_pe: Optional[str] = None,
                     pe_scale: Optional[float] = None, seed: int = 0, cache_dir=None, device: str = "cpu",
                     progress: Optional[Callable[[int, int], None]] = None,
                     log: Optional[Callable[[str], None]] = None, data=None,
                     build: Optional[Callable[[Any, Any], Any]] = None, source: Optional[str] = None,
                     fit_progress: Optional[Callable[[int, int], None]] = None, **params: Any) -> Dict[str, Any]:
    """Initialize checkpoint ``path`` with ``spec`` (a spec, or a method name with ``params``) and
    write the result (see the module docstring for what is written where).

    ``layers``: ``None``/``"all"``, a spec like ``"0-3,5"`` or a list of indices. ``heads``/``grid``
    are needed only where the checkpoint does not tell. ``set_pe='sincos'`` writes the fixed sin-cos
    position embedding (times ``pe_scale``, default 1). ``force`` replaces an existing output.
    ``progress(done, total)`` follows the solve and the layers; ``log(message)`` gets a line as each
    stage starts. Returns a JSON-able report; with ``dry_run`` the plan only (nothing solved,
    nothing written).

    ``data``: a batch of real inputs, normalized as the model sees them, for the impulse data fit
    (``[B, C, H, W]`` images, ``[B, C, L]`` or ``[B, L]`` sequences). The fit runs them through the
    model the checkpoint describes, which ``build(checkpoint, state_dict)`` returns with the state
    dict loaded (see :func:`structinit.training.checkpoint_models.fit_checkpoint`, which passes
    it); the fitted Q/K (a cached fitted artifact, the same one ``initialize_model`` and ``train``
    use for the same weights, seed and batch) are then written into every copy of the model in the
    file. ``source`` says in words where ``data`` came from; ``fit_progress(done, total)`` follows
    the fit.
    """
    path = check_checkpoint_path(path)  # before the output's name, which is made from it
    spec = init_spec(spec, **params)
    if getattr(spec, "base", "model") != "model":
        raise UsageError(f"{spec.method} parameter {param('base')} {spec.base} resets every weight of a model; a "
                         "checkpoint's weights are kept (leave base at model)")
    if set_pe is not None and set_pe not in PE_KINDS:
        raise UsageError(f"{param('set_pe')} must be one of {', '.join(PE_KINDS)}, got {set_pe!r}")
    _check_pe_scale(pe_scale, set_pe)
    if data is not None:
        if dry_run:
            raise UsageError(f"{param('data')} fits Q/K on real inputs and {param('dry_run')} writes nothing; give "
                             "one of them")
        if not spec.uses_data:
            raise UsageError(f"{param('data')} is for the impulse data fit; the {spec.method} init does not use it"
                             + (" (data_fit is 0)" if spec.method == "impulse" else ""))
        if build is None:
            raise UsageError(f"{param('data')} runs real inputs through the model the checkpoint describes: give "
                             f"{param('build')} (or call structinit.training.checkpoint_models.fit_checkpoint)")
    target = _output_path(path, spec.method, out, in_place, force or dry_run)  # a dry run writes nothing
    say = log or (lambda message: None)

    try:
        stat = path.stat()  # before reading: an in-place replace checks that the file is still this one
    except OSError:
        stat = None
    ckpt = load_checkpoint(path)
    det = ckpt.detected
    heads = heads if heads is not None else det.heads  # the file's hints (HF config.json, timm arch)
    if grid is None and "shape" in ckpt.extra:  # a structinit train checkpoint tells its grid (a sequence's too),
        grid = det.grid  # which the views, detected afresh from the weights alone, would not know
    views = [AttentionTarget(sd, Grid(grid) if grid is not None else None, heads, layers,
                             need_grid=spec.needs_grid or set_pe is not None) for _, sd in ckpt.state_dicts]
    first = views[0]
    spec.check_target(first)
    if set_pe is not None and det.pos_key is None:
        raise UsageError(f"{param('set_pe')}: the {det.layout.name} checkpoint has no position embedding")
    if output_format(target) == "safetensors":
        safetensors_dict(ckpt, target)  # refuse now what cannot be written as safetensors

    pe_before = first.pos_embed_kind()
    plan = {
        "input": str(path), "output": str(target), "in_place": in_place, "backup": None,
        "format": ckpt.format, "output_format": output_format(target),
        "state_dicts": ckpt.where, **det.summary(), "heads": first.heads,
        "grid": list(first.grid) if first.grid else None, "method": spec.method, "params": spec.params(),
        "seed": seed, "set_pe": set_pe, "pe_scale": (1.0 if pe_scale is None else pe_scale) if set_pe else None,
        "pos_embed_kind": pe_before, "hints": ckpt.extra,
        "layers": [{"layer": slot.index, "replaced": spec.planned(slot)} for slot in first.slots],
    }
    if set_pe:
        plan["pos_embed_replaced"] = det.pos_key
    if spec.method == "impulse" and spec.artifact is None and first.grid is not None:
        spec.solve_config(first.grid, first.dim, first.heads, first.depth, seed)  # refuses impossible settings first
    if spec.method == "impulse" and set_pe is None:
        spec.check_embedding(first)  # a learned embedding needs set_pe or fit_pe: refuse before any work
    if dry_run:
        plan["dry_run"] = True
        return plan

    if set_pe:
        from structinit.init.pos_embed import write_sincos

        for view in views:
            write_sincos(view.sd[det.pos_key], view.grid, plan["pe_scale"], name=det.pos_key)
    extra: Dict[str, Any] = {}
    built = None
    if data is not None:  # the fit on the model the checkpoint describes: one fitted artifact for every copy
        say("building the model")
        built = build(ckpt, views[0].sd)
        model_view = AttentionTarget(built.model, first.grid, first.heads, layers)
        if (tuple(model_view.grid), model_view.dim, model_view.depth) != (tuple(first.grid), first.dim, first.depth):
            raise StructinitError(f"the model built for {path} ({built.how}) has grid {model_view.grid.describe()}, "
                                  f"dim {model_view.dim}, depth {model_view.depth}; the checkpoint has "
                                  f"{first.grid.describe()}, {first.dim}, {first.depth}")
        spec.check_target(model_view)
        spec.check_data_target(model_view)
        say("solving" if spec.artifact is None else "reading the artifact")
        plain, _ = spec.artifact_for(model_view, seed, cache_dir, device, progress)
        from structinit.init.fitted import load_or_fit

        say(f"fitting Q/K on {min(int(data.shape[0]), spec.data_fit_samples)} real inputs")
        extra["artifact"], extra["cached"] = load_or_fit(spec, model_view, plain, data[: spec.data_fit_samples],
                                                         seed, cache_dir, fit_progress, say, source)
        plan["model"] = built.how
    elif spec.method == "impulse":  # one solve for every copy of the model in the file
        say("solving" if spec.artifact is None else "reading the artifact")
        extra["artifact"], extra["cached"] = spec.artifact_for(first, seed, cache_dir, device, progress)
    reports = []
    for i, view in enumerate(views):
        say(f"writing {plan['state_dicts'][i]}" + (f" ({i + 1}/{len(views)})" if len(views) > 1 else ""))
        view.progress = progress
        if spec.method == "impulse" and i > 0:
            extra["check_pe"] = False  # a copy (an EMA) gets the weights solved for the first state dict
        reports.append(spec.apply(view, seed=seed, cache_dir=cache_dir, device=device, **extra))

    report = reports[0]
    from structinit.init.impulse import position_hint, structure_warning

    weak = None
    if spec.method == "impulse":
        hint = position_hint(plan["pe_scale"], checkpoint=True) if det.pos_key and not spec.fit_pe else None
        weak = structure_warning(report, hint)
    if weak:
        import warnings

        from structinit.errors import StructinitWarning

        warnings.warn(StructinitWarning(f"impulse: {weak}"), stacklevel=2)
    rows = {r["layer"]: r for r in report["layers"]}
    if spec.method != "impulse" and first.grid is not None:
        measured = describe_state_dict(ckpt.state_dicts[0][1], det, first.heads, first.grid)
        for row in measured["layers"]:
            if row["layer"] in rows:
                rows[row["layer"]].update({k: row[k] for k in ("hit_rate", "target_mass", "mse", "offsets")})
        plan["measured_on"] = measured["measured_on"]
    say(f"writing {target}")
    _write(ckpt, path, target, stat, in_place, force, plan)
    plan["layers"] = [rows[i] for i in first.layers]
    for key in ("artifact", "hit_rate", "target_mass", "measured_on", "mimetic_vproj", "data_fit"):
        if key in report:
            plan[key] = report[key]
    plan["pos_embed_kind"] = first.pos_embed_kind()
    plan["written"] = True
    return plan


def _write(ckpt, path: Path, target: Path, stat: os.stat_result, in_place: bool, force: bool, plan: dict) -> None:
    """Write the checkpoint: a new file created exclusively (or replacing one with ``force``), or,
    in place, a numbered backup of the input first and then the input replaced atomically."""
    from structinit.atomic import claim_backup

    if not in_place:
        save_checkpoint(ckpt, target, exclusive=not force, file_mode=stat.st_mode)
        return
    now = target.stat()
    if (now.st_ino, now.st_mtime_ns, now.st_size) != (stat.st_ino, stat.st_mtime_ns, stat.st_size):
        raise StructinitError(f"{path} changed while it was being initialized (another process?); it was not "
                              "replaced")
    try:
        backup = claim_backup(target)
    except OSError as exc:
        raise CheckpointError(f"cannot keep a backup of {path}: {exc.strerror or exc}; the input was not "
                              "replaced") from None
    plan["backup"] = str(backup)
    try:
        save_checkpoint(ckpt, target, file_mode=stat.st_mode)
    except CheckpointError:
        backup.unlink(missing_ok=True)  # the input is unchanged; the backup would only be a duplicate
        raise
