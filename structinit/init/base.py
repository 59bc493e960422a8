"""The base of every init spec: a frozen dataclass of one method's parameters that knows how to
check them, serialize them, and write them into an :class:`~structinit.init.attention_target.AttentionTarget`.

Parameter values may come from Python (``filter=5``) or from text (``"5"``, the CLI's
``NAME=VALUE``): :func:`coerce` converts them to the field's declared type and rejects what does
not fit, naming the parameter.
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Dict, List, Tuple, Union

from structinit.errors import UsageError, param

if TYPE_CHECKING:
    import os

    from structinit.init.attention_target import AttentionTarget
    from structinit.init.layouts import AttnSlot


def parse_value(text: str) -> Any:
    """A ``NAME=VALUE`` value as Python: ``true``/``false``, ``none``/``null``, JSON numbers, lists
    and objects; anything else stays a string."""
    stripped = text.strip()
    low = stripped.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    try:
        return json.loads(stripped)
    except ValueError:
        return stripped


def coerce(owner: str, name: str, value: Any, hint: Any) -> Any:
    """``value`` converted to type ``hint`` (``bool``, ``int``, ``float``, ``str``, ``dict``,
    ``Optional[...]``); :class:`UsageError` naming ``owner``'s parameter ``name`` if it does not fit."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Union:
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return coerce(owner, name, value, inner[0])

    def bad(what: str) -> UsageError:
        return UsageError(f"{owner} parameter {param(name)} must be {what}, got {value!r}")

    if isinstance(value, str) and hint in (bool, int, float, dict):
        value = parse_value(value)
    if hint is bool:
        if not isinstance(value, bool):
            raise bad("true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not float(value).is_integer():
            raise bad("an integer")
        return int(value)
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad("a number")
        if not math.isfinite(value):
            raise bad("a finite number")
        return float(value)
    if hint is str:
        if isinstance(value, (dict, list)) or value is None:
            raise bad("a string")
        return str(value)
    if origin in (dict, Dict) or hint is dict:
        if not isinstance(value, dict):
            raise bad("a JSON object such as {\"iters\": 2000}")
        return dict(value)
    return value


def _copy(value: Any) -> Any:
    return dict(value) if isinstance(value, dict) else list(value) if isinstance(value, list) else value


_HINTS: Dict[type, Dict[str, Any]] = {}


def _type_hints(cls: type) -> Dict[str, Any]:
    """``typing.get_type_hints(cls)``, once per spec class: resolving the annotations' strings is
    the most of a spec's construction (a grid of thousands of runs builds one per run)."""
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    return hints


@dataclass(frozen=True)
class InitSpec:
    """One init method's parameters. Subclasses set ``method`` (the registered name), ``writes``
    (which tensors it changes, in words) and ``needs_grid``, and implement :meth:`apply`."""

    method: ClassVar[str] = ""
    writes: ClassVar[str] = ""
    needs_grid: ClassVar[bool] = False
    #: Parameters added after run keys were in use: :meth:`to_dict` leaves them out at their
    #: defaults, so the keys of runs made before them stay valid.
    optional_defaults: ClassVar[Tuple[str, ...]] = ()
    #: Of those, the ones whose default has changed since: name -> the value :meth:`to_dict` leaves
    #: out (the old default), so an old run keeps its key and the new default gets a key of its own.
    legacy_defaults: ClassVar[Dict[str, Any]] = {}
    #: What every weight the method does not write starts from, for a method without a ``base``
    #: parameter (one of :data:`~structinit.init.baselines.BASES`).
    fixed_base: ClassVar[str] = "model"

    @property
    def other_weights(self) -> str:
        """The base of every weight this init does not write (its ``base`` parameter, else
        :attr:`fixed_base`): ``model`` (as built: timm's trunc normal 0.02), ``pytorch`` (PyTorch's
        defaults), ``pytorch-mlp`` or ``pytorch-head``. Reports compare inits on the same base."""
        return str(getattr(self, "base", self.fixed_base))

    @property
    def uses_data(self) -> bool:
        """Whether :meth:`apply` needs a batch of real inputs (``data``)."""
        return False

    def without_fit(self) -> InitSpec:
        """This spec with its data fit off (what a resumed run re-applies besides the weights); a
        spec that does not :attr:`use data <uses_data>` is that already."""
        return self

    def __post_init__(self) -> None:
        hints = _type_hints(type(self))
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, coerce(self.method, f.name, getattr(self, f.name), hints[f.name]))
        self.validate()

    def validate(self) -> None:
        """Check combinations and ranges of the parameters (types are already checked)."""

    def params(self) -> Dict[str, Any]:
        """Every parameter, defaults included (containers copied)."""
        return {f.name: _copy(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def algorithms(self) -> Dict[str, int]:
        """The versions of the algorithms this init computes with (a solver recipe, the data fit):
        ``{name: version}``, empty for an init that computes nothing of structinit's own."""
        return {}

    def to_dict(self) -> Dict[str, Any]:
        """``{"method": NAME, "params": {...}}``: the spec as one axis value of a comparison grid;
        with ``"algorithms"`` where one of :meth:`algorithms` is past version 1 (run keys made
        before versions existed are version 1, and keep their keys)."""
        params = self.params()
        for f in dataclasses.fields(self):
            if f.name in self.optional_defaults and params[f.name] == self.legacy_defaults.get(f.name, f.default):
                del params[f.name]
        out = {"method": self.method, "params": params}
        newer = {name: v for name, v in self.algorithms().items() if v != 1}
        if newer:
            out["algorithms"] = newer
        return out

    def canonical_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def planned(self, slot: AttnSlot) -> List[str]:
        """What the method replaces in one attention layer (keys with row ranges)."""
        from structinit.init.inject import label

        return [label(p) for p in (slot.q, slot.k, slot.q_bias, slot.k_bias) if p is not None]

    def check_target(self, target: AttentionTarget) -> None:
        """Raise :class:`UsageError` if the method cannot be applied to ``target`` as it is (called
        before anything is solved or written; the default accepts every target)."""

    def apply(self, target: AttentionTarget, *, seed: int = 0, cache_dir: Union[str, os.PathLike, None] = None,
              device: str = "cpu") -> Dict[str, Any]:
        """Write the initialization into ``target`` (an :class:`~structinit.init.attention_target.AttentionTarget`)
        and return a JSON-able report."""
        raise NotImplementedError

    def check_positive(self, *names: str, allow_zero: bool = False) -> None:
        for name in names:
            value = getattr(self, name)
            if value is not None and (value < 0 or (value == 0 and not allow_zero)):
                need = "non-negative" if allow_zero else "positive"
                raise UsageError(f"{self.method} parameter {param(name)} must be {need}, got {value!r}")
