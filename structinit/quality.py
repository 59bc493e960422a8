"""Attention maps of solved Q/K on the pseudo input, and the quality measures of a solution.

Conventions: ``x: [..., N, D]``, ``q, k: [..., D, d]`` (one matrix per head, ``d = D / heads``),
attention ``M = softmax(x q (x k)^T / sqrt(d))`` of shape ``[..., N, N]`` (rows are queries).
"""

from __future__ import annotations

import math
from typing import Dict

import torch


def attention_logits(x: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Scaled logits ``x q (x k)^T / sqrt(d)``: ``[..., N, N]``."""
    d = q.shape[-1]
    return (x @ q) @ (x @ k).transpose(-1, -2) / math.sqrt(d)


def attention_maps(x: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Attention ``softmax(x q (x k)^T / sqrt(d))``: ``[..., N, N]`` (float32)."""
    return torch.softmax(attention_logits(x.float(), q.float(), k.float()), dim=-1)


def attention_quality(attn: torch.Tensor, targets: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Quality of attention ``[..., N, N]`` against impulse targets ``[..., N, N]``.

    Returns tensors of shape ``[...]``: ``mse`` (mean over all N*N entries), ``hit_rate`` (share
    of rows with a target whose argmax is the target column), ``target_mass`` (mean attention on
    the target column over those rows).
    """
    attn = attn.float()
    targets = targets.to(attn)
    mse = ((attn - targets) ** 2).mean(dim=(-1, -2))
    has = targets.sum(-1) > 0
    tcol = targets.argmax(-1)
    hit = (attn.argmax(-1) == tcol) & has
    mass = attn.gather(-1, tcol.unsqueeze(-1)).squeeze(-1) * has
    rows = has.sum(-1).clamp(min=1)
    return {"mse": mse, "hit_rate": hit.sum(-1) / rows, "target_mass": mass.sum(-1) / rows}


def column_norms(w: torch.Tensor) -> torch.Tensor:
    """Mean column norm of ``w: [..., D, d]`` (norm over ``D``), shape ``[...]``."""
    return w.float().norm(dim=-2).mean(-1)


def solution_quality(x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, targets: torch.Tensor) -> Dict[str, torch.Tensor]:
    """All quality measures of ``q, k: [L, H, D, d]`` on ``x: [L, N, D]`` against ``targets: [L, H, N, N]``.

    Each returned tensor is ``[L, H]``: ``mse``, ``hit_rate``, ``target_mass``, ``q_norm``, ``k_norm``.
    """
    attn = attention_maps(x.unsqueeze(1), q, k)
    out = attention_quality(attn, targets)
    out["q_norm"] = column_norms(q)
    out["k_norm"] = column_norms(k)
    return out
