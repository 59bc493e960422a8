"""A new model family is its adapter module and its test (docs/architecture.md, "Model families"):
tests/toy_family.py, a plain ``torch.nn.TransformerEncoder`` over feature vectors, registered by
importing it (here, or through the entry-point group ``structinit.families`` in a real process),
works through ``structinit apply --data`` and ``inspect`` with no edit to structinit; unregistered,
the same checkpoint is a bare ``nn.MultiheadAttention`` one that ``apply --data`` refuses."""

import importlib
import json
import sys
import textwrap

import pytest
import torch
from conftest import REPO, error_line

from structinit.init import family as registry
from structinit.init import layouts

FEATURES = torch.Size([12, 6])  # one input: 12 tokens of 6 features


@pytest.fixture
def toy(monkeypatch):
    """tests/toy_family.py imported (which registers it), unregistered again after the test."""
    registry.load_families()
    monkeypatch.setattr(registry, "FAMILIES", dict(registry.FAMILIES))
    monkeypatch.setattr(layouts, "_ADDED", list(layouts._ADDED))
    sys.modules.pop("toy_family", None)
    module = importlib.import_module("toy_family")
    yield module
    sys.modules.pop("toy_family", None)


def _files(module, tmp_path):
    torch.manual_seed(0)
    model = module.ToyEncoder()
    ckpt, feats = tmp_path / "toy.pt", tmp_path / "feats.pt"
    torch.save({"model": model.state_dict(), module.HEADS_KEY: 2}, ckpt)
    torch.save(torch.randn(64, *FEATURES), feats)
    return model, ckpt, feats


def test_the_toy_family_fits_through_apply_and_inspect_as_initialize_model_does(toy, tmp_path, cli):
    from structinit import initialize_model

    model, ckpt, feats = _files(toy, tmp_path)
    r = cli("apply", ckpt, "--data", feats, "--out", tmp_path / "out.pt", "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert (rep["layout"], rep["heads"], rep["grid"], rep["model"]) == ("toy-encoder", 2, [12],
                                                                        "toy encoder (depth 2, heads 2)")
    fit = rep["data_fit"]
    assert fit["inputs"] == "data" and fit["samples"] == 64 and fit["streamed"] and fit["token_values"] == 6
    assert fit["hit_rate"] > 0.85 and abs(fit["target_mass"] - 0.3) < 0.01  # fitted to an impulse, calibrated
    assert rep["changed"]["model"] == [f"encoder.layers.{i}.self_attn.{t}" for i in (0, 1)
                                       for t in ("in_proj_weight", "out_proj.weight")]
    # the same init as initialize_model gives the model itself, through the same adapter
    initialize_model(model, "impulse", data=torch.load(feats))
    written = torch.load(tmp_path / "out.pt")["model"]
    for key, value in model.state_dict().items():
        torch.testing.assert_close(written[key], value, rtol=1e-5, atol=1e-6, msg=key)
    # inspect measures the attention through the adapter: an impulse after the init, spread before
    after = json.loads(cli("inspect", tmp_path / "out.pt", "--json").stdout)["on_inputs"]
    before = json.loads(cli("inspect", ckpt, "--json").stdout)["on_inputs"]
    assert after["inputs"].startswith("64 Gaussian noise inputs N(0, 1) of shape [12, 6]")
    assert after["hit_rate"] > 0.85 and abs(after["target_mass"] - 0.3) < 0.05
    assert before["hit_rate"] < 0.2 and before["target_mass"] < 0.15


def test_inputs_of_another_shape_are_refused_as_the_family_tells_it(toy, tmp_path, cli):
    _, ckpt, _ = _files(toy, tmp_path)
    torch.save(torch.randn(8, 12, 5), tmp_path / "bad.pt")
    r = cli("apply", ckpt, "--data", tmp_path / "bad.pt", "--out", tmp_path / "o.pt")
    assert r.returncode == 2
    assert "has inputs of shape [12, 5]; the model takes [12, 6]" in error_line(r.stderr)
    r = cli("apply", ckpt, "--data", tmp_path, "--out", tmp_path / "o.pt")  # a folder: of images
    assert "the checkpoint's model takes feature vectors" in error_line(r.stderr)


def test_unregistered_the_toy_checkpoint_is_a_bare_multihead_attention_one(toy, monkeypatch, tmp_path, cli):
    monkeypatch.setattr(registry, "FAMILIES", {k: v for k, v in registry.FAMILIES.items() if k != "toy-encoder"})
    monkeypatch.setattr(layouts, "_ADDED", [row for row in layouts._ADDED if row.family != "toy-encoder"])
    torch.manual_seed(0)
    ToyEncoder = toy.ToyEncoder
    torch.save({"model": ToyEncoder().state_dict()}, tmp_path / "toy.pt")
    torch.save(torch.randn(8, *FEATURES), tmp_path / "feats.pt")
    r = cli("apply", tmp_path / "toy.pt", "--data", tmp_path / "feats.pt", "--heads", "2", "--grid", "12",
            "--out", tmp_path / "o.pt")
    assert r.returncode == 2
    assert "cannot build the model of a torch-mha checkpoint" in error_line(r.stderr)


DIST = textwrap.dedent("""
    Metadata-Version: 2.1
    Name: toy-family
    Version: 0.1
""").lstrip()


@pytest.mark.slow  # a fresh interpreter: the registry loads the entry points on its first lookup
def test_the_toy_family_of_another_installed_package_works_in_a_real_process(tmp_path, cli_process):
    site = tmp_path / "site"
    info = site / "toy_family-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(DIST)
    (info / "entry_points.txt").write_text(f"[{registry.ENTRY_POINT_GROUP}]\ntoy = toy_family\n")
    env = {"PYTHONPATH": f"{site}:{REPO / 'tests'}:{REPO}"}
    script = ("import torch, toy_family; torch.manual_seed(0); "
              f"torch.save({{'model': toy_family.ToyEncoder().state_dict(), 'toy_heads': 2}}, '{tmp_path}/toy.pt'); "
              f"torch.save(torch.randn(32, 12, 6), '{tmp_path}/feats.pt')")
    import subprocess

    subprocess.run([sys.executable, "-c", script], check=True, env={**__import__("os").environ, **env})
    r = cli_process("apply", tmp_path / "toy.pt", "--data", tmp_path / "feats.pt", "--out", tmp_path / "o.pt",
                    "--json", env=env)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["layout"] == "toy-encoder" and rep["data_fit"]["inputs"] == "data"
    assert rep["data_fit"]["hit_rate"] > 0.85
    # a family plugin that fails to load is one warning line; the others (the toy's too) still work
    broken = site / "broken_family-0.1.dist-info"
    broken.mkdir()
    (broken / "METADATA").write_text(DIST.replace("toy-family", "broken-family"))
    (broken / "entry_points.txt").write_text(f"[{registry.ENTRY_POINT_GROUP}]\nbroken = broken_family\n")
    (site / "broken_family.py").write_text("raise ImportError('no such thing')\n")
    r = cli_process("apply", tmp_path / "toy.pt", "--data", tmp_path / "feats.pt", "--out", tmp_path / "o2.pt",
                    env=env)
    assert r.returncode == 0, r.stderr
    assert "family plugin broken (broken_family) was not loaded: ImportError: no such thing" in r.stderr
