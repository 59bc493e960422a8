"""Fixed sin-cos position embeddings (1-D and 2-D) and the pseudo input the solvers fit attention on.

The same embedding is what structinit's models use as their fixed position embedding, so the
solved attention is what a freshly initialized model computes on position alone.
"""

from __future__ import annotations

import math

import numpy as np

from structinit.errors import UsageError, param
from structinit.geometry.grid import Grid

#: Pseudo-input kinds (the structured-initialization paper's Table 6): PE, uniform noise U,
#: Gaussian noise G, and PE plus noise.
PSEUDO_INPUTS = ("pe", "uniform", "gaussian", "pe+uniform", "pe+gaussian")

LAYER_NORM_EPS = 1e-6  # timm ViT blocks use LayerNorm(eps=1e-6)


def sincos_2d(grid: Grid, dim: int, temperature: float = 10000.0) -> np.ndarray:
    """Fixed 2-D sin-cos position embedding, float32 ``[H*W, dim]`` (row-major tokens).

    Channels are ``[sin(x w), cos(x w), sin(y w), cos(y w)]`` with ``dim // 4`` frequencies
    ``w_i = temperature ** (-i / (dim // 4))``, ``x`` the column and ``y`` the row of the token.
    """
    if dim % 4:
        raise UsageError(f"{param('dim')} {dim} must be divisible by 4 for a 2-D sin-cos position embedding")
    h, w = grid
    q = dim // 4
    omega = temperature ** (-np.arange(q, dtype=np.float64) / q)
    ys, xs = np.meshgrid(np.arange(h, dtype=np.float64), np.arange(w, dtype=np.float64), indexing="ij")
    ax = xs.reshape(-1, 1) * omega[None]
    ay = ys.reshape(-1, 1) * omega[None]
    pe = np.concatenate([np.sin(ax), np.cos(ax), np.sin(ay), np.cos(ay)], axis=1)
    return pe.astype(np.float32)


def sincos_1d(length: int, dim: int, temperature: float = 10000.0) -> np.ndarray:
    """Fixed 1-D sin-cos position embedding, float32 ``[length, dim]``: channels
    ``[sin(t w), cos(t w)]`` with ``dim // 2`` frequencies ``w_i = temperature ** (-i / (dim // 2))``."""
    if dim % 2:
        raise UsageError(f"{param('dim')} {dim} must be even for a 1-D sin-cos position embedding")
    half = dim // 2
    omega = temperature ** (-np.arange(half, dtype=np.float64) / half)
    angle = np.arange(length, dtype=np.float64)[:, None] * omega[None]
    return np.concatenate([np.sin(angle), np.cos(angle)], axis=1).astype(np.float32)


def sincos(grid: Grid, dim: int) -> np.ndarray:
    """The fixed sin-cos embedding of ``grid``, float32 ``[N, dim]``: :func:`sincos_1d` for a
    sequence, :func:`sincos_2d` for an image grid."""
    grid = Grid(grid)
    return sincos_1d(grid[0], dim) if grid.ndim == 1 else sincos_2d(grid, dim)


def layer_norm(x: np.ndarray, eps: float = LAYER_NORM_EPS) -> np.ndarray:
    """LayerNorm over the last axis without affine parameters (float32)."""
    x = x.astype(np.float64)
    mu = x.mean(-1, keepdims=True)
    var = x.var(-1, keepdims=True)
    return ((x - mu) / np.sqrt(var + eps)).astype(np.float32)


def pseudo_input(kind: str, grid: Grid, dim: int, seed: int = 0, embedding=None) -> np.ndarray:
    """The pseudo input ``X``: float32 ``[N, dim]``, LayerNorm'd.

    ``pe``: the sin-cos embedding (:func:`sincos`), or ``embedding [N, dim]`` when given (a model's
    own position embedding); ``uniform``: U(-1, 1) noise; ``gaussian``: N(0, 1/2) noise
    truncated at 2 std; ``pe+uniform`` / ``pe+gaussian``: the embedding plus that noise. Noise is
    drawn from a NumPy generator seeded with ``seed`` (device independent).
    """
    if kind not in PSEUDO_INPUTS:
        raise UsageError(f"unknown {param('pseudo_input')} {kind!r}; choose one of {', '.join(PSEUDO_INPUTS)}")
    n = Grid(grid).tokens
    rng = np.random.default_rng(seed)
    x = np.zeros((n, dim), dtype=np.float64)
    if kind.startswith("pe"):
        if embedding is None:
            x += sincos(grid, dim)
        else:
            embedding = np.asarray(embedding, dtype=np.float32)
            if embedding.shape != (n, dim):
                raise UsageError(f"the position {param('embedding')} has shape {list(embedding.shape)}, expected "
                                 f"[{n}, {dim}] for a {Grid(grid).describe()} grid")
            x += embedding
    if kind.endswith("uniform"):
        x += rng.uniform(-1.0, 1.0, size=(n, dim))
    elif kind.endswith("gaussian"):
        std = math.sqrt(0.5)
        g = rng.standard_normal(size=(n, dim))
        while np.any(np.abs(g) > 2):  # resample beyond 2 std (a truncated normal)
            bad = np.abs(g) > 2
            g[bad] = rng.standard_normal(size=int(bad.sum()))
        x += std * g
    return layer_norm(x)
