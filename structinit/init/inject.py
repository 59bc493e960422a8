"""Reading and writing per-head Q/K (and V/proj) in a state dict, and measuring what was written.

Convention: a projection weight is an ``nn.Linear`` weight ``[out, in]`` applied as
``x @ W^T``; for head ``h`` rows ``h*d:(h+1)*d`` of the q block are ``Q_h^T`` and the same rows of
the k block are ``K_h^T``, where ``Q_h, K_h: [D, d]`` and head ``h`` attends with
``softmax(x Q_h (x K_h)^T / sqrt(d))``. Per-head arrays are ``[heads, D, d]``. A *transposed*
part (GPT-2's ``Conv1D``, stored ``[in, out]`` and applied as ``x @ W``) is read and written
through the same row view: its columns are transposed on the way in and out.

Writes go into the state dict's tensors in place, under ``torch.no_grad()``, cast to each tensor's
own dtype and device, touching only the rows named by the slot; a ``model.state_dict()`` shares
storage with the model, so writing into it initializes the model.
"""

from __future__ import annotations

from typing import List, Mapping, MutableMapping

import torch

from structinit.errors import StructinitError
from structinit.init.layouts import AttnSlot, Part


def heads_to_rows(w: torch.Tensor) -> torch.Tensor:
    """Per-head ``[H, D, d]`` -> projection rows ``[H*d, D]`` (row block ``h`` is ``w[h]^T``)."""
    h, dim, d = w.shape
    return w.transpose(-1, -2).reshape(h * d, dim)


def rows_to_heads(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """Projection rows ``[H*d, D]`` -> per-head ``[H, D, d]`` (inverse of :func:`heads_to_rows`)."""
    n, dim = rows.shape
    return rows.reshape(heads, n // heads, dim).transpose(-1, -2)


def read_part(sd: Mapping, part: Part) -> torch.Tensor:
    """The rows of ``part`` as float32 (a copy); a transposed part's columns, transposed to rows."""
    t = sd[part.key]
    block = t[:, part.start:part.stop].T if part.transposed else t[part.start:part.stop]
    return block.detach().to("cpu", torch.float32).clone()


def write_part(sd: MutableMapping, part: Part, value: torch.Tensor) -> None:
    """Write ``value`` (rows) into the rows of ``part`` (the columns of a transposed part), in the
    tensor's own dtype and device."""
    t = sd[part.key]
    with torch.no_grad():
        if part.transposed:
            t[:, part.start:part.stop].copy_(value.T.to(device=t.device, dtype=t.dtype))
        else:
            t[part.start:part.stop].copy_(value.to(device=t.device, dtype=t.dtype))


def read_qk(sd: Mapping, slot: AttnSlot, heads: int):
    """``(q, k)`` float32 ``[H, D, d]`` of one attention layer."""
    return rows_to_heads(read_part(sd, slot.q), heads), rows_to_heads(read_part(sd, slot.k), heads)


def write_qk(sd: MutableMapping, slot: AttnSlot, q: torch.Tensor, k: torch.Tensor, zero_bias: bool = True) -> List[str]:
    """Write ``q, k: [H, D, d]`` into one layer; zero the q/k biases (the solve assumes none).

    Returns the written keys with their rows, e.g. ``blocks.0.attn.qkv.weight[0:192]``.
    """
    written = []
    for part, w in ((slot.q, q), (slot.k, k)):
        write_part(sd, part, heads_to_rows(torch.as_tensor(w, dtype=torch.float32)))
        written.append(label(part))
    if zero_bias:
        for bias in (slot.q_bias, slot.k_bias):
            if bias is not None:
                write_part(sd, bias, torch.zeros(bias.stop - bias.start))
                written.append(label(bias))
    return written


def write_vproj(sd: MutableMapping, slot: AttnSlot, w_v: torch.Tensor, w_proj: torch.Tensor) -> List[str]:
    """Write ``W_V, W_proj: [D, D]`` given in the ``x @ W`` convention (so ``x W_V W_proj`` is the
    layer's value-output map); stored transposed as ``nn.Linear`` weights. Biases are left alone."""
    if slot.proj is None:
        raise StructinitError(f"layer {slot.index}: no output projection found ({slot.block}...)")
    write_part(sd, slot.v, torch.as_tensor(w_v).T)
    write_part(sd, proj_part(sd, slot), torch.as_tensor(w_proj).T)
    return [label(slot.v), slot.proj]


def proj_part(sd: Mapping, slot: AttnSlot) -> Part:
    """The whole output projection of ``slot`` as a :class:`Part` (transposed for Conv1D layouts)."""
    assert slot.proj is not None  # its callers check that the layer has one
    axis = 1 if slot.transposed else 0
    return Part(slot.proj, 0, sd[slot.proj].shape[axis], transposed=slot.transposed)


def read_vproj(sd: Mapping, slot: AttnSlot):
    """``(W_V, W_proj)`` float32 ``[D, D]`` in the ``x @ W`` convention."""
    w_v = read_part(sd, slot.v).T
    w_p = read_part(sd, proj_part(sd, slot)).T if slot.proj else None
    return w_v, w_p


def label(part: Part) -> str:
    """``key[start:stop]`` (``key[:, start:stop]`` for a transposed part): how reports name the rows a
    write touched."""
    if part.transposed:
        return f"{part.key}[:, {part.start}:{part.stop}]"
    return f"{part.key}[{part.start}:{part.stop}]"
