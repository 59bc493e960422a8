"""The init of a run, at its start: the model built from the run's seed and initialized
(:func:`initialized_model`), fitted to the run's first training inputs (:func:`init_inputs`) when
the init fits to data, and an impulse init's attention measured on them (:func:`impulse_fidelity`)
for the report and the epoch-0 record. A resumed run re-runs only what the init sets besides the
weights.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional

from structinit.errors import StructinitError
from structinit.init.base import InitSpec
from structinit.init.report import InitReport
from structinit.training.config import FIDELITY_SAMPLES, TrainConfig, causal_refused

if TYPE_CHECKING:  # torch is imported where it is used
    import torch

    from structinit.training.datasets import Data, DatasetInfo, TensorSplit


def init_inputs(split: TensorSplit, info: DatasetInfo) -> torch.Tensor:
    """The first :data:`FIDELITY_SAMPLES` training inputs of an in-memory split, as the model sees
    them (images normalized; sequences as stored): what the init fits to (``data_fit``) and where
    its attention is measured at init."""
    from structinit.training.augment import normalize

    x = split.images[:FIDELITY_SAMPLES]
    return x if info.is_sequence else normalize(x, info.mean, info.std)


def impulse_fidelity(model: torch.nn.Module, split: TensorSplit, info: DatasetInfo,
                     report: InitReport) -> Dict[str, Any]:
    """The hit rate and target mass, per layer, of a freshly impulse-initialized model's attention on
    the first :data:`FIDELITY_SAMPLES` training inputs (see
    :func:`structinit.analysis.fidelity.data_attention_quality`); ``report`` is the init's report."""
    from structinit.analysis.fidelity import data_attention_quality
    from structinit.geometry.grid import Grid

    x = init_inputs(split, info)
    structure = report.structure
    if structure is None:
        raise StructinitError(f"the {report.method} init reported no impulse offsets to measure its attention on")
    layers = sorted(structure.offsets)
    # No causal mask: the models train builds attend both ways (TrainConfig refuses causal offsets).
    return data_attention_quality(model, x, [structure.offsets[i] for i in layers], Grid(structure.grid),
                                  padding=structure.padding, layers=layers)


@dataclass
class Initialized:
    """The model :func:`~structinit.training.loop.train` built and initialized: ``arch`` is what it was built as
    (``model.structinit_arch``); ``report`` and ``seconds`` the init's report and time (``None``
    for the model's own init); ``record`` the epoch-0 line of ``metrics.jsonl``, the init's attention
    on real inputs (``None`` when it is not measured)."""

    model: torch.nn.Module
    arch: Dict[str, Any]
    report: Optional[InitReport] = None
    seconds: Optional[float] = None
    record: Optional[Dict[str, Any]] = None

    @property
    def rounded_seconds(self) -> Optional[float]:
        """``seconds`` to the millisecond, as the run's files hold it."""
        return None if self.seconds is None else round(self.seconds, 3)

    def report_json(self) -> Optional[Dict[str, Any]]:
        """The init's report as the run's files hold it (``None``: the model's own init)."""
        return self.report.to_dict() if self.report is not None else None


def initialized_model(config: TrainConfig, data: Data, resumed: Optional[Dict[str, Any]],
                      on_init: Optional[Callable[[int, int], None]], say: Callable[[str], None]) -> Initialized:
    """The run's model, built from its seed, with its init applied: in full when the run starts
    (:func:`_apply_init`, ``on_init(done, total)`` called as its data fit steps, ``say`` told what
    it measured); when it resumes from a checkpoint whose ``config.json`` (``resumed``) recorded the
    init's report, only for what the init sets besides the weights (:func:`_reapply_init`)."""
    import torch

    from structinit.training.models import build_model

    info = data.info
    torch.manual_seed(config.seed)
    model = build_model(config.model, num_classes=info.num_classes, image_size=info.image_size,
                        in_chans=info.in_chans, default_patch=info.default_patch, seed=config.seed)
    built = Initialized(model, model.structinit_arch)
    started = resumed or {}
    recorded = started.get("init_report")
    spec = config.init
    if spec is None:
        return built
    if recorded is not None:
        return _reapply_init(built, config, spec, recorded, started.get("init_seconds"))
    return _apply_init(built, config, spec, data, on_init, say)


def _reapply_init(built: Initialized, config: TrainConfig, spec: InitSpec, recorded: Dict[str, Any],
                  seconds: Optional[float]) -> Initialized:
    """Resumed: the checkpoint holds every weight, so the init runs only for what it sets besides
    them (which parameters train, such as a position embedding it makes learnable), without its data
    fit; the run keeps the report (``recorded``), the time and the epoch-0 attention it recorded when
    it started. ``spec`` is ``config.init``."""
    from structinit.init.initialize import initialize_model

    initialize_model(built.model, spec.without_fit(), seed=config.seed)
    try:
        built.report, built.seconds = InitReport.from_dict(recorded), seconds
    except ValueError as exc:
        raise StructinitError(f"the init report the run recorded cannot be read: {exc}") from None
    if built.report.data_attention is not None:
        built.record = {"epoch": 0, "init_attention": built.report.data_attention}
    return built


def _apply_init(built: Initialized, config: TrainConfig, spec: InitSpec, data: Data,
                on_init: Optional[Callable[[int, int], None]], say: Callable[[str], None]) -> Initialized:
    """The init (``spec``, the config's) of a run that starts: fitted to the run's first training
    inputs when it fits to data (noise inputs for a dataset read from disk), timed; an impulse
    init's attention is then measured on those inputs (:func:`impulse_fidelity`) for the report and
    the epoch-0 record."""
    from structinit.init.initialize import initialize_model

    info = data.info
    fit_to = None
    if spec.uses_data:
        if info.in_memory:
            fit_to = init_inputs(data.train, info)
        else:
            say(f"the init's data fit needs training inputs held in memory and {config.dataset} is read "
                "from disk: it runs on noise inputs of the model's input shape")
    t_init = time.perf_counter()
    source = (f"{config.dataset}: the run's first {int(fit_to.shape[0])} training inputs"
              if fit_to is not None else None)
    report = initialize_model(built.model, spec, seed=config.seed, data=fit_to,
                              progress=on_init, log=say, source=source)
    built.report, built.seconds = report, time.perf_counter() - t_init
    if report.structure is not None and report.structure.causal:  # an artifact given by path or key, read just now
        raise causal_refused(config.model.name, artifact=report.structure.artifact)
    if info.in_memory and spec.reports_offsets:
        quality = report.data_attention = impulse_fidelity(built.model, data.train, info, report)
        built.record = {"epoch": 0, "init_attention": quality}
        say(f"impulse attention at init on {quality['samples']} training inputs: hit rate {quality['hit_rate']:.3f}, "
            f"target mass {quality['target_mass']:.3f} (on the pseudo input: {report.hit_rate or 0:.3f}, "
            f"{report.target_mass or 0:.3f})")
    return built

