"""The impulse init on a stock timm ViT (a learnable position embedding drawn from a truncated
normal of std 0.02, with or without a class token): the plain call brings position with it; the fit
on noise inputs needs no data; the model's own embedding can be scaled and solved for; and a fit
that leaves a layer weakly structured says so."""

import warnings

import pytest
import torch
from conftest import says

from structinit.analysis.fidelity import data_attention_quality
from structinit.errors import UsageError
from structinit.geometry.embedding import sincos
from structinit.geometry.grid import Grid
from structinit.init.initialize import initialize, initialize_model
from structinit.training.augment import normalize
from structinit.training.datasets import load_dataset, split_train
from structinit.training.models import ModelConfig, build_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def digits():
    data = split_train(load_dataset("digits"), None, 300, 0)
    info = data.info
    return normalize(data.train.images[:256], info.mean, info.std), normalize(data.val.images, info.mean, info.std)


def stock(pool="avg", seed=0):
    return build_model(ModelConfig("vit-digits", pos_embed="learned", pool=pool), num_classes=10, image_size=8,
                       in_chans=1, seed=seed)


@pytest.mark.slow
@pytest.mark.parametrize("pool", ["avg", "token"])
def test_the_plain_call_on_a_stock_model_writes_the_table_and_is_structured_on_held_out_digits(digits, pool):
    model = stock(pool)
    assert model.pos_embed.requires_grad and float(model.pos_embed.std()) < 0.05
    before = model.pos_embed.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a structured init is silent
        report = initialize_model(model, "impulse", data=digits[0], seed=0)
    assert report["pos_embed_written"] == "sin-cos table x1 in place of the model's own pos_embed, kept learnable"
    table = torch.from_numpy(sincos(Grid((8, 8)), 64)).float()
    rows = model.pos_embed.detach()[0, -64:]
    torch.testing.assert_close(rows, table, rtol=0, atol=1e-6)
    if pool == "token":  # the class token's own row is kept as it was
        assert torch.equal(model.pos_embed.detach()[0, 0], before[0, 0])
    assert model.pos_embed.requires_grad  # learnable, as it was
    rows = report["layers"]
    held = data_attention_quality(model, digits[1][:256], [r["offsets"] for r in rows], Grid((8, 8)))
    assert min(r["hit_rate"] for r in held["layers"]) >= 0.9


def test_the_table_in_place_of_a_learned_embedding_keeps_the_class_tokens_row(digits, tmp_path, cli):
    """Issue 45, behaviour 5 (only a slow test noticed the class token's row zeroed): the table goes
    into the grid's rows, and the class token's own row is kept as it was, on a model and through
    apply."""
    table = torch.from_numpy(sincos(Grid((8, 8)), 64)).float()
    model = stock("token")
    before = model.pos_embed.detach().clone()
    assert before.shape == (1, 65, 64) and float(before[0, 0].abs().sum()) > 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one fit step leaves the layers weak, and says so
        rep = initialize_model(model, "impulse", data=digits[0][:16], data_fit=1, data_fit_samples=16, seed=0)
    assert rep["pos_embed_written"] == "sin-cos table x1 in place of the model's own pos_embed, kept learnable"
    assert torch.equal(model.pos_embed.detach()[0, 0], before[0, 0])
    torch.testing.assert_close(model.pos_embed.detach()[0, 1:], table, rtol=0, atol=1e-6)
    torch.save(stock("token").state_dict(), tmp_path / "stock.pt")
    r = cli("apply", tmp_path / "stock.pt", "--heads", "4", "-p", "data_fit=1", "-p", "data_fit_samples=16", "--out",
            tmp_path / "out.pt")
    assert r.returncode == 0, r.stderr
    src, out = (torch.load(tmp_path / name)["pos_embed"] for name in ("stock.pt", "out.pt"))
    assert float(src[0, 0].abs().sum()) > 0 and torch.equal(out[0, 0], src[0, 0])
    torch.testing.assert_close(out[0, 1:], table, rtol=0, atol=1e-6)


def test_a_state_dict_with_a_learned_embedding_is_still_refused_without_an_answer(digits):
    with pytest.raises(UsageError) as err:
        initialize(stock().state_dict(), "impulse", heads=4)
    assert says(str(err.value), "not the sin-cos table", "fit_pe")


def test_the_fit_on_noise_needs_no_data_and_uses_only_the_shape_of_data_given(digits):
    a = initialize_model(build_model(ModelConfig("vit-digits"), num_classes=10, image_size=8, in_chans=1, seed=0),
                         "impulse", data_fit_inputs="noise", data_fit=3, seed=0)
    assert a["data_fit"]["source"] == "noise: 256 Gaussian inputs N(0, 1) of shape [1, 8, 8] (no data)"
    b_model = build_model(ModelConfig("vit-digits"), num_classes=10, image_size=8, in_chans=1, seed=0)
    b = initialize_model(b_model, "impulse", data_fit_inputs="noise", data_fit=3, seed=0, data=digits[0] * 0 + 5)
    assert b["data_fit"]["artifact"]["key"] == a["data_fit"]["artifact"]["key"]  # the same noise, the same fit
    c = initialize_model(build_model(ModelConfig("vit-digits"), num_classes=10, image_size=8, in_chans=1, seed=1),
                         "impulse", data_fit_inputs="noise", data_fit=3, seed=1)
    assert c["data_fit"]["artifact"]["key"] != a["data_fit"]["artifact"]["key"]
    with pytest.raises(UsageError) as err:
        initialize_model(stock(), "impulse", data_fit_inputs="noise", data_fit=0)
    assert says(str(err.value), "data_fit_inputs", "data_fit is 0")
    with pytest.raises(UsageError) as err:
        initialize_model(stock(), "impulse", data_fit_inputs="images")
    assert says(str(err.value), "data_fit_inputs", "data, noise", "'images'")


def test_the_models_own_embedding_scaled_and_solved_for(digits):
    model = stock()
    before = model.pos_embed.detach().clone()
    report = initialize_model(model, "impulse", fit_pe=True, pe_factor=18.0, data=digits[0], data_fit=10, seed=0)
    torch.testing.assert_close(model.pos_embed.detach(), before * 18)
    assert report["pos_embed_written"] == "the model's own pos_embed x18 (pe_factor)"
    assert report["artifact"]["config"]["pos_embed"].startswith("sha256:")  # solved for that embedding
    for params, message in (({"pe_factor": 18.0}, "pe_factor scales the target's own position embedding for fit_pe"),
                            ({"fit_pe": True, "pe_factor": 0.0}, "give fit_pe=true and a positive factor")):
        with pytest.raises(UsageError, match=message):
            initialize_model(stock(), "impulse", **params)


@pytest.mark.slow
def test_a_weak_fit_is_warned_about_in_trains_log_as_a_flag_where_content_fills_the_stream(digits, tmp_path, cli):
    """Fashion-MNIST in 7x7 patches into dim 48 (49 values a token: the stream is full): one fit step
    leaves the layers weak, and train's log says so once, advising the subspace as train takes it."""
    r = cli("train", "--model", "vit-fashion", "--dataset", "fashion-mnist", "--patch", "7", "--dim", "48",
            "--init", "impulse", "-p", "data_fit=1", "--train-size", "32", "--val-size", "0", "--batch-size", "16",
            "--epochs", "1", "--warmup-epochs", "0", "--out", tmp_path / "r")
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("warning:")]
    assert len(lines) == 1 and "the data fit left layer" in lines[0], r.stderr
    assert "for structure try -p position_subspace=true (" in lines[0]
    # a weak fit on digits (1 value a token) is the init that wins there: nothing is said
    quiet = cli("train", "--model", "vit-digits", "--pos-embed", "learned", "--init", "impulse", "-p", "data_fit=1",
                "--train-size", "32", "--batch-size", "16", "--epochs", "1", "--warmup-epochs", "0",
                "--out", tmp_path / "q")
    assert quiet.returncode == 0 and "warning:" not in quiet.stderr, quiet.stderr
