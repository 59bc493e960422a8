"""What ``structinit apply`` (:func:`~structinit.apply.checkpoint.apply_checkpoint`) is asked to do
beside the init's own parameters: :class:`ApplyOptions` (where the output goes, which layers, the
position table, the data fit's inputs and model), checked against the init before any work."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple, Union

from structinit.errors import UsageError, param
from structinit.init.base import InitSpec

#: What ``set_pe`` writes, and the scale it writes it at unless ``pe_scale`` says.
PE_KINDS = ("sincos",)
#: Datasets made in memory (scikit-learn's digits, the seeded synthetic bars): no ``data_dir`` is read
#: for them, as ``train`` says too.
FILELESS_DATASETS = ("digits", "synthetic")
DEFAULT_PE_SCALE = 1.0


def _check_pe_scale(pe_scale: Optional[float], set_pe: Optional[str]) -> None:
    if pe_scale is None:
        return
    if set_pe is None:
        raise UsageError(f"{param('pe_scale')} scales the embedding {param('set_pe')} writes; give set_pe too")
    if isinstance(pe_scale, bool) or not isinstance(pe_scale, (int, float)) or not math.isfinite(pe_scale) \
            or pe_scale <= 0:
        raise UsageError(f"{param('pe_scale')} must be a positive finite number, got {pe_scale!r}")


@dataclass(frozen=True)
class ApplyOptions:
    """How :func:`~structinit.apply.checkpoint.apply_checkpoint` reads, initializes and writes a
    checkpoint (the ``structinit apply`` options; the init's own parameters are the spec's).

    Output: ``out`` (default ``NAME.METHOD.EXT`` beside the input), ``in_place`` (replace the input,
    keeping a numbered backup), ``force`` (replace an existing ``out``), ``dry_run`` (the plan only).
    Shape: ``layers`` (``None``/``"all"``, ``"0-3,5"`` or indices), ``heads`` and ``grid`` where the
    checkpoint does not tell them. Position: ``set_pe="sincos"`` writes the fixed table times
    ``pe_scale`` (default :data:`DEFAULT_PE_SCALE`). ``seed``, ``cache_dir``, ``device`` as for a solve. The data fit:
    ``data`` (a dataset name, an image folder, a tensor file, ``"noise"``, or a tensor of inputs;
    ``None``: noise inputs, as without data on a model), at most ``samples`` of them (the fit reads
    them all: its ``data_fit_samples`` becomes ``samples``; default: the fit's own), ``data_dir`` for a
    dataset read from disk,
    ``model_name`` (a timm model) or ``config`` (a Hugging Face ``config.json``) for the model the
    checkpoint holds."""

    out: Union[str, os.PathLike, None] = None
    in_place: bool = False
    dry_run: bool = False
    force: bool = False
    layers: Union[None, str, Sequence[int]] = None
    heads: Optional[int] = None
    grid: Any = None
    set_pe: Optional[str] = None
    pe_scale: Optional[float] = None
    seed: int = 0
    cache_dir: Union[str, os.PathLike, None] = None
    device: str = "cpu"
    data: Any = None
    samples: Optional[int] = None
    data_dir: Union[str, os.PathLike, None] = None
    model_name: Optional[str] = None
    config: Optional[str] = None

    def check(self, spec: InitSpec) -> None:
        """Refuse options that cannot go together or would do nothing for ``spec``."""
        from structinit.init.registry import fitting_methods

        if self.set_pe is not None and self.set_pe not in PE_KINDS:
            raise UsageError(f"{param('set_pe')} must be one of {', '.join(PE_KINDS)}, got {self.set_pe!r}")
        _check_pe_scale(self.pe_scale, self.set_pe)
        base = spec.other_weights
        if spec.has_base and base != "model":
            raise UsageError(f"{spec.method} parameter {param('base')} {base} resets every weight of a model; "
                             "a checkpoint's weights are kept (leave base at model)")
        fits = spec.uses_data
        off = f" ({spec.fit_off()})" if spec.fit_off() else ""
        if self.data is not None:
            if isinstance(self.data, (str, os.PathLike)) and str(self.data).strip() == "":
                raise UsageError(f"{param('data')} needs a source (a dataset, an image folder, a tensor file or "
                                 "noise); it is empty")
            if self.dry_run:
                raise UsageError(f"{param('data')} fits Q/K on real inputs and {param('dry_run')} writes nothing; "
                                 "give one of them")
            if not fits:
                raise UsageError(f"{param('data')} is for the {fitting_methods()} data fit; the {spec.method} "
                                 f"init does not use it{off}")
        if self.data_dir is not None and isinstance(self.data, str) and self.data in FILELESS_DATASETS:
            raise UsageError(f"{param('data_dir')} does not apply to the {self.data} dataset, which needs no files")
        needs_source = [name for name in ("samples", "data_dir") if getattr(self, name) is not None]
        if needs_source and self.data is None:
            raise UsageError(f"{', '.join(param(n) for n in needs_source)} "
                             f"{'needs' if len(needs_source) == 1 else 'need'} {param('data')}")
        builds = [name for name in ("model_name", "config") if getattr(self, name) is not None]
        if builds and not fits and not spec.needs_model:
            verb = "names" if len(builds) == 1 else "name"
            raise UsageError(f"{', '.join(param(n) for n in builds)} {verb} the model apply builds, for the data fit "
                             f"or a method that runs on the model; the {spec.method} init does neither{off}")
        if self.heads is not None and (isinstance(self.heads, bool) or not isinstance(self.heads, int)
                                       or self.heads < 1):
            raise UsageError(f"{param('heads')} must be a positive integer, got {self.heads!r}")
        for name in ("model_name", "config"):
            value = getattr(self, name)
            if value is not None and not str(value).strip():
                raise UsageError(f"{param(name)} is empty; give a name, or leave it out")
        if self.samples is not None and (isinstance(self.samples, bool) or not isinstance(self.samples, int)
                                         or self.samples < 1):
            raise UsageError(f"{param('samples')} must be a positive integer, got {self.samples!r}")


def split_settings(options: Optional[ApplyOptions], settings: Dict[str, Any]) -> Tuple[ApplyOptions, Dict[str, Any]]:
    """``(options, init parameters)``: the names of ``settings`` that are :class:`ApplyOptions`
    fields replace those of ``options`` (default: the defaults); the rest are the init's."""
    fields = {f.name for f in dataclasses.fields(ApplyOptions)}
    given = {k: v for k, v in settings.items() if k in fields}
    options = dataclasses.replace(options or ApplyOptions(), **given)
    return options, {k: v for k, v in settings.items() if k not in fields}


__all__ = ["ApplyOptions", "split_settings", "PE_KINDS"]
