"""What the data fit runs on (structinit.fit.inputs): the batch given, or noise of the input shape
a model's family tells (structinit.init.family), with an identity that names it."""

from types import SimpleNamespace

import pytest
import torch

from structinit.families.timm_vit import patch_input_shape
from structinit.fit.inputs import NOISE_SEED_OFFSET, data_inputs, noise_inputs
from structinit.init.family import FAMILIES, load_families, model_inputs

load_families()


class Bare(torch.nn.Module):
    """A module that tells nothing of its inputs."""


def with_patch_embed(chans=None, grid_size=None, img_size=None):
    m = Bare()
    m.patch_embed = Bare()
    if chans is not None:
        m.patch_embed.proj = torch.nn.Conv2d(chans, 4, 1)
    if grid_size is not None:
        m.patch_embed.grid_size = grid_size
    if img_size is not None:
        m.patch_embed.img_size = img_size
    return m


def test_the_input_shape_a_model_tells():
    from structinit.training.models import ModelConfig, build_model

    vit = build_model(ModelConfig("vit-digits"), num_classes=10, image_size=8, in_chans=1)
    assert model_inputs(vit) == FAMILIES["structinit"].input_spec(vit)
    assert (model_inputs(vit).kind, model_inputs(vit).shape, model_inputs(vit).images) == ("image", (1, 8, 8), True)
    seq = build_model(ModelConfig("transformer-1d"), num_classes=10, image_size=40, in_chans=1)
    got = model_inputs(seq)  # a sequence: grid_size (L,), and a batch may leave out its one channel
    assert (got.kind, got.shape, got.squeezed, got.noise_shape) == ("sequence", (1, 40), True, (1, 40))
    assert tuple(got.as_model_batch(torch.zeros(2, 40)).shape) == (2, 1, 40)
    assert patch_input_shape(with_patch_embed(3, grid_size=(4, 2), img_size=(16, 8))) == (3, 16, 8)
    assert patch_input_shape(with_patch_embed(3, img_size=(12, 6))) == (3, 12, 6)  # no grid_size: the image size
    assert patch_input_shape(with_patch_embed(3)) is None  # channels but no size
    assert patch_input_shape(with_patch_embed(img_size=(8, 8))) is None  # no projection: no channels
    hf, family = Bare(), FAMILIES["hf-vit"]
    hf.config = SimpleNamespace(num_channels=3, image_size=32)
    assert family.input_spec(hf).shape == (3, 32, 32)
    hf.config = SimpleNamespace(num_channels=1, image_size=(24, 16))
    assert family.input_spec(hf).shape == (1, 24, 16)
    hf.config = SimpleNamespace(num_channels=3)  # channels but no image size
    assert family.input_spec(hf) is None
    ids = FAMILIES["hf-bert"].input_spec(hf)  # a model of token ids: noise cannot stand for them
    assert ids.ids and ids.shape is None and ids.noise_shape is None
    assert model_inputs(Bare()) is None


def test_noise_inputs_are_seeded_standard_normal_and_named():
    a = noise_inputs((1, 8, 8), 64, seed=3)
    assert a.kind == "noise" and a.seed == 3 and tuple(a.x.shape) == (64, 1, 8, 8)
    assert torch.equal(a.x, torch.randn(64, 1, 8, 8, generator=torch.Generator().manual_seed(3 + NOISE_SEED_OFFSET)))
    assert torch.equal(noise_inputs((1, 8, 8), 64, seed=3).x, a.x) and not torch.equal(noise_inputs((1, 8, 8), 64,
                                                                                                  4).x, a.x)
    assert abs(float(a.x.mean())) < 0.1 and abs(float(a.x.std()) - 1) < 0.1
    assert a.source == "noise: 64 Gaussian inputs N(0, 1) of shape [1, 8, 8] (no data)"
    assert a.identity() == {"inputs": {"kind": "noise", "seed": 3, "samples": 64, "shape": [1, 8, 8]}}
    # seed 0 is a seed: its identity is not another seed's (a fit on it must not be read for seed 1)
    zero, one = noise_inputs((1, 8, 8), 64, seed=0).identity(), noise_inputs((1, 8, 8), 64, seed=1).identity()
    assert zero["inputs"]["seed"] == 0 and one["inputs"]["seed"] == 1


@pytest.mark.parametrize("source, want", [(None, "a batch of 5 inputs"), ("mine", "mine")])
def test_a_batch_given_is_cut_to_the_samples_and_named(source, want):
    x = torch.arange(7 * 3, dtype=torch.float32).view(7, 3)
    got = data_inputs(x, 5, source)
    assert got.kind == "data" and torch.equal(got.x, x[:5]) and got.source == want and got.samples == 5
    ident = got.identity()
    assert set(ident) == {"batch", "samples"} and ident["samples"] == 5 and ident["batch"].startswith("sha256:")
    assert data_inputs(x, 9).source == "a batch of 7 inputs"


def test_the_token_grid_and_heads_a_hugging_face_config_tells():
    from structinit.errors import UsageError
    from structinit.init.family import model_heads

    hf, family = Bare(), FAMILIES["hf-vit"]
    hf.config = SimpleNamespace(image_size=32, patch_size=4, num_attention_heads=3)
    assert family.grid(hf) == (8, 8) and family.heads(hf) == 3
    hf.config = SimpleNamespace(image_size=(24, 16), patch_size=(4, 8))  # rectangular images and patches
    assert family.grid(hf) == (6, 2)
    hf.config = SimpleNamespace(patch_size=4)  # no image size: the grid must be given
    with pytest.raises(UsageError, match="grid"):
        family.grid(hf)
    with pytest.raises(UsageError, match="heads"):
        model_heads(Bare())
