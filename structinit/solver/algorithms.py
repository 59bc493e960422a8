"""Solvers: Q/K whose attention on the pseudo input approximates impulse targets.

Every solver is batched over layers x heads (one set of batched matrix products) and has the
signature ``solver(x, targets, head_dim, heads, generator, **params) -> (q, k)`` with

- ``x: [L, N, D]`` the pseudo input of each layer,
- ``targets: [L, H, N, N]`` the impulse targets (rows with no impulse are all zero),
- ``q, k: [L, H, D, d]`` so that head ``h`` of layer ``l`` attends with
  ``softmax(x q (x k)^T / sqrt(d))``,
- ``mask`` (keyword, optional): bool ``[N, N]``, the keys each query may see (a causal decoder's
  mask); the attention that is fitted, calibrated and measured is then the masked one.

Recipes (``RECIPES``):

- ``fast`` (default): closed-form, ridge-regularized rank-``d`` fit of impulse logits (the gap
  that gives ``target_mass`` on the target token) in the pseudo input's column space, then a
  per-head temperature calibrated by bisection so that the mean
  attention mass on the target token equals ``target_mass``. Softness is an explicit knob, not
  an accident of iteration counts.
- ``paper``: Algorithm 1 of the structured-initialization paper as written (uniform init, Adam
  lr 1e-4, 10,000 iterations, MSE loss, scale 1/sqrt(d)).
- ``released``: the authors' released code: as ``paper`` but every ``norm_every`` iterations
  (from iteration 0) Q's columns and K's rows are rescaled to the mean initial column norm of Q,
  which keeps the attention soft (target mass ~0.2 on the ViT-T shape).
- ``closed-form``: the authors' later construction: target logits (``logit`` on impulse entries,
  truncated-normal noise elsewhere) through the pseudo-inverse of ``x``, rank-``d`` SVD, each
  factor normalized to unit Frobenius norm and scaled by ``qk_scale``.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Tuple

import torch

from structinit.analysis.quality import attention_logits
from structinit.errors import UsageError, param
from structinit.solver.recipes import RECIPES

Solver = Callable[..., Tuple[torch.Tensor, torch.Tensor]]


def _uniform_init(shape, head_dim: int, heads: int, generator: torch.Generator, device) -> torch.Tensor:
    """Uniform in +-sqrt(1 / (d * heads)), drawn on the CPU generator (device independent)."""
    bound = math.sqrt(1.0 / (head_dim * heads))
    w = (2 * torch.rand(shape, generator=generator, dtype=torch.float32) - 1) * bound
    return w.to(device)


def _adam_mse(x, targets, head_dim, heads, generator, iters, lr, norm_every=0, progress=None, mask=None):
    """Adam on the per-head MSE (summed over heads, so each head sees its own Algorithm 1)."""
    L, H, N, _ = targets.shape
    D = x.shape[-1]
    q = _uniform_init((L, H, D, head_dim), head_dim, heads, generator, x.device).requires_grad_(True)
    k = _uniform_init((L, H, D, head_dim), head_dim, heads, generator, x.device).requires_grad_(True)
    opt = torch.optim.Adam([q, k], lr=lr)
    xb = x.unsqueeze(1)
    ref_norm = q.detach().norm(dim=-2).mean(dim=-1, keepdim=True).unsqueeze(-2)  # [L, H, 1, 1]
    iters = int(iters)
    for i in range(iters):
        if norm_every and i % int(norm_every) == 0:
            with torch.no_grad():
                q.mul_(ref_norm / q.norm(dim=-2, keepdim=True))  # columns of Q (norm over D)
                k.mul_(ref_norm / k.norm(dim=-1, keepdim=True))  # rows of K, i.e. columns of K^T
        opt.zero_grad(set_to_none=True)
        attn = torch.softmax(attention_logits(xb, q, k, mask), dim=-1)
        loss = ((attn - targets) ** 2).mean(dim=(-1, -2)).sum()
        loss.backward()
        opt.step()
        if progress is not None and (i + 1) % 100 == 0:
            progress(i + 1, iters)
    return q.detach(), k.detach()


def solve_paper(x, targets, head_dim, heads, generator, iters=10000, lr=1e-4, progress=None, mask=None):
    """Algorithm 1 as the paper states it. See the module docstring for shapes."""
    return _adam_mse(x, targets, head_dim, heads, generator, iters, lr, 0, progress, mask)


def solve_released(x, targets, head_dim, heads, generator, iters=10000, lr=1e-4, norm_every=100, progress=None,
                   mask=None):
    """Algorithm 1 with the released code's periodic norm reset. See the module docstring."""
    return _adam_mse(x, targets, head_dim, heads, generator, iters, lr, norm_every, progress, mask)


def lowrank_logit_fit(x: torch.Tensor, logits: torch.Tensor, head_dim: int, ridge: float = 0.0,
                      rcond: float = 1e-6) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rank-``d`` bilinear fit ``x q (x k)^T / sqrt(d) ~ logits``, ridge-regularized.

    ``x: [L, N, D]``, ``logits: [L, H, N, N]`` -> ``q, k: [L, H, D, d]`` (float64).
    With ``x = U S V^T`` the fit works in ``x``'s column space: ``B = U^T logits U`` is shrunk
    entrywise by ``s_i^2 s_j^2 / (s_i^2 s_j^2 + ridge * s_max^4)`` (the closed form of
    ``min |x A x^T - logits|^2 + lambda |A|^2``), truncated to rank ``d`` by SVD and mapped back
    with ``V S^-1``. The ridge keeps weak pseudo-input directions (a LayerNorm'd sin-cos embedding
    is far from full rank) from blowing up the weights and breaks the tie between equally good
    subspaces in favour of the strong ones. ``rcond`` drops singular values below
    ``rcond * s_max`` (a pseudo-inverse cut-off).
    """
    u, s, vh = torch.linalg.svd(x.double(), full_matrices=False)
    u, s, v = u.unsqueeze(1), s.unsqueeze(1), vh.transpose(-1, -2).unsqueeze(1)
    b = u.transpose(-1, -2) @ logits.double() @ u  # logits in x's column space, [L, H, r, r]
    if ridge > 0:
        w = s.unsqueeze(-1) ** 2 * s.unsqueeze(-2) ** 2
        b = b * (w / (w + ridge * s[..., :1, None] ** 4))
    p, sig, rh = torch.linalg.svd(b)
    root = (sig[..., :head_dim].sqrt() * head_dim ** 0.25).unsqueeze(-2)
    s_inv = torch.where(s > rcond * s[..., :1], 1.0 / s, torch.zeros_like(s))
    back = v * s_inv.unsqueeze(-2)  # whitened coordinates -> input space: [L, 1, D, r]
    q = back @ (p[..., :head_dim] * root)
    k = back @ (rh.transpose(-1, -2)[..., :head_dim] * root)
    return q, k


def mass_logit_gap(target_mass: float, n: int) -> float:
    """Logit gap ``c`` that gives mass ``m`` on one of ``n`` tokens when the others tie."""
    return math.log(target_mass * (n - 1) / (1 - target_mass))


def calibrate_temperature(x, q, k, targets, target_mass: float, steps: int = 50, mask=None):
    """Scale each head's ``q, k`` by one scalar so its mean target mass equals ``target_mass``
    (under ``mask`` when given). Bisection on ``log`` of the logit scale, batched over all heads;
    returns the scaled q, k.
    """
    xb = x.unsqueeze(1).to(q.dtype)
    base = attention_logits(xb, q, k, mask)  # [L, H, N, N]
    has = targets.sum(-1) > 0
    tcol = targets.argmax(-1, keepdim=True)
    rows = has.sum(-1).clamp(min=1)

    def mass(log_scale):
        p = torch.softmax(base * log_scale.exp()[..., None, None], dim=-1)
        return (p.gather(-1, tcol).squeeze(-1) * has).sum(-1) / rows

    lo = torch.full(base.shape[:2], -12.0, dtype=base.dtype, device=base.device)
    hi = torch.full_like(lo, 12.0)
    for _ in range(steps):
        mid = (lo + hi) / 2
        above = mass(mid) > target_mass
        hi = torch.where(above, mid, hi)
        lo = torch.where(above, lo, mid)
    root = ((lo + hi) / 2).exp().sqrt()[..., None, None]
    return q * root, k * root


def solve_fast(x, targets, head_dim, heads, generator, target_mass=0.3, ridge=1e-5, progress=None, mask=None):
    """Closed-form low-rank logit fit + per-head temperature calibration. See the module docstring."""
    n = targets.shape[-1]
    if not (1.0 / n < target_mass < 1.0):
        raise UsageError(f"{param('target_mass')} must lie in (1/N, 1) = ({1.0 / n:.4g}, 1), got {target_mass}")
    gap = mass_logit_gap(min(target_mass, 0.999), n)
    centred = targets.double() - targets.double().mean(-1, keepdim=True)
    q, k = lowrank_logit_fit(x, gap * centred, head_dim, ridge=ridge)
    q, k = calibrate_temperature(x.double(), q, k, targets, target_mass, mask=mask)
    return q.float(), k.float()


def solve_closed_form(x, targets, head_dim, heads, generator, logit=10.0, noise_std=1.0, qk_scale=7.0, progress=None,
                      mask=None):
    """The authors' later pseudo-inverse + SVD construction. See the module docstring (``mask``
    changes nothing here: hidden logits are simply never seen)."""
    noise = torch.randn(targets.shape, generator=generator, dtype=torch.float64).clamp_(-2, 2) * noise_std
    logits = torch.where(targets.cpu() > 0, torch.full_like(noise, logit), noise).to(x.device)
    q, k = lowrank_logit_fit(x, logits, head_dim)
    q = q / q.norm(dim=(-2, -1), keepdim=True) * qk_scale
    k = k / k.norm(dim=(-2, -1), keepdim=True) * qk_scale
    return q.float(), k.float()


SOLVERS: Dict[str, Solver] = {
    "fast": solve_fast,
    "paper": solve_paper,
    "released": solve_released,
    "closed-form": solve_closed_form,
}
assert set(SOLVERS) == set(RECIPES)
