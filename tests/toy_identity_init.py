"""A toy data-fitting init, added as a maintainer adds one: this module and its test
(``tests/test_toy_identity_init.py``, which registers it by importing it), no other file.

``identity-attention``: what the first attention layer reads on a batch of inputs (or, without one,
on noise inputs of the shape the model's family tells) is whitened, ``W = C^{-1/2}`` of its token
covariance ``C`` ``[D, D]``; every selected layer gets ``Q_h = K_h = s * W[:, h*d:(h+1)*d]`` (Q/K
biases zeroed), with the one scale ``s`` found by bisection so that a token's mean attention on
itself, over those inputs and every head, is ``self_mass``. Its own value in the report:
``self_mass_fitted`` (what the bisection reached) and ``scale``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from structinit.errors import UsageError, param
from structinit.init.base import InitSpec, register
from structinit.init.report import FitRecord, InitReport, LayerRow


@dataclass(frozen=True)
class Whitening:
    """What :meth:`IdentityAttentionInit.prepare` found: the whitening ``w`` ``[D, D]``, the scale, the
    self-attention mass it gives, and what it was found on."""

    w: Any
    scale: float
    mass: float
    inputs: str
    samples: int


def self_attention_mass(tokens, w, scale: float, heads: int) -> float:
    """Mean attention a token pays itself: ``tokens`` ``[N, T, D]``, ``Q_h = K_h = scale * w``'s head block."""
    import torch

    n, t, dim = tokens.shape
    d = dim // heads
    z = (tokens @ w).reshape(n, t, heads, d).transpose(1, 2) * scale  # q = k per head: [N, H, T, d]
    attn = torch.softmax(z @ z.transpose(-1, -2) / d ** 0.5, dim=-1)
    return float(attn.diagonal(dim1=-2, dim2=-1).mean())


@register
@dataclass(frozen=True)
class IdentityAttentionInit(InitSpec):
    """Whitened Q/K at the scale whose self-attention mass is ``self_mass`` (see the module)."""

    method = "identity-attention"
    writes = "Q/K rows (biases zeroed)"
    fits_data = True
    self_mass: float = 0.3
    samples: int = 32

    def validate(self) -> None:
        if not 0 < self.self_mass < 1:
            raise UsageError(f"{self.method} parameter {param('self_mass')} must lie strictly between 0 and 1, "
                             f"got {self.self_mass}")
        self.check_positive("samples", allow_zero=True)

    @property
    def uses_data(self) -> bool:
        return self.samples > 0

    @property
    def fit_samples(self) -> int:
        return self.samples

    def with_fit_samples(self, samples: int) -> "IdentityAttentionInit":
        return dataclasses.replace(self, samples=samples)

    def fit_off(self) -> str:
        return "samples is 0" if not self.samples else ""

    def without_fit(self) -> "IdentityAttentionInit":
        """No fit (``samples=0``): a resumed run keeps the Q/K its checkpoint holds."""
        return dataclasses.replace(self, samples=0)

    def prepare(self, target, *, seed: int = 0, data=None, source: Optional[str] = None, stage=None,
                **_: Any) -> Optional[Whitening]:
        import torch

        from structinit.analysis.capture import first_input, projection_module
        from structinit.fit.inputs import data_inputs, noise_inputs

        if not self.samples:
            return None
        model = target.model
        if model is None:
            raise UsageError(f"{self.method} runs inputs through the model; give the model, not a state dict")
        if data is not None:
            inputs = data_inputs(data, self.samples, source)
        elif target.inputs is not None and target.inputs.noise_shape is not None:
            inputs = noise_inputs(target.inputs.noise_shape, self.samples, seed)
        else:
            raise UsageError(f"{self.method}: the model does not tell its input shape; give {param('data')}")
        if stage is not None:
            stage("whitening the first layer's inputs")
        qkv = projection_module(model, target.det.slots[0].q.key)
        was = model.training
        model.eval()
        try:
            with torch.no_grad():
                x = first_input(qkv, lambda: model(inputs.x)).double()
        finally:
            model.train(was)
        tokens = x.reshape(int(inputs.x.shape[0]), -1, target.dim)
        flat = tokens.reshape(-1, target.dim)
        values, vectors = torch.linalg.eigh(torch.cov(flat.T))
        w = vectors @ torch.diag(values.clamp_min(1e-6 * float(values.max())).rsqrt()) @ vectors.T
        low, high = 0.0, 1.0
        while self_attention_mass(tokens, w, high, target.heads) < self.self_mass:
            if high > 1e4:  # a token's whitened neighbours can outweigh it: the mass stops rising
                reach = self_attention_mass(tokens, w, high, target.heads)
                raise UsageError(f"{self.method} parameter {param('self_mass')} {self.self_mass} is out of reach "
                                 f"on these inputs (at most {reach:.2f}): ask for less")
            high *= 2
        for _step in range(60):
            mid = (low + high) / 2
            below = self_attention_mass(tokens, w, mid, target.heads) < self.self_mass
            low, high = (mid, high) if below else (low, mid)
        scale = (low + high) / 2
        return Whitening(w.float(), scale, self_attention_mass(tokens, w, scale, target.heads), inputs.kind,
                         inputs.samples)

    def write(self, target, prepared: Optional[Whitening] = None, *, seed: int = 0, cache_dir=None,
              device: str = "cpu") -> InitReport:
        from structinit.init.inject import write_qk

        if prepared is None:
            if self.samples:
                raise UsageError(f"{self.method} writes what prepare found; call apply")
            return InitReport(self.method, layers=[LayerRow(slot.index) for slot in target.slots])
        d = target.dim // target.heads
        per_head = prepared.scale * prepared.w.reshape(target.dim, target.heads, d).permute(1, 0, 2)
        rows = [LayerRow(slot.index, replaced=write_qk(target.sd, slot, per_head, per_head)) for slot in target.slots]
        return InitReport(self.method, layers=rows, fit=FitRecord(inputs=prepared.inputs, samples=prepared.samples),
                          extra={"scale": prepared.scale, "self_mass_fitted": prepared.mass})
