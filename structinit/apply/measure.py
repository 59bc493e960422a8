"""What a checkpoint's attention is, measured as ``apply`` measures it (:func:`inspect_checkpoint`,
what ``structinit inspect CHECKPOINT`` shows).

Two measures, each labelled: the attention of every layer on the position embedding alone (the
LayerNorm'd table, what the plain solve is made for; :func:`~structinit.init.checkpoints.describe_checkpoint`)
and, where structinit can build the checkpoint's model and noise can stand for its inputs, the
attention the model computes on Gaussian noise inputs of its input shape (the inputs ``apply``'s
default fit runs on, measured on the first :data:`MEASURED` of them as its report does). Both are
taken against each head's closest impulse offset, which a checkpoint does not record.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, Optional, Union

from structinit.errors import StructinitError, UsageError, param
from structinit.geometry.grid import Grid, GridLike

#: How many noise inputs the model's attention is measured on (as the data fit's report measures).
MEASURED = 64


def checkpoint_file(path: Union[str, os.PathLike]) -> Path:
    """The weights file of ``path``: the file itself, or a Hugging Face ``save_pretrained`` folder's."""
    from structinit.apply.files import hf_folder

    p = Path(path)
    return hf_folder(p) if p.is_dir() else p


def inspect_checkpoint(path: Union[str, os.PathLike], *, heads: Optional[int] = None,
                       grid: Optional[GridLike] = None, model_name: Optional[str] = None,
                       config: Optional[str] = None, seed: int = 0) -> Dict[str, Any]:
    """Layout, shape and the attention of every layer of checkpoint ``path`` (a file, or a Hugging
    Face folder as ``apply`` takes it): ``layers`` on the position embedding alone (``measured_on``
    says which input) and ``on_inputs`` on :data:`MEASURED` noise inputs through the model the
    checkpoint describes (``model_name`` a timm model, ``config`` a Hugging Face config.json, as in
    ``apply``; ``None`` with ``on_inputs_skipped`` saying why where it cannot run). JSON-able."""
    from structinit.apply.models import timm_heads
    from structinit.init.checkpoints import describe_checkpoint

    if model_name is not None and not model_name.strip():
        raise UsageError(f"{param('model_name')} is empty; give a timm model's name, or leave it out")
    if model_name is not None and heads is None:
        heads = timm_heads(model_name)
    desc = describe_checkpoint(checkpoint_file(path), heads=heads, grid=grid)
    try:
        desc["on_inputs"], desc["on_inputs_skipped"] = _on_noise(desc, model_name, config, seed), None
    except StructinitError as exc:
        desc["on_inputs"], desc["on_inputs_skipped"] = None, exc.render()
    return desc


def _on_noise(desc: Dict[str, Any], model_name: Optional[str], config: Optional[str], seed: int) -> Dict[str, Any]:
    """The model's attention on noise inputs against the offsets ``desc`` found (see the module docstring)."""
    from structinit.apply.models import checkpoint_model
    from structinit.fit.inputs import noise_inputs
    from structinit.init.checkpoints import load_checkpoint
    from structinit.init.family import GENERIC

    ckpt = load_checkpoint(desc["path"])
    grid = Grid(desc["grid"])
    built = checkpoint_model(ckpt, model_name=model_name, config=config, heads=desc["heads"], grid=grid)
    shape = built.inputs.noise_shape
    if shape is None:
        raise StructinitError(f"the model takes {built.inputs.kind}s, which noise cannot stand for")
    family = built.family if built.family is not None else GENERIC
    if not family.measures_attention:
        raise StructinitError(f"the attention of a {built.how} is measured on its position embedding only")
    x = built.inputs.as_model_batch(noise_inputs(shape, MEASURED, seed).x)
    offsets = [row["offsets"] for row in desc["layers"]]
    got = family.attention_quality(built.model.eval(), x, offsets, grid, [r["layer"] for r in desc["layers"]])
    return {"inputs": f"{MEASURED} Gaussian noise inputs N(0, 1) of shape {list(shape)} "
                      f"(seed {seed}), through {built.how}",
            "layers": [{"layer": r["layer"], "hit_rate": r["hit_rate"], "target_mass": r["target_mass"]}
                       for r in got["layers"]],
            "hit_rate": got["hit_rate"], "target_mass": got["target_mass"]}


__all__ = ["inspect_checkpoint", "checkpoint_file", "MEASURED"]
