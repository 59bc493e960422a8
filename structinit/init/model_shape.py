"""What a model says of its attention's shape: its token grid and heads per layer, read from a
timm-style model (``patch_embed.grid_size``, ``blocks[0].attn.num_heads``) or a Hugging Face one
(its config)."""

from __future__ import annotations

from structinit.errors import UsageError, param
from structinit.geometry.grid import Grid


def model_grid(model) -> Grid:
    """Token grid of a timm-style model (``patch_embed.grid_size``: ``(H, W)`` for images, ``(L,)``
    for a sequence model such as structinit's ``transformer-1d``) or of a Hugging Face vision model
    (its config's ``image_size`` over ``patch_size``)."""
    try:
        return Grid(tuple(int(g) for g in model.patch_embed.grid_size))
    except (AttributeError, TypeError):
        pass
    config = getattr(model, "config", None)
    size, patch = getattr(config, "image_size", None), getattr(config, "patch_size", None)
    if size is not None and patch is not None:
        h, w = (size, size) if isinstance(size, int) else size
        ph, pw = (patch, patch) if isinstance(patch, int) else patch
        return Grid((int(h) // int(ph), int(w) // int(pw)))
    raise UsageError(f"the model has no patch_embed.grid_size; pass {param('grid')}")


def model_heads(model) -> int:
    """Heads of a timm-style model's first block (``blocks[0].attn.num_heads``), or of a Hugging
    Face model (its config's ``num_attention_heads``)."""
    try:
        return int(model.blocks[0].attn.num_heads)
    except (AttributeError, IndexError, TypeError):
        pass
    heads = getattr(getattr(model, "config", None), "num_attention_heads", None)
    if isinstance(heads, int):
        return heads
    raise UsageError(f"the model has no blocks[0].attn.num_heads; pass {param('heads')}")


__all__ = ["model_grid", "model_heads"]
