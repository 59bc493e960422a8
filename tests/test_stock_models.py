"""The impulse init on a stock timm ViT (a learnable position embedding drawn from a truncated
normal of std 0.02, with or without a class token): the plain call brings position with it; the fit
on noise inputs needs no data; the model's own embedding can be scaled and solved for; and a fit
that leaves a layer weakly structured says so."""

import warnings

import pytest
import torch

from structinit.analysis.fidelity import data_attention_quality
from structinit.errors import StructinitWarning, UsageError
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
    with pytest.raises(UsageError, match="is not the sin-cos table the impulse solve assumes"):
        initialize(stock().state_dict(), "impulse", heads=4)


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
    with pytest.raises(UsageError, match="data_fit_inputs chooses the data fit's inputs, and data_fit is 0"):
        initialize_model(stock(), "impulse", data_fit_inputs="noise", data_fit=0)
    with pytest.raises(UsageError, match="must be one of data, noise, got 'images'"):
        initialize_model(stock(), "impulse", data_fit_inputs="images")


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
def test_a_fit_that_leaves_a_layer_below_0_9_says_which_and_what_to_try(digits, cli, tmp_path):
    with pytest.warns(StructinitWarning) as seen:
        initialize_model(stock(), "impulse", data=digits[0][:16], data_fit=1, seed=0)
    text = str(seen.list[-1].message)
    assert "of the rows on the batch" in text and "try the position subspace (position_subspace=true" in text
    assert "more steps (data_fit=1000)" in text
    assert text.startswith("impulse: the data fit left layer ")
    # Last in the list: the position signal at twice the scale written (x1 by the plain call, so x2) ...
    assert text.endswith("or a stronger position signal (pe_scale=2: the sin-cos table x2; compare on validation)")
    with pytest.warns(StructinitWarning) as seen:
        initialize_model(stock(), "impulse", data=digits[0][:16], data_fit=1, pe_scale=2.0, seed=0)
    assert "(pe_scale=4: the sin-cos table x4; compare on validation)" in str(seen.list[-1].message)
    # ... and none where the embedding is the model's own (fit_pe): pe_scale would replace it.
    with pytest.warns(StructinitWarning) as seen:
        initialize_model(stock(), "impulse", data=digits[0][:16], data_fit=1, fit_pe=True, pe_factor=18.0, seed=0)
    text = str(seen.list[-1].message)
    assert "the data fit left layer" in text and "pe_scale" not in text and text.endswith(") or more inputs")
    r = cli("train", "--model", "vit-digits", "--pos-embed", "learned", "--init", "impulse", "--init-param",
            "data_fit=1", "--train-size", "32", "--batch-size", "16", "--epochs", "1", "--warmup-epochs", "0",
            "--out", tmp_path / "r")
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("warning:")]
    assert len(lines) == 1 and "the data fit left layer" in lines[0]
    # train has no --pe-scale flag: pe_scale is an --init-param key there
    assert "(pe_scale=2: the sin-cos table x2; compare on validation)" in lines[0]


def test_the_structure_warning_names_the_worst_layer_and_puts_the_position_hint_last():
    from structinit.errors import StructinitError
    from structinit.fit.advice import structure_warning
    from structinit.init.impulse import position_hint

    def report(*hits):
        return {"data_fit": {"layers": [{"layer": i, "hit_rate": h} for i, h in enumerate(hits)]}}

    assert structure_warning(report(0.9, 0.95, 0.99), "anything") is None  # at the floor is structured
    assert structure_warning({"data_fit": None}) is None and structure_warning({}) is None
    assert structure_warning(report(None, 0.95)) is None  # a layer without a measure is not weak
    def plain(message):  # parameter names are marked in library messages; str() of an error writes them plainly
        return StructinitError(message).render()

    sub = ("the position subspace (position_subspace=true: the position table in directions nothing else writes, "
           "which structures every layer where a token's content fills the stream), ")
    one = plain(structure_warning(report(0.95, 0.899)))
    assert one == ("the data fit left layer 1 hitting its offsets in 0.90 of the rows on the batch: the init is only "
                   f"partly structured; try {sub}more steps (data_fit=1000), a sharper fit target (data_fit_mass=0.8) "
                   "or more inputs")
    many = plain(structure_warning(report(0.8, 0.5, 0.7, 0.95), position_hint(None, checkpoint=False)))
    assert many == ("the data fit left layer 1 hitting its offsets in 0.50 of the rows on the batch (3 layers below "
                    f"0.9; per layer 0.80 0.50 0.70 0.95): the init is only partly structured; try {sub}more steps "
                    "(data_fit=1000), a sharper fit target (data_fit_mass=0.8), more inputs or a stronger position "
                    "signal (pe_scale=2: the sin-cos table x2; compare on validation)")
    # a fit on noise is warned about too, and what the user already gave is not advised again
    noisy = report(0.59, 0.26)
    noisy["data_fit"].update(inputs="noise", steps=1000, mass=0.8)
    assert plain(structure_warning(noisy)) == (
        "the data fit left layer 1 hitting its offsets in 0.26 of the rows on its noise inputs (2 layers below 0.9; "
        f"per layer 0.59 0.26): the init is only partly structured; try {sub[:-2]} or real inputs (data)")
    noisy["position_subspace"] = {"dims": 48}
    assert plain(structure_warning(noisy)).endswith("the init is only partly structured; try real inputs (data)")
    two = plain(structure_warning(report(0.6, 0.5)))
    assert "offsets in 0.50 of the rows on the batch (2 layers below 0.9; per layer 0.60 0.50): " in two
    assert plain(position_hint(3.0, checkpoint=False)) == "pe_scale=6: the sin-cos table x6"
    assert plain(position_hint(None, checkpoint=True)) == "set_pe=sincos with pe_scale=2"
    assert plain(position_hint(0.5, checkpoint=True)) == "set_pe=sincos with pe_scale=1"
    # the names are marked parameters: the CLI writes its own flags in their place
    flagged = StructinitError(position_hint(1.5, checkpoint=True)).render(lambda n: "--" + n.replace("_", "-"))
    assert flagged == "--set-pe=sincos with --pe-scale=3"
    assert StructinitError(structure_warning(report(0.1))).render(lambda n: f"<{n}>").count("<data_fit") == 2
