"""Comparison grids as TOML files: the axes of a comparison, its fixed settings, the seeds, how
the report lays it out, and the paper's numbers where it has them.

A grid file (the shipped ones are in ``structinit/data/grids/``; ``structinit bench grid --list``)::

    name = "table2"                       # default: the file name
    title = "ViT-T with five inits on four datasets"
    seeds = 3                             # seeds 0, 1, 2; or a list [0, 5, 7]
    rows = "init"                         # the axis shown as rows (default: the first axis)
    columns = ["dataset"]                 # the axes shown as columns (default: the others)
    baseline = "trunc-normal"             # a row id: differences are reported against it

    [settings]                            # every run: TrainConfig fields
    model = "vit-t"

    [[axes.init]]                         # one table per value of the axis "init"
    id = "impulse-5"                      # how the value is named (default: the value of the
    label = "Impulse 5x5"                 #   setting named like the axis); label: the row title
    init = "impulse"                      # any TrainConfig fields, init_params as a table
    init_params = { filter = 5 }

    [axes]                                # or short: an axis named after a setting, its values
    heads = [4, 8, 16, 32]

    [paper]                               # the paper's numbers, one list per row id, in the
    source = "..., Table 2"               #   order of the column cells (nan: no number)
    values.impulse-5 = [90.67, 70.46, 97.23, 74.40]

A value's settings are merged over ``[settings]`` in axis order (``init_params`` key by key); an
axis value may carry several settings (a training-set size with its own epochs and batch size).
Every run of the grid is one cell (one value of every axis) and one seed. ``seed``, ``out`` and
``resume`` belong to the launcher, not to the file. A relative ``data_dir`` is read below the data
root (``--data-dir``, else ``$STRUCTINIT_DATA``, else ``./data``).

Mistakes are reported with the file and line: an unknown key (with the closest known one), a
value of the wrong type, an axis missing from the layout, a paper row that is not a row.
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from structinit.experiments.gridtypes import (
    LAUNCHER_FIELDS,
    Axis,
    AxisValue,
    GridError,
    GridSpec,
    coerce_setting,
    settable_fields,
    suggest,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python < 3.11
    import tomli as tomllib

GRIDS_PACKAGE = "structinit.data"
GRIDS_FOLDER = "grids"
TOP_KEYS = ("name", "title", "description", "seeds", "rows", "columns", "baseline", "settings", "axes", "paper")
VALUE_KEYS = ("id", "label")
PAPER_KEYS = ("source", "note", "values")
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*\Z")


# --------------------------------------------------------------------------- where keys are

class _Lines:
    """Finds the line of a key in TOML text (tomllib reports positions only for syntax errors)."""

    HEADER = re.compile(r"\s*(\[\[?)\s*([^\[\]#]+?)\s*\]\]?\s*(#.*)?$")

    def __init__(self, text: str):
        self.lines = text.splitlines()
        self.headers: List[Tuple[int, str]] = []
        for i, line in enumerate(self.lines):
            m = self.HEADER.match(line)
            if m:
                self.headers.append((i, re.sub(r"\s+", "", m.group(2)).replace('"', "")))

    def _span(self, section: Optional[str], occurrence: int = 0) -> Tuple[int, int]:
        if section is None:
            return 0, self.headers[0][0] if self.headers else len(self.lines)
        found = [i for i, (_, name) in enumerate(self.headers) if name == section]
        if occurrence >= len(found):
            return -1, -1
        k = found[occurrence]
        end = self.headers[k + 1][0] if k + 1 < len(self.headers) else len(self.lines)
        return self.headers[k][0], end

    def header(self, section: str, occurrence: int = 0) -> Optional[int]:
        start, _ = self._span(section, occurrence)
        return start + 1 if start >= 0 else None

    def key(self, key: str, section: Optional[str] = None, occurrence: int = 0, after: int = 0) -> Optional[int]:
        """1-based line of ``key = ...`` in ``section`` (``None``: the top), at or after line ``after``."""
        start, end = self._span(section, occurrence)
        if start < 0:
            return None
        pat = re.compile(r"(^|[\s{,.])[\"']?" + re.escape(key) + r"[\"']?\s*=")
        for i in range(max(start, after - 1), end):
            if pat.search(self.lines[i].split("#", 1)[0]):
                return i + 1
        return None

    def nth_brace(self, after_line: int, n: int) -> Optional[int]:
        """Line of the ``n``-th ``{`` from ``after_line`` on (values of an inline axis list)."""
        count = -1
        for i in range(after_line - 1, len(self.lines)):
            for ch in self.lines[i].split("#", 1)[0]:
                if ch == "{":
                    count += 1
                    if count == n:
                        return i + 1
        return None


def _at(source: str, line: Optional[int], message: str) -> GridError:
    return GridError(f"{source}:{line}: {message}" if line else f"{source}: {message}")


# --------------------------------------------------------------------------- parsing

def _load_toml(text: str, source: str) -> Dict[str, Any]:
    """The TOML document of a grid file's ``text``; a syntax error names its line in ``source``."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        msg = str(exc)
        m = re.search(r"\(at line (\d+), column (\d+)\)", msg)
        if m:
            raise GridError(f"{source}:{m.group(1)}: {msg[:m.start()].strip()} (column {m.group(2)})") from None
        raise GridError(f"{source}: {msg}") from None


def _parse_settings(doc: Dict[str, Any], source: str, lines: "_Lines", fields: Dict[str, Any]) -> Dict[str, Any]:
    """The grid's ``[settings]``: every run's training settings, each checked as a setting."""
    settings_doc = doc.get("settings", {})
    if not isinstance(settings_doc, dict):
        raise _at(source, lines.key("settings"), "'settings' must be a table of training settings")
    settings = {}
    for key, value in settings_doc.items():
        try:
            settings[key] = coerce_setting(key, value, fields, strict=True)
        except GridError as exc:
            raise _at(source, lines.key(key, "settings") or lines.key(key), f"[settings] {exc}") from None
    return settings


def _parse_layout(doc: Dict[str, Any], names: List[str], source: str, lines: "_Lines") -> Tuple[str, List[str]]:
    """``(rows, columns)``: the axis the report's rows are, the axes its columns are (every axis
    laid out exactly once)."""
    rows = doc.get("rows", names[0])
    if not isinstance(rows, str):
        raise _at(source, lines.key("rows"), f"'rows' must be one axis name, got {rows!r}")
    if rows not in names:
        raise _at(source, lines.key("rows"), f"unknown axis {rows!r} in 'rows'{suggest(rows, names)}; the axes are "
                  f"{', '.join(names)}")
    columns = doc.get("columns", [n for n in names if n != rows])
    if isinstance(columns, str):
        columns = [columns]
    if not isinstance(columns, list) or not all(isinstance(c, str) for c in columns):
        raise _at(source, lines.key("columns"), f"'columns' must be a list of axis names, got {columns!r}")
    for c in columns:
        if c not in names:
            raise _at(source, lines.key("columns"), f"unknown axis {c!r} in 'columns'{suggest(c, names)}; the axes "
                      f"are {', '.join(names)}")
    laid = [rows] + list(columns)
    for n in names:
        if laid.count(n) != 1:
            where = "both rows and columns" if laid.count(n) > 1 else "neither rows nor columns"
            raise _at(source, lines.key("columns") or lines.key("rows") or lines.header(f"axes.{n}"),
                      f"axis {n!r} is in {where}; every axis must be laid out exactly once")
    return rows, list(columns)


def parse_grid_text(text: str, source: str = "<grid>", default_name: str = "grid") -> GridSpec:
    """Parse a grid file's text; ``source`` names it in errors (a path, or the shipped name)."""
    doc = _load_toml(text, source)
    lines = _Lines(text)
    fields = settable_fields()

    for key in doc:
        if key not in TOP_KEYS:
            hint = suggest(key, TOP_KEYS)
            if not hint and key in fields:
                hint = " (training settings go in [settings] or in an axis value)"
            raise _at(source, lines.key(key) or lines.header(key), f"unknown key {key!r}{hint}; a grid has "
                      f"{', '.join(TOP_KEYS)}")

    def text_field(key: str, default: str) -> str:
        value = doc.get(key, default)
        if not isinstance(value, str):  # TOML has no null, so only a value of another type is refused
            raise _at(source, lines.key(key), f"'{key}' must be a string, got {value!r}")
        return value

    name = text_field("name", default_name)
    if not NAME_RE.match(name or ""):
        raise _at(source, lines.key("name"), f"'name' must be letters, digits, '-', '_' or '.', got {name!r}")
    title = text_field("title", name)
    description = text_field("description", "")

    settings = _parse_settings(doc, source, lines, fields)
    # axes
    axes_doc = doc.get("axes")
    if not isinstance(axes_doc, dict) or not axes_doc:
        raise _at(source, lines.header("axes") or lines.key("axes"), "a grid needs at least one axis: [[axes.NAME]] "
                  "tables or [axes] NAME = [values]")
    axes = []
    for axis_name, raw in axes_doc.items():
        axes.append(_parse_axis(axis_name, raw, source, lines, fields))

    rows, columns = _parse_layout(doc, [a.name for a in axes], source, lines)
    seeds = parse_seeds(doc.get("seeds", 1), where=f"{source}:{lines.key('seeds')}" if lines.key("seeds") else source)

    spec = GridSpec(name=name, title=title, description=description, source=source, axes=tuple(axes), rows=rows,
                    columns=tuple(columns), seeds=seeds, settings=settings)

    baseline = doc.get("baseline")
    if baseline is not None:
        ids = [v.id for v in spec.row_axis.values]
        if baseline not in ids:
            raise _at(source, lines.key("baseline"), f"'baseline' {baseline!r} is not a value of the row axis "
                      f"{rows!r}{suggest(str(baseline), ids)}; its values are {', '.join(ids)}")
        spec.baseline = baseline

    paper = doc.get("paper")
    if paper is not None:
        _parse_paper(spec, paper, source, lines)
    return spec


def _parse_axis(name: str, raw: Any, source: str, lines: _Lines, fields: Dict[str, Any]) -> Axis:
    if not NAME_RE.match(name):
        raise _at(source, lines.header(f"axes.{name}") or lines.key(name, "axes"), f"axis name {name!r} must be "
                  "letters, digits, '-', '_' or '.'")
    if name in LAUNCHER_FIELDS:
        raise _at(source, lines.header(f"axes.{name}") or lines.key(name, "axes"), f"'{name}' cannot be an axis: "
                  "it is set by the launcher" + (", and every cell already runs each of the grid's seeds (set them "
                                                 "with seeds = N or a list, or --seeds)" if name == "seed" else ""))
    inline_line = lines.key(name, "axes")
    if not isinstance(raw, list) or not raw:
        raise _at(source, inline_line or lines.header(f"axes.{name}"), f"axis {name!r} must be a non-empty list of "
                  "values")
    values: List[AxisValue] = []
    for i, item in enumerate(raw):
        line = lines.header(f"axes.{name}", i) or (lines.nth_brace(inline_line, i) if inline_line else None)
        if not isinstance(item, dict):  # shorthand: the axis is a setting, the items its values
            if name not in fields:
                raise _at(source, inline_line, f"axis {name!r} lists plain values, so it must be a training setting"
                          f"{suggest(name, list(fields))}; otherwise give each value as a table with its settings")
            try:
                value = coerce_setting(name, item, fields, strict=True)
            except GridError as exc:
                raise _at(source, inline_line, f"axis {name!r}: {exc}") from None
            values.append(AxisValue(str(item), str(item), {name: value}, inline_line))
            continue
        settings: Dict[str, Any] = {}
        for key, value in item.items():
            if key in VALUE_KEYS:
                if not isinstance(value, str) or not value.strip():
                    raise _at(source, lines.key(key, after=line or 0) or line, f"axis {name!r} value {i + 1}: "
                              f"'{key}' must be a non-empty string, got {value!r}")
                continue
            try:
                settings[key] = coerce_setting(key, value, fields, strict=True)
            except GridError as exc:
                where = lines.key(key, f"axes.{name}", i) if lines.header(f"axes.{name}", i) else \
                    lines.key(key, after=line or 0)
                raise _at(source, where or line, f"axis {name!r} value {i + 1}: {exc}"
                          + ("; a value may also have 'id' and 'label'" if "unknown setting" in str(exc) else "")) \
                    from None
        vid = item.get("id")
        if vid is None:
            if name in settings and not isinstance(settings[name], dict):
                vid = str(settings[name])
            else:
                raise _at(source, line, f"axis {name!r} value {i + 1} needs an 'id' (it sets no setting named "
                          f"{name!r} to name it by)")
        values.append(AxisValue(vid, item["label"] if "label" in item else vid, settings, line))
    seen: Dict[str, AxisValue] = {}
    labels: Dict[str, AxisValue] = {}
    for v in values:
        if v.id in seen:
            raise _at(source, v.line, f"axis {name!r} has the id {v.id!r} twice; give each value its own 'id'")
        bad = [c for c in ID_FORBIDDEN if c in v.id]
        if bad or v.id != v.id.strip():
            what = f"{bad[0]!r}" if bad else "spaces at its ends"
            raise _at(source, v.line, f"axis {name!r}: the id {v.id!r} has {what}, which --only and the report's "
                      f"column ids use to separate ids; give the value an 'id' without ', / =' or end spaces")
        if v.label in labels:
            raise _at(source, v.line, f"axis {name!r} has the label {v.label!r} twice (values {labels[v.label].id!r} "
                      f"and {v.id!r}); tables and figures would show two rows or columns of that name")
        for other in seen.values():
            if _canonical(other.settings) == _canonical(v.settings):
                raise _at(source, v.line, f"axis {name!r}: the values {other.id!r} and {v.id!r} set the same settings "
                          f"({_settings_text(v.settings)}), so they would be the same runs under two names")
        seen[v.id] = v
        labels[v.label] = v
    return Axis(name, tuple(values))


#: Characters an axis value's id may not hold: --only separates ids with ',' and the axis with
#: '=', the report joins column ids with '/'.
ID_FORBIDDEN = (",", "/", "=")


def _canonical(settings: Dict[str, Any]) -> str:
    import json

    return json.dumps(settings, sort_keys=True, default=str)


def _settings_text(settings: Dict[str, Any]) -> str:
    return ", ".join(f"{k} = {v!r}" for k, v in sorted(settings.items())) or "none"


def _parse_paper(spec: GridSpec, paper: Any, source: str, lines: _Lines) -> None:
    if not isinstance(paper, dict):
        raise _at(source, lines.key("paper"), "'paper' must be a table with source and values")
    for key in paper:
        if key not in PAPER_KEYS:
            raise _at(source, lines.key(key, "paper") or lines.header("paper"), f"unknown key {key!r} in [paper]"
                      f"{suggest(key, PAPER_KEYS)}; it has {', '.join(PAPER_KEYS)}")
    spec.paper_source = paper.get("source")
    spec.paper_note = paper.get("note")
    values = paper.get("values", {})
    if not isinstance(values, dict):
        raise _at(source, lines.key("values", "paper"), "[paper] values must be a table: row id = [numbers]")
    ids = [v.id for v in spec.row_axis.values]
    n = len(spec.column_cells())
    for row, nums in values.items():
        line = lines.key(row, "paper.values") or lines.key(row, "paper") or lines.key(f"values.{row}", "paper")
        if row not in ids:
            raise _at(source, line, f"[paper] row {row!r} is not a value of the row axis {spec.rows!r}"
                      f"{suggest(row, ids)}; its values are {', '.join(ids)}")
        if not isinstance(nums, list) or len(nums) != n:
            raise _at(source, line, f"[paper] row {row!r} needs {n} numbers (one per column, in the order of the "
                      f"column cells), got {nums!r}")
        out: List[Optional[float]] = []
        for x in nums:
            if isinstance(x, bool) or not isinstance(x, (int, float)):
                raise _at(source, line, f"[paper] row {row!r}: {x!r} is not a number (use nan for no number)")
            out.append(None if math.isnan(x) else float(x))
        spec.paper[row] = out


#: A seed count above this is kept as a ``range`` (not a tuple) until the grid is expanded, so that
#: counting the runs of a grid of a hundred million seeds (to refuse it) costs nothing.
LAZY_SEEDS = 100_000


def parse_seeds(value: Any, where: str = "seeds") -> Sequence[int]:
    """Seeds from ``N`` (seeds ``0 .. N-1``), a list of seeds, or text: ``"N"``, ``"0,3,7"``, or an
    inclusive range ``"5-9"`` (one seed alone is ``"7,"`` or ``"7-7"``). A count above
    :data:`LAZY_SEEDS` gives a ``range``, which is a sequence like the tuple."""
    if isinstance(value, str):
        text = value.strip()
        span = re.fullmatch(r"(\d+)\s*-\s*(\d+)", text)
        if span:
            first, last = int(span.group(1)), int(span.group(2))
            if last < first:
                raise GridError(f"{where}: the seed range {text!r} ends before it starts")
            value = list(range(first, last + 1))
        else:
            try:
                value = int(text) if re.fullmatch(r"\d+", text) else [int(s) for s in text.split(",") if s.strip()]
            except ValueError:
                raise GridError(f"{where}: seeds must be a count N, a list such as 0,3,7 or a range such as 5-9, "
                                f"got {text!r}") from None
    if isinstance(value, bool):
        raise GridError(f"{where}: seeds must be a count or a list of seeds, got {value!r}")
    if isinstance(value, int):
        if value < 1:
            raise GridError(f"{where}: the seed count must be at least 1, got {value} (a count N means seeds "
                            f"0..N-1; seed 0 alone is 0,)")
        return tuple(range(value)) if value <= LAZY_SEEDS else range(value)
    if isinstance(value, list) and value and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                                 for s in value):
        if len(set(value)) != len(value):
            raise GridError(f"{where}: seeds repeat in {value}")
        return tuple(value)
    raise GridError(f"{where}: seeds must be a count or a non-empty list of non-negative seeds, got {value!r}")


# --------------------------------------------------------------------------- selecting part of a grid

def parse_selection(items: Sequence[str]) -> Dict[str, List[str]]:
    """``["train_size=100,250", "init=mimetic"]`` -> ``{"train_size": ["100", "250"], "init": ["mimetic"]}``."""
    from structinit.errors import param

    out: Dict[str, List[str]] = {}
    for item in items:
        name, sep, values = str(item).partition("=")
        ids = [v.strip() for v in values.split(",") if v.strip()]
        if not sep or not name.strip() or not ids:
            raise GridError(f"{param('only')} must look like AXIS=ID[,ID...], got {item!r}")
        out.setdefault(name.strip(), []).extend(ids)
    return out


def restrict(spec: GridSpec, selection: Mapping[str, Sequence[str]]) -> GridSpec:
    """``spec`` with only the chosen values of some axes (``{axis: [value ids]}``), in the grid's
    order; the paper's numbers follow the rows and columns that are kept."""
    from structinit.errors import param

    if not selection:
        return spec
    names = [a.name for a in spec.axes]
    for name, ids in selection.items():
        if name not in names and name in ("seed", "seeds"):
            raise GridError(f"{param('only')}: the seeds are not an axis; choose them with {param('seeds')}")
        if name not in names:
            raise GridError(f"{param('only')}: unknown axis {name!r}{suggest(name, names)}; grid {spec.name} has "
                            f"{', '.join(names)}")
        known = [v.id for v in spec.axis(name).values]
        for vid in ids:
            if vid not in known:
                raise GridError(f"{param('only')}: axis {name!r} has no value {vid!r}{suggest(vid, known)}; it has "
                                f"{', '.join(known)}")
    axes = tuple(Axis(a.name, tuple(v for v in a.values if a.name not in selection or v.id in selection[a.name]))
                 for a in spec.axes)
    new = GridSpec(**{**spec.__dict__, "axes": axes, "paper": {}})
    old_cols = [tuple(v.id for v in c) for c in spec.column_cells()]
    keep = [old_cols.index(tuple(v.id for v in c)) for c in new.column_cells()]
    rows = {v.id for v in new.row_axis.values}
    new.paper = {r: [vals[i] for i in keep] for r, vals in spec.paper.items() if r in rows}
    if new.baseline is not None and new.baseline not in rows:
        new.baseline = None
    return new


# --------------------------------------------------------------------------- shipped grids and files

def shipped_grids() -> Dict[str, Any]:
    """Grid name -> the shipped file (an ``importlib.resources`` traversable), sorted by name."""
    from importlib.resources import files

    folder = files(GRIDS_PACKAGE) / GRIDS_FOLDER
    found = {p.name[:-5]: p for p in folder.iterdir() if p.name.endswith(".toml")}
    return dict(sorted(found.items()))


def load_grid(name_or_path: str) -> GridSpec:
    """The grid ``name_or_path``: a file (``*.toml``, or any existing path) or a shipped name."""
    text_arg = str(name_or_path)
    path = Path(text_arg).expanduser()
    if path.is_file() or text_arg.endswith(".toml") or "/" in text_arg:
        from structinit.atomic import NotRegularFile, read_regular

        try:
            text = read_regular(path).decode("utf-8")  # a FIFO or a device is named, never read
        except NotRegularFile as exc:
            raise GridError(f"grid file {text_arg}: {exc.strerror}") from None
        except FileNotFoundError:
            raise GridError(f"grid file {text_arg} does not exist") from None
        except OSError as exc:  # a file-system problem (exit code 1), not a mistake in the grid
            from structinit.errors import StructinitError

            raise StructinitError(f"cannot read grid file {path}: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            raise GridError(f"cannot read grid file {path}: it is not UTF-8 text ({exc.reason} at byte "
                            f"{exc.start})") from None
        return parse_grid_text(text, str(path), default_name=path.stem)
    shipped = shipped_grids()
    if text_arg not in shipped:
        raise GridError(f"unknown grid {text_arg!r}{suggest(text_arg, list(shipped))}; shipped grids: "
                        f"{', '.join(shipped)} (structinit bench grid --list), or give a .toml file")
    return parse_grid_text(shipped[text_arg].read_text(encoding="utf-8"), f"{text_arg} (shipped)", text_arg)


__all__ = ["GridSpec", "Axis", "AxisValue", "GridError", "load_grid", "parse_grid_text", "shipped_grids", "restrict",
           "parse_selection",
           "parse_seeds", "coerce_setting", "settable_fields"]
