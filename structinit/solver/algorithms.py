"""Solvers: Q/K whose attention on the pseudo input approximates impulse targets.

Every solver is batched over layers x heads and has the signature
``solver(x, columns, head_dim, heads, generator, progress=None, **params) -> (q, k)`` with

- ``x: [L, N, D]`` the pseudo input of each layer,
- ``columns: [L, H, N]`` int64, the impulse target of every query row: the column of its one
  target token, ``-1`` for a row without one (zero padding at the border); the dense ``N x N``
  target of a head is the 0/1 matrix with those ones (:func:`dense_targets`),
- ``q, k: [L, H, D, d]`` so that head ``h`` of layer ``l`` attends with
  ``softmax(x q (x k)^T / sqrt(d))``,
- ``progress(done, total)`` called as the work advances,
- ``mask`` (keyword, optional): bool ``[N, N]``, the keys each query may see (a causal decoder's
  mask); the attention that is fitted, calibrated and measured is then the masked one.

Recipes (``RECIPES``):

- ``fast`` (default): closed-form, ridge-regularized rank-``d`` fit of impulse logits (the gap
  that gives ``target_mass`` on the target token) in the pseudo input's column space, then a
  per-head temperature calibrated so that the mean attention mass on the target token equals
  ``target_mass``. Softness is an explicit knob, not an accident of iteration counts. It never
  forms an ``N x N`` target: an impulse target is a shift, so its projection ``U^T T U`` onto the
  input's column space is a row gather of ``U`` (``O(N r^2)`` for the input's numerical rank
  ``r``: directions below the pseudo-inverse cut-off carry no weight and are dropped first, which
  leaves ~35 of 768 for a LayerNorm'd sin-cos table on a 28x28 grid); heads of the same input and
  offset share one solve; the temperature is calibrated on row chunks of the logits. Time
  ``O(N D^2 + G (N r^2 + r^3 + N^2 d))`` for ``G`` distinct (input, offset) pairs (at most
  ``f^2`` per distinct pseudo input), memory ``O(N D)`` plus a bounded logit chunk.
- ``paper``: Algorithm 1 of the structured-initialization paper as written (uniform init, Adam
  lr 1e-4, 10,000 iterations, MSE loss, scale 1/sqrt(d)). Dense: ``O(L H N^2)`` memory.
- ``released``: the authors' released code: as ``paper`` but every ``norm_every`` iterations
  (from iteration 0) Q's columns and K's rows are rescaled to the mean initial column norm of Q,
  which keeps the attention soft (target mass ~0.2 on the ViT-T shape).
- ``closed-form``: this project's variant of the authors' later construction, *not* their exact
  recipe: target logits ``logit`` (10) on impulse entries and ``noise_std`` (1) times a standard
  normal *clamped* at +-2 elsewhere, fitted through the full pseudo-inverse of ``x`` (every
  singular direction above :data:`RCOND`) with the rank-``d`` truncation done in ``x``'s whitened
  column space (:func:`lowrank_logit_fit`), each factor normalized to unit Frobenius norm and
  scaled by ``qk_scale``; on whatever pseudo input the solve has (the sin-cos table by default).
  Dense (the noise is ``N x N``). Kept for the artifacts made with it; ``authors-2025`` is the
  exact construction.
- ``authors-2025``: the closed form of "Structured Initialization for Vision Transformers"
  (NeurIPS 2025) exactly as the authors' code computes it (:func:`solve_authors_2025`): logits
  1000 on impulse entries and 3 x trunc-normal(std 0.6, truncated to [-2, 2] by inverse-CDF
  sampling) elsewhere, fresh for every layer; the rank-``d`` pseudo-inverse
  ``P+ = (P^T P)^+_d P^T`` of the pseudo input; ``A_h = P+ W_h P+^T``; ``Q_h = U_d S_d^1/2``,
  ``K_h = V_d S_d^1/2`` from the SVD of ``A_h``; each factor at unit Frobenius norm per head, then
  x7. Q/K are the authors' weights as they write them into timm's attention, which applies the
  ``1/sqrt(d)`` itself, so the convention above holds with these Q/K unchanged (the logits a head
  computes are not ``W_h``: their scale is set by the x7 norms). The 2025 pseudo input (LayerNorm
  of 18 x a random learnable position embedding) belongs to the init method ``impulse-2025``;
  this recipe uses the ``x`` it is given. Dense (the noise is ``N x N``, one layer at a time).
"""

from __future__ import annotations

import math
import time
from typing import Callable, Dict, Optional, Tuple

import torch

from structinit.analysis.quality import attention_logits
from structinit.errors import UsageError, param
from structinit.solver.calibrate import log_scale_root
from structinit.solver.recipes import RECIPE_DEFAULTS, RECIPES

Solver = Callable[..., Tuple[torch.Tensor, torch.Tensor]]

#: Bytes of float64 logits the fast recipe keeps per head while calibrating; larger heads are
#: recomputed in row chunks of about :data:`CHUNK_BYTES` on every step instead.
CACHE_BYTES = 256 * 2 ** 20
CHUNK_BYTES = 32 * 2 ** 20
#: Passes over the logits a head's calibration typically takes (for progress only).
PASSES = 6
#: Singular values of the pseudo input below ``RCOND`` times the largest are cut off (a pseudo-inverse).
RCOND = 1e-6


def dense_targets(columns: torch.Tensor, n: int, dtype=torch.float32) -> torch.Tensor:
    """The 0/1 targets ``[..., N, N]`` of target columns ``[..., N]`` (``-1``: an empty row)."""
    out = torch.zeros(columns.shape + (n,), dtype=dtype, device=columns.device)
    has = columns >= 0
    out.scatter_(-1, columns.clamp(min=0).unsqueeze(-1), has.unsqueeze(-1).to(dtype))
    return out


def _uniform_init(shape, head_dim: int, heads: int, generator: torch.Generator, device) -> torch.Tensor:
    """Uniform in +-sqrt(1 / (d * heads)), drawn on the CPU generator (device independent)."""
    bound = math.sqrt(1.0 / (head_dim * heads))
    w = (2 * torch.rand(shape, generator=generator, dtype=torch.float32) - 1) * bound
    return w.to(device)


def _adam_mse(x, columns, head_dim, heads, generator, iters, lr, norm_every=0, progress=None, mask=None):
    """Adam on the per-head MSE (summed over heads, so each head sees its own Algorithm 1)."""
    L, H, N = columns.shape
    targets = dense_targets(columns, N)
    D = x.shape[-1]
    q = _uniform_init((L, H, D, head_dim), head_dim, heads, generator, x.device).requires_grad_(True)
    k = _uniform_init((L, H, D, head_dim), head_dim, heads, generator, x.device).requires_grad_(True)
    opt = torch.optim.Adam([q, k], lr=lr)
    xb = x.unsqueeze(1)
    ref_norm = q.detach().norm(dim=-2).mean(dim=-1, keepdim=True).unsqueeze(-2)  # [L, H, 1, 1]
    iters = int(iters)
    last = time.monotonic()
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
        # every 100 steps, or every step once steps take a second (a large shape: minutes per 100)
        if progress is not None and ((i + 1) % 100 == 0 or i + 1 == iters or time.monotonic() - last >= 1.0):
            progress(i + 1, iters)
            last = time.monotonic()
    return q.detach(), k.detach()


# Each solver's defaults are its recipe's (declared once, in structinit.solver.recipes).
_PAPER, _RELEASED, _CLOSED, _AUTHORS = (RECIPE_DEFAULTS[name] for name in ("paper", "released", "closed-form",
                                                                       "authors-2025"))


def solve_paper(x, columns, head_dim, heads, generator, iters=_PAPER["iters"], lr=_PAPER["lr"], progress=None,
                mask=None):
    """Algorithm 1 as the paper states it. See the module docstring for shapes."""
    return _adam_mse(x, columns, head_dim, heads, generator, iters, lr, 0, progress, mask)


def solve_released(x, columns, head_dim, heads, generator, iters=_RELEASED["iters"], lr=_RELEASED["lr"],
                   norm_every=_RELEASED["norm_every"], progress=None, mask=None):
    """Algorithm 1 with the released code's periodic norm reset. See the module docstring."""
    return _adam_mse(x, columns, head_dim, heads, generator, iters, lr, norm_every, progress, mask)


def _factor(b: torch.Tensor, s: torch.Tensor, v: torch.Tensor, head_dim: int, ridge: float,
            rcond: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rank-``d`` factors of logits ``b [..., r, r]`` given in the whitened column space of ``x``
    (singular values ``s [..., r]``, right singular vectors ``v [..., D, r]``): ridge shrink,
    SVD, map back with ``V S^-1``. See :func:`lowrank_logit_fit`."""
    if ridge > 0:
        w = s.unsqueeze(-1) ** 2 * s.unsqueeze(-2) ** 2
        b = b * (w / (w + ridge * s[..., :1, None] ** 4))
    p, sig, rh = torch.linalg.svd(b)
    root = (sig[..., :head_dim].sqrt() * head_dim ** 0.25).unsqueeze(-2)
    s_inv = torch.where(s > rcond * s[..., :1], 1.0 / s, torch.zeros_like(s))
    back = v * s_inv.unsqueeze(-2)  # whitened coordinates -> input space: [..., D, r]
    q = back @ (p[..., :head_dim] * root)
    k = back @ (rh.transpose(-1, -2)[..., :head_dim] * root)
    return q, k


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
    return _factor(b, s, v, head_dim, ridge, rcond)


def impulse_projection(u: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """``U^T C U`` for the centred impulse target ``C = T - rowmean(T)`` of target columns
    ``[N]``, with ``u: [N, r]`` (float64), in ``O(N r^2)`` and without forming ``T``: ``T U`` is
    the rows of ``U`` at the target columns (zero rows where there is none), and the row means of
    ``T`` are ``1/N`` on rows with a target."""
    n = u.shape[0]
    has = (columns >= 0).to(u.dtype)
    tu = u.index_select(0, columns.clamp(min=0)) * has.unsqueeze(-1)
    return u.transpose(-1, -2) @ tu - torch.outer(u.transpose(-1, -2) @ has / n, u.sum(0))


def mass_logit_gap(target_mass: float, n: int) -> float:
    """Logit gap ``c`` that gives mass ``m`` on one of ``n`` tokens when the others tie."""
    return math.log(target_mass * (n - 1) / (1 - target_mass))


def _row_chunks(n: int, budget: int = CHUNK_BYTES):
    step = max(1, min(n, budget // (8 * 3 * max(n, 1))))
    return [(i, min(i + step, n)) for i in range(0, n, step)]


def calibrate_head(xq: torch.Tensor, xk: torch.Tensor, columns: torch.Tensor, target_mass: float,
                   tol: float = 1e-13, max_steps: int = 200, on_chunk: Optional[Callable[[], None]] = None,
                   start: float = 0.0, mask: Optional[torch.Tensor] = None) -> float:
    """The log-scale ``t`` in ``[-12, 12]`` at which the mean attention on the target token of one
    head, ``softmax(e^t xq xk^T / sqrt(d))`` over the rows that have a target, equals ``target_mass``
    (found by :func:`~structinit.solver.calibrate.log_scale_root`).

    ``xq, xk: [N, d]`` float64 (the projected input), ``columns: [N]``, ``mask``: bool ``[N, N]``
    visible keys or ``None`` (see the module docstring). Newton steps on ``t``
    inside a bisection bracket (a step that leaves the bracket is replaced by the midpoint), so it
    converges to the root the plain bisection converges to, in a handful of passes over the
    logits; the logits are kept when they fit in :data:`CACHE_BYTES`, else recomputed in row
    chunks on every pass."""
    n, d = xq.shape
    has = columns >= 0
    rows = max(int(has.sum()), 1)
    chunks = _row_chunks(n)
    cached = [None] * len(chunks) if n * n * 8 <= CACHE_BYTES else None
    scale = 1.0 / math.sqrt(d)

    def logits(i, a, b):
        if cached is not None and cached[i] is not None:
            return cached[i]
        out = (xq[a:b] @ xk.transpose(0, 1)) * scale
        if mask is not None:  # hidden keys: a finite floor, so exp() is 0 and 0 * z stays 0
            out = out.masked_fill(~mask[a:b], -1e30)
        if cached is not None:
            cached[i] = out
        return out

    def mass_and_slope(t: float):
        s = math.exp(t)
        m = dm = 0.0
        for i, (a, b) in enumerate(chunks):
            z = logits(i, a, b) * s
            z.sub_(z.amax(-1, keepdim=True))  # shifted by the row max (nothing below depends on the shift)
            e = torch.exp(z)
            total = e.sum(-1)
            mean_z = torch.einsum("ij,ij->i", e, z) / total
            col = columns[a:b].clamp(min=0).unsqueeze(-1)
            keep = has[a:b]
            p_t = e.gather(-1, col).squeeze(-1) / total * keep
            m += float(p_t.sum())
            dm += float((p_t * (z.gather(-1, col).squeeze(-1) - mean_z)).sum())
            if on_chunk is not None:
                on_chunk()
        return m / rows, dm / rows

    def f(u: torch.Tensor):
        m, dm = mass_and_slope(float(u))
        return torch.tensor([m], dtype=torch.float64), torch.tensor([dm], dtype=torch.float64)

    def bound(v: float) -> torch.Tensor:
        return torch.tensor([v], dtype=torch.float64)

    t = log_scale_root(f, target_mass, bound(-12.0), bound(12.0), bound(min(max(start, -11.0), 11.0)),
                       max_iter=max_steps, tol=tol, bracket_tol=tol)
    return float(t)


def distinct_heads(x: torch.Tensor, columns: torch.Tensor):
    """Heads that pose the same problem (the same pseudo input and target).

    ``x: [L, N, D]``, ``columns: [L, H, N]`` -> ``(inputs, first, inverse)``: ``inputs [L]`` the
    first layer with the same pseudo input as each layer, ``first [G, 2]`` one ``(layer, head)`` of
    each distinct pair (in order of first appearance) and ``inverse [L, H]`` the pair of every head."""
    L, H, N = columns.shape
    inputs = list(range(L))

    def same(a, b):
        return a.data_ptr() == b.data_ptr() and a.stride() == b.stride() or torch.equal(a, b)

    for l in range(1, L):
        inputs[l] = next((m for m in range(l) if inputs[m] == m and same(x[l], x[m])), l)
    rows = torch.cat([torch.tensor(inputs).view(L, 1, 1).expand(L, H, 1), columns.cpu()], -1).reshape(L * H, -1)
    _, inverse = torch.unique(rows, dim=0, return_inverse=True)
    order: Dict[int, int] = {}
    for i, u in enumerate(inverse.tolist()):
        order.setdefault(u, i)
    relabel = torch.empty(len(order), dtype=torch.long)
    for new, u in enumerate(order):
        relabel[u] = new
    first = torch.tensor([[i // H, i % H] for i in order.values()], dtype=torch.long).view(-1, 2)
    return torch.tensor(inputs), first, relabel[inverse].view(L, H)


def solve_fast(x, columns, head_dim, heads, generator, target_mass=RECIPE_DEFAULTS["fast"]["target_mass"],
               ridge=RECIPE_DEFAULTS["fast"]["ridge"], progress=None, mask=None):
    """Closed-form low-rank logit fit + per-head temperature calibration, once per distinct
    (pseudo input, offset) pair. See the module docstring."""
    L, H, n = columns.shape
    if not (1.0 / n < target_mass < 1.0):
        raise UsageError(f"{param('target_mass')} must lie in (1/N, 1) = ({1.0 / n:.4g}, 1), got {target_mass}")
    gap = mass_logit_gap(min(target_mass, 0.999), n)
    inputs, first, inverse = distinct_heads(x, columns)
    qs: Dict[int, torch.Tensor] = {}  # by distinct head (every one of first is solved below)
    ks: Dict[int, torch.Tensor] = {}
    # Progress in row-chunk passes of the calibration (about PASSES per head), the part that grows as N^2.
    per_head = PASSES * len(_row_chunks(n))
    done = [0, 0]  # heads finished, chunks of the current head
    t = 0.0  # each head's calibration starts from the last one's answer

    def tick():
        done[1] += 1
        if progress is not None:
            progress(done[0] * per_head + min(done[1], per_head - 1), len(first) * per_head)

    for src in sorted(set(inputs.tolist())):  # one input's SVD in memory at a time
        xl = x[src].double()
        u, s, vh = torch.linalg.svd(xl, full_matrices=False)
        # Directions below the pseudo-inverse cut-off contribute nothing to Q, K (they are mapped back
        # with weight 0): drop them before the fit. A LayerNorm'd sin-cos table keeps ~35 of 768 on a
        # 28x28 grid, so the r x r fit below is tiny.
        keep = s > RCOND * s[0]
        u, s, v = u[:, keep], s[keep], vh.transpose(-1, -2)[:, keep]
        for g, (l, h) in enumerate(first.tolist()):
            if int(inputs[l]) != src:
                continue
            q, k = _factor(gap * impulse_projection(u, columns[l, h]), s, v, head_dim, ridge, RCOND)
            if q.shape[-1] < head_dim:  # a pseudo input of lower rank than d: the other columns are zero
                q, k = (torch.nn.functional.pad(w, (0, head_dim - w.shape[-1])) for w in (q, k))
            t = calibrate_head(xl @ q, xl @ k, columns[l, h], target_mass, on_chunk=tick, start=t, mask=mask)
            qs[g], ks[g] = q * math.exp(t / 2), k * math.exp(t / 2)
            done[0], done[1] = done[0] + 1, 0
            if progress is not None:
                progress(done[0] * per_head, len(first) * per_head)
        del u, s, v, xl
    heads_solved = range(len(first))
    return (torch.stack([qs[g] for g in heads_solved])[inverse].float(),
            torch.stack([ks[g] for g in heads_solved])[inverse].float())


def solve_closed_form(x, columns, head_dim, heads, generator, logit=_CLOSED["logit"], noise_std=_CLOSED["noise_std"],
                      qk_scale=_CLOSED["qk_scale"], progress=None,
                      mask=None):
    """This project's variant of the authors' later pseudo-inverse + SVD construction (not their
    exact recipe, which is :func:`solve_authors_2025`): logit 10 and a clamped standard normal by
    default, the full pseudo-inverse of ``x`` (:func:`lowrank_logit_fit`). See the module
    docstring (``mask`` changes nothing here: hidden logits are simply never seen)."""
    n = columns.shape[-1]
    noise = torch.randn(columns.shape + (n,), generator=generator, dtype=torch.float64).clamp_(-2, 2) * noise_std
    targets = dense_targets(columns.cpu(), n)
    logits = torch.where(targets > 0, torch.full_like(noise, logit), noise).to(x.device)
    del targets
    q, k = lowrank_logit_fit(x, logits, head_dim)
    q = q / q.norm(dim=(-2, -1), keepdim=True) * qk_scale
    k = k / k.norm(dim=(-2, -1), keepdim=True) * qk_scale
    if progress is not None:
        progress(1, 1)
    return q.float(), k.float()


def trunc_normal(shape, std: float, bound: float, generator: torch.Generator, dtype=torch.float64) -> torch.Tensor:
    """``N(0, std)`` truncated to ``[-bound, bound]``, sampled as timm's ``trunc_normal_`` does: a
    uniform draw between the CDF values of the bounds mapped through the inverse normal CDF (the
    final clamp only guards against rounding). The tails are redrawn inside the bounds, not clamped
    onto them, so no mass piles up at ``+-bound``. Drawn on the CPU ``generator`` (device independent)."""

    def cdf(v: float) -> float:
        return (1.0 + math.erf(v / math.sqrt(2.0))) / 2.0

    lo, hi = cdf(-bound / std), cdf(bound / std)
    u = torch.rand(shape, generator=generator, dtype=dtype) * (2 * hi - 2 * lo) + (2 * lo - 1)
    return (torch.erfinv(u) * (std * math.sqrt(2.0))).clamp_(-bound, bound)


def authors_2025_logits(columns: torch.Tensor, generator: torch.Generator, logit: float = 1000.0,
                        noise_scale: float = 3.0, noise_std: float = 0.6, noise_bound: float = 2.0) -> torch.Tensor:
    """The 2025 closed form's target logits, float64 ``[..., N, N]`` for target columns ``[..., N]``:
    ``logit`` on every impulse entry, ``noise_scale * trunc_normal(noise_std, +-noise_bound)``
    (:func:`trunc_normal`) on every other entry (a border row without a target is all noise). Each
    call draws fresh noise from ``generator``."""
    n = columns.shape[-1]
    noise = trunc_normal(tuple(columns.shape) + (n,), noise_std, noise_bound, generator)
    impulse = dense_targets(columns.cpu(), n, dtype=torch.float64) > 0
    return torch.where(impulse, torch.full_like(noise, logit), noise_scale * noise)


def rank_d_pinv(p: torch.Tensor, rank: int, rcond: float = RCOND) -> torch.Tensor:
    """The rank-``rank`` pseudo-inverse ``P+ = (P^T P)^+_d P^T``, float64 ``[..., D, N]`` of
    ``p [..., N, D]``, as the authors' 2025 code forms it: the SVD of the symmetric ``P^T P`` (its
    eigendecomposition), ``1/s`` on its ``rank`` largest singular values and 0 on the rest, so
    ``P+`` maps onto the top-``rank`` principal directions of ``P``. Singular values of ``P^T P``
    below ``rcond^2`` times the largest (directions ``P`` does not have) count as zero."""
    p = p.double()
    ptp = p.transpose(-1, -2) @ p
    u, s, vh = torch.linalg.svd(ptp)
    keep = torch.arange(s.shape[-1], device=s.device) < rank
    keep = keep & (s > rcond ** 2 * s[..., :1])
    s_inv = torch.where(keep, 1.0 / s, torch.zeros_like(s))
    ptp_inv = vh.transpose(-1, -2) @ (s_inv.unsqueeze(-1) * u.transpose(-1, -2))  # V diag(s_inv) U^T
    return ptp_inv @ p.transpose(-1, -2)


def solve_authors_2025(x, columns, head_dim, heads, generator, logit=_AUTHORS["logit"],
                       noise_scale=_AUTHORS["noise_scale"], noise_std=_AUTHORS["noise_std"],
                       noise_bound=_AUTHORS["noise_bound"], qk_scale=_AUTHORS["qk_scale"], progress=None, mask=None):
    """The closed form of "Structured Initialization for Vision Transformers" (NeurIPS 2025), as the
    authors' code computes it, one layer at a time (fresh noise per layer, from ``generator``):

    1. ``W_h``: :func:`authors_2025_logits` (``logit`` on impulse entries, noise elsewhere);
    2. ``P+ = (P^T P)^+_d P^T`` of the layer's pseudo input ``P = x[l]`` (:func:`rank_d_pinv`,
       ``d = head_dim``);
    3. ``A_h = P+ W_h P+^T`` (``D x D``), SVD ``A_h = U S V^T`` truncated to rank ``d``:
       ``Q_h = U_d S_d^1/2``, ``K_h = V_d S_d^1/2``;
    4. each of ``Q_h`` and ``K_h`` divided by its Frobenius norm and multiplied by ``qk_scale``.

    The result is written into a model as it is (``Q_h^T`` the q rows of head ``h``), which
    attends with ``softmax(x Q_h (x K_h)^T / sqrt(d))`` as timm's attention does; see the module
    docstring. ``mask`` changes nothing (the construction is for image grids). Memory: one layer's
    ``[H, N, N]`` logits in float64 at a time.
    """
    L = columns.shape[0]
    qs, ks = [], []
    pinv = None
    for l in range(L):
        logits = authors_2025_logits(columns[l], generator, logit, noise_scale, noise_std, noise_bound).to(x.device)
        if pinv is None or not torch.equal(x[l], x[l - 1]):
            pinv = rank_d_pinv(x[l], head_dim)
        a = pinv @ logits @ pinv.transpose(-1, -2)  # [H, D, D]
        del logits
        u, s, vh = torch.linalg.svd(a)
        root = s[..., :head_dim].sqrt().unsqueeze(-2)
        q = u[..., :head_dim] * root
        k = vh.transpose(-1, -2)[..., :head_dim] * root
        qs.append(q / q.norm(dim=(-2, -1), keepdim=True) * qk_scale)
        ks.append(k / k.norm(dim=(-2, -1), keepdim=True) * qk_scale)
        if progress is not None:
            progress(l + 1, L)
    return torch.stack(qs).float(), torch.stack(ks).float()


SOLVERS: Dict[str, Solver] = {
    "fast": solve_fast,
    "paper": solve_paper,
    "released": solve_released,
    "closed-form": solve_closed_form,
    "authors-2025": solve_authors_2025,
}
assert set(SOLVERS) == set(RECIPES)
