"""Init methods by name: the registry of typed specs and the one ``NAME=VALUE`` parser (the entry
points that initialize a model or a state dict with a spec are in :mod:`structinit.init.initialize`).

========================  =========================================================================
``kaiming``               PyTorch's default ``nn.Linear``/``Conv`` init (Kaiming uniform, a=sqrt 5)
``trunc-normal``          timm's default: Linear weights trunc-normal std 0.02, biases zero
``mimetic``               ``W_Q W_K^T ~ a1 Z1 + b1 I`` per head, ``W_V W_proj ~ a2 Z2 - b2 I`` per layer
``impulse``               Q/K solved so each head's attention starts as an impulse filter
``impulse-2024``          the authors' released 2024 code exactly (:mod:`structinit.init.authors`)
``impulse-2025``          the authors' 2025 closed form exactly (:mod:`structinit.init.authors`)
``conditioned``           Q/K semi-orthogonal and V the identity per head (:mod:`structinit.init.conditioned`)
``mixed``                 two methods in one model, split by depth and head (:mod:`structinit.init.mixed`)
========================  =========================================================================

Example::

    spec = init_spec("impulse", filter=5, target_mass=0.5)         # from Python
    spec = parse_init("impulse", ["filter=5", "target_mass=0.5"])  # from NAME=VALUE text
    report = initialize_model(model, spec)   # (structinit.init.initialize) or "impulse" with filter=5
    spec.to_dict()  # {"method": "impulse", "params": {... every parameter ...}}
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Iterable, List, Mapping, Tuple, Type, TypeVar, Union, overload

from structinit.errors import UsageError, param
from structinit.init import authors, baselines, conditioned, impulse, mimetic, mixed
from structinit.init.base import REGISTERED, InitSpec, parse_value

#: The modules of the built-in methods, in the order the docs and messages list their methods (each
#: registers its own with :func:`~structinit.init.base.register` when imported).
BUILTIN_MODULES = (baselines, mimetic, impulse, authors, conditioned, mixed)


def _builtins_first() -> None:
    """Order :data:`INIT_METHODS` as :data:`BUILTIN_MODULES` lists the modules (the methods of one
    module in the order they were registered), whatever order the modules were imported in; a method
    registered later (a plugin's, a test's) comes after them."""
    modules = [m.__name__ for m in BUILTIN_MODULES]
    seen = list(REGISTERED)

    def rank(name: str) -> Tuple[int, int]:
        module = REGISTERED[name].__module__
        return (modules.index(module) if module in modules else len(modules)), seen.index(name)

    ordered = [(name, REGISTERED[name]) for name in sorted(seen, key=rank)]
    REGISTERED.clear()
    REGISTERED.update(ordered)


#: The entry-point group through which another installed package adds init methods: each entry
#: point names a module (``mypkg.inits``) whose import registers its methods with
#: :func:`~structinit.init.base.register`, e.g. in its pyproject.toml::
#:
#:     [project.entry-points."structinit.inits"]
#:     my-init = "mypkg.inits"
ENTRY_POINT_GROUP = "structinit.inits"


#: Plugins that failed to load, in words, not yet said (the first lookup of a method warns of each once).
_PLUGIN_FAILURES: List[str] = []


def _load_plugins() -> None:
    """Import every module of :data:`ENTRY_POINT_GROUP` (its methods register as it loads); one that
    fails to load is left out, never breaking the built-in methods, and named in a warning at the
    first lookup of a method (:func:`spec_class`), where the caller shows warnings its way."""
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            ep.load()
        except Exception as exc:  # noqa: BLE001 - another package's failure is reported, not raised
            _PLUGIN_FAILURES.append(f"init plugin {ep.name} ({ep.value}) was not loaded: {type(exc).__name__}: {exc}")


_load_plugins()
_builtins_first()
#: Registered init methods: name -> spec class (the built-in ones, then any registered later).
INIT_METHODS: Dict[str, Type[InitSpec]] = REGISTERED


def fitting_methods() -> str:
    """The methods with a data fit (:attr:`~structinit.init.base.InitSpec.fits_data`), in words: what
    a refusal of inputs names."""
    return " / ".join(name for name, cls in INIT_METHODS.items() if cls.fits_data)


def methods_with(name: str) -> List[str]:
    """The registered methods whose spec has parameter ``name`` (e.g. ``"filter"``), in the
    registry's order: what a command's alias of that parameter applies to."""
    return [method for method, cls in INIT_METHODS.items() if name in {f.name for f in dataclasses.fields(cls)}]


def spec_class(method: str) -> Type[InitSpec]:
    """The spec class registered as ``method``."""
    while _PLUGIN_FAILURES:
        import warnings

        from structinit.errors import StructinitWarning

        warnings.warn(StructinitWarning(_PLUGIN_FAILURES.pop(0)), stacklevel=2)
    if method not in INIT_METHODS:
        raise UsageError(f"unknown init method {method!r}; {param('init')} takes one of {', '.join(INIT_METHODS)}")
    return INIT_METHODS[method]


_Spec = TypeVar("_Spec", bound=InitSpec)


@overload
def init_spec(method: _Spec, **params: Any) -> _Spec: ...


@overload
def init_spec(method: str, **params: Any) -> InitSpec: ...


def init_spec(method: Union[str, InitSpec], **params: Any) -> InitSpec:
    """The typed spec of ``method`` with ``params`` (``-`` in names is read as ``_``); an unknown
    parameter or a value of the wrong type is a :class:`UsageError` naming it. A spec given with
    ``params`` is copied with them replaced."""
    given = {k.replace("-", "_"): v for k, v in params.items()}
    cls = type(method) if isinstance(method, InitSpec) else spec_class(method)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(given) - set(names))
    if unknown:
        takes = ", ".join(names) if names else "no parameters"
        raise UsageError(f"init method {cls.method!r} has no parameter {', '.join(param(u) for u in unknown)} "
                         f"(it takes: {takes})")
    if isinstance(method, InitSpec):
        return dataclasses.replace(method, **given) if given else method
    return cls(**given)


def parse_assignments(items: Iterable[str], what: str = "init_params") -> Dict[str, Any]:
    """``["filter=5", "share=true"]`` -> ``{"filter": 5, "share": True}`` (values as in
    :func:`~structinit.init.base.parse_value`; ``-`` in names becomes ``_``); ``what`` names the
    parameter in errors. A name given twice is refused naming both values (never the last one kept)."""
    out: Dict[str, Any] = {}
    seen: Dict[str, str] = {}
    for item in items:
        name, sep, value = str(item).partition("=")
        name = name.strip().replace("-", "_")
        if not sep or not name:
            raise UsageError(f"{param(what)} must look like NAME=VALUE, got {item!r}")
        if name in seen:
            raise UsageError(f"{param(what)} sets {name} twice ({seen[name]}, {item}); give it once")
        seen[name] = str(item)
        out[name] = parse_value(value)
    return out


def parse_init(method: str, items: Iterable[str] = ()) -> InitSpec:
    """The spec of ``method`` from ``NAME=VALUE`` strings (the CLI's ``--init-param`` form)."""
    return init_spec(method, **parse_assignments(items))


def spec_from_dict(d: Mapping[str, Any]) -> InitSpec:
    """Inverse of :meth:`InitSpec.to_dict`."""
    return init_spec(d["method"], **dict(d.get("params") or {}))
