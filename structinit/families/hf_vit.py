"""The Hugging Face ViT/DeiT family: transformers vision transformers (the ``hf-vit`` layout it
writes to disk, ``hf-vit-v5`` as transformers 5 names it in memory). A model tells its grid
(``image_size`` over ``patch_size``), heads and inputs (``(num_channels, image_size, image_size)``
images) through its config; a checkpoint's model is built from its ``config.json``
(:mod:`structinit.families.hf_common`).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

from structinit.families.hf_common import HfFamily
from structinit.geometry.grid import Grid
from structinit.init.family import InputSpec, register_family


@register_family
class HfVit(HfFamily):
    """Hugging Face ViT/DeiT (see the module docstring)."""

    name = "hf-vit"

    def grid(self, model) -> Grid:
        config = getattr(model, "config", None)
        size, patch = getattr(config, "image_size", None), getattr(config, "patch_size", None)
        if size is None or patch is None:
            return super().grid(model)
        h, w = (size, size) if isinstance(size, int) else size
        ph, pw = (patch, patch) if isinstance(patch, int) else patch
        return Grid((int(h) // int(ph), int(w) // int(pw)))

    def input_spec(self, model) -> Optional[InputSpec]:
        config = getattr(model, "config", None)
        chans, size = getattr(config, "num_channels", None), getattr(config, "image_size", None)
        if chans is None or size is None:
            return None
        h, w = (size, size) if isinstance(size, int) else (size[0], size[1])
        return InputSpec("image", (int(chans), int(h), int(w)), images=True)

    def config_inputs(self, cfg: dict, grid, det) -> Tuple[InputSpec, Any]:
        size, chans = cfg.get("image_size", 224), cfg.get("num_channels", 3)
        side = size if isinstance(size, int) else size[0]
        return InputSpec("image", (chans, side, side), images=True), grid or det.grid


__all__ = ["HfVit"]
