"""The one target-mass calibrator: the scale of each head's logits at which its mean attention on
the target token equals a target mass.

A head's attention on the target token grows monotonically with the scale ``s = e^u`` of its logits
(a sharper softmax puts more on the largest logit, which calibration is only asked for where the
target's logit is the largest on average). :func:`log_scale_root` finds, per head, the log-scale
``u`` at which ``mass(u) == target``: Newton steps on ``u`` kept inside a bisection bracket (a step
that leaves the bracket is replaced by its midpoint), or plain bisection. The solver calibrates
each solved head on the pseudo input with it (:func:`structinit.solver.algorithms.calibrate_head`),
the data fit each fitted head on a batch of layer inputs (:mod:`structinit.fit.refine`).

Shapes: every argument and result is a tensor ``[H]`` (one entry per head) of one dtype;
``mass_and_slope(u)`` returns ``(mass [H], d mass / d u [H])`` (the slope may be ``None`` when
``newton`` is off).
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

MassAndSlope = Callable[[torch.Tensor], Tuple[torch.Tensor, Optional[torch.Tensor]]]


def log_scale_root(mass_and_slope: MassAndSlope, target: float, lo: torch.Tensor, hi: torch.Tensor,
                   start: torch.Tensor, *, max_iter: int, tol: Optional[float] = None, newton: bool = True,
                   min_slope: float = 0.0, bracket_tol: Optional[float] = None,
                   stop_if_unreachable: bool = False) -> torch.Tensor:
    """Per head, the log-scale ``u`` in ``[lo, hi]`` at which ``mass_and_slope(u)[0] == target``.

    From ``start``, at most ``max_iter`` evaluations. After each, a head whose mass is within
    ``tol`` of ``target`` is done (it keeps that ``u``); the others narrow their bracket (``u`` is
    the new ``hi`` where the mass is above ``target``, else the new ``lo``) and are done when it is
    narrower than ``bracket_tol``; the next ``u`` is the Newton step where the slope exceeds
    ``min_slope`` and the step stays strictly inside the bracket, else the bracket's midpoint
    (always the midpoint without ``newton``). ``stop_if_unreachable``: a head whose mass at ``hi``
    is at most ``target`` cannot reach it and ends at ``hi`` (one evaluation first). Done heads stop
    moving, and the loop ends once every head is done. Returns ``u [H]``."""
    u = start.clone()
    done = torch.zeros_like(u, dtype=torch.bool)
    if stop_if_unreachable:
        m_hi, _ = mass_and_slope(hi)
        done |= m_hi <= target
        u = torch.where(done, hi, u)
    for _ in range(max_iter):
        m, dm = mass_and_slope(u)
        if tol is not None:
            done |= (m - target).abs() <= tol
            if bool(done.all()):
                break
        above = m > target
        hi = torch.where(above & ~done, u, hi)
        lo = torch.where(~above & ~done, u, lo)
        if bracket_tol is not None:
            done |= (hi - lo) <= bracket_tol
            if bool(done.all()):
                break
        nxt = (lo + hi) / 2
        if newton:
            assert dm is not None, "newton needs the slope from mass_and_slope"
            step = u - (m - target) / dm.clamp(min=min_slope)
            nxt = torch.where((step > lo) & (step < hi) & (dm > min_slope), step, nxt)
        u = torch.where(done, u, nxt)
    return u


__all__ = ["log_scale_root"]
