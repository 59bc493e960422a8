"""A dependency-free PNG writer and the attention-map figure that ``inspect --png`` draws."""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path

import numpy as np

from .atomic import atomic_write

# A perceptually ordered colour ramp (dark blue -> teal -> yellow), interpolated to 256 steps.
_ANCHORS = np.array([[13, 8, 135], [84, 2, 163], [139, 10, 165], [185, 50, 137], [219, 92, 104],
                     [244, 136, 73], [254, 188, 43], [240, 249, 33]], dtype=np.float64)


def colormap(values: np.ndarray) -> np.ndarray:
    """Map ``values`` in [0, 1] to uint8 RGB ``[..., 3]``."""
    v = np.clip(values, 0, 1) * (len(_ANCHORS) - 1)
    lo = np.floor(v).astype(int).clip(0, len(_ANCHORS) - 2)
    t = (v - lo)[..., None]
    return (_ANCHORS[lo] * (1 - t) + _ANCHORS[lo + 1] * t).round().astype(np.uint8)


def write_png(path: os.PathLike, rgb: np.ndarray) -> Path:
    """Write uint8 ``rgb: [H, W, 3]`` as a PNG file, atomically."""
    h, w, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[y].tobytes() for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))
    with atomic_write(path) as fh:
        fh.write(png)
    return Path(path)


def attention_figure(attn: np.ndarray, grid: tuple, query: int, cell: int = 0) -> np.ndarray:
    """One panel per head, side by side: the full ``N x N`` map on top, the query's ``H x W`` map below.

    ``attn: [heads, N, N]``; each panel is scaled to its own maximum. Returns uint8 RGB.
    """
    heads, n, _ = attn.shape
    gh, gw = grid
    scale_full = max(1, 256 // n) if not cell else cell
    scale_q = max(1, (n * scale_full) // max(gh, gw))
    gap = 8
    panel_w = max(n * scale_full, gw * scale_q)
    height = n * scale_full + gap + gh * scale_q
    out = np.full((height, heads * (panel_w + gap) - gap, 3), 255, dtype=np.uint8)
    for h in range(heads):
        x0 = h * (panel_w + gap)
        full = attn[h] / max(float(attn[h].max()), 1e-12)
        img = np.kron(colormap(full), np.ones((scale_full, scale_full, 1), dtype=np.uint8))
        out[: img.shape[0], x0 : x0 + img.shape[1]] = img
        qmap = attn[h, query].reshape(gh, gw)
        qimg = np.kron(colormap(qmap / max(float(qmap.max()), 1e-12)), np.ones((scale_q, scale_q, 1), dtype=np.uint8))
        y0 = n * scale_full + gap
        out[y0 : y0 + qimg.shape[0], x0 : x0 + qimg.shape[1]] = qimg
    return out
