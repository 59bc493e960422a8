"""``structinit apply CKPT --data DATASET``: the attention the written weights give on the run's own
real training inputs, through the model a train checkpoint describes; checked against the
pseudo-input quality where the two must agree, against an independent measure where they do not,
and refused with one line (nothing written) where it cannot be measured."""

import json

import pytest
import torch

from structinit.analysis.fidelity import data_attention_quality
from structinit.bench.attention import run_model, training_images
from structinit.geometry.grid import Grid
from structinit.training.config import TrainConfig
from structinit.training.loop import train

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A one-epoch digits run's checkpoint.pt (trunc normal init), and the same with the patch
    embedding and every block's output (attention proj, MLP fc2) zeroed and the attention's
    LayerNorm reset: there every layer sees the LayerNorm'd position embedding alone, the input the
    impulse solve is made for."""
    out = tmp_path_factory.mktemp("apply-data") / "run"
    train(TrainConfig(model="vit-digits", dataset="digits", init="trunc-normal", epochs=1, train_size=64,
                      batch_size=32, out=str(out), threads=1))
    ck = torch.load(out / "checkpoint.pt", weights_only=True)
    sd = ck["state_dict"]
    for name in list(sd):
        if name.startswith("patch_embed.proj.") or ".attn.proj." in name or ".mlp.fc2." in name:
            sd[name] = torch.zeros_like(sd[name])
        elif ".norm1." in name:  # the plain LayerNorm the solve assumes (one epoch moved it a little)
            sd[name] = torch.ones_like(sd[name]) if name.endswith("weight") else torch.zeros_like(sd[name])
    zeroed = out.parent / "zeroed.pt"
    torch.save(ck, zeroed)
    return out / "checkpoint.pt", zeroed


def test_on_position_alone_the_real_data_measure_is_the_pseudo_input_one(checkpoint, cli, tmp_path):
    _, zeroed = checkpoint
    r = cli("apply", zeroed, "--out", tmp_path / "imp.pt", "--no-mimetic-vproj", "--data", "digits",
            "--samples", "16", "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    got = rep["data_attention"]
    assert got["dataset"] == "digits" and got["samples"] == 16 and got["filter"] == 3
    for mine, solved in zip(got["layers"], rep["layers"]):
        assert mine["layer"] == solved["layer"]
        assert mine["hit_rate"] == pytest.approx(solved["hit_rate"], abs=1e-6)
        assert mine["target_mass"] == pytest.approx(solved["target_mass"], abs=1e-4)
    assert [row["hit_rate"] for row in got["layers"]] == pytest.approx([1.0] * 4)


def test_on_real_digits_it_matches_an_independent_measure_of_the_written_model(checkpoint, cli, tmp_path):
    ckpt, _ = checkpoint
    out = tmp_path / "imp.pt"
    r = cli("apply", ckpt, "--out", out, "--data", "digits", "--samples", "24", "--seed", "3", "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    model = run_model(out).model  # the written file, loaded over the model its settings describe
    config = TrainConfig.from_dict(torch.load(ckpt, weights_only=True)["args"])
    want = data_attention_quality(model, training_images(config, 24), [row["offsets"] for row in rep["layers"]],
                                  Grid(rep["grid"]))
    got = rep["data_attention"]["layers"]
    assert [g["hit_rate"] for g in got] == pytest.approx([w["hit_rate"] for w in want["layers"]], abs=1e-6)
    assert [g["target_mass"] for g in got] == pytest.approx([w["target_mass"] for w in want["layers"]], abs=1e-5)
    # the plain solve on real digits: the content embedding washes the structure out
    assert max(g["hit_rate"] for g in got) < 0.5
    text = cli("apply", ckpt, "--out", tmp_path / "imp2.pt", "--data", "digits", "--samples", "24", "--seed", "3")
    assert "attention of the written weights on the first 24 training inputs of digits:" in text.stdout
    assert f"{got[0]['hit_rate']:.3f}" in text.stdout


@pytest.mark.parametrize("args, message", [
    (("--data", "mnist1d"), "was trained on digits; --data mnist1d would feed it other inputs (give --data digits)"),
    (("--data", "digits", "--dry-run"), "--data measures the written weights, and --dry-run writes none"),
    (("--samples", "3"), "--samples and --data-dir need --data DATASET"),
    (("--data", "nope"), "unknown dataset 'nope'"),
])
def test_what_cannot_be_measured_is_refused_before_anything_is_written(checkpoint, cli, tmp_path, args, message):
    ckpt, _ = checkpoint
    r = cli("apply", ckpt, "--out", tmp_path / "o.pt", *args)
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_a_checkpoint_train_did_not_write_has_no_model_to_measure(checkpoint, cli, tmp_path):
    ckpt, _ = checkpoint
    bare = tmp_path / "bare.pt"
    torch.save(torch.load(ckpt, weights_only=True)["state_dict"], bare)
    r = cli("apply", bare, "--heads", "4", "--out", tmp_path / "o.pt", "--data", "digits")
    assert r.returncode == 2
    assert r.stderr.strip() == (f"error: --data: {bare} is not a checkpoint written by structinit train "
                                "(checkpoint.pt or best.pt, which hold the run's settings)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bare.pt"]
