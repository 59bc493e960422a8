"""Q/K on the content directions beside a position subspace: each head's columns split by direction.

With a position subspace (:mod:`structinit.init.position_subspace`) a head's impulse Q/K read only
the ``k`` directions ``B [D, k]`` that carry the position table, so ``Q_h K_h^T = B M_h B^T`` has rank
at most ``k``. When ``k`` is below the head dim ``d``, the head has ``r = d - k`` columns to spare:
``content_qk`` fills them with Q/K that read only the content directions ``U [D, D - k]`` (an
orthonormal basis of ``C = I - B B^T``), drawn by another method:

- ``mimetic``: per head ``A = alpha Z + beta I`` on the content directions (``Z ~ N(0, I/(D - k))``,
  ``alpha = beta = 0.7``, mimetic init's defaults), its best rank-``r`` factor by SVD;
- ``conditioned``: per head two independent Haar semi-orthogonal ``[D - k, r]`` matrices at scale 2
  (conditioned init's default), read through ``U``.

A head's logits are then ``x B M_h B^T x^T + content_scale * x U A_h U^T x^T``: the position part is
the impulse solve (or fit) unchanged (it is refactored into ``k`` columns, exact), and the content
part is zero on the position table, so the attention measured on the position embedding alone is the
impulse init's. ``content_scale`` multiplies the content part's bilinear form (``Q_c`` and ``K_c``
each by its square root).

With ``zero_keys`` the content part's keys start at zero (its queries as drawn): the attention at
init is the position part's exactly, on any input, and the content columns still train from the
first step (the gradient of ``K_c`` is carried by ``Q_c``; the zero-initialized factor of a
low-rank adapter works the same way). Small drawn content Q/K instead (a small ``content_scale``)
keep the attention close to the position part's but leave both factors small, so their gradients
are small too.

Shapes: ``q, k: [H, D, d]`` (``x @ W`` convention), ``basis [D, k]``; returns ``[H, D, d]`` with
the position part in columns ``0 .. k-1`` and the content part in ``k .. d-1``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Tuple

if TYPE_CHECKING:
    import torch

#: What fills a head's spare columns (``none``: nothing, the impulse init as it was).
CONTENT_QK = ("none", "mimetic", "conditioned")
#: Added to the init's seed for the content draws (independent of the V/proj, basis and solve draws).
CONTENT_SEED_OFFSET = 5


def content_basis(basis) -> "torch.Tensor":
    """``[D, D - k]``: an orthonormal basis of the complement of ``basis [D, k]`` (complete QR)."""
    import torch

    q, _ = torch.linalg.qr(basis.double(), mode="complete")
    return q[:, basis.shape[1]:].float()


def position_columns(q, k, basis) -> Tuple["torch.Tensor", "torch.Tensor"]:
    """``q, k: [H, D, d]`` that read only ``basis [D, k]``, refactored into ``k`` columns with the same
    ``Q_h K_h^T``: ``[H, D, k]`` each (SVD of ``B^T Q_h K_h^T B``)."""
    import torch

    b = basis.double()
    m = (b.T @ q.double()) @ (b.T @ k.double()).transpose(-1, -2)  # [H, k, k]
    u, s, vh = torch.linalg.svd(m)
    root = s.sqrt().unsqueeze(-2)
    return (b @ (u * root)).float(), (b @ (vh.transpose(-1, -2) * root)).float()


def content_columns(method: str, heads: int, basis, rank: int, scale: float, gen,
                    zero_keys: bool = False) -> Tuple["torch.Tensor", "torch.Tensor"]:
    """``(q_c, k_c)``, each ``[H, D, rank]``, reading only the complement of ``basis [D, k]``, by
    ``method`` (``mimetic`` or ``conditioned``), their product times ``scale``; drawn from ``gen``
    (the same draws with ``zero_keys``, which then sets ``k_c`` to zero)."""
    import torch

    from structinit.init.conditioned import ConditionedInit, semi_orthogonal
    from structinit.init.mimetic import MimeticInit, mimetic_factors

    u = content_basis(basis).double()
    n = u.shape[1]
    if method == "mimetic":  # at mimetic init's own constants
        qc, kc, _ = mimetic_factors(n, heads, rank, MimeticInit.alpha1, MimeticInit.beta1, gen)
    elif method == "conditioned":  # at conditioned init's own Q/K scale
        qc = semi_orthogonal(heads, n, rank, ConditionedInit.qk_scale, gen).double()
        kc = semi_orthogonal(heads, n, rank, ConditionedInit.qk_scale, gen).double()
    else:
        raise ValueError(f"content_qk must be one of {', '.join(CONTENT_QK[1:])}, got {method!r}")
    root = math.sqrt(scale)
    kc = torch.zeros_like(kc) if zero_keys else kc
    return (u @ qc * root).float(), (u @ kc * root).float()


def with_content(q, k, basis, method: str, scale: float, gen,
                 zero_keys: bool = False) -> Tuple["torch.Tensor", "torch.Tensor"]:
    """Each head of ``q, k: [H, D, d]`` (reading only ``basis [D, k]``, ``k < d``) with its position
    part in columns ``0 .. k-1`` and ``method``'s content part in ``k .. d-1``: ``[H, D, d]`` each."""
    import torch

    heads, _, d = q.shape
    dims = basis.shape[1]
    qp, kp = position_columns(q, k, basis)
    qc, kc = content_columns(method, heads, basis, d - dims, scale, gen, zero_keys)
    return torch.cat([qp, qc], dim=-1), torch.cat([kp, kc], dim=-1)


__all__ = ["CONTENT_QK", "CONTENT_SEED_OFFSET", "content_basis", "content_columns", "position_columns",
           "with_content"]
