"""A position subspace reserved in the residual stream: ``k`` of a model's ``D`` dimensions carry the
position table alone at init, so that Q/K which read only them see position and nothing else.

Why: a 16x16x3 patch puts 768 content dimensions into a residual stream of 192-768 (ViT-T/S/B at
224). Content then fills every direction of every layer's input, and no Q/K of the stream can read
position past it: the data fit of the whole stream leaves the deeper layers of ViT-T hitting their
offsets in a few percent of the rows of real images. With the position table in ``k`` directions
that nothing else writes, the attention of every layer reads position exactly (the measurements:
``docs/results/patch16``).

What is written (``basis``: an orthonormal ``B [D, k]`` drawn from the init's seed, orthogonal to
the all-ones direction so that LayerNorm's mean subtraction leaves it alone; ``C = I - B B^T``):

- the position embedding's grid rows: the ``k``-dim sin-cos table times ``gain``, in ``B``
  (``table @ B^T``); its prefix (class-token) rows and the prefix tokens themselves are projected
  onto ``C``;
- every tensor that writes into the residual stream at init (the patch or token embedding, each
  attention layer's output projection, each MLP's output projection; weights and biases) is
  projected onto ``C``: its output lies outside ``B``;
- each layer's Q/K read only ``B`` (the solve on the written table does, and the data fit runs on
  the layer inputs projected onto ``B``).

LayerNorm then scales a token's position part by its own norm only, which the fit, run on inputs of
the model's input shape, sees and calibrates for. ``gain`` defaults to ``sqrt(D / k)`` times
``pe_scale``: the table carries the energy of the full ``D``-dim sin-cos table at that scale, so a
token's LayerNorm divides its content by what it did with the full table.

Shapes: ``basis [D, k]``; weights stored ``[out, ...]`` with ``out = D`` (a Linear ``[D, in]``, a
Conv ``[D, C, *kernel]``), or ``[in, D]`` for a transposed (Conv1D) layout; biases ``[D]``;
prefix tokens ``[1, n, D]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, MutableMapping, Optional

from structinit.errors import UsageError, param

if TYPE_CHECKING:
    import torch

#: Added to the init's seed for the basis generator (independent of the V/proj and solve draws).
BASIS_SEED_OFFSET = 3


def auto_dims(dim: int, heads: int, ndim: int = 2) -> int:
    """The default ``k`` for a model of ``dim`` and ``heads``: the head dim, at most a quarter of
    ``dim``, rounded down to what the ``ndim``-D sin-cos table needs (a multiple of 4, or of 2 on a
    sequence): a head's ``Q_h K_h^T`` restricted to the subspace has rank ``min(k, d)``, so ``k``
    past ``d`` buys nothing, and a quarter of the stream leaves the content three quarters. ViT-T
    (192, 3 heads): 48; ViT-S and ViT-B: 64; dim 64 with 4 heads: 16."""
    step = 4 if ndim == 2 else 2
    k = min(dim // heads, dim // 4)
    return max(step, k - k % step)


def check_dims(k: int, dim: int, ndim: int) -> None:
    """Raise :class:`UsageError` unless ``k`` is a usable subspace size for ``dim`` (positive, below
    ``dim``, a multiple of 4 on an image grid, of 2 on a sequence)."""
    step = 4 if ndim == 2 else 2
    if k <= 0 or k >= dim - 1 or k % step:
        raise UsageError(f"impulse parameter {param('position_dims')} must be a positive multiple of {step} below "
                         f"the model's dim {dim} less one, got {k}")


def subspace_basis(dim: int, k: int, seed: int) -> "torch.Tensor":
    """An orthonormal ``[dim, k]`` basis orthogonal to the all-ones direction, drawn from a
    generator seeded with ``seed + BASIS_SEED_OFFSET`` (float32)."""
    import torch

    gen = torch.Generator().manual_seed(int(seed) + BASIS_SEED_OFFSET)
    a = torch.randn(dim, k, generator=gen, dtype=torch.float64)
    ones = torch.full((dim, 1), 1.0 / math.sqrt(dim), dtype=torch.float64)
    a = a - ones @ (ones.T @ a)
    q, _ = torch.linalg.qr(a)
    return q.float()


@dataclass
class PositionSubspace:
    """The subspace of one target: ``dims`` (``k``), ``gain`` (the table's scale) and ``basis``
    ``[D, k]``; :meth:`write_table` and :meth:`project_embedding` prepare the stream before the
    first layer, :meth:`project_layer` keeps a layer's writes out of it, :attr:`projected` names
    every tensor changed."""

    dims: int
    gain: float
    basis: Any
    projected: List[str] = field(default_factory=list)
    #: Also write the full ``D``-dim sin-cos table (times ``rest_scale``) projected onto ``C``: the model keeps
    #: the whole position code there (a frozen table stays frozen), and Q/K at init still read ``B`` alone.
    rest_scale: float = 0.0
    #: Scale each projected tensor back to the Frobenius norm it had before the projection (which
    #: takes about ``k / D`` of a random weight's energy): the control that tells the subspace's
    #: directions apart from its smaller writes.
    keep_norms: bool = False

    @classmethod
    def for_target(cls, t, dims: int, pe_scale: Optional[float], seed: int,
                   rest: bool = False, keep_norms: bool = False) -> "PositionSubspace":
        """The subspace of ``dims`` (0: :func:`auto_dims`) for target ``t``, with ``gain = pe_scale
        (default 1) * sqrt(D / dims)``. Refuses a target whose layout does not name the tensors that
        write its stream, or that has no position embedding."""
        layout = t.det.layout
        if t.pos_key is None or not layout.embed or not layout.writers:
            raise UsageError(f"impulse parameter {param('position_subspace')} needs a model whose position embedding "
                             f"and stream writers structinit knows (timm ViTs, Hugging Face ViT/DeiT); the "
                             f"{t.layout} target is not one")
        ndim = t.grid.ndim  # the impulse init always has its grid
        k = dims or auto_dims(t.dim, t.heads, ndim)
        check_dims(k, t.dim, ndim)
        scale = 1.0 if pe_scale is None else float(pe_scale)
        return cls(k, scale * math.sqrt(t.dim / k), subspace_basis(t.dim, k, seed), rest_scale=scale if rest else 0.0,
                   keep_norms=keep_norms)

    def complement(self) -> "torch.Tensor":
        """``C = I - B B^T`` ``[D, D]``."""
        import torch

        return torch.eye(self.basis.shape[0]) - self.basis @ self.basis.T

    def table(self, grid) -> "torch.Tensor":
        """The ``k``-dim sin-cos table of ``grid`` times ``gain``, in the subspace: ``[N, D]``."""
        import torch

        from structinit.geometry.embedding import sincos

        out = self.gain * torch.from_numpy(sincos(grid, self.dims)) @ self.basis.T
        if self.rest_scale:
            out = out + self.rest_scale * torch.from_numpy(sincos(grid, self.basis.shape[0])) @ self.complement()
        return out

    def write_table(self, t) -> str:
        """Write :meth:`table` into the grid rows of ``t``'s position embedding (in place; a learned
        embedding stays learnable) and project its prefix rows onto ``C``; returns what was written,
        in words."""
        import torch

        pe = t.sd[t.pos_key]
        n = t.grid.tokens
        if pe.dim() != 3 or pe.shape[1] < n:
            raise UsageError(f"{t.pos_key} of shape {list(pe.shape)} cannot hold the {t.grid.describe()} grid")
        start = pe.shape[1] - n
        with torch.no_grad():
            if start:
                pe[0, :start].copy_(pe[0, :start].float().cpu() @ self.complement())
            pe[0, start:].copy_(self.table(t.grid))
        return f"the {self.dims}-dim sin-cos table x{self.gain:.3g} in a position subspace of {t.pos_key}"

    def project_embedding(self, t) -> None:
        """Project the embedding's weights and bias and the prefix tokens onto ``C`` (in place)."""
        model = t.det.model_prefix
        keys = [model + k for k in t.det.layout.embed] + [model + k for k in t.det.layout.prefix_tokens]
        self._project(t.sd, [k for k in keys if k in t.sd], t.det.layout.transposed)

    def project_layer(self, t, slot) -> None:
        """Project what layer ``slot`` adds to the stream (its output projection, its MLP's output)
        onto ``C`` (in place). A weight the layout names but the target lacks is refused (a bias
        may be absent): a writer left out would break the subspace."""
        from structinit.errors import StructinitError

        keys = [slot.block + k for k in t.det.layout.writers]
        missing = [k for k in keys if k not in t.sd and k.endswith("weight")]
        if missing:
            raise StructinitError(f"impulse parameter {param('position_subspace')}: layer {slot.index} has no "
                                  f"{missing[0]}, which writes into its residual stream")
        self._project(t.sd, [k for k in keys if k in t.sd], t.det.layout.transposed)

    def _project(self, sd: MutableMapping, keys: List[str], transposed: bool) -> None:
        import torch

        c = self.complement()
        for key in keys:
            w = sd[key]
            with torch.no_grad():
                x = w.detach().to("cpu", torch.float32)
                if x.dim() == 3 and x.shape[0] == 1:  # prefix tokens [1, n, D]
                    out = x @ c
                elif transposed and x.dim() == 2:  # Conv1D [in, D]
                    out = x @ c
                else:  # [D, ...] or a bias [D]
                    out = (c @ x.reshape(x.shape[0], -1)).reshape(x.shape)
                if self.keep_norms and float(out.norm()) > 0:
                    out = out * (x.norm() / out.norm())
                w.copy_(out.to(device=w.device, dtype=w.dtype))
            if key not in self.projected:
                self.projected.append(key)

    def record(self) -> Dict[str, Any]:
        """The report's ``position_subspace``: dims, gain, the tensors projected, and ``keep_norms``
        when they were scaled back to their norms."""
        return {"dims": self.dims, "gain": round(self.gain, 6), "projected": list(self.projected),
                **({"keep_norms": True} if self.keep_norms else {})}


__all__ = ["PositionSubspace", "auto_dims", "check_dims", "subspace_basis", "BASIS_SEED_OFFSET"]
