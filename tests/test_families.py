"""Model families as registered adapters (structinit.init.family): the built-in ones are the
modules of the families stage, each layout row names a registered family, a model and a checkpoint
find theirs, and a layout row naming a family no one registered is refused when registered (it
would otherwise break the default ``apply`` of its layout)."""

import dataclasses
from pathlib import Path

import pytest
import torch
from conftest import vit_digits

from structinit.errors import StructinitError
from structinit.init import family as registry
from structinit.init import layouts
from structinit.init.family import GENERIC, ModelFamily, register_family, register_layout
from structinit.init.layouts import LAYOUTS, Layout, detect_layout

PACKAGE = Path(__file__).resolve().parents[1] / "structinit"


@pytest.fixture
def isolated(monkeypatch):
    """The registry as it is, restored after the test."""
    registry.load_families()
    monkeypatch.setattr(registry, "FAMILIES", dict(registry.FAMILIES))
    monkeypatch.setattr(layouts, "_ADDED", list(layouts._ADDED))


def test_the_builtin_families_are_the_families_stage_one_module_each():
    registry.load_families()
    modules = {Path(*name.split(".")[1:]).with_suffix(".py") for name in registry.BUILTIN_FAMILIES}
    assert all((PACKAGE / m).is_file() and m.parts[0] == "families" for m in modules)
    owners = [type(f).__module__ for f in registry.FAMILIES.values() if type(f).__module__.startswith("structinit.")]
    assert sorted(owners) == sorted(registry.BUILTIN_FAMILIES)  # each module registers one family
    assert list(registry.FAMILIES)[:6] == ["timm-vit", "structinit", "hf-vit", "hf-bert", "hf-gpt2", "torch-mha"]


def test_every_layout_row_names_a_registered_family():
    registry.load_families()
    assert all(row.family in registry.FAMILIES for row in LAYOUTS)
    assert registry.family_of_layout(LAYOUTS[0]) is registry.FAMILIES["timm-vit"]
    assert registry.family_of_layout(dataclasses.replace(LAYOUTS[0], family=None)) is GENERIC


def test_a_model_finds_its_family():
    import timm

    registry.load_families()
    assert registry.family_for_model(vit_digits()).name == "structinit"  # built by structinit: its own
    vit = timm.models.vision_transformer.VisionTransformer(img_size=8, patch_size=2, in_chans=1, embed_dim=16,
                                                           depth=1, num_heads=2)
    assert registry.family_for_model(vit).name == "timm-vit"
    assert registry.model_grid(vit) == (4, 4) and registry.model_heads(vit) == 2
    assert registry.model_inputs(vit).shape == (1, 8, 8)
    enc = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(16, 2, batch_first=True), 2,
                                      enable_nested_tensor=False)
    assert registry.family_for_model(enc).name == "torch-mha"
    assert registry.family_for_model(torch.nn.Linear(2, 2)) is GENERIC


def test_a_layout_row_naming_no_registered_family_is_refused_and_the_table_is_kept(isolated):
    rows = layouts.layout_rows()
    orphan = dataclasses.replace(LAYOUTS[0], name="orphan-vit", family="no-such-family")
    with pytest.raises(StructinitError) as exc:
        register_layout(orphan)
    text = exc.value.render()
    assert "orphan-vit" in text and "'no-such-family'" in text and "not registered" in text and "timm-vit" in text
    assert layouts.layout_rows() == rows  # nothing was added: timm checkpoints still go to the timm family
    sd = {"blocks.0.attn.qkv.weight": torch.zeros(48, 16), "pos_embed": torch.zeros(1, 16, 16)}
    assert detect_layout(sd).layout.family == "timm-vit"
    with pytest.raises(StructinitError, match="already registered"):
        register_layout(LAYOUTS[0])


def test_a_family_whose_own_row_is_refused_is_not_left_registered(isolated):
    class Broken(ModelFamily):
        name = "broken"
        layouts = (Layout("broken", "a row of another family", r"^(?P<block>(?P<model>)x\.)w$", "w", "w", "w",
                          "b", "b", "b", "p", family="someone-else"),)

    with pytest.raises(StructinitError, match="someone-else"):
        register_family(Broken)
    assert "broken" not in registry.FAMILIES and layouts.layout_rows()[0].name != "broken"
    with pytest.raises(StructinitError, match="already registered"):
        register_family(type("Again", (ModelFamily,), {"name": "timm-vit"}))


def test_a_familys_rows_are_tried_before_the_builtin_table(isolated):
    row = Layout("mine", "an encoder's layers", r"^(?P<block>(?P<model>(?:.*\.)?)encoder\.layers\.(?P<layer>\d+)\.)"
                 r"self_attn\.in_proj_weight$", *(["self_attn.in_proj_weight"] * 3),
                 *(["self_attn.in_proj_bias"] * 3), "self_attn.out_proj.weight", family="mine")

    @register_family
    class Mine(ModelFamily):
        name = "mine"
        layouts = (row,)

    enc = torch.nn.Module()
    enc.encoder = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(16, 2, batch_first=True), 2,
                                              enable_nested_tensor=False)
    assert detect_layout(enc.state_dict()).layout.name == "mine"  # not torch-mha, which would match too
    assert isinstance(registry.family_for_model(enc), Mine)
