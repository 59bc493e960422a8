"""Fitted artifacts: the data fit's Q/K stored like a solve, under a key of everything the fit reads
(the plain solve, the weights up to the last fitted layer, the batch, the settings and version);
found again instead of fitted again; recomputed, never loaded, when damaged."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import digits_images, vit_digits

from structinit.errors import ArtifactError
from structinit.fit import artifact as fitted_artifact
from structinit.fit import identity
from structinit.init.initialize import initialize_model
from structinit.solver.artifact import read_artifact
from structinit.training.datasets import load_dataset

pytestmark = pytest.mark.usefixtures("one_torch_thread")
FIT = dict(data_fit=2)  # the fit is what test_data_fit and test_fit_v2 test; here its key and file


@pytest.fixture(scope="module")
def digits():
    return digits_images(16)


vit = vit_digits


def fitted_key(report):
    return report["data_fit"]["artifact"]["key"]


def test_the_same_fit_is_read_from_the_cache_and_writes_the_same_weights(digits, monkeypatch):
    a = vit()
    first = initialize_model(a, "impulse", data=digits, seed=0, **FIT)
    assert first["data_fit"]["artifact"]["cached"] is False
    path = Path(first["data_fit"]["artifact"]["path"])
    assert path.name == f"n64-d64-h4-f3-fit-{fitted_key(first)}.safetensors" and path.exists()

    def no_fit(*args, **kwargs):
        raise AssertionError("fitted again")

    monkeypatch.setattr(fitted_artifact, "run_fit", no_fit)
    b = vit()
    again = initialize_model(b, "impulse", data=digits, seed=0, **FIT)
    assert again["data_fit"]["artifact"] == {**first["data_fit"]["artifact"], "cached": True}
    assert again["data_fit"]["layers"] == first["data_fit"]["layers"]
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name
    art = read_artifact(path)
    ident = art.fit["identity"]
    assert ident["plain"] == first["artifact"]["key"] and ident["samples"] == 16 and ident["layers"] == [0, 1, 2, 3]
    assert ident["fit"]["data_fit"] == 2 and ident["fit"]["data_fit_version"] == 2 and ident["seed"] == 0
    assert art.q.shape == (4, 4, 64, 16) and art.offsets.shape == (4, 4, 2)
    assert ident["fit"] == {"data_fit": 2, "data_fit_mass": 0.6, "data_fit_l2": 1e-4, "data_fit_lr": 1e-2,
                            "data_fit_norm": 5.0, "data_fit_samples": 256, "data_fit_version": 2, "data_fit_batch": 0,
                            "self_weight": 0.0, "mimetic_vproj": True, "alpha2": 0.4, "beta2": 0.4,
                            "calibrated_to": 0.3}
    assert ident["weights"].startswith("sha256:") and len(ident["weights"]) == len("sha256:") + 64
    assert art.stats["measured_on"] == "the pseudo input (the fitted Q/K)" and art.stats["seconds"] > 0
    assert len(art.stats["layers"]) == 4


def test_the_fit_settings_identity_names_every_setting_by_its_parameter():
    from structinit.fit.settings import FitSettings

    s = FitSettings(steps=1, mass=0.2, l2=0.3, lr=0.4, norm=0.5, samples=6, version=1, batch=7, self_weight=0.8,
                    calibrated_to=0.9, writes={"mimetic_vproj": False})
    assert s.identity() == {"data_fit": 1, "data_fit_mass": 0.2, "data_fit_l2": 0.3, "data_fit_lr": 0.4,
                            "data_fit_norm": 0.5, "data_fit_samples": 6, "data_fit_version": 1, "data_fit_batch": 7,
                            "self_weight": 0.8, "mimetic_vproj": False, "calibrated_to": 0.9}


def test_the_key_follows_what_the_fit_reads_and_nothing_else(digits):
    base = fitted_key(initialize_model(vit(), "impulse", data=digits, seed=0, **FIT))

    def key_of(model=None, data=digits, seed=0, **params):
        return fitted_key(initialize_model(model or vit(), "impulse", data=data, seed=seed, **{**FIT, **params}))

    head = vit()
    with torch.no_grad():
        head.head.weight.add_(1.0)  # the classifier is never reached by the fit
        head.fc_norm.weight.add_(1.0)
    assert key_of(head) == base
    embed = vit()
    with torch.no_grad():
        embed.patch_embed.proj.weight.mul_(0.5)
    mlp = vit()
    with torch.no_grad():
        mlp.blocks[2].mlp.fc1.weight.mul_(0.5)
    others = {key_of(embed), key_of(mlp), key_of(data=digits[:15]), key_of(data=digits + 1e-3), key_of(seed=1),
              key_of(data_fit_version=1), key_of(data_fit=3), key_of(target_mass=0.4), key_of(mimetic_vproj=False)}
    assert base not in others and len(others) == 9


def test_only_the_layers_up_to_the_last_fitted_one_count(digits):
    """Fitting layers 0-1 reads nothing of blocks 2-3 but block 1's projection input."""
    base = fitted_key(initialize_model(vit(), "impulse", data=digits, seed=0, layers="0-1", **FIT))
    late = vit()
    with torch.no_grad():
        late.blocks[3].attn.qkv.weight.mul_(2.0)
        late.blocks[1].mlp.fc2.weight.mul_(2.0)  # after block 1's attention: not read either
    assert fitted_key(initialize_model(late, "impulse", data=digits, seed=0, layers="0-1", **FIT)) == base
    early = vit()
    with torch.no_grad():
        early.blocks[1].norm1.weight.mul_(2.0)
    assert fitted_key(initialize_model(early, "impulse", data=digits, seed=0, layers="0-1", **FIT)) != base


def test_a_damaged_fitted_artifact_is_fitted_again_never_loaded(digits):
    first = initialize_model(vit(), "impulse", data=digits, seed=0, **FIT)
    path = Path(first["data_fit"]["artifact"]["path"])
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ArtifactError):
        read_artifact(path)
    with pytest.warns(UserWarning, match="ignoring corrupt artifact"):
        again = initialize_model(vit(), "impulse", data=digits, seed=0, **FIT)
    assert again["data_fit"]["artifact"]["cached"] is False and read_artifact(path).key == fitted_key(first)


def test_a_fitted_artifact_whose_identity_was_edited_is_refused(digits, tmp_path):
    from safetensors.numpy import load, save

    first = initialize_model(vit(), "impulse", data=digits, seed=0, **FIT)
    path = Path(first["data_fit"]["artifact"]["path"])
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    meta = json.loads(raw[8:8 + n])["__metadata__"]
    fit = json.loads(meta["fit"])
    fit["identity"]["seed"] = 7  # claims another seed than the one its key hashes
    meta["fit"] = json.dumps(fit, sort_keys=True)
    bad = tmp_path / path.name
    bad.write_bytes(save(load(raw), metadata=meta))
    with pytest.raises(ArtifactError, match="does not match what it was fitted to"):
        read_artifact(bad)


def test_train_and_initialize_model_share_the_fit(tmp_path, digits):
    """train fits the run's first training inputs; the same model, seed and batch through
    initialize_model finds that fit in the cache."""
    from structinit.training.config import TrainConfig
    from structinit.training.loop import init_inputs, train

    config = TrainConfig(init="impulse", init_params={**FIT, "base": "model"}, train_size=64, epochs=1,
                         out=str(tmp_path / "r"), threads=1, seed=3)  # the model's own base, as initialize_model
    result = train(config)
    fit = result.init_report["data_fit"]
    assert fit["artifact"]["cached"] is False and fit["source"] == "digits: the run's first 64 training inputs"
    final = json.loads((tmp_path / "r" / "final.json").read_text())
    assert final["init_seconds"] >= fit["seconds"] > 0
    from structinit.training.datasets import split_train

    data = split_train(load_dataset("digits"), 64, 0, 3)
    model = vit(seed=3)
    again = initialize_model(model, "impulse", data=init_inputs(data.train, data.info), seed=3, **FIT)
    assert again["data_fit"]["artifact"] == {**fit["artifact"], "cached": True}


def test_a_tensor_digest_tells_dtype_shape_and_name_apart():
    import hashlib

    def digest(name, t):
        h = hashlib.sha256()
        identity.tensor_digest(h, name, t)
        return h.hexdigest()

    raw = torch.arange(8, dtype=torch.uint8)
    same = digest("x", raw)
    assert same == digest("x", raw.clone())
    assert digest("x", raw.view(torch.int8)) != same  # the same bytes, another dtype
    assert digest("x", raw.view(2, 4)) != same and digest("y", raw) != same
    # floating tensors are digested as float32: a float64 copy of the same values is the same input
    assert digest("x", torch.ones(3, dtype=torch.float64)) == digest("x", torch.ones(3))


def test_the_batch_digest_is_stable():
    # part of every fitted artifact's key: a change of its derivation orphans every cached fit
    # (a deliberate change bumps the fit's version and this value)
    x = torch.arange(6.0).view(2, 3)
    assert identity.batch_digest(x) == "sha256:d609b2041ec897a4e9323f951d4d0b1d975dfc9861b06a580b99c545fd4bcbbe"


def test_the_key_follows_the_models_own_tensors(digits):
    """The position embedding and class token are the model's own tensors, read by every layer: a
    model with the table at x2 (pe_scale=2), an edited embedding or another class token never loads
    the fit of the x1 model."""
    import timm

    def stock(cls=False):
        torch.manual_seed(0)
        return timm.create_model("vit_tiny_patch16_224", img_size=8, patch_size=1, in_chans=1, embed_dim=64, depth=2,
                                 num_heads=4, num_classes=10, class_token=cls, global_pool="token" if cls else "avg")

    x1 = fitted_key(initialize_model(stock(), "impulse", data=digits, **FIT))
    assert fitted_key(initialize_model(stock(), "impulse", data=digits, **FIT)) == x1
    assert fitted_key(initialize_model(stock(), "impulse", data=digits, pe_scale=2.0, **FIT)) != x1
    edited = stock()
    with torch.no_grad():
        edited.pos_embed[0, 5, 3] += 0.5  # written over by the table: the same fit
    assert fitted_key(initialize_model(edited, "impulse", data=digits, **FIT)) == x1
    own = stock()
    with torch.no_grad():
        own.pos_embed.mul_(18.0)
    a = fitted_key(initialize_model(own, "impulse", data=digits, fit_pe=True, **FIT))
    own = stock()
    with torch.no_grad():
        own.pos_embed.mul_(18.0)
        own.pos_embed[0, 5, 3] += 0.5  # the embedding the fit reads, edited
    assert fitted_key(initialize_model(own, "impulse", data=digits, fit_pe=True, **FIT)) != a
    cls = fitted_key(initialize_model(stock(cls=True), "impulse", data=digits, **FIT))
    other = stock(cls=True)
    with torch.no_grad():
        other.cls_token.add_(0.1)
    assert fitted_key(initialize_model(other, "impulse", data=digits, **FIT)) != cls


def test_inspect_of_a_weakly_structured_fit_says_so_as_the_init_did(cli):
    """The warning an init gives for a fit that left layers below 0.9 on its inputs (noise here), where
    a token's content fills the stream, is the one `structinit inspect` shows for that fitted
    artifact, in inspect's syntax; a structured fit gets none."""
    import warnings

    from conftest import vit_filling

    from structinit.cli.apply import ALIASES, apply
    from structinit.cli.common import CommandSyntax, declared_flags

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        weak = initialize_model(vit_filling(), "impulse", data_fit=1, data_fit_samples=16)  # one step: weak
    said = [w.message for w in caught if "the data fit left layer" in str(w.message)]
    assert len(said) == 1 and "on its noise inputs" in str(said[0])
    r = cli("inspect", weak["data_fit"]["artifact"]["path"])
    assert r.returncode == 0
    lines = [line for line in r.stderr.splitlines() if line.startswith("warning:")]
    # the remedies are the init's settings, written as `structinit apply` takes them
    assert len(lines) == 1 and lines[0] == "warning: " + said[0].render(
        CommandSyntax(declared_flags(apply), ALIASES))
    assert "try -p position_subspace=true (" in lines[0] and "; then real inputs (--data) (" in lines[0]
    strong = initialize_model(vit_digits(), "impulse", position_subspace=True, data_fit=100)
    assert min(row["hit_rate"] for row in strong["data_fit"]["layers"]) >= 0.9
    r = cli("inspect", strong["data_fit"]["artifact"]["path"])
    assert r.returncode == 0 and "warning:" not in r.stderr


# --------------------------------------------------------------------------- issue 45


def test_the_key_follows_what_the_model_computes_not_only_its_tensors(digits):
    """The same tensors in a model whose MLP activation is ReLU, or whose LayerNorm eps differs, give
    other layer inputs: another fit, never the cached one of the other model. A change after the last
    fitted layer, which the fit never runs, keeps the key."""
    base = initialize_model(vit(), "impulse", data=digits, seed=0, **FIT)

    def changed(change, **params):
        model = vit()
        change(model)
        rep = initialize_model(model, "impulse", data=digits, seed=0, **{**FIT, **params})
        return rep, read_artifact(rep["data_fit"]["artifact"]["path"])

    def relu(m):
        for block in m.blocks:
            block.mlp.act = torch.nn.ReLU()

    def eps(m):
        for block in m.blocks:
            block.norm1.eps = 1e-2

    base_q = read_artifact(base["data_fit"]["artifact"]["path"]).q
    for change in (relu, eps):
        rep, art = changed(change)
        assert rep["data_fit"]["artifact"]["cached"] is False, change.__name__
        assert fitted_key(rep) != fitted_key(base) and art.fit["identity"]["weights"] == read_artifact(
            base["data_fit"]["artifact"]["path"]).fit["identity"]["weights"], change.__name__  # the same tensors
        assert float(abs(art.q[1:] - base_q[1:]).max()) > 1e-3, change.__name__  # and another fit
    first = initialize_model(vit(), "impulse", data=digits, seed=0, layers="0-1", **FIT)

    def late(m):
        m.blocks[3].mlp.act = torch.nn.ReLU()
        m.blocks[2].norm1.eps = 1e-2

    assert fitted_key(changed(late, layers="0-1")[0]) == fitted_key(first)


def test_without_data_the_fit_runs_on_the_noise_of_its_seed_and_sample_count():
    """Issue 45, behaviours 1 and 2: the noise is drawn with the init's seed (seed 1 never fits on
    seed 0's noise) and as many inputs as data_fit_samples asks (16, not the default 256). The fit on
    noise is the fit on that very batch given as data."""
    from structinit.fit.inputs import noise_inputs

    def fit(seed, **params):
        rep = initialize_model(vit(), "impulse", seed=seed, data_fit=4, **params)
        return rep, read_artifact(rep["data_fit"]["artifact"]["path"])

    rep, noise = fit(1, data_fit_samples=16)
    assert noise.fit["identity"]["inputs"] == {"kind": "noise", "seed": 1, "samples": 16, "shape": [1, 8, 8]}
    assert rep["data_fit"]["samples"] == 16 and rep["data_fit"]["inputs"] == "noise"
    drawn = {s: noise_inputs((1, 8, 8), 16, s).x for s in (0, 1)}
    assert not torch.equal(drawn[0], drawn[1])
    _, given = fit(1, data=drawn[1])
    assert np.array_equal(noise.q, given.q) and np.array_equal(noise.k, given.k)
    _, other_seed = fit(1, data=drawn[0])
    _, more = fit(1, data=noise_inputs((1, 8, 8), 256, 1).x)
    assert not np.allclose(noise.q, other_seed.q) and not np.allclose(noise.q, more.q)


def test_a_fitted_artifact_without_its_header_checksum_is_refused_even_with_its_report_edited(digits):
    """Issue 45, behaviour 3: a fitted artifact must carry its header checksum (only a plain solve of
    0.2 may lack it); one without it whose fit report was edited is refused and fitted again."""
    from safetensors.numpy import load, save

    first = initialize_model(vit(), "impulse", data=digits, seed=0, **FIT)
    path = Path(first["data_fit"]["artifact"]["path"])
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    meta = json.loads(raw[8:8 + n])["__metadata__"]
    fit = json.loads(meta.pop("header_checksum") and meta["fit"])
    fit["report"]["layers"][0]["hit_rate"] = 1.0  # a better number than the fit measured
    meta["fit"] = json.dumps(fit, sort_keys=True)
    path.write_bytes(save(load(raw), metadata=meta))
    with pytest.raises(ArtifactError, match="header checksum mismatch"):
        read_artifact(path)
    with pytest.warns(UserWarning, match="header checksum mismatch"):
        again = initialize_model(vit(), "impulse", data=digits, seed=0, **FIT)
    assert again["data_fit"]["artifact"]["cached"] is False
    assert again["data_fit"]["layers"][0]["hit_rate"] == first["data_fit"]["layers"][0]["hit_rate"] < 1.0


def test_another_seeds_fit_under_this_fits_name_is_set_aside_and_fitted_again(digits, cache_dir):
    """Issue 45, behaviour 4: a whole, valid fitted artifact of another fit (seed 1) copied to this
    fit's name (seed 0) holds another key: named, set aside (kept) and fitted again, never loaded."""
    zero = initialize_model(vit(), "impulse", data=digits, seed=0, **FIT)
    one = initialize_model(vit(), "impulse", data=digits, seed=1, **FIT)
    path, other = (Path(r["data_fit"]["artifact"]["path"]) for r in (zero, one))
    assert path != other
    path.write_bytes(other.read_bytes())
    with pytest.warns(UserWarning) as seen:
        again = initialize_model(vit(), "impulse", data=digits, seed=0, **FIT)
    said = [str(w.message) for w in seen.list if "ignoring" in str(w.message)]
    assert said == [f"ignoring unusable artifact: {path}: holds the fitted artifact {fitted_key(one)}, not the fitted "
                    f"artifact {fitted_key(zero)} its name asks for; set aside as {path.name}.set-aside; it will be "
                    "recomputed"]
    assert again["data_fit"]["artifact"] == {**zero["data_fit"]["artifact"], "cached": False}
    assert read_artifact(path).key == fitted_key(zero)
    assert read_artifact(Path(f"{path}.set-aside")).key == fitted_key(one)


def test_the_seed_is_in_the_fit_key_seed_1_never_reads_seed_0s_fit(digits, cache_dir, tmp_path):
    """Issue 54, case 25: seed 1 fitted after seed 0 in the same cache writes the Q/K that seed 1
    fitted in an empty cache (not seed 0's, read back under seed 1's name): checked by the weights.
    Both fit from the same given plain solve, so only the seed in the fit's key keeps them apart."""
    from structinit.init.attention_target import AttentionTarget
    from structinit.init.inject import read_qk

    def qk(model):
        t = AttentionTarget(model)
        return [read_qk(t.sd, slot, t.heads) for slot in t.slots]

    solved = initialize_model(vit(), "impulse", seed=0, data_fit=0)["artifact"]["path"]
    # one plain solve given to both seeds; minibatches of 8 of the 16 inputs, drawn by the seed
    how = dict(FIT, artifact=solved, data_fit_batch=8)
    zero, one, alone = vit(), vit(), vit()
    first = initialize_model(zero, "impulse", data=digits, seed=0, **how)
    report = initialize_model(one, "impulse", data=digits, seed=1, **how)
    assert report["artifact"]["key"] == first["artifact"]["key"]  # the same plain solve: only the fit key tells
    initialize_model(alone, "impulse", data=digits, seed=1, cache_dir=tmp_path / "empty", **how)
    for (q1, k1), (qa, ka), (q0, _) in zip(qk(one), qk(alone), qk(zero)):
        assert torch.equal(q1, qa) and torch.equal(k1, ka)
        assert not torch.equal(q1, q0)
