"""MNIST-1D and the sequence presets: the package's own dataset (plain and shuffled), the 1-D
transformer every init method applies to, the 1-D CNN, settings that do not fit sequences, and
training through ``structinit train``."""

import json

import numpy as np
import pytest
import torch
from conftest import says

from structinit.errors import UsageError
from structinit.geometry.embedding import sincos_1d
from structinit.geometry.grid import Grid
from structinit.training.config import TrainConfig
from structinit.training.datasets import load_dataset, mnist1d_arrays
from structinit.training.models import ModelConfig, build_model, count_parameters


@pytest.fixture(scope="module")
def plain():
    return load_dataset("mnist1d")


@pytest.fixture(scope="module")
def shuffled():
    return load_dataset("mnist1d", shuffle_seq=True)


@pytest.mark.slow
def test_mnist1d_is_the_packages_default_dataset(plain):
    assert plain.train.images.shape == (4000, 1, 40) and plain.test.images.shape == (1000, 1, 40)
    assert plain.train.images.dtype == torch.float32 and plain.train.labels.dtype == torch.int64
    assert plain.info.kind == "sequence" and plain.info.num_classes == 10
    raw = mnist1d_arrays()
    np.testing.assert_array_equal(plain.train.images[:, 0].numpy(), raw["x"].astype(np.float32))
    np.testing.assert_array_equal(plain.test.labels.numpy(), raw["y_test"])
    allx = torch.cat([plain.train.images, plain.test.images])
    assert abs(float(allx.mean())) < 0.01 and abs(float(allx.std()) - 1) < 0.01  # the package standardizes
    assert torch.bincount(plain.train.labels, minlength=10).min() > 350


@pytest.mark.slow
def test_mnist1d_leaves_global_random_state_alone():
    np.random.seed(7)
    want = np.random.rand(3)
    np.random.seed(7)
    mnist1d_arrays()
    assert (np.random.rand(3) == want).all()


@pytest.mark.slow
def test_shuffled_is_one_permutation_of_the_positions(plain, shuffled):
    a, b = plain.train.images[:, 0].numpy(), shuffled.train.images[:, 0].numpy()
    assert torch.equal(plain.train.labels, shuffled.train.labels)
    # Each shuffled column is exactly one plain column, the same for every sequence.
    perm = [int(np.argmin(np.abs(a - b[:, [j]]).sum(0))) for j in range(40)]
    assert sorted(perm) == list(range(40)) and perm != list(range(40))
    np.testing.assert_allclose(b, a[:, perm], atol=1e-6)
    np.testing.assert_allclose(shuffled.test.images[:, 0].numpy(), plain.test.images[:, 0].numpy()[:, perm],
                               atol=1e-6)


def transformer(**kw):
    return build_model(ModelConfig("transformer-1d", **kw), num_classes=10, image_size=40, in_chans=1, seed=0)


def test_transformer_1d_is_laid_out_for_the_init_methods():
    m = transformer()
    assert m(torch.zeros(3, 1, 40)).shape == (3, 10)
    assert m.patch_embed.grid_size == (40,) and m.structinit_arch["grid"] == [40]
    assert "blocks.3.attn.qkv.weight" in m.state_dict() and m.blocks[0].attn.num_heads == 4
    assert not m.pos_embed.requires_grad
    torch.testing.assert_close(m.pos_embed[0], torch.from_numpy(sincos_1d(40, 64)))
    dim, hidden, depth = 64, 128, 4
    block = 4 * dim + (3 * dim * dim + 3 * dim) + (dim * dim + dim) + (dim * hidden + hidden) + (hidden * dim + dim)
    want = (dim + dim) + 40 * dim + depth * block + 2 * dim + 10 * dim + 10
    assert count_parameters(m) == {"total": want, "trainable": want - 40 * dim}
    wide = transformer(window=5, dim=32, heads=2, depth=2)
    assert wide.patch_embed.proj.kernel_size == (5,) and wide(torch.zeros(1, 1, 40)).shape == (1, 10)


@pytest.mark.parametrize("method, params", [("impulse", {"filter": 5}), ("impulse", {"filter": 3, "causal": True}),
                                            ("mimetic", {}), ("kaiming", {}), ("trunc-normal", {})])
def test_every_init_method_applies_to_transformer_1d(method, params):
    from structinit.init.initialize import initialize_model

    m = transformer()
    before = m.blocks[0].attn.qkv.weight.detach().clone()
    rep = initialize_model(m, method, **params, **({"data_fit": 0} if method == "impulse" else {}))  # the solve's
    assert not torch.equal(before, m.blocks[0].attn.qkv.weight)
    if method == "impulse":
        assert rep["grid"] == [40] and rep["hit_rate"] > 0.95
        offs = np.array([r["offsets"] for r in rep["layers"]])
        lo, hi = (-(params["filter"] - 1), 0) if params.get("causal") else (-2, 2)
        assert (offs[..., 0] == 0).all() and offs[..., 1].min() >= lo and offs[..., 1].max() <= hi


@pytest.mark.slow
def test_impulse_attention_on_real_sequences_is_measured(plain):
    from structinit.analysis.fidelity import data_attention_quality
    from structinit.init.initialize import initialize_model

    m = transformer()
    rep = initialize_model(m, "impulse", data_fit=0, filter=5)
    x = plain.train.images[:64]
    real = data_attention_quality(m, x, [r["offsets"] for r in rep["layers"]], Grid(40))
    assert real["samples"] == 64 and len(real["layers"]) == 4
    assert 0 < real["hit_rate"] < 1 and 0 < real["target_mass"] < rep["target_mass"]  # content dilutes the impulse
    # With no content (zero input, zero embedding bias) layer 0 sees the pseudo input itself and attends as solved.
    with torch.no_grad():
        m.patch_embed.proj.bias.zero_()
    zero = data_attention_quality(m, torch.zeros(4, 1, 40), [rep["layers"][0]["offsets"]], Grid(40), layers=[0])
    assert zero["hit_rate"] == pytest.approx(rep["layers"][0]["hit_rate"], abs=1e-6)
    assert zero["target_mass"] == pytest.approx(rep["layers"][0]["target_mass"], abs=1e-4)


def test_cnn_1d():
    m = build_model(ModelConfig("cnn-1d"), num_classes=10, image_size=40, in_chans=1, seed=0)
    assert m(torch.zeros(2, 1, 40)).shape == (2, 10)
    dim, k = 64, 5
    conv_bn = (dim * k + dim + 2 * dim), (dim * dim * k + dim + 2 * dim)
    assert count_parameters(m)["total"] == conv_bn[0] + 3 * conv_bn[1] + dim * 10 + 10


@pytest.mark.parametrize("kwargs, message", [
    (dict(model="vit-digits", dataset="mnist1d"), "holds sequences"),
    (dict(model="transformer-1d", dataset="digits"), "holds images"),
    (dict(model="transformer-1d", dataset="mnist1d", augment="flip"), "image augmentation"),
    (dict(model="transformer-1d", dataset="mnist1d", patch=2), "patch applies to image models"),
    (dict(model="transformer-1d", dataset="mnist1d", window=4), "window must be odd"),
    (dict(model="vit-digits", dataset="digits", window=3), "window applies to transformer-1d"),
    (dict(model="vit-digits", dataset="digits", shuffle_seq=True), "shuffle_seq applies to sequence datasets"),
    (dict(model="cnn-1d", dataset="mnist1d", init="impulse"), "keeps its own init"),
    (dict(model="transformer-1d", dataset="mnist1d", pool="token"), "pools by averaging"),
    (dict(model="cnn-1d", dataset="mnist1d", heads=2), "do not apply to cnn-1d"),
])
def test_settings_that_do_not_fit_sequences(kwargs, message):
    with pytest.raises(UsageError, match=message):
        TrainConfig(**kwargs).validate()


def test_new_settings_keep_earlier_run_keys():
    base = TrainConfig()
    assert "window" not in base.computed_settings() and "shuffle_seq" not in base.computed_settings()
    seq = TrainConfig(model="transformer-1d", dataset="mnist1d")
    assert TrainConfig(model="transformer-1d", dataset="mnist1d", shuffle_seq=True).key != seq.key
    assert TrainConfig(model="transformer-1d", dataset="mnist1d", window=3).key != seq.key
    assert TrainConfig.from_dict(seq.to_dict()).key == seq.key


@pytest.mark.slow
def test_train_on_mnist1d_through_the_cli(tmp_path, cli):
    out = tmp_path / "run"
    r = cli("train", "--model", "transformer-1d", "--dataset", "mnist1d", "--init", "impulse", "-p", "filter=5", "-p",
            "mimetic_vproj=true", "--dim", "32", "--depth", "2", "--heads", "4", "--epochs", "3", "--val-size", "500",
            "--train-size", "1500", "--lr", "3e-3", "--threads", "1", "--out", out, "--json",
            env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["epochs"] == 3 and summary["final_acc"] > 20  # chance is 10%
    assert summary["best_epoch"]["selected_on"] == "val"
    config = json.loads((out / "config.json").read_text())
    assert config["resolved"]["model"]["grid"] == [40] and config["resolved"]["train_images"] == 1500
    real = config["init_report"]["data_attention"]
    assert real["samples"] == 256 and len(real["layers"]) == 2 and 0 < real["hit_rate"] <= 1
    assert "impulse attention at init on 256 training inputs" in r.stderr
    # The checkpoint tells apply/inspect its sequence grid and heads.
    plan = cli("apply", out / "checkpoint.pt", "--method", "mimetic", "--dry-run", "--json")
    assert plan.returncode == 0, plan.stderr
    plan = json.loads(plan.stdout)
    assert plan["grid"] == [40] and plan["heads"] == 4 and plan["layout"] == "timm-vit"
    desc = cli("inspect", out / "best.pt", "--json")
    assert desc.returncode == 0 and json.loads(desc.stdout)["grid"] == [40], desc.stderr
    cnn = cli("train", "--model", "cnn-1d", "--dataset", "mnist1d", "--shuffle-seq", "--epochs", "2", "--train-size",
              "1000", "--dim", "16", "--threads", "1", "--json", env={"OMP_NUM_THREADS": "1"})
    assert cnn.returncode == 0, cnn.stderr
    assert json.loads(cnn.stdout)["final_acc"] > 15


@pytest.mark.slow
def test_training_images_of_a_sequence_run_are_what_train_feeds(shuffled):
    """The inputs bench report --attention and inspect --data measure on: a sequence is used as
    stored (not normalized as an image) and a shuffled run's positions are shuffled."""
    from structinit.training.run_models import training_images

    got = training_images(TrainConfig(model="transformer-1d", dataset="mnist1d", shuffle_seq=True), 8)
    assert got.shape == (8, 1, 40)
    assert torch.equal(got, shuffled.train.images[:8])


@pytest.mark.parametrize("kwargs, parts", [
    (dict(model="vit-digits", dataset="mnist1d"), ("<dataset> mnist1d", "sequences", "<model> vit-digits",
                                                   "transformer-1d, cnn-1d")),
    (dict(model="transformer-1d", dataset="digits"), ("<dataset> digits", "images", "<model> transformer-1d",
                                                      "image model")),
    (dict(model="transformer-1d", dataset="mnist1d", augment="flip"), ("<augment> flip", "image augmentation",
                                                                       "mnist1d", "none")),
    (dict(model="vit-digits", dataset="digits", shuffle_seq=True), ("<shuffle_seq>", "sequence datasets", "digits")),
    (dict(model="vit-digits", dataset="digits", image_size=16), ("<image_size>", "imagefolder", "digits")),
    (dict(model="vit-digits", dataset="digits", data_dir="/tmp"), ("<data_dir>", "<download>", "digits",
                                                                  "needs no files")),
])
def test_settings_that_do_not_fit_the_data_are_refused_whole(kwargs, parts):
    """Each names the settings, marked (the CLI writes them as its flags), and why they do not fit."""
    with pytest.raises(UsageError) as e:
        TrainConfig(**kwargs).validate()
    assert says(e.value.render(lambda n: f"<{n}>"), *parts)
