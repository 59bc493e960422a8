"""The data-aware impulse fit (impulse ``data_fit``): Q/K refined on real digits' layer inputs keep
the solved offsets on real data, where the pseudo-input solve does not; its parts (target
distribution, refinement, calibration) do what their docstrings say; bad settings are refused."""

import math
import warnings

import numpy as np
import pytest
import torch
from conftest import digits_images, says, vit_digits

from structinit.analysis.capture import attention_inputs
from structinit.analysis.fidelity import data_attention_quality
from structinit.errors import StructinitError, UsageError
from structinit.fit.refine import MAX_LOGIT, calibrate_on_batch, fit_loss, refine_qk, target_distribution
from structinit.geometry.grid import Grid
from structinit.geometry.targets import causal_mask, impulse_columns
from structinit.init.impulse import ImpulseInit
from structinit.init.initialize import initialize, initialize_model
from structinit.init.inject import read_qk
from structinit.init.registry import init_spec
from structinit.training.config import TrainConfig
from structinit.training.datasets import load_dataset
from structinit.training.models import ModelConfig, build_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def digits():
    return digits_images(64), digits_images(64, "test")  # to fit on, and held out


vit = vit_digits


def real_quality(model, report, x):
    rows = report["layers"]
    return data_attention_quality(model, x, [r["offsets"] for r in rows], Grid(report["grid"]),
                                  layers=[r["layer"] for r in rows])


@pytest.mark.slow
def test_data_fit_keeps_the_offsets_on_real_digits_where_the_pseudo_input_solve_does_not(digits):
    fit, held_out = digits
    plain, fitted = vit(), vit()
    r_plain = initialize_model(plain, "impulse", seed=0, data_fit=0)
    r_fit = initialize_model(fitted, "impulse", seed=0, data=fit, data_fit=80, data_fit_samples=48)
    assert r_plain["data_fit"] is None
    before = real_quality(plain, r_plain, held_out)
    after = real_quality(fitted, r_fit, held_out)  # images the fit never saw
    assert [r["offsets"] for r in r_fit["layers"]] == [r["offsets"] for r in r_plain["layers"]]
    assert max(r["hit_rate"] for r in before["layers"]) < 0.35
    assert min(r["hit_rate"] for r in after["layers"]) > 0.8
    # the report's own measure is on the fitted batch, calibrated to the target mass
    assert r_fit["data_fit"]["samples"] == 48
    assert r_fit["data_fit"]["calibrated_to"] == pytest.approx(0.3)
    for row in r_fit["data_fit"]["layers"]:
        assert row["target_mass"] == pytest.approx(0.3, abs=0.01)


def test_data_fit_refines_layers_in_order_on_what_the_earlier_layers_give(digits):
    """Layer l is fitted on the inputs produced by the already refined layers 0..l-1: refitting
    layer 1 alone on the final model's layer-1 input changes nothing (version 1, the whole batch
    every step; version 2 is replayed in tests/test_fit_v2.py)."""
    fit, _ = digits
    model = vit(seed=1)
    report = initialize_model(model, "impulse", seed=1, data=fit, data_fit=12, data_fit_samples=32,
                              data_fit_version=1)
    sd = model.state_dict()
    from structinit.init.layouts import detect_layout

    slot = detect_layout(sd).slots[1]
    q0, k0 = read_qk(sd, slot, 4)
    x = attention_inputs(model, fit[:32])[1]
    cols = torch.from_numpy(impulse_columns(Grid((8, 8)), np.asarray(report["layers"][1]["offsets"]))).long()
    # the same refinement from the same start (the artifact's layer 1) on the same input gives the same weights
    from structinit.solver.cache import resolve_artifact

    art = resolve_artifact(report["artifact"]["path"])
    q, k = refine_qk(x, torch.from_numpy(art.q[1]), torch.from_numpy(art.k[1]), cols, steps=12, mass=0.6, l2=1e-4,
                     lr=1e-2, norm=5.0)
    q, k = calibrate_on_batch(x, q, k, cols, 0.3)
    assert torch.allclose(q @ k.transpose(-1, -2), q0 @ k0.transpose(-1, -2), atol=1e-4)


def test_target_distribution_puts_the_mass_on_the_offset_and_spreads_the_rest():
    grid = Grid((3, 3))
    cols = torch.from_numpy(impulse_columns(grid, np.array([[0, 1], [1, 1]]))).long()
    t = target_distribution(cols, 0.6)
    assert t.shape == (2, 9, 9)
    for h in range(2):
        for i in range(9):
            if cols[h, i] < 0:
                assert t[h, i].sum() == 0
            else:
                assert t[h, i].sum() == pytest.approx(1.0)
                assert t[h, i, cols[h, i]] == pytest.approx(0.6)
                others = [t[h, i, j] for j in range(9) if j != cols[h, i]]
                assert all(o == pytest.approx(0.4 / 8) for o in others)
    seq = Grid((5,))
    mask = torch.from_numpy(causal_mask(seq, True))
    cols = torch.from_numpy(impulse_columns(seq, np.array([[0, -1]]))).long()
    t = target_distribution(cols, 0.5, mask)
    assert torch.all(t[0][~mask] == 0)
    assert t[0, 2].tolist() == pytest.approx([0.25, 0.5, 0.25, 0, 0])


@pytest.mark.parametrize("grid, offsets, causal", [((3, 3), [[0, 1], [1, 1]], False), ((6,), [[0, -1], [0, 0]], True)])
def test_the_fit_loss_is_the_cross_entropy_against_the_target_distribution(grid, offsets, causal):
    g = torch.Generator().manual_seed(3)
    grid = Grid(grid)
    n = grid.tokens
    x, q, k = torch.randn(5, n, 8, generator=g), torch.randn(2, 8, 4, generator=g), torch.randn(2, 8, 4, generator=g)
    cols = torch.from_numpy(impulse_columns(grid, np.array(offsets))).long()
    mask = torch.from_numpy(causal_mask(grid, True)) if causal else None
    logits = torch.einsum("bnD,hDd->bhnd", x, q) @ torch.einsum("bnD,hDd->bhnd", x, k).transpose(-1, -2) / 2.0
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    logp = torch.log_softmax(logits, -1).nan_to_num(neginf=0.0)
    t = target_distribution(cols, 0.7, mask)
    rows = (cols >= 0).float()
    want = -((t[None] * logp).sum(-1) * rows[None]).sum() / (rows.sum() * 5)
    assert float(fit_loss(x, q, k, cols, 0.7, mask)) == pytest.approx(float(want), rel=1e-5)


def test_refinement_starts_at_the_given_norm_and_lowers_the_loss(digits):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 9, 12, generator=g)
    q, k = torch.randn(3, 12, 4, generator=g), torch.randn(3, 12, 4, generator=g)
    cols = torch.from_numpy(impulse_columns(Grid((3, 3)), np.array([[0, 1], [1, 0], [0, 0]]))).long()
    q0, k0 = refine_qk(x, q, k, cols, steps=0, mass=0.6, l2=0.0, lr=1e-2, norm=2.5)
    assert q0.norm(dim=(-2, -1)).tolist() == pytest.approx([2.5] * 3)
    assert k0.norm(dim=(-2, -1)).tolist() == pytest.approx([2.5] * 3)

    def mass(q_, k_):
        p = torch.softmax(torch.einsum("bnD,hDd->bhnd", x, q_) @ torch.einsum("bnD,hDd->bhnd", x, k_).transpose(-1, -2)
                          / 2.0, -1)
        has = cols >= 0
        return float(p.gather(-1, cols.clamp(min=0)[None, :, :, None].expand(8, -1, -1, 1)).squeeze(-1)[:, has].mean())

    q1, k1 = refine_qk(x, q, k, cols, steps=80, mass=0.6, l2=0.0, lr=1e-1, norm=2.5)
    assert mass(q1, k1) > mass(q0, k0) + 0.2
    # the penalty keeps the weights small
    q2, k2 = refine_qk(x, q, k, cols, steps=80, mass=0.6, l2=1.0, lr=1e-1, norm=2.5)
    assert q2.norm() < q1.norm() and k2.norm() < k1.norm()


def test_calibration_reaches_the_mass_or_stops_at_the_logit_cap():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 9, 12, generator=g)
    cols = torch.from_numpy(impulse_columns(Grid((3, 3)), np.array([[0, 1], [1, 0]]))).long()
    q, k = refine_qk(x, torch.randn(2, 12, 4, generator=g), torch.randn(2, 12, 4, generator=g), cols, steps=100,
                     mass=0.9, l2=0.0, lr=1e-1, norm=1.0)
    for want in (0.2, 0.5):
        qc, kc = calibrate_on_batch(x, q, k, cols, want)
        p = torch.softmax(torch.einsum("bnD,hDd->bhnd", x, qc) @ torch.einsum("bnD,hDd->bhnd", x, kc).transpose(-1, -2)
                          / 2.0, -1)
        got = p.gather(-1, cols.clamp(min=0)[None, :, :, None].expand(4, -1, -1, 1)).squeeze(-1)
        for h in range(2):
            assert float(got[:, h][:, cols[h] >= 0].mean()) == pytest.approx(want, abs=1e-3)
    # an unreachable mass stops at the cap: the largest logit is MAX_LOGIT
    qc, kc = calibrate_on_batch(x, q, k, cols, 0.999999)
    logits = torch.einsum("bnD,hDd->bhnd", x, qc) @ torch.einsum("bnD,hDd->bhnd", x, kc).transpose(-1, -2) / 2.0
    assert logits.abs().amax(dim=(0, 2, 3)).tolist() == pytest.approx([MAX_LOGIT] * 2, rel=1e-3)


def test_refinement_is_adam_on_the_documented_objective_under_a_causal_mask():
    """Three steps of refine_qk equal three Adam steps, written out here, on the mean cross-entropy
    plus ``l2 * (|Q|^2 + |K|^2) / heads`` (heads, not the model dim), under the causal mask, from Q/K
    rescaled to ``norm`` (also from a start whose norm is below 1)."""
    g = torch.Generator().manual_seed(5)
    grid = Grid((6,))
    x = torch.randn(4, 6, 8, generator=g)
    q, k = 0.05 * torch.randn(2, 8, 4, generator=g), 0.05 * torch.randn(2, 8, 4, generator=g)
    assert float(q[0].norm()) < 1
    cols = torch.from_numpy(impulse_columns(grid, np.array([[0, -1], [0, -2]]))).long()
    mask = torch.from_numpy(causal_mask(grid, True))
    got_q, got_k = refine_qk(x, q, k, cols, steps=3, mass=0.6, l2=0.3, lr=0.05, norm=1.7, mask=mask)
    wq = (q * (1.7 / q.norm(dim=(-2, -1), keepdim=True))).requires_grad_(True)
    wk = (k * (1.7 / k.norm(dim=(-2, -1), keepdim=True))).requires_grad_(True)
    opt = torch.optim.Adam([wq, wk], lr=0.05)
    for _ in range(3):
        loss = fit_loss(x, wq, wk, cols, 0.6, mask) + 0.3 * ((wq ** 2).sum() + (wk ** 2).sum()) / 2
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert torch.allclose(got_q, wq.detach(), atol=1e-6) and torch.allclose(got_k, wk.detach(), atol=1e-6)
    # every query aiming at the first token is still a target to fit (column 0 is a token)
    first = torch.zeros(2, 6, dtype=torch.long)
    start_q, _ = refine_qk(x, q, k, first, steps=0, mass=0.6, l2=0.0, lr=0.05, norm=1.7)
    moved_q, _ = refine_qk(x, q, k, first, steps=2, mass=0.6, l2=0.0, lr=0.05, norm=1.7)
    assert not torch.allclose(moved_q, start_q)


def test_calibration_counts_every_target_under_a_causal_mask_and_caps_small_logits():
    g = torch.Generator().manual_seed(2)
    grid = Grid((7,))
    x = torch.randn(3, 7, 12, generator=g)
    cols = torch.from_numpy(impulse_columns(grid, np.array([[0, 0], [0, -1]]))).long()  # head 0: itself (column 0 too)
    mask = torch.from_numpy(causal_mask(grid, True))
    q, k = refine_qk(x, torch.randn(2, 12, 4, generator=g), torch.randn(2, 12, 4, generator=g), cols, steps=100,
                     mass=0.9, l2=0.0, lr=1e-1, norm=1.0, mask=mask)

    def target_mass(q_, k_):
        logits = torch.einsum("bnD,hDd->bhnd", x, q_) @ torch.einsum("bnD,hDd->bhnd", x, k_).transpose(-1, -2) / 2.0
        p = torch.softmax(logits.masked_fill(~mask, float("-inf")), -1)
        got = p.gather(-1, cols.clamp(min=0)[None, :, :, None].expand(3, -1, -1, 1)).squeeze(-1)
        return [float(got[:, h][:, cols[h] >= 0].mean()) for h in range(2)]

    qc, kc = calibrate_on_batch(x, q, k, cols, 0.45, mask)
    assert target_mass(qc, kc) == pytest.approx([0.45, 0.45], abs=1e-3)
    # weights whose logits are all below 1 still reach the cap when the mass is out of reach
    tiny_q, tiny_k = 1e-3 * q, 1e-3 * k
    qc, kc = calibrate_on_batch(x, tiny_q, tiny_k, cols, 0.999999, mask)
    logits = torch.einsum("bnD,hDd->bhnd", x, qc) @ torch.einsum("bnD,hDd->bhnd", x, kc).transpose(-1, -2) / 2.0
    assert logits.abs().amax(dim=(0, 2, 3)).tolist() == pytest.approx([MAX_LOGIT] * 2, rel=1e-3)


@pytest.mark.parametrize("params, cause", [
    ({"data_fit": -1}, "non-negative, got -1"),
    ({"data_fit_mass": 1.0}, "strictly between 0 and 1, got 1.0"),
    ({"data_fit_lr": 0.0}, "positive, got 0.0"),
    ({"data_fit_norm": -2.0}, "positive, got -2.0"),
    ({"data_fit_samples": 0}, "positive, got 0"),
    ({"data_fit_l2": -1e-3}, "non-negative, got -0.001"),
])
def test_bad_data_fit_settings_are_refused_by_name(params, cause):
    with pytest.raises(UsageError) as e:
        init_spec("impulse", **params)
    (name,) = params
    assert says(e.value.render(lambda n: f"<{n}>"), "impulse", f"<{name}>", cause)


def test_data_fit_without_data_runs_on_noise_and_says_so_and_a_state_dict_keeps_the_plain_solve(digits):
    """The default fits to data; a model without data is fitted on noise inputs of its input shape
    (the same fit as ``data_fit_inputs="noise"``) and one warning says so; a state dict gets the
    plain solve and a report that says why, without a warning (it can never be fitted); data given
    to a state dict is refused."""
    want = initialize_model(vit(), "impulse", data=digits[0][:4], data_fit_inputs="noise", data_fit=10)
    m = vit()
    with pytest.warns(UserWarning, match=r"impulse: no data given, so Q/K were fitted on 256 Gaussian noise inputs"):
        rep = initialize_model(m, "impulse", data_fit=10)
    assert rep["data_fit"]["inputs"] == "noise" and rep["data_fit"]["artifact"] == {
        **want["data_fit"]["artifact"], "cached": True}
    assert rep["data_fit"]["source"] == "noise: 256 Gaussian inputs N(0, 1) of shape [1, 8, 8] (no data)"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain = initialize_model(vit(), "impulse", data_fit=0)  # asked for by name: no warning
    assert plain["data_fit"] is None
    sd = vit().state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rep = initialize(sd, "impulse", heads=4)
    assert rep["data_fit"]["skipped"].startswith("not run: a checkpoint or state dict holds no model")
    with pytest.raises(UsageError, match="so it needs a model, not a checkpoint or state dict"):
        initialize(sd, "impulse", heads=4, data=digits[0], data_fit=10)


def test_run_keys_of_the_old_and_the_new_default():
    """Runs made before data_fit existed keep their keys: the plain solve without V/proj (the old
    default) is still the literal key it was; the new default (data fit + mimetic V/proj) has the
    key the runs of that setting had when it was an option, so they count as its runs."""
    spec = ImpulseInit(data_fit=0)
    assert not any(k.startswith("data_fit") for k in spec.to_dict()["params"])
    assert spec.to_dict()["params"]["filter"] == 3
    assert ImpulseInit().to_dict()["params"]["data_fit"] == 300
    assert [k for k in ImpulseInit().to_dict()["params"] if k.startswith("data_fit_")] == ["data_fit_version"]
    assert not any(k.startswith("data_fit_") for k in ImpulseInit(data_fit_version=1).to_dict()["params"])

    def key(**params):  # as the runs' config.json held them, before train's base (TrainConfig.from_dict)
        return TrainConfig.from_dict(dict(dataset="digits", init="impulse", init_params=params, train_size=100,
                                          val_size=300, seed=0)).key

    assert key(data_fit=0, mimetic_vproj=False) == "eb1a3455b343"  # the old default's key, as it was
    # version 1 of the data fit keeps the key its runs were made under (the committed ones: see below);
    # version 2 (the default) has its own
    assert key(data_fit_version=1) == key(data_fit=300, mimetic_vproj=True, data_fit_version=1)
    assert key() == key(data_fit_version=2) != key(data_fit_version=1)
    assert key(data_fit=150) != key() and key(data_fit=0) == key(data_fit=0, data_fit_version=1)


def test_the_digits_grid_keeps_its_committed_runs():
    """The committed digits report's grid pins the data fit's version 1 its runs were made with (key of
    seed 0 at 100 images), and its plain row is the old default's runs; the shipped grid's impulse
    row is the default, version 2."""
    from pathlib import Path

    from structinit.experiments.expand import expand
    from structinit.experiments.gridspec import load_grid

    committed = Path(__file__).resolve().parents[1] / "docs" / "results" / "digits-default" / "grid.toml"
    only = ["train_size=100", "init=impulse,impulse-plain"]
    keys = {c.row: c.key for c in expand(load_grid(str(committed)), seeds=1, only=only).cells}
    assert keys == {"impulse": "96fbec4c6b94", "impulse-plain": "650ab8c05363"}
    shipped = {c.row: c.key for c in expand(load_grid("digits"), seeds=1, only=only).cells}
    assert shipped["impulse-plain"] == "650ab8c05363" and shipped["impulse"] not in ("96fbec4c6b94", "650ab8c05363")


def test_train_fits_to_its_training_images_and_records_the_fit(tmp_path):
    from structinit.training.loop import train

    cfg = TrainConfig(dataset="digits", init="impulse", init_params={"data_fit": 20, "data_fit_samples": 32},
                      train_size=100, val_size=300, epochs=1, out=str(tmp_path / "run"), threads=1)
    result = train(cfg)
    init = result.init_report
    assert init["data_fit"]["steps"] == 20 and init["data_fit"]["samples"] == 32
    # measured at init on the run's training inputs (all 100, of which 32 were fitted): far above the
    # pseudo-input solve's 0.12-0.17, even after only 20 steps
    assert init["data_attention"]["hit_rate"] > 0.4
    assert math.isfinite(result.final_acc)


def test_a_state_dict_checkpoint_path_refuses_data_fit_with_one_line(tmp_path, cli):
    import safetensors.torch

    path = tmp_path / "vit.safetensors"
    safetensors.torch.save_file({k: v.contiguous() for k, v in vit().state_dict().items()}, str(path))
    r = cli("train", "--dataset", "digits", "--init", "impulse", "--init-param", "data_fit=-3", "--epochs", "1",
            "--out", str(tmp_path / "r"))
    assert r.returncode == 2
    assert "data_fit must be non-negative" in r.stderr
    assert not (tmp_path / "r").exists()
    with pytest.raises(StructinitError):
        from structinit.apply.checkpoint import apply_checkpoint

        apply_checkpoint(path, init_spec("impulse", data_fit=5), out=tmp_path / "o.safetensors")
    assert not (tmp_path / "o.safetensors").exists()


def test_grid_attention_figures_see_the_model_train_starts_from():
    """bench report --attention rebuilds each run's initialized model: a data-fitted init gets the
    run's own first training inputs, so its Q/K are the ones train starts from."""
    from structinit.training.datasets import split_train
    from structinit.training.loop import init_inputs
    from structinit.training.run_models import initialized_model

    cfg = TrainConfig(dataset="digits", init="impulse", init_params={"data_fit": 4, "data_fit_samples": 16},
                      train_size=100, val_size=300, seed=2)
    model, report, info = initialized_model(cfg)
    assert report["data_fit"]["samples"] == 16
    data = split_train(load_dataset("digits"), 100, 300, 2)
    again = build_model(cfg.model, num_classes=10, image_size=8, in_chans=1, seed=2)
    initialize_model(again, cfg.init, seed=2, data=init_inputs(data.train, info))
    for a, b in zip(model.blocks, again.blocks):
        assert torch.equal(a.attn.qkv.weight, b.attn.qkv.weight)


def test_the_fit_and_the_calibration_return_float32_on_the_cpu_whatever_they_are_given():
    """float64 Q/K (a float64 artifact, a state dict in double) come back float32, as documented,
    through both entry points, with and without a causal mask."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 9, 12, generator=g)
    q = torch.randn(2, 12, 4, generator=g, dtype=torch.float64)
    k = torch.randn(2, 12, 4, generator=g, dtype=torch.float64)
    cols = torch.from_numpy(impulse_columns(Grid((3, 3)), np.array([[0, 1], [1, 0]]))).long()
    for mask in (None, torch.ones(9, 9).tril().bool()):
        for qq, kk in (refine_qk(x, q, k, cols, steps=2, mass=0.6, l2=0.0, lr=1e-2, norm=1.0, mask=mask),
                       calibrate_on_batch(x, q, k, cols, 0.3, mask=mask, steps=5)):
            assert qq.dtype == kk.dtype == torch.float32 and qq.device.type == kk.device.type == "cpu"
            assert qq.shape == kk.shape == (2, 12, 4)


def test_a_data_fit_refuses_what_it_cannot_run_naming_the_parameter(digits):
    """The fit runs inputs through the model and fits q and k as linear maps: a state dict, a
    model that cannot run the batch, and a layer with q/k norms are refused, each with the parameter
    and what is wrong named."""
    import timm

    def refusal(target, **kw):
        with pytest.raises(UsageError) as e:
            initialize(target, "impulse", data=digits[0], data_fit=10, **kw)
        return e.value.render(lambda n: f"<{n}>")

    assert says(refusal(vit().state_dict(), heads=4), "<data_fit>", "needs a model", "not a checkpoint or state dict",
                "apply_checkpoint")

    class Wrapped(torch.nn.Module):  # the same ViT one attribute further down, and no forward of its own
        def __init__(self):
            super().__init__()
            self.inner = vit()

    assert refusal(Wrapped(), grid=(8, 8), heads=4).startswith(
        "the <model> cannot run on the <data> given (NotImplementedError: ")
    torch.manual_seed(0)
    normed = timm.create_model("vit_tiny_patch16_224", img_size=8, patch_size=2, in_chans=1, embed_dim=32, depth=2,
                               num_heads=4, class_token=False, global_pool="avg", num_classes=10, qk_norm=True)
    assert says(refusal(normed, layers=[1]), "<data_fit>", "linear maps", "layer 1", "q_norm/k_norm")


def test_a_causal_data_fit_calibrates_under_the_decoders_mask():
    """Causal offsets on a model with timm-style blocks (a 1-D transformer used as a decoder): the
    fit calibrates each head's mean attention on its target to ``target_mass`` as the masked model
    attends, every later token hidden (calibrated unmasked, the masked mass came out 0.56-0.68)."""
    m = build_model(ModelConfig("transformer-1d"), num_classes=10, image_size=24, in_chans=1, seed=0)
    x = torch.randn(32, 1, 24, generator=torch.Generator().manual_seed(0))
    rep = initialize_model(m, "impulse", causal=True, filter=3, data=x, data_fit=10, target_mass=0.5, seed=0)
    assert rep["artifact"]["config"]["causal"] is True and rep["data_fit"]["calibrated_to"] == 0.5
    assert [round(row["target_mass"], 4) for row in rep["data_fit"]["layers"]] == [0.5] * 4


def test_a_causal_data_fit_fits_each_layer_under_the_mask():
    """Layer 0 of a causal data fit is the fit and calibration of the solved Q/K on that layer's
    inputs with the decoder's mask, replayed here step for step (a fit without the mask differs)."""
    from pathlib import Path

    from structinit.init.attention_target import AttentionTarget
    from structinit.solver.artifact import read_artifact

    def model():
        return build_model(ModelConfig("transformer-1d"), num_classes=10, image_size=24, in_chans=1, seed=0)

    m = model()
    x = torch.randn(32, 1, 24, generator=torch.Generator().manual_seed(0))
    rep = initialize_model(m, "impulse", causal=True, filter=3, data=x, data_fit=10, target_mass=0.5, seed=0,
                           mimetic_vproj=False, data_fit_version=1)
    art = read_artifact(Path(rep["artifact"]["path"]))
    spec = ImpulseInit()
    x0 = attention_inputs(model(), x)[0].float()  # the init leaves the embedding that feeds layer 0 as it was
    cols = torch.from_numpy(impulse_columns(art.config.grid, art.offsets[0], art.config.padding)).long()
    mask = torch.from_numpy(causal_mask(art.config.grid, True))
    q, k = refine_qk(x0, torch.from_numpy(art.q[0]), torch.from_numpy(art.k[0]), cols, steps=10,
                     mass=spec.data_fit_mass, l2=spec.data_fit_l2, lr=spec.data_fit_lr, norm=spec.data_fit_norm,
                     mask=mask)
    q, k = calibrate_on_batch(x0, q, k, cols, 0.5, mask)
    t = AttentionTarget(m)
    got_q, got_k = read_qk(t.sd, t.slots[0], t.heads)
    torch.testing.assert_close(got_q, q, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_k, k, rtol=1e-5, atol=1e-6)


def test_the_noise_fit_warning_points_at_the_callers_line():
    """The warning that the data fit ran on noise names the user's call, not structinit's inside (a
    wrapper between the two, as the mutation pass puts there, is not structinit's either)."""
    from pathlib import Path

    import structinit
    from structinit.errors import StructinitWarning

    with pytest.warns(StructinitWarning, match="impulse: no data given, so Q/K were fitted on 256") as seen:
        initialize_model(vit(), "impulse", seed=0, data_fit=5)
    package = Path(structinit.__file__).resolve().parent
    notices = [w for w in seen.list if "no data given" in str(w.message)]
    assert len(notices) == 1 and package not in Path(notices[0].filename).resolve().parents


def test_an_artifact_fitted_to_one_embedding_is_refused_for_a_model_with_another(tmp_path):
    """``fit_pe`` solves for the model's own (learned) position embedding: that artifact, given by
    path to a model whose embedding differs, is refused naming the parameter; the model it was
    solved for takes it."""
    import timm

    def learned(seed):
        torch.manual_seed(seed)
        return timm.create_model("vit_tiny_patch16_224", img_size=8, patch_size=2, in_chans=1, embed_dim=32,
                                 depth=1, num_heads=4, class_token=False, global_pool="avg", num_classes=10)

    rep = initialize_model(learned(0), "impulse", fit_pe=True, data_fit=0, filter=3, cache_dir=tmp_path)
    path = rep["artifact"]["path"]
    with pytest.raises(UsageError) as e:
        initialize_model(learned(1), "impulse", artifact=path, data_fit=0, cache_dir=tmp_path)
    assert says(e.value.render(lambda n: f"<{n}>"), "<artifact>", "another position embedding", "<fit_pe>")
    assert initialize_model(learned(0), "impulse", artifact=path, data_fit=0, cache_dir=tmp_path)["layers"]


def test_a_given_artifact_is_checked_by_its_own_pseudo_input_not_the_spec_default(tmp_path):
    """A model with a learned position embedding takes Q/K solved on Gaussian pseudo inputs (they
    assume no table), given by path or as an Artifact; the same given as the table's solve is refused.
    The check reads the artifact's pseudo input, not the spec's default ('pe')."""
    import timm

    from structinit.init.attention_target import AttentionTarget
    from structinit.solver.run import solve

    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", img_size=8, patch_size=2, in_chans=1, embed_dim=32, depth=1,
                              num_heads=4, class_token=False, global_pool="avg", num_classes=10)
    t = AttentionTarget(model)
    assert t.pos_embed_kind() == "other"
    gaussian = solve(init_spec("impulse", pseudo_input="gaussian").solve_config(t.grid, 32, 4, 1),
                     cache_dir=tmp_path).artifact
    table = solve(init_spec("impulse").solve_config(t.grid, 32, 4, 1), cache_dir=tmp_path).artifact
    spec = init_spec("impulse", data_fit=0)
    assert spec.apply(AttentionTarget(model), artifact=gaussian)["layers"]
    assert initialize_model(model, "impulse", artifact=gaussian.path, data_fit=0, cache_dir=tmp_path)["layers"]
    with pytest.raises(UsageError, match="is not the sin-cos table the impulse solve assumes"):
        spec.apply(AttentionTarget(model), artifact=table)


def test_fit_pe_needs_a_pe_pseudo_input_and_says_which_parameter():
    with pytest.raises(UsageError) as e:
        init_spec("impulse", fit_pe=True, pseudo_input="gaussian")
    assert says(e.value.render(lambda n: f"<{n}>"), "<fit_pe>", "'pe' <pseudo_input>", "'gaussian'")


def test_a_prefix_token_sees_and_is_seen_by_every_token():
    from structinit.fit.layers import prefixed_mask

    grid = np.array([[True, False], [False, True]])
    full = prefixed_mask(grid, 3)  # one class token first
    assert full.dtype == torch.bool
    assert full.tolist() == [[True, True, True], [True, True, False], [True, False, True]]
    assert prefixed_mask(grid, 2).tolist() == grid.tolist() and prefixed_mask(None, 3) is None


def test_a_partly_structured_fit_warns_where_it_is_called(tmp_path):
    from pathlib import Path

    from conftest import filling_images, vit_filling

    import structinit
    from structinit.errors import StructinitWarning

    with pytest.warns(StructinitWarning) as caught:
        initialize_model(vit_filling(), "impulse", data=filling_images(8), seed=0, data_fit=1, cache_dir=tmp_path)
    weak = [w for w in caught if "the data fit left layer" in str(w.message)]
    assert len(weak) == 1 and str(weak[0].message).startswith("impulse: the data fit left layer")
    # said where initialize_model is called, not inside structinit (the mutation pass's wrapper between
    # the two is not structinit's either)
    package = Path(structinit.__file__).resolve().parent
    assert package not in Path(weak[0].filename).resolve().parents


def test_a_model_that_does_not_tell_its_input_shape_gets_the_plain_solve_and_a_warning_asking_for_data(tmp_path):
    from structinit.errors import StructinitWarning

    model = vit()
    model.patch_embed.img_size = None  # no input shape to draw noise of
    with pytest.warns(StructinitWarning) as caught:
        report = initialize_model(model, "impulse", seed=0, cache_dir=tmp_path)
    said = [str(w.message) for w in caught if "data_fit" in str(w.message)]
    assert said == ["impulse data_fit not run: the model does not tell its input shape (a model of token ids?) and no "
                    "inputs were given, so Q/K are the plain solve on the position embedding alone, which real inputs "
                    "mostly wash out; give data"]
    assert report["data_fit"]["skipped"] == said[0].removeprefix("impulse data_fit ")


def test_the_solve_reports_its_progress_through_apply(tmp_path):
    """``apply(progress=...)`` follows the solve (the fast recipe's calibration passes): called with
    a growing ``done`` of a fixed ``total``; a cached artifact solves nothing and reports nothing."""
    from structinit.init.attention_target import AttentionTarget

    seen = []
    spec = init_spec("impulse", data_fit=0)
    model = vit(dim=48, depth=1)  # a shape the package ships no artifact for: it is solved here
    spec.apply(AttentionTarget(model), cache_dir=tmp_path, progress=lambda done, total: seen.append((done, total)))
    assert len(seen) > 1 and len({total for _, total in seen}) == 1
    assert [done for done, _ in seen] == sorted(done for done, _ in seen) and seen[-1][0] <= seen[-1][1]
    again = []
    spec.apply(AttentionTarget(model), cache_dir=tmp_path, progress=lambda done, total: again.append(done))
    assert again == []
