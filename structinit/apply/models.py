"""The model a checkpoint describes, built and loaded with the checkpoint's weights: what real
inputs run through when the impulse data fit is applied to a checkpoint (``structinit apply
--data``), the way timm's ``create_model`` and ``load_checkpoint`` go together.

=========================  =====================================================================
checkpoint                 how its model is built
=========================  =====================================================================
``structinit train``       its settings (``args``): the preset ``train`` built, for the run's data
timm ViT                   ``model_name``, else the ``arch`` of timm's train.py checkpoints, as a
                           timm model of the shape the tensors have; without a name, a timm
                           ``VisionTransformer`` of the shape the tensors have (patch size and
                           channels from ``patch_embed.proj.weight``, depth, MLP ratio, the grid
                           from ``pos_embed``, class and register tokens, qkv bias, LayerScale,
                           classes); ``heads`` when nothing names them
Hugging Face ViT/DeiT,     the ``config.json`` beside the weights (as ``save_pretrained`` writes
BERT, GPT-2                it) or ``config``; the weights are loaded by transformers itself
=========================  =====================================================================

Every weight of the checkpoint must load into the model (an unexpected or missing tensor is an
error naming it): the fit reads the model as the checkpoint has it.

Example::

    built = checkpoint_model(load_checkpoint("vit.pth"), model_name="vit_tiny_patch16_224")
    built.model          # the nn.Module, eval mode, weights loaded
    built.input_shape    # one input's shape, e.g. (3, 32, 32) or (128,) token ids
    built.how            # "timm vit_tiny_patch16_224 (img_size=32, patch_size=2, ...)"
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional, Tuple

from structinit.atomic import NotRegularFile, atomic_write, read_regular
from structinit.errors import StructinitError, UsageError, param
from structinit.init.checkpoints import CONFIG_LIMIT, HF_CONFIG

if TYPE_CHECKING:
    import torch


@dataclass
class CheckpointModel:
    """A model built for a checkpoint. ``kind``: ``image`` (float ``[B, C, H, W]``), ``sequence``
    (float ``[B, C, L]``, structinit's ``transformer-1d``) or ``tokens`` (int64 ids ``[B, L]``,
    BERT and GPT-2); ``input_shape`` one input's shape (``None`` for tokens, whose length may be
    anything up to the position table); ``settings``: a ``structinit train`` checkpoint's
    :class:`~structinit.training.config.TrainConfig`; ``grid``/``heads``: its attention shape."""

    model: Any
    how: str
    kind: str
    input_shape: Optional[Tuple[int, ...]]
    grid: Any = None
    heads: Optional[int] = None
    settings: Any = None


def checkpoint_model(ckpt, state_dict: Optional[Mapping] = None, *, model_name: Optional[str] = None,
                     config: Optional[str] = None, heads: Optional[int] = None, grid=None) -> CheckpointModel:
    """Build the model of ``ckpt`` (a :class:`~structinit.init.checkpoints.Checkpoint`) and load
    ``state_dict`` into it (default: the checkpoint's first state dict). See the module docstring.
    ``grid``/``heads`` are needed only where the checkpoint does not tell."""
    sd = state_dict if state_dict is not None else ckpt.state_dicts[0][1]
    det = ckpt.detected
    layout = det.layout.name
    settings = ckpt.obj.get("args") if isinstance(ckpt.obj, Mapping) else None
    if isinstance(settings, dict) and "shape" in ckpt.extra:
        if model_name is not None or config is not None:
            raise UsageError(f"{ckpt.path} was written by structinit train, whose settings build its model; "
                             f"leave out {param('model_name')} and {param('config')}")
        return _structinit_model(ckpt, sd, settings)
    if det.layout.builder == "transformers":
        if model_name is not None:
            raise UsageError(f"{param('model_name')} names a timm model; the {layout} checkpoint's model comes "
                             f"from its config.json (or {param('config')})")
        return _hf_model(ckpt, sd, config, grid)
    if config is not None:
        raise UsageError(f"{param('config')} is a Hugging Face config.json; the {layout} checkpoint is not a "
                         "Hugging Face model")
    if det.layout.builder == "timm":
        return _timm_model(ckpt, sd, model_name, heads, grid)
    raise UsageError(f"the {layout} checkpoint holds attention weights but no model structinit can build and run "
                     "real inputs through (timm ViTs, Hugging Face ViT/DeiT, BERT and GPT-2, and structinit "
                     "train checkpoints can)")


def _load(model, sd: Mapping, prefix: str, what: str) -> None:
    """Load ``sd`` (its keys less ``prefix``) into ``model``, every tensor: an unexpected or missing
    one is an error naming it."""
    import torch

    state = {k[len(prefix):]: torch.as_tensor(v) for k, v in sd.items() if isinstance(k, str) and k.startswith(prefix)}
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # tensors of other shapes: name the first
        mismatch = next((ln.strip() for ln in str(exc).splitlines() if "size mismatch" in ln), str(exc).splitlines()[0])
        raise UsageError(f"the checkpoint's weights do not fit the {what} ({mismatch})") from None
    problems = []
    if result.unexpected_keys:
        problems.append(f"tensors the model does not have: {', '.join(result.unexpected_keys[:5])}")
    if result.missing_keys:
        problems.append(f"tensors the checkpoint lacks: {', '.join(result.missing_keys[:5])}")
    if problems:
        raise UsageError(f"the checkpoint's weights do not fit the {what} ({'; '.join(problems)})")
    model.eval()


# --------------------------------------------------------------------------- structinit train

def _structinit_model(ckpt, sd: Mapping, settings: dict) -> CheckpointModel:
    from structinit.training.config import TrainConfig
    from structinit.training.datasets import dataset_info
    from structinit.training.models import ATTENTION_FAMILIES, build_model

    try:
        config = TrainConfig.from_dict(settings)
        config.validate()
    except (TypeError, UsageError) as exc:
        raise StructinitError(f"the run settings in {ckpt.path} are unreadable ({exc})") from None
    if config.model.family not in ATTENTION_FAMILIES:
        raise UsageError(f"{config.model.name} has no attention layers to fit")
    info = dataset_info(config.dataset)
    image_size = config.image_size or info.image_size
    head = sd.get(ckpt.detected.model_prefix + "head.weight")
    classes = info.num_classes or (int(head.shape[0]) if head is not None else 1000)  # imagefolder: the file's
    model = build_model(config.model, num_classes=classes, image_size=image_size,
                        in_chans=info.in_chans, default_patch=info.default_patch, seed=config.seed)
    _load(model, sd, ckpt.detected.model_prefix, f"{config.model.name} model its settings describe")
    arch = model.structinit_arch
    shape = (info.in_chans, image_size) if info.is_sequence else (info.in_chans, image_size, image_size)
    return CheckpointModel(model, f"structinit train settings: {config.model.name} on {config.dataset}",
                           "sequence" if info.is_sequence else "image", shape, grid=arch["grid"],
                           heads=arch.get("heads"), settings=config)


# --------------------------------------------------------------------------- timm

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


def _timm_model(ckpt, sd: Mapping, model_name: Optional[str], heads: Optional[int], grid) -> CheckpointModel:
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
    _load(model, sd, det.model_prefix, how)
    shown = ", ".join(f"{k}={kwargs[k]}" for k in ("img_size", "patch_size", "in_chans", "embed_dim", "depth"))
    grid_ = tuple(int(g) for g in model.patch_embed.grid_size)
    return CheckpointModel(model, f"{how} ({shown}, heads={_block_heads(model)})", "image",
                           (kwargs["in_chans"], *kwargs["img_size"]), grid=grid_, heads=_block_heads(model))


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


# --------------------------------------------------------------------------- Hugging Face

def hf_config(ckpt, config: Optional[str] = None) -> Tuple[dict, Path]:
    """The Hugging Face config of ``ckpt``: ``config`` (a ``config.json``, or the folder holding
    it) or the ``config.json`` beside the checkpoint, as ``(dict, path)``."""
    path = Path(config) if config is not None else ckpt.path.parent / HF_CONFIG
    if path.is_dir():
        path = path / HF_CONFIG
    try:
        cfg = json.loads(read_regular(path, limit=CONFIG_LIMIT))
    except FileNotFoundError:
        how = "" if config is not None else f" (none beside {ckpt.path.name}; give one with {param('config')})"
        raise UsageError(f"no Hugging Face config at {path}{how}") from None
    except NotRegularFile as exc:
        raise UsageError(f"{path} is not a readable config.json ({exc.strerror})") from None
    except (OSError, ValueError) as exc:
        raise UsageError(f"{path} is not a readable config.json ({exc})") from None
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        raise UsageError(f"{path} is not a Hugging Face config.json (it has no model_type)")
    return cfg, path


#: What to install for Hugging Face checkpoints' models.
HF_EXTRA = "pip install 'structinit[hf]' (or transformers)"


def transformers_installed() -> bool:
    """Whether Hugging Face transformers can be imported (it builds the models of ``hf-*`` checkpoints)."""
    import importlib.util

    try:
        return importlib.util.find_spec("transformers") is not None
    except ValueError:  # a module set to None in sys.modules (how a test hides it)
        return False


def _hf_model(ckpt, sd: Mapping, config: Optional[str], grid) -> CheckpointModel:
    import torch
    from safetensors.torch import save

    try:
        import transformers
    except ImportError:
        raise UsageError(f"the {ckpt.detected.layout.name} checkpoint's model is built by Hugging Face "
                         f"transformers, which is not installed: {HF_EXTRA}") from None

    cfg, path = hf_config(ckpt, config)
    transformers.utils.logging.disable_progress_bar()  # one line per weight file on stderr otherwise
    archs = [a for a in cfg.get("architectures") or [] if hasattr(transformers, a)]
    cls = getattr(transformers, archs[0]) if archs else transformers.AutoModel
    det = ckpt.detected
    with tempfile.TemporaryDirectory() as tmp:
        with atomic_write(Path(tmp) / HF_CONFIG, "w") as fh:
            fh.write(json.dumps(cfg))
        tensors = {k: torch.as_tensor(v).detach().contiguous().clone() for k, v in sd.items() if isinstance(k, str)}
        with atomic_write(Path(tmp) / "model.safetensors") as fh:
            fh.write(save(tensors))
        # transformers 5 prints a table of missing and unexpected weights; the refusal below names them in one line
        verbosity = transformers.utils.logging.get_verbosity()
        transformers.utils.logging.set_verbosity_error()
        try:
            model, info = cls.from_pretrained(tmp, output_loading_info=True, local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - transformers' own failure, in one line
            raise UsageError(f"transformers cannot build {cls.__name__} from {path} with the checkpoint's weights "
                             f"({str(exc).strip().splitlines()[0][:200]})") from None
        finally:
            transformers.utils.logging.set_verbosity(verbosity)
    # transformers 4 reports lists, 5 sets: sorted, so the message names the same tensors every time
    problems = [f"{what}: {', '.join(sorted(str(k) for k in keys)[:5])}" for what, keys in
                (("tensors the model does not have", info.get("unexpected_keys") or ()),
                 ("tensors the checkpoint lacks", info.get("missing_keys") or ()),
                 ("tensors of another shape", info.get("mismatched_keys") or ())) if keys]
    if problems:
        raise UsageError(f"the checkpoint's weights do not fit the {cls.__name__} of {path} ({'; '.join(problems)})")
    model.eval()
    how = f"transformers {cls.__name__} from {path}"
    heads = cfg.get("num_attention_heads", cfg.get("n_head"))
    if det.layout.sequence:
        return CheckpointModel(model, how, "tokens", None, grid=grid, heads=heads)
    size, chans = cfg.get("image_size", 224), cfg.get("num_channels", 3)
    side = size if isinstance(size, int) else size[0]
    return CheckpointModel(model, how, "image", (chans, side, side), grid=grid or det.grid, heads=heads)


__all__ = ["CheckpointModel", "checkpoint_model", "timm_vit_kwargs", "timm_heads", "hf_config",
           "transformers_installed", "HF_EXTRA"]
