"""The model of a training setup as ``train`` has it before the first step, rebuilt: for a
``structinit train`` run folder (the model at init, from its ``config.json``), its ``checkpoint.pt``
or ``best.pt`` (that epoch's weights over the rebuilt model), or a preset with an init. What
``structinit inspect TARGET --data DATASET`` runs real inputs through, and what the grid report's
attention figure (:mod:`structinit.experiments.attention`) draws, beside :mod:`structinit.apply.models`
(the model any checkpoint describes).

Example::

    m = run_model("runs/digits-imp")          # m.model, m.report (the init report), m.recorded
    m = preset_model(TrainConfig(model="vit-digits", dataset="digits", init="impulse"))
    model, report, info = initialized_model(config)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from structinit.errors import StructinitError, UsageError
from structinit.init.report import InitReport


def training_images(config, n: int):
    """The first ``n`` inputs of a ``train`` run's training split (its subset and validation hold-out
    applied) as the model sees them in training: images normalized, float ``[n, C, H, W]``;
    sequences as stored (already standardized; ``shuffle_seq`` applied), float ``[n, C, L]``."""
    import torch

    from structinit.training.augment import normalize
    from structinit.training.datasets import load_dataset, split_train

    data = load_dataset(config.dataset, config.data_dir, image_size=config.image_size,
                        shuffle_seq=config.shuffle_seq)
    data = split_train(data, config.train_size, config.val_size,
                       config.seed if config.data_seed is None else config.data_seed)
    n = min(n, len(data.train))
    if data.info.in_memory:
        x = data.train.images[:n]
        return x if data.info.is_sequence else normalize(x, data.info.mean, data.info.std)
    return torch.stack([data.train[i][0] for i in range(n)])


def _recorded_attention(recorded: Any, where: Path) -> Optional[Dict[str, Any]]:
    """What ``train`` measured at init (the ``data_attention`` of ``recorded``, the init report of the
    run's ``config.json`` at ``where``; ``None`` where it holds none)."""
    if recorded is None:
        return None
    try:
        return InitReport.from_dict(recorded).data_attention
    except ValueError as exc:
        raise StructinitError(f"{where}: its init_report cannot be read: {exc}") from None


def initialized_model(config, cache_dir=None) -> Tuple[Any, Optional[InitReport], Any]:
    """The model of ``config`` as ``train`` builds it before the first step: ``(model, init
    report, dataset info)`` (the report is ``None`` for the model's own init). An init that fits
    to real inputs (impulse ``data_fit``) gets the run's first training inputs, as in ``train``.
    ``cache_dir``: the artifact cache an impulse init reads (and solves into)."""
    import torch

    from structinit.training.datasets import dataset_info
    from structinit.training.models import build_model

    info = dataset_info(config.dataset)
    image_size = config.image_size or info.image_size
    torch.manual_seed(config.seed)
    model = build_model(config.model, num_classes=info.num_classes or 1000, image_size=image_size,
                        in_chans=info.in_chans, default_patch=info.default_patch, seed=config.seed)
    report = None
    spec = config.init
    if spec is not None:
        from structinit.init.initialize import initialize_model
        from structinit.training.config import FIDELITY_SAMPLES

        data = training_images(config, FIDELITY_SAMPLES) if spec.uses_data else None
        source = f"{config.dataset}: the run's first {int(data.shape[0])} training inputs" if data is not None else None
        report = initialize_model(model, spec, seed=config.seed, data=data, cache_dir=cache_dir, source=source)
    return model, report, info


@dataclass
class InspectedModel:
    """A model of a training setup, ready to be measured on real inputs (``structinit inspect
    --data``): its :class:`~structinit.training.config.TrainConfig`, the model, the init report
    (``None`` for the model's own init), the dataset info, and where its weights come from:
    ``source`` is ``"init"`` (built and initialized as ``train`` does before the first step) or
    ``"checkpoint"`` (a run's weights after ``epoch`` epochs, loaded over that model; the report
    still gives the init's offsets). ``config_path``: the run's ``config.json`` when there is one;
    ``recorded``: what ``train`` measured there at init (``init_report.data_attention``)."""

    config: Any
    model: Any
    report: Optional[InitReport]
    info: Any
    source: str = "init"
    epoch: int = 0
    config_path: Optional[str] = None
    recorded: Optional[dict] = None


def _check_attention(config) -> None:
    from structinit.training.models import ATTENTION_FAMILIES

    config.validate()
    if config.model.family not in ATTENTION_FAMILIES:
        raise UsageError(f"{config.model.name} has no attention layers to measure; real-data attention applies to the "
                         "ViT presets and transformer-1d")


def preset_model(config, cache_dir=None) -> InspectedModel:
    """The model of ``config`` (a preset, its init and seed, the dataset) at init."""
    _check_attention(config)
    model, report, info = initialized_model(config, cache_dir)
    return InspectedModel(config, model, report, info)


def run_model(path, data_dir=None, cache_dir=None) -> InspectedModel:
    """The model of a ``structinit train`` run: for its folder, the model at init, rebuilt from its
    ``config.json`` exactly as ``train`` built it (``train`` saves no weights before the first
    epoch); for its ``checkpoint.pt`` or ``best.pt``, that file's weights (after its epoch) over
    the model rebuilt from the settings it holds. ``data_dir`` replaces the run's dataset folder."""
    from pathlib import Path

    from structinit.training.rundir import RunDir, load_run_weights

    path = Path(path)
    folder = path if path.is_dir() else path.parent
    doc = None
    if (folder / RunDir.CONFIG).is_file():
        doc = RunDir(folder).read_config()
    ck = None
    if path.is_dir():
        if doc is None:
            raise UsageError(f"{path} is not a structinit train run folder (it has no {RunDir.CONFIG})")
        settings = doc.get("config")
    else:
        ck = load_run_weights(path)
        settings = ck["args"]
    config = _run_config(settings, path, data_dir)
    model, report, info = initialized_model(config, cache_dir)
    recorded = None
    if ck is not None:
        try:
            model.load_state_dict(ck["state_dict"])
        except RuntimeError as exc:
            raise StructinitError(f"the weights in {path} do not fit the model its settings describe: "
                                  f"{str(exc).splitlines()[0]}") from None
    else:
        assert doc is not None  # no checkpoint file: path is a run folder, whose config.json was read
        recorded = _recorded_attention(doc.get("init_report"), folder / RunDir.CONFIG)
    return InspectedModel(config, model, report, info, source="checkpoint" if ck is not None else "init",
                          epoch=int(ck["epoch"]) if ck is not None else 0,
                          config_path=str(folder / RunDir.CONFIG) if doc is not None else None, recorded=recorded)


def _run_config(settings, path, data_dir=None):
    """The checked :class:`~structinit.training.config.TrainConfig` of a run's ``settings`` (read
    from ``path``), its dataset folder replaced by ``data_dir`` when given."""
    import dataclasses

    from structinit.training.config import TrainConfig

    try:
        config = TrainConfig.from_dict(settings)
    except (TypeError, UsageError) as exc:
        raise StructinitError(f"the run settings in {path} are unreadable ({exc})") from None
    if data_dir is not None:
        config = dataclasses.replace(config, data_dir=str(data_dir))
    _check_attention(config)
    return config


__all__ = ["training_images", "initialized_model", "InspectedModel", "preset_model", "run_model"]
