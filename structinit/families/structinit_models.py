"""structinit's own models: the presets ``structinit train`` builds (timm ViTs such as
``vit-digits``, the 1-D ``transformer-1d`` for sequences), as models (``structinit_arch`` tells them
apart) and as checkpoints (their run settings, ``args``, and ``shape`` entry build the model).

A model is a timm-style model (:class:`~structinit.families.timm_vit.TimmVit`'s grid, heads,
inputs and blocks); a checkpoint's model is the preset its settings describe, for the run's data.
"""

from __future__ import annotations

from typing import Mapping

from structinit.errors import StructinitError, UsageError, param
from structinit.families.timm_vit import TimmVit
from structinit.families.weights import load_weights
from structinit.init.family import CheckpointModel, InputSpec, register_family


@register_family
class StructinitModels(TimmVit):
    """structinit's own models (see the module docstring)."""

    name = "structinit"

    def claims_model(self, model) -> bool:
        return hasattr(model, "structinit_arch")

    def claims_checkpoint(self, ckpt) -> bool:
        settings = ckpt.obj.get("args") if isinstance(ckpt.obj, Mapping) else None
        return isinstance(settings, dict) and "shape" in ckpt.extra

    def build(self, ckpt, sd, *, model_name=None, config=None, heads=None, grid=None) -> CheckpointModel:
        if model_name is not None or config is not None:
            raise UsageError(f"{ckpt.path} was written by structinit train, whose settings build its model; "
                             f"leave out {param('model_name')} and {param('config')}")
        return structinit_model(ckpt, sd, ckpt.obj["args"])


def structinit_model(ckpt, sd: Mapping, settings: dict) -> CheckpointModel:
    """The model a ``structinit train`` checkpoint's ``settings`` describe, with ``sd`` loaded."""
    from structinit.training.config import TrainConfig
    from structinit.training.datasets import dataset_info
    from structinit.training.models import ATTENTION_FAMILIES, build_model

    try:
        config = TrainConfig.from_dict(settings)
        config.validate()
    except (TypeError, UsageError) as exc:
        raise StructinitError(f"the run settings in {ckpt.path} are unreadable ({exc})") from None
    if config.model.family not in ATTENTION_FAMILIES:
        raise UsageError(f"{config.model.name} has no attention layers to fit")
    info = dataset_info(config.dataset)
    image_size = config.image_size or info.image_size
    head = sd.get(ckpt.detected.model_prefix + "head.weight")
    classes = info.num_classes or (int(head.shape[0]) if head is not None else 1000)  # imagefolder: the file's
    model = build_model(config.model, num_classes=classes, image_size=image_size,
                        in_chans=info.in_chans, default_patch=info.default_patch, seed=config.seed)
    load_weights(model, sd, ckpt.detected.model_prefix, f"{config.model.name} model its settings describe")
    arch = model.structinit_arch
    shape = (info.in_chans, image_size) if info.is_sequence else (info.in_chans, image_size, image_size)
    inputs = InputSpec("sequence", shape, squeezed=True) if info.is_sequence else InputSpec("image", shape,
                                                                                           images=True)
    return CheckpointModel(model, f"structinit train settings: {config.model.name} on {config.dataset}", inputs,
                           grid=arch["grid"], heads=arch.get("heads"), settings=config)


__all__ = ["StructinitModels", "structinit_model"]
