"""The data fit's maths for one layer: Q/K refined on the inputs a batch gives the layer at init,
then calibrated.

The pseudo-input solve fits Q/K to position alone (the LayerNorm'd position embedding). In a model
whose patch embedding is of the usual scale, the content of real images swamps the position signal
at every layer's input, and the solved offsets are hit in only a small share of query rows. This fit
starts from the pseudo-input solution and refines each layer, in order, on a batch of real inputs:

1. the layer's input is captured on the batch (its norm's output, after the earlier layers, which
   are already initialized and refined);
2. each head's ``Q_h``/``K_h`` are rescaled to Frobenius norm ``norm`` and take ``steps`` Adam
   steps (learning rate ``lr``) on the cross-entropy between the head's attention on the batch and
   a target distribution with ``mass`` on the offset's token and the rest spread evenly over the
   other visible keys, plus ``l2 * (|Q|^2 + |K|^2) / heads``. The penalty matters: a fit without it
   reaches the targets with weights hundreds of times larger than a trained layer's, which AdamW
   barely moves and which make attention hypersensitive to the residual stream as it changes;
3. one temperature per head is set on the batch (the one calibrator,
   :func:`structinit.solver.calibrate.log_scale_root`) so that the mean attention on the target
   token equals ``target_mass``, with no logit above :data:`MAX_LOGIT` in magnitude (a head whose
   hit rate on the batch is below the mass would otherwise be driven to a one-hot, gradient-free
   attention).

Versions (:data:`~structinit.fit.settings.FIT_VERSIONS`; the version enters the run key and the
fitted artifact's key, so a change to what a version computes needs a new number):

- **1** (:func:`refine_qk`, :func:`calibrate_on_batch`): every step on the whole batch (256 images
  by default), the temperature by 60 bisection passes over it. About 100 s for the 4 layers of a
  64-token model on one CPU thread, hours for ViT-T.
- **2** (:func:`refine_qk_minibatch`, :func:`calibrate`), the default: the same loss, optimizer,
  learning rate and number of steps, but each step on a few images drawn from the batch (enough
  for :data:`ROWS_PER_STEP` query rows per head), and the temperature by a safeguarded Newton
  iteration on at most :data:`CALIBRATION_SAMPLES` images. Chosen by measurement: the hit rate on
  held-out real inputs and the trained accuracy are those of version 1 (``docs/bench-fit.md``).

Shapes: inputs ``x: [B, T, D]``; per-head weights ``q, k: [H, D, d]`` (a head attends with
``softmax(x q (x k)^T / sqrt(d))``); ``columns: [H, T]`` the target token of every query row (``-1``
where the offset leaves the grid, and for prefix tokens such as a class token: those rows are not
fitted); ``mask``: bool ``[T, T]`` visible keys or ``None``.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Tuple

import torch

from structinit.solver.calibrate import log_scale_root

#: The largest logit magnitude the calibration allows.
MAX_LOGIT = 30.0
#: Version 2: query rows per head in one step (the step's images: this over the tokens per image).
ROWS_PER_STEP = 1024
#: Version 2: images the temperature is calibrated on (the first of the batch).
CALIBRATION_SAMPLES = 64


def _on(device: torch.device, q: torch.Tensor, k: torch.Tensor, columns: torch.Tensor,
        mask: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``q, k`` (float32, detached), ``columns`` and ``mask`` on ``device``: the fit runs where the
    batch is (a model on a GPU gives its attention inputs on the GPU)."""
    mask = None if mask is None else mask.to(device)
    return q.detach().to(device, torch.float32), k.detach().to(device, torch.float32), columns.to(device), mask


def _logits(x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """``[B, H, N, N]`` attention logits (masked keys at a large negative value)."""
    b, n, dim = x.shape
    h, _, d = q.shape
    xq = (x @ (q / math.sqrt(d)).permute(1, 0, 2).reshape(dim, h * d)).view(b, n, h, d).transpose(1, 2)  # [B, H, N, d]
    xk = (x @ k.permute(1, 0, 2).reshape(dim, h * d)).view(b, n, h, d).transpose(1, 2)
    logits = xq @ xk.transpose(-1, -2)
    if mask is not None:
        logits = logits.masked_fill(~mask, -1e9)
    return logits


def target_distribution(columns: torch.Tensor, mass: float, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[H, N, N]``: for every head and query row with a target, ``mass`` on the target token and
    ``1 - mass`` spread evenly over the other visible keys; rows without a target are zero."""
    h, n = columns.shape
    visible = torch.ones(n, n, dtype=torch.bool, device=columns.device) if mask is None else mask.bool()
    others = (visible.sum(-1) - 1).clamp(min=1).to(torch.float32)  # [N]
    out = torch.zeros(h, n, n, device=columns.device)
    out += (visible.float() * ((1 - mass) / others)[:, None])[None]
    rows = columns >= 0
    hh, ii = torch.nonzero(rows, as_tuple=True)
    out[hh, ii, columns[hh, ii]] = mass
    out[~rows] = 0.0
    return out


def fit_loss(x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, columns: torch.Tensor, mass: float,
             mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The mean cross-entropy, over every image and every (head, query row) with a target, between
    the attention of ``q, k`` on ``x`` and :func:`target_distribution` (a scalar tensor)."""
    heads, n = columns.shape
    rows = (columns >= 0).float()  # [H, N]
    count = rows.sum() * x.shape[0]
    # without building the N x N target: with c the share of every other visible key,
    # -sum_j t_j log p_j = -(c * sum_visible log p_j + (mass - c) * log p_target).
    # log_softmax is one fused kernel each way (logsumexp's guards against infinities cost several
    # passes over the [B, H, N, N] logits, half of a step on the CPU).
    visible = torch.full((n,), float(n), device=x.device) if mask is None else mask.sum(-1).float()
    c = (1 - mass) / (visible - 1).clamp(min=1)  # [N]
    idx = columns.clamp(min=0)[None, :, :, None].expand(x.shape[0], -1, -1, 1)
    logp = torch.log_softmax(_logits(x, q, k, mask), dim=-1)  # [B, H, N, N]
    total = (logp if mask is None else logp.masked_fill(~mask, 0.0)).sum(-1)
    picked = logp.gather(-1, idx).squeeze(-1)
    ce = -(c * total + (mass - c) * picked)
    return (ce * rows[None]).sum() / count.clamp(min=1)


def refine_qk(x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, columns: torch.Tensor, *, steps: int,
              mass: float, l2: float, lr: float, norm: float,
              mask: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rescale every head to Frobenius norm ``norm`` and take ``steps`` Adam steps on the batch
    ``x`` (see the module docstring), on the device ``x`` is on; returns float32 ``q, k: [H, D, d]``
    on the CPU."""
    return _adam_steps(x, q, k, columns, steps=steps, mass=mass, l2=l2, lr=lr, norm=norm, mask=mask)


def _adam_steps(x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, columns: torch.Tensor, *, steps: int,
                mass: float, l2: float, lr: float, norm: float, mask: Optional[torch.Tensor] = None,
                draws: Optional[torch.Tensor] = None,
                tick: Optional[Callable[[], None]] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The fit's Adam steps: every head rescaled to Frobenius norm ``norm``, then ``steps`` steps on
    the fit loss plus the L2 penalty, step ``s`` on ``x[draws[s]]`` (on all of ``x`` without
    ``draws``), ``tick()`` after each. Float32 ``q, k`` on the CPU."""
    x = x.detach().float()
    q, k, columns, mask = _on(x.device, q, k, columns, mask)
    q = (q * (norm / q.norm(dim=(-2, -1), keepdim=True).clamp(min=1e-12))).requires_grad_(True)
    k = (k * (norm / k.norm(dim=(-2, -1), keepdim=True).clamp(min=1e-12))).requires_grad_(True)
    if not bool((columns >= 0).any()):
        return q.detach().cpu(), k.detach().cpu()
    heads = q.shape[0]
    opt = torch.optim.Adam([q, k], lr=lr)
    for s in range(steps):
        batch = x if draws is None else x[draws[s]]
        loss = fit_loss(batch, q, k, columns, mass, mask) + l2 * ((q ** 2).sum() + (k ** 2).sum()) / heads
        opt.zero_grad()
        loss.backward()
        opt.step()
        if tick is not None:
            tick()
    return q.detach().cpu(), k.detach().cpu()


def calibrate_on_batch(x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, columns: torch.Tensor,
                       target_mass: float, mask: Optional[torch.Tensor] = None,
                       steps: int = 60) -> Tuple[torch.Tensor, torch.Tensor]:
    """Scale each head's ``q`` and ``k`` by one factor so that its mean attention on the target
    token over the batch ``x`` equals ``target_mass`` (or the nearest it gets with every logit at
    most :data:`MAX_LOGIT` in magnitude), on the device ``x`` is on; returns float32 ``q, k`` on the CPU."""
    with torch.no_grad():
        x = x.float()
        q, k, columns, mask = _on(x.device, q, k, columns, mask)
        base = _logits(x, q, k, None)  # [B, H, N, N], unmasked: the scale applies to all
        rows = columns >= 0
        idx = columns.clamp(min=0)[None, :, :, None].expand(base.shape[0], -1, -1, 1)
        count = rows.sum(-1).clamp(min=1) * base.shape[0]

        def mass_at(log_s: torch.Tensor) -> torch.Tensor:
            logits = base * log_s.exp()[None, :, None, None]
            if mask is not None:
                logits = logits.masked_fill(~mask, -1e9)
            p = torch.softmax(logits, -1)
            return (p.gather(-1, idx).squeeze(-1) * rows[None]).sum((0, 2)) / count

        top = base.abs().amax(dim=(0, 2, 3)).clamp(min=1e-12)
        hi = (MAX_LOGIT / top).log()
        lo = torch.minimum(torch.full((q.shape[0],), -12.0, device=x.device), hi)
        u = log_scale_root(lambda u: (mass_at(u), None), target_mass, lo, hi, (lo + hi) / 2, max_iter=steps,
                           newton=False)
        root = u.exp().sqrt()[:, None, None]
        return (q * root).cpu(), (k * root).cpu()


# --------------------------------------------------------------------------- version 2

def step_images(tokens: int, batch: int = 0) -> int:
    """Images in one version-2 step: ``batch`` when positive, else enough for
    :data:`ROWS_PER_STEP` query rows per head (``ceil(ROWS_PER_STEP / tokens)``)."""
    return int(batch) if batch > 0 else max(1, -(-ROWS_PER_STEP // int(tokens)))


def refine_qk_minibatch(x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, columns: torch.Tensor, *, steps: int,
                        mass: float, l2: float, lr: float, norm: float, batch: int = 0,
                        mask: Optional[torch.Tensor] = None, seed: int = 0,
                        tick: Optional[Callable[[], None]] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`refine_qk`, each Adam step on :func:`step_images` images drawn (with replacement,
    from a generator seeded with ``seed``) from the batch ``x`` instead of all of it. ``tick()`` is
    called after every step (progress; it may raise to stop the fit). Returns float32 ``q, k`` on the CPU."""
    b = int(x.shape[0])
    size = min(step_images(x.shape[1], batch), b)
    draws = torch.randint(0, b, (steps, size), generator=torch.Generator().manual_seed(int(seed))).to(x.device)
    return _adam_steps(x, q, k, columns, steps=steps, mass=mass, l2=l2, lr=lr, norm=norm, mask=mask, draws=draws,
                       tick=tick)


def calibrate(x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, columns: torch.Tensor, target_mass: float,
              mask: Optional[torch.Tensor] = None, samples: int = CALIBRATION_SAMPLES, tol: float = 1e-4,
              max_iter: int = 40) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`calibrate_on_batch` on the first ``samples`` images of ``x``, solved by Newton's
    method on the log of each head's scale (safeguarded: a step that leaves the bracket of the
    root is a bisection step instead) until the mean target mass is within ``tol`` of
    ``target_mass``; a head that cannot reach it within :data:`MAX_LOGIT` ends at that bound.
    Returns float32 ``q, k`` on the CPU."""
    with torch.no_grad():
        x = x[:samples].float()
        q, k, columns, mask = _on(x.device, q, k, columns, mask)
        base = _logits(x, q, k, None)  # [B, H, T, T], unmasked: the scale applies to all
        rows = columns >= 0
        idx = columns.clamp(min=0)[None, :, :, None].expand(base.shape[0], -1, -1, 1)
        count = rows.sum(-1).clamp(min=1) * base.shape[0]
        target_logit = base.gather(-1, idx).squeeze(-1)  # [B, H, T]

        def mass_and_slope(u: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
            s = u.exp()[None, :, None, None]
            logits = base * s
            if mask is not None:
                logits = logits.masked_fill(~mask, -1e9)
            p = torch.softmax(logits, -1)
            pt = p.gather(-1, idx).squeeze(-1)
            mean_logit = (p * base).sum(-1)  # the attention-weighted logit of each row
            m = (pt * rows[None]).sum((0, 2)) / count
            # d m / d log s = s * mean over rows of p_t (l_t - sum_j p_j l_j)
            dm = (pt * (target_logit - mean_logit) * rows[None]).sum((0, 2)) / count * u.exp()
            return m, dm

        heads = q.shape[0]
        top = base.abs().amax(dim=(0, 2, 3)).clamp(min=1e-12)
        hi = (MAX_LOGIT / top).log()
        lo = torch.minimum(torch.full((heads,), -12.0, device=x.device), hi)
        start = torch.minimum(torch.zeros(heads, device=x.device), hi)  # from the fitted scale
        u = log_scale_root(mass_and_slope, target_mass, lo, hi, start, max_iter=max_iter, tol=tol, min_slope=1e-12,
                           stop_if_unreachable=True)
        root = u.exp().sqrt()[:, None, None]
        return (q * root).cpu(), (k * root).cpu()
