"""Whatever runs of a grid have finished, as the paper's tables: methods as rows, settings as
columns, the final-epoch test accuracy as mean ± std over seeds with the seed count, the
difference to the baseline row paired by seed (± its standard error), the paper's number beside
ours where it has one, unfinished cells marked, and the best epoch shown as such (chosen on the
validation split when the runs hold one out).

Example::

    from structinit.experiments.report import collect, markdown
    rep = collect(expansion)          # an Expansion: expanded from a grid file or read from a manifest
    print(markdown(rep))
    rep.to_dict()                     # the same as JSON (``structinit bench report --json``)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from structinit.errors import UsageError, param
from structinit.experiments.aggregate import (
    CellStats,
    GridReport,
    RunResult,
    collect,
    mean_std,
    read_runs_csv,
    rerun_differences,
    software_spread,
)
from structinit.experiments.expand import Cell, Expansion, load_manifests, pick_manifest
from structinit.experiments.tables import cells_csv, markdown, row_label, runs_csv, software_lines
from structinit.training.rundir import RunDir

# --------------------------------------------------------------------------- sources

def reports_for_folder(runs_dir: os.PathLike, grid: Optional[str] = None,
                       mixed_versions: bool = False) -> List[GridReport]:
    """Reports of every grid recorded in ``runs_dir`` (or of the one named ``grid``); a folder of
    runs made without a grid (e.g. by ``structinit train``) is reported as one table of its runs."""
    import warnings

    from structinit.errors import StructinitWarning

    folder = Path(runs_dir)
    if not folder.is_dir():
        raise UsageError(f"{param('target')} {folder} is not a folder of runs")
    unreadable: Dict[Path, str] = {}
    expansions = pick_manifest(load_manifests(folder, unreadable), grid, unreadable)
    if grid is None:
        for path, why in unreadable.items():
            warnings.warn(StructinitWarning(f"left out {path}, which is not a readable grid manifest ({why}); run the "
                                            "command that launched its grid again to write it anew"), stacklevel=2)
    if not expansions:
        ex = loose_runs(folder)
        return [collect(ex, mixed_versions=mixed_versions)]
    return name_reports([collect(ex, mixed_versions=mixed_versions) for ex in expansions])


def name_reports(reports: List[GridReport]) -> List[GridReport]:
    """Give every report a name of its own: a grid expanded twice into one folder (its file edited,
    other ``--set``) is two reports whose sections, figures and CSV lines must not share one name;
    each is then named by its manifest (``NAME-DIGEST``)."""
    counts: Dict[str, int] = {}
    for rep in reports:
        counts[rep.spec.name] = counts.get(rep.spec.name, 0) + 1
    for rep in reports:
        rep.name = rep.ex.manifest_path.stem if counts[rep.spec.name] > 1 else rep.spec.name
    return reports


def loose_runs(folder: Path) -> Expansion:
    """The runs in ``folder``'s sub-folders (each with a ``config.json``) as a one-column grid:
    one row per distinct setting (seeds pooled), labelled by the settings that differ."""
    from structinit.experiments.gridspec import Axis, AxisValue, GridSpec
    from structinit.training.config import EXECUTION_FIELDS

    found = []
    for sub in sorted(p for p in folder.iterdir() if p.is_dir()):
        cfg = RunDir(sub).peek_json(RunDir.CONFIG)
        if isinstance(cfg, dict) and isinstance(cfg.get("config"), dict):
            found.append((sub, cfg["config"]))
    if not found:
        raise UsageError(f"no runs in {folder}: no sub-folder holds a config.json (run structinit bench grid or "
                         "structinit train --out first)")

    def settings(c: Dict[str, Any]) -> Dict[str, Any]:
        return {k: v for k, v in c.items() if k not in EXECUTION_FIELDS and k not in ("seed",)}

    groups: Dict[str, List[Tuple[Path, Dict[str, Any]]]] = {}
    for sub, c in found:
        groups.setdefault(json.dumps(settings(c), sort_keys=True, default=str), []).append((sub, c))
    keys = list(groups)
    differing = sorted({k for g in keys for k, v in json.loads(g).items()
                        if any(json.loads(o).get(k) != v for o in keys)})
    values, cells = [], []
    for i, g in enumerate(keys):
        s = json.loads(g)
        label = ", ".join(f"{k}={_short(s.get(k))}" for k in differing) or (s.get("init") or "default")
        vid = f"r{i}"
        values.append(AxisValue(vid, label, {"val_size": s.get("val_size") or 0}))
        for sub, c in groups[g]:
            cells.append(Cell(vid, (), int(c.get("seed", 0)), sub.name))
    seeds = tuple(sorted({c.seed for c in cells}))
    spec = GridSpec(name=folder.name or "runs", title=f"Runs in {folder}", source=str(folder),
                    axes=(Axis("run", tuple(values)),), rows="run", columns=(), seeds=seeds)
    return Expansion(spec, folder, cells)


def _short(v: Any) -> str:
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}={_short(x)}" for k, x in v.items()) + "}"
    return str(v)


__all__ = ["collect", "markdown", "row_label", "cells_csv", "runs_csv", "GridReport", "CellStats", "RunResult",
           "reports_for_folder", "loose_runs", "mean_std", "software_spread", "software_lines", "rerun_differences",
           "read_runs_csv", "name_reports"]
