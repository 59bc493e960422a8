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

import csv
import dataclasses
import io
import json
import math
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from structinit.errors import UsageError, param
from structinit.experiments.expand import Cell, Expansion, load_manifests, pick_manifest
from structinit.experiments.status import STATES, run_status
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
        text = path.read_text()
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
    return {row: (v[0], v[1]) for row, v in _row_specs(ex).items()}


def _row_specs(ex: Expansion) -> Dict[str, Tuple[Optional[str], Optional[str], Optional[str]]]:
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


# --------------------------------------------------------------------------- text

def _num(x: Optional[float], sign: bool = False) -> str:
    if x is None:
        return "—"
    return f"{x:+.2f}" if sign else f"{x:.2f}"


def _unfinished(c: CellStats) -> str:
    """What a cell without a finished run is waiting for: ``failed`` (every run failed or is
    damaged: a rerun is needed), ``running`` or ``pending``."""
    states = {k for k, n in c.states.items() if n}
    if states and states <= {"failed", "damaged"}:
        return "failed" if "failed" in states else "damaged"
    return "running" if "running" in states else "pending"


def _spread(mean: Optional[float], std: Optional[float], n: int, expected: Optional[int] = None) -> str:
    """``mean ± std``; one value has no spread: ``mean (1/n)``."""
    if mean is None:
        return "—"
    if std is None:
        return f"{mean:.2f} (1/{expected or n})"
    return f"{mean:.2f} ± {std:.2f}"


def _cell_text(c: CellStats, show_paper: bool) -> str:
    if c.n == 0:
        text = f"{_unfinished(c)} (0/{c.expected})"
    else:
        text = _spread(c.final_mean, c.final_std, c.n, c.expected)
        if c.n < c.expected and c.n > 1:
            text += f" ({c.n}/{c.expected})"
    if show_paper and c.paper is not None:
        text += f" [{c.paper:.2f}]"
    return text


def _held_out(rep: "GridReport") -> Optional[bool]:
    """Whether the grid's runs hold a validation split out (``val_size`` above 0), from the runs'
    own settings or the grid's; ``None`` when some do and some do not."""
    sizes = set()
    for cell in rep.ex.cells:
        if cell.config is not None:
            sizes.add(bool(cell.config.val_size))
            continue
        value = rep.ex.overrides.get("val_size", rep.spec.settings.get("val_size", 0))
        if "val_size" not in rep.ex.overrides:
            chosen = dict(zip([rep.spec.rows, *rep.spec.columns], [cell.row, *cell.column]))
            for axis in rep.spec.axes:
                vid = chosen.get(axis.name)
                for v in axis.values:
                    if v.id == vid and "val_size" in v.settings:
                        value = v.settings["val_size"]
        sizes.add(bool(value))
    return sizes.pop() if len(sizes) == 1 else None


def device_kind(device: Optional[str]) -> str:
    """``cuda:1`` -> ``cuda``; ``None`` (a run that did not record it) -> ``unrecorded``."""
    return device.split(":")[0] if device else "unrecorded"


def device_lines(rep: GridReport) -> List[str]:
    """Markdown lines saying where the finished runs trained, and naming the cells whose seeds
    trained on different kinds of device (the run key leaves the device out: it is the same
    experiment, but the accuracies differ in the last digits and the wall times are not comparable);
    none when no run recorded its device."""
    kind = {(r.row, r.column, r.seed): device_kind(r.device) for r in rep.runs if r.state == "finished"}
    kinds = Counter(kind.values())
    if set(kinds) <= {"unrecorded"}:
        return []
    counts = ", ".join(f"{k} ({n} run{'' if n == 1 else 's'})" for k, n in sorted(kinds.items()))
    by_cell: Dict[Tuple[str, Tuple[str, ...]], set] = {}
    for (row, col, _), k in kind.items():
        by_cell.setdefault((row, col), set()).add(k)
    mixed = [f"{rep.ex.row_label(row)} / {rep.ex.column_label(col)}" for (row, col), k in by_cell.items() if len(k) > 1]
    text = f"Trained on: {counts}."
    if mixed:
        text += (f" Seeds trained on different devices are pooled in {len(mixed)} of the cells "
                 f"({'; '.join(mixed[:4])}{'; ...' if len(mixed) > 4 else ''}): the same settings, but their "
                 "accuracies are not from one kind of machine and their wall times are not comparable.")
    return [text, ""]


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


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def software_lines(rep: GridReport) -> List[str]:
    """Markdown lines flagging a table whose finished runs ran under different versions (naming
    each field that differs and its values), runs that recorded none beside runs that did, and
    reruns whose final accuracy differs from an earlier runs.csv's (naming the versions that
    differ between the two); none when nothing differs."""
    lines = []
    spread = software_spread(rep.runs)
    if spread:
        what = "; ".join(f"{k} " + ", ".join(f"{v} ({_plural(n, 'run')})" for v, n in sorted(c.items()))
                         for k, c in spread.items())
        lines += [f"Ran under different versions: {what}. The run key leaves these out (the same settings), but "
                  "numerical kernels change between versions, so the same run can end a fraction of a point to a "
                  "point apart (docs/reproducing.md).", ""]
    finished = [r for r in rep.runs if r.final_acc is not None]
    unrecorded = sum(1 for r in finished if not r.versions)
    if unrecorded and unrecorded < len(finished):
        lines += [f"{_plural(unrecorded, 'finished run')} of {len(finished)} recorded no versions (made before runs "
                  "recorded them): whether they ran under the versions of the others is not known.", ""]
    for d in rep.reruns:
        lines += [f"Rerun {d['key']} ({d['cell']}): final {d['final_acc']:.4f} here, {d['earlier_acc']:.4f} in "
                  f"`{d['source']}`; {d['why']}.", ""]
    return lines


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


def _table(header: List[str], rows: List[List[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def markdown(rep: GridReport, figures: Optional[Dict[str, str]] = None, heading: int = 2) -> str:
    """The report of one grid as markdown (``figures``: name -> file name, linked below the tables)."""
    s = rep.spec
    h = "#" * heading
    has_paper = any(c.paper is not None for c in rep.cells.values())
    lines = _intro_lines(rep, h)
    lines += _final_lines(rep, h, has_paper)
    if s.baseline is not None:
        lines += _delta_lines(rep, h, has_paper)
    if any(c.val_mean is not None for c in rep.cells.values()):
        lines += [f"{h}# Final-epoch validation accuracy (%)", "",
                  "On the images held out of training (the same for every seed): the split to make choices on; "
                  "mean ± std.", ""]
        lines += [_grid_table(rep, _spread_rows(rep, lambda c: (c.val_mean, c.val_std))), ""]
    lines += _best_lines(rep, h)
    if s.paper_note:
        lines += [f"Paper: {s.paper_note}.", ""]
    problems = rep.problems()
    if problems:
        lines += [f"{h}# Problems", ""] + [f"- {p}" for p in problems] + [""]
    if figures:
        lines += [f"{h}# Figures", ""] + [f"![{name}]({fname})" for name, fname in figures.items()] + [""]
    return "\n".join(lines)


def _grid_table(rep: GridReport, body: List[List[str]]) -> str:
    """A table of the grid: a header of the row axis and the column labels above ``body`` (one list
    per row: its label, then one text per column)."""
    return _table([rep.spec.rows.replace("_", " ")] + [rep.ex.column_label(c) for c in rep.columns], body)


def _spread_rows(rep: GridReport,
                 stat: Callable[[CellStats], Tuple[Optional[float], Optional[float]]]) -> List[List[str]]:
    """Every row's label and, per column, ``mean ± std`` of ``stat(cell)`` (a (mean, std) pair)."""
    return [[row_label(rep, r)] + [_spread(*stat(c), c.n, c.expected)
                                     for c in (rep.cells[(r, col)] for col in rep.columns)] for r in rep.rows]


def _intro_lines(rep: GridReport, h: str) -> List[str]:
    """The title and what the tables are of: the grid, its command, the runs taken from an earlier
    report's runs.csv, the seeds and states, the settings changed, the devices trained on."""
    s, ex = rep.spec, rep.ex
    counts = rep.counts()
    total = sum(counts.values())
    lines = [f"{h} {s.title}" + (f" ({rep.name})" if rep.name != s.name else ""), ""]
    if rep.name != s.name:
        lines += [f"One of several expansions of grid {s.name} in `{ex.runs_dir}` (its file or options changed between "
                  f"launches): this one is recorded as `{rep.name}`, and its files and CSV lines carry that name.", ""]
    if s.description:
        lines += [s.description, ""]
    if ex.command:
        lines += ["Command:", "", "```bash", ex.command, "```", ""]
    sources = sorted({r.source for r in rep.runs if r.source})
    if sources:
        taken = sum(1 for r in rep.runs if r.source)
        named = ", ".join(f"`{p}`" for p in sources)
        lines += [f"{taken} of the finished runs are read from {named} (the runs.csv of an earlier report): their "
                  f"folders are not in `{ex.runs_dir}`, so they have no per-epoch curve. To make this report again, "
                  f"give `structinit bench report` the grid and `--out` with "
                  + " ".join(f"`--runs-csv {p}`" for p in sources) + ".", ""]
    state_text = ", ".join(f"{counts[k]} {k}" for k in STATES if counts.get(k))
    lines += [f"Seeds {', '.join(map(str, s.seeds))} ({len(s.seeds)} per cell); {_plural(total, 'run')}: {state_text}. "
              f"Runs in `{ex.runs_dir}`." + (f" Settings changed for the whole grid: "
                                             f"{', '.join(f'{k}={v}' for k, v in ex.overrides.items())}."
                                             if ex.overrides else ""), ""]
    return lines + device_lines(rep) + software_lines(rep)


def _final_lines(rep: GridReport, h: str, has_paper: bool) -> List[str]:
    """The headline table: final-epoch test accuracy, ``[x]`` the paper's number where it has one."""
    lines = [f"{h}# Final-epoch test accuracy (%)", "",
             "Mean ± standard deviation over the seeds that finished; (k/n): k of n seeds finished (one seed "
             "alone has no ±); pending, running or failed (0/n): none finished yet, and what its runs are doing."
             + (f" [x]: the paper's number ({rep.spec.paper_source})." if has_paper else ""), ""]
    body = [[row_label(rep, r)] + [_cell_text(rep.cells[(r, c)], has_paper) for c in rep.columns]
            for r in rep.rows]
    return lines + [_grid_table(rep, body), ""]


#: What each base of the other weights is, in words (the reports' notes).
BASE_WORDS = {"model": "as the model builds it (timm's: Linear weights trunc normal 0.02)",
              "pytorch": "PyTorch's defaults (Kaiming uniform)", "pytorch-mlp": "the MLPs at PyTorch's defaults",
              "pytorch-head": "the classifier at PyTorch's default"}


def _bases(rep: GridReport) -> List[str]:
    return sorted({b for b in (rep.cells[(r, rep.columns[0])].base for r in rep.rows if rep.columns) if b is not None})


def row_label(rep: GridReport, row: str) -> str:
    """The row's label, with the base of the other weights in brackets where the grid's rows carry
    several (tables and figures alike)."""
    base = rep.cells[(row, rep.columns[0])].base if rep.columns else None
    label = rep.ex.row_label(row)
    return f"{label} [{base}]" if base is not None and len(_bases(rep)) > 1 else label


def _delta_lines(rep: GridReport, h: str, has_paper: bool) -> List[str]:
    """The difference of every row to the baseline's method on the same base of the other weights,
    paired by seed (the grid has a baseline)."""
    s, ex = rep.spec, rep.ex
    base = ex.row_label(s.baseline)
    bases = _bases(rep)
    several = len(bases) > 1
    text = (f"Paired by seed: the mean over seeds of (method − {base}) with its standard error; (k): seeds "
            "finished in both." + (" [x]: the paper's difference." if has_paper else ""))
    if several:
        text += (f" Each row is paired with the row of the same init as {base} on the same base of the other weights, "
                 "in brackets (" + "; ".join(f"{b}: {BASE_WORDS.get(b, b)}" for b in bases) + "); —: the grid has no "
                 "such row there (inits are not compared across bases), or no seed finished in both.")
    lines = [f"{h}# Difference to {base}" + (" on the same base" if several else "") + " (percentage points)", "",
             text, ""]
    body = []
    for r in rep.rows:
        first = rep.cells[(r, rep.columns[0])] if rep.columns else None
        if r == s.baseline or (first is not None and first.paired_with is None and first.base is not None
                               and several and _is_baseline_method(rep, r)):
            continue
        label = row_label(rep, r)
        if first is not None and first.paired_with not in (None, s.baseline):
            label += f" vs {ex.row_label(first.paired_with)}"
        row = [label]
        for c in rep.columns:
            st = rep.cells[(r, c)]
            if st.delta_mean is None:
                text = "—"
            else:
                text = _num(st.delta_mean, True) + (f" ± {st.delta_se:.2f}" if st.delta_se is not None else "")
                text += f" ({st.n_paired})"
            if has_paper and st.paper_delta is not None:
                text += f" [{st.paper_delta:+.2f}]"
            row.append(text)
        body.append(row)
    return lines + [_grid_table(rep, body), ""] + _own_base_lines(rep, h)


def _is_baseline_method(rep: GridReport, row: str) -> bool:
    """Whether ``row`` is the baseline's method on another base (the baseline of that base)."""
    specs = _row_specs(rep.ex)
    return specs.get(row, (None,))[0] == specs.get(rep.spec.baseline, (None,))[0]


def _own_base_lines(rep: GridReport, h: str) -> List[str]:
    """Each init at its own best base: for every init the grid has on several bases, per column the
    base with the best mean validation accuracy and that row's final test accuracy (none without a
    validation split, or when no init has several bases)."""
    specs = _row_specs(rep.ex)
    groups: Dict[str, List[str]] = {}
    for r in rep.rows:
        variant = specs.get(r, (None, None, None))[2]
        if variant is not None:
            groups.setdefault(variant, []).append(r)
    groups = {v: rows for v, rows in groups.items() if len({specs[r][1] for r in rows}) > 1}
    if not groups or not any(c.val_mean is not None for c in rep.cells.values()):
        return []
    body = []
    for rows in groups.values():
        named = next((r for r in rows if rep.cells[(r, rep.columns[0])].base == "model"), rows[0])
        line = [rep.ex.row_label(named) + " (bases: " + ", ".join(rep.cells[(r, rep.columns[0])].base or "?"
                                                                  for r in rows) + ")"]
        for c in rep.columns:
            ranked = [r for r in rows if rep.cells[(r, c)].val_mean is not None]
            if not ranked:
                line.append("—")
                continue
            best = max(ranked, key=lambda r: rep.cells[(r, c)].val_mean or 0.0)
            st = rep.cells[(best, c)]
            line.append(f"{_spread(st.final_mean, st.final_std, st.n, st.expected)} [{st.base}]")
        body.append(line)
    return [f"{h}# Each init at its own best base", "",
            "For every init the grid has on several bases of the other weights: per column, the final-epoch test "
            "accuracy (%) of the base with the best mean validation accuracy, named in brackets.", "",
            _grid_table(rep, body), ""]


def _best_lines(rep: GridReport, h: str) -> List[str]:
    """The best epoch's test accuracy, saying which split chose the epoch (before anything finished:
    which split the runs will choose on)."""
    ons = sorted({c.best_on for c in rep.cells.values() if c.best_on})
    if not ons:  # nothing finished yet: say what the runs will choose on
        held = _held_out(rep)
        ons = ["val"] if held else ["test"] if held is False else ["val", "test"]
    chosen = {"val": "the validation split", "test": "the test split itself (optimistic: no validation split)"}
    lines = [f"{h}# Best epoch (%)", "",
             "Test accuracy at the evaluated epoch with the best accuracy on "
             + " / ".join(chosen.get(o, o) for o in ons) + "; mean ± std. The final epoch above is the headline.",
             ""]
    return lines + [_grid_table(rep, _spread_rows(rep, lambda c: (c.best_mean, c.best_std))), ""]


def cells_csv(reports: List[GridReport]) -> str:
    """One line per (grid, row, column): the aggregates, the paper's number and difference."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["grid", "row_id", "row", "column_id", "column", "n", "expected", "final_mean", "final_std",
                "best_mean", "best_std", "best_on", "delta_mean", "delta_se", "n_paired", "paper", "paper_delta",
                "val_mean", "val_std", "base", "paired_with"])
    for rep in reports:
        for r in rep.rows:
            for c in rep.columns:
                st = rep.cells[(r, c)]
                w.writerow([rep.name, r, rep.ex.row_label(r), "/".join(c), rep.ex.column_label(c), st.n,
                            st.expected] + [_csv(x) for x in (st.final_mean, st.final_std, st.best_mean, st.best_std)]
                           + [st.best_on or ""] + [_csv(st.delta_mean), _csv(st.delta_se), st.n_paired,
                                                   _csv(st.paper), _csv(st.paper_delta), _csv(st.val_mean),
                                                   _csv(st.val_std), st.base or "", st.paired_with or ""])
    return buf.getvalue()


def runs_csv(reports: List[GridReport]) -> str:
    """One line per run of every grid."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["grid", "key", "row_id", "column_id", "seed", "state", "final_acc", "best_acc", "best_epoch",
                "best_on", "final_val_acc", "epochs", "train_images", "wall_seconds", "problem", "algorithms",
                "device", "versions"])
    for rep in reports:
        for r in rep.runs:
            w.writerow([rep.name, r.key, r.row, "/".join(r.column), r.seed, r.state, _csv(r.final_acc),
                        _csv(r.best_acc), r.best_epoch or "", r.best_on or "", _csv(r.final_val_acc), r.epochs or "",
                        r.train_images or "", r.wall_seconds or "", r.problem or "", r.algorithms or "",
                        r.device or "", versions_text(r.versions) if r.versions else ""])
    return buf.getvalue()


def _csv(x: Optional[float]) -> str:
    return "" if x is None else f"{x:.4f}"


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
           "reports_for_folder", "loose_runs", "mean_std", "software_spread", "software_lines", "rerun_differences"]
