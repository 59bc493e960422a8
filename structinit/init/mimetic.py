"""Mimetic initialization (Trockman & Kolter, "Mimetic Initialization of Self-Attention Layers").

Per head ``W_Q W_K^T ~ alpha1 Z1 + beta1 I`` (rank ``d``), per layer ``W_V W_proj ~ alpha2 Z2 -
beta2 I`` (full rank), ``Z ~ N(0, I/D)`` fresh per head and per layer, factored by SVD. The paper's
own equation labels swap the two pairs; the intent is as written here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List

from structinit.geometry.targets import check_choice
from structinit.init.base import InitSpec, register
from structinit.init.baselines import BASES, apply_base, generator
from structinit.init.report import InitReport


def mimetic_factors(dim: int, heads: int, rank: int, alpha: float, beta: float, gen):
    """Per head ``A_h = alpha Z + beta I`` (``Z ~ N(0, I/dim)``, fresh per head), its best rank-``rank``
    factor by SVD ``A = U S V^T``: ``Q_h = U[:, :rank] S[:rank]^1/2``, ``K_h = V[:, :rank] S[:rank]^1/2``.

    Returns float64 ``(q, k, a)``: ``q, k: [H, dim, rank]`` and the targets ``a: [H, dim, dim]``.
    """
    import torch

    z = torch.randn(heads, dim, dim, generator=gen, dtype=torch.float64) / math.sqrt(dim)
    a = alpha * z + beta * torch.eye(dim, dtype=torch.float64)
    u, s, vh = torch.linalg.svd(a)
    root = s[:, :rank].sqrt().unsqueeze(-2)
    return u[:, :, :rank] * root, vh.transpose(-1, -2)[:, :, :rank] * root, a


def mimetic_qk(dim: int, heads: int, alpha: float, beta: float, gen):
    """Mimetic init's Q/K: :func:`mimetic_factors` at the head dim ``d = D / H``.

    Returns float32 ``(q, k, a)``: ``q, k: [H, D, d]`` and the targets ``a: [H, D, D]``.
    """
    q, k, a = mimetic_factors(dim, heads, dim // heads, alpha, beta, gen)
    return q.float(), k.float(), a.float()


#: Distributions of ``Z`` in :func:`mimetic_v_proj` (both of variance ``1/D`` per entry).
Z_DISTS = ("normal", "uniform")


def mimetic_v_proj(dim: int, alpha: float, beta: float, gen, dist: str = "normal"):
    """``A = alpha Z - beta I`` factored at full rank: ``W_V = U S^1/2``, ``W_proj = S^1/2 V^T``
    (``x @ W`` convention, so ``W_V W_proj = A``). ``Z ~ N(0, I/D)`` (``dist="normal"``, mimetic
    init's), or ``U(-sqrt(3/D), sqrt(3/D))`` per entry (``"uniform"``, what the authors' code of
    "Structured Initialization for Vision Transformers" draws). Returns ``(w_v, w_proj, a)``."""
    import torch

    from structinit.geometry.targets import check_choice

    check_choice("dist", dist, Z_DISTS)
    if dist == "uniform":
        z = (2 * torch.rand(dim, dim, generator=gen, dtype=torch.float64) - 1) * math.sqrt(3.0 / dim)
    else:
        z = torch.randn(dim, dim, generator=gen, dtype=torch.float64) / math.sqrt(dim)
    a = alpha * z - beta * torch.eye(dim, dtype=torch.float64)
    u, s, vh = torch.linalg.svd(a)
    root = s.sqrt()
    return (u * root).float(), (root.unsqueeze(-1) * vh).float(), a.float()


def vproj_keys(slot) -> List[str]:
    from structinit.init.inject import label

    return [label(slot.v), str(slot.proj)]


@register
@dataclass(frozen=True)
class MimeticInit(InitSpec):
    """Mimetic init: Q/K per head and (with ``vproj``) V/proj per layer, see the module docstring.
    Q/K biases are zeroed; V/proj biases kept. ``base`` (``model``, ``pytorch``, ``pytorch-mlp`` or
    ``pytorch-head``: :data:`~structinit.init.baselines.BASES`) is what every other weight starts from.

    Report per layer: ``qk_diag_mean`` (mean diagonal of ``Q_h K_h^T`` over heads) and
    ``vproj_diag_mean`` (of ``W_V W_proj``), read back from the written weights.
    """

    method = "mimetic"
    writes = "Q/K rows and biases; V and output projection (vproj)"
    alpha1: float = 0.7
    beta1: float = 0.7
    alpha2: float = 0.4
    beta2: float = 0.4
    vproj: bool = True
    base: str = "model"
    has_base = True

    #: Parameters added after run keys were in use: left out of :meth:`to_dict` at their defaults.
    optional_defaults = ("base",)

    def validate(self) -> None:
        check_choice("base", self.base, BASES)

    def planned(self, slot) -> List[str]:
        return super().planned(slot) + (vproj_keys(slot) if self.vproj else [])

    def write(self, target, prepared=None, *, seed: int = 0, cache_dir=None, device: str = "cpu") -> InitReport:
        from structinit.init.inject import read_qk, read_vproj, write_qk, write_vproj

        t = target
        reset = apply_base(t, self.base, seed, self.method)
        gen = generator(seed)
        rows = []
        for slot in t.slots:
            q, k, _ = mimetic_qk(t.dim, t.heads, self.alpha1, self.beta1, gen)
            keys = write_qk(t.sd, slot, q, k)
            if self.vproj:
                w_v, w_p, _ = mimetic_v_proj(t.dim, self.alpha2, self.beta2, gen)
                keys += write_vproj(t.sd, slot, w_v, w_p)
            rq, rk = read_qk(t.sd, slot, t.heads)
            row = {"layer": slot.index, "replaced": keys,
                   "qk_diag_mean": float((rq @ rk.transpose(-1, -2)).diagonal(dim1=-2, dim2=-1).mean())}
            if self.vproj:
                rv, rp = read_vproj(t.sd, slot)
                row["vproj_diag_mean"] = float((rv @ rp).diagonal().mean())
            rows.append(row)
        return InitReport.from_dict({"method": "mimetic", "layout": t.layout, "dim": t.dim, "heads": t.heads,
                                     "params": self.params(), **({"base_reset": reset} if reset is not None else {}),
                                     "layers": rows})
