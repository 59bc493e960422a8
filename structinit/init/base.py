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
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Dict, List, Optional, Tuple, Type, TypeVar, Union

from structinit.errors import UsageError, param

if TYPE_CHECKING:
    import os

    from structinit.init.attention_target import AttentionTarget
    from structinit.init.layouts import AttnSlot
    from structinit.init.report import InitReport


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
_S = TypeVar("_S", bound="InitSpec")


def _type_hints(cls: type) -> Dict[str, Any]:
    """``typing.get_type_hints(cls)``, once per spec class: resolving the annotations' strings is
    the most of a spec's construction (a grid of thousands of runs builds one per run)."""
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    return hints


#: The init ``apply`` writes unless told: the one that wins (docs/results).
DEFAULT_METHOD = "impulse"
#: Every registered init method: name -> spec class, filled by :func:`register` as the method
#: modules are imported (:mod:`structinit.init.registry` imports the built-in ones and is where
#: callers look methods up).
REGISTERED: Dict[str, Type["InitSpec"]] = {}


def register(cls: Type[_S]) -> Type[_S]:
    """Class decorator that registers an :class:`InitSpec` subclass under its ``method`` name (as
    timm's ``@register_model`` registers a model), so that ``init_spec(name)``, ``--init name``
    and a grid's ``init = "name"`` find it. A method lives in one module: its parameters, its
    refusals and its steps (the hooks below); nothing else names it."""
    if not cls.method:
        raise TypeError(f"{cls.__name__} has no method name")
    has_base = any(f.name == "base" for f in dataclasses.fields(cls))
    if has_base != cls.has_base:
        raise TypeError(f"{cls.__name__} {'has' if has_base else 'has no'} base parameter but declares "
                        f"has_base = {cls.has_base}")
    if cls.fits_data and cls.without_fit is InitSpec.without_fit:
        raise TypeError(f"{cls.__name__} fits data (fits_data) but does not override without_fit: a resumed run "
                        "would fit again, on noise")
    known = REGISTERED.get(cls.method)
    if known is not None and known.__qualname__ != cls.__qualname__:
        raise ValueError(f"init method {cls.method!r} is registered twice ({known.__qualname__}, {cls.__qualname__})")
    REGISTERED[cls.method] = cls
    return cls


@dataclass(frozen=True)
class InitWarning:
    """A line an init's caller shows the user after the init (``text``, parameters marked with
    :func:`~structinit.errors.param`). ``loggable``: it may go to the caller's ``log`` (``train``'s
    run log) instead of a :class:`~structinit.errors.StructinitWarning`; ``warning``: a log writes it
    after ``warning:`` (a caution, not a note)."""

    text: str
    loggable: bool = True
    warning: bool = False


@dataclass(frozen=True)
class InitSpec:
    """One init method's parameters and steps. Subclasses set ``method`` (the registered name, see
    :func:`register`), ``writes`` (which tensors it changes, in words) and ``needs_grid``, and
    implement :meth:`write`; every other hook has a default that does nothing, so code that runs an
    init calls the hooks and never asks which method it runs:

    ========================  ===================================================================
    ``uses_data``             whether :meth:`prepare` fits to a batch of inputs (``data``), with
                              ``fit_samples``/``with_fit_samples`` (how many) and ``fit_off``
    ``check_target``          refuse a target the method cannot write (before any work)
    ``writes_every_layer``    whether it must write every layer (cannot write a selection)
    ``check_shape``           refuse settings that cannot be solved for a shape (before any work)
    ``check_pos_embed``       refuse a position embedding the method cannot use as it is
    ``replaces_pos_embed``    whether it writes the sin-cos table in place of the target's own
    ``presolves``             the solves a launcher can make before its runs start
    ``prepare``               what :meth:`write` writes: solved, fitted (the slow part), or nothing
    ``write``                 write into the target and return the report (:class:`~structinit.init.report.InitReport`)
    ``write_copy``            write into one more copy of a model (a checkpoint's EMA) alike
    ``warnings``              the lines a caller shows after the init (a weak fit, noise inputs)
    ``notes``                 the lines a command shows beside the result it prints
    ``summary``               the lines a command prints of what the init did (its fit, its attention)
    ``without_fit``           the spec that rebuilds what it set besides the weights (a resume);
                              a method that :attr:`fits_data` must override it (:func:`register` checks)
    ``is_causal``             whether it solves offsets under a decoder's causal mask
    ========================  ===================================================================

    ``has_base`` declares a ``base`` parameter (what the weights it does not write start from):
    ``train`` sets it to its own default unless given, ``apply`` refuses any but ``model``.
    """

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
    #: Whether the report gives each layer's impulse offsets (its :attr:`~structinit.init.report.InitReport.structure`),
    #: the ``grid`` and the attention measured on them: ``train`` then measures the attention at init
    #: on real inputs against those offsets, and ``apply`` reports them as they are (for any other
    #: method it measures the written weights itself).
    reports_offsets: ClassVar[bool] = False
    #: Whether the method has a data fit (run when :attr:`uses_data`): what ``apply --data`` is for.
    fits_data: ClassVar[bool] = False
    #: Whether the method runs on the model itself, not a state dict (it resets modules): ``apply``
    #: builds the model the checkpoint describes, initializes it, and writes its weights back.
    needs_model: ClassVar[bool] = False
    #: Whether the spec has a ``base`` parameter (one of :data:`~structinit.init.baselines.BASES`):
    #: :func:`register` checks the declaration against the fields.
    has_base: ClassVar[bool] = False

    @property
    def other_weights(self) -> str:
        """The base of every weight this init does not write (its ``base`` parameter, else
        :attr:`fixed_base`): ``model`` (as built: timm's trunc normal 0.02), ``pytorch`` (PyTorch's
        defaults), ``pytorch-mlp`` or ``pytorch-head``. Reports compare inits on the same base."""
        return str(self.params()["base"]) if self.has_base else self.fixed_base

    @property
    def uses_data(self) -> bool:
        """Whether :meth:`prepare` fits to a batch of real inputs (``data``; without one, it may fit
        to noise inputs of the model's input shape)."""
        return False

    @property
    def fit_samples(self) -> int:
        """How many inputs the fit reads at most (the first ones of ``data``; 0: it fits nothing)."""
        return 0

    def with_fit_samples(self, samples: int) -> InitSpec:
        """This spec with its fit reading at most ``samples`` inputs (no change for a method that fits nothing)."""
        return self

    def fit_off(self) -> str:
        """Why a spec of a method that :attr:`fits data <fits_data>` fits nothing here, in words for a
        refusal of inputs (``"data_fit is 0"``); ``""`` otherwise."""
        return ""

    def without_fit(self) -> InitSpec:
        """This spec with its data fit off (what a resumed run re-applies besides the weights); a
        spec that does not :attr:`use data <uses_data>` is that already. A method that
        :attr:`fits_data` overrides it (:func:`register` refuses one that does not)."""
        return self

    def is_causal(self) -> bool:
        """Whether the spec solves its offsets under a decoder's causal mask (the default: no)."""
        return False

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

    def writes_every_layer(self) -> bool:
        """Whether this init must write every attention layer of a model, whatever layers are
        selected (what it writes is read by all of them); the default writes the selected ones."""
        return False

    def check_shape(self, grid: Any, dim: int, heads: int, depth: int, seed: int = 0,
                    cache_dir: Union[str, os.PathLike, None] = None) -> None:
        """Raise :class:`UsageError` for settings that cannot be solved for a model of this shape, or
        a given artifact (looked up in ``cache_dir``) that does not fit it, before any work (the
        default: nothing is solved)."""

    def check_pos_embed(self, target: AttentionTarget) -> None:
        """Raise :class:`UsageError` when ``target``'s position embedding is not one this init can
        use as it is and will not replace (the default uses none)."""

    def replaces_pos_embed(self, target: AttentionTarget) -> bool:
        """Whether, asked nothing of the position embedding, this init writes the sin-cos table in
        place of ``target``'s own (a learned one); ``apply`` then writes it into the checkpoint's
        copies too, as on a model (the default: never)."""
        return False

    def presolves(self, shape: Callable[[], Tuple[Any, int, int, int]], seed: int = 0) -> List[Any]:
        """The :class:`~structinit.solver.config.SolveConfig` of every solve this init will ask for on a
        model of ``shape()`` (its ``(grid, dim, heads, depth)``, built on the first call) that a
        launcher can make into the cache before its runs start (the default: none)."""
        return []

    def prepare(self, target: AttentionTarget, *, seed: int = 0, cache_dir: Union[str, os.PathLike, None] = None,
                device: str = "cpu", data: Any = None, source: Optional[str] = None,
                progress: Optional[Callable[[int, int], None]] = None,
                fit_progress: Optional[Callable[[int, int], None]] = None,
                log: Optional[Callable[[str], None]] = None, stage: Optional[Callable[[str], None]] = None) -> Any:
        """Step 1: what :meth:`write` writes into ``target``, made before anything of the init is
        written (a solve, a fit to ``data``: the slow part). ``data``: a batch of real, normalized
        model inputs for a method that :attr:`uses_data` (``source`` says in words where it came
        from); without it, ``target.inputs`` (an :class:`~structinit.init.family.InputSpec`, what the
        model's family says one input is, ``None`` on a state dict) gives the shape of the noise
        inputs that stand for real ones; ``progress(done, total)`` follows a solve, ``fit_progress``
        a fit (raise from it to stop), ``log(message)`` hears the estimated time and per-layer lines,
        ``stage(words)`` names each stage as it starts. The default makes nothing (``None``)."""
        return None

    def write(self, target: AttentionTarget, prepared: Any = None, *, seed: int = 0,
              cache_dir: Union[str, os.PathLike, None] = None, device: str = "cpu") -> InitReport:
        """Step 2: write the init (with what :meth:`prepare` made) into ``target`` and return its
        :class:`~structinit.init.report.InitReport` (``layers``: a row per selected layer with the
        tensors it ``replaced``; the method's own values in ``extra``)."""
        raise NotImplementedError

    def apply(self, target: AttentionTarget, *, seed: int = 0, cache_dir: Union[str, os.PathLike, None] = None,
              device: str = "cpu", **prepare_args: Any) -> InitReport:
        """Write the initialization into ``target`` (an :class:`~structinit.init.attention_target.AttentionTarget`)
        and return its report: :meth:`prepare` (with ``prepare_args``), then :meth:`write`."""
        prepared = self.prepare(target, seed=seed, cache_dir=cache_dir, device=device, **prepare_args)
        return self.write(target, prepared, seed=seed, cache_dir=cache_dir, device=device)

    def write_copy(self, target: AttentionTarget, shared: Any, *, first: bool, seed: int = 0,
                   cache_dir: Union[str, os.PathLike, None] = None, device: str = "cpu",
                   progress: Optional[Callable[[int, int], None]] = None,
                   stage: Optional[Callable[[str], None]] = None) -> InitReport:
        """Write the init into one more copy of a model of a checkpoint (its weights, its EMA
        weights...) and return that copy's report: every copy gets the same weights. ``shared``: what
        :meth:`prepare` made on the model the checkpoint describes, or on its first copy (``first``:
        ``target`` is that first copy). The default writes ``shared`` as it is (:meth:`write`)."""
        return self.write(target, shared, seed=seed, cache_dir=cache_dir, device=device)

    def warnings(self, report: InitReport, target: AttentionTarget, *, checkpoint: bool = False,
                 pe_scale: Optional[float] = None) -> List[InitWarning]:
        """What the caller of :func:`~structinit.init.initialize.initialize` (or, ``checkpoint``,
        of ``apply_checkpoint``, with the ``pe_scale`` of the table it wrote) tells the user after
        this init wrote ``report`` into ``target`` (the default: nothing)."""
        return []

    def notes(self, report: InitReport) -> List[str]:
        """Lines (parameters marked) that a command shows beside the result it prints of ``report``:
        what was done other than the user may think (the default: none)."""
        return []

    def summary(self, report: InitReport, *, model: Optional[str] = None) -> List[str]:
        """The lines (parameters marked) a command prints of what the init did: what its data fit ran
        on, through ``model`` (words; ``None``: the model), and the attention it measured. The
        default: the fit's inputs or why it was skipped, and the hit rate per layer where the rows
        give one."""
        from structinit.init.report import layers_line

        lines = []
        fit = report.fit
        if fit is not None and fit.skipped is not None:
            lines.append(f"{self.method}: the data fit {fit.skipped}")
        elif fit is not None:
            count = f"{fit.samples} " if fit.samples is not None else ""
            kind = {"data": "real", "noise": "Gaussian noise"}.get(fit.inputs or "", fit.inputs or "given")
            lines.append(f"{self.method}: fitted through {model or 'the model'} on {count}{kind} inputs"
                         + (f" ({fit.source})" if fit.source else ""))
        hits = layers_line("hit rate", [row.hit_rate for row in report.layers])
        if hits:
            lines.append(f"attention on the position embedding alone: {hits}")
        return lines

    def check_positive(self, *names: str, allow_zero: bool = False) -> None:
        for name in names:
            value = getattr(self, name)
            if value is not None and (value < 0 or (value == 0 and not allow_zero)):
                need = "non-negative" if allow_zero else "positive"
                raise UsageError(f"{self.method} parameter {param(name)} must be {need}, got {value!r}")
