"""Initializations of a ViT's attention, one function per method, and a registry by name.

Every method has the signature ``method(target, *, grid=None, heads=None, layers=None, seed=0,
**params) -> dict`` where ``target`` is a timm ``VisionTransformer`` (initialized in place) or a
state dict of one, or of any layout in :mod:`structinit.layouts` (its tensors written in place).
``grid`` ``(H, W)`` and ``heads`` are inferred from a model (``patch_embed.grid_size``,
``blocks[0].attn.num_heads``) or from the state dict where it tells; ``layers`` selects attention
layers (``None``: all). The returned report is JSON-able.

========================  ===========================================================================
``kaiming``               PyTorch's default ``nn.Linear``/``Conv2d`` init (Kaiming uniform, a=sqrt 5)
``trunc-normal``          timm's default: Linear weights trunc-normal std 0.02, biases zero
``mimetic``               papers 002/003: ``W_Q W_K^T ~ a1 Z1 + b1 I`` per head, ``W_V W_proj ~ a2 Z2 - b2 I``
``impulse``               paper 000: Q/K solved so each head's attention is an impulse filter
========================  ===========================================================================

On a model, ``kaiming`` and ``trunc-normal`` reset every ``Linear`` (and, for ``kaiming``, the
patch-embedding convolution) as the training baselines do; on a state dict they re-draw only the
Q/K rows of the selected layers. ``mimetic`` and ``impulse`` change only Q/K (plus V/proj for
``mimetic`` and for ``impulse`` with ``mimetic_vproj=True``) and the Q/K biases (set to zero).

Use :func:`initialize_model` for a model and :func:`set_sincos_pos_embed` for the paper's fixed
2-D sin-cos position embedding.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from .errors import StructinitError, UsageError

Grid = Tuple[int, int]

MIMETIC_DEFAULTS = {"alpha1": 0.7, "beta1": 0.7, "alpha2": 0.4, "beta2": 0.4}


# --------------------------------------------------------------------------- targets

def _is_module(target) -> bool:
    import torch

    return isinstance(target, torch.nn.Module)


def model_grid(model) -> Grid:
    """Patch grid ``(H, W)`` of a timm ViT (``patch_embed.grid_size``)."""
    try:
        g = model.patch_embed.grid_size
        return int(g[0]), int(g[1])
    except AttributeError:
        raise UsageError("the model has no patch_embed.grid_size; pass grid=(H, W)") from None


def model_heads(model) -> int:
    """Heads of a timm ViT's first block."""
    try:
        return int(model.blocks[0].attn.num_heads)
    except (AttributeError, IndexError, TypeError):
        raise UsageError("the model has no blocks[0].attn.num_heads; pass heads=") from None


class _Target:
    """A state dict (a model's, sharing its storage, or a bare one) with its detected layout and shape."""

    def __init__(self, target, grid: Optional[Grid], heads: Optional[int], layers: Optional[Sequence[int]],
                 need_grid: bool = True):
        from .layouts import detect_layout, resolve_shape

        if _is_module(target):
            self.model = target
            self.sd = target.state_dict()
            grid = grid or model_grid(target)
            heads = heads or model_heads(target)
        else:
            self.model = None
            self.sd = target
        det = detect_layout(self.sd)
        if det is None:
            keys = list(self.sd)[:12]
            raise StructinitError(f"no attention layers found; keys seen: {', '.join(map(str, keys))}"
                                  + (" ..." if len(self.sd) > 12 else ""))
        self.det = det
        self.grid, self.heads = resolve_shape(det, heads, grid, need_grid)
        self.dim = det.dim
        self.layers = select_layers(layers, det.depth)

    @property
    def slots(self):
        return [self.det.slots[i] for i in self.layers]


def select_layers(layers: Optional[Sequence[int]], depth: int) -> List[int]:
    """Validated, sorted layer indices (``None``: all ``depth`` layers)."""
    if layers is None:
        return list(range(depth))
    out = sorted({int(l) for l in layers})
    bad = [l for l in out if not 0 <= l < depth]
    if bad:
        raise UsageError(f"layers {bad} out of range: the model has {depth} attention layers (0..{depth - 1})")
    if not out:
        raise UsageError("no layers selected")
    return out


def parse_layers(spec: str, depth: int) -> List[int]:
    """``all``, or comma-separated indices and ranges (``0-3``, ``5``, ``8-``), 0-based, inclusive."""
    spec = (spec or "all").strip()
    if spec == "all":
        return list(range(depth))
    out = []
    for part in spec.split(","):
        part = part.strip()
        try:
            if "-" in part:
                a, b = part.split("-", 1)
                lo = int(a) if a.strip() else 0
                hi = int(b) if b.strip() else depth - 1
                if hi < lo:
                    raise ValueError
                out.extend(range(lo, hi + 1))
            else:
                out.append(int(part))
        except ValueError:
            raise UsageError(f"--layers must be 'all' or indices/ranges like 0-3,5; got {spec!r}") from None
    return select_layers(out, depth)


def _generator(seed: int):
    import torch

    return torch.Generator().manual_seed(int(seed))


# --------------------------------------------------------------------------- baselines

def init_kaiming(target, *, grid: Optional[Grid] = None, heads: Optional[int] = None,
                 layers: Optional[Sequence[int]] = None, seed: int = 0) -> Dict[str, Any]:
    """PyTorch's default init: ``kaiming_uniform_(a=sqrt(5))`` weights, biases ``U(+-1/sqrt(fan_in))``.

    Model: ``reset_parameters()`` of every ``Linear`` and ``Conv2d``. State dict: the Q/K rows
    (and biases) of the selected layers, drawn with the bound of a ``[D, D]`` Linear.
    """
    import torch

    if _is_module(target):
        n = 0
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for m in target.modules():
                if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)):
                    m.reset_parameters()
                    n += 1
        return {"method": "kaiming", "modules_reset": n}
    return _redraw_qk(target, "kaiming", grid, heads, layers, seed)


def init_trunc_normal(target, *, grid: Optional[Grid] = None, heads: Optional[int] = None,
                      layers: Optional[Sequence[int]] = None, seed: int = 0, std: float = 0.02) -> Dict[str, Any]:
    """timm's default ViT init: Linear weights ``trunc_normal_(std=0.02)``, biases zero; a learnable
    ``pos_embed`` trunc-normal std 0.02 (a frozen one is left alone), ``cls_token`` normal std 1e-6.

    State dict: the Q/K rows of the selected layers, biases zero.
    """
    import torch

    if _is_module(target):
        from timm.layers import trunc_normal_

        n = 0
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(seed)
            pe = getattr(target, "pos_embed", None)
            if isinstance(pe, torch.nn.Parameter) and pe.requires_grad:
                trunc_normal_(pe, std=std)
            cls = getattr(target, "cls_token", None)
            if isinstance(cls, torch.nn.Parameter):
                torch.nn.init.normal_(cls, std=1e-6)
            for m in target.modules():
                if isinstance(m, torch.nn.Linear):
                    trunc_normal_(m.weight, std=std)
                    if m.bias is not None:
                        torch.nn.init.zeros_(m.bias)
                    n += 1
        return {"method": "trunc-normal", "std": std, "linear_reset": n}
    return _redraw_qk(target, "trunc-normal", grid, heads, layers, seed, std=std)


def _redraw_qk(sd, method, grid, heads, layers, seed, std=0.02) -> Dict[str, Any]:
    import torch

    from .inject import label, write_part

    t = _Target(sd, grid, heads, layers, need_grid=False)
    gen = _generator(seed)
    replaced = []
    bound = 1.0 / math.sqrt(t.dim)
    for slot in t.slots:
        keys = []
        for w, b in ((slot.q, slot.q_bias), (slot.k, slot.k_bias)):
            if method == "kaiming":
                val = (torch.rand(t.dim, t.dim, generator=gen) * 2 - 1) * bound
                bias = (torch.rand(t.dim, generator=gen) * 2 - 1) * bound
            else:
                val = (torch.randn(t.dim, t.dim, generator=gen) * std).clamp_(-2.0, 2.0)
                bias = torch.zeros(t.dim)
            write_part(t.sd, w, val)
            keys.append(label(w))
            if b is not None:
                write_part(t.sd, b, bias)
                keys.append(label(b))
        replaced.append({"layer": slot.index, "replaced": keys})
    return {"method": method, "layout": t.det.layout.name, "layers": replaced}


# --------------------------------------------------------------------------- mimetic

def mimetic_qk(dim: int, heads: int, alpha: float, beta: float, generator):
    """Per head ``A_h = alpha Z + beta I`` (``Z ~ N(0, I/D)``, fresh per head), factored by reduced
    SVD ``A = U S V^T``: ``Q_h = U[:, :d] S[:d]^1/2``, ``K_h = V[:, :d] S[:d]^1/2``.

    Returns ``(q, k, a)``: ``q, k: [H, D, d]`` and the targets ``a: [H, D, D]``.
    """
    import torch

    d = dim // heads
    z = torch.randn(heads, dim, dim, generator=generator, dtype=torch.float64) / math.sqrt(dim)
    a = alpha * z + beta * torch.eye(dim, dtype=torch.float64)
    u, s, vh = torch.linalg.svd(a)
    root = s[:, :d].sqrt().unsqueeze(-2)
    q = u[:, :, :d] * root
    k = vh.transpose(-1, -2)[:, :, :d] * root
    return q.float(), k.float(), a.float()


def mimetic_v_proj(dim: int, alpha: float, beta: float, generator):
    """``A = alpha Z - beta I`` (``Z ~ N(0, I/D)``) factored at full rank: ``W_V = U S^1/2``,
    ``W_proj = S^1/2 V^T`` (``x @ W`` convention, so ``W_V W_proj = A``). Returns ``(w_v, w_proj, a)``."""
    import torch

    z = torch.randn(dim, dim, generator=generator, dtype=torch.float64) / math.sqrt(dim)
    a = alpha * z - beta * torch.eye(dim, dtype=torch.float64)
    u, s, vh = torch.linalg.svd(a)
    root = s.sqrt()
    return (u * root).float(), (root.unsqueeze(-1) * vh).float(), a.float()


def init_mimetic(target, *, grid: Optional[Grid] = None, heads: Optional[int] = None,
                 layers: Optional[Sequence[int]] = None, seed: int = 0, alpha1: float = 0.7, beta1: float = 0.7,
                 alpha2: float = 0.4, beta2: float = 0.4, vproj: bool = True) -> Dict[str, Any]:
    """Mimetic init (papers 002/003, SPEC 2): per head ``W_Q W_K^T ~ a1 Z1 + b1 I`` (rank ``d``),
    per layer ``W_V W_proj ~ a2 Z2 - b2 I`` (full rank). Q/K biases are zeroed; V/proj biases kept.

    Report per layer: ``qk_diag_mean`` (mean diagonal of ``Q_h K_h^T`` over heads) and
    ``vproj_diag_mean`` (of ``W_V W_proj``), read back from the written weights.
    """
    from .inject import read_qk, read_vproj, write_qk, write_vproj

    t = _Target(target, grid, heads, layers, need_grid=False)
    gen = _generator(seed)
    rows = []
    for slot in t.slots:
        q, k, _ = mimetic_qk(t.dim, t.heads, alpha1, beta1, gen)
        keys = write_qk(t.sd, slot, q, k)
        if vproj:
            w_v, w_p, _ = mimetic_v_proj(t.dim, alpha2, beta2, gen)
            keys += write_vproj(t.sd, slot, w_v, w_p)
        rq, rk = read_qk(t.sd, slot, t.heads)
        row = {"layer": slot.index, "replaced": keys,
               "qk_diag_mean": float((rq @ rk.transpose(-1, -2)).diagonal(dim1=-2, dim2=-1).mean())}
        if vproj:
            rv, rp = read_vproj(t.sd, slot)
            row["vproj_diag_mean"] = float((rv @ rp).diagonal().mean())
        rows.append(row)
    return {"method": "mimetic", "layout": t.det.layout.name, "dim": t.dim, "heads": t.heads,
            "params": {"alpha1": alpha1, "beta1": beta1, "alpha2": alpha2, "beta2": beta2, "vproj": vproj},
            "layers": rows}


# --------------------------------------------------------------------------- impulse

def impulse_config(grid: Grid, dim: int, heads: int, depth: int, *, seed: int = 0, filter: int = 3,
                   recipe: str = "fast", target_mass: Optional[float] = None,
                   recipe_params: Optional[Mapping[str, Any]] = None, share: bool = False,
                   offset_order: str = "random", padding: str = "zero", pseudo_input: str = "pe",
                   pseudo_input_rest: Optional[str] = None):
    """The :class:`~structinit.config.SolveConfig` that ``impulse`` solves for a model of this shape.

    ``target_mass`` is the ``fast`` recipe's softness knob (mean attention on the target token);
    ``recipe_params`` passes any other recipe parameter (``iters``, ``lr``, ``qk_scale``...).
    """
    from .config import SolveConfig

    params = dict(recipe_params or {})
    if target_mass is not None:
        params["target_mass"] = target_mass  # a recipe without this knob rejects it (recipe_params)
    return SolveConfig(grid=grid, dim=dim, heads=heads, filter=filter, layers=depth, share=share, recipe=recipe,
                       params=params, pseudo_input=pseudo_input, pseudo_input_rest=pseudo_input_rest,
                       padding=padding, offset_order=offset_order, seed=seed)


def check_artifact(artifact, grid: Grid, dim: int, heads: int, layers: Sequence[int]) -> None:
    """Raise :class:`UsageError` unless ``artifact`` fits a model of this shape and these layers
    (an artifact of one layer is reused for every layer)."""
    c = artifact.config
    problems = []
    if c.dim != dim:
        problems.append(f"dim {c.dim} vs {dim}")
    if c.heads != heads:
        problems.append(f"heads {c.heads} vs {heads}")
    if tuple(c.grid) != tuple(grid):
        problems.append(f"grid {c.grid[0]}x{c.grid[1]} vs {grid[0]}x{grid[1]}")
    if problems:
        raise UsageError(f"the artifact does not fit the model: {'; '.join(problems)} (artifact vs model)")
    if c.layers != 1 and max(layers) >= c.layers:
        raise UsageError(f"the artifact has {c.layers} layers but layer {max(layers)} was asked for")


def init_impulse(target, *, grid: Optional[Grid] = None, heads: Optional[int] = None,
                 layers: Optional[Sequence[int]] = None, seed: int = 0, filter: int = 3, recipe: str = "fast",
                 target_mass: Optional[float] = None, recipe_params: Optional[Mapping[str, Any]] = None,
                 share: bool = False, offset_order: str = "random", padding: str = "zero",
                 pseudo_input: str = "pe", pseudo_input_rest: Optional[str] = None, artifact=None,
                 mimetic_vproj: bool = False, alpha2: float = 0.4, beta2: float = 0.4,
                 pe_scale: Optional[float] = None, cache_dir=None, device: str = "cpu",
                 tolerance: float = 0.02) -> Dict[str, Any]:
    """Impulse init (paper 000): Q/K of every selected layer from ``artifact`` (an
    :class:`~structinit.artifact.Artifact` or a path to one) or solved now (cached) for the
    target's shape with :func:`impulse_config`'s settings.

    ``mimetic_vproj`` also sets V/proj as mimetic does; ``pe_scale`` (models only) writes the
    sin-cos position embedding scaled by it (LayerNorm makes the pseudo input scale-free).

    The written weights are read back and their attention on the pseudo input is measured against
    the artifact's offsets: the report's per-layer ``hit_rate``/``target_mass``/``mse`` (means over
    heads, and per head) come from the model, not from the solver. A layer whose measured hit rate
    or target mass differs from the solver's by more than ``tolerance`` (a transposed or misplaced
    write) raises :class:`StructinitError`.
    """
    import torch

    from .artifact import Artifact, read_artifact
    from .inject import measure, read_qk, write_qk, write_vproj
    from .solve import solve
    from .targets import impulse_targets

    t = _Target(target, grid, heads, layers)
    cached = None
    if artifact is None:
        config = impulse_config(t.grid, t.dim, t.heads, t.det.depth, seed=seed, filter=filter, recipe=recipe,
                                target_mass=target_mass, recipe_params=recipe_params, share=share,
                                offset_order=offset_order, padding=padding, pseudo_input=pseudo_input,
                                pseudo_input_rest=pseudo_input_rest)
        result = solve(config, cache_dir=cache_dir, device=device)
        art, cached = result.artifact, result.cached
    else:
        art = artifact if isinstance(artifact, Artifact) else read_artifact(artifact)
    check_artifact(art, t.grid, t.dim, t.heads, t.layers)
    if pe_scale is not None:
        if t.model is None:
            raise UsageError("pe_scale needs a model (use set_pos_embed on a state dict)")
        set_sincos_pos_embed(t.model, t.grid, scale=pe_scale)
    gen = _generator(seed + 1)
    rows = []
    for slot in t.slots:
        src = 0 if art.config.layers == 1 else slot.index
        keys = write_qk(t.sd, slot, torch.from_numpy(art.q[src]), torch.from_numpy(art.k[src]))
        if mimetic_vproj:
            w_v, w_p, _ = mimetic_v_proj(t.dim, alpha2, beta2, gen)
            keys += write_vproj(t.sd, slot, w_v, w_p)
        rq, rk = read_qk(t.sd, slot, t.heads)
        targets = impulse_targets(art.config.grid, art.offsets[src], art.config.padding)
        got = measure(art.layer_input(src), rq, rk, targets)
        row = {"layer": slot.index, "replaced": keys, "offsets": art.offsets[src].tolist(),
               "hit_rate": float(np.mean(got["hit_rate"])), "target_mass": float(np.mean(got["target_mass"])),
               "mse": float(np.mean(got["mse"])), "heads": got}
        solved = art.stats.get("layers", [])
        if src < len(solved):
            for name in ("hit_rate", "target_mass"):
                want = float(np.mean([h[name] for h in solved[src]]))
                if abs(want - row[name]) > tolerance:
                    raise StructinitError(
                        f"layer {slot.index}: the written weights give {name} {row[name]:.3f} but the solve has "
                        f"{want:.3f}; the Q/K rows were not placed as the layout expects")
        rows.append(row)
    return {"method": "impulse", "layout": t.det.layout.name, "grid": list(t.grid), "dim": t.dim,
            "heads": t.heads, "artifact": {"key": art.key, "path": str(art.path) if art.path else None,
                                           "cached": cached, "config": art.config.to_dict()},
            "mimetic_vproj": mimetic_vproj, "pe_scale": pe_scale, "layers": rows,
            "hit_rate": float(np.mean([r["hit_rate"] for r in rows])),
            "target_mass": float(np.mean([r["target_mass"] for r in rows]))}


# --------------------------------------------------------------------------- position embedding

def set_sincos_pos_embed(model, grid: Optional[Grid] = None, scale: float = 1.0) -> None:
    """Write ``scale * sincos_2d(grid, D)`` into ``model.pos_embed [1, prefix + N, D]`` (the last
    ``N`` positions; prefix positions are left alone) and freeze it (``requires_grad=False``)."""
    import torch

    pe = getattr(model, "pos_embed", None)
    if not isinstance(pe, torch.Tensor):
        raise UsageError("the model has no pos_embed tensor (create it with a learnable position embedding)")
    set_pos_embed_state_dict({"pos_embed": pe}, "pos_embed", grid or model_grid(model), scale)
    pe.requires_grad_(False)


def set_pos_embed_state_dict(sd, key: str, grid: Grid, scale: float = 1.0) -> str:
    """Write ``scale * sincos_2d(grid, D)`` into the last ``N`` positions of ``sd[key] [1, prefix + N, D]``
    (in its own dtype and device); returns what was replaced."""
    import torch

    from .pseudo_input import sincos_2d

    pe = sd[key]
    n = grid[0] * grid[1]
    if pe.dim() != 3 or pe.shape[1] < n:
        raise UsageError(f"{key} of shape {list(pe.shape)} cannot hold a {grid[0]}x{grid[1]} grid")
    table = torch.from_numpy(sincos_2d(grid, pe.shape[-1])) * float(scale)
    with torch.no_grad():
        pe[0, pe.shape[1] - n:].copy_(table.to(device=pe.device, dtype=pe.dtype))
    return f"{key}[0, {pe.shape[1] - n}:{pe.shape[1]}]"


# --------------------------------------------------------------------------- registry

INIT_METHODS: Dict[str, Callable[..., Dict[str, Any]]] = {
    "kaiming": init_kaiming,
    "trunc-normal": init_trunc_normal,
    "mimetic": init_mimetic,
    "impulse": init_impulse,
}


def get_method(name: str) -> Callable[..., Dict[str, Any]]:
    if name not in INIT_METHODS:
        raise UsageError(f"unknown init method {name!r}; choose one of {', '.join(INIT_METHODS)}")
    return INIT_METHODS[name]


def initialize(target, method: str, *, grid: Optional[Grid] = None, heads: Optional[int] = None,
               layers: Optional[Sequence[int]] = None, seed: int = 0, **params) -> Dict[str, Any]:
    """Run init ``method`` on a model or state dict (see the module docstring); unknown parameters
    raise :class:`UsageError`."""
    import inspect

    fn = get_method(method)
    accepted = [p for p in inspect.signature(fn).parameters if p not in ("target",)]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise UsageError(f"init method {method!r} has no parameter(s) {unknown}; it takes {', '.join(accepted)}")
    return fn(target, grid=grid, heads=heads, layers=layers, seed=seed, **params)


def initialize_model(model, method: str, *, grid: Optional[Grid] = None, seed: int = 0, **params) -> Dict[str, Any]:
    """Initialize a timm ``VisionTransformer`` in place with ``method`` and return its report.

    ``grid`` defaults to ``model.patch_embed.grid_size``. Example::

        model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=2,
                                  class_token=False, global_pool="avg", num_classes=10)
        set_sincos_pos_embed(model)
        report = initialize_model(model, "impulse", filter=3, recipe="fast", target_mass=0.3)
    """
    if not _is_module(model):
        raise UsageError("initialize_model needs an nn.Module; use initialize() for a state dict")
    return initialize(model, method, grid=grid, seed=seed, **params)
