"""What an init method writes into: a model or a state dict, seen as its attention layers.

:class:`AttentionTarget` wraps a ``torch.nn.Module`` (its ``state_dict()`` shares storage with it,
so writing into it initializes the model) or a bare state dict of any layout in
:mod:`structinit.init.layouts`, with the shape it has: token grid, dim, heads, depth, and the
layers selected.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, List, Optional, Sequence, Union

from structinit.errors import StructinitError, UsageError, param
from structinit.geometry.grid import Grid

if TYPE_CHECKING:
    from structinit.init.family import InputSpec


def is_module(target) -> bool:
    import torch

    return isinstance(target, torch.nn.Module)


def select_layers(layers: Optional[Sequence[int]], depth: int) -> List[int]:
    """Validated, sorted layer indices (``None``: all ``depth`` layers)."""
    if layers is None:
        return list(range(depth))
    out = sorted({int(l) for l in layers})
    if not out:
        raise UsageError(f"no {param('layers')} selected")
    bad = [l for l in out if not 0 <= l < depth]
    if bad:
        raise UsageError(f"{param('layers')} {bad} out of range: the model has {depth} attention layers "
                         f"(0..{depth - 1})")
    return out


def parse_layers(spec: Optional[str], depth: int) -> List[int]:
    """``all``, or comma-separated 0-based indices and inclusive ranges (``0-3``, ``5``, ``8-``).
    Negative indices are refused (``-1`` would read as the range ``0-1``), as is an empty selection."""
    text = "all" if spec is None else str(spec).strip()
    if text == "all":
        return list(range(depth))
    out: List[int] = []
    for part in text.split(","):
        part = part.strip()
        if part.startswith("-"):
            raise UsageError(f"{param('layers')} takes 0-based indices, not negative ones like {part!r}: the layers "
                             f"are 0..{depth - 1}, and 'N-' selects from layer N to the last")
        try:
            if not part:
                raise ValueError
            if "-" in part:
                a, b = part.split("-", 1)
                lo = int(a)  # never empty: a part starting with "-" was refused above
                hi = int(b) if b.strip() else depth - 1
                if hi < lo or lo < 0:
                    raise ValueError
                out.extend(range(lo, hi + 1))
            else:
                out.append(int(part))
        except ValueError:
            raise UsageError(f"{param('layers')} must be 'all' or 0-based indices and ranges like 0-3,5; "
                             f"got {spec!r}") from None
    return select_layers(out, depth)


class _Reported(list):
    """A list whose iteration calls ``report(done, total)`` after each item has been handled."""

    def __init__(self, items, report):
        super().__init__(items)
        self._report = report

    def __iter__(self):
        for i, item in enumerate(list.__iter__(self)):
            yield item
            self._report(i + 1, len(self))


class AttentionTarget:
    """A model or state dict with its detected layout, shape and selected layers.

    ``grid``/``heads`` come from the model or the state dict where they tell, else from the caller;
    ``need_grid=False`` lets the grid stay ``None`` (methods that do not use it). ``progress(done,
    total)`` is called as a method finishes each selected layer. A model's ``family``
    (:class:`~structinit.init.family.ModelFamily`) tells its grid, heads and how its layer inputs are
    captured, and ``inputs`` (:class:`~structinit.init.family.InputSpec`, what a data fit runs on) is
    the one given or the one its family tells (``None`` on a state dict, or where it does not tell).
    """

    def __init__(self, target, grid=None, heads: Optional[int] = None,
                 layers: Union[None, str, Sequence[int]] = None, need_grid: bool = True,
                 progress: Optional[Callable[[int, int], None]] = None, inputs: Optional[InputSpec] = None):
        from structinit.init.family import GENERIC, family_for_model, load_families
        from structinit.init.layouts import detect_layout, resolve_shape

        load_families()  # the layout rows families add are tried first
        self.family = GENERIC
        if is_module(target):
            self.model = target
            self.sd = target.state_dict()
            self.family = family_for_model(target)
            if grid is None:
                try:
                    grid = self.family.grid(target)
                except UsageError:
                    if need_grid:
                        raise
            heads = heads or self.family.heads(target)
            inputs = inputs if inputs is not None else self.family.input_spec(target)
        else:
            self.model = None
            self.sd = target
        self.inputs = inputs
        det = detect_layout(self.sd)
        if det is None:
            keys = list(self.sd)[:12]
            raise StructinitError(f"no attention layers found; keys seen: {', '.join(map(str, keys))}"
                                  + (" ..." if len(self.sd) > 12 else ""))
        self.det = det
        grid, self.heads = resolve_shape(det, heads, Grid(grid) if grid is not None else None, need_grid)
        self.grid: Optional[Grid] = Grid(grid) if grid is not None else None
        self.dim = det.dim
        self.depth = det.depth
        if isinstance(layers, str):
            self.layers = parse_layers(layers, det.depth)
        else:
            self.layers = select_layers(layers, det.depth)
        self.progress = progress

    @property
    def layout(self) -> str:
        return self.det.layout.name

    @property
    def causal(self):
        """Whether the model masks later tokens: ``True`` (a decoder such as GPT-2), ``False`` (none),
        ``None`` (the layout does not tell, e.g. ``nn.MultiheadAttention``, whose mask is an argument)."""
        return self.det.layout.causal

    @property
    def slots(self):
        """The :class:`~structinit.init.layouts.AttnSlot` of every selected layer (iterating them
        reports progress, see the class docstring)."""
        chosen = [self.det.slots[i] for i in self.layers]
        return _Reported(chosen, self.progress) if self.progress is not None else chosen

    @property
    def pos_key(self) -> Optional[str]:
        """The key of the position embedding in :attr:`sd`, or ``None`` when there is none."""
        return self.det.pos_key

    def pos_embed(self):
        """The position embedding of the grid's tokens: float32 ``[N, D]`` (an image model's last
        ``N`` rows, so the prefix tokens' rows are dropped; a sequence model's first ``N``
        positions), or ``None`` when the target has none."""
        pe = self._grid_rows()
        return None if pe is None else pe.float().numpy().copy()

    def _grid_rows(self):
        if self.det.pos_key is None or self.grid is None:
            return None
        pe = self.sd[self.det.pos_key].detach().to("cpu")
        rows = pe.reshape(-1, pe.shape[-1])
        n = self.grid.tokens
        return rows[:n] if self.det.layout.sequence else rows[-n:]

    def pos_embed_kind(self) -> Optional[str]:
        """``sincos``, ``sincos xS`` or ``other`` (see :func:`~structinit.init.pos_embed.pe_kind`), or
        ``None`` when the target has no position embedding."""
        from structinit.init.pos_embed import pe_kind

        rows = self._grid_rows()
        if rows is None:
            return None
        assert self.grid is not None  # _grid_rows gives rows of a grid only
        return pe_kind(rows, self.grid)

    def own_input(self):
        """The LayerNorm'd position embedding ``[N, D]`` of the target (what its first layer sees on
        position alone), or ``None`` when it has none."""
        from structinit.geometry.embedding import layer_norm

        pe = self.pos_embed()
        return None if pe is None else layer_norm(pe)
