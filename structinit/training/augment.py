"""Batched augmentation on whatever device the images live on (the GPU for CIFAR-sized sets).

Works on uint8 batches ``[B, C, H, W]``; every image gets its own random draw: flips and crops
are vectorized per image, RandAugment (torchvision v2) is applied per small chunk of images (each
chunk draws its own ops), so no CPU dataloader is needed.
"""

from __future__ import annotations

from typing import Sequence

AUGMENTS = ("randaugment", "crop-flip", "flip", "shift", "none")
#: ``shift``: how far an image moves in each direction (pixels).
SHIFT_PIXELS = 2
RANDAUGMENT_CHUNK = 8


def hflip(x, generator=None):
    """Flip each image of ``[B, C, H, W]`` left-right with probability 1/2."""
    import torch

    flip = torch.rand(x.shape[0], generator=generator, device="cpu") < 0.5
    flip = flip.to(x.device)
    return torch.where(flip[:, None, None, None], x.flip(-1), x)


def random_crop(x, padding: int, generator=None):
    """Zero-pad ``[B, C, H, W]`` by ``padding`` and crop each image back at its own random offset."""
    import torch
    import torch.nn.functional as F

    if padding <= 0:
        return x
    b, _, h, w = x.shape
    xp = F.pad(x, (padding, padding, padding, padding))
    oy = torch.randint(0, 2 * padding + 1, (b,), generator=generator).to(x.device)
    ox = torch.randint(0, 2 * padding + 1, (b,), generator=generator).to(x.device)
    rows = (oy[:, None] + torch.arange(h, device=x.device)[None])  # [B, H]
    cols = (ox[:, None] + torch.arange(w, device=x.device)[None])  # [B, W]
    bi = torch.arange(b, device=x.device)[:, None, None]
    out = xp.permute(0, 2, 3, 1)[bi, rows[:, :, None], cols[:, None, :]]  # [B, H, W, C]
    return out.permute(0, 3, 1, 2).contiguous()


class BatchAugment:
    """``augment(uint8 [B, C, H, W]) -> uint8 [B, C, H, W]`` per ``kind``:

    ``randaugment``: horizontal flip (when ``flip``) then RandAugment(``num_ops``, ``magnitude``);
    ``crop-flip``: 4-pixel zero-pad random crop then flip; ``flip``: flip only; ``shift``: a random
    shift of up to :data:`SHIFT_PIXELS` in each direction (zero-pad random crop), never a flip,
    whatever ``flip`` says; ``none``: identity.
    Randomness comes from torch's global generator (saved in checkpoints).
    """

    def __init__(self, kind: str = "randaugment", flip: bool = True, num_ops: int = 2, magnitude: int = 9,
                 chunk: int = RANDAUGMENT_CHUNK):
        from structinit.errors import UsageError, param

        if kind not in AUGMENTS:
            raise UsageError(f"unknown {param('augment')} {kind!r}; choose one of {', '.join(AUGMENTS)}")
        self.kind, self.flip, self.chunk = kind, flip, chunk
        self._ra = None
        if kind == "randaugment":
            from torchvision.transforms import v2

            self._ra = v2.RandAugment(num_ops=num_ops, magnitude=magnitude)

    def __call__(self, x):
        import torch

        if self.kind == "none":
            return x
        if self.kind == "shift":
            return random_crop(x, SHIFT_PIXELS)
        if self.kind == "crop-flip":
            x = random_crop(x, 4)
        if self.flip:
            x = hflip(x)
        if self._ra is not None:
            x = torch.cat([self._ra(c) for c in x.split(self.chunk)])
        return x


def normalize(x, mean: Sequence[float], std: Sequence[float], dtype=None):
    """uint8 ``[B, C, H, W]`` -> float ``(x / 255 - mean) / std``."""
    import torch

    m = torch.tensor(mean, device=x.device).view(1, -1, 1, 1)
    s = torch.tensor(std, device=x.device).view(1, -1, 1, 1)
    out = (x.float() / 255.0 - m) / s
    return out if dtype is None else out.to(dtype)
