"""A grid expanded into runs: one :class:`~structinit.training.config.TrainConfig` per cell and
seed, each living in the folder named by its run key (``RUNS/<key>/``), so the same run in two
grids is one run. The expansion is recorded in ``RUNS/grids/<name>-<digest>.json`` (the
*manifest*: the layout, the paper's numbers, every cell's key and the command that made it), which
is what ``structinit bench report RUNS`` reads.

Example::

    from structinit.experiments.gridspec import load_grid
    from structinit.experiments.expand import expand
    ex = expand(load_grid("digits"), overrides=["epochs=2"], seeds="2", runs_dir="runs")
    len(ex.cells), ex.cells[0].key, ex.run_dir(ex.cells[0])
"""

from __future__ import annotations

import copy
import datetime
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Set, Tuple, Union

from structinit.atomic import read_regular_text
from structinit.errors import UsageError, param
from structinit.experiments.gridspec import (
    Axis,
    AxisValue,
    GridError,
    GridSpec,
    coerce_setting,
    parse_seeds,
    settable_fields,
    suggest,
)
from structinit.keys import text_key

MANIFEST_FORMAT = "structinit-grid/1"
INIT_PARAM_PREFIX = "init_params."


@dataclass
class Cell:
    """One run of a grid: the row value, the column values (one per column axis), the seed, the
    run key and (when expanded here, not read from a manifest) the config."""

    row: str
    column: Tuple[str, ...]
    seed: int
    key: str
    config: Any = None


@dataclass
class Expansion:
    """A grid's runs (see the module docstring). ``overrides`` are the ``--set`` settings."""

    spec: GridSpec
    runs_dir: Path
    cells: List[Cell]
    overrides: Dict[str, Any] = field(default_factory=dict)
    command: Optional[str] = None
    created: Optional[str] = None
    warnings: List[str] = field(default_factory=list)

    def run_dir(self, cell_or_key: Union[Cell, str]) -> Path:
        key = cell_or_key.key if isinstance(cell_or_key, Cell) else cell_or_key
        return self.runs_dir / key

    def unique_cells(self) -> List[Cell]:
        """The first cell of every distinct run key (two cells with equal settings are one run)."""
        seen, out = set(), []
        for c in self.cells:
            if c.key not in seen:
                seen.add(c.key)
                out.append(c)
        return out

    def row_label(self, row: str) -> str:
        return self.spec.row_axis.value(row).label

    def column_label(self, column: Sequence[str]) -> str:
        return " / ".join(a.value(v).label for a, v in zip(self.spec.column_axes, column)) or "accuracy"

    def describe(self, cell: Cell) -> str:
        """``Impulse / 100 / seed 3``."""
        parts = [self.row_label(cell.row)] + ([self.column_label(cell.column)] if cell.column else [])
        return " / ".join(parts + [f"seed {cell.seed}"])

    @property
    def digest(self) -> str:
        text = json.dumps([[c.row, list(c.column), c.seed, c.key] for c in self.cells], separators=(",", ":"))
        return text_key(text, 8)

    @property
    def manifest_path(self) -> Path:
        return self.runs_dir / "grids" / f"{self.spec.name}-{self.digest}.json"

    # ---- manifest
    def manifest(self) -> Dict[str, Any]:
        s = self.spec

        def axis(a: Axis) -> Dict[str, Any]:
            return {"name": a.name, "values": [{"id": v.id, "label": v.label, "settings": v.settings}
                                               for v in a.values]}

        return {"format": MANIFEST_FORMAT, "name": s.name, "title": s.title, "description": s.description,
                "source": s.source, "rows": s.rows, "columns": list(s.columns), "axes": [axis(a) for a in s.axes],
                "seeds": list(s.seeds), "settings": s.settings, "baseline": s.baseline,
                "paper": {"source": s.paper_source, "note": s.paper_note, "values": s.paper},
                "overrides": self.overrides, "command": self.command,
                "created": self.created or datetime.datetime.now().isoformat(timespec="seconds"),
                "cells": [{"row": c.row, "column": list(c.column), "seed": c.seed, "key": c.key} for c in self.cells]}

    def write_manifest(self) -> Path:
        """Write the manifest (kept as it is when the same expansion was recorded before). One that
        no longer reads as this expansion (cut short, edited) is moved aside to
        ``NAME-DIGEST.json.damaged-<time>`` and written again, with a warning."""
        import warnings

        from structinit.atomic import atomic_write
        from structinit.errors import StructinitError, StructinitWarning

        path = self.manifest_path
        try:
            if path.is_file():
                why = self._manifest_damage(path)
                if why is None:
                    return path
                aside = path.with_name(f"{path.name}.damaged-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}")
                os.replace(path, aside)
                warnings.warn(StructinitWarning(f"the grid manifest {path} was damaged ({why}): moved to {aside.name} "
                                                "and written again"), stacklevel=2)
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_write(path, "w") as f:
                f.write(json.dumps(self.manifest(), indent=1, sort_keys=True, default=str) + "\n")
        except OSError as exc:
            raise StructinitError(f"cannot write {path}: {exc.strerror or exc}") from None
        return path

    def _manifest_damage(self, path: Path) -> Optional[str]:
        """Why the manifest at ``path`` is not this expansion's record (``None`` when it is)."""
        try:
            old = Expansion.from_manifest(json.loads(read_regular_text(path)), self.runs_dir)
        except (ValueError, UsageError) as exc:
            return str(exc).splitlines()[0][:200]
        mine = [(c.row, tuple(c.column), c.seed, c.key) for c in self.cells]
        if [(c.row, tuple(c.column), c.seed, c.key) for c in old.cells] != mine or old.spec.name != self.spec.name:
            return "it records other runs"
        return None

    @classmethod
    def from_manifest(cls, doc: Dict[str, Any], runs_dir: os.PathLike) -> "Expansion":
        """The expansion recorded in a manifest (cells without configs)."""
        if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
            raise UsageError("not a structinit grid manifest")
        try:
            axes = tuple(Axis(a["name"], tuple(AxisValue(v["id"], v["label"], v.get("settings", {}))
                                               for v in a["values"])) for a in doc["axes"])
            paper = doc.get("paper") or {}
            title = doc["title"] if "title" in doc else doc["name"]
            spec = GridSpec(name=doc["name"], title=title, source=doc.get("source", ""),
                            axes=axes, rows=doc["rows"], columns=tuple(doc["columns"]), seeds=tuple(doc["seeds"]),
                            settings=doc.get("settings", {}), baseline=doc.get("baseline"),
                            description=doc.get("description", ""), paper_source=paper.get("source"),
                            paper_note=paper.get("note"), paper=paper.get("values") or {})
            cells = [Cell(c["row"], tuple(c["column"]), int(c["seed"]), c["key"]) for c in doc["cells"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise UsageError(f"the grid manifest is incomplete ({type(exc).__name__}: {exc})") from None
        return cls(spec, Path(runs_dir), cells, doc.get("overrides") or {}, doc.get("command"), doc.get("created"))


# --------------------------------------------------------------------------- overrides

def parse_overrides(items: Iterable[str]) -> Dict[str, Any]:
    """``["epochs=2", "init_params.target_mass=0.5"]`` -> typed settings. A training setting
    applies to every run; ``init_params.NAME`` to the runs whose init method takes ``NAME``."""
    from structinit.init.registry import parse_assignments

    raw = parse_assignments(items, what="overrides")
    fields = settable_fields()
    out: Dict[str, Any] = {}
    for name, value in raw.items():
        if name.startswith(INIT_PARAM_PREFIX):
            if not name[len(INIT_PARAM_PREFIX):]:
                raise GridError(f"{param('overrides')} {name}: give the init parameter after '{INIT_PARAM_PREFIX}'")
            out[name] = value
            continue
        try:
            out[name] = coerce_setting(name, value, fields)
        except GridError as exc:
            raise GridError(f"{param('overrides')} {name}={value}: {exc}") from None
    return out


def _check_axes_kept(spec: GridSpec, plain: Dict[str, Any], init_over: Dict[str, Any]) -> None:
    """Refuse ``--set`` settings that would replace what an axis varies: the setting an axis is
    named after, or one without which two values of an axis are the same settings (their runs would
    collapse into one while the report shows them apart)."""
    for axis in spec.axes:
        name = axis.name
        if name in plain and any(name in v.settings for v in axis.values):
            raise GridError(f"{param('overrides')} {name}={plain[name]} would replace the axis {name!r} of grid "
                            f"{spec.name} in every run; choose some of its values with {param('only')} "
                            f"{name}={','.join(v.id for v in axis.values[:2])}")
        left = []
        for v in axis.values:
            kept = {k: val for k, val in v.settings.items() if k not in plain}
            if "init_params" in kept and init_over:
                kept["init_params"] = {k: val for k, val in kept["init_params"].items() if k not in init_over}
                if not kept["init_params"]:
                    del kept["init_params"]
            left.append(json.dumps(kept, sort_keys=True, default=str))
        for i, text in enumerate(left):
            j = left.index(text)
            if j < i:
                a, b = axis.values[j], axis.values[i]
                gone = sorted({k for k in (*a.settings, *b.settings) if k in plain}
                              | {f"init_params.{k}" for k in init_over
                                 if k in (a.settings.get("init_params") or {}) or k in (b.settings.get("init_params")
                                                                                         or {})})
                raise GridError(f"{param('overrides')} {', '.join(gone)} would make the values {a.id!r} and {b.id!r} "
                                f"of the axis {name!r} the same runs; choose values with {param('only')} instead")


def _merge(cfg: Dict[str, Any], settings: Dict[str, Any]) -> None:
    for k, v in settings.items():
        if k == "init_params":
            cfg.setdefault("init_params", {}).update(copy.deepcopy(v))
        else:
            cfg[k] = copy.deepcopy(v)


def _data_dir(value: Optional[str], root: Path) -> Optional[str]:
    if value is None:
        return None
    p = Path(value).expanduser()
    return str(p if p.is_absolute() else root / p)


# --------------------------------------------------------------------------- expansion

#: Grids of more runs than this are refused unless asked for (``max_runs=None``, ``--yes``):
#: expanding one takes about 3-25 ms per run here, before anything is launched.
MAX_RUNS = 10_000
#: Grids of at least this many runs report their expansion to ``progress``.
PROGRESS_FROM = 2000
#: Seconds per run that expanding takes at least (measured: 2.6 ms per run for table6).
EXPAND_SECONDS_PER_RUN = 0.0026


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} minutes"
    return f"{seconds / 3600:.1f} hours"


def _checked_count(spec: GridSpec, n_seeds: int, max_runs: Optional[int]) -> int:
    """The runs of ``spec`` with ``n_seeds`` seeds; more than ``max_runs`` is refused, naming the way out."""
    total = spec.cells * n_seeds
    if max_runs is not None and total > max_runs:
        shape = " x ".join([f"{len(a.values)} {a.name}" for a in (spec.row_axis, *spec.column_axes)]
                           + [f"{n_seeds} seeds"])
        raise GridError(f"grid {spec.name} has {total:,} runs ({shape}): expanding them alone would take about "
                        f"{_duration(total * EXPAND_SECONDS_PER_RUN)} before anything runs, and training them far "
                        f"longer; choose fewer with {param('seeds')} or {param('only')}, or pass {param('yes')} if "
                        f"you mean {total:,} runs")
    return total


def _cell_settings(spec: GridSpec, chosen: Dict[str, Any], plain: Dict[str, Any], init_over: Dict[str, Any],
                   used: set, where: str) -> Dict[str, Any]:
    """One cell's settings: the grid's, each axis value's in file order, the overrides; an
    ``init_params.NAME`` override goes to a cell whose init method takes ``NAME`` (``used`` collects them)."""
    cfg: Dict[str, Any] = copy.deepcopy(spec.settings)
    for axis in spec.axes:  # file order, whatever the layout
        _merge(cfg, chosen[axis.name].settings)
    _merge(cfg, plain)
    if init_over and cfg.get("init"):
        from structinit.init.registry import spec_class

        try:
            names = {f for f in spec_class(cfg["init"]).__dataclass_fields__}
        except UsageError as exc:
            raise GridError(f"{spec.source}: cell {where}: {exc}") from None
        for k, v in init_over.items():
            if k in names:
                cfg.setdefault("init_params", {})[k] = v
                used.add(k)
    return cfg


def _check_cell(spec: GridSpec, cfg: Dict[str, Any], where: str, long_warmup: Dict[Tuple[float, int], int]) -> None:
    """Refuse a cell whose settings make no run (naming the cell); count a warm-up longer than the run."""
    from structinit.training.config import TrainConfig
    from structinit.training.datasets import dataset_info

    try:
        base = TrainConfig(**cfg)
        hp = base.validate()
        if hp["warmup_epochs"] >= hp["epochs"]:
            k = (hp["warmup_epochs"], hp["epochs"])
            long_warmup[k] = long_warmup.get(k, 0) + 1
        info = dataset_info(base.dataset)
        base.model.resolved(info.default_patch)
    except UsageError as exc:
        raise GridError(f"{spec.source}: cell {where}: {exc}") from None
    except TypeError as exc:  # a value of a type the config cannot take
        raise GridError(f"{spec.source}: cell {where}: {exc}") from None


def expand(spec: GridSpec, *, overrides: Union[Iterable[str], Dict[str, Any], None] = None,
           seeds: Union[None, int, str, Sequence[int]] = None, runs_dir: Union[str, os.PathLike] = "runs",
           data_root: Optional[os.PathLike] = None, command: Optional[str] = None,
           only: Union[None, Sequence[str], Dict[str, Sequence[str]]] = None,
           max_runs: Optional[int] = MAX_RUNS,
           progress: Optional[Callable[[int, int], None]] = None) -> Expansion:
    """Every run of ``spec``: cells (rows x column cells) x seeds, each a validated TrainConfig.

    ``overrides``: ``NAME=VALUE`` strings or a dict from :func:`parse_overrides`, applied over the
    file's settings and axis values. ``seeds``: a count, a list, or ``None`` for the file's.
    ``data_root``: where a relative ``data_dir`` of the grid is read from (``None``:
    ``$STRUCTINIT_DATA``, else ``./data``); given, it is also the data folder of every run that
    sets none. ``only``: some values of some axes (``["train_size=100,250"]`` or ``{"train_size":
    ["100", "250"]}``, see :func:`~structinit.experiments.gridspec.restrict`). Raises :class:`GridError`
    naming the cell of an invalid combination. The runs are counted first: more
    than ``max_runs`` is refused before any is expanded (``None``: no limit); ``progress(done,
    total)`` is called as the runs are expanded.
    """
    from structinit.experiments.gridspec import parse_selection, restrict
    from structinit.training.datasets import default_data_dir

    if only:
        spec = restrict(spec, only if isinstance(only, dict) else parse_selection(only))
    if overrides is None:
        overrides = {}
    elif not isinstance(overrides, dict):
        overrides = parse_overrides(overrides)
    seed_list = spec.seeds if seeds is None else parse_seeds(seeds if not isinstance(seeds, tuple) else list(seeds),
                                                             where=param("seeds"))
    total = _checked_count(spec, len(seed_list), max_runs)
    done = 0
    root = Path(data_root if data_root is not None else default_data_dir()).expanduser().absolute()
    runs_dir = Path(runs_dir).expanduser()
    plain = {k: v for k, v in overrides.items() if not k.startswith(INIT_PARAM_PREFIX)}
    init_over = {k[len(INIT_PARAM_PREFIX):]: v for k, v in overrides.items() if k.startswith(INIT_PARAM_PREFIX)}
    used_init_over: Set[str] = set()
    _check_axes_kept(spec, plain, init_over)

    long_warmup: Dict[Tuple[float, int], int] = {}
    first_seed: Dict[str, str] = {}  # the run key of each cell's first seed -> the cell
    row_axis = spec.row_axis
    col_cells = spec.column_cells()
    layout = [spec.rows] + list(spec.columns)
    cells: List[Cell] = []
    for row in row_axis.values:
        for col in col_cells:
            chosen = dict(zip(layout, (row,) + tuple(col)))
            where = ", ".join(f"{a}={chosen[a].id}" for a in layout)
            cfg = _cell_settings(spec, chosen, plain, init_over, used_init_over, where)
            if "data_dir" in cfg:
                cfg["data_dir"] = _data_dir(cfg["data_dir"], root)
            elif data_root is not None:
                cfg["data_dir"] = str(root)
            _check_cell(spec, cfg, where, long_warmup)
            for cell in _seed_runs(spec, cfg, seed_list, row.id, tuple(v.id for v in col), where, runs_dir,
                                   first_seed):
                cells.append(cell)
                done += 1
                if progress is not None and total >= PROGRESS_FROM and (done % 500 == 0 or done == total):
                    progress(done, total)
    unused = sorted(set(init_over) - used_init_over)
    if unused:
        raise GridError(f"{param('overrides')} {', '.join(INIT_PARAM_PREFIX + u for u in unused)}: no init method of "
                        f"this grid takes {'it' if len(unused) == 1 else 'them'}")
    spec_seeds = GridSpec(**{**spec.__dict__, "seeds": tuple(seed_list)})
    warnings = [f"{n} cell(s) warm up for {w:g} epochs but train for only {e}: the learning rate never reaches its "
                f"peak (set warmup_epochs too)" for (w, e), n in sorted(long_warmup.items())]
    return Expansion(spec_seeds, runs_dir, cells, dict(overrides), command, warnings=warnings)


def _seed_runs(spec: GridSpec, cfg: Dict[str, Any], seed_list: Sequence[int], row: str, column: Tuple[str, ...],
               where: str, runs_dir: Path, first_seed: Dict[str, str]) -> Iterator[Cell]:
    """The runs of one cell (its settings ``cfg``, named ``where`` in errors), one per seed, each
    in ``runs_dir/<key>`` and resumed when started again. Two cells whose first seeds are the same
    run are refused (``first_seed``: each cell's first run key, filled in as cells come)."""
    from structinit.training.config import TrainConfig

    for i, seed in enumerate(seed_list):
        config = TrainConfig(**dict(copy.deepcopy(cfg), seed=seed))
        key = config.key
        if i == 0:
            if key in first_seed:  # two cells that are one run: the report would show it twice
                raise GridError(f"{spec.source}: cells {first_seed[key]} and {where} are the same runs (their "
                                "settings differ only in spelling or in defaults); give each cell settings "
                                "of its own, or drop one")
            first_seed[key] = where
        config.out = str(runs_dir / key)
        config.resume = True
        yield Cell(row, column, seed, key, config)


def load_manifests(runs_dir: os.PathLike, unreadable: Optional[Dict[Path, str]] = None) -> List[Expansion]:
    """Every grid recorded in ``runs_dir/grids/``, oldest first. An unreadable manifest is an error,
    unless ``unreadable`` is given: then it is left out and recorded there (path -> why)."""
    folder = Path(runs_dir) / "grids"
    out = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            doc = json.loads(read_regular_text(path))
            out.append(Expansion.from_manifest(doc, runs_dir))
        except (OSError, ValueError, UsageError) as exc:
            why = str(exc).splitlines()[0][:200]
            if unreadable is None:
                raise UsageError(f"{path} is not a readable grid manifest ({why})") from None
            unreadable[path] = why
    out.sort(key=lambda e: (e.created or "", e.spec.name))
    return out


def manifest_name(path: Path) -> str:
    """The grid name in a manifest's file name (``NAME-DIGEST.json``)."""
    stem = Path(path).stem
    return stem.rsplit("-", 1)[0] if "-" in stem else stem


def pick_manifest(expansions: List[Expansion], name: Optional[str],
                  unreadable: Optional[Dict[Path, str]] = None) -> List[Expansion]:
    """The expansions named ``name`` (all when ``None``). A damaged manifest of the grid asked for
    (``unreadable``, from :func:`load_manifests`) is an error; those of other grids are not."""
    if name is not None:
        for path, why in (unreadable or {}).items():
            if name in (manifest_name(path), path.stem):
                raise UsageError(f"{path} is not a readable grid manifest ({why}); run the command that launched the "
                                 "grid again (structinit bench grid ..., which trains nothing finished) to write it "
                                 "anew")
    if name is None:
        return expansions
    chosen = [e for e in expansions if e.spec.name == name or e.manifest_path.stem == name]
    if not chosen:
        names = sorted({e.spec.name for e in expansions})
        raise UsageError(f"no grid {name!r} in this folder{suggest(name, names)}; it holds {', '.join(names)}")
    return chosen


__all__ = ["Cell", "Expansion", "expand", "parse_overrides", "load_manifests", "pick_manifest",
           "MAX_RUNS"]
