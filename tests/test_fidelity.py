"""attention_fidelity: attention captured from real timm models on real digits, checked against the
attention computed by hand from the weights and against the pseudo-input measures of the init."""

import math

import numpy as np
import pytest
import torch
from conftest import digits_images, vit_digits

from structinit.analysis.fidelity import (
    attention_fidelity,
    attention_modules,
    capture_attention,
    offsets_from_report,
    window_mask,
)
from structinit.errors import UsageError
from structinit.init.initialize import initialize_model
from structinit.init.report import InitReport

pytestmark = pytest.mark.usefixtures("one_torch_thread")
# The impulse inits here are the solve alone (data_fit=0): what is tested is the measurement of a
# model's attention, and the default noise fit would cost seconds each.


@pytest.fixture(scope="module")
def digits_batch():
    return digits_images(48)


def vit(pool="avg", seed=0):
    return vit_digits(seed, pool=pool)


def manual_attention(block, x):
    """softmax(q k^T / sqrt(d)) of a timm block on its input x [B, T, D], computed from the weights."""
    attn = block.attn
    h = block.norm1(x)
    b, t, d = h.shape
    qkv = attn.qkv(h).reshape(b, t, 3, attn.num_heads, d // attn.num_heads).permute(2, 0, 3, 1, 4)
    q, k = qkv[0], qkv[1]
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // attn.num_heads), dim=-1)


def test_captured_attention_is_the_attention_of_the_weights(digits_batch):
    model = vit(seed=3)
    initialize_model(model, "mimetic", seed=3)
    got = capture_attention(model, digits_batch, batch_size=20)  # three batches, the last one partial
    assert len(got) == 4 and got[0].shape == (48, 4, 64, 64)
    with torch.no_grad():
        x = model._pos_embed(model.patch_embed(digits_batch))
        want0 = manual_attention(model.blocks[0], x)
        x = model.blocks[0](x)
        want1 = manual_attention(model.blocks[1], x)
    torch.testing.assert_close(got[0], want0, atol=2e-6, rtol=1e-4)
    torch.testing.assert_close(got[1], want1, atol=2e-6, rtol=1e-4)
    assert torch.allclose(got[3].sum(-1), torch.ones(48, 4, 64), atol=1e-5)


def test_capture_leaves_the_model_as_it_was(digits_batch):
    model = vit()
    model.train()
    fused = [m.fused_attn for m in attention_modules(model)]
    for m in attention_modules(model):
        m.fused_attn = True
    capture_attention(model, digits_batch[:4])
    assert model.training
    assert all(m.fused_attn for m in attention_modules(model))
    assert all(not m.attn_drop._forward_hooks for m in attention_modules(model))
    for m, f in zip(attention_modules(model), fused):
        m.fused_attn = f


def test_zero_patch_embedding_gives_the_pseudo_input_measures(digits_batch):
    """With the patch embedding zeroed, layer 1 sees LayerNorm(PE) exactly: the solver's pseudo input."""
    model = vit()
    report = initialize_model(model, "impulse", seed=0, data_fit=0)  # the solve alone: its pseudo input
    with torch.no_grad():
        model.patch_embed.proj.weight.zero_()
        model.patch_embed.proj.bias.zero_()
    fid = attention_fidelity(model, digits_batch, offsets=offsets_from_report(report), filter=3)
    first = report["layers"][0]
    assert fid.hit_rate.shape == (4, 4) and fid.images == 48
    assert fid.hit_rate[0].mean() == pytest.approx(first["hit_rate"], abs=1e-4)
    assert fid.target_mass[0].mean() == pytest.approx(first["target_mass"], abs=1e-4)
    # every image gives the same attention in layer 1, so the mean map is that attention
    assert fid.maps.shape == (4, 4, 64, 64)
    np.testing.assert_allclose(fid.maps[0].sum(-1), 1.0, atol=1e-5)
    rows = fid.layer_rows()
    assert rows[0]["hit_rate"] == pytest.approx(first["hit_rate"], abs=1e-4)
    assert 0.0 < rows[0]["window_mass"] <= 1.0


def test_measures_match_a_hand_count(digits_batch):
    model = vit(seed=1)
    report = initialize_model(model, "impulse", seed=1, data_fit=0)
    offsets = offsets_from_report(report)
    fid = attention_fidelity(model, digits_batch, offsets=offsets, filter=3)
    attn = capture_attention(model, digits_batch)
    from structinit.geometry.targets import impulse_columns

    for layer in (0, 3):
        a = attn[layer]  # [B, H, 64, 64]
        cols = torch.from_numpy(impulse_columns((8, 8), offsets[layer]))  # [H, 64]
        has = cols >= 0
        hit = ((a.argmax(-1) == cols) & has).sum(-1).double() / has.sum(-1)
        mass = (a.gather(-1, cols.clamp(min=0).expand(a.shape[:-1]).unsqueeze(-1)).squeeze(-1) * has).sum(-1)
        np.testing.assert_allclose(fid.hit_rate[layer], hit.mean(0).numpy(), atol=1e-6)
        np.testing.assert_allclose(fid.target_mass[layer], (mass / has.sum(-1)).mean(0).numpy(), atol=1e-6)
        win = torch.from_numpy(window_mask((8, 8), 3))
        np.testing.assert_allclose(fid.window_mass[layer], (a * win).sum(-1).mean(-1).mean(0).numpy(), atol=1e-6)
    # offsets for some layers only: the others are NaN, the summary averages what exists
    part = attention_fidelity(model, digits_batch, offsets={1: offsets[1]}, keep_maps=False)
    assert np.isnan(part.hit_rate[0]).all() and not np.isnan(part.hit_rate[1]).any()
    assert part.maps is None and part.layer_rows()[0]["hit_rate"] is None
    assert part.summary()["hit_rate"] == pytest.approx(float(fid.hit_rate[1].mean()))


def test_window_mask_counts_the_window():
    m = window_mask((3, 3), 3)
    assert m.shape == (9, 9)
    assert m[4].sum() == 9 and m[0].sum() == 4 and m[1].sum() == 6
    seq = window_mask((7,), 3, prefix=1)  # a sequence with one prefix token
    assert seq.shape == (7, 8) and seq[:, 0].sum() == 0
    assert seq[3].sum() == 3 and seq[0].sum() == 2
    assert window_mask((5, 5), 1)[12].tolist() == np.eye(25)[12].tolist()


def test_class_token_is_a_prefix_token(digits_batch):
    model = vit(pool="token")
    report = initialize_model(model, "impulse", data_fit=0)
    fid = attention_fidelity(model, digits_batch[:8], offsets=offsets_from_report(report))
    assert fid.prefix == 1 and fid.maps.shape == (4, 4, 65, 65) and fid.grid_maps().shape == (4, 4, 64, 64)
    assert fid.to_dict()["layers"][0]["hit_rate"] is not None


def test_bad_input_is_one_clear_error(digits_batch):
    model = vit()
    with pytest.raises(UsageError, match="shape"):
        attention_fidelity(model, digits_batch[:2], offsets=np.zeros((2, 4, 2)))
    with pytest.raises(UsageError, match="layer"):
        attention_fidelity(model, digits_batch[:2], offsets={7: np.zeros((4, 2))})
    with pytest.raises(UsageError, match="filter"):
        attention_fidelity(model, digits_batch[:2], filter=0)
    with pytest.raises(UsageError, match="no offsets"):
        offsets_from_report(InitReport.from_dict({"method": "mimetic", "layers": [{"layer": 0}]}))
    with pytest.raises(UsageError, match="no timm attention"):
        attention_modules(torch.nn.Sequential(torch.nn.Linear(2, 2)))
