"""Where the attention weights of a transformer live in a state dict: one small table of layouts.

Every layout names, relative to one attention layer's key prefix, the tensors that hold its query,
key and value projections (``nn.Linear`` weights ``[out, in]``: fused ``[3D, D]`` with rows
``q, k, v``, or three separate ``[D, D]``; or, for ``transposed`` layouts, ``Conv1D`` weights
``[in, out]`` applied as ``x @ W``: fused ``[D, 3D]`` with columns ``q, k, v``), their biases, the
output projection, and, relative to the model's prefix, the position embedding and the prefix
(class/register) tokens.

- ``timm-vit`` (timm VisionTransformer): ``{model}blocks.{i}.attn.qkv.weight``, fused q/k/v;
  position embedding ``{model}pos_embed [1, prefix + N, D]``.
- ``hf-vit`` (Hugging Face ViT/DeiT on disk): ``{model}encoder.layer.{i}.attention.attention.query.weight``,
  separate q/k/v; position embedding ``{model}embeddings.position_embeddings``.
- ``hf-vit-v5`` (transformers 5, in memory): ``{model}layers.{i}.attention.q_proj.weight``, separate q/k/v;
  position embedding ``{model}embeddings.position_embeddings``.
- ``hf-bert`` (Hugging Face BERT-style encoders): ``{model}encoder.layer.{i}.attention.self.query.weight``,
  separate q/k/v; a sequence model: position embedding ``{model}embeddings.position_embeddings.weight``
  ``[positions, D]``.
- ``hf-gpt2`` (Hugging Face GPT-2): ``{model}h.{i}.attn.c_attn.weight``, fused and transposed
  (``Conv1D`` ``[D, 3D]``, columns ``q, k, v``); a causal decoder; position embedding
  ``{model}wpe.weight`` ``[positions, D]``.
- ``torch-mha`` (``nn.MultiheadAttention``): ``{layer}in_proj_weight``, fused q/k/v; no position
  embedding (pass ``grid``).

A *sequence* layout's position embedding is a table with one row per position; its token grid is
the sequence of that many positions (or a shorter one, given as ``grid``). A *causal* layout masks
later tokens, so an impulse init must keep its offsets in the past. A layout's ``family`` names the
adapter of its models (:mod:`structinit.init.family`): it builds the model ``apply``'s data fit runs
inputs through, and tells a built model's grid, heads and inputs. A family adds its own rows
(:func:`structinit.init.family.register_layout`, tried before this table); every step reads them
through :func:`layout_rows`.

``{model}`` is any key prefix (``module.``, ``vit.``, ``model.``...), found by the anchor; a
state dict holding several models (several distinct prefixes) is refused. ``hf-vit`` is the
layout transformers writes to disk (DeiT included); ``hf-vit-v5`` is how transformers 5 names the
same tensors in memory. Row ``h*d:(h+1)*d`` of a projection weight is head ``h`` in all layouts
(those rows of the q block are ``Q_h^T``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Tuple

from structinit.errors import StructinitError, UsageError, param
from structinit.geometry.grid import Grid, GridLike


@dataclass(frozen=True)
class Layout:
    """One row of the layout table (see the module docstring)."""

    name: str
    description: str
    anchor: str  # regex with groups ``block`` (the layer's key prefix), ``model`` and ``layer`` (optional)
    q: str  # key templates relative to ``{block}``; a fused layout uses the same key for q, k, v
    k: str
    v: str
    q_bias: str
    k_bias: str
    v_bias: str
    proj: str
    pos_embed: Optional[str] = None  # relative to ``{model}``
    prefix_tokens: Tuple[str, ...] = ()  # keys relative to ``{model}``: each adds ``shape[1]`` tokens
    transposed: bool = False  # weights stored ``[in, out]`` (Conv1D), parts are column blocks
    sequence: bool = False  # position embedding ``[positions, D]``: a 1-D grid
    causal: Optional[bool] = False  # the model's own attention mask: True causal, False none, None unknown
    #: What writes into the residual stream (a position subspace keeps it out of its directions): the
    #: token embedding's tensors, relative to ``{model}`` (weights ``[D, ...]``, bias ``[D]``), and each
    #: layer's, relative to ``{block}`` (the attention output projection and the MLP's output, weights
    #: and biases). Empty where structinit does not know them.
    embed: Tuple[str, ...] = ()
    writers: Tuple[str, ...] = ()
    #: The family (:mod:`structinit.init.family`) whose adapter knows this layout's models: it builds
    #: the model of such a checkpoint to run inputs through (``apply``'s data fit); ``None``: no family.
    family: Optional[str] = None

    @property
    def fused(self) -> bool:
        return self.q == self.k == self.v


_HF_PREFIX = ("embeddings.cls_token", "embeddings.distillation_token")
_HF_EMBED = ("embeddings.patch_embeddings.projection.weight", "embeddings.patch_embeddings.projection.bias")

LAYOUTS: Tuple[Layout, ...] = (
    Layout("timm-vit", "timm VisionTransformer (fused qkv)",
           r"^(?P<block>(?P<model>(?:.*\.)?)blocks\.(?P<layer>\d+)\.)attn\.qkv\.weight$",
           "attn.qkv.weight", "attn.qkv.weight", "attn.qkv.weight",
           "attn.qkv.bias", "attn.qkv.bias", "attn.qkv.bias", "attn.proj.weight",
           pos_embed="pos_embed", prefix_tokens=("cls_token", "reg_token"), causal=None,
           embed=("patch_embed.proj.weight", "patch_embed.proj.bias"),
           writers=("attn.proj.weight", "attn.proj.bias", "mlp.fc2.weight", "mlp.fc2.bias"), family="timm-vit"),
    Layout("hf-vit", "Hugging Face transformers ViT/DeiT (separate query/key/value)",
           r"^(?P<block>(?P<model>(?:.*\.)?)encoder\.layer\.(?P<layer>\d+)\.)attention\.attention\.query\.weight$",
           "attention.attention.query.weight", "attention.attention.key.weight", "attention.attention.value.weight",
           "attention.attention.query.bias", "attention.attention.key.bias", "attention.attention.value.bias",
           "attention.output.dense.weight",
           pos_embed="embeddings.position_embeddings", prefix_tokens=_HF_PREFIX, embed=_HF_EMBED,
           writers=("attention.output.dense.weight", "attention.output.dense.bias", "output.dense.weight",
                    "output.dense.bias"), family="hf-vit"),
    Layout("hf-vit-v5", "Hugging Face transformers 5 ViT, in-memory names (q_proj/k_proj/v_proj)",
           r"^(?P<block>(?P<model>(?:.*\.)?)layers\.(?P<layer>\d+)\.)attention\.q_proj\.weight$",
           "attention.q_proj.weight", "attention.k_proj.weight", "attention.v_proj.weight",
           "attention.q_proj.bias", "attention.k_proj.bias", "attention.v_proj.bias", "attention.o_proj.weight",
           pos_embed="embeddings.position_embeddings", prefix_tokens=_HF_PREFIX, embed=_HF_EMBED,
           writers=("attention.o_proj.weight", "attention.o_proj.bias", "mlp.fc2.weight", "mlp.fc2.bias"),
           family="hf-vit"),
    Layout("hf-bert", "Hugging Face transformers BERT-style encoder (separate query/key/value)",
           r"^(?P<block>(?P<model>(?:.*\.)?)encoder\.layer\.(?P<layer>\d+)\.)attention\.self\.query\.weight$",
           "attention.self.query.weight", "attention.self.key.weight", "attention.self.value.weight",
           "attention.self.query.bias", "attention.self.key.bias", "attention.self.value.bias",
           "attention.output.dense.weight",
           pos_embed="embeddings.position_embeddings.weight", sequence=True, family="hf-bert"),
    Layout("hf-gpt2", "Hugging Face transformers GPT-2 (fused c_attn, Conv1D [D, 3D])",
           r"^(?P<block>(?P<model>(?:.*\.)?)h\.(?P<layer>\d+)\.)attn\.c_attn\.weight$",
           "attn.c_attn.weight", "attn.c_attn.weight", "attn.c_attn.weight",
           "attn.c_attn.bias", "attn.c_attn.bias", "attn.c_attn.bias", "attn.c_proj.weight",
           pos_embed="wpe.weight", transposed=True, sequence=True, causal=True, family="hf-gpt2"),
    Layout("torch-mha", "torch.nn.MultiheadAttention (in_proj_weight)",
           r"^(?P<block>(?P<model>)(?:.*\.)?)in_proj_weight$",
           "in_proj_weight", "in_proj_weight", "in_proj_weight",
           "in_proj_bias", "in_proj_bias", "in_proj_bias", "out_proj.weight", causal=None, family="torch-mha"),
)

#: Rows families added (:func:`structinit.init.family.register_layout`), tried before :data:`LAYOUTS`.
_ADDED: List[Layout] = []


def add_layout(row: Layout) -> None:
    """Add ``row`` to the rows tried first (what :func:`structinit.init.family.register_layout`
    calls once it has checked the row)."""
    _ADDED.append(row)


def layout_rows() -> Tuple[Layout, ...]:
    """Every layout row in the order detection tries them: those families added, then :data:`LAYOUTS`."""
    return (*_ADDED, *LAYOUTS)



@dataclass(frozen=True)
class Part:
    """Rows ``start:stop`` of the tensor at ``key`` (a weight ``[out, in]`` or a bias ``[out]``);
    ``transposed``: columns ``start:stop`` of a weight stored ``[in, out]`` (Conv1D)."""

    key: str
    start: int
    stop: int
    transposed: bool = False


@dataclass(frozen=True)
class AttnSlot:
    """The tensors of one attention layer; ``q, k, v`` are ``[D, D]`` row blocks, biases may be ``None``."""

    index: int
    block: str
    q: Part
    k: Part
    v: Part
    q_bias: Optional[Part]
    k_bias: Optional[Part]
    v_bias: Optional[Part]
    proj: Optional[str]
    transposed: bool = False  # the projection weights (``proj`` too) are stored ``[in, out]``


@dataclass
class Detected:
    """A layout found in a state dict, with the shape it implies.

    ``grid``/``heads`` are ``None`` when the state dict does not tell (the caller must supply them).
    """

    layout: Layout
    model_prefix: str
    slots: List[AttnSlot]
    dim: int
    pos_key: Optional[str] = None
    prefix_tokens: int = 0
    grid: Optional[Grid] = None
    heads: Optional[int] = None
    pos_rows: Optional[int] = None  # rows of the position embedding (prefix rows included)
    grid_note: Optional[str] = None  # why the grid could not be told, when it could not
    heads_note: Optional[str] = None  # why the heads could not be told (a config.json that cannot be read), when not

    @property
    def depth(self) -> int:
        return len(self.slots)

    def summary(self) -> Dict:
        return {"layout": self.layout.name, "description": self.layout.description, "prefix": self.model_prefix,
                "dim": self.dim, "heads": self.heads, "depth": self.depth,
                "grid": list(self.grid) if self.grid else None, "prefix_tokens": self.prefix_tokens,
                "pos_embed": self.pos_key}


def _natural(key: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", key)]


def _shape(t) -> Tuple[int, ...]:
    return tuple(getattr(t, "shape", ()))


def _part(sd: Mapping, key: str, row: int, dim: int, fused: bool, what: str,
          transposed: bool = False) -> Optional[Part]:
    if key not in sd:
        return None
    start = row * dim if fused else 0
    shape = _shape(sd[key])
    rows_needed = 3 * dim if fused else dim
    axis = 1 if transposed and len(shape) == 2 else 0  # a Conv1D weight [in, out]; a bias is [out]
    if not shape or shape[axis] != rows_needed:
        raise StructinitError(f"{key}: shape {list(shape)} does not fit dim {dim} ({what})")
    return Part(key, start, start + dim, transposed=axis == 1)


def detect_layout(sd: Mapping) -> Optional[Detected]:
    """The first layout of :func:`layout_rows` whose anchor matches keys of ``sd``, or ``None``.

    Raises :class:`StructinitError` when tensors are missing or inconsistent, or when the state
    dict holds several models.
    """
    keys = [k for k in sd if isinstance(k, str)]
    for layout in layout_rows():
        rx = re.compile(layout.anchor)
        hits = [(m, k) for k in keys for m in [rx.match(k)] if m]
        if not hits:
            continue
        models = sorted({m.group("model") for m, _ in hits})
        if len(models) > 1:
            raise StructinitError(f"the checkpoint holds several {layout.name} models (key prefixes {models}); "
                                  "extract one state dict first")
        model = models[0]
        if "layer" in rx.groupindex:  # numbered layers (nn.MultiheadAttention modules are found by name)
            hits.sort(key=lambda mk: int(mk[0].group("layer")))
            layers = [int(m.group("layer")) for m, _ in hits]
            if layers != list(range(len(layers))):
                missing = [i for i in range(max(layers)) if i not in layers]
                m, key = hits[0]
                lo, hi = m.span("layer")
                named = ", ".join(key[:lo] + str(i) + key[hi:] for i in missing[:3]) + (" ..." if len(missing) > 3
                                                                                        else "")
                raise StructinitError(f"{layout.name}: the checkpoint has no {named} (attention layers "
                                      f"{', '.join(map(str, layers))} have theirs): a tensor is missing, or the layers "
                                      f"are not numbered from 0" if missing else
                                      f"{layout.name}: attention layers {layers} are not numbered 0..{len(layers) - 1}")
        else:
            hits.sort(key=lambda mk: _natural(mk[1]))
        first = _shape(sd[hits[0][1]])
        if len(first) != 2:
            raise StructinitError(f"{hits[0][1]}: expected a 2-D weight, got shape {list(first)}")
        in_axis = 0 if layout.transposed else 1
        dim = first[in_axis]
        slots = []
        for i, (m, _) in enumerate(hits):
            b = m.group("block")
            parts: Dict[str, Part] = {}
            biases: Dict[str, Optional[Part]] = {}
            for j, role in enumerate(("q", "k", "v")):
                key = b + getattr(layout, role)
                if key not in sd:
                    raise StructinitError(f"{layout.name}: missing tensor {key}")
                part = _part(sd, key, j, dim, layout.fused, role, layout.transposed)
                assert part is not None  # its key is in sd
                parts[role] = part
                if len(_shape(sd[key])) != 2 or _shape(sd[key])[in_axis] != dim:
                    raise StructinitError(f"{key}: shape {list(_shape(sd[key]))} does not fit dim {dim}")
                bias_key = b + getattr(layout, role + "_bias")
                biases[role + "_bias"] = _part(sd, bias_key, j, dim, layout.fused, role + " bias")
            proj = b + layout.proj
            slots.append(AttnSlot(index=i, block=b, proj=proj if proj in sd else None, transposed=layout.transposed,
                                  q=parts["q"], k=parts["k"], v=parts["v"], q_bias=biases["q_bias"],
                                  k_bias=biases["k_bias"], v_bias=biases["v_bias"]))
        det = Detected(layout=layout, model_prefix=model, slots=slots, dim=dim)
        if layout.sequence:
            _sequence_grid(sd, det)
        elif layout.pos_embed and model + layout.pos_embed in sd:
            det.pos_key = model + layout.pos_embed
            det.prefix_tokens = sum(_shape(sd[model + t])[1] for t in layout.prefix_tokens
                                    if model + t in sd and len(_shape(sd[model + t])) == 3)
            _grid_from_pos(_shape(sd[det.pos_key]), dim, det)
        return det
    return None


def _sequence_grid(sd: Mapping, det: Detected) -> None:
    """A sequence layout's grid: as many positions as its position-embedding table ``[P, D]`` has rows."""
    assert det.layout.pos_embed is not None  # every sequence layout names its position table
    key = det.model_prefix + det.layout.pos_embed
    shape = _shape(sd.get(key))
    if len(shape) == 2 and shape[1] == det.dim and shape[0] > 0:
        det.pos_key = key
        det.grid = Grid((shape[0],))


def _grid_from_pos(shape: Tuple[int, ...], dim: int, det: Detected) -> None:
    """Set ``det.grid`` from ``pos_embed [1, rows, D]`` when it can be told for sure: ``rows`` minus
    the prefix (class/register/distillation) tokens is a perfect square and ``rows`` itself is not
    (a square grid whose prefix tokens have positions). Otherwise leave it ``None`` and say why in
    ``det.grid_note``: with prefix tokens a square ``rows`` may also be a grid whose prefix tokens
    have no position (timm's ``no_embed_class``) or a non-square grid, so only ``grid`` can tell."""
    if len(shape) != 3 or shape[-1] != dim:
        det.grid_note = f"its position embedding has shape {list(shape)}"
        return
    rows, prefix = shape[1], det.prefix_tokens
    det.pos_rows = rows
    n = rows - prefix
    square = [m for m in dict.fromkeys((n, rows)) if m > 0 and math.isqrt(m) ** 2 == m]
    if square == [n]:
        det.grid = Grid((math.isqrt(n),) * 2)
    elif not prefix:
        det.grid_note = f"its position embedding has {rows} rows, which is not a square grid"
    elif not square:
        det.grid_note = (f"its position embedding has {rows} rows for {prefix} prefix token(s) and a grid, "
                         "which is not square")
    else:
        det.grid_note = (f"its position embedding has {rows} rows and it has {prefix} prefix token(s): "
                         f"a {'x'.join([str(math.isqrt(rows))] * 2)} grid whose prefix tokens have no position "
                         f"(timm's no_embed_class), or {n} tokens after the prefix rows (e.g. a non-square grid)")


def _check_sequence_grid(det: Detected, grid: Grid) -> None:
    """A sequence model takes a sequence (a 1-D grid) no longer than its position table."""
    if grid.ndim != 1:
        raise UsageError(f"the {det.layout.name} checkpoint is a sequence model; give {param('grid')} as a length L, "
                         f"not the image grid {grid.describe()}")
    if det.grid is not None and grid.tokens > det.grid.tokens:
        raise UsageError(f"{param('grid')} {grid.tokens} is longer than the checkpoint's position embedding "
                         f"({det.grid.tokens} positions)")


def heads_unknown(det: Detected) -> UsageError:
    """The refusal of a checkpoint that does not tell its number of heads (and why, where a file that
    should have told it, a ``config.json``, could not be read: ``det.heads_note``)."""
    why = f" ({det.heads_note})" if det.heads_note else ""
    return UsageError(f"the {det.layout.name} checkpoint does not tell its number of heads{why}; give it with "
                      f"{param('heads')} (it must divide dim {det.dim})")



def resolve_shape(det: Detected, heads: Optional[int] = None, grid: Optional[GridLike] = None,
                  need_grid: bool = True) -> Tuple[Optional[Grid], int]:
    """``(grid, heads)`` from the checkpoint and the caller's values; raises :class:`UsageError` when
    one is missing (the grid only if ``need_grid``; else it may come back ``None``) or contradicts
    the checkpoint. A given grid must account for the position embedding's rows: all of them, or all
    but the prefix tokens' rows."""
    if grid is not None:
        grid = Grid(grid)
        fits = (det.pos_rows - det.prefix_tokens, det.pos_rows) if det.pos_rows is not None else None
        if det.layout.sequence:
            _check_sequence_grid(det, grid)
        elif fits is not None and grid.tokens not in fits:
            pre = f" ({det.prefix_tokens} of them prefix tokens)" if det.prefix_tokens else ""
            raise UsageError(f"{param('grid')} {grid.describe()} has {grid.tokens} tokens but the checkpoint's "
                             f"position embedding has {det.pos_rows} rows{pre}")
    else:
        grid = det.grid
    if grid is None and need_grid:
        if det.layout.sequence:
            raise UsageError(f"the {det.layout.name} checkpoint has no position embedding to tell its sequence "
                             f"length; give it with {param('grid')} L")
        why = f" ({det.grid_note})" if det.grid_note else ""
        raise UsageError(f"the {det.layout.name} checkpoint does not tell its token grid{why}; give it with "
                         f"{param('grid')} (HxW, or L for a sequence)")
    if heads is not None and (isinstance(heads, bool) or not isinstance(heads, int) or heads < 1):
        raise UsageError(f"{param('heads')} must be a positive integer, got {heads!r}")
    if heads is None:
        heads = det.heads
    if heads is None:
        raise heads_unknown(det)
    if det.heads is not None and heads != det.heads:
        raise UsageError(f"{param('heads')} {heads} contradicts the checkpoint, which has {det.heads} heads")
    if heads < 1 or det.dim % heads:
        raise UsageError(f"{param('heads')} {heads} does not divide the checkpoint's dim {det.dim}")
    return grid, heads
