"""Attention maps of Q/K on an input, and the quality measures of a solution: one record for all.

Conventions: ``x: [..., N, D]``, ``q, k: [..., D, d]`` (one matrix per head, ``d = D / heads``),
attention ``M = softmax(x q (x k)^T / sqrt(d))`` of shape ``[..., N, N]`` (rows are queries).
Targets are given as the target column of every row, int64 ``[..., N]`` with ``-1`` for rows
without one (see :func:`structinit.geometry.targets.impulse_columns`).

The measures (:class:`Quality`): ``mse`` (mean over all ``N x N`` entries of the squared
difference to the 0/1 impulse matrix), ``hit_rate`` (share of rows with a target whose argmax is
the target column), ``target_mass`` (mean attention on the target column over those rows),
``q_norm`` / ``k_norm`` (mean column norm of Q / K, the norm taken over ``D``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List

import numpy as np

MEASURES = ("mse", "hit_rate", "target_mass", "q_norm", "k_norm")


def attention_logits(x, q, k, mask=None):
    """Scaled logits ``x q (x k)^T / sqrt(d)``: ``[..., N, N]`` (torch tensors). ``mask``: bool
    ``[N, N]`` of the keys each query may see (a decoder's causal mask; ``None``: all); hidden
    entries are ``-inf``."""
    d = q.shape[-1]
    logits = (x @ q) @ (x @ k).transpose(-1, -2) / math.sqrt(d)
    if mask is not None:
        import torch

        allowed = torch.as_tensor(np.asarray(mask) if not isinstance(mask, torch.Tensor) else mask,
                                  device=logits.device)
        logits = logits.masked_fill(~allowed, float("-inf"))
    return logits


def attention_maps(x, q, k, mask=None):
    """Attention ``softmax(x q (x k)^T / sqrt(d))``: ``[..., N, N]`` (float32 torch tensors); see
    :func:`attention_logits` for ``mask``."""
    import torch

    return torch.softmax(attention_logits(x.float(), q.float(), k.float(), mask), dim=-1)


def targets_to_columns(targets):
    """Dense 0/1 targets ``[..., N, N]`` -> target columns ``[..., N]`` (``-1`` for empty rows)."""
    import torch

    t = torch.as_tensor(targets)
    return torch.where(t.sum(-1) > 0, t.argmax(-1), torch.full_like(t.argmax(-1), -1))


def attention_quality(attn, columns) -> Dict[str, Any]:
    """``mse``, ``hit_rate``, ``target_mass`` of attention ``[..., N, N]`` against target columns
    ``[..., N]`` (broadcast over leading axes); each a tensor ``[...]``."""
    import torch

    attn = attn.float()
    cols = torch.as_tensor(columns, device=attn.device).long().expand(attn.shape[:-1])
    has = cols >= 0
    safe = cols.clamp(min=0)
    on_target = attn.gather(-1, safe.unsqueeze(-1)).squeeze(-1) * has
    n = attn.shape[-1]
    # sum (attn - T)^2 = sum attn^2 - 2 sum attn[target] + (rows with a target)
    sq = (attn ** 2).sum(dim=(-1, -2)) - 2 * on_target.sum(-1) + has.sum(-1)
    rows = has.sum(-1).clamp(min=1)
    hit = (attn.argmax(-1) == cols) & has
    return {"mse": sq / (n * n), "hit_rate": hit.sum(-1) / rows, "target_mass": on_target.sum(-1) / rows}


def column_norms(w):
    """Mean column norm of ``w: [..., D, d]`` (norm over ``D``), shape ``[...]``."""
    return w.float().norm(dim=-2).mean(-1)


@dataclass
class Quality:
    """Quality of a solution, per layer and head: every field is float64 ``[layers, heads]``."""

    mse: np.ndarray
    hit_rate: np.ndarray
    target_mass: np.ndarray
    q_norm: np.ndarray
    k_norm: np.ndarray

    @property
    def layers(self) -> int:
        return int(self.mse.shape[0])

    def cell(self, layer: int, head: int) -> Dict[str, float]:
        return {m: float(getattr(self, m)[layer, head]) for m in MEASURES}

    def summary(self) -> Dict[str, float]:
        """Each measure averaged over all layers and heads."""
        return {m: float(getattr(self, m).mean()) for m in MEASURES}

    def layer_row(self, layer: int = 0) -> Dict[str, Any]:
        """``mse``, ``hit_rate``, ``target_mass`` of ``layer`` averaged over heads, and per head under
        ``heads`` (lists): how reports show one layer."""
        heads = {m: [float(v) for v in getattr(self, m)[layer]] for m in ("mse", "hit_rate", "target_mass")}
        return {**{m: float(np.mean(v)) for m, v in heads.items()}, "heads": heads}

    def to_stats(self) -> List[List[Dict[str, float]]]:
        """The artifact's ``stats["layers"]`` form: ``[layer][head] -> {measure: value}``."""
        return [[self.cell(l, h) for h in range(self.mse.shape[1])] for l in range(self.layers)]

    @classmethod
    def from_stats(cls, layers: List[List[Dict[str, float]]]) -> "Quality":
        return cls(**{m: np.array([[c[m] for c in layer] for layer in layers], dtype=np.float64) for m in MEASURES})

    def select(self, index) -> "Quality":
        """The layers ``index`` (an index array) of this record."""
        return Quality(**{m: getattr(self, m)[index] for m in MEASURES})


#: Attention maps larger than this (float32 bytes, all layers and heads together) are measured
#: head by head in row chunks instead of at once.
DENSE_BYTES = 128 * 2 ** 20
CHUNK_BYTES = 32 * 2 ** 20


def _row_chunks(n: int, budget: int = CHUNK_BYTES):
    step = max(1, min(n, budget // (4 * 3 * max(n, 1))))
    return [(i, min(i + step, n)) for i in range(0, n, step)]


def _head_quality(x, q, k, cols, mask=None) -> Dict[str, float]:
    """``mse``, ``hit_rate``, ``target_mass`` of one head (``x: [N, D]``, ``q, k: [D, d]``,
    ``cols: [N]``, ``mask``: bool ``[N, N]`` or ``None``), row chunk by row chunk: never more than
    a chunk of the ``N x N`` map at once."""
    import torch

    n = x.shape[0]
    xq, xk = x @ q, x @ k
    scale = 1.0 / math.sqrt(q.shape[-1])
    has = cols >= 0
    sq = on = hits = 0.0
    for a, b in _row_chunks(n):
        logits = (xq[a:b] @ xk.transpose(0, 1)) * scale
        if mask is not None:
            logits = logits.masked_fill(~mask[a:b], float("-inf"))
        attn = torch.softmax(logits, dim=-1)
        c = cols[a:b]
        on_t = attn.gather(-1, c.clamp(min=0).unsqueeze(-1)).squeeze(-1) * has[a:b]
        sq += float((attn.double() ** 2).sum())
        on += float(on_t.double().sum())
        hits += float(((attn.argmax(-1) == c) & has[a:b]).sum())
    rows = max(int(has.sum()), 1)
    return {"mse": (sq - 2 * on + int(has.sum())) / (n * n), "hit_rate": hits / rows, "target_mass": on / rows}


def measure(x, q, k, columns, mask=None) -> Quality:
    """:class:`Quality` of ``q, k: [L, H, D, d]`` on inputs ``x: [L, N, D]`` against target columns
    ``[L, H, N]``. NumPy arrays or torch tensors; one layer may be given as ``x: [N, D]``,
    ``q, k: [H, D, d]``, ``columns: [H, N]``. ``mask``: bool ``[N, N]`` visible keys (a causal
    decoder's mask), ``None`` for none. Small maps are measured at once; large ones (over
    :data:`DENSE_BYTES`) head by head in row chunks, so memory stays ``O(N)`` per row."""
    import torch

    x, q, k = (torch.as_tensor(np.asarray(t) if not isinstance(t, torch.Tensor) else t) for t in (x, q, k))
    cols = torch.as_tensor(np.asarray(columns) if not isinstance(columns, torch.Tensor) else columns)
    if q.dim() == 3:
        x, q, k, cols = x.unsqueeze(0), q.unsqueeze(0), k.unsqueeze(0), cols.unsqueeze(0)
    L, H, n = q.shape[0], q.shape[1], x.shape[-2]
    if L * H * n * n * 4 <= DENSE_BYTES:
        attn = attention_maps(x.unsqueeze(1).to(q.device), q, k, mask)
        got = attention_quality(attn, cols.to(attn.device))
        got = {m: v.detach().double().cpu().numpy() for m, v in got.items()}
    else:
        if mask is not None:
            mask = torch.as_tensor(np.asarray(mask) if not isinstance(mask, torch.Tensor) else mask, device=q.device)
        got = {m: np.zeros((L, H)) for m in ("mse", "hit_rate", "target_mass")}
        xs = x.float().to(q.device)
        for l in range(L):
            for h in range(H):
                cell = _head_quality(xs[l if xs.shape[0] > 1 else 0], q[l, h].float(), k[l, h].float(),
                                     cols[l, h].to(q.device), mask)
                for m, v in cell.items():
                    got[m][l, h] = v
    got["q_norm"] = column_norms(q).detach().double().cpu().numpy()
    got["k_norm"] = column_norms(k).detach().double().cpu().numpy()
    return Quality(**{m: np.asarray(got[m], dtype=np.float64) for m in MEASURES})


def closest_offsets(x, q, k, grid, mask=None) -> np.ndarray:
    """Per head, the impulse offset ``(dy, dx)`` its attention follows most on input ``x: [N, D]``
    (``q, k: [H, D, d]``): the most common displacement from each query token to its argmax key
    (among the keys ``mask`` lets it see). int32 ``[H, 2]``."""
    import torch

    from structinit.geometry.grid import Grid

    x, q, k = (torch.as_tensor(np.asarray(t, np.float32) if not isinstance(t, torch.Tensor) else t) for t in (x, q, k))
    x, q, k = x.float(), q.float(), k.float()
    xq, xk = x @ q, x @ k  # [H, N, d]
    n, heads = x.shape[0], q.shape[0]
    if mask is not None:
        mask = torch.as_tensor(np.asarray(mask) if not isinstance(mask, torch.Tensor) else mask, device=xq.device)
    step = max(1, CHUNK_BYTES // (4 * n * heads))
    chunks = []
    for a in range(0, n, step):
        logits = xq[:, a:a + step] @ xk.transpose(-1, -2)
        if mask is not None:
            logits = logits.masked_fill(~mask[a:a + step], float("-inf"))
        chunks.append(logits.argmax(-1).cpu().numpy())
    arg = np.concatenate(chunks, axis=1)  # [H, N]
    h, w = Grid(grid).hw
    qy, qx = np.divmod(np.arange(h * w), w)
    out = np.zeros((arg.shape[0], 2), dtype=np.int32)
    for head in range(arg.shape[0]):
        ky, kx = np.divmod(arg[head], w)
        disp = (ky - qy) * (2 * w + 1) + (kx - qx)  # a unique code per displacement
        vals, counts = np.unique(disp, return_counts=True)
        best = int(vals[np.argmax(counts)])
        dy, dx = divmod(best + w, 2 * w + 1)
        out[head] = (dy, dx - w)
    return out


def artifact_attention(artifact, layer: int, query=None) -> np.ndarray:
    """Attention of every head of ``layer`` of an artifact on its pseudo input: ``[heads, N, N]``
    (NumPy), or only the rows of ``query`` (an int or a list of token indices): ``[heads, Q, N]``."""
    import torch

    from structinit.geometry.targets import causal_mask

    x = torch.from_numpy(artifact.layer_input(layer))
    q, k = torch.from_numpy(artifact.q[layer]), torch.from_numpy(artifact.k[layer])
    rows = x if query is None else x[torch.as_tensor(np.atleast_1d(query))]
    logits = (rows @ q) @ (x @ k).transpose(-1, -2) / math.sqrt(q.shape[-1])
    mask = causal_mask(artifact.config.grid, artifact.config.causal)
    if mask is not None:
        visible = torch.from_numpy(mask if query is None else mask[np.atleast_1d(query)])
        logits = logits.masked_fill(~visible, float("-inf"))
    return torch.softmax(logits.float(), dim=-1).numpy()
