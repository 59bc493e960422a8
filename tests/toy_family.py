"""A toy model family, as another package would add one (docs/architecture.md, "Model families"): a
plain ``torch.nn.TransformerEncoder`` (batch first, pre-norm) over feature vectors ``[B, L, F]``,
embedded by one ``nn.Linear`` plus a position table ``[L, D]`` (learnable, the sin-cos table at
init, as in the original Transformer).

Importing this module registers the family (``@register_family``), its layout row included; a
checkpoint is ``{"model": state_dict, "toy_heads": H}`` (``nn.MultiheadAttention`` stores no heads,
so the file tells them). Everything else structinit needs of such a model is below: nothing in
structinit names it.
"""

from typing import Any, Dict, List, Optional

import numpy as np
import torch

from structinit.errors import UsageError, param
from structinit.families.weights import load_weights
from structinit.geometry.embedding import sincos_1d
from structinit.geometry.grid import Grid
from structinit.init.family import CheckpointModel, InputSpec, ModelFamily, register_family
from structinit.init.layouts import Layout

#: The entry of a toy checkpoint that tells its heads.
HEADS_KEY = "toy_heads"

TOY_LAYOUT = Layout(
    "toy-encoder", "torch.nn.TransformerEncoder over feature vectors (tests/toy_family.py)",
    r"^(?P<block>(?P<model>(?:.*\.)?)encoder\.layers\.(?P<layer>\d+)\.)self_attn\.in_proj_weight$",
    "self_attn.in_proj_weight", "self_attn.in_proj_weight", "self_attn.in_proj_weight",
    "self_attn.in_proj_bias", "self_attn.in_proj_bias", "self_attn.in_proj_bias", "self_attn.out_proj.weight",
    pos_embed="pos_embed", sequence=True, causal=False, embed=("embed.weight", "embed.bias"),
    writers=("self_attn.out_proj.weight", "self_attn.out_proj.bias", "linear2.weight", "linear2.bias"),
    family="toy-encoder")


class ToyEncoder(torch.nn.Module):
    """Feature vectors ``[B, L, F]`` -> class logits ``[B, classes]``."""

    def __init__(self, features: int = 6, dim: int = 16, heads: int = 2, depth: int = 2, length: int = 12,
                 classes: int = 3):
        super().__init__()
        self.embed = torch.nn.Linear(features, dim)
        self.pos_embed = torch.nn.Parameter(torch.from_numpy(sincos_1d(length, dim)).float())
        layer = torch.nn.TransformerEncoderLayer(dim, heads, dim_feedforward=2 * dim, dropout=0.0, batch_first=True,
                                                 norm_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.head = torch.nn.Linear(dim, classes)

    def forward(self, x):
        h = self.embed(x) + self.pos_embed[: x.shape[1]]
        return self.head(self.encoder(h).mean(1))


@register_family
class ToyFamily(ModelFamily):
    """The toy encoder's adapter (see the module docstring)."""

    name = "toy-encoder"
    layouts = (TOY_LAYOUT,)
    builds = True
    measures_attention = True

    def grid(self, model) -> Grid:
        return Grid((int(model.pos_embed.shape[0]),))

    def heads(self, model) -> int:
        return int(model.encoder.layers[0].self_attn.num_heads)

    def input_spec(self, model) -> Optional[InputSpec]:
        return InputSpec("feature vector", (int(model.pos_embed.shape[0]), int(model.embed.in_features)))

    def blocks(self, model):
        return list(model.encoder.layers)

    def checkpoint_hints(self, ckpt) -> None:
        heads = ckpt.obj.get(HEADS_KEY)
        if isinstance(heads, int) and heads > 0 and ckpt.detected.dim % heads == 0:
            ckpt.detected.heads = heads

    def build(self, ckpt, sd, *, model_name=None, config=None, heads=None, grid=None) -> CheckpointModel:
        self.refuse_config(ckpt, config)
        if model_name is not None:
            raise UsageError(f"{param('model_name')} names a timm model; a toy encoder is built from its tensors")
        det = ckpt.detected
        pre = det.model_prefix
        heads = heads or det.heads
        if heads is None:
            raise UsageError(f"the toy checkpoint does not tell its heads; give {param('heads')}")
        embed, pos = sd[pre + "embed.weight"], sd[pre + "pos_embed"]
        model = ToyEncoder(features=int(embed.shape[1]), dim=det.dim, heads=heads, depth=det.depth,
                           length=int(pos.shape[0]), classes=int(sd[pre + "head.weight"].shape[0]))
        load_weights(model, sd, pre, "toy encoder")
        return CheckpointModel(model, f"toy encoder (depth {det.depth}, heads {heads})", self.input_spec(model),
                               grid=self.grid(model), heads=heads)

    def attention_quality(self, model, x, offsets, grid, layers: List[int]) -> Dict[str, Any]:
        from structinit.analysis.capture import LayerInputs
        from structinit.analysis.quality import attention_quality
        from structinit.geometry.targets import impulse_columns

        attns = [layer.self_attn for layer in model.encoder.layers]
        inputs = LayerInputs(model, x, attns, blocks=self.blocks(model))
        rows = []
        for i, layer in enumerate(layers):
            h = inputs(layer)
            with torch.no_grad():
                _, weights = attns[layer](h, h, h, need_weights=True, average_attn_weights=False)
            got = attention_quality(weights, impulse_columns(Grid(grid), np.asarray(offsets[i])))
            rows.append({"layer": layer, "hit_rate": float(got["hit_rate"].mean()),
                         "target_mass": float(got["target_mass"].mean())})
        return {"samples": int(x.shape[0]), "layers": rows,
                "hit_rate": float(np.mean([r["hit_rate"] for r in rows])),
                "target_mass": float(np.mean([r["target_mass"] for r in rows]))}
