"""What the data fit runs on (:class:`FitInputs`): a batch of real inputs, or Gaussian noise
inputs of the model's input shape when no data is given (the shape the model's family tells:
:class:`structinit.init.family.InputSpec`).

Noise inputs are drawn with the normalized input's own statistics, ``N(0, 1)`` per value: a model
trained on normalized inputs sees that mean and spread, and the fit needs no dataset. Measured on
the digits learning curve (docs/results/stock-models), Q/K fitted on noise train within a few
tenths of a point of the fit on real training images, so it is what an impulse init does when no
data is given. The fit's key names the inputs: a batch by a digest of its values, noise by its
kind, seed, count and shape (:meth:`FitInputs.identity`).

Shapes: images ``[B, C, H, W]``, sequences ``[B, C, L]`` (or ``[B, L]``), token ids ``[B, L]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

#: Added to the init's seed for the noise generator (noise is independent of the model's own draws).
NOISE_SEED_OFFSET = 7_000_001


@dataclass
class FitInputs:
    """A batch for the fit: ``x`` as the model takes it, ``kind`` (``data`` or ``noise``),
    ``source`` (where it came from, in words) and, for noise, the ``seed`` it was drawn with."""

    x: Any
    kind: str
    source: str
    seed: Optional[int] = None

    @property
    def samples(self) -> int:
        return int(self.x.shape[0])

    def token_values(self, tokens: int) -> Optional[int]:
        """How many values of one input each of the ``tokens`` tokens carries (``C * p * p`` for
        images in ``p x p`` patches, ``C`` for a sequence); ``None`` for token ids, whose embedding
        is a row of the model's own."""
        if not self.x.is_floating_point() or tokens <= 0:
            return None
        return int(self.x[0].numel()) // int(tokens)

    def identity(self) -> Dict[str, Any]:
        """The inputs' part of a fitted artifact's identity: a batch's digest and count, or the
        noise's kind, seed, count and shape."""
        if self.kind == "noise":
            return {"inputs": {"kind": "noise", "seed": int(self.seed or 0), "samples": self.samples,
                               "shape": [int(s) for s in self.x.shape[1:]]}}
        from structinit.fit.identity import batch_digest

        return {"batch": batch_digest(self.x), "samples": self.samples}


def noise_inputs(shape, samples: int, seed: int) -> FitInputs:
    """``samples`` Gaussian inputs ``N(0, 1)`` of one input's ``shape``, from a generator seeded
    with ``seed`` (plus :data:`NOISE_SEED_OFFSET`): float32 ``[samples, *shape]``."""
    import torch

    gen = torch.Generator().manual_seed(int(seed) + NOISE_SEED_OFFSET)
    x = torch.randn(int(samples), *shape, generator=gen)
    text = f"noise: {int(samples)} Gaussian inputs N(0, 1) of shape {list(shape)} (no data)"
    return FitInputs(x, "noise", text, int(seed))


def data_inputs(x, samples: int, source: Optional[str] = None) -> FitInputs:
    """The first ``samples`` of the batch ``x`` as the fit's inputs (``source``: where they came from)."""
    x = x[:samples]
    return FitInputs(x, "data", source or f"a batch of {int(x.shape[0])} inputs")


__all__ = ["FitInputs", "noise_inputs", "data_inputs", "NOISE_SEED_OFFSET"]
