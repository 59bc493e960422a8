"""``apply_checkpoint()``: initialize the attention of a saved checkpoint and write a new file.

Example::

    from structinit.apply import apply_checkpoint
    report = apply_checkpoint("vit.pth", method="impulse", filter=3, layers="0-5")
    report["output"]        # vit.impulse.pth, beside the input
    report["layers"][0]     # {"layer": 0, "replaced": [...], "hit_rate": 1.0, "target_mass": 0.3, ...}

Only the Q/K rows (and Q/K biases) of the selected layers change, plus V/proj for ``mimetic``
(or ``impulse`` with ``mimetic_vproj=True``) and the position embedding with ``set_pe='sincos'``;
every other tensor and entry is written back as loaded. The input is never modified unless
``in_place`` is asked for, and then a ``.bak`` copy is kept and the file is replaced atomically.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

from .checkpoints import describe_state_dict, load_checkpoint, save_checkpoint
from .errors import UsageError
from .inject import label
from .init_methods import get_method, initialize, parse_layers, select_layers, set_pos_embed_state_dict
from .layouts import AttnSlot, resolve_shape

PE_KINDS = ("sincos",)


def default_output(path: Path, method: str) -> Path:
    """``name.METHOD.ext`` beside the input (``vit.pth`` -> ``vit.impulse.pth``)."""
    return path.with_name(f"{path.stem}.{method}{path.suffix}")


def planned_keys(slot: AttnSlot, method: str, params: Dict[str, Any]) -> List[str]:
    """What ``method`` replaces in one layer (tensor keys with row ranges)."""
    keys = [label(p) for p in (slot.q, slot.k, slot.q_bias, slot.k_bias) if p is not None]
    vproj = (method == "mimetic" and params.get("vproj", True)) or (method == "impulse" and params.get("mimetic_vproj"))
    if vproj:
        keys += [label(slot.v), str(slot.proj)]
    return keys


IMPULSE_SOLVE_PARAMS = ("filter", "recipe", "target_mass", "recipe_params", "share", "offset_order", "padding",
                        "pseudo_input", "pseudo_input_rest")


def _solve_for(grid, dim, heads, depth, seed, params):
    """Solve (or fetch from the cache) the impulse artifact for this shape; pops the solve settings
    from ``params``. Returns ``(artifact, cached)``."""
    from .init_methods import impulse_config
    from .solve import solve

    settings = {k: params.pop(k) for k in IMPULSE_SOLVE_PARAMS if k in params}
    config = impulse_config(grid, dim, heads, depth, seed=seed, **settings)
    result = solve(config, cache_dir=params.pop("cache_dir", None), device=params.pop("device", "cpu"))
    return result.artifact, result.cached


def resolve_artifact(spec, cache_dir=None):
    """An :class:`~structinit.artifact.Artifact` from an Artifact, a file path, or a key in the cache."""
    from .artifact import Artifact, read_artifact
    from .cache import resolve_key

    if isinstance(spec, Artifact):
        return spec
    p = Path(spec)
    if p.exists():
        return read_artifact(p)
    found = resolve_key(str(spec), cache_dir)
    if found is None:
        raise UsageError(f"--artifact {spec}: no such file, and no cached artifact has that key")
    return read_artifact(found)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (b.exists() and os.path.samefile(a, b))
    except OSError:
        return False


def apply_checkpoint(path: Union[str, os.PathLike], *, method: str = "impulse", out: Optional[os.PathLike] = None,
                     in_place: bool = False, dry_run: bool = False,
                     layers: Union[None, str, Sequence[int]] = None, heads: Optional[int] = None, grid=None,
                     set_pe: Optional[str] = None, pe_scale: float = 1.0, seed: int = 0, **params) -> Dict[str, Any]:
    """Initialize ``method``'s weights in checkpoint ``path`` and write the result.

    ``layers``: ``None``/``"all"``, a spec like ``"0-3,5"`` or a list of indices. ``heads``/``grid``
    are needed only where the checkpoint does not tell. ``set_pe='sincos'`` writes the fixed 2-D
    sin-cos position embedding (times ``pe_scale``). ``params`` go to the init method (see
    :mod:`structinit.init_methods`). Returns a JSON-able report; with ``dry_run`` the plan only
    (nothing solved, nothing written).
    """
    path = Path(path)
    get_method(method)
    if set_pe is not None and set_pe not in PE_KINDS:
        raise UsageError(f"--set-pe must be one of {', '.join(PE_KINDS)}, got {set_pe!r}")
    if in_place and out is not None:
        raise UsageError("give either --out or --in-place, not both")
    if in_place:
        target = path
    else:
        target = Path(out) if out is not None else default_output(path, method)
        if _same_file(path, target):
            raise UsageError(f"--out {target} is the input file; use --in-place to replace it (a .bak is kept)")
        if not target.parent.is_dir():
            raise UsageError(f"--out {target}: folder {target.parent} does not exist")

    ckpt = load_checkpoint(path)
    det = ckpt.detected
    layer_list = parse_layers(layers, det.depth) if isinstance(layers, str) or layers is None \
        else select_layers(layers, det.depth)
    needs_grid = method == "impulse" or set_pe is not None
    grid, heads = resolve_shape(det, heads, grid, need_grid=needs_grid)
    if set_pe is not None and det.pos_key is None:
        raise UsageError(f"--set-pe: the {det.layout.name} checkpoint has no position embedding")

    if not in_place and out is None and target.exists() and not dry_run:
        raise UsageError(f"{target} already exists; choose another path with --out")

    plan = {
        "input": str(path), "output": str(target), "in_place": in_place,
        "backup": str(path) + ".bak" if in_place else None, "format": ckpt.format,
        "state_dicts": ckpt.where, **det.summary(), "heads": heads, "grid": list(grid) if grid else None,
        "method": method, "params": {k: (v if isinstance(v, (int, float, str, bool, dict, list, type(None))) else str(v))
                   for k, v in params.items()},
        "seed": seed, "set_pe": set_pe, "pe_scale": pe_scale if set_pe else None, "hints": ckpt.extra,
        "layers": [{"layer": i, "replaced": planned_keys(det.slots[i], method, params)} for i in layer_list],
    }
    if set_pe:
        plan["pos_embed_replaced"] = det.pos_key
    if dry_run:
        plan["dry_run"] = True
        return plan

    cached = None
    if method == "impulse":
        params = dict(params)
        if params.get("artifact") is None:
            params["artifact"], cached = _solve_for(grid, det.dim, heads, det.depth, seed, params)
        else:
            params["artifact"] = resolve_artifact(params["artifact"], params.get("cache_dir"))
    reports = []
    for where, sd in ckpt.state_dicts:  # every copy (e.g. state_dict and state_dict_ema) gets the same weights
        if set_pe:
            set_pos_embed_state_dict(sd, det.pos_key, grid, pe_scale)
        reports.append(initialize(sd, method, grid=grid, heads=heads, layers=layer_list, seed=seed, **params))
    if cached is not None:
        reports[0]["artifact"]["cached"] = cached

    first = reports[0]
    rows = {r["layer"]: r for r in first["layers"]}
    if method != "impulse" and grid is not None:
        measured = describe_state_dict(ckpt.state_dicts[0][1], det, heads, grid)
        for row in measured["layers"]:
            if row["layer"] in rows:
                rows[row["layer"]].update({k: row[k] for k in ("hit_rate", "target_mass", "mse", "offsets")})

    if in_place:
        shutil.copy2(path, plan["backup"])
    save_checkpoint(ckpt, target)
    plan["layers"] = [rows[i] for i in layer_list]
    for key in ("artifact", "hit_rate", "target_mass"):
        if key in first:
            plan[key] = first[key]
    plan["written"] = True
    return plan
