"""Init methods by name: the registry of typed specs, the one ``NAME=VALUE`` parser, and the
entry points that initialize a model or a state dict.

========================  =========================================================================
``kaiming``               PyTorch's default ``nn.Linear``/``Conv`` init (Kaiming uniform, a=sqrt 5)
``trunc-normal``          timm's default: Linear weights trunc-normal std 0.02, biases zero
``mimetic``               ``W_Q W_K^T ~ a1 Z1 + b1 I`` per head, ``W_V W_proj ~ a2 Z2 - b2 I`` per layer
``impulse``               Q/K solved so each head's attention starts as an impulse filter
``impulse-2024``          the authors' released 2024 code exactly (:mod:`structinit.init.authors`)
``impulse-2025``          the authors' 2025 closed form exactly (:mod:`structinit.init.authors`)
========================  =========================================================================

Example::

    spec = init_spec("impulse", filter=5, target_mass=0.5)         # from Python
    spec = parse_init("impulse", ["filter=5", "target_mass=0.5"])  # from NAME=VALUE text
    report = initialize_model(model, spec)                          # or initialize_model(model, "impulse", filter=5)
    spec.to_dict()  # {"method": "impulse", "params": {... every parameter ...}}
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Sequence, Type, Union

from structinit.errors import StructinitWarning, UsageError, param
from structinit.init.authors import Impulse2024Init, Impulse2025Init
from structinit.init.base import InitSpec, parse_value
from structinit.init.baselines import KaimingInit, TruncNormalInit
from structinit.init.impulse import ImpulseInit
from structinit.init.mimetic import MimeticInit

#: Registered init methods: name -> spec class.
INIT_METHODS: Dict[str, Type[InitSpec]] = {cls.method: cls for cls in (KaimingInit, TruncNormalInit, MimeticInit,
                                                                       ImpulseInit, Impulse2024Init, Impulse2025Init)}

#: Methods whose report gives the impulse offsets of every layer (``report["layers"][i]["offsets"]``)
#: and the ``grid``, so the attention at init can be measured against them on real inputs.
IMPULSE_METHODS = ("impulse", "impulse-2024", "impulse-2025")


def spec_class(method: str) -> Type[InitSpec]:
    """The spec class registered as ``method``."""
    if method not in INIT_METHODS:
        raise UsageError(f"unknown init method {param('init')} {method!r}; choose one of {', '.join(INIT_METHODS)}")
    return INIT_METHODS[method]


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
    parameter in errors."""
    out: Dict[str, Any] = {}
    for item in items:
        name, sep, value = str(item).partition("=")
        name = name.strip().replace("-", "_")
        if not sep or not name:
            raise UsageError(f"{param(what)} must look like NAME=VALUE, got {item!r}")
        out[name] = parse_value(value)
    return out


def parse_init(method: str, items: Iterable[str] = ()) -> InitSpec:
    """The spec of ``method`` from ``NAME=VALUE`` strings (the CLI's ``--init-param`` form)."""
    return init_spec(method, **parse_assignments(items))


def spec_from_dict(d: Mapping[str, Any]) -> InitSpec:
    """Inverse of :meth:`InitSpec.to_dict`."""
    return init_spec(d["method"], **dict(d.get("params") or {}))


def initialize(target, spec: Union[str, InitSpec], *, grid=None, heads: Optional[int] = None,
               layers: Union[None, str, Sequence[int]] = None, seed: int = 0, cache_dir=None, device: str = "cpu",
               data=None, progress: Optional[Callable[[int, int], None]] = None,
               log: Optional[Callable[[str], None]] = None, source: Optional[str] = None,
               **params: Any) -> Dict[str, Any]:
    """Initialize a model or a state dict (written in place) with ``spec`` (a spec, or a method name
    with ``params``) and return the method's JSON-able report.

    ``grid``/``heads`` are needed only where the target does not tell; ``layers`` selects attention
    layers (``None``: all; a spec such as ``"0-3,5"`` or a list of indices). ``data``: a batch of
    real, normalized inputs for a method that fits to them (impulse, whose ``data_fit`` is on by
    default); the others do not use it. Without ``data`` the fit runs on Gaussian noise inputs of
    the model's input shape, and one line says so (to ``log``, else a
    :class:`~structinit.errors.StructinitWarning`); a state dict, which holds no model, gets the
    plain solve and a warning, as does a fit that leaves a layer hitting its offsets in under 0.9 of
    its inputs' rows. ``progress(done, total)``
    follows that fit step by step (raise from it to stop the fit), ``log(message)`` gets a line
    per fitted layer, and ``source`` (words) says where ``data`` came from, for the fitted artifact.
    """
    from structinit.init.target import AttentionTarget

    spec = init_spec(spec, **params)
    t = AttentionTarget(target, grid, heads, layers, need_grid=spec.needs_grid)
    spec.check_target(t)
    if not spec.uses_data:
        return spec.apply(t, seed=seed, cache_dir=cache_dir, device=device)
    report = spec.apply(t, seed=seed, cache_dir=cache_dir, device=device, data=data, fit_progress=progress, log=log,
                        source=source)
    from structinit.init.impulse import position_hint, structure_warning
    from structinit.init.impulse_write import noise_notice

    skipped = (report.get("data_fit") or {}).get("skipped")
    if skipped and t.model is not None:
        warnings.warn(StructinitWarning(f"{spec.method} {param('data_fit')} {skipped}"), stacklevel=3)
    notice = noise_notice(report)
    if notice and log is not None:
        log(StructinitWarning(notice).render())
    elif notice:
        warnings.warn(StructinitWarning(notice), stacklevel=3)
    hint = None
    if spec.method == "impulse" and not report.get("fit_pe") and t.model is not None and t.pos_key is not None:
        hint = position_hint(report.get("pe_scale"), checkpoint=False)
    weak = structure_warning(report, hint)
    if weak:
        warnings.warn(StructinitWarning(f"{spec.method}: {weak}"), stacklevel=3)
    return report


def initialize_model(model, spec: Union[str, InitSpec], *, grid=None, seed: int = 0, data=None,
                     progress: Optional[Callable[[int, int], None]] = None,
                     log: Optional[Callable[[str], None]] = None, source: Optional[str] = None,
                     **params: Any) -> Dict[str, Any]:
    """Initialize a timm-style model in place (``grid`` defaults to ``model.patch_embed.grid_size``)
    and return the report; ``data``: real inputs for a method that fits to them, ``progress``,
    ``log`` and ``source`` go with that fit (see :func:`initialize`). Example::

        model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=2,
                                  class_token=False, global_pool="avg", num_classes=10)
        set_sincos_pos_embed(model)
        report = initialize_model(model, "impulse", data=images[:256])  # fitted to real inputs
        report = initialize_model(model, "impulse")             # fitted to noise inputs: no data needed
        report = initialize_model(model, "impulse", data_fit=0)  # the plain solve (measured to lose)
    """
    from structinit.init.target import is_module

    if not is_module(model):
        raise UsageError("initialize_model needs an nn.Module; use initialize() for a state dict")
    return initialize(model, spec, grid=grid, seed=seed, data=data, progress=progress, log=log, source=source,
                      **params)
