"""``solve()``: Q/K for a shape and recipe, from the cache when possible.

Example::

    from structinit import SolveConfig, solve
    art = solve(SolveConfig(grid=(16, 16), dim=192, heads=3, filter=3))
    art.q.shape  # (1, 3, 192, 64) = [layers, heads, D, d]
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from structinit.errors import UsageError, param
from structinit.geometry.embedding import pseudo_input
from structinit.geometry.targets import causal_mask, draw_offsets, impulse_targets
from structinit.runtime import check_device, check_threads, resolve_device, set_threads
from structinit.solver.artifact import Artifact, write_artifact
from structinit.solver.cache import check_cache_dir, find_cached, key_lock, user_cache_dir
from structinit.solver.config import SolveConfig


@dataclass
class SolveResult:
    """An artifact and whether it came from the cache (``cached``) or was just solved."""

    artifact: Artifact
    cached: bool


def layer_inputs(config: SolveConfig) -> tuple:
    """``(first, rest)`` pseudo inputs ``[N, D]``; ``rest`` is ``None`` when it equals ``first``."""
    first = pseudo_input(config.pseudo_input, config.grid, config.dim, seed=config.seed)
    rest = None
    if config.pseudo_input_rest is not None:
        rest = pseudo_input(config.pseudo_input_rest, config.grid, config.dim, seed=config.seed + 1)
    return first, rest


def compute(config: SolveConfig, device: str = "auto", progress: Optional[Callable[[int, int], None]] = None,
            threads: Optional[int] = None) -> Artifact:
    """Solve ``config`` now (no cache), batched over all solved layers x heads on ``device``."""
    import torch

    set_threads(threads)
    from structinit.analysis.quality import measure, targets_to_columns
    from structinit.solver.algorithms import SOLVERS

    dev = resolve_device(device)
    L, H = config.layers, config.heads
    first, rest = layer_inputs(config)
    # Layers that get their own solve: all of them, or (shared) the first and, if its pseudo input
    # differs, one more for every following layer (the released code's behaviour).
    solved = list(range(L)) if not config.share else ([0, 1] if rest is not None and L > 1 else [0])
    offsets_solved = draw_offsets(config.filter, H, len(solved), config.seed, config.offset_order,
                                  ndim=config.grid.ndim, causal=config.causal)
    x_np = np.stack([rest if (i > 0 and rest is not None) else first for i in solved])
    x = torch.from_numpy(x_np).to(dev)
    targets = torch.from_numpy(impulse_targets(config.grid, offsets_solved, config.padding)).to(dev)
    gen = torch.Generator().manual_seed(config.seed)
    mask = causal_mask(config.grid, config.causal)
    masked = {} if mask is None else {"mask": torch.from_numpy(mask).to(dev)}  # a causal decoder's mask
    t0 = time.perf_counter()
    q, k = SOLVERS[config.recipe](x, targets, config.head_dim, H, gen, progress=progress, **masked, **config.params)
    if dev.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    # Shared solves: layer 0 uses the first solve, every following layer the last one.
    index = np.array([min(i, len(solved) - 1) for i in range(L)]) if config.share else np.arange(L)
    quality = measure(x, q, k, targets_to_columns(targets), masked.get("mask")).select(index)
    q, k = q.cpu().numpy(), k.cpu().numpy()
    stats = {"layers": quality.to_stats(), "summary": quality.summary(), "seconds": seconds,
             "device": torch.cuda.get_device_name(dev) if dev.startswith("cuda") else "cpu"}
    return Artifact(config=config, q=q[index], k=k[index], offsets=offsets_solved[index].astype(np.int32),
                    pseudo_input=first, pseudo_input_rest=rest, stats=stats)


def solve(config: SolveConfig, cache_dir: Optional[os.PathLike] = None, device: str = "auto", force: bool = False,
          progress: Optional[Callable[[int, int], None]] = None, warn: Optional[Callable[[str], None]] = None,
          threads: Optional[int] = None) -> SolveResult:
    """The artifact for ``config``: from the cache if present and valid, else solved and stored.

    Concurrent callers with the same key solve it once (a per-key lock) and every caller gets a
    complete artifact; ``force`` re-solves and replaces the user-cache copy.
    """
    check_threads(threads)
    check_cache_dir(cache_dir)
    if check_device(device) != "auto":
        resolve_device(device)  # an impossible device is an error even when the cache has the result
    if not force:
        hit = find_cached(config.filename, cache_dir, warn)
        if hit is not None:
            return SolveResult(hit, cached=True)
    folder = user_cache_dir(cache_dir)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create the {param('cache_dir')} folder {folder}: {exc.strerror}") from None
    with key_lock(folder, config.filename):
        if not force:  # another process may have finished it while we waited for the lock
            hit = find_cached(config.filename, cache_dir, warn)
            if hit is not None:
                return SolveResult(hit, cached=True)
        artifact = compute(config, device, progress, threads)
        artifact.path = write_artifact(artifact, folder / config.filename)
    return SolveResult(artifact, cached=False)
