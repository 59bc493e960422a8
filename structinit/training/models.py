"""Model presets of the paper's comparison, built with timm.

Every ViT preset is the paper's ViT (Table 1, last row): fixed 2-D sin-cos position embedding,
global average pooling, no class token. The Table 1 ablation variants switch to a class token
and/or a learned position embedding. ConViT and ConvMixer are timm's models sized for the data.
The sequence presets (:data:`SEQUENCE_PRESETS`, for datasets of kind ``sequence`` such as
MNIST-1D) are a 1-D transformer whose tokens are the positions (fixed 1-D sin-cos position
embedding, average pooling; timm blocks, so every init method applies) and a 1-D CNN of similar
size (:mod:`structinit.training.sequence_models`).

Example::

    from structinit.training.models import ModelConfig, build_model
    model = build_model(ModelConfig("vit-digits"), num_classes=10, image_size=8, in_chans=1)
    model(torch.zeros(2, 1, 8, 8)).shape  # (2, 10)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Optional, Union

from structinit.errors import UsageError, param
from structinit.geometry.grid import Grid

#: ViT presets: name -> (depth, dim, heads, mlp_ratio, pool, pos_embed). ``None`` fields are free.
VIT_PRESETS: Dict[str, Dict[str, Any]] = {
    "vit-t": dict(depth=12, dim=192, heads=3),
    "vit-t-h8": dict(depth=12, dim=192, heads=8),
    "vit-s": dict(depth=12, dim=384, heads=6),
    "vit-s-h16": dict(depth=12, dim=384, heads=16),
    # Tables 5 and 7: depth 8, dims 64-512, heads 4-32 (set with --dim / --heads).
    "vit-d8": dict(depth=8, dim=256, heads=4),
    # The CPU-scale grid: scikit-learn's 8x8 digits, patch 1 (64 tokens).
    "vit-digits": dict(depth=4, dim=64, heads=4, mlp_ratio=2.0, patch=1),
    # Fashion-MNIST (28x28): sized to train on a CPU; patch 4 (7x7 = 49 tokens) and the same ViT at
    # patch 2 (14x14 = 196 tokens, the paper's scale of tokens).
    "vit-fashion": dict(depth=4, dim=64, heads=4, mlp_ratio=2.0, patch=4),
    "vit-fashion-196": dict(depth=4, dim=64, heads=4, mlp_ratio=2.0, patch=2),
    # Table 1 variants of ViT-T.
    "vit-t-cls": dict(depth=12, dim=192, heads=3, pool="token"),
    "vit-t-learned-pe": dict(depth=12, dim=192, heads=3, pos_embed="learned"),
    "vit-t-cls-learned-pe": dict(depth=12, dim=192, heads=3, pool="token", pos_embed="learned"),
}
OTHER_PRESETS: Dict[str, Dict[str, Any]] = {
    # timm's convit_tiny (4 heads x 48 = 192 dim, 12 blocks, 10 GPSA) at the dataset's size.
    "convit": dict(depth=12, dim=192, heads=4),
    # Table 4: ConvMixer depth 8, dim 256 / 512, kernel 3 / 5 / 8 (--kernel), filters (--filters).
    "convmixer-256": dict(depth=8, dim=256, kernel=5),
    "convmixer-512": dict(depth=8, dim=512, kernel=5),
}
#: Sequence presets (inputs ``[B, C, L]``): the 1-D transformer (tokens = positions, each the linear
#: embedding of a ``window`` of values) and the 1-D CNN reference, both ~0.1M parameters at dim 64.
SEQUENCE_PRESETS: Dict[str, Dict[str, Any]] = {
    "transformer-1d": dict(depth=4, dim=64, heads=4, mlp_ratio=2.0, window=1),
    "cnn-1d": dict(depth=4, dim=64, kernel=5),
}
PRESETS = tuple(VIT_PRESETS) + tuple(OTHER_PRESETS) + tuple(SEQUENCE_PRESETS)
#: Families whose attention structinit's init methods write.
ATTENTION_FAMILIES = ("vit", "transformer-1d")
POOLS = ("avg", "token")
POS_EMBEDS = ("sincos", "learned")
FILTERS = ("trained", "random", "impulse", "box")


@dataclass(frozen=True)
class ModelConfig:
    """A preset and its overrides (``None``: the preset's value, or the dataset's default patch).

    ``pool``/``pos_embed`` apply to ViT presets (and ``pos_embed`` to ``transformer-1d``);
    ``kernel``/``filters`` to ConvMixer, where ``filters`` is ``trained`` or frozen ``random``,
    ``impulse`` (one-hot at a random tap per channel) or ``box`` (all ones), as in the paper's
    Table 4; ``kernel`` also to ``cnn-1d``; ``window`` (odd: the values each token embeds) to
    ``transformer-1d``.
    """

    name: str = "vit-digits"
    dim: Optional[int] = None
    heads: Optional[int] = None
    depth: Optional[int] = None
    patch: Optional[int] = None
    mlp_ratio: Optional[float] = None
    pool: Optional[str] = None
    pos_embed: Optional[str] = None
    kernel: Optional[int] = None
    filters: str = "trained"
    drop_path: float = 0.0
    window: Optional[int] = None

    def __post_init__(self):
        if self.name not in PRESETS:
            raise UsageError(f"unknown {param('model')} {self.name!r}; choose one of {', '.join(PRESETS)}")
        for field in ("dim", "heads", "depth", "patch", "kernel", "window"):
            value = getattr(self, field)
            if value is not None and value < 1:
                raise UsageError(f"{param(field)} must be positive, got {value}")
        if self.mlp_ratio is not None and not 0 < self.mlp_ratio < float("inf"):
            raise UsageError(f"{param('mlp_ratio')} must be a positive finite number, got {self.mlp_ratio}")
        if self.pool is not None and self.pool not in POOLS:
            raise UsageError(f"unknown {param('pool')} {self.pool!r}; choose one of {', '.join(POOLS)}")
        if self.pos_embed is not None and self.pos_embed not in POS_EMBEDS:
            raise UsageError(f"unknown {param('pos_embed')} {self.pos_embed!r}; choose one of {', '.join(POS_EMBEDS)}")
        if self.filters not in FILTERS:
            raise UsageError(f"unknown {param('filters')} {self.filters!r}; choose one of {', '.join(FILTERS)}")
        if not 0.0 <= self.drop_path < 1.0:
            raise UsageError(f"{param('drop_path')} must be in [0, 1), got {self.drop_path}")
        family = self.family
        if family == "cnn-1d" and self.filters != "trained":
            raise UsageError(f"{param('filters')} applies to ConvMixer presets only")
        if family not in ("convmixer", "cnn-1d") and (self.kernel is not None or self.filters != "trained"):
            raise UsageError(f"{param('kernel')} and {param('filters')} apply to ConvMixer presets only "
                             f"({param('kernel')} also to cnn-1d)")
        if family == "transformer-1d" and self.pool not in (None, "avg"):
            raise UsageError(f"transformer-1d pools by averaging its tokens; {param('pool')} {self.pool} needs a "
                             "ViT preset")
        if family not in ("vit", "transformer-1d") and (self.pool is not None or self.pos_embed is not None):
            raise UsageError(f"{param('pool')} and {param('pos_embed')} apply to ViT presets only")
        if family in ("convmixer", "cnn-1d") and (self.heads is not None or self.mlp_ratio is not None):
            raise UsageError(f"{param('heads')} and {param('mlp_ratio')} do not apply to {self.name}")
        if self.window is not None and family != "transformer-1d":
            raise UsageError(f"{param('window')} applies to transformer-1d only")
        if self.window is not None and self.window % 2 == 0:
            raise UsageError(f"{param('window')} must be odd (a window centred on each position), got {self.window}")
        if self.patch is not None and self.is_sequence:
            raise UsageError(f"{param('patch')} applies to image models; {self.name}'s tokens are the sequence's "
                             f"positions (set how many values each embeds with {param('window')})")

    @property
    def family(self) -> str:
        """``vit``, ``convit``, ``convmixer``, ``transformer-1d`` or ``cnn-1d``."""
        if self.name in SEQUENCE_PRESETS:
            return self.name
        return "vit" if self.name in VIT_PRESETS else self.name.split("-")[0]

    @property
    def is_sequence(self) -> bool:
        """Whether the model takes sequences ``[B, C, L]`` (else images ``[B, C, H, W]``)."""
        return self.name in SEQUENCE_PRESETS

    def resolved(self, default_patch: int) -> Dict[str, Any]:
        """Every architecture setting, preset values filled in (what ``build_model`` builds)."""
        base = dict(VIT_PRESETS.get(self.name) or OTHER_PRESETS.get(self.name) or SEQUENCE_PRESETS[self.name])
        out: Dict[str, Any] = {"name": self.name, "family": self.family}
        out["depth"] = self.depth or base["depth"]
        out["dim"] = self.dim or base["dim"]
        if self.is_sequence:
            return self._resolved_sequence(base, out)
        out["patch"] = self.patch or base.get("patch") or default_patch
        if self.family == "convmixer":
            out["kernel"] = self.kernel or base["kernel"]
            out["filters"] = self.filters
        else:
            out["heads"] = self.heads or base["heads"]
            out["mlp_ratio"] = float(self.mlp_ratio or base.get("mlp_ratio", 4.0))
            if out["dim"] % out["heads"]:
                raise UsageError(f"{param('dim')} {out['dim']} is not divisible by {param('heads')} {out['heads']}")
        if self.family == "vit":
            out["pool"] = self.pool or base.get("pool", "avg")
            out["pos_embed"] = self.pos_embed or base.get("pos_embed", "sincos")
            if out["pos_embed"] == "sincos" and out["dim"] % 4:
                raise UsageError(f"{param('dim')} {out['dim']} must be divisible by 4 for the sin-cos position "
                                 "embedding")
        out["drop_path"] = self.drop_path
        return out

    def _resolved_sequence(self, base: Dict[str, Any], out: Dict[str, Any]) -> Dict[str, Any]:
        if self.family == "cnn-1d":
            out["kernel"] = self.kernel or base["kernel"]
        else:
            out["heads"] = self.heads or base["heads"]
            out["mlp_ratio"] = float(self.mlp_ratio or base.get("mlp_ratio", 4.0))
            out["window"] = self.window or base["window"]
            out["pool"] = "avg"
            out["pos_embed"] = self.pos_embed or "sincos"
            if out["dim"] % out["heads"]:
                raise UsageError(f"{param('dim')} {out['dim']} is not divisible by {param('heads')} {out['heads']}")
            if out["pos_embed"] == "sincos" and out["dim"] % 2:
                raise UsageError(f"{param('dim')} {out['dim']} must be even for the 1-D sin-cos position embedding")
        out["drop_path"] = self.drop_path
        return out

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


def _grid(image_size: int, patch: int) -> Grid:
    if image_size % patch:
        raise UsageError(f"image size {image_size} is not divisible by {param('patch')} size {patch}")
    return Grid((image_size // patch, image_size // patch))


def build_model(config: ModelConfig, *, num_classes: int, image_size: int, in_chans: int,
                default_patch: Optional[int] = None, seed: Optional[int] = None):
    """A fresh timm model for images ``[B, in_chans, image_size, image_size]`` -> logits ``[B, num_classes]``
    (a sequence preset: sequences ``[B, in_chans, image_size]``, ``image_size`` being their length).

    ViTs get their position embedding per ``pos_embed``: ``sincos`` writes structinit's fixed 2-D
    sin-cos embedding (zeros at a class token) and freezes it. ``seed`` seeds torch first.
    """
    import torch

    if seed is not None:
        torch.manual_seed(seed)
    arch = config.resolved(default_patch or 1)
    if config.is_sequence:
        return _build_sequence_model(arch, num_classes=num_classes, length=image_size, in_chans=in_chans)
    grid = _grid(image_size, arch["patch"])
    family = arch["family"]
    model: torch.nn.Module
    if family == "vit":
        from timm.models.vision_transformer import VisionTransformer

        cls = arch["pool"] == "token"
        model = VisionTransformer(
            img_size=image_size, patch_size=arch["patch"], in_chans=in_chans, num_classes=num_classes,
            global_pool=arch["pool"], embed_dim=arch["dim"], depth=arch["depth"], num_heads=arch["heads"],
            mlp_ratio=arch["mlp_ratio"], class_token=cls, drop_path_rate=arch["drop_path"])
        if arch["pos_embed"] == "sincos":
            from structinit.init.pos_embed import set_sincos_pos_embed

            set_sincos_pos_embed(model, grid, zero_prefix=True)  # a class token's position stays zero
    elif family == "convit":
        from timm.models.convit import ConVit

        heads = arch["heads"]
        model = ConVit(img_size=image_size, patch_size=arch["patch"], in_chans=in_chans, num_classes=num_classes,
                       embed_dim=arch["dim"] // heads, num_heads=heads, depth=arch["depth"],
                       mlp_ratio=arch["mlp_ratio"], local_up_to_layer=max(arch["depth"] - 2, 1),
                       locality_strength=1.0, drop_path_rate=arch["drop_path"])
    else:
        from timm.models.convmixer import ConvMixer

        model = ConvMixer(dim=arch["dim"], depth=arch["depth"], kernel_size=arch["kernel"], patch_size=arch["patch"],
                          in_chans=in_chans, num_classes=num_classes)
        set_convmixer_filters(model, arch["filters"], seed=seed or 0)
    # torch types Module.__setattr__ for tensors and modules; any other value is stored as a plain attribute
    model.structinit_arch = dict(arch, grid=list(grid), image_size=image_size,  # type: ignore[assignment]
                                 in_chans=in_chans, num_classes=num_classes)
    return model


def _build_sequence_model(arch: Dict[str, Any], *, num_classes: int, length: int, in_chans: int):
    """The ``transformer-1d`` or ``cnn-1d`` model of ``arch`` for sequences ``[B, in_chans, length]``."""
    from structinit.training.sequence_models import SequenceCNN, SequenceTransformer

    model: Union[SequenceCNN, SequenceTransformer]
    if arch["family"] == "cnn-1d":
        model = SequenceCNN(length, in_chans, num_classes, dim=arch["dim"], depth=arch["depth"], kernel=arch["kernel"])
    else:
        model = SequenceTransformer(length, in_chans, num_classes, dim=arch["dim"], depth=arch["depth"],
                                    heads=arch["heads"], mlp_ratio=arch["mlp_ratio"], window=arch["window"],
                                    pos_embed=arch["pos_embed"], drop_path=arch["drop_path"])
    # torch types Module.__setattr__ for tensors and modules; any other value is stored as a plain attribute
    model.structinit_arch = dict(arch, grid=[int(length)], length=int(length),  # type: ignore[assignment]
                                 in_chans=in_chans, num_classes=num_classes)
    return model


def convmixer_depthwise(model):
    """The depthwise ``nn.Conv2d`` of every ConvMixer block, in order."""
    return [block[0].fn[0] for block in model.blocks]


def set_convmixer_filters(model, filters: str, seed: int = 0) -> None:
    """Set and freeze the depthwise filters ``[dim, 1, k, k]`` of a ConvMixer (``trained``: leave as is).

    ``random``: timm's (Kaiming-uniform) init, frozen; ``impulse``: a single 1 at a tap drawn
    uniformly per channel; ``box``: all ones. Frozen filters have their bias zeroed (for impulse
    and box) and ``requires_grad`` off on weight and bias.
    """
    import torch

    if filters not in FILTERS:
        raise UsageError(f"unknown {param('filters')} {filters!r}; choose one of {', '.join(FILTERS)}")
    if filters == "trained":
        return
    gen = torch.Generator().manual_seed(seed)
    for conv in convmixer_depthwise(model):
        w = conv.weight
        c, _, kh, kw = w.shape
        with torch.no_grad():
            if filters == "impulse":
                taps = torch.randint(0, kh * kw, (c,), generator=gen)
                new = torch.zeros(c, kh * kw)
                new[torch.arange(c), taps] = 1.0
                w.copy_(new.view(c, 1, kh, kw))
            elif filters == "box":
                w.fill_(1.0)
            if filters != "random" and conv.bias is not None:
                conv.bias.zero_()
        w.requires_grad_(False)
        if conv.bias is not None:
            conv.bias.requires_grad_(False)


def count_parameters(model) -> Dict[str, int]:
    """``{"total": ..., "trainable": ...}`` parameter counts."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"total": int(total), "trainable": int(trainable)}
