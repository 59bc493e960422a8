"""Writing a report folder: ``report.md`` (every grid's tables, the figures linked), ``cells.csv``,
``runs.csv``, ``report.json`` and the PNG figures, all or nothing: everything is rendered into a
temporary folder first and only then moved into place, and existing files are replaced only when
asked (``force``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional

from structinit.atomic import read_regular_text
from structinit.errors import StructinitError, UsageError, param
from structinit.experiments.report import GridReport, cells_csv, markdown, runs_csv


def render_report(reports: List[GridReport], figures: bool = True, attention: Optional[Dict[str, Any]] = None,
                  command: Optional[str] = None) -> Dict[str, Any]:
    """File name -> content (text, or a matplotlib figure for ``.png``). ``attention``: grid name
    -> ``(figure, entries)`` from :mod:`structinit.experiments.attention`."""
    from structinit.experiments.plots import report_figures

    files: Dict[str, Any] = {}
    parts = []
    if command:
        parts += [f"Report written by `{command}`.", ""]
    for rep in reports:
        figs: Dict[str, str] = {}
        if figures:
            for kind, fig in report_figures(rep).items():
                name = f"{rep.name}-{kind}.png"
                files[name] = fig
                figs[kind] = name
        table = ""
        if attention and rep.name in attention:
            from structinit.experiments.attention import fidelity_markdown, grid_fidelity_figure

            name = f"{rep.name}-attention.png"
            entries = attention[rep.name][1]
            files[name] = attention[rep.name][0]
            figs["attention after init"] = name
            if any(e.fidelity is not None for e in entries):
                files[f"{rep.name}-fidelity.png"] = grid_fidelity_figure(entries, title=rep.spec.title)
                figs["real-data fidelity per layer"] = f"{rep.name}-fidelity.png"
                table = fidelity_markdown(entries)
        parts.append(markdown(rep, figs))
        if table:
            parts.append(f"### Real-data attention at init, per layer\n\n{table}\n")
    files["report.md"] = "\n".join(parts)
    files["cells.csv"] = cells_csv(reports)
    files["runs.csv"] = runs_csv(reports)
    doc: Dict[str, Any] = {"grids": [r.to_dict(metrics=False) for r in reports]}
    if attention:
        doc["attention"] = {name: [{"row": e.row, "label": e.label, "note": e.note,
                                    "fidelity": e.fidelity.to_dict() if e.fidelity is not None else None}
                                   for e in entries] for name, (_, entries) in attention.items()}
    doc["files"] = sorted([*files, "report.json"])  # what a later --force replaces, stale figures included
    files["report.json"] = json.dumps(doc, indent=1, sort_keys=True, default=str) + "\n"
    return files


#: The figures a report may draw per grid (``GRID-KIND.png``).
FIGURE_KINDS = ("accuracy", "learning-curve", "curves", "attention", "fidelity")
TEXT_FILES = ("report.md", "cells.csv", "runs.csv", "report.json")


def earlier_report_files(folder: Path) -> List[str]:
    """The files an earlier report wrote into ``folder`` (from its ``report.json``: its list of
    files, or for a report written before it kept one, the figure names of the grids it holds);
    only those that are still there."""
    try:
        doc = json.loads(read_regular_text(folder / "report.json"))
    except (OSError, ValueError):
        return []
    if not isinstance(doc, dict):
        return []
    names = doc.get("files")
    if not isinstance(names, list):
        grids = [g.get("grid") for g in doc.get("grids") or [] if isinstance(g, dict)]
        names = [*TEXT_FILES] + [f"{g}-{kind}.png" for g in grids if isinstance(g, str) for kind in FIGURE_KINDS]
    return sorted(n for n in names if isinstance(n, str) and "/" not in n and n not in ("", ".", "..")
                  and (folder / n).is_file())


def stale_report_files(files: Dict[str, Any], folder: os.PathLike) -> List[str]:
    """The files of an earlier report in ``folder`` that writing ``files`` with ``force`` removes:
    those it wrote and the new report does not (e.g. a figure not drawn this time)."""
    folder = Path(folder).expanduser()
    return [n for n in earlier_report_files(folder) if n not in files] if folder.is_dir() else []


def write_report(files: Dict[str, Any], folder: os.PathLike, force: bool = False) -> List[Path]:
    """Write ``files`` (from :func:`render_report`) into ``folder`` (created if needed). Refuses,
    before writing anything, to replace an existing file unless ``force``; with ``force`` the
    earlier report is replaced whole: its files that the new one does not write (the figures of a
    grid no longer reported) are removed once the new files are in place, so no figure of another
    report is left beside them."""
    from structinit.analysis.figures import save_png
    from structinit.atomic import write_text

    folder = Path(folder).expanduser()
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"{param('report_dir')} {folder} exists and is not a folder")
    stale = stale_report_files(files, folder) if force else []
    clash = sorted(n for n in files if (folder / n).exists())
    if clash and not force:
        raise UsageError(f"{param('report_dir')} {folder} already holds {', '.join(clash)}; choose another folder or "
                         f"pass {param('force')} to replace them")
    created = not folder.exists()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".report-", dir=folder))
    except OSError as exc:
        raise StructinitError(f"cannot create {folder}: {exc.strerror or exc}") from None
    try:
        for name, content in files.items():
            if name.endswith(".png"):
                save_png(content, tmp / name)
            else:
                write_text(tmp / name, content)
        written = []
        for name in files:
            os.replace(tmp / name, folder / name)
            written.append(folder / name)
        for name in stale:
            (folder / name).unlink(missing_ok=True)
        return written
    except OSError as exc:
        raise StructinitError(f"cannot write the report into {folder}: {exc.strerror or exc}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if created and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()


__all__ = ["render_report", "stale_report_files", "write_report"]
