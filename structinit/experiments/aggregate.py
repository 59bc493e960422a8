"""Whatever runs of a grid have finished, gathered into cells (:func:`collect`): each run's result
read from its folder (:func:`read_run`) or an earlier runs.csv (:func:`read_runs_csv`), the cells'
mean ± std over seeds, the rows paired with the baseline they share a base with, and what differs
between the versions the runs ran under. :mod:`structinit.experiments.tables` writes them as the
paper's tables; :mod:`structinit.experiments.report` is the public face.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from structinit.atomic import read_regular_text
from structinit.errors import UsageError, param
from structinit.experiments.expand import Cell, Expansion
from structinit.experiments.status import run_status
from structinit.runtime import parse_versions, versions_text
from structinit.training.rundir import RunDir


@dataclass
class RunResult:
    """One cell's run as the report sees it. Accuracies in %; ``metrics``: the epoch records;
    ``algorithms``: the versions of the algorithms its init computed with, as the run recorded
    them (:func:`algorithms_text`; ``None`` for a run made before runs recorded them); ``device``:
    where it trained, as its final.json says (``cpu``, ``cuda:0``, ...); ``versions``: what it ran
    under, as its final.json says (:func:`structinit.runtime.software_versions`; ``None`` for a run
    made before runs recorded them); ``source``: the runs.csv the result was read from
    (:func:`read_runs_csv`), ``None`` for a run read from its folder."""

    key: str
    row: str
    column: Tuple[str, ...]
    seed: int
    state: str
    final_acc: Optional[float] = None
    best_acc: Optional[float] = None
    best_epoch: Optional[int] = None
    best_on: Optional[str] = None
    final_val_acc: Optional[float] = None
    epochs: Optional[int] = None
    epochs_expected: Optional[int] = None
    train_images: Optional[int] = None
    wall_seconds: Optional[float] = None
    metrics: List[Dict[str, Any]] = field(default_factory=list)
    problem: Optional[str] = None
    algorithms: Optional[str] = None
    device: Optional[str] = None
    source: Optional[str] = None
    versions: Optional[Dict[str, str]] = None

    def to_dict(self, metrics: bool = False) -> Dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "metrics"}
        d["column"] = list(self.column)
        if metrics:
            d["metrics"] = self.metrics
        return d


@dataclass
class CellStats:
    """Aggregates of one (row, column) cell over its seeds. ``delta_*``: paired by seed against
    the baseline row of the same column (``n_paired`` seeds finished in both)."""

    row: str
    column: Tuple[str, ...]
    n: int
    expected: int
    final: Dict[int, float]
    final_mean: Optional[float] = None
    final_std: Optional[float] = None
    best_mean: Optional[float] = None
    best_std: Optional[float] = None
    best_on: Optional[str] = None
    delta_mean: Optional[float] = None
    delta_se: Optional[float] = None
    n_paired: int = 0
    paper: Optional[float] = None
    paper_delta: Optional[float] = None
    val_mean: Optional[float] = None
    val_std: Optional[float] = None
    states: Dict[str, int] = field(default_factory=dict)  # how many of the cell's runs are in each state
    #: The base of the other weights the row's init carries (``None``: not an init of a ViT, or unknown),
    #: and the row its ``delta_*`` are paired with: the baseline's method on the same base.
    base: Optional[str] = None
    paired_with: Optional[str] = None

    def to_dict(self) -> Dict[str, Any]:
        d = dict(self.__dict__)
        d["column"] = list(self.column)
        d["final"] = {str(k): v for k, v in self.final.items()}
        return d


def mean_std(xs: List[float]) -> Tuple[Optional[float], Optional[float]]:
    """Mean and sample standard deviation (``None`` for no values; a std of ``None`` for one value,
    which has no spread to show)."""
    if not xs:
        return None, None
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, None
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


@dataclass
class GridReport:
    """The report of one expansion (see the module docstring)."""

    ex: Expansion
    runs: List[RunResult]
    cells: Dict[Tuple[str, Tuple[str, ...]], CellStats]
    #: How files, CSV lines and the JSON name this report: the grid's name, or, where one report
    #: holds several expansions of a grid (its file edited between launches), each expansion's
    #: manifest name (``NAME-DIGEST``; :func:`name_reports`).
    name: str = ""
    #: Runs finished here whose final accuracy differs from the one an earlier runs.csv gives for
    #: their key (:func:`rerun_differences`).
    reruns: List[Dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.name = self.name or self.ex.spec.name

    @property
    def spec(self):
        return self.ex.spec

    @property
    def columns(self) -> List[Tuple[str, ...]]:
        return [tuple(v.id for v in c) for c in self.spec.column_cells()]

    @property
    def rows(self) -> List[str]:
        return [v.id for v in self.spec.row_axis.values]

    def counts(self) -> Dict[str, int]:
        out: Dict[str, int] = {}
        seen = set()
        for r in self.runs:
            if r.key not in seen:
                seen.add(r.key)
                out[r.state] = out.get(r.state, 0) + 1
        return out

    def problems(self) -> List[str]:
        return [f"{self.ex.run_dir(r.key)}: {r.problem}" for r in self.runs if r.problem]

    def learning_curve_axis(self) -> Optional[str]:
        """The column axis whose values set ``train_size`` (a learning-curve grid), if any."""
        for axis in self.spec.column_axes:
            sizes = {str(v.settings.get("train_size")) for v in axis.values}
            if len(sizes) > 1:
                return axis.name
        return None

    def to_dict(self, metrics: bool = False) -> Dict[str, Any]:
        s = self.spec
        return {"grid": self.name, "grid_name": s.name, "title": s.title, "description": s.description,
                "command": self.ex.command,
                "runs_dir": str(self.ex.runs_dir), "seeds": list(s.seeds), "overrides": self.ex.overrides,
                "rows": [{"id": v.id, "label": v.label} for v in s.row_axis.values], "row_axis": s.rows,
                "column_axes": list(s.columns),
                "columns": [{"ids": list(c), "label": self.ex.column_label(c)} for c in self.columns],
                "baseline": s.baseline, "paper": {"source": s.paper_source, "note": s.paper_note},
                "metric": "final-epoch test accuracy (%)", "counts": self.counts(), "problems": self.problems(),
                "cells": [self.cells[(r, c)].to_dict() for r in self.rows for c in self.columns],
                "runs": [r.to_dict(metrics) for r in self.runs],
                "versions_differ": {k: dict(c) for k, c in software_spread(self.runs).items()},
                "reruns": self.reruns}


def read_run(ex: Expansion, cell: Cell) -> RunResult:
    """What the run of ``cell`` has: its state, and for a finished run its results, with a
    ``problem`` when its files disagree (a missing or repeated epoch, no final accuracy)."""
    path = ex.run_dir(cell)
    st = run_status(path)
    r = RunResult(cell.key, cell.row, tuple(cell.column), cell.seed, st.state)
    rd = RunDir(path)
    cfg = rd.peek_json(rd.CONFIG) or {}
    if isinstance(cfg.get("algorithms"), dict):
        r.algorithms = algorithms_text(cfg["algorithms"])
    resolved = cfg.get("resolved") or {}
    r.train_images = resolved.get("train_images")
    r.epochs_expected = (resolved.get("hparams") or {}).get("epochs")
    if st.state == "damaged":
        r.problem = (f"damaged, not counted: {st.detail}; a rerun of the grid moves the damaged files into a "
                     "damaged-<time>/ folder of the run and trains it again")
        return r
    if st.state != "finished":
        return r
    final = rd.peek_json(rd.FINAL)
    metrics = rd.read_metrics(strict=False)
    r.metrics = metrics
    if not isinstance(final, dict) or not isinstance(final.get("final_acc"), (int, float)):
        r.problem = "final.json has no final_acc"
        return r
    r.final_acc = float(final["final_acc"])
    r.final_val_acc = final.get("final_val_acc")
    best = final.get("best_epoch") or {}
    r.best_acc, r.best_epoch, r.best_on = best.get("test_acc"), best.get("epoch"), best.get("selected_on")
    r.epochs = final.get("epochs")
    r.wall_seconds = final.get("wall_seconds")
    r.device = final.get("device") if isinstance(final.get("device"), str) else None
    versions = final.get("versions")
    r.versions = {str(k): str(v) for k, v in versions.items()} if isinstance(versions, dict) else None
    epochs = [m.get("epoch") for m in metrics]
    want = list(range(1, (r.epochs_expected or r.epochs or 0) + 1))
    if epochs != want:
        r.problem = f"metrics.jsonl has epochs {_ranges(epochs)}, expected 1-{len(want)} once each"
    elif metrics and metrics[-1].get("test_acc") != r.final_acc:
        r.problem = "final_acc differs from the last epoch's test accuracy"
    return r


def algorithms_text(algorithms: Dict[str, Any]) -> str:
    """A run's recorded algorithm versions in one line: ``data fit 2, recipe fast 1`` (``none``
    for an init of its own, such as trunc normal)."""
    return ", ".join(f"{name} {algorithms[name]}" for name in sorted(algorithms)) or "none"


def check_versions(runs: List[RunResult], grid: str) -> None:
    """Refuse a table whose row pools finished runs made with different algorithm versions (a run
    made before runs recorded them counts as ``not recorded``): their mean would mix two methods."""
    by_row: Dict[str, Dict[str, List[int]]] = {}
    for r in runs:
        if r.final_acc is not None:
            by_row.setdefault(r.row, {}).setdefault(r.algorithms or "not recorded", []).append(r.seed)
    for row, found in by_row.items():
        if len(found) > 1:
            what = "; ".join(f"{v} (seeds {','.join(map(str, sorted(set(seeds))))})"
                             for v, seeds in sorted(found.items()))
            raise UsageError(f"grid {grid}, row {row}: its runs were made with different algorithm versions ({what}); "
                             f"pool them only on purpose, with {param('mixed_versions')}")


def _ranges(xs: List[Any]) -> str:
    return ",".join(str(x) for x in xs[:12]) + (",..." if len(xs) > 12 else "")


def read_runs_csv(path: os.PathLike) -> Dict[str, RunResult]:
    """The finished runs listed in an earlier report's ``runs.csv`` (:func:`runs_csv`), by run key:
    their accuracies without the per-epoch records (which the CSV does not keep). Raises
    :class:`UsageError` naming ``runs_csv`` for a file that is missing or not such a table."""
    path = Path(path)
    try:
        text = read_regular_text(path)
    except OSError as exc:
        raise UsageError(f"{param('runs_csv')} {path}: {exc.strerror or exc}") from None
    rows = list(csv.DictReader(text.splitlines()))
    need = {"key", "row_id", "seed", "state", "final_acc"}
    if not rows or not need <= set(rows[0]):
        raise UsageError(f"{param('runs_csv')} {path} is not the runs.csv of a report (it needs the columns "
                         f"{', '.join(sorted(need))})")

    def num(v, kind=float):
        return kind(float(v)) if v not in (None, "") else None

    out: Dict[str, RunResult] = {}
    for i, r in enumerate(rows, start=2):
        if r["state"] != "finished" or not r["final_acc"]:
            continue
        try:
            out[r["key"]] = RunResult(
                r["key"], r["row_id"], tuple(str(r.get("column_id", "")).split("/")), int(r["seed"]), "finished",
                final_acc=num(r["final_acc"]), best_acc=num(r.get("best_acc")),
                best_epoch=num(r.get("best_epoch"), int), best_on=r.get("best_on") or None,
                final_val_acc=num(r.get("final_val_acc")), epochs=num(r.get("epochs"), int),
                train_images=num(r.get("train_images"), int), wall_seconds=num(r.get("wall_seconds")),
                algorithms=r.get("algorithms") or None, device=r.get("device") or None, source=str(path),
                versions=parse_versions(r.get("versions") or "") or None)  # a runs.csv made before: none
        except ValueError:
            raise UsageError(f"{param('runs_csv')} {path}:{i}: not a number in {r}") from None
    return out


def collect(ex: Expansion, earlier: Optional[Dict[str, RunResult]] = None,
            mixed_versions: bool = False) -> GridReport:
    """Read every run of ``ex`` and aggregate the cells (unfinished runs are counted, not hidden).
    ``earlier``: results of runs whose folders are gone, by run key (:func:`read_runs_csv`); a run
    not finished in the folder is taken from there when its key is (the key is the run's whole
    configuration, so it is the same run). A row whose runs recorded different algorithm versions
    is refused (:func:`check_versions`) unless ``mixed_versions``."""
    runs = [read_run(ex, c) for c in ex.cells]
    reruns = rerun_differences(ex, runs, earlier or {})
    if earlier:
        for i, (cell, r) in enumerate(zip(ex.cells, runs)):
            old = earlier.get(cell.key)
            if r.state != "finished" and old is not None:
                runs[i] = dataclasses.replace(old, row=cell.row, column=tuple(cell.column), seed=cell.seed,
                                              epochs_expected=r.epochs_expected, metrics=[])
    spec = ex.spec
    if not mixed_versions:
        check_versions(runs, spec.name)
    by_cell: Dict[Tuple[str, Tuple[str, ...]], List[RunResult]] = {}
    for r in runs:
        by_cell.setdefault((r.row, r.column), []).append(r)
    columns = [tuple(v.id for v in c) for c in spec.column_cells()]
    cells: Dict[Tuple[str, Tuple[str, ...]], CellStats] = {}
    for row in [v.id for v in spec.row_axis.values]:
        for ci, col in enumerate(columns):
            done = [r for r in by_cell.get((row, col), []) if r.final_acc is not None]
            final = {r.seed: r.final_acc for r in done if r.final_acc is not None}  # every run of done
            c = CellStats(row, col, len(done), len(by_cell.get((row, col), [])), final)
            for r in by_cell.get((row, col), []):
                c.states[r.state] = c.states.get(r.state, 0) + 1
            c.final_mean, c.final_std = mean_std(list(final.values()))
            bests = [r.best_acc for r in done if r.best_acc is not None]
            c.best_mean, c.best_std = mean_std(bests)
            c.val_mean, c.val_std = mean_std([r.final_val_acc for r in done if r.final_val_acc is not None])
            ons = sorted({r.best_on for r in done if r.best_on})
            c.best_on = "/".join(ons) if ons else None
            paper = spec.paper.get(row)
            c.paper = paper[ci] if paper else None
            cells[(row, col)] = c
    inits = row_inits(ex)
    for (row, _), c in cells.items():
        c.base = inits[row][1]
    if spec.baseline is not None:
        partners = same_base_partners(inits, spec.baseline, [v.id for v in spec.row_axis.values])
        for (row, col), c in cells.items():
            partner = partners.get(row)
            if partner is None or partner == row:
                continue
            c.paired_with = partner
            base = cells[(partner, col)]
            pairs = [c.final[s] - base.final[s] for s in c.final if s in base.final]
            c.n_paired = len(pairs)
            m, sd = mean_std(pairs)
            c.delta_mean = m
            c.delta_se = sd / math.sqrt(len(pairs)) if sd is not None and len(pairs) > 1 else None
            if c.paper is not None and base.paper is not None:
                c.paper_delta = c.paper - base.paper
    return GridReport(ex, runs, cells, reruns=reruns)


def row_inits(ex: Expansion, runs: Optional[List[RunResult]] = None) -> Dict[str, Tuple[Optional[str], Optional[str]]]:
    """Every row's ``(init method, base of the other weights)``, from its runs' settings (the
    expansion's configs, else a run folder's ``config.json``); ``(None, None)`` for a row whose runs
    tell neither (a model without a structinit init, such as the ConvMixer, or only runs.csv lines)."""
    return {row: (v[0], v[1]) for row, v in row_specs(ex).items()}


def row_specs(ex: Expansion) -> Dict[str, Tuple[Optional[str], Optional[str], Optional[str]]]:
    """Every row's ``(method, base, variant)``: ``variant`` the init's canonical JSON without its base,
    with the row's other settings (a learning rate, say): rows of one variant on several bases are one
    init at several bases."""
    from structinit.training.config import TrainConfig

    out: Dict[str, Tuple[Optional[str], Optional[str], Optional[str]]] = {}
    for cell in ex.cells:
        if cell.row in out and out[cell.row] != (None, None, None):
            continue
        config = cell.config
        if config is None:
            doc = RunDir(ex.run_dir(cell)).peek_json(RunDir.CONFIG)
            try:
                config = TrainConfig.from_dict(doc["config"]) if isinstance(doc, dict) else None
            except (KeyError, TypeError, ValueError, UsageError):
                config = None
        init = getattr(config, "init", None)
        if init is None:
            out[cell.row] = (None, None, None)
            continue
        doc = init.to_dict()
        doc["params"].pop("base", None)
        value = next((v for v in ex.spec.row_axis.values if v.id == cell.row), None)
        others = {k: v for k, v in (value.settings if value is not None else {}).items()
                  if k not in ("init", "init_params")}
        out[cell.row] = (init.method, init.other_weights, json.dumps([doc, others], sort_keys=True, default=str))
    return out


def same_base_partners(inits: Dict[str, Tuple[Optional[str], Optional[str]]], baseline: str,
                       rows: List[str]) -> Dict[str, Optional[str]]:
    """For every row, the row its difference is paired with: the baseline row's method on the row's
    own base of the other weights (the baseline itself where the bases agree or a row's base is
    unknown), or ``None`` where the grid has no such row (an init is never compared across bases)."""
    method, base = inits.get(baseline, (None, None))
    out: Dict[str, Optional[str]] = {}
    for row in rows:
        m, b = inits.get(row, (None, None))
        if m is None or b is None or base is None or b == base:
            out[row] = baseline
        else:
            out[row] = next((r for r in rows if inits.get(r) == (method, b)), None)
    return out


def _same_form(versions: Dict[str, str]) -> Dict[str, str]:
    """``versions`` as runs.csv holds them (no spaces), so that a run's folder and a runs.csv line compare."""
    return parse_versions(versions_text(versions))


def software_spread(runs: List[RunResult]) -> Dict[str, Counter]:
    """What differs between the finished runs that recorded what they ran under: each field
    (``torch``, ``numpy``, ``platform``, ...) with more than one value, and how many runs had each
    (a field a run did not record counts as ``not recorded``)."""
    recorded = [_same_form(r.versions) for r in runs if r.final_acc is not None and r.versions]
    seen: Dict[str, Counter] = {}
    for v in recorded:
        for k, x in v.items():
            seen.setdefault(k, Counter())[x] += 1
    for c in seen.values():
        if sum(c.values()) < len(recorded):
            c["not recorded"] += len(recorded) - sum(c.values())
    return {k: c for k, c in seen.items() if len(c) > 1}


def rerun_differences(ex: Expansion, runs: List[RunResult], earlier: Dict[str, RunResult]) -> List[Dict[str, Any]]:
    """The runs finished in ``ex``'s folder that an earlier runs.csv (``earlier``, by run key) also
    holds with another final accuracy (to the 4 decimals runs.csv keeps): the key, the cell, both
    numbers, the runs.csv, and ``why`` in words: the versions that differ between the two, or that
    one of them recorded none, or that they recorded the same."""
    out = []
    for r in runs:
        old = earlier.get(r.key)
        if r.final_acc is None or old is None or old.final_acc is None or round(r.final_acc, 4) == old.final_acc:
            continue
        if not r.versions or not old.versions:
            why = ("the runs.csv" if not old.versions else "this run") + " recorded no versions, so what changed is " \
                "not known"
        else:
            here, there = _same_form(r.versions), _same_form(old.versions)
            differ = [f"{k} {here.get(k, 'none')} here, {there.get(k, 'none')} there"
                      for k in dict.fromkeys([*here, *there]) if here.get(k) != there.get(k)]
            why = ("versions differ: " + "; ".join(differ)) if differ else \
                "both ran under the same recorded versions (threads or hardware may differ)"
        out.append({"key": r.key, "cell": f"{ex.row_label(r.row)} / {ex.column_label(r.column)}, seed {r.seed}",
                    "final_acc": r.final_acc, "earlier_acc": old.final_acc, "source": old.source, "why": why})
    return out

