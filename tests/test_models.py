"""Model presets: shapes, parameter counts from first principles, fixed sin-cos PE, frozen ConvMixer filters."""

import pytest
import torch

from structinit.errors import UsageError
from structinit.geometry.embedding import sincos_2d
from structinit.training.models import (
    FILTERS,
    OTHER_PRESETS,
    PRESETS,
    SEQUENCE_PRESETS,
    VIT_PRESETS,
    ModelConfig,
    build_model,
    convmixer_depthwise,
    count_parameters,
    set_convmixer_filters,
)


def vit_params(depth, dim, mlp_ratio, patch, in_chans, classes, tokens, cls_token):
    """Parameters of a timm ViT (qkv bias, avg-pool fc_norm or final norm, linear head)."""
    hidden = int(dim * mlp_ratio)
    norms, qkv, proj = 2 * dim + 2 * dim, 3 * dim * dim + 3 * dim, dim * dim + dim
    block = norms + qkv + proj + (dim * hidden + hidden) + (hidden * dim + dim)
    patch_embed = in_chans * patch * patch * dim + dim
    prefix = 1 if cls_token else 0
    return patch_embed + (tokens + prefix) * dim + prefix * dim + depth * block + 2 * dim + dim * classes + classes


def convmixer_params(depth, dim, kernel, patch, in_chans, classes):
    stem = in_chans * patch * patch * dim + dim + 2 * dim
    block = (dim * kernel * kernel + dim + 2 * dim) + (dim * dim + dim + 2 * dim)
    return stem + depth * block + dim * classes + classes


def _size(name):
    return (8, 1, 1) if name == "vit-digits" else (32, 3, 2)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n.startswith("vit-s") else n
                                  for n in VIT_PRESETS])  # the ViT-S presets take seconds each
def test_vit_presets_forward_and_parameter_count(name):
    side, chans, patch = _size(name)
    model = build_model(ModelConfig(name), num_classes=10, image_size=side, in_chans=chans, default_patch=patch, seed=0)
    arch = model.structinit_arch
    spec = VIT_PRESETS[name]
    assert (arch["depth"], arch["dim"], arch["heads"]) == (spec["depth"], spec["dim"], spec["heads"])
    assert len(model.blocks) == spec["depth"] and model.blocks[0].attn.num_heads == spec["heads"]
    y = model(torch.randn(2, chans, side, side))
    assert y.shape == (2, 10)
    tokens = (side // arch["patch"]) ** 2
    cls = arch["pool"] == "token"
    want = vit_params(arch["depth"], arch["dim"], arch["mlp_ratio"], arch["patch"], chans, 10, tokens, cls)
    counts = count_parameters(model)
    assert counts["total"] == want
    if arch["pos_embed"] == "sincos":
        # Fixed PE: the sin-cos table, frozen, so not trainable.
        assert counts["trainable"] == want - (tokens + cls) * arch["dim"]
        assert not model.pos_embed.requires_grad
        grid = (side // arch["patch"],) * 2
        assert torch.allclose(model.pos_embed[0, int(cls):], torch.from_numpy(sincos_2d(grid, arch["dim"])))
    else:
        assert counts["trainable"] == want and model.pos_embed.requires_grad
    assert (model.cls_token is not None) == cls


def test_paper_shapes():
    t = build_model(ModelConfig("vit-t"), num_classes=10, image_size=32, in_chans=3, default_patch=2)
    assert t.patch_embed.grid_size == (16, 16) and t.global_pool == "avg" and t.cls_token is None
    assert t.structinit_arch["mlp_ratio"] == 4.0
    d = build_model(ModelConfig("vit-digits"), num_classes=10, image_size=8, in_chans=1)
    assert d.patch_embed.grid_size == (8, 8)  # patch 1: 64 tokens
    a = d.structinit_arch
    assert (a["depth"], a["dim"], a["heads"], a["mlp_ratio"]) == (4, 64, 4, 2.0)
    assert count_parameters(d) == {"total": 138890, "trainable": 134794}


def test_depth8_grid_takes_dim_and_heads():
    m = build_model(ModelConfig("vit-d8", dim=128, heads=8), num_classes=10, image_size=16, in_chans=3, default_patch=2)
    assert len(m.blocks) == 8 and m.blocks[0].attn.num_heads == 8 and m.embed_dim == 128
    assert m(torch.randn(1, 3, 16, 16)).shape == (1, 10)


def test_convit_matches_timm_convit_tiny():
    import timm

    m = build_model(ModelConfig("convit"), num_classes=10, image_size=32, in_chans=3, default_patch=2)
    ref = timm.create_model("convit_tiny", pretrained=False, img_size=32, patch_size=2, num_classes=10)
    assert count_parameters(m)["total"] == count_parameters(ref)["total"]
    assert m(torch.randn(2, 3, 32, 32)).shape == (2, 10)


@pytest.mark.parametrize("name,kernel", [("convmixer-256", 3), ("convmixer-512", 8)])
def test_convmixer_forward_and_parameter_count(name, kernel):
    m = build_model(ModelConfig(name, kernel=kernel), num_classes=10, image_size=32, in_chans=3, default_patch=2)
    dim = OTHER_PRESETS[name]["dim"]
    assert count_parameters(m)["total"] == convmixer_params(8, dim, kernel, 2, 3, 10)
    assert m(torch.randn(2, 3, 32, 32)).shape == (2, 10)


@pytest.mark.parametrize("filters", [f for f in FILTERS if f != "trained"])
def test_frozen_convmixer_filters_stay_frozen(filters):
    torch.manual_seed(0)
    m = build_model(ModelConfig("convmixer-256", dim=16, depth=2, kernel=3, filters=filters), num_classes=4,
                    image_size=8, in_chans=1, default_patch=1, seed=0)
    convs = convmixer_depthwise(m)
    before = [c.weight.detach().clone() for c in convs]
    if filters == "box":
        assert all(torch.equal(w, torch.ones_like(w)) for w in before)
    if filters == "impulse":
        for w in before:
            flat = w.flatten(1)
            assert torch.equal(flat.sum(1), torch.ones(16))
            assert torch.equal((flat != 0).sum(1), torch.ones(16, dtype=torch.long))
    assert all(not c.weight.requires_grad and not c.bias.requires_grad for c in convs)
    other = m.blocks[0][1].weight.detach().clone()
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        loss = torch.nn.functional.cross_entropy(m(torch.randn(8, 1, 8, 8)), torch.randint(0, 4, (8,)))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert all(torch.equal(c.weight, w) for c, w in zip(convs, before))
    assert not torch.equal(m.blocks[0][1].weight, other)  # the rest trains


def test_trained_convmixer_filters_train():
    m = build_model(ModelConfig("convmixer-256", dim=8, depth=1, kernel=3), num_classes=2, image_size=8, in_chans=1,
                    default_patch=1)
    assert all(c.weight.requires_grad for c in convmixer_depthwise(m))
    with pytest.raises(UsageError, match="unknown filters"):
        set_convmixer_filters(m, "gabor")


@pytest.mark.parametrize("kwargs,match", [
    (dict(name="vit-x"), "unknown model"),
    (dict(name="vit-t", kernel=3), "ConvMixer presets only"),
    (dict(name="convmixer-256", pool="token"), "ViT presets only"),
    (dict(name="vit-t", pool="max"), "unknown pool"),
    (dict(name="vit-t", dim=0), "must be positive"),
])
def test_bad_model_settings(kwargs, match):
    with pytest.raises(UsageError, match=match):
        ModelConfig(**kwargs)


def test_bad_shapes_are_usage_errors():
    with pytest.raises(UsageError, match="not divisible by heads"):
        build_model(ModelConfig("vit-t", heads=5), num_classes=10, image_size=32, in_chans=3, default_patch=2)
    with pytest.raises(UsageError, match="not divisible by patch"):
        build_model(ModelConfig("vit-digits", patch=3), num_classes=10, image_size=8, in_chans=1)


def test_every_preset_is_listed():
    assert set(PRESETS) == set(VIT_PRESETS) | set(OTHER_PRESETS) | set(SEQUENCE_PRESETS)
