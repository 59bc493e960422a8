"""What an init did, as a typed record: :class:`InitReport`, returned by
:meth:`~structinit.init.base.InitSpec.write`/``apply``, :func:`~structinit.init.initialize.initialize`
and :func:`~structinit.init.initialize.initialize_model`.

Code that runs an init reads its fields (``report.layers[0].hit_rate``, ``report.fit``,
``report.structure``, ``report.changed``); a method's own values (what no other method has: impulse's
artifact, mimetic's parameters) are in one declared place, ``extra``. :meth:`InitReport.to_dict` gives
the JSON layout written into run folders (``config.json``'s ``init_report``), checkpoints and
``apply``'s output, the same as before the report was typed; :meth:`InitReport.from_dict` reads it
back, checking the type of every field. A report is also a read-only mapping over that layout
(``report["layers"]``), for code written against the dict.

Example::

    report = initialize_model(model, "impulse")
    report.changed                       # every tensor the init changed, read from the tensors
    [row.hit_rate for row in report.layers]
    report.structure.offsets[0]          # layer 0's impulse offsets [heads, 2] (None: no structure)
    report.to_dict()                     # the JSON form
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping as MappingABC
from dataclasses import dataclass, field
from typing import (
    TYPE_CHECKING,
    Any,
    ClassVar,
    Dict,
    Iterator,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    Type,
    TypeVar,
    Union,
)

_R = TypeVar("_R", bound="Record")
#: Field names that are not keys of the JSON layout.
_BOOKKEEPING = ("extra", "order")


def _plain(value: Any) -> Any:
    """``value`` as JSON-able data: records as their :meth:`Record.to_dict`, lists and dicts copied."""
    if isinstance(value, Record):
        return value.to_dict()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _fits(value: Any, hint: Any) -> bool:
    """Whether ``value`` is of type ``hint`` (``Optional``, ``List``, ``Dict``, ``Any``, a record, a
    plain type; an int passes as a float, a bool never as a number)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin is Union:
        return any(_fits(value, a) for a in args)
    if hint is type(None):
        return value is None
    if origin in (list, List):
        return isinstance(value, list) and all(_fits(v, args[0]) for v in value) if args else isinstance(value, list)
    if origin in (dict, Dict):
        return isinstance(value, dict) and (not args or all(_fits(k, args[0]) and _fits(v, args[1])
                                                            for k, v in value.items()))
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


_HINTS: Dict[type, Dict[str, Any]] = {}


def _hints(cls: type) -> Dict[str, Any]:
    """``typing.get_type_hints(cls)``, once per record class."""
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def layers_line(name: str, values: Sequence[Optional[float]]) -> str:
    """``"hit rate 0.91 0.88 (mean 0.90)"``: ``name`` and a value per layer (``None`` left out; ``""``
    when none is left)."""
    given = [float(v) for v in values if v is not None]
    if not given:
        return ""
    return f"{name} " + " ".join(f"{v:.2f}" for v in given) + f" (mean {sum(given) / len(given):.2f})"


class Record:
    """A typed part of a report: declared fields, the rest of its JSON object in ``extra``, and
    ``order`` (the keys as they came, so :meth:`to_dict` writes them back in that order). A field
    is written when it came in the dict read, or when it was set to other than its default."""

    #: JSON key of a field, where it is not the field's name.
    json_keys: ClassVar[Dict[str, str]] = {}
    #: Fields that are a view of others, not keys of the JSON layout.
    derived: ClassVar[Tuple[str, ...]] = ()
    if TYPE_CHECKING:  # every record is a dataclass that declares these two last, with their defaults
        __dataclass_fields__: ClassVar[Dict[str, dataclasses.Field]]
        extra: Dict[str, Any]
        order: Tuple[str, ...]

        def __init__(self, **fields: Any) -> None: ...

    @classmethod
    def _fields(cls) -> Dict[str, dataclasses.Field]:
        """JSON key -> field, for every field the layout holds."""
        return {cls.json_keys.get(f.name, f.name): f for f in dataclasses.fields(cls)
                if f.name not in _BOOKKEEPING and f.name not in cls.derived}

    @classmethod
    def _read(cls, name: str, value: Any) -> Any:
        """A JSON value of field ``name`` as the field holds it (a subclass reads its nested records)."""
        return value

    @classmethod
    def from_dict(cls: Type[_R], d: Mapping[str, Any]) -> _R:
        """The record of a JSON object (:meth:`to_dict`'s layout); :class:`ValueError` naming the
        field whose value is not of its declared type."""
        if not isinstance(d, MappingABC):
            raise ValueError(f"{cls.__name__} must be read from a JSON object, got {type(d).__name__}")
        fields = cls._fields()
        values: Dict[str, Any] = {}
        extra: Dict[str, Any] = {}
        for key, value in d.items():
            f = fields.get(key)
            if f is None:
                extra[key] = value
            else:
                values[f.name] = cls._read(f.name, value)
        missing = [f.name for f in fields.values()
                   if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                   and f.name not in values]
        if missing:
            raise ValueError(f"{cls.__name__} needs {', '.join(missing)}")
        out = cls(**values, extra=extra, order=tuple(d))
        out.check()
        return out

    def check(self) -> None:
        """:class:`ValueError` naming the first field (nested ones too) not of its declared type."""
        hints = _hints(type(self))
        for f in dataclasses.fields(self):
            if f.name == "order":
                continue
            value = getattr(self, f.name)
            if not _fits(value, hints[f.name]):
                raise ValueError(f"{type(self).__name__}.{f.name} must be {hints[f.name]}, got {value!r}")
            for part in value if isinstance(value, list) else [value]:
                if isinstance(part, Record):
                    part.check()

    def _written(self, f: dataclasses.Field, key: str) -> bool:
        if key in self.order:
            return True
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        return getattr(self, f.name) != default

    def holds(self, name: str) -> bool:
        """Whether :meth:`to_dict` writes field ``name`` (``None`` included: a method that reports a
        data fit writes ``data_fit: null`` when its fit is off)."""
        fields = {f.name: (key, f) for key, f in self._fields().items()}
        key, f = fields[name]
        return self._written(f, key)

    def to_dict(self) -> Dict[str, Any]:
        """The JSON object: the keys read in their order, then fields set since, then ``extra``'s new keys."""
        fields = self._fields()
        extra = self.extra
        out: Dict[str, Any] = {}
        for key in [*self.order, *fields, *extra]:
            if key in out:
                continue
            f = fields.get(key)
            if f is not None:
                if self._written(f, key):
                    out[key] = _plain(getattr(self, f.name))
            elif key in extra:
                out[key] = _plain(extra[key])
        return out


@dataclass
class LayerRow(Record):
    """One attention layer an init wrote: its index, the tensors it ``replaced`` (keys with row
    ranges), and where the method measures them the impulse ``offsets`` (``[heads, 2]``, ``(dy, dx)``)
    and the attention's ``hit_rate``/``target_mass``/``mse`` (means over heads)."""

    layer: int
    replaced: List[str] = field(default_factory=list)
    offsets: Optional[List[List[int]]] = None
    hit_rate: Optional[float] = None
    target_mass: Optional[float] = None
    mse: Optional[float] = None
    extra: Dict[str, Any] = field(default_factory=dict)
    order: Tuple[str, ...] = field(default=(), repr=False, compare=False)


@dataclass
class FitRecord(Record):
    """What a data fit did (the report's ``data_fit``): the ``inputs`` it ran on (``"data"`` or
    ``"noise"``), how many (``samples``), where they came from (``source``, words), or why it did not
    run (``skipped``, words); impulse's also the fit's ``version``, ``seconds``, per-layer
    attention on the fitted inputs (``layers``, on the first ``measured_on`` of them), their means and
    the fitted ``artifact`` (``key``, ``path``, ``cached``). ``default_inputs``: it ran on noise
    because no inputs were given."""

    inputs: Optional[str] = None
    samples: Optional[int] = None
    source: Optional[str] = None
    skipped: Optional[str] = None
    seconds: Optional[float] = None
    version: Optional[int] = None
    default_inputs: Optional[bool] = None
    measured_on: Optional[int] = None
    layers: Optional[List[Dict[str, Any]]] = None
    hit_rate: Optional[float] = None
    target_mass: Optional[float] = None
    artifact: Optional[Dict[str, Any]] = None
    extra: Dict[str, Any] = field(default_factory=dict)
    order: Tuple[str, ...] = field(default=(), repr=False, compare=False)

    @property
    def measured_count(self) -> Optional[int]:
        """How many inputs the per-layer attention was measured on (``measured_on``, else ``samples``)."""
        return self.measured_on if self.measured_on is not None else self.samples


@dataclass(frozen=True)
class StructureRecord:
    """The impulse structure an init wrote, where it wrote one: per layer the offsets
    (``{layer: [[dy, dx], ...]}``, a head each) on ``grid``, the solve's ``filter`` (``None``: not
    said), ``padding`` and whether the offsets are ``causal``; ``artifact``: the key of the solve's
    artifact (``None``: none)."""

    grid: List[int]
    offsets: Dict[int, List[List[int]]]
    padding: str = "zero"
    filter: Optional[int] = None
    causal: bool = False
    artifact: Optional[str] = None


def _structure(d: Mapping[str, Any], layers: List[LayerRow]) -> Optional[StructureRecord]:
    """The structure a report's layout holds: offsets in every layer row and a ``grid``; the solve's
    settings from its artifact's ``config`` (impulse, impulse-2024) or the report itself
    (impulse-2025, which solves without one)."""
    grid = d.get("grid")
    if not layers or not isinstance(grid, list) or any(row.offsets is None for row in layers):
        return None
    art = d.get("artifact")
    solved: Mapping[str, Any] = d
    if isinstance(art, dict) and isinstance(art.get("config"), dict):
        solved = art["config"]
    filt = solved.get("filter")
    return StructureRecord(grid=[int(g) for g in grid], offsets={row.layer: row.offsets for row in layers
                                                                 if row.offsets is not None},
                           padding=str(solved.get("padding", "zero")),
                           filter=int(filt) if isinstance(filt, int) else None,
                           causal=bool(solved.get("causal", False)),
                           artifact=art.get("key") if isinstance(art, dict) else None)


@dataclass
class InitReport(Record, MappingABC):
    """What an init did (see the module docstring): its ``method``, the ``layers`` it wrote (a
    :class:`LayerRow` each), the ``changed`` tensors (names, read from the tensors by
    :func:`~structinit.init.changes.changed`; ``None`` until the caller compares), the data ``fit``
    (:class:`FitRecord`, JSON ``data_fit``), the impulse ``structure`` (:class:`StructureRecord`, a
    view of the layout: grid, offsets and solve settings), the means ``hit_rate``/``target_mass``
    and what they were ``measured_on``, the position table written (``pos_embed_written``, words),
    ``data_source`` (the inputs of a checkpoint's fit), ``data_attention`` (``train``'s measure on
    real inputs at init), ``base_note`` (the line on the weights kept), and the method's own values
    (``extra``)."""

    json_keys: ClassVar[Dict[str, str]] = {"fit": "data_fit"}
    derived: ClassVar[Tuple[str, ...]] = ("structure",)

    method: str
    grid: Optional[List[int]] = None
    layers: List[LayerRow] = field(default_factory=list)
    hit_rate: Optional[float] = None
    target_mass: Optional[float] = None
    measured_on: Optional[str] = None
    pos_embed_written: Optional[str] = None
    fit: Optional[FitRecord] = None
    data_source: Optional[str] = None
    data_attention: Optional[Dict[str, Any]] = None
    changed: Optional[List[str]] = None
    base_note: Optional[str] = None
    structure: Optional[StructureRecord] = None
    extra: Dict[str, Any] = field(default_factory=dict)
    order: Tuple[str, ...] = field(default=(), repr=False, compare=False)

    @classmethod
    def _read(cls, name: str, value: Any) -> Any:
        if name == "layers" and isinstance(value, list):
            return [LayerRow.from_dict(row) for row in value]
        if name == "fit" and isinstance(value, MappingABC):
            return FitRecord.from_dict(value)
        return value

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "InitReport":
        """As :meth:`Record.from_dict`, with the :attr:`structure` the layout holds."""
        out = super().from_dict(d)
        out.structure = _structure(d, out.layers)
        return out

    @property
    def fit_ran(self) -> bool:
        """Whether a data fit ran (a :attr:`fit` that was not ``skipped``)."""
        return self.fit is not None and self.fit.skipped is None

    # ---- the read-only mapping over the JSON layout, for code written against the dict

    def __getitem__(self, key: str) -> Any:
        return self.to_dict()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_dict())

    def __len__(self) -> int:
        return len(self.to_dict())

    def __contains__(self, key: object) -> bool:
        return key in self.to_dict()

    def __eq__(self, other: object) -> bool:
        """Against a report: the same fields; against a mapping (code written against the dict): the
        same JSON layout."""
        if isinstance(other, InitReport):
            return self.to_dict() == other.to_dict() and self.structure == other.structure
        if isinstance(other, MappingABC):
            return self.to_dict() == dict(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]



__all__ = ["InitReport", "LayerRow", "FitRecord", "StructureRecord", "Record", "layers_line"]
