"""What a comparison grid is once read: its axes (:class:`Axis`), their values (:class:`AxisValue`),
the grid itself (:class:`GridSpec`), the settings a grid may set and their values coerced to
TrainConfig's types (:func:`coerce_setting`), and :class:`GridError`.
:mod:`structinit.experiments.gridspec` reads grid files into them.
"""

from __future__ import annotations

import difflib
import math
import typing
from dataclasses import dataclass, field
from itertools import product
from typing import Any, Dict, List, Optional, Sequence, Tuple

from structinit.errors import UsageError

#: Settings a grid may not set: the launcher owns them.
LAUNCHER_FIELDS = ("out", "resume", "seed")


class GridError(UsageError):
    """A mistake in a grid file or in the overrides of a grid (CLI exit code 2)."""


# --------------------------------------------------------------------------- settings

def settable_fields() -> Dict[str, Any]:
    """The TrainConfig settings a grid may set (its flat form), with their type hints."""
    from structinit.training.config import flat_settings

    return {k: v for k, v in flat_settings().items() if k not in LAUNCHER_FIELDS}


def _kind(hint: Any) -> str:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    base = args[0] if typing.get_origin(hint) is typing.Union and args else hint
    origin = typing.get_origin(base) or base
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string",
            dict: "a table such as { filter = 5 }"}.get(origin, str(base))


def suggest(name: str, known: Sequence[str]) -> str:
    """`` (did you mean 'x'?)`` when a known name is close to ``name``, else an empty string."""
    close = difflib.get_close_matches(str(name), list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _base(hint: Any) -> Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    base = args[0] if typing.get_origin(hint) is typing.Union and args else hint
    return typing.get_origin(base) or base


def coerce_setting(name: str, value: Any, fields: Optional[Dict[str, Any]] = None, strict: bool = False) -> Any:
    """``value`` of training setting ``name`` converted to the field's type; a :class:`GridError`
    saying what was expected when it does not fit (or when ``name`` is not a setting). ``strict``
    (a value from a grid file, which TOML types): a number or a true/false given as a string is
    refused rather than converted, as any other value of the wrong type is (a number for a string
    setting is read as its text)."""
    from structinit.init.base import coerce

    fields = fields if fields is not None else settable_fields()
    if name in LAUNCHER_FIELDS:
        raise GridError(f"'{name}' is set by the launcher, not by the grid"
                        + (" (use seeds / --seeds)" if name == "seed" else " (use --out)" if name == "out" else ""))
    if name not in fields:
        raise GridError(f"unknown setting {name!r}{suggest(name, list(fields))}")
    base = _base(fields[name])
    if strict and isinstance(value, str) and base in (bool, int, float):
        raise GridError(f"'{name}' must be {_kind(fields[name])}, got {value!r} (write it without quotes)")
    try:
        return coerce("training", name, value, fields[name])
    except UsageError:
        raise GridError(f"'{name}' must be {_kind(fields[name])}, got {value!r}") from None


# --------------------------------------------------------------------------- the spec

@dataclass(frozen=True)
class AxisValue:
    """One value of an axis: ``id`` (names it in files and on the command line), ``label`` (in
    tables), the training ``settings`` it sets, and the file line it was read from."""

    id: str
    label: str
    settings: Dict[str, Any]
    line: Optional[int] = None


@dataclass(frozen=True)
class Axis:
    name: str
    values: Tuple[AxisValue, ...]

    def value(self, id: str) -> AxisValue:
        for v in self.values:
            if v.id == id:
                return v
        raise GridError(f"axis {self.name!r} has no value {id!r}; it has {', '.join(v.id for v in self.values)}")


@dataclass
class GridSpec:
    """A parsed grid file (see the module docstring). ``source`` says where it came from."""

    name: str
    title: str
    source: str
    axes: Tuple[Axis, ...]
    rows: str
    columns: Tuple[str, ...]
    seeds: Sequence[int] = (0,)  # a range when there are many (see LAZY_SEEDS)
    settings: Dict[str, Any] = field(default_factory=dict)
    baseline: Optional[str] = None
    description: str = ""
    paper_source: Optional[str] = None
    paper_note: Optional[str] = None
    paper: Dict[str, List[Optional[float]]] = field(default_factory=dict)

    def axis(self, name: str) -> Axis:
        for a in self.axes:
            if a.name == name:
                return a
        raise GridError(f"unknown axis {name!r}{suggest(name, [a.name for a in self.axes])}; the grid's axes are "
                        f"{', '.join(a.name for a in self.axes)}")

    @property
    def row_axis(self) -> Axis:
        return self.axis(self.rows)

    @property
    def column_axes(self) -> Tuple[Axis, ...]:
        return tuple(self.axis(c) for c in self.columns)

    def column_cells(self) -> List[Tuple[AxisValue, ...]]:
        """Every column of the report: one value of each column axis (first axis outermost)."""
        return list(product(*(a.values for a in self.column_axes))) if self.columns else [()]

    @property
    def cells(self) -> int:
        """How many cells (counted, not listed: a grid of a million cells costs nothing to count)."""
        return math.prod([len(self.row_axis.values)] + [len(a.values) for a in self.column_axes])

    @property
    def runs(self) -> int:
        return self.cells * len(self.seeds)

    def summary(self) -> Dict[str, Any]:
        return {"name": self.name, "title": self.title, "source": self.source, "rows": self.rows,
                "columns": list(self.columns), "axes": {a.name: [v.id for v in a.values] for a in self.axes},
                "seeds": list(self.seeds), "cells": self.cells, "runs": self.runs, "paper": self.paper_source}


