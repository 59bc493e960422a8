"""What an AttentionTarget reads off a model or state dict: the grid a ViT tells even when the
method needs none, the rows of a sequence table that are the sequence (its first N), and the
progress it reports through the selected layers."""

import numpy as np
import timm
import torch

from structinit.geometry.embedding import sincos_1d
from structinit.geometry.grid import Grid
from structinit.init.attention_target import AttentionTarget

D = 8


def test_a_vit_tells_its_grid_even_to_a_method_that_needs_none():
    # 4x6 patches and a class token: 25 rows, which the weights alone would read as 5x5
    model = timm.create_model("vit_tiny_patch16_224", img_size=(32, 48), patch_size=8, depth=1, num_classes=3)
    assert AttentionTarget(model, need_grid=False).grid == Grid((4, 6))
    assert AttentionTarget(model.state_dict(), heads=3, need_grid=False).grid is None


def gpt2_sd(positions):
    torch.manual_seed(0)
    return {"h.0.attn.c_attn.weight": torch.randn(D, 3 * D), "h.0.attn.c_attn.bias": torch.zeros(3 * D),
            "h.0.attn.c_proj.weight": torch.zeros(D, D), "wpe.weight": torch.from_numpy(sincos_1d(positions, D))}


def test_a_sequence_table_gives_its_first_rows():
    target = AttentionTarget(gpt2_sd(12), grid=(8,), heads=2)
    np.testing.assert_array_equal(np.asarray(target.pos_embed()), sincos_1d(12, D)[:8])
    assert target.pos_embed_kind() == "sincos"


def test_progress_is_reported_as_each_selected_layer_is_done():
    sd = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(D, 2, batch_first=True), 3,
                                     enable_nested_tensor=False).state_dict()
    calls = []
    target = AttentionTarget(sd, grid=(2, 2), heads=2, layers="0,2",
                             progress=lambda done, total: calls.append((done, total)))
    assert [slot.index for slot in target.slots] == [0, 2]
    assert calls == [(1, 2), (2, 2)]
