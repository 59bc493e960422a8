"""The model a checkpoint describes, built and loaded with the checkpoint's weights: what real
inputs run through when the impulse data fit is applied to a checkpoint (``structinit apply
--data``), the way timm's ``create_model`` and ``load_checkpoint`` go together.

The checkpoint's family builds it (:meth:`structinit.init.family.ModelFamily.build`; the built-in
families are the modules of :mod:`structinit.families`):

=========================  =====================================================================
checkpoint                 how its model is built
=========================  =====================================================================
``structinit train``       its settings (``args``): the preset ``train`` built, for the run's data
timm ViT                   ``model_name``, else the ``arch`` of timm's train.py checkpoints, as a
                           timm model of the shape the tensors have; without a name, a timm
                           ``VisionTransformer`` of the shape the tensors have (patch size and
                           channels from ``patch_embed.proj.weight``, depth, MLP ratio, the grid
                           from ``pos_embed``, class and register tokens, qkv bias, LayerScale,
                           classes); ``heads`` when nothing names them
Hugging Face ViT/DeiT,     the ``config.json`` beside the weights (as ``save_pretrained`` writes
BERT, GPT-2                it) or ``config``; the weights are loaded by transformers itself
=========================  =====================================================================

Every weight of the checkpoint must load into the model (an unexpected or missing tensor is an
error naming it): the fit reads the model as the checkpoint has it.

Example::

    built = checkpoint_model(load_checkpoint("vit.pth"), model_name="vit_tiny_patch16_224")
    built.model          # the nn.Module, eval mode, weights loaded
    built.inputs         # what one input is (an InputSpec: kind, shape, e.g. image (3, 32, 32))
    built.how            # "timm vit_tiny_patch16_224 (img_size=32, patch_size=2, ...)"
"""

from __future__ import annotations

from typing import Mapping, Optional

from structinit.families.hf_common import HF_EXTRA, hf_config, transformers_installed
from structinit.families.timm_vit import timm_heads, timm_vit_kwargs
from structinit.init.family import CheckpointModel, family_for_checkpoint


def checkpoint_model(ckpt, state_dict: Optional[Mapping] = None, *, model_name: Optional[str] = None,
                     config: Optional[str] = None, heads: Optional[int] = None, grid=None) -> CheckpointModel:
    """Build the model of ``ckpt`` (a :class:`~structinit.init.checkpoints.Checkpoint`) through its
    family and load ``state_dict`` into it (default: the checkpoint's first state dict). See the
    module docstring. ``grid``/``heads`` are needed only where the checkpoint does not tell."""
    sd = state_dict if state_dict is not None else ckpt.state_dicts[0][1]
    family = family_for_checkpoint(ckpt)
    built = family.build(ckpt, sd, model_name=model_name, config=config, heads=heads, grid=grid)
    built.family = family
    return built


__all__ = ["CheckpointModel", "checkpoint_model", "timm_vit_kwargs", "timm_heads", "hf_config",
           "transformers_installed", "HF_EXTRA"]
