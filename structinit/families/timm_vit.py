"""The timm ViT family: timm ``VisionTransformer`` models and their checkpoints (the ``timm-vit``
layout, timm's train.py checkpoints with their ``arch`` and class token included).

A checkpoint's model is timm's ``model_name``, else the ``arch`` of timm's train.py checkpoints, as
a timm model of the shape the tensors have; without a name, a timm ``VisionTransformer`` of the
shape the tensors have (patch size and channels from ``patch_embed.proj.weight``, depth, MLP ratio,
the grid from ``pos_embed``, class and register tokens, qkv bias, LayerScale, classes); ``heads``
when nothing names them. A model tells its grid (``patch_embed.grid_size``), heads
(``blocks[0].attn.num_heads``) and inputs (``patch_embed``'s channels and image size: ``(C, H, W)``,
or ``(C, L)`` for a one-dimensional grid), and is captured block by block (``blocks``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Tuple

from structinit.errors import UsageError, param
from structinit.families.weights import load_weights
from structinit.geometry.grid import Grid
from structinit.init.family import CheckpointModel, InputSpec, ModelFamily, register_family

if TYPE_CHECKING:
    import torch


@register_family
class TimmVit(ModelFamily):
    """timm ViTs (see the module docstring)."""

    name = "timm-vit"
    builds = True
    measures_attention = True

    def grid(self, model) -> Grid:
        try:
            return Grid(tuple(int(g) for g in model.patch_embed.grid_size))
        except (AttributeError, TypeError):
            return super().grid(model)

    def heads(self, model) -> int:
        try:
            return int(model.blocks[0].attn.num_heads)
        except (AttributeError, IndexError, TypeError):
            return super().heads(model)

    def input_spec(self, model) -> Optional[InputSpec]:
        shape = patch_input_shape(model)
        if shape is None:
            return None
        return InputSpec("sequence", shape, squeezed=True) if len(shape) == 2 else InputSpec("image", shape,
                                                                                             images=True)

    def blocks(self, model):
        blocks = getattr(model, "blocks", None)  # a model that wraps a ViT (``inner.blocks``) is run whole
        return list(blocks) if blocks is not None else None

    def qk_not_linear(self, model, owner, layer: int) -> Optional[str]:
        attn = model.blocks[layer].attn if hasattr(model, "blocks") else owner  # timm keeps q_norm on attn
        return super().qk_not_linear(model, attn, layer)

    def attention_quality(self, model, x, offsets, grid, layers: List[int]) -> Dict[str, Any]:
        from structinit.analysis.fidelity import data_attention_quality

        return data_attention_quality(model, x, offsets, grid, layers=layers)

    def checkpoint_hints(self, ckpt) -> None:
        timm_arch_hints(ckpt)

    def heads_needed(self, det) -> Optional[str]:
        return (f"the timm-vit checkpoint does not tell its number of heads; give it with {param('heads')} "
                f"(it must divide dim {det.dim}), or name the timm model it holds with "
                f"{param('model_name')} (e.g. vit_tiny_patch16_224)")

    def build(self, ckpt, sd, *, model_name=None, config=None, heads=None, grid=None) -> CheckpointModel:
        self.refuse_config(ckpt, config)
        return timm_model(ckpt, sd, model_name, heads, grid)


def patch_input_shape(model) -> Optional[Tuple[int, ...]]:
    """One input's shape from a timm-style ``patch_embed`` (its projection's channels and
    ``img_size``; ``(C, L)`` where ``grid_size == (L,)``), or ``None`` where it does not tell."""
    pe = getattr(model, "patch_embed", None)
    chans = getattr(getattr(pe, "proj", None), "in_channels", None)
    if chans is None:
        return None
    grid = tuple(getattr(pe, "grid_size", ()) or ())
    if len(grid) == 1:
        return (int(chans), int(grid[0]))
    size = getattr(pe, "img_size", None)
    return (int(chans), int(size[0]), int(size[1])) if size is not None else None


def timm_arch_hints(ckpt) -> None:
    """The heads the ``arch`` entry of a timm training checkpoint tells (looked up in timm's
    registry, no weights), when its width is the checkpoint's dim."""
    arch = ckpt.obj.get("arch")
    if isinstance(arch, str):
        heads = timm_arch_heads(arch, ckpt.detected.dim)
        if heads:
            ckpt.detected.heads = heads
            ckpt.extra["arch"] = arch


def timm_arch_heads(arch: str, dim: int) -> Optional[int]:
    """The heads of timm's model ``arch`` when its width is ``dim`` (``None``: no such model, or
    another width)."""
    shape = _timm_arch_shape(arch)
    return shape[1] if shape is not None and shape[0] == dim else None


_ARCH_SHAPES: Dict[str, Tuple[int, int]] = {}


def _timm_arch_shape(arch: str) -> Optional[Tuple[int, int]]:
    """``(embed_dim, heads)`` of timm's model ``arch`` at its defaults, built without weights (on
    the meta device; kept for the process, as building it takes a good part of a second); ``None``
    where it builds no ViT (not kept: a model registered later is found then)."""
    if arch in _ARCH_SHAPES:
        return _ARCH_SHAPES[arch]
    try:
        import timm
        import torch

        with torch.device("meta"):
            # Any: its submodules are read by name (torch types every attribute Tensor | Module)
            model: Any = timm.create_model(arch, pretrained=False)
        shape = _ARCH_SHAPES[arch] = (int(model.embed_dim), int(model.blocks[0].attn.num_heads))
        return shape
    except Exception:  # noqa: BLE001 - an unknown arch is simply no hint
        return None


def timm_vit_kwargs(sd: Mapping, prefix: str, grid) -> Dict[str, Any]:
    """The timm ``VisionTransformer`` arguments a state dict's tensors tell (all but the heads):
    ``img_size``, ``patch_size``, ``in_chans``, ``embed_dim``, ``depth``, ``mlp_ratio``,
    ``num_classes``, ``class_token``, ``reg_tokens``, ``no_embed_class``, ``global_pool``,
    ``fc_norm``, ``qkv_bias``, ``qk_norm``, ``init_values``, ``pre_norm``, for the token ``grid``
    (``(H, W)``, e.g. the checkpoint's detected one)."""
    from structinit.geometry.grid import Grid

    def get(name):
        return sd.get(prefix + name)

    proj = get("patch_embed.proj.weight")
    if proj is None or len(proj.shape) != 4:
        raise UsageError("the checkpoint has no 2-D patch embedding (patch_embed.proj.weight [D, C, p, p]); it is "
                         "not a timm VisionTransformer")
    dim, chans, ph, pw = (int(s) for s in proj.shape)
    depth = 0
    while get(f"blocks.{depth}.attn.qkv.weight") is not None:
        depth += 1
    fc1 = get("blocks.0.mlp.fc1.weight")
    prefix_tokens = sum(int(get(t).shape[1]) for t in ("cls_token", "reg_token") if get(t) is not None)
    pos = get("pos_embed")
    rows = int(pos.shape[1]) if pos is not None else None
    if grid is None:
        raise UsageError(f"the checkpoint does not tell its token grid (position embedding rows {rows}, "
                         f"{prefix_tokens} prefix token(s)); give it with {param('grid')}")
    grid = Grid(grid)
    if grid.ndim != 2:
        raise UsageError(f"{param('grid')} of a timm ViT is an image grid HxW, got {grid.describe()}")
    head = get("head.weight")
    class_token = get("cls_token") is not None
    fc = get("fc_norm.weight") is not None
    kwargs = dict(img_size=(grid.hw[0] * ph, grid.hw[1] * pw), patch_size=(ph, pw), in_chans=chans, embed_dim=dim,
                  depth=depth, mlp_ratio=(int(fc1.shape[0]) / dim) if fc1 is not None else 4.0,
                  num_classes=int(head.shape[0]) if head is not None else 0, class_token=class_token,
                  reg_tokens=int(get("reg_token").shape[1]) if get("reg_token") is not None else 0,
                  no_embed_class=bool(prefix_tokens) and rows == grid.tokens,
                  global_pool="avg" if fc or not class_token else "token", fc_norm=fc,
                  qkv_bias=get("blocks.0.attn.qkv.bias") is not None,
                  qk_norm=get("blocks.0.attn.q_norm.weight") is not None,
                  init_values=1e-5 if get("blocks.0.ls1.gamma") is not None else None,
                  pre_norm=get("norm_pre.weight") is not None)
    if pos is None:
        kwargs["pos_embed"] = "none"
    return kwargs


def timm_model(ckpt, sd: Mapping, model_name: Optional[str], heads: Optional[int], grid) -> CheckpointModel:
    """The timm ViT of ``ckpt`` (see :class:`TimmVit`) with ``sd`` loaded."""
    import timm
    from timm.models.vision_transformer import VisionTransformer

    det = ckpt.detected
    kwargs = timm_vit_kwargs(sd, det.model_prefix, grid or det.grid)
    arch = ckpt.obj.get("arch") if isinstance(ckpt.obj, Mapping) else None
    name = model_name or (arch if isinstance(arch, str) and timm.is_model(arch) else None)
    model = None
    if name is not None:
        model = _named_timm_model(name, kwargs, heads, named=model_name is not None)
        how = f"timm {name}"
    if model is None:  # no name, or the file's arch hint contradicts its tensors: a ViT of the tensors' shape
        heads = heads or det.heads
        if heads is None:
            raise UsageError(f"the checkpoint does not tell its number of heads; give it with {param('heads')} "
                             f"(it must divide dim {kwargs['embed_dim']}), or name the timm model with "
                             f"{param('model_name')}")
        if kwargs["embed_dim"] % heads:
            raise UsageError(f"{param('heads')} {heads} does not divide the checkpoint's dim {kwargs['embed_dim']}")
        model = VisionTransformer(num_heads=heads, **kwargs)
        how = "timm VisionTransformer built from the tensors' shapes"
    load_weights(model, sd, det.model_prefix, how)
    shown = ", ".join(f"{k}={kwargs[k]}" for k in ("img_size", "patch_size", "in_chans", "embed_dim", "depth"))
    grid_ = tuple(int(g) for g in model.patch_embed.grid_size)
    inputs = InputSpec("image", (kwargs["in_chans"], *kwargs["img_size"]), images=True)
    return CheckpointModel(model, f"{how} ({shown}, heads={_block_heads(model)})", inputs, grid=grid_,
                           heads=_block_heads(model))


def _block_heads(model: torch.nn.Module) -> int:
    """The heads per layer of a timm ViT: its first block's ``attn.num_heads``."""
    # timm's blocks is an attribute torch types as Tensor | Module (nn.Module.__getattr__): not indexable
    return int(model.blocks[0].attn.num_heads)  # type: ignore[index, union-attr]


def timm_heads(name: str) -> int:
    """The heads per layer of timm's model ``name`` (built at its defaults, without weights)."""
    import timm

    if not timm.is_model(name):
        raise UsageError(f"{param('model_name')} {name!r} is not a timm model name (see timm.list_models)")
    model = timm.create_model(name, pretrained=False)
    try:
        return _block_heads(model)
    except (AttributeError, IndexError):
        raise UsageError(f"{param('model_name')} {name!r} is not a ViT with blocks[i].attn") from None


def _named_timm_model(name: str, kwargs: Dict[str, Any], heads: Optional[int], named: bool):
    """timm's ``name`` built for the checkpoint's shape (``kwargs``). ``named``: the user named it,
    so a model that cannot take the tensors is an error; else (timm's ``arch`` in the file) ``None``,
    and the model is built from the tensors' shapes instead."""
    import timm

    if not timm.is_model(name):
        raise UsageError(f"{param('model_name')} {name!r} is not a timm model name (see timm.list_models)")
    overrides = {k: kwargs[k] for k in ("img_size", "patch_size", "in_chans", "num_classes", "class_token",
                                        "reg_tokens", "no_embed_class", "global_pool", "fc_norm")}
    try:
        model = timm.create_model(name, pretrained=False, **overrides)
    except Exception as exc:  # noqa: BLE001 - a model that cannot take the checkpoint's shape
        if not named:
            return None
        raise UsageError(f"timm cannot build {name} for the checkpoint's shape ({str(exc).splitlines()[0]})") \
            from None
    # timm's blocks is an attribute torch types as Tensor | Module (nn.Module.__getattr__): not Sized
    shape = (int(model.embed_dim), len(model.blocks))  # type: ignore[arg-type]
    if shape != (kwargs["embed_dim"], kwargs["depth"]):
        if not named:
            return None
        raise UsageError(f"the checkpoint is not a {name}: its tensors have dim {kwargs['embed_dim']} and "
                         f"depth {kwargs['depth']}, {name} has dim {shape[0]} and depth {shape[1]} (name "
                         f"the model it was trained as with {param('model_name')}, or leave that out and give "
                         f"{param('heads')})")
    if heads is not None and _block_heads(model) != heads:
        if not named:
            return None
        raise UsageError(f"{param('heads')} {heads} contradicts {name}, which has "
                         f"{_block_heads(model)} heads")
    return model


__all__ = ["TimmVit", "timm_arch_hints", "timm_arch_heads", "timm_model", "timm_vit_kwargs", "timm_heads",
           "patch_input_shape"]
