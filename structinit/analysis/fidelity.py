"""The attention a model actually computes on real inputs, per layer and head, and how well it
keeps a convolutional structure: the real-data counterpart of the pseudo-input measures of
:mod:`structinit.analysis.quality`.

The attention is captured from timm's own attention modules (``timm.layers.Attention`` and any
module that has its ``fused_attn`` switch and an ``attn_drop`` applied to the softmax output): for
the duration of the capture each one runs its non-fused path, and a forward hook on ``attn_drop``
reads the attention probabilities ``[B, heads, T, T]`` (rows are queries; ``T`` = prefix tokens +
grid tokens). Nothing of the model is changed: its mode, the fused switches and the hooks are
restored afterwards.

Measures, per layer and head, averaged over the images and over the query rows of grid tokens
(see :class:`Fidelity`):

- ``hit_rate``: share of rows whose argmax is the impulse target ``(y + dy, x + dx)`` (rows whose
  target falls outside the grid are left out), when offsets are given;
- ``target_mass``: mean attention on that target;
- ``window_mass``: share of the attention inside the ``f x f`` window centred on the query (on a
  sequence, the ``f`` positions around it), with or without offsets.

:func:`data_attention_quality` is the light-weight per-layer version for models built of
``model.blocks[i].attn`` with a fused ``qkv`` Linear (timm's ViT, structinit's ``transformer-1d``),
with a causal mask where the model has one; the training loop records it after the init.

Example::

    from structinit.analysis.fidelity import attention_fidelity
    report = initialize_model(model, "impulse")                 # offsets per layer in the report
    fid = attention_fidelity(model, images, offsets=offsets_from_report(report), filter=3)
    fid.hit_rate.shape      # (layers, heads)
    fid.maps.shape          # (layers, heads, T, T): the attention averaged over the images
    fid.layer_rows()[0]     # {"layer": 0, "hit_rate": ..., "target_mass": ..., "window_mass": ...}

:func:`init_fidelity` reads the offsets, filter and padding off the init's report (window share
alone for inits without offsets), and :meth:`Fidelity.query_maps` gives the maps of one query
token over the grid, the data behind ``structinit inspect MODEL --data DATASET --png``::

    fid = init_fidelity(model, images, report)
    fid.query_maps().shape  # (layers, heads, H, W): the centre token's attention, image-averaged
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Protocol, Sequence, Union

import numpy as np

from structinit.errors import UsageError, param
from structinit.geometry.grid import Grid
from structinit.geometry.targets import PADDINGS, check_choice, impulse_columns

OffsetsLike = Union[np.ndarray, Sequence, Mapping[int, Any]]


@dataclass
class Fidelity:
    """The attention of a model on a batch of real inputs and its structure measures.

    ``maps``: float32 ``[layers, heads, T, T]``, the attention averaged over the images (``T =
    prefix + N``; ``None`` when not kept); ``hit_rate``, ``target_mass``: float64 ``[layers,
    heads]`` (NaN where no offsets were given for a layer; ``None`` without offsets);
    ``window_mass``: float64 ``[layers, heads]``; ``offsets``: int ``[layers, heads, 2]`` as
    ``(dy, dx)`` (``None`` without offsets; ``-9999`` where a layer had none).
    """

    grid: Grid
    prefix: int
    filter: int
    images: int
    window_mass: np.ndarray
    hit_rate: Optional[np.ndarray] = None
    target_mass: Optional[np.ndarray] = None
    offsets: Optional[np.ndarray] = None
    maps: Optional[np.ndarray] = None
    padding: str = "zero"

    @property
    def layers(self) -> int:
        return int(self.window_mass.shape[0])

    @property
    def heads(self) -> int:
        return int(self.window_mass.shape[1])

    def grid_maps(self) -> np.ndarray:
        """``maps`` without the prefix tokens: ``[layers, heads, N, N]`` (grid queries x grid keys)."""
        if self.maps is None:
            raise UsageError("the attention maps were not kept (keep_maps=False)")
        p = self.prefix
        return self.maps[:, :, p:, p:]

    def query_maps(self, query: Optional[int] = None) -> np.ndarray:
        """The attention of grid token ``query`` (row-major; default :func:`centre_query`) over the
        grid keys, averaged over the images: ``[layers, heads, H, W]`` (``[layers, heads, L]`` on a
        sequence). Prefix keys (a class token) are left out, so a row sums to 1 less their share."""
        n = self.grid.tokens
        q = centre_query(self.grid) if query is None else query
        if isinstance(q, bool) or not isinstance(q, (int, np.integer)) or not 0 <= q < n:
            raise UsageError(f"{param('query')} must be a grid token in 0..{n - 1}, got {query!r}")
        return self.grid_maps()[:, :, int(q), :].reshape(self.layers, self.heads, *self.grid)

    def targets(self, query: Optional[int] = None) -> Optional[np.ndarray]:
        """Where each head's impulse target of grid token ``query`` lies, as grid coordinates: int
        ``[layers, heads, ndim]`` (``(y, x)``, or ``(x,)`` on a sequence), ``-1`` where the target
        falls outside the grid or a layer has no offsets; ``None`` without offsets."""
        if self.offsets is None:
            return None
        q = centre_query(self.grid) if query is None else int(query)
        h, w = self.grid.hw
        out = np.full((self.layers, self.heads, self.grid.ndim), -1, dtype=np.int64)
        for l in range(self.layers):
            if (self.offsets[l] == -9999).any():
                continue
            cols = impulse_columns(self.grid, self.offsets[l], self.padding)[:, q]  # [heads]
            for hd, c in enumerate(cols):
                if c >= 0:
                    out[l, hd] = divmod(int(c), w) if self.grid.ndim == 2 else (int(c),)
        return out

    def layer_rows(self) -> List[Dict[str, Any]]:
        """One dict per layer: ``layer`` and each measure averaged over heads (``None`` if absent)."""
        rows = []
        for l in range(self.layers):
            row: Dict[str, Any] = {"layer": l, "window_mass": float(self.window_mass[l].mean())}
            for name in ("hit_rate", "target_mass"):
                v = getattr(self, name)
                row[name] = None if v is None or np.isnan(v[l]).all() else float(np.nanmean(v[l]))
            rows.append(row)
        return rows

    def summary(self) -> Dict[str, Any]:
        """Means over layers and heads (``None`` where a measure is absent)."""
        out: Dict[str, Any] = {"window_mass": float(self.window_mass.mean())}
        for name in ("hit_rate", "target_mass"):
            v = getattr(self, name)
            out[name] = None if v is None or np.isnan(v).all() else float(np.nanmean(v))
        return out

    def to_dict(self) -> Dict[str, Any]:
        """JSON-able: shape facts, per layer and head measures, the summary (no maps)."""

        def arr(v):
            # None as an object array: numpy's stubs take no bare None as where's value (the same array results)
            return None if v is None else np.where(np.isnan(v), np.asarray(None), np.round(v, 6)).tolist()

        return {"grid": list(self.grid), "prefix": self.prefix, "filter": self.filter, "images": self.images,
                "padding": self.padding, "window_mass": arr(self.window_mass), "hit_rate": arr(self.hit_rate),
                "target_mass": arr(self.target_mass),
                "offsets": None if self.offsets is None else self.offsets.tolist(),
                "layers": self.layer_rows(), "summary": self.summary()}


def attention_modules(model) -> list:
    """The attention modules of ``model`` whose probabilities can be captured (timm's
    ``Attention`` and its kind: a ``fused_attn`` switch, ``num_heads`` and an ``attn_drop``
    module applied to the softmax output), in forward order."""
    import torch

    found = [m for m in model.modules()
             if hasattr(m, "fused_attn") and hasattr(m, "num_heads")
             and isinstance(getattr(m, "attn_drop", None), torch.nn.Module)]
    if not found:
        raise UsageError(f"the {param('model')} has no timm attention layers (modules with fused_attn, num_heads "
                         "and attn_drop); the attention of other implementations cannot be captured")
    return found


class StructureLike(Protocol):
    """The impulse structure an init report holds (:class:`structinit.init.report.StructureRecord`):
    per layer the offsets ``[heads, 2]``, the solve's filter (``None``: not said) and padding."""

    @property
    def offsets(self) -> Mapping[int, Any]: ...

    @property
    def filter(self) -> Optional[int]: ...

    @property
    def padding(self) -> str: ...


class ReportLike(Protocol):
    """What these measures read of an init's report (:class:`structinit.init.report.InitReport`,
    ``initialize_model``'s): its method and the impulse structure it wrote (``None``: none)."""

    @property
    def method(self) -> str: ...

    @property
    def structure(self) -> Optional[StructureLike]: ...


def offsets_from_report(report: ReportLike) -> Dict[int, np.ndarray]:
    """``{layer: offsets [heads, 2]}`` from the report of an impulse init (``initialize_model``)."""
    if report.structure is None:
        raise UsageError(f"the {report.method} init report holds no offsets (only impulse inits write them)")
    return {int(layer): np.asarray(o, dtype=np.int64) for layer, o in report.structure.offsets.items()}


def _offsets_array(offsets: OffsetsLike, layers: int, heads: int) -> np.ndarray:
    missing = np.full((heads, 2), -9999, dtype=np.int64)
    if isinstance(offsets, Mapping):
        out = np.stack([np.asarray(offsets.get(l, missing), dtype=np.int64) for l in range(layers)])
        bad = [l for l in offsets if not 0 <= int(l) < layers]
        if bad:
            raise UsageError(f"{param('offsets')} name layer(s) {bad} but the model has {layers} attention layers")
    else:
        out = np.asarray(offsets, dtype=np.int64)
    if out.shape != (layers, heads, 2):
        raise UsageError(f"{param('offsets')} must have shape [layers, heads, 2] = [{layers}, {heads}, 2], got "
                         f"{list(out.shape)}")
    return out


def centre_query(grid) -> int:
    """The grid token in the middle of ``grid``: ``(H // 2) * W + W // 2`` (row-major), ``L // 2``
    on a sequence of ``L``."""
    h, w = Grid(grid).hw
    return (h // 2) * w + w // 2


def report_settings(report: Optional[ReportLike]) -> Dict[str, Any]:
    """What an init report (``initialize_model``'s) says about the structure to look for:
    ``offsets`` (``{layer: [heads, 2]}``; ``None`` unless the init solved impulse offsets, i.e. every
    layer of its report gives them), ``filter`` and ``padding`` of the solve (``None``/``"zero"``
    without one) and ``method`` (``None`` for the model's own init)."""
    if report is None:
        return {"method": None, "offsets": None, "filter": None, "padding": "zero"}
    structure = report.structure
    if structure is None:
        return {"method": report.method, "offsets": None, "filter": None, "padding": "zero"}
    return {"method": report.method, "offsets": offsets_from_report(report),
            "filter": structure.filter if structure.filter is not None else 3, "padding": structure.padding}


def init_fidelity(model, images, report: Optional[ReportLike] = None, *, filter: Optional[int] = None,
                  batch_size: int = 64, keep_maps: bool = True) -> Fidelity:
    """:func:`attention_fidelity` of a model initialized by ``initialize_model`` (``report``: its
    report; ``None`` for the model's own init), on ``images`` (real inputs, as the model sees them
    in training). An impulse init's offsets, filter and padding come from the report: hit rate and
    target mass are measured on the solved offsets. Any other init has no offsets: only the window
    share is measured (``hit_rate``/``target_mass`` are ``None``). ``filter`` sets the window
    (default: the solved filter, else 3)."""
    s = report_settings(report)
    f = filter if filter is not None else (s["filter"] or 3)
    return attention_fidelity(model, images, offsets=s["offsets"], filter=f, padding=s["padding"],
                              batch_size=batch_size, keep_maps=keep_maps)


def window_mask(grid: Grid, filter_size: int, prefix: int = 0) -> np.ndarray:
    """``[N, prefix + N]`` 0/1: grid query ``(y, x)`` against every key, 1 on grid keys inside the
    ``f x f`` window centred on it (``f`` positions along a sequence)."""
    h, w = Grid(grid).hw
    n = h * w
    ys, xs = np.divmod(np.arange(n), w)
    # Kernel offsets run from -(f // 2) to f - 1 - f // 2 on each axis (as impulse offsets do).
    lo, hi = -(filter_size // 2), filter_size - 1 - filter_size // 2
    ddy = ys[None, :] - ys[:, None]
    ddx = xs[None, :] - xs[:, None]
    inside = (ddy >= lo) & (ddy <= hi) & (ddx >= lo) & (ddx <= hi)
    mask = np.zeros((n, prefix + n), dtype=np.float32)
    mask[:, prefix:] = inside.astype(np.float32)
    return mask


def capture_attention(model, images, *, batch_size: int = 64, on_batch=None) -> List[Any]:
    """Run ``model`` on ``images`` (a float tensor ``[B, C, H, W]``, normalized as the model
    expects) in inference mode and return, per attention layer, the probabilities ``[B, heads, T,
    T]`` (float32, on the CPU). For large batches prefer :func:`attention_fidelity`, which reduces
    batch by batch. ``on_batch(layers)`` (optional) receives each batch's list instead and then
    nothing is returned."""
    import torch

    mods = attention_modules(model)
    kept: List[List[Any]] = [[] for _ in mods]
    current: List[Any] = [None] * len(mods)
    hooks, fused = [], [m.fused_attn for m in mods]
    was_training = model.training

    def hook_for(i):
        def hook(_module, inputs, _output):
            current[i] = inputs[0].detach().float().cpu()
        return hook

    try:
        for i, m in enumerate(mods):
            m.fused_attn = False
            hooks.append(m.attn_drop.register_forward_hook(hook_for(i)))
        model.eval()
        device = next(model.parameters()).device
        with torch.inference_mode():
            for start in range(0, int(images.shape[0]), batch_size):
                model(images[start:start + batch_size].to(device))
                if any(c is None for c in current):
                    raise UsageError("an attention layer did not run (is the model's forward using it?)")
                if on_batch is not None:
                    on_batch(list(current))
                else:
                    for i, c in enumerate(current):
                        kept[i].append(c)
                current = [None] * len(mods)
    finally:
        for h in hooks:
            h.remove()
        for m, f in zip(mods, fused):
            m.fused_attn = f
        model.train(was_training)
    return [] if on_batch is not None else [torch.cat(k) for k in kept]


def attention_fidelity(model, images, *, offsets: Optional[OffsetsLike] = None, filter: int = 3,
                       padding: str = "zero", grid=None, prefix: Optional[int] = None, batch_size: int = 64,
                       keep_maps: bool = True) -> Fidelity:
    """Capture ``model``'s attention on ``images`` (float ``[B, C, H, W]``, normalized as in
    training) and measure its structure (see the module docstring).

    ``offsets``: the impulse offsets ``(dy, dx)`` per layer and head, ``[layers, heads, 2]`` or
    ``{layer: [heads, 2]}`` (see :func:`offsets_from_report`); without them only ``window_mass``
    is measured. ``grid``/``prefix`` default to the model's ``patch_embed.grid_size`` and
    ``num_prefix_tokens``. ``keep_maps`` keeps the batch-mean maps ``[layers, heads, T, T]``.
    """
    import torch

    from structinit.analysis.quality import attention_quality

    grid = _checked_grid(model, images, filter, padding, grid)
    if prefix is None:
        prefix = int(getattr(model, "num_prefix_tokens", 0) or 0)
    mods = attention_modules(model)
    layers, heads = len(mods), int(mods[0].num_heads)
    n = grid.tokens
    if filter > max(grid.hw):
        raise UsageError(f"{param('filter')} {filter} is larger than the {grid.describe()} grid")
    offs = _offsets_array(offsets, layers, heads) if offsets is not None else None
    window = torch.from_numpy(window_mask(grid, filter, prefix))
    cols = _target_columns(grid, offs, padding, prefix) if offs is not None else None

    sums = {"window": torch.zeros(layers, heads, dtype=torch.float64),
            "hit": torch.zeros(layers, heads, dtype=torch.float64),
            "mass": torch.zeros(layers, heads, dtype=torch.float64)}
    maps = torch.zeros(layers, heads, prefix + n, prefix + n, dtype=torch.float64) if keep_maps else None
    count = [0]

    def reduce(batch: List[Any]) -> None:
        for l, a in enumerate(batch):
            if a.shape[-1] != prefix + n or a.shape[1] != heads:
                raise UsageError(f"attention layer {l} has shape {list(a.shape[1:])} but the {grid.describe()} grid "
                                 f"with {prefix} prefix token(s) and {heads} heads needs "
                                 f"[{heads}, {prefix + n}, {prefix + n}]; pass {param('grid')}/{param('prefix')}")
            rows = a[:, :, prefix:, :]  # grid queries x all keys
            sums["window"][l] += (rows * window).sum(-1).mean(-1).sum(0).double()
            col = cols[l] if cols is not None else None
            if col is not None:
                q = attention_quality(rows, col)
                sums["hit"][l] += q["hit_rate"].sum(0).double()
                sums["mass"][l] += q["target_mass"].sum(0).double()
            if maps is not None:
                maps[l] += a.sum(0).double()
        count[0] += int(batch[0].shape[0])

    capture_attention(model, images, batch_size=batch_size, on_batch=reduce)
    b = count[0]
    hit = mass = None
    if cols is not None:
        missing = torch.tensor([c is None for c in cols])
        hit = (sums["hit"] / b).numpy()
        mass = (sums["mass"] / b).numpy()
        hit[missing.numpy()] = np.nan
        mass[missing.numpy()] = np.nan
    return Fidelity(grid=grid, prefix=prefix, filter=filter, images=b, window_mass=(sums["window"] / b).numpy(),
                    hit_rate=hit, target_mass=mass, offsets=offs,
                    maps=(maps / b).float().numpy() if maps is not None else None, padding=padding)


def _checked_grid(model, images, filter: int, padding: str, grid) -> Grid:
    """The token grid :func:`attention_fidelity` measures on (``grid``, else the model's
    ``patch_embed.grid_size``), once its ``filter``, ``padding`` and ``images`` are checked."""
    check_choice("padding", padding, PADDINGS)
    if not isinstance(filter, int) or isinstance(filter, bool) or filter < 1:
        raise UsageError(f"{param('filter')} must be a positive integer, got {filter!r}")
    if not hasattr(images, "shape") or len(images.shape) < 2 or int(images.shape[0]) < 1:
        raise UsageError(f"{param('images')} must be a non-empty batch tensor [B, ...]")
    if grid is None:
        pe = getattr(model, "patch_embed", None)
        if pe is None or getattr(pe, "grid_size", None) is None:
            raise UsageError(f"give {param('grid')}: the model has no patch_embed.grid_size")
        grid = tuple(int(s) for s in pe.grid_size)
    return Grid(grid)


def _target_columns(grid: Grid, offs, padding: str, prefix: int) -> List[Optional[Any]]:
    """Per layer, the key column of each head's impulse target among all ``prefix + tokens`` keys
    (``[heads, tokens]``, -1 where the target falls outside with zero padding); ``None`` for a
    layer whose offsets are missing (-9999)."""
    import torch

    cols: List[Optional[Any]] = []
    for layer_offsets in offs:
        if (layer_offsets == -9999).any():
            cols.append(None)
        else:
            c = torch.from_numpy(impulse_columns(grid, layer_offsets, padding))
            cols.append(torch.where(c >= 0, c + prefix, c))  # key index among all T tokens
    return cols


__all__ = ["Fidelity", "attention_fidelity", "init_fidelity", "capture_attention", "attention_modules",
           "offsets_from_report", "report_settings", "centre_query", "window_mask", "ReportLike", "StructureLike"]


# ---- per-layer quality on one batch (timm-style blocks; sequences and causal masks too)

def attention_of(attn, x, mask=None):
    """The attention map of a timm ``Attention`` module on ``x: [B, N, D]``: ``[B, H, N, N]``
    (its own ``qkv``, ``q_norm``/``k_norm`` and scale; ``mask``: bool ``[N, N]`` visible keys)."""
    import torch

    b, n, dim = x.shape
    heads = attn.num_heads
    qkv = attn.qkv(x).reshape(b, n, 3, heads, dim // heads).permute(2, 0, 3, 1, 4)
    q, k = attn.q_norm(qkv[0]), attn.k_norm(qkv[1])
    logits = (q @ k.transpose(-1, -2)) * attn.scale
    if mask is not None:
        logits = logits.masked_fill(~torch.as_tensor(mask, device=logits.device), float("-inf"))
    return torch.softmax(logits.float(), dim=-1)


def data_attention_quality(model, x, offsets, grid, padding: str = "zero", causal: bool = False,
                           layers: Optional[List[int]] = None) -> Dict[str, Any]:
    """Per layer, the ``hit_rate`` and ``target_mass`` of the model's attention on the real batch
    ``x`` against ``offsets`` (``[layers, heads, 2]``, or one ``[heads, 2]`` per entry of ``layers``),
    averaged over the batch (per head under ``heads``); and their means over the layers. JSON-able.
    Tokens before the grid's (a class token) are left out as queries, as in :func:`attention_fidelity`."""
    import torch

    from structinit.analysis.capture import attention_inputs
    from structinit.analysis.quality import attention_quality
    from structinit.geometry.targets import causal_mask, impulse_columns

    inputs = attention_inputs(model, x)
    layers = list(range(len(offsets))) if layers is None else list(layers)
    mask = causal_mask(grid, causal)
    # Prefix tokens (a class token) come first: they are neither queries nor targets here.
    n = Grid(grid).tokens
    prefix = int(inputs[0].shape[1]) - n if inputs else 0
    if prefix < 0:
        raise UsageError(f"the model has {inputs[0].shape[1]} tokens, fewer than the {Grid(grid).describe()} grid")
    if mask is not None and prefix:
        full = np.ones((prefix + n, prefix + n), dtype=bool)
        full[prefix:, prefix:] = mask
        mask = full
    rows = []
    for i, layer in enumerate(layers):
        blk = model.blocks[layer]
        with torch.no_grad():
            attn = attention_of(blk.attn, inputs[layer], mask)[..., prefix:, :]
        cols = torch.from_numpy(impulse_columns(grid, np.asarray(offsets[i]), padding))
        cols = torch.where(cols >= 0, cols + prefix, cols)  # key index among all tokens
        got = attention_quality(attn, cols)
        heads = {m: [float(v) for v in got[m].mean(0)] for m in ("hit_rate", "target_mass")}
        rows.append({"layer": layer, **{m: float(np.mean(v)) for m, v in heads.items()}, "heads": heads})
    return {"samples": int(x.shape[0]), "layers": rows,
            "hit_rate": float(np.mean([r["hit_rate"] for r in rows])) if rows else float("nan"),
            "target_mass": float(np.mean([r["target_mass"] for r in rows])) if rows else float("nan")}
