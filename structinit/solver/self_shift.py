"""Self + shift: an impulse head that also attends to its own token.

Mimetic init ("Mimetic Initialization of Self-Attention Layers") gives every head
``Q_h K_h^T ~ alpha Z + beta I``: the identity term makes a token attend to itself and to tokens
like it. An impulse head attends to one offset. Self + shift mixes the two per head, at the
head's own scale::

    M_h = (1 - weight) A_h + weight |A_h|_F I / sqrt(D),    A_h = Q_h K_h^T

and factors ``M_h`` back at the head's rank ``d`` by SVD (``Q_h = U S^1/2``, ``K_h = V S^1/2``
over the top ``d`` singular values: the best rank-``d`` approximation). ``weight = 0`` leaves the
product ``Q_h K_h^T`` as it is; the larger ``weight``, the more of each row's attention goes to the
query itself. Because of the rank ``d`` the identity survives mostly inside the directions the
impulse solve uses (for a data-fitted head, those in which real inputs carry position).

Shapes: ``q, k: [H, D, d]`` (a head attends with ``softmax(x q (x k)^T / sqrt(d))``).
"""

from __future__ import annotations

import math
from typing import Tuple

import torch


def add_self_term(q: torch.Tensor, k: torch.Tensor, weight: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """Mix an identity term of share ``weight`` (``0 <= weight < 1``) into every head's
    ``Q_h K_h^T`` (see the module docstring); returns float32 ``q, k: [H, D, d]``."""
    if not 0 <= weight < 1:
        raise ValueError(f"weight must lie in [0, 1), got {weight}")
    q64, k64 = q.detach().double(), k.detach().double()
    if weight == 0:
        return q64.float(), k64.float()
    heads, dim, d = q64.shape
    a = q64 @ k64.transpose(-1, -2)  # [H, D, D]
    scale = a.norm(dim=(-2, -1), keepdim=True) / math.sqrt(dim)
    m = (1 - weight) * a + weight * scale * torch.eye(dim, dtype=torch.float64)
    u, s, vh = torch.linalg.svd(m)
    root = s[:, :d].sqrt().unsqueeze(-2)
    return (u[:, :, :d] * root).float(), (vh.transpose(-1, -2)[:, :, :d] * root).float()
