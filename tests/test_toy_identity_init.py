"""The maintainer's test of the house (issue 53): a toy data-fitting init, ``identity-attention``
(``tests/toy_identity_init.py``), added as its module and this test, nothing else: it passes every
check a registered method passes and works through ``initialize_model``, ``apply --data``,
``train --init`` and ``inspect``."""

from __future__ import annotations

import importlib
import json

import pytest
import torch
from test_init_conformance import check_method, images, tiny_vit

from structinit import initialize_model
from structinit.init.base import REGISTERED


@pytest.fixture
def toy():
    """``tests/toy_identity_init.py`` imported (it registers ``identity-attention``), and taken out
    of the registry afterwards, so no other test sees it."""
    import toy_identity_init

    saved = dict(REGISTERED)
    REGISTERED.pop("identity-attention", None)
    module = importlib.reload(toy_identity_init)
    try:
        yield module
    finally:
        REGISTERED.clear()
        REGISTERED.update((k, v) for k, v in saved.items() if k != "identity-attention")


def first_layer_tokens(model, x):
    """What the first block's qkv reads on ``x``, from timm's own modules: ``[N, T, D]``."""
    with torch.no_grad():
        return model.blocks[0].norm1(model.norm_pre(model._pos_embed(model.patch_embed(x))))


def test_it_passes_every_check_a_registered_method_passes(toy, tmp_path):
    check_method(toy.IdentityAttentionInit, tmp_path)


@pytest.mark.parametrize("mass", [0.2, 0.35])
def test_its_written_qk_give_each_token_the_self_mass_asked(toy, mass):
    from structinit.init.attention_target import AttentionTarget
    from structinit.init.inject import read_qk

    model, x = tiny_vit(), images(16)
    tokens = first_layer_tokens(tiny_vit(), x)  # the model before its init: what the fit read
    report = initialize_model(model, "identity-attention", data=x, self_mass=mass)
    assert report.method == "identity-attention" and report.fit is not None and report.fit.samples == 16
    assert report.extra["self_mass_fitted"] == pytest.approx(mass, abs=1e-3)
    t = AttentionTarget(model)
    q, k = read_qk(t.sd, t.slots[0], t.heads)  # [heads, D, d]
    assert torch.equal(q, k)
    qh = torch.einsum("ntd,hde->nhte", tokens, q)
    attn = torch.softmax(qh @ qh.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
    assert float(attn.diagonal(dim1=-2, dim2=-1).mean()) == pytest.approx(mass, abs=0.01)
    white = torch.einsum("ntd,hde->nhte", tokens, q / report.extra["scale"]).transpose(1, 2).reshape(-1, t.dim)
    spread = torch.linalg.eigvalsh(torch.cov(white.T))  # whitened: 1 along every direction the tokens span
    rank = int((torch.linalg.eigvalsh(torch.cov(tokens.reshape(-1, t.dim).T)) > 1e-4).sum())
    assert rank > t.dim // 2 and torch.allclose(spread[-rank:], torch.ones(rank), atol=1e-3)


def test_a_mass_out_of_reach_is_refused_naming_it(toy):
    from structinit.errors import UsageError

    with pytest.raises(UsageError) as e:
        initialize_model(tiny_vit(), "identity-attention", data=images(16), self_mass=0.9)
    assert "self_mass" in str(e.value) and "out of reach" in str(e.value)


def test_apply_fits_it_to_the_inputs_given(toy, cli, tmp_path):
    torch.save(tiny_vit().state_dict(), tmp_path / "vit.pth")
    x = images(12)
    torch.save(x, tmp_path / "inputs.pt")
    r = cli("apply", tmp_path / "vit.pth", "--heads", "2", "--method", "identity-attention", "-p", "self_mass=0.3",
            "--data", tmp_path / "inputs.pt", "--out", tmp_path / "out.pth", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    own = initialize_model(tiny_vit(), "identity-attention", data=x, self_mass=0.3)
    assert report["method"] == "identity-attention" and report["data_fit"] == {"inputs": "data", "samples": 12}
    assert report["scale"] == pytest.approx(own.extra["scale"], rel=1e-5)
    assert report["self_mass_fitted"] == pytest.approx(0.3, abs=1e-3)


def test_train_fits_it_to_the_runs_training_inputs(toy, cli, tmp_path):
    out = tmp_path / "run"
    r = cli("train", "--model", "vit-digits", "--dataset", "digits", "--init", "identity-attention", "-p",
            "samples=24", "-p", "self_mass=0.1", "--epochs", "1", "--train-size", "64", "--patch", "2", "--depth",
            "1", "--dim", "32", "--heads", "2", "--batch-size", "32", "--out", out, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads((out / "config.json").read_text())
    assert doc["config"]["init"] == "identity-attention"
    assert doc["config"]["init_params"] == {"samples": 24, "self_mass": 0.1}
    assert doc["init_report"]["data_fit"] == {"inputs": "data", "samples": 24}
    assert doc["init_report"]["self_mass_fitted"] == pytest.approx(0.1, abs=1e-3)


def test_inspect_measures_it_on_real_inputs(toy, cli):
    r = cli("inspect", "vit-digits", "--data", "digits", "--init", "identity-attention", "-p", "self_mass=0.03",
            "--samples", "16", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["config"]["init"] == "identity-attention" and doc["config"]["init_params"] == {"self_mass": 0.03}
    rows = doc["fidelity"]["layers"]
    assert [row["layer"] for row in rows] == list(range(len(rows))) and len(rows) >= 2
    assert all(0 < row["window_mass"] <= 1 for row in rows)  # measured on the model it initialized
    assert "identity-attention" in " ".join(cli("inspect", "--help").stdout.split())
