"""Conditioned initialization (Saratchandran and Lucey, "Conditioned Initialization for Attention").

The paper bounds the condition number of the attention layer's Jacobian by those of its query, key
and value weights, and starts each at condition number 1: per head, ``W_Q`` and ``W_K`` (``[D, d]``
in the ``x @ W`` convention) are semi-orthogonal (orthonormal columns) and ``W_V`` is the
rectangular identity. No code was released; what the paper leaves open is chosen here:

- **which rectangular identity**: head ``h``'s value weight selects the stream's coordinates
  ``h*d .. (h+1)*d`` (its own rows of the whole ``[D, D]`` value weight, which is then the identity),
  so that the heads together pass the whole stream on;
- **the scales**: ``qk_scale`` multiplies every head's semi-orthogonal ``W_Q`` and ``W_K`` (all
  their singular values equal it; condition number 1 at any scale), ``v_scale`` the identity;
  ``qk_scale``'s default, 2.0, was chosen on a validation split (docs/results/conditioned: of
  0.5, 1, 2 and 4 at 2,000 Fashion-MNIST images in 7x7 patches, 3 seeds each);
- **the draw**: ``W_Q`` and ``W_K`` are independent Haar-random (the QR of a Gaussian, signs fixed
  by ``R``'s diagonal), fresh per head and per layer, from the init's seed;
- **the output projection** and every other weight: left at ``base`` (not written);
- **biases**: the query, key and value biases are zeroed (the paper's analysis has none).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

from structinit.errors import param
from structinit.geometry.targets import check_choice
from structinit.init.base import InitSpec, register
from structinit.init.baselines import BASES, apply_base, generator
from structinit.init.report import InitReport


def semi_orthogonal(heads: int, dim: int, head_dim: int, scale: float, gen):
    """``[H, D, d]``: per head a ``D x d`` matrix with orthonormal columns times ``scale`` (every
    singular value ``scale``), Haar-distributed (QR of a Gaussian, signs fixed by ``R``'s diagonal).
    Needs ``d <= D``."""
    import torch

    g = torch.randn(heads, dim, head_dim, generator=gen, dtype=torch.float64)
    q, r = torch.linalg.qr(g)
    signs = torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))
    signs[signs == 0] = 1.0
    return (q * signs.unsqueeze(-2) * scale).float()


def value_keys(slot) -> List[str]:
    """The labels of the parts :func:`write_identity_value` writes in layer ``slot``: its value
    weight, and its value bias where it has one."""
    from structinit.init.inject import label

    return [label(p) for p in (slot.v, slot.v_bias) if p is not None]


def write_identity_value(sd, slot, dim: int, scale: float = 1.0) -> List[str]:
    """Write layer ``slot``'s value weight as conditioned init does: ``scale`` times the rectangular
    identity on each head's own coordinates (the whole ``[D, D]`` value weight ``scale * I``), its
    bias zeroed where it has one. Returns the labels of the parts written."""
    import torch

    from structinit.init.inject import write_part

    write_part(sd, slot.v, scale * torch.eye(slot.v.stop - slot.v.start, dim))
    if slot.v_bias is not None:
        write_part(sd, slot.v_bias, torch.zeros(slot.v_bias.stop - slot.v_bias.start))
    return value_keys(slot)


def head_condition_numbers(w) -> List[float]:
    """The condition number (largest over smallest singular value) of each head's ``[D, d]`` block
    of ``w: [H, D, d]``."""
    import torch

    s = torch.linalg.svdvals(w.double())
    return [float(c) for c in (s[:, 0] / s[:, -1])]


@register
@dataclass(frozen=True)
class ConditionedInit(InitSpec):
    """Conditioned init: per head ``W_Q``, ``W_K`` semi-orthogonal at ``qk_scale``, ``W_V`` the
    rectangular identity at ``v_scale`` on the head's own coordinates (the whole value weight is
    ``v_scale * I``); query, key and value biases zeroed; the output projection and every other
    weight from ``base`` (``model``, ``pytorch``, ``pytorch-mlp`` or ``pytorch-head``:
    :data:`~structinit.init.baselines.BASES`). See the module docstring for what the paper leaves open.

    Report per layer: ``qk_condition`` (the largest condition number of any head's ``W_Q`` or
    ``W_K``) and ``v_identity_error`` (the largest absolute difference of the value weight from
    ``v_scale * I``), read back from the written weights.
    """

    method = "conditioned"
    writes = "Q/K/V rows and their biases"
    qk_scale: float = 2.0
    v_scale: float = 1.0
    base: str = "model"
    has_base = True

    def validate(self) -> None:
        check_choice("base", self.base, BASES)
        self.check_positive("qk_scale", "v_scale")

    def planned(self, slot) -> List[str]:
        return super().planned(slot) + value_keys(slot)

    def check_target(self, target) -> None:
        from structinit.errors import UsageError

        head_dim = target.dim // target.heads
        if head_dim * target.heads != target.dim:
            raise UsageError(f"conditioned needs {param('heads')} to divide the model's width {target.dim}, "
                             f"got {target.heads}")

    def write(self, target, prepared=None, *, seed: int = 0, cache_dir=None, device: str = "cpu") -> InitReport:
        import torch

        from structinit.init.inject import read_part, read_qk, write_qk

        t = target
        reset = apply_base(t, self.base, seed, self.method)
        gen = generator(seed)
        head_dim = t.dim // t.heads
        rows = []
        for slot in t.slots:
            q = semi_orthogonal(t.heads, t.dim, head_dim, self.qk_scale, gen)
            k = semi_orthogonal(t.heads, t.dim, head_dim, self.qk_scale, gen)
            keys = write_qk(t.sd, slot, q, k) + write_identity_value(t.sd, slot, t.dim, self.v_scale)
            identity = self.v_scale * torch.eye(slot.v.stop - slot.v.start, t.dim)
            rq, rk = read_qk(t.sd, slot, t.heads)
            rows.append({"layer": slot.index, "replaced": keys,
                         "qk_condition": max(head_condition_numbers(rq) + head_condition_numbers(rk)),
                         "v_identity_error": float((read_part(t.sd, slot.v) - identity).abs().max())})
        return InitReport.from_dict({"method": self.method, "layout": t.layout, "dim": t.dim, "heads": t.heads,
                                     "params": self.params(), **({"base_reset": reset} if reset is not None else {}),
                                     "layers": rows})
