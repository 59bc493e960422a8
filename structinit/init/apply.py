"""``apply_checkpoint()``: initialize the attention of a saved checkpoint and write a new file.

Example::

    from structinit import apply_checkpoint
    report = apply_checkpoint("vit.pth", "impulse", filter=3, layers="0-5")
    report["output"]        # vit.impulse.pth, beside the input
    report["layers"][0]     # {"layer": 0, "replaced": [...], "hit_rate": 1.0, "target_mass": 0.3, ...}

Only the Q/K rows (and Q/K biases) of the selected layers change, plus V/proj where the spec says
so (``mimetic``, or ``impulse`` with ``mimetic_vproj``) and the position embedding with
``set_pe='sincos'``; every other tensor and entry is written back as loaded. Every copy of the
model in the file (e.g. ``state_dict`` and ``state_dict_ema``) gets the same weights. The input
is never modified unless ``in_place`` is asked for, and then a ``.bak`` copy is kept and the file
is replaced atomically.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Union

from structinit.errors import UsageError, param
from structinit.geometry.grid import Grid
from structinit.init.base import InitSpec
from structinit.init.checkpoints import describe_state_dict, load_checkpoint, save_checkpoint
from structinit.init.specs import init_spec
from structinit.init.target import AttentionTarget

PE_KINDS = ("sincos",)


def default_output(path: Path, method: str) -> Path:
    """``name.METHOD.ext`` beside the input (``vit.pth`` -> ``vit.impulse.pth``)."""
    return path.with_name(f"{path.stem}.{method}{path.suffix}")


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (b.exists() and os.path.samefile(a, b))
    except OSError:
        return False


def _output_path(path: Path, method: str, out: Optional[os.PathLike], in_place: bool) -> Path:
    if in_place and out is not None:
        raise UsageError(f"give either {param('out')} or {param('in_place')}, not both")
    if in_place:
        return path
    target = Path(out) if out is not None else default_output(path, method)
    if _same_file(path, target):
        raise UsageError(f"{param('out')} {target} is the input file; use {param('in_place')} to replace it "
                         "(a .bak is kept)")
    if not target.parent.is_dir():
        raise UsageError(f"{param('out')} {target}: folder {target.parent} does not exist")
    return target


def apply_checkpoint(path: Union[str, os.PathLike], spec: Union[str, InitSpec] = "impulse", *,
                     out: Optional[os.PathLike] = None, in_place: bool = False, dry_run: bool = False,
                     layers: Union[None, str, Sequence[int]] = None, heads: Optional[int] = None, grid=None,
                     set_pe: Optional[str] = None, pe_scale: float = 1.0, seed: int = 0, cache_dir=None,
                     device: str = "cpu", **params: Any) -> Dict[str, Any]:
    """Initialize checkpoint ``path`` with ``spec`` (a spec, or a method name with ``params``) and
    write the result.

    ``layers``: ``None``/``"all"``, a spec like ``"0-3,5"`` or a list of indices. ``heads``/``grid``
    are needed only where the checkpoint does not tell. ``set_pe='sincos'`` writes the fixed sin-cos
    position embedding (times ``pe_scale``). Returns a JSON-able report; with ``dry_run`` the plan
    only (nothing solved, nothing written).
    """
    path = Path(path)
    spec = init_spec(spec, **params)
    if set_pe is not None and set_pe not in PE_KINDS:
        raise UsageError(f"{param('set_pe')} must be one of {', '.join(PE_KINDS)}, got {set_pe!r}")
    target = _output_path(path, spec.method, out, in_place)

    ckpt = load_checkpoint(path)
    det = ckpt.detected
    heads = heads if heads is not None else det.heads  # the file's hints (HF config.json, timm arch)
    if grid is None and "shape" in ckpt.extra:  # a structinit train checkpoint tells its grid (a sequence's too)
        grid = det.grid
    views = [AttentionTarget(sd, Grid(grid) if grid is not None else None, heads, layers,
                             need_grid=spec.needs_grid or set_pe is not None) for _, sd in ckpt.state_dicts]
    first = views[0]
    spec.check_target(first)
    if set_pe is not None and det.pos_key is None:
        raise UsageError(f"{param('set_pe')}: the {det.layout.name} checkpoint has no position embedding")
    if not in_place and out is None and target.exists() and not dry_run:
        raise UsageError(f"{target} already exists; choose another path with {param('out')}")

    plan = {
        "input": str(path), "output": str(target), "in_place": in_place,
        "backup": str(path) + ".bak" if in_place else None, "format": ckpt.format,
        "state_dicts": ckpt.where, **det.summary(), "heads": first.heads,
        "grid": list(first.grid) if first.grid else None, "method": spec.method, "params": spec.params(),
        "seed": seed, "set_pe": set_pe, "pe_scale": pe_scale if set_pe else None, "hints": ckpt.extra,
        "layers": [{"layer": slot.index, "replaced": spec.planned(slot)} for slot in first.slots],
    }
    if set_pe:
        plan["pos_embed_replaced"] = det.pos_key
    if dry_run:
        plan["dry_run"] = True
        return plan

    extra = {}
    if spec.method == "impulse":  # one solve for every copy of the model in the file
        extra["artifact"], extra["cached"] = spec.artifact_for(first, seed, cache_dir, device)
    reports = []
    for view in views:
        if set_pe:
            from structinit.init.pos_embed import write_sincos

            write_sincos(view.sd[det.pos_key], view.grid, pe_scale, name=det.pos_key)
        reports.append(spec.apply(view, seed=seed, cache_dir=cache_dir, device=device, **extra))

    report = reports[0]
    rows = {r["layer"]: r for r in report["layers"]}
    if spec.method != "impulse" and first.grid is not None:
        measured = describe_state_dict(ckpt.state_dicts[0][1], det, first.heads, first.grid)
        for row in measured["layers"]:
            if row["layer"] in rows:
                rows[row["layer"]].update({k: row[k] for k in ("hit_rate", "target_mass", "mse", "offsets")})

    if in_place:
        shutil.copy2(path, plan["backup"])
    save_checkpoint(ckpt, target)
    plan["layers"] = [rows[i] for i in first.layers]
    for key in ("artifact", "hit_rate", "target_mass"):
        if key in report:
            plan[key] = report[key]
    plan["written"] = True
    return plan
