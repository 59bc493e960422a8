"""Mixed init: two registered methods in one model, split by depth (``split_layer``) and by head
(``split_head``); which layers and heads got which weights, the refusals naming their parameter,
the run keys, and the paths through ``initialize_model``, ``structinit train``, ``structinit
apply`` and a grid's ``init_params``."""

import json
import warnings

import pytest
import torch
from conftest import error_line

from structinit.errors import StructinitWarning, UsageError
from structinit.init.initialize import initialize, initialize_model
from structinit.init.registry import INIT_METHODS, init_spec, parse_init

DIM, HEADS, DEPTH = 48, 4, 4
D = DIM // HEADS
#: The plain solve: the fastest impulse (the data fit's own tests are elsewhere).
PLAIN = {"data_fit": 0}


def vit(seed=0, depth=DEPTH):
    import timm

    from structinit.init.pos_embed import set_sincos_pos_embed

    torch.manual_seed(seed)
    model = timm.create_model("vit_tiny_patch16_224", img_size=28, in_chans=1, patch_size=7, embed_dim=DIM,
                              depth=depth, num_heads=HEADS, class_token=False, global_pool="avg", num_classes=10,
                              mlp_ratio=2)
    set_sincos_pos_embed(model)
    return model


def state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def rendered(fn, *args, **kwargs):
    with pytest.raises(UsageError) as exc:
        fn(*args, **kwargs)
    return exc.value.render(lambda n: f"<{n}>")


def attn(sd, i, what="qkv.weight"):
    return sd[f"blocks.{i}.attn.{what}"]


def quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StructinitWarning)
        return fn(*args, **kwargs)


def test_depth_split_gives_the_lower_layers_the_lower_method_and_the_rest_the_upper(tmp_path):
    """split_layer 3: layers 0-2 exactly as impulse writes them alone on those layers, layer 3 as
    mimetic alone on it; every weight outside the attention untouched."""
    before = state(vit())
    mixed = vit()
    report = quiet(initialize_model, mixed, "mixed", lower_params=PLAIN, split_layer=3, seed=5, cache_dir=tmp_path)
    low, up = vit(), vit()
    quiet(initialize, low, "impulse", layers=[0, 1, 2], seed=5, cache_dir=tmp_path, **PLAIN)
    initialize(up, "mimetic", layers=[3], seed=5)
    got, want_low, want_up = state(mixed), state(low), state(up)
    for i in range(3):
        for what in ("qkv.weight", "qkv.bias", "proj.weight"):
            assert torch.equal(attn(got, i, what), attn(want_low, i, what)), (i, what)
    for what in ("qkv.weight", "qkv.bias", "proj.weight"):
        assert torch.equal(attn(got, 3, what), attn(want_up, 3, what))
    for what in ("qkv.weight", "proj.weight"):
        assert not torch.equal(attn(got, 3, what), attn(before, 3, what))
        assert not torch.equal(attn(got, 2, what), attn(want_up, 2, what))
    assert torch.equal(got["blocks.3.mlp.fc1.weight"], before["blocks.3.mlp.fc1.weight"])
    assert [(r["layer"], r["method"]) for r in report["layers"]] == [(0, "impulse"), (1, "impulse"), (2, "impulse"),
                                                                     (3, "mimetic")]
    assert report["split_layer"] == 3 and report["split_head"] is None
    assert report["lower"]["method"] == "impulse" and [r["layer"] for r in report["lower"]["layers"]] == [0, 1, 2]
    assert report["upper"]["method"] == "mimetic" and [r["layer"] for r in report["upper"]["layers"]] == [3]
    assert set(report["changed"]) >= {"blocks.0.attn.qkv.weight", "blocks.3.attn.proj.weight"}
    assert not any("mlp" in k for k in report["changed"])


def test_the_default_split_is_half_the_depth_and_conditioned_above_keeps_the_model_projection(tmp_path):
    before = state(vit())
    model = vit()
    report = quiet(initialize_model, model, "mixed", lower_params=PLAIN, upper="conditioned", seed=1,
                   cache_dir=tmp_path)
    assert report["split_layer"] == DEPTH // 2
    sd = state(model)
    for i in (2, 3):  # conditioned: V the identity, the output projection the model's own
        assert torch.equal(attn(sd, i)[2 * DIM:], torch.eye(DIM))
        assert torch.equal(attn(sd, i, "proj.weight"), attn(before, i, "proj.weight"))
    for i in (0, 1):  # impulse with mimetic V/proj
        assert not torch.equal(attn(sd, i, "proj.weight"), attn(before, i, "proj.weight"))


def test_head_split_keeps_the_lower_heads_and_takes_the_upper_heads_qk_rows(tmp_path):
    """split_head 1 (every layer, the default with a head split): in each layer the q and k rows of
    head 0 are impulse's, those of heads 1-3 mimetic's; V, the output projection and the biases of
    head 0 are impulse's."""
    mixed = vit()
    report = quiet(initialize_model, mixed, "mixed", lower_params=PLAIN, split_head=1, seed=2, cache_dir=tmp_path)
    low, up = vit(), vit()
    quiet(initialize_model, low, "impulse", seed=2, cache_dir=tmp_path, **PLAIN)
    initialize_model(up, "mimetic", seed=2)
    got, want_low, want_up = state(mixed), state(low), state(up)
    for i in range(DEPTH):
        w, wl, wu = attn(got, i), attn(want_low, i), attn(want_up, i)
        for block in (0, DIM):  # q, then k
            assert torch.equal(w[block:block + D], wl[block:block + D])
            assert torch.equal(w[block + D:block + DIM], wu[block + D:block + DIM])
            assert not torch.equal(w[block + D:block + DIM], wl[block + D:block + DIM])
        assert torch.equal(w[2 * DIM:], wl[2 * DIM:])  # V
        assert torch.equal(attn(got, i, "proj.weight"), attn(want_low, i, "proj.weight"))
    assert report["split_layer"] == DEPTH and report["split_head"] == 1
    row = report["layers"][0]
    assert row["method"] == "mixed" and row["heads_lower"] == [0]
    assert f"blocks.0.attn.qkv.weight[{D}:{DIM}]" in row["replaced"]


def test_the_position_subspace_below_is_written_in_every_layer_and_mimetic_above(tmp_path):
    """The impulse init with position_subspace writes every layer (the subspace is kept out of all
    their writes); the upper layers then get mimetic's Q/K and V/proj."""
    model = vit()
    report = quiet(initialize_model, model, "mixed", lower_params={"position_subspace": True, **PLAIN},
                   split_layer=1, seed=0, cache_dir=tmp_path)
    assert [r["layer"] for r in report["lower"]["layers"]] == [0, 1, 2, 3]
    assert "position_subspace" in report["lower"]
    up = vit()
    initialize(up, "mimetic", layers=[1, 2, 3], seed=0)
    for i in (1, 2, 3):
        assert torch.equal(attn(state(model), i), attn(state(up), i))
    assert [r["method"] for r in report["layers"]] == ["impulse", "mimetic", "mimetic", "mimetic"]


def test_bad_parameters_are_refused_by_name(tmp_path):
    assert rendered(init_spec, "mixed", split_layer=0) == "mixed parameter <split_layer> must be positive, got 0"
    assert rendered(init_spec, "mixed", split_head=-1) == "mixed parameter <split_head> must be positive, got -1"
    said = rendered(init_spec, "mixed", lower="nope")
    assert said.startswith("mixed parameter <lower> must be an init method") and "'nope'" in said
    listed = said.split("(")[1].split(")")[0].split(", ")
    assert listed == [n for n, c in INIT_METHODS.items() if n != "mixed" and not c.needs_model]  # each one it takes
    assert "impulse-2024" not in listed
    assert rendered(init_spec, "mixed", upper="mixed") == "mixed parameter <upper> cannot be mixed (it is this method)"
    assert rendered(init_spec, "mixed", lower="impulse-2025") == ("mixed parameter <lower> cannot be impulse-2025 "
                                                                  "(it resets the whole model, not selected layers)")
    assert rendered(init_spec, "mixed", lower_params={"filters": 3}).startswith(
        "mixed parameter <lower_params>: init method 'impulse' has no parameter filters")
    assert rendered(init_spec, "mixed", upper_params={"base": "pytorch"}) == (
        "mixed parameter <upper_params>: the upper part starts from the weights the lower one leaves, so its base "
        "must be model, got pytorch")
    assert rendered(parse_init, "mixed", ["split_layer=two"]) == ("mixed parameter <split_layer> must be an integer, "
                                                                  "got 'two'")
    refusals = {
        "split_layer": ({"split_layer": DEPTH}, "mixed parameter <split_layer> must be 1 to 3 (the model has 4 "
                                                "layers), got 4: either part would write nothing"),
        "split_head": ({"split_head": HEADS}, "mixed parameter <split_head> must be 1 to 3 (the model has 4 heads), "
                                              "got 4: the upper heads would be none"),
    }
    for name, (params, words) in refusals.items():
        model = vit()
        before = state(model)
        assert rendered(initialize_model, model, "mixed", lower="mimetic", **params) == words, name
        assert all(torch.equal(before[k], v) for k, v in state(model).items())  # nothing written
    assert rendered(initialize, vit(), "mixed", lower="mimetic", layers=[2, 3]) == (
        "mixed: the selected <layers> [2, 3] leave the lower part nothing to write (split_layer 2)")
    with pytest.raises(UsageError):
        init_spec("mixed").check_shape((4, 4), DIM, HEADS, 1)  # one layer: no split


def test_the_run_key_is_the_canonical_split_and_parts():
    """Part parameters at their defaults are left out, so two spellings of one init share a key;
    another split, part or part parameter is another key."""
    a = init_spec("mixed", lower_params={"filter": 3, "data_fit_inputs": "noise"}, split_layer=2)
    b = init_spec("mixed", lower_params={"data_fit_inputs": "noise"}, split_layer=2)
    assert a.canonical_json() == b.canonical_json()
    assert a.to_dict()["params"]["lower_params"] == {"data_fit_inputs": "noise"}
    keys = {init_spec("mixed", **p).canonical_json() for p in
            ({}, {"split_layer": 1}, {"split_head": 2}, {"upper": "conditioned"}, {"upper_params": {"alpha1": 0.5}})}
    assert len(keys) == 5
    parts = init_spec("mixed", lower="mimetic", upper="impulse").algorithms()
    assert parts == {f"upper {k}": v for k, v in init_spec("impulse").to_dict().get("algorithms", {}).items()}
    assert init_spec("mixed").with_fit_samples(8).parts[0].data_fit_samples == 8
    assert not init_spec("mixed").without_fit().uses_data


def test_structinit_train_runs_it(cli, tmp_path):
    out = tmp_path / "run"
    r = cli("train", "--model", "vit-digits", "--dataset", "digits", "--init", "mixed", "-p", "upper=conditioned",
            "-p", 'lower_params={"data_fit": 0}', "--epochs", "1", "--train-size", "64", "--patch", "2", "--depth", "2",
            "--dim", "32", "--heads", "2", "--batch-size", "32", "--out", out, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads((out / "config.json").read_text())
    assert doc["config"]["init"] == "mixed"
    assert [row["method"] for row in doc["init_report"]["layers"]] == ["impulse", "conditioned"]


def test_structinit_apply_writes_it_into_a_checkpoint(cli, tmp_path):
    from structinit.init.checkpoints import load_checkpoint

    torch.save(vit().state_dict(), tmp_path / "vit.pth")
    r = cli("apply", tmp_path / "vit.pth", "--heads", str(HEADS), "--method", "mixed", "-p", "lower=mimetic",
            "-p", "upper=conditioned", "-p", "split_layer=3", "--seed", "3", "--out", tmp_path / "out.pth", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["method"] == "mixed"
    model = vit()
    initialize_model(model, "mixed", lower="mimetic", upper="conditioned", split_layer=3, seed=3)
    written = load_checkpoint(tmp_path / "out.pth").state_dicts[0][1]
    for key in ("blocks.0.attn.qkv.weight", "blocks.3.attn.qkv.weight", "blocks.2.attn.proj.weight"):
        assert torch.equal(torch.as_tensor(written[key]), model.state_dict()[key])
    refused = cli("apply", tmp_path / "vit.pth", "--heads", str(HEADS), "--method", "mixed", "-p", "split_head=9",
                  "--out", tmp_path / "bad.pth")
    assert refused.returncode == 2 and not (tmp_path / "bad.pth").exists()
    assert error_line(refused.stderr) == ("error: mixed parameter split_head must be 1 to 3 (the model has 4 heads), "
                                          "got 9: the upper heads would be none")


def test_a_grid_row_names_it_with_its_parts():
    from pathlib import Path

    from structinit.experiments.gridspec import load_grid

    grid = load_grid(Path(__file__).resolve().parents[1] / "docs/results/conditioned/grid.toml")
    row = grid.row_axis.value("h2-subspace-heads").settings
    assert row["init"] == "mixed"
    spec = init_spec(row["init"], **row["init_params"])
    assert spec.split_head == 2 and spec.parts[0].position_subspace and spec.upper == "mimetic"


def test_a_parts_advice_is_written_through_its_params_in_each_callers_syntax():
    """Impulse's weak-structure advice from the lower part names ``lower_params`` (with what it
    already holds), as Python, the command line and a grid file write it; each form parses back."""
    import json
    import shlex

    from structinit.cli.common import CommandSyntax
    from structinit.errors import StructinitWarning
    from structinit.experiments import gridspec
    from structinit.experiments.task import GridSyntax
    from structinit.init.report import InitReport

    lower = {"method": "impulse", "dim": 192,
             "data_fit": {"inputs": "noise", "token_values": 768,
                          "layers": [{"layer": 0, "hit_rate": 0.45}, {"layer": 1, "hit_rate": 0.01}]}}
    report = InitReport.from_dict({"method": "mixed", "layers": [], "lower": lower, "upper": {"method": "mimetic"}})
    spec = init_spec("mixed", lower_params={"data_fit": 20})
    said = [w.text for w in spec.warnings(report, None, checkpoint=True)]
    assert len(said) == 1 and "for structure try" in said[0]
    message = StructinitWarning(said[0])
    python = message.render()
    assert "try lower_params={'data_fit': 20, 'position_subspace': True} (" in python
    line = message.render(CommandSyntax(["--init-param"])).split("for structure try ")[1].split(" (")[0]
    words = shlex.split(line)
    assert words[0] == "-p" and words[1].split("=", 1)[0] == "lower_params"
    assert json.loads(words[1].split("=", 1)[1]) == {"data_fit": 20, "position_subspace": True}
    grid = message.render(GridSyntax()).split("for structure try ")[1].split(" (")[0]
    assert gridspec.tomllib.loads(grid.replace("init_params.", "", 1)) == {
        "lower_params": {"data_fit": 20, "position_subspace": True}}
