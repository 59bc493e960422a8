"""Models for sequences ``[B, C, L]`` (e.g. MNIST-1D): a small 1-D transformer whose tokens are the
positions, and a 1-D CNN of similar size as the reference it is compared with.

:class:`SequenceTransformer` is laid out like a timm VisionTransformer (it is built from timm's own
``Block``), so every init method and layout of structinit applies to it unchanged: its keys read
``blocks.{i}.attn.qkv.weight``, its fixed position embedding is ``pos_embed [1, L, D]``, and
``patch_embed.grid_size == (L,)`` tells :func:`structinit.init.family.model_grid` that its tokens
form a sequence of ``L``.

Example::

    model = SequenceTransformer(length=40, in_chans=1, num_classes=10, dim=64, depth=4, heads=4)
    model(torch.zeros(2, 1, 40)).shape  # (2, 10)
    initialize_model(model, "impulse", filter=5)  # 1-D impulse filters on the sequence of 40
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from structinit.errors import UsageError, param


class TokenEmbed1d(nn.Module):
    """One token per position: a linear map of the ``window`` values centred on it (zero padded at
    the ends; ``window=1``: the value itself). ``[B, C, L] -> [B, L, D]``."""

    def __init__(self, in_chans: int, dim: int, window: int, length: int):
        super().__init__()
        if window < 1 or window % 2 == 0:
            raise UsageError(f"{param('window')} must be a positive odd number (a window centred on each "
                             f"position), got {window}")
        self.proj = nn.Conv1d(in_chans, dim, window, padding=window // 2)
        self.grid_size = (int(length),)
        self.num_patches = int(length)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).transpose(1, 2)


class SequenceTransformer(nn.Module):
    """A pre-norm transformer encoder over the positions of a sequence: token embedding
    (:class:`TokenEmbed1d`) plus position embedding, ``depth`` timm ``Block``s, final LayerNorm,
    average pooling over the tokens, a linear head. ``[B, in_chans, length] -> [B, num_classes]``.

    ``pos_embed='sincos'`` writes the fixed 1-D sin-cos table (frozen); ``'learned'`` trains it
    (trunc-normal std 0.02). Linear layers start as timm's ViTs do (trunc normal std 0.02, zero
    bias); structinit's init methods replace that.
    """

    def __init__(self, length: int, in_chans: int, num_classes: int, dim: int = 64, depth: int = 4, heads: int = 4,
                 mlp_ratio: float = 2.0, window: int = 1, pos_embed: str = "sincos", drop_path: float = 0.0):
        super().__init__()
        from timm.layers import trunc_normal_
        from timm.models.vision_transformer import Block

        self.num_prefix_tokens = 0
        self.no_embed_class = True
        self.embed_dim = dim
        self.patch_embed = TokenEmbed1d(in_chans, dim, window, length)
        self.pos_embed = nn.Parameter(torch.zeros(1, length, dim))
        rates = torch.linspace(0, drop_path, depth).tolist()
        norm = partial(nn.LayerNorm, eps=1e-6)
        # timm annotates norm_layer as a class and calls it; a partial is what its own models pass
        self.blocks = nn.Sequential(*[Block(dim, heads, mlp_ratio, qkv_bias=True, drop_path=rates[i],
                                            norm_layer=norm)  # type: ignore[arg-type]
                                      for i in range(depth)])
        self.norm = norm(dim)
        self.head = nn.Linear(dim, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)
        if pos_embed == "sincos":
            from structinit.init.pos_embed import set_sincos_pos_embed

            set_sincos_pos_embed(self)
        elif pos_embed == "learned":
            trunc_normal_(self.pos_embed, std=0.02)
        else:
            raise UsageError(f"unknown {param('pos_embed')} {pos_embed!r}; choose sincos or learned")

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Token features after the last block and the final norm: ``[B, L, D]``."""
        return self.norm(self.blocks(self.patch_embed(x) + self.pos_embed))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.forward_features(x).mean(1))


class SequenceCNN(nn.Module):
    """A 1-D CNN: a stem ``Conv1d(in_chans, dim, kernel)`` then ``depth - 1`` residual blocks
    ``x + GELU(BN(Conv1d(dim, dim, kernel)(x)))`` (all 'same' zero padding, stride 1), average
    pooling over positions, a linear head. ``[B, in_chans, length] -> [B, num_classes]``; PyTorch's
    default init."""

    def __init__(self, length: int, in_chans: int, num_classes: int, dim: int = 64, depth: int = 4, kernel: int = 5):
        super().__init__()
        if kernel < 1 or kernel % 2 == 0:
            raise UsageError(f"{param('kernel')} must be a positive odd number for a 1-D CNN, got {kernel}")

        def conv_bn(c_in: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv1d(c_in, dim, kernel, padding=kernel // 2), nn.BatchNorm1d(dim), nn.GELU())

        self.length = int(length)
        self.stem = conv_bn(in_chans)
        self.blocks = nn.ModuleList([conv_bn(dim) for _ in range(depth - 1)])
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x.mean(-1))
