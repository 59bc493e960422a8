"""``solve()``: Q/K for a shape and recipe, from the cache when possible.

Example::

    from structinit import SolveConfig, solve
    art = solve(SolveConfig(grid=(16, 16), dim=192, heads=3, filter=3))
    art.q.shape  # (1, 3, 192, 64) = [layers, heads, D, d]
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, List, Optional, Tuple, Union

import numpy as np

from structinit.errors import StructinitError, UsageError, param
from structinit.geometry.embedding import pseudo_input
from structinit.geometry.targets import causal_mask, draw_offsets, impulse_columns
from structinit.runtime import check_device, check_threads, device_name, duration_text, resolve_device, set_threads
from structinit.solver.artifact import Artifact
from structinit.solver.cache import check_cache_dir, load_or_compute
from structinit.solver.config import SolveConfig, embedding_digest

if TYPE_CHECKING:
    import numpy.typing as npt
    import torch

    from structinit.analysis.quality import Quality


@dataclass
class SolveResult:
    """An artifact and whether it came from the cache (``cached``) or was just solved."""

    artifact: Artifact
    cached: bool


def layer_inputs(config: SolveConfig,
                 embedding: Optional[npt.ArrayLike] = None) -> Tuple[np.ndarray, Optional[np.ndarray]]:
    """``(first, rest)`` pseudo inputs ``[N, D]``; ``rest`` is ``None`` when it equals ``first``.
    ``embedding [N, D]`` is the position embedding of ``config.pos_embed`` (required when set)."""
    if config.pos_embed is not None and embedding is None:
        raise UsageError(f"the solve config has {param('pos_embed')} {config.pos_embed[:19]}...; pass the "
                         f"{param('embedding')} it was made from")
    if embedding is not None:
        check_embedding(config, embedding)
    first = pseudo_input(config.pseudo_input, config.grid, config.dim, seed=config.seed, embedding=embedding)
    rest = None
    if config.pseudo_input_rest is not None:
        rest = pseudo_input(config.pseudo_input_rest, config.grid, config.dim, seed=config.seed + 1,
                            embedding=embedding)
    return first, rest


def check_embedding(config: SolveConfig, embedding: npt.ArrayLike) -> None:
    """Raise :class:`UsageError` unless ``embedding`` is the one ``config.pos_embed`` names."""
    if config.pos_embed is None:
        raise UsageError(f"an {param('embedding')} was given but the config has no {param('pos_embed')} digest "
                         "(set it to embedding_digest(embedding))")
    if embedding_digest(embedding) != config.pos_embed:
        raise UsageError(f"the {param('embedding')} given is not the one the config's {param('pos_embed')} "
                         "digest names")


def solved_layers(config: SolveConfig) -> List[int]:
    """The layers that get their own solve: all of them, or (shared) the first and, when the
    following layers have another pseudo input, one more for all of them."""
    if not config.share:
        return list(range(config.layers))
    return [0, 1] if config.pseudo_input_rest is not None and config.layers > 1 else [0]


#: The allocator's and threads' share on top of what a solve's tensors hold (fragmentation, one
#: malloc arena per thread, torch's own work buffers): an estimate that refuses work must bound the
#: real peak from above on every machine, and one measured 1% under its peak without it.
ALLOCATOR_FACTOR, ALLOCATOR_BYTES = 1.2, 64 * 2 ** 20


def estimate_memory(config: SolveConfig) -> int:
    """Bytes a solve of ``config`` needs at its peak, an upper bound, for refusing a solve that
    cannot fit (the Python interpreter and torch themselves not counted): what its tensors hold
    (the ``fast`` recipe is ``O(N D)``; ``paper``, ``released`` and ``closed-form`` hold ``N x N``
    maps for every head; ``authors-2025`` those of one layer's heads at a time), times
    :data:`ALLOCATOR_FACTOR` plus :data:`ALLOCATOR_BYTES`.

    Measured against the peak resident memory a real solve adds on a CPU (dim 64; the test suite
    checks it): the dense recipes' tensors are within 0.85-1.3x of the peak from about 2,000 tokens
    up, so the estimate is 1.0-1.6x of it plus the fixed share (at a few hundred tokens torch's own
    first allocations, about 200 MiB, dominate); ``fast`` counts its chunk and cache buffers in full,
    so it never underestimates and overestimates by at most about 500 MiB (2.4x at 4,096 tokens)."""
    from structinit.analysis.quality import CHUNK_BYTES, DENSE_BYTES
    from structinit.solver import algorithms

    n, dim, d = config.tokens, config.dim, config.head_dim
    ls, heads = len(solved_layers(config)), config.heads
    r = min(n, dim)
    inputs = 8 * 8 * n * dim + 2 * 4 * ls * n * dim  # pseudo inputs (float64 work) and the stacked x
    weights = 4 * 4 * config.layers * heads * dim * d  # q, k and their copies
    maps = ls * heads * n * n
    if config.recipe == "fast":
        groups = min(ls * heads, config.filter ** 2 * (2 if config.pseudo_input_rest else 1))
        svd = 8 * (3 * n * r + 2 * r * r + r * dim)  # x in float64, U, the LAPACK work, V
        per_group = 8 * (n * r + 8 * r * r + 4 * n * d)  # T U, B and its SVD, x q / x k
        calibrate = min(8 * n * n, algorithms.CACHE_BYTES) + 4 * algorithms.CHUNK_BYTES
        work = svd + per_group + calibrate + 8 * 2 * groups * dim * d + 4 * CHUNK_BYTES
    elif config.recipe == "closed-form":
        work = 8 * 4 * maps + 8 * ls * heads * r * n + min(4 * maps, DENSE_BYTES)
    elif config.recipe == "authors-2025":  # one layer's logits at a time, then [H, D, D] targets
        layer = heads * n * n
        work = 8 * 3 * layer + 8 * heads * (dim * n + 3 * dim * dim) + min(4 * maps, DENSE_BYTES)
    else:  # paper, released: Adam through dense attention (forward and backward)
        work = 4 * 8 * maps + min(4 * maps, DENSE_BYTES)
    return int((inputs + weights + work) * ALLOCATOR_FACTOR + ALLOCATOR_BYTES)


#: Recipes that take many steps through dense attention, whose time is estimated before they start.
ITERATIVE = ("paper", "released")
#: The share of a large matmul's rate that a step of the iterative recipes reaches (measured here:
#: their softmax and elementwise work run far below matmul speed).
STEP_EFFICIENCY = 0.15


@functools.lru_cache(maxsize=None)
def matmul_rate(device: str) -> float:
    """Floating-point operations per second of a float32 matmul on ``device``, measured now (about
    0.1 s, once per process)."""
    import torch

    a = torch.randn(512, 512, device=device)
    b = torch.randn(512, 512, device=device)
    a @ b  # warm-up
    runs, t0 = 0, time.perf_counter()
    while runs < 3 or time.perf_counter() - t0 < 0.05:
        a @ b
        runs += 1
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return runs * 2 * 512 ** 3 / max(time.perf_counter() - t0, 1e-9)


def estimate_seconds(config: SolveConfig, device: str) -> Optional[float]:
    """Seconds a solve of ``config`` will take on ``device``, roughly: for the iterative recipes
    (``paper``, ``released``: Adam through every head's dense ``N x N`` attention), the operations
    of a step times the steps over this device's measured matmul rate (:func:`matmul_rate`,
    :data:`STEP_EFFICIENCY`); ``None`` for the others, which take seconds where they fit in memory."""
    if config.recipe not in ITERATIVE:
        return None
    n, dim, d = config.tokens, config.dim, config.head_dim
    heads = len(solved_layers(config)) * config.heads
    per_step = 3 * heads * (4 * n * dim * d + 2 * n * n * d + 8 * n * n)  # forward and backward
    steps = int(config.params.get("iters", 10000))
    return steps * per_step / (matmul_rate(device) * STEP_EFFICIENCY)


#: An estimate above this (seconds) is said before the solve starts.
SAY_SOLVE_ESTIMATE = 30.0


def available_memory(device: str) -> Optional[int]:
    """Bytes free for a solve on ``device``: the GPU's free memory, or on a CPU the kernel's
    ``MemAvailable`` (capped by an address-space limit, if any); ``None`` when unknown."""
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    free = None
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft != resource.RLIM_INFINITY:
            free = soft if free is None else min(free, soft)
    except (ImportError, ValueError, OSError):
        pass
    return free


def check_memory(config: SolveConfig, device: str) -> int:
    """The :func:`estimate_memory` of ``config``; raises :class:`StructinitError` with the estimate
    when it exceeds what ``device`` has free (so a solve that cannot finish does not start)."""
    need = estimate_memory(config)
    free = available_memory(device)
    if free is not None and need > free:
        hint = ("the fast recipe needs no N x N maps" if config.recipe != "fast"
                else "fewer tokens, a smaller dim, or a device with more memory")
        raise StructinitError(f"solving {config.describe()} needs about {_gib(need)} of memory on {device}, and "
                              f"only {_gib(free)} is free; try {hint}")
    return need


def _gib(n: int) -> str:
    return f"{n / 2 ** 30:.1f} GiB" if n >= 2 ** 30 else f"{n / 2 ** 20:.0f} MiB"


def _quality(x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, columns: torch.Tensor, inputs: torch.Tensor,
             mask: Optional[torch.Tensor] = None) -> Quality:
    """:class:`~structinit.analysis.quality.Quality` of every solved head, measuring each distinct
    (pseudo input, target, q, k) once (heads of the fast recipe that share an offset are one)."""
    from structinit.analysis.quality import MEASURES, Quality, measure

    L, H = q.shape[:2]
    seen, cells = {}, {}
    for l in range(L):
        for h in range(H):
            key = (int(inputs[l]), columns[l, h].cpu().numpy().tobytes(), q[l, h].cpu().numpy().tobytes(),
                   k[l, h].cpu().numpy().tobytes())
            if key not in seen:
                seen[key] = measure(x[l], q[l, h:h + 1], k[l, h:h + 1], columns[l, h:h + 1], mask).cell(0, 0)
            cells[l, h] = seen[key]
    return Quality(**{m: np.array([[cells[l, h][m] for h in range(H)] for l in range(L)]) for m in MEASURES})


def compute(config: SolveConfig, device: str = "auto", progress: Optional[Callable[[int, int], None]] = None,
            threads: Optional[int] = None, embedding: Optional[npt.ArrayLike] = None,
            log: Optional[Callable[[str], None]] = None) -> Artifact:
    """Solve ``config`` now (no cache) on ``device``, batched over the solved layers x heads.

    ``embedding [N, D]``: the position embedding whose digest is ``config.pos_embed`` (only then).
    Refuses (:func:`check_memory`) a solve that does not fit in the device's free memory. A solve
    estimated (:func:`estimate_seconds`) to take over :data:`SAY_SOLVE_ESTIMATE` seconds is said to
    ``log`` before it starts.
    """
    import torch

    from structinit.solver.recipes import RECIPE_VERSIONS

    if config.algorithm != RECIPE_VERSIONS[config.recipe]:
        raise UsageError(f"the config asks for version {config.algorithm} of recipe {config.recipe!r}, and this "
                         f"structinit computes version {RECIPE_VERSIONS[config.recipe]} (an artifact of another "
                         "version can be read, not solved again)")
    set_threads(threads)
    from structinit.solver.algorithms import SOLVERS, distinct_heads

    dev = resolve_device(device)
    need = check_memory(config, dev)
    if log is not None:
        eta = estimate_seconds(config, dev)
        if eta is not None and eta > SAY_SOLVE_ESTIMATE:
            steps, maps = int(config.params.get("iters", 10000)), len(solved_layers(config)) * config.heads
            log(f"solving {config.describe()}: {steps} Adam steps through {maps} "
                f"dense {config.tokens}x{config.tokens} attention maps, about {_gib(need)} of memory; estimated "
                f"{duration_text(eta)} on {dev} (the fast recipe takes seconds)")
    L, H = config.layers, config.heads
    first, rest = layer_inputs(config, embedding)
    solved = solved_layers(config)
    offsets_solved = draw_offsets(config.filter, H, len(solved), config.seed, config.offset_order,
                                  ndim=config.grid.ndim, causal=config.causal)
    if rest is None:  # one input for every solved layer: a view, not copies
        x = torch.from_numpy(first).to(dev).unsqueeze(0).expand(len(solved), -1, -1)
    else:
        x = torch.from_numpy(np.stack([rest if i > 0 else first for i in solved])).to(dev)
    columns = torch.from_numpy(impulse_columns(config.grid, offsets_solved, config.padding)).to(dev)
    gen = torch.Generator().manual_seed(config.seed)
    mask = causal_mask(config.grid, config.causal)
    masked = {} if mask is None else {"mask": torch.from_numpy(mask).to(dev)}  # a causal decoder's mask
    t0 = time.perf_counter()
    q, k = SOLVERS[config.recipe](x, columns, config.head_dim, H, gen, progress=progress, **masked, **config.params)
    if dev.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    # Shared solves: layer 0 uses the first solve, every following layer the last one.
    index = np.array([min(i, len(solved) - 1) for i in range(L)]) if config.share else np.arange(L)
    quality = _quality(x, q, k, columns, distinct_heads(x, columns)[0], masked.get("mask")).select(index)
    q_np, k_np = q.cpu().numpy(), k.cpu().numpy()
    stats = {"layers": quality.to_stats(), "summary": quality.summary(), "seconds": seconds,
             "device": device_name(dev)}
    return Artifact(config=config, q=q_np[index], k=k_np[index], offsets=offsets_solved[index].astype(np.int32),
                    pseudo_input=first, pseudo_input_rest=rest, stats=stats)


def solve(config: SolveConfig, cache_dir: Union[str, os.PathLike, None] = None, device: str = "auto",
          force: bool = False, progress: Optional[Callable[[int, int], None]] = None,
          warn: Optional[Callable[[str], None]] = None, threads: Optional[int] = None,
          embedding: Optional[npt.ArrayLike] = None, log: Optional[Callable[[str], None]] = None) -> SolveResult:
    """The artifact for ``config``: from the cache if present and valid, else solved and stored.

    Concurrent callers with the same key solve it once (a per-key lock; ``log`` hears that this one
    waits for another) and every caller gets a complete artifact; ``force`` re-solves and replaces
    the user-cache copy (:func:`~structinit.solver.cache.load_or_compute`). ``embedding``: the
    position embedding of ``config.pos_embed`` (see :func:`compute`). A cache folder that cannot
    be created, locked or written is a :class:`StructinitError` (before solving where it can be
    told), and nothing partial is left in it. ``warn(message)`` hears of an unusable cached copy,
    which is set aside and solved again (default: a :class:`~structinit.errors.StructinitWarning`).
    """
    if warn is None:
        def warn(message: str) -> None:
            import warnings

            from structinit.errors import StructinitWarning

            warnings.warn(StructinitWarning(message), stacklevel=3)
    check_threads(threads)
    check_cache_dir(cache_dir)
    if check_device(device) != "auto":
        resolve_device(device)  # an impossible device is an error even when the cache has the result

    def before() -> None:
        if embedding is not None:
            check_embedding(config, embedding)

    artifact, cached = load_or_compute(
        config.filename, lambda: compute(config, device, progress, threads, embedding, log=log), key=config.key,
        fitted=False, cache_dir=cache_dir, force=force, warn=warn, wait=log, before=before, what="solved")
    return SolveResult(artifact, cached=cached)
