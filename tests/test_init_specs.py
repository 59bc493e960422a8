"""Init specs as values: the NAME=VALUE parser, type coercion and its messages, the registry,
serialization, what each method plans to replace, and the entry points passing every argument on."""

import dataclasses
import math
from pathlib import Path
from typing import Dict, Optional

import pytest
import torch
from conftest import says

from structinit.errors import UsageError
from structinit.init.authors import Impulse2024Init, Impulse2025Init
from structinit.init.base import InitSpec, coerce, parse_value
from structinit.init.baselines import KaimingInit, TruncNormalInit
from structinit.init.conditioned import ConditionedInit
from structinit.init.impulse import ImpulseInit
from structinit.init.initialize import initialize, initialize_model
from structinit.init.layouts import detect_layout
from structinit.init.mimetic import MimeticInit
from structinit.init.mixed import MixedInit
from structinit.init.registry import (
    INIT_METHODS,
    init_spec,
    parse_assignments,
    parse_init,
    spec_class,
    spec_from_dict,
)
from structinit.solver.artifact import read_artifact


def rendered(fn, *args, **kwargs):
    with pytest.raises(UsageError) as exc:
        fn(*args, **kwargs)
    return exc.value.render(lambda n: f"<{n}>")


@pytest.mark.parametrize("text, value", [
    ("true", True), (" False ", False), ("TRUE", True), ("none", None), ("NULL", None), ("null", None),
    ("5", 5), ("-0.5", -0.5), ("1e-3", 1e-3), ("[1, 2]", [1, 2]), ('{"iters": 2000}', {"iters": 2000}),
    ("centre", "centre"), (" pe+gaussian ", "pe+gaussian"), ("", ""),
])
def test_parse_value(text, value):
    got = parse_value(text)
    assert got == value and type(got) is type(value)


def test_parse_assignments_and_their_errors():
    got = parse_assignments(["filter=5", "recipe-params={\"iters\": 20}", " share = true", "name=a=b"])
    assert got == {"filter": 5, "recipe_params": {"iters": 20}, "share": True, "name": "a=b"}
    assert says(rendered(parse_assignments, ["filter"]), "<init_params>", "NAME=VALUE", "'filter'")
    assert says(rendered(parse_assignments, ["=5"], what="recipe_params"), "<recipe_params>", "NAME=VALUE", "'=5'")
    assert parse_init("mimetic", ["alpha1=0.5", "vproj=false"]) == MimeticInit(alpha1=0.5, vproj=False)


def test_registry_and_spec_lookup():
    builtin = {"kaiming": KaimingInit, "trunc-normal": TruncNormalInit, "mimetic": MimeticInit,
               "impulse": ImpulseInit, "impulse-2024": Impulse2024Init, "impulse-2025": Impulse2025Init,
               "conditioned": ConditionedInit, "mixed": MixedInit}
    assert all(INIT_METHODS[name] is cls for name, cls in builtin.items())
    assert all(spec_class(name) is cls and cls.method == name for name, cls in INIT_METHODS.items())
    assert says(rendered(spec_class, "xavier"), "'xavier'", "<init>", ", ".join(INIT_METHODS))  # every one, in order


def test_init_spec_builds_copies_and_names_unknown_parameters():
    spec = init_spec("impulse", filter=5, **{"target-mass": 0.4})
    assert spec == ImpulseInit(filter=5, target_mass=0.4)
    assert init_spec(spec) is spec
    other = init_spec(spec, share=True)
    assert other == dataclasses.replace(spec, share=True) and spec.share is False
    takes = ", ".join(f.name for f in dataclasses.fields(ImpulseInit))
    assert says(rendered(init_spec, "impulse", filtr=3, bogus=1), "'impulse'", "no parameter", "<bogus>, <filtr>",
                takes)
    assert says(rendered(init_spec, "kaiming", std=1), "'kaiming'", "no parameter <std>", "no parameters")
    assert says(rendered(init_spec, MimeticInit(), beta3=1), "'mimetic'", "no parameter <beta3>", "alpha1")


@pytest.mark.parametrize("spec", [
    KaimingInit(), TruncNormalInit(std=0.05), MimeticInit(alpha1=0.1, beta2=0.9, vproj=False),
    ImpulseInit(filter=5, target_mass=0.6, share=True, offset_order="centre", padding="circular",
                pseudo_input="pe+uniform", pseudo_input_rest="gaussian", mimetic_vproj=True, pe_scale=2.0),
    ImpulseInit(recipe="paper", recipe_params={"iters": 50}),
    ImpulseInit(data_fit=300, data_fit_mass=0.5, data_fit_samples=64),
])
def test_specs_round_trip_through_their_dict_and_json(spec):
    d = spec.to_dict()
    params = spec.params()
    left_out = set(params) - set(d["params"])  # only parameters added later, and only at their defaults
    assert left_out <= set(type(spec).optional_defaults)
    assert all(params[k] == getattr(type(spec)(), k) for k in left_out)
    assert d == {"method": spec.method, "params": {k: v for k, v in params.items() if k not in left_out}}
    assert spec_from_dict(d) == spec
    import json

    assert spec.canonical_json() == json.dumps(d, sort_keys=True, separators=(",", ":"))
    assert " " not in spec.canonical_json().replace("pe+uniform", "")


def test_spec_from_dict_without_params_and_exact_json():
    assert spec_from_dict({"method": "kaiming"}) == KaimingInit()
    assert spec_from_dict({"method": "mimetic", "params": None}) == MimeticInit()
    assert KaimingInit().canonical_json() == '{"method":"kaiming","params":{}}'
    assert TruncNormalInit(std=0.05).canonical_json() == '{"method":"trunc-normal","params":{"std":0.05}}'
    assert MimeticInit().canonical_json() == ('{"method":"mimetic","params":{"alpha1":0.7,"alpha2":0.4,"beta1":0.7,'
                                              '"beta2":0.4,"vproj":true}}')


def test_params_are_copies():
    spec = ImpulseInit(recipe="paper", recipe_params={"iters": 50})
    p = spec.params()
    p["recipe_params"]["iters"] = 1
    assert spec.recipe_params == {"iters": 50}


@pytest.mark.parametrize("value, hint, want", [
    ("true", bool, True), (False, bool, False), ("3", int, 3), (3.0, int, 3), ("0.5", float, 0.5), (2, float, 2.0),
    (5, str, "5"), ("x", str, "x"), ('{"a": 1}', dict, {"a": 1}), ({"b": 2}, Dict[str, int], {"b": 2}),
    (None, Optional[float], None), ("2", Optional[int], 2), (1.5, Optional[float], 1.5),
])
def test_coerce_converts_to_the_declared_type(value, hint, want):
    got = coerce("m", "p", value, hint)
    assert got == want and type(got) is type(want)


@pytest.mark.parametrize("value, hint, what, shown", [
    (1, bool, "true or false", "1"), ("yes", bool, "true or false", "'yes'"), (3.5, int, "an integer", "3.5"),
    (True, int, "an integer", "True"), ("x", int, "an integer", "'x'"), ("abc", float, "a number", "'abc'"),
    (True, float, "a number", "True"), (math.inf, float, "a finite number", "inf"),
    (float("nan"), Optional[float], "a finite number", "nan"), (None, str, "a string", "None"),
    ([1], str, "a string", "[1]"), ({"a": 1}, str, "a string", "{'a': 1}"),
    (5, dict, 'a JSON object such as {"iters": 2000}', "5"), ("[1]", dict, "a JSON object such", "[1]"),
])
def test_coerce_refuses_by_name(value, hint, what, shown):
    assert says(rendered(coerce, "impulse", "pe_scale", value, hint), "impulse", "<pe_scale>", what, shown)


def test_check_positive_and_validation_messages():
    assert says(rendered(ImpulseInit, filter=0), "impulse", "<filter>", "positive", "got 0")
    # a spec's own fields are coerced under its method's name (not only coerce called directly)
    assert says(rendered(ImpulseInit, filter="three"), "impulse", "<filter>", "an integer", "'three'")
    assert says(rendered(MimeticInit, alpha1="big"), "mimetic", "<alpha1>", "a number", "'big'")
    assert says(rendered(ImpulseInit, pe_scale=-1.0), "impulse", "<pe_scale>", "positive", "-1.0")
    assert says(rendered(ImpulseInit, tolerance=-0.1), "impulse", "<tolerance>", "non-negative", "-0.1")
    assert ImpulseInit(tolerance=0.0).tolerance == 0.0 and ImpulseInit(pe_scale=None).pe_scale is None
    assert says(rendered(TruncNormalInit, std=0.0), "trunc-normal", "<std>", "positive", "0.0")
    assert says(rendered(ImpulseInit, recipe="closed-form", target_mass=0.3), "'closed-form'", "no parameter",
                "<target_mass>", "logit, noise_std, qk_scale")
    for name, value in (("padding", "reflect"), ("offset_order", "spiral"), ("pseudo_input", "noise"),
                        ("pseudo_input_rest", "noise"), ("recipe", "magic")):
        assert says(rendered(ImpulseInit, **{name: value}), "unknown", f"<{name}>", repr(value))
    assert ImpulseInit(artifact=Path("a/b.safetensors")).artifact == "a/b.safetensors"


def test_impulse_solve_config_carries_every_setting():
    spec = ImpulseInit(filter=5, target_mass=0.6, recipe_params={"ridge": 1e-3}, share=True, offset_order="centre",
                       padding="circular", pseudo_input="pe+uniform", pseudo_input_rest="gaussian")
    cfg = spec.solve_config((8, 8), 32, 4, 6, seed=9)
    assert (cfg.grid, cfg.dim, cfg.heads, cfg.filter, cfg.layers, cfg.share, cfg.recipe) == \
        ((8, 8), 32, 4, 5, 6, True, "fast")
    assert cfg.params == {"target_mass": 0.6, "ridge": 1e-3}
    assert (cfg.pseudo_input, cfg.pseudo_input_rest, cfg.padding, cfg.offset_order, cfg.seed) == \
        ("pe+uniform", "gaussian", "circular", "centre", 9)
    paper = ImpulseInit(recipe="paper", recipe_params={"iters": 7}).solve_config((4, 4), 16, 2, 1)
    assert paper.params == {"iters": 7, "lr": 1e-4} and paper.seed == 0 and paper.filter == 3


def test_impulse_params_name_an_artifact_object_by_path_or_key(tmp_path):
    from structinit.solver.config import SolveConfig
    from structinit.solver.run import solve

    art = solve(SolveConfig(grid=(4, 4), dim=16, heads=2), cache_dir=tmp_path).artifact
    assert ImpulseInit(artifact=art).params()["artifact"] == str(art.path)
    art.path = None
    assert ImpulseInit(artifact=art).params()["artifact"] == art.key
    assert ImpulseInit(artifact="abc").params()["artifact"] == "abc"


def _vit(depth=2):
    import timm

    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", img_size=8, patch_size=2, embed_dim=32, depth=depth, num_heads=4,
                             mlp_ratio=2.0, class_token=False, global_pool="avg", num_classes=3)


def test_planned_rows_of_each_method():
    slot = detect_layout(_vit(1).state_dict()).slots[0]
    qk = ["blocks.0.attn.qkv.weight[0:32]", "blocks.0.attn.qkv.weight[32:64]", "blocks.0.attn.qkv.bias[0:32]",
          "blocks.0.attn.qkv.bias[32:64]"]
    vproj = ["blocks.0.attn.qkv.weight[64:96]", "blocks.0.attn.proj.weight"]
    assert KaimingInit().planned(slot) == qk and TruncNormalInit().planned(slot) == qk
    assert MimeticInit().planned(slot) == qk + vproj and MimeticInit(vproj=False).planned(slot) == qk
    assert ImpulseInit().planned(slot) == qk + vproj and ImpulseInit(mimetic_vproj=False).planned(slot) == qk
    value = ["blocks.0.attn.qkv.weight[64:96]", "blocks.0.attn.qkv.bias[64:96]"]  # V and its bias; proj left alone
    assert ConditionedInit().planned(slot) == qk + value
    assert ImpulseInit(value_init="conditioned").planned(slot) == qk + value
    mha = torch.nn.MultiheadAttention(16, 2, bias=False)
    s = detect_layout(mha.state_dict()).slots[0]
    assert ImpulseInit(mimetic_vproj=False).planned(s) == ["in_proj_weight[0:16]", "in_proj_weight[16:32]"]
    assert ConditionedInit().planned(s) == ["in_proj_weight[0:16]", "in_proj_weight[16:32]", "in_proj_weight[32:48]"]
    with pytest.raises(NotImplementedError):
        InitSpec().apply(None)


def test_initialize_passes_grid_seed_layers_cache_dir_on(tmp_path):
    mha = torch.nn.MultiheadAttention(32, 4, batch_first=True).state_dict()
    assert "grid" in rendered(initialize, dict(mha), "impulse", heads=4)  # the state dict does not tell the grid
    rep = initialize(mha, "impulse", grid=(4, 8), heads=4, cache_dir=tmp_path / "c", seed=2, device="cpu")
    art = read_artifact(rep["artifact"]["path"])
    assert rep["grid"] == [4, 8] and art.config.grid == (4, 8) and art.config.seed == 2
    assert art.path.parent == tmp_path / "c"
    mim = initialize(torch.nn.MultiheadAttention(32, 4).state_dict(), "mimetic", heads=4)  # no grid needed
    assert mim["method"] == "mimetic"
    a, b, c = _vit().state_dict(), _vit().state_dict(), _vit().state_dict()
    initialize(a, "mimetic", heads=4)
    initialize(b, "mimetic", heads=4, seed=0)
    initialize(c, "mimetic", heads=4, seed=1, layers="1")
    assert torch.equal(a["blocks.1.attn.qkv.weight"], b["blocks.1.attn.qkv.weight"])  # seed 0 is the default
    assert not torch.equal(a["blocks.1.attn.qkv.weight"], c["blocks.1.attn.qkv.weight"])
    assert torch.equal(c["blocks.0.attn.qkv.weight"], _vit().state_dict()["blocks.0.attn.qkv.weight"])


def test_initialize_model_passes_grid_and_seed_on():
    m1, m2, m3 = _vit(), _vit(), _vit()
    initialize_model(m1, "mimetic", seed=4)
    initialize_model(m2, "mimetic", seed=4)
    initialize_model(m3, MimeticInit())
    assert torch.equal(m1.blocks[0].attn.qkv.weight, m2.blocks[0].attn.qkv.weight)
    assert not torch.equal(m1.blocks[0].attn.qkv.weight, m3.blocks[0].attn.qkv.weight)
    # the grid given wins over the model's; pe_scale writes the sin-cos table the solve assumes
    rep = initialize_model(_vit(), "impulse", grid=(2, 8), filter=1, pe_scale=1.0, data_fit=0)  # the solve's grid
    assert rep["grid"] == [2, 8] and rep["artifact"]["config"]["grid"] == [2, 8]
    assert says(rendered(initialize_model, {"a": 1}, "mimetic"), "nn.Module", "initialize()", "state dict")


def test_params_copy_list_and_dict_parameters():
    from dataclasses import field
    from typing import List

    @dataclasses.dataclass(frozen=True)
    class WithContainers(InitSpec):
        method = "with-containers"
        layers: List[int] = field(default_factory=lambda: [1, 2])
        extra: Dict[str, int] = field(default_factory=dict)

    spec = WithContainers(layers=[3], extra={"a": 1})
    p = spec.params()
    assert p == {"layers": [3], "extra": {"a": 1}}
    p["layers"].append(4)
    p["extra"]["b"] = 2
    assert spec.layers == [3] and spec.extra == {"a": 1}


@pytest.mark.parametrize("spec", [KaimingInit(), TruncNormalInit(), MimeticInit()])
def test_spec_apply_defaults_to_seed_zero_like_initialize(spec):
    from structinit.init.attention_target import AttentionTarget

    a, b = _vit().state_dict(), _vit().state_dict()
    spec.apply(AttentionTarget(a, heads=4))
    initialize(b, spec, heads=4, seed=0)
    assert all(torch.equal(a[k], b[k]) for k in a)
    m1, m2 = _vit(), _vit()
    spec.apply(AttentionTarget(m1))
    initialize_model(m2, spec, seed=0)
    assert all(torch.equal(x, y) for x, y in zip(m1.state_dict().values(), m2.state_dict().values()))
