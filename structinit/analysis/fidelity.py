"""How closely a model's attention follows its impulse offsets on *real* inputs, not the pseudo input.

An impulse init is fitted on the LayerNorm'd position embedding alone; in a model the attention
sees the position embedding plus the content embedding (and, after the first layer, whatever the
previous layers made of them), which can swamp the fit. :func:`data_attention_quality` runs a batch
of real inputs through a timm-style model (``model.blocks[i].attn`` with a fused ``qkv`` Linear, as
timm's ViT and structinit's ``transformer-1d``) and measures each layer's hit rate and target mass
against the offsets the init solved for.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import numpy as np


def attention_inputs(model, x) -> List[Any]:
    """The input of every ``model.blocks[i].attn`` (after the block's norm) on batch ``x``:
    a list of ``[B, N, D]`` tensors, one per block (no gradients)."""
    import torch

    seen: List[Any] = []
    hooks = [blk.attn.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach()))
             for blk in model.blocks]
    try:
        was_training = model.training
        model.eval()
        with torch.no_grad():
            model(x)
        model.train(was_training)
    finally:
        for h in hooks:
            h.remove()
    return seen


def attention_of(attn, x, mask=None):
    """The attention map of a timm ``Attention`` module on ``x: [B, N, D]``: ``[B, H, N, N]``
    (its own ``qkv``, ``q_norm``/``k_norm`` and scale; ``mask``: bool ``[N, N]`` visible keys)."""
    import torch

    b, n, dim = x.shape
    heads = attn.num_heads
    qkv = attn.qkv(x).reshape(b, n, 3, heads, dim // heads).permute(2, 0, 3, 1, 4)
    q, k = attn.q_norm(qkv[0]), attn.k_norm(qkv[1])
    logits = (q @ k.transpose(-1, -2)) * attn.scale
    if mask is not None:
        logits = logits.masked_fill(~torch.as_tensor(mask, device=logits.device), float("-inf"))
    return torch.softmax(logits.float(), dim=-1)


def data_attention_quality(model, x, offsets, grid, padding: str = "zero", causal: bool = False,
                           layers: Optional[List[int]] = None) -> Dict[str, Any]:
    """Per layer, the ``hit_rate`` and ``target_mass`` of the model's attention on the real batch
    ``x`` against ``offsets`` (``[layers, heads, 2]``, or one ``[heads, 2]`` per entry of ``layers``),
    averaged over the batch (per head under ``heads``); and their means over the layers. JSON-able."""
    import torch

    from structinit.analysis.quality import attention_quality
    from structinit.geometry.targets import causal_mask, impulse_columns

    inputs = attention_inputs(model, x)
    layers = list(range(len(offsets))) if layers is None else list(layers)
    mask = causal_mask(grid, causal)
    rows = []
    for i, layer in enumerate(layers):
        blk = model.blocks[layer]
        with torch.no_grad():
            attn = attention_of(blk.attn, inputs[layer], mask)
        cols = torch.from_numpy(impulse_columns(grid, np.asarray(offsets[i]), padding))
        got = attention_quality(attn, cols)
        heads = {m: [float(v) for v in got[m].mean(0)] for m in ("hit_rate", "target_mass")}
        rows.append({"layer": layer, **{m: float(np.mean(v)) for m, v in heads.items()}, "heads": heads})
    return {"samples": int(x.shape[0]), "layers": rows,
            "hit_rate": float(np.mean([r["hit_rate"] for r in rows])) if rows else float("nan"),
            "target_mass": float(np.mean([r["target_mass"] for r in rows])) if rows else float("nan")}
