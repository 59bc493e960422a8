"""Shared pieces of the 16x16-patch structure study: stock timm ViTs at 224, real crops of
scikit-learn's two sample photos (fit on one, check on the other), per-layer held-out hit rates."""

import time

import numpy as np
import torch

from structinit.analysis.fidelity import data_attention_quality

MEAN = torch.tensor([0.485, 0.456, 0.406])[:, None, None]
STD = torch.tensor([0.229, 0.224, 0.225])[:, None, None]


def crops(photo: int, count: int, seed: int, size: int = 224) -> torch.Tensor:
    """``count`` random ``size``-pixel crops of sample photo ``photo`` (0: china, 1: flower), ImageNet
    normalized: float32 ``[count, 3, size, size]``."""
    from sklearn.datasets import load_sample_images

    img = load_sample_images().images[photo]  # [427, 640, 3] uint8
    rng = np.random.default_rng(seed)
    h, w = img.shape[:2]
    out = np.empty((count, size, size, 3), dtype=np.uint8)
    for i in range(count):
        y, x = rng.integers(0, h - size + 1), rng.integers(0, w - size + 1)
        out[i] = img[y:y + size, x:x + size]
    t = torch.from_numpy(out).permute(0, 3, 1, 2).float() / 255.0
    return (t - MEAN) / STD


def stock(name: str, seed: int = 0):
    import timm

    torch.manual_seed(seed)
    return timm.create_model(name, pretrained=False).eval()


def held_out_hits(model, report, x) -> np.ndarray:
    """Per-layer hit rate of ``model``'s attention on ``x`` against the report's offsets."""
    offsets = [np.asarray(r["offsets"]) for r in report["layers"]]
    q = data_attention_quality(model, x, offsets, tuple(report["grid"]))
    return np.array([r["hit_rate"] for r in q["layers"]])


class Timer:
    def __enter__(self):
        self.t = time.perf_counter()
        return self

    def __exit__(self, *a):
        self.seconds = time.perf_counter() - self.t


def pink_noise(count: int, shape, seed: int, exponent: float = 1.0) -> torch.Tensor:
    """Gaussian noise images with a ``1/f**exponent`` amplitude spectrum (natural images: about 1),
    each channel standardized to mean 0, std 1: float32 ``[count, *shape]``."""
    c, h, w = shape
    g = torch.Generator().manual_seed(seed)
    white = torch.randn(count, c, h, w, generator=g)
    fy = torch.fft.fftfreq(h)[:, None]
    fx = torch.fft.rfftfreq(w)[None, :]
    f = (fy ** 2 + fx ** 2).sqrt()
    f[0, 0] = 1.0 / max(h, w)
    spec = torch.fft.rfft2(white) / f ** exponent
    x = torch.fft.irfft2(spec, s=(h, w))
    x = x - x.mean(dim=(-2, -1), keepdim=True)
    return x / x.std(dim=(-2, -1), keepdim=True)


def dead_leaves(count: int, shape, seed: int, rmin: float = 0.01, rmax: float = 0.3, discs: int = 400) -> torch.Tensor:
    """Dead-leaves images: ``discs`` opaque discs of radius ~ 1/r^3 (between ``rmin`` and ``rmax`` of
    the side) and uniform random colour, drawn back to front; standardized per channel."""
    c, h, w = shape
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w] / max(h, w)
    out = np.zeros((count, c, h, w), dtype=np.float32)
    for n in range(count):
        img = np.full((c, h, w), rng.random((c, 1, 1)), dtype=np.float32)
        u = rng.random(discs)
        r = 1.0 / np.sqrt(u * (rmin ** -2 - rmax ** -2) + rmax ** -2)  # density ~ 1/r^3
        cy, cx = rng.random(discs) * h / max(h, w), rng.random(discs) * w / max(h, w)
        col = rng.random((discs, c))
        for i in range(discs):
            m = (yy - cy[i]) ** 2 + (xx - cx[i]) ** 2 < r[i] ** 2
            img[:, m] = col[i][:, None]
        out[n] = img
    t = torch.from_numpy(out)
    t = t - t.mean(dim=(0, 2, 3), keepdim=True)
    return t / t.std(dim=(0, 2, 3), keepdim=True)
