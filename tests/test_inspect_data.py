"""``inspect --data``: the attention of an initialized model on real inputs (init_fidelity), checked
against the artifact's pseudo-input measures (a model whose patch embedding is zeroed sees the
pseudo input itself), against what ``train`` records at init, and through the CLI: its numbers,
its figure, and its refusals."""

import json
import struct

import numpy as np
import pytest
import torch
from conftest import error_line, says

from structinit.analysis.fidelity import centre_query, init_fidelity, report_settings, window_mask
from structinit.analysis.quality import artifact_attention
from structinit.init.initialize import initialize_model
from structinit.solver.artifact import read_artifact
from structinit.training.config import TrainConfig
from structinit.training.models import ModelConfig, build_model
from structinit.training.run_models import initialized_model, training_images

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: The impulse init without its data fit (300 Adam steps a model, the default): what inspect shows
#: does not depend on it, and it would dominate these tests' time.
PLAIN = ("--init", "impulse", "-p", "data_fit=0")
IMPULSE = TrainConfig(model="vit-digits", dataset="digits", init="impulse", init_params={"data_fit": 0})


@pytest.fixture(scope="module")
def digits_batch():
    return training_images(IMPULSE, 48)


def zeroed(model, residual: bool = False):
    """Zero the patch embedding (and with ``residual`` every attention and MLP output), so the
    tokens hold the position embedding alone (and every block passes it on unchanged)."""
    with torch.no_grad():
        model.patch_embed.proj.weight.zero_()
        model.patch_embed.proj.bias.zero_()
        if residual:
            for blk in model.blocks:
                for lin in (blk.attn.proj, blk.mlp.fc2):
                    lin.weight.zero_()
                    lin.bias.zero_()
    return model


def pseudo_window_share(art, layer: int) -> np.ndarray:
    """Per head, the share of attention in the f x f window (odd f) on the artifact's pseudo input,
    counted key by key from grid coordinates (not with window_mask, which it checks)."""
    attn = artifact_attention(art, layer)  # [heads, N, N]
    h, w = art.config.grid
    r = art.config.filter // 2
    share = np.zeros(attn.shape[0])
    for q in range(h * w):
        qy, qx = divmod(q, w)
        keys = [ky * w + kx for ky in range(h) for kx in range(w) if abs(ky - qy) <= r and abs(kx - qx) <= r]
        share += attn[:, q, keys].sum(-1)
    return share / (h * w)


# --------------------------------------------------------------------------- the library function

def test_zero_patch_embedding_gives_the_artifacts_pseudo_input_measures(digits_batch):
    """The issue's check: with the patch embedding zeroed, layer 0 sees LayerNorm(PE) on every image,
    the solver's pseudo input, so its real-data measures are the artifact's, head by head. With the
    residual branches zeroed too every layer sees it, so every layer matches; and the centre token's
    image-averaged map is the artifact's attention row of that token."""
    model = build_model(ModelConfig("vit-digits"), num_classes=10, image_size=8, in_chans=1, seed=0)
    report = initialize_model(model, "impulse", data_fit=0, seed=0)
    art = read_artifact(report["artifact"]["path"])
    fid = init_fidelity(zeroed(model), digits_batch, report)
    assert fid.images == 48 and fid.filter == 3 and fid.hit_rate.shape == (4, 4)
    np.testing.assert_allclose(fid.hit_rate[0], art.quality.hit_rate[0], atol=1e-4)
    np.testing.assert_allclose(fid.target_mass[0], art.quality.target_mass[0], atol=1e-4)
    np.testing.assert_allclose(fid.window_mass[0], pseudo_window_share(art, 0), atol=1e-4)

    deep = init_fidelity(zeroed(model, residual=True), digits_batch, report)
    q = centre_query(art.config.grid)
    for layer in range(4):
        np.testing.assert_allclose(deep.hit_rate[layer], art.quality.hit_rate[layer], atol=1e-4)
        np.testing.assert_allclose(deep.target_mass[layer], art.quality.target_mass[layer], atol=1e-4)
        np.testing.assert_allclose(deep.window_mass[layer], pseudo_window_share(art, layer), atol=1e-4)
        want = artifact_attention(art, layer, q)[:, 0].reshape(4, 8, 8)
        np.testing.assert_allclose(deep.query_maps()[layer], want, atol=1e-5)
    rows = deep.layer_rows()
    assert [r["hit_rate"] for r in rows] == pytest.approx(art.quality.hit_rate.mean(1).tolist(), abs=1e-4)


def test_centre_query_and_targets():
    assert centre_query((8, 8)) == 36 and centre_query((7, 5)) == 17 and centre_query((40,)) == 20
    model = build_model(ModelConfig("vit-digits"), num_classes=10, image_size=8, in_chans=1, seed=1)
    report = initialize_model(model, "impulse", data_fit=0, seed=1)
    fid = init_fidelity(model, torch.zeros(2, 1, 8, 8), report)
    offsets = np.array([r["offsets"] for r in report["layers"]])
    np.testing.assert_array_equal(fid.targets(), np.array([4, 4]) + offsets)  # the centre token is (4, 4)
    assert (fid.targets(0)[offsets.min(-1) < 0] == -1).all()  # token (0, 0): a negative offset leaves the grid
    assert fid.query_maps(9).shape == (4, 4, 8, 8)
    np.testing.assert_array_equal(fid.query_maps(9)[2, 1].ravel(), fid.grid_maps()[2, 1, 9])
    with pytest.raises(Exception, match="query"):
        fid.query_maps(64)


def test_other_inits_have_window_share_alone(digits_batch):
    model = build_model(ModelConfig("vit-digits"), num_classes=10, image_size=8, in_chans=1, seed=0)
    report = initialize_model(model, "mimetic", seed=0)
    assert report_settings(report)["offsets"] is None
    fid = init_fidelity(model, digits_batch[:8], report, filter=5)
    assert fid.hit_rate is None and fid.target_mass is None and fid.targets() is None and fid.filter == 5
    win = torch.from_numpy(window_mask((8, 8), 5))
    attn = torch.from_numpy(fid.maps)  # the mean over images of a linear measure is the measure of the mean
    np.testing.assert_allclose(fid.window_mass, (attn * win).sum(-1).mean(-1).numpy(), atol=1e-5)
    assert init_fidelity(model, digits_batch[:2], None).filter == 3  # the model's own init: the default window


# --------------------------------------------------------------------------- the figure

def test_figure_draws_the_centre_query_of_the_first_middle_and_last_layer(digits_batch):
    from structinit.analysis.figures import fidelity_figure

    model = build_model(ModelConfig("vit-digits"), num_classes=10, image_size=8, in_chans=1, seed=0)
    report = initialize_model(model, "impulse", data_fit=0, seed=0)
    fid = init_fidelity(zeroed(model, residual=True), digits_batch[:8], report)
    fig = fidelity_figure(fid, title="t")
    panels = [ax for ax in fig.axes if ax.get_xlabel() == "key column x"]
    assert len(panels) == 3 * 4 and "rows: layers 0, 1, 3 of 0-3" in fig._suptitle.get_text()
    bars = [ax for ax in fig.axes if ax.get_ylabel() == "attention weight (one scale for every panel)"]
    assert len(bars) == 1 and len({ax.images[0].get_clim() for ax in panels}) == 1  # one scale for the figure
    qmaps, targets = fid.query_maps(), fid.targets()
    for i, layer in enumerate((0, 1, 3)):
        for head in range(4):
            ax = panels[4 * i + head]
            assert ax.get_title().startswith(f"layer {layer}, head {head}")
            shown = np.asarray(ax.images[0].get_array())
            np.testing.assert_allclose(shown, qmaps[layer, head])
            (qx,), (qy,) = ax.lines[0].get_data()
            assert (qy, qx) == (4, 4)  # the white square: the centre token
            (tx,), (ty,) = ax.lines[1].get_data()
            assert (ty, tx) == tuple(targets[layer, head])
            assert np.unravel_index(shown.argmax(), shown.shape) == (ty, tx)  # pseudo input: the impulse hits
            box = ax.patches[0]
            assert (box.get_x(), box.get_y(), box.get_width()) == (2.5, 2.5, 3)  # the 3x3 window around (4, 4)


def test_sequence_figure_is_a_band_per_head_on_its_offset():
    from structinit.analysis.figures import fidelity_figure

    model = build_model(ModelConfig("transformer-1d"), num_classes=10, image_size=40, in_chans=1, seed=0)
    report = initialize_model(model, "impulse", data_fit=0, filter=5, seed=0)
    fid = init_fidelity(zeroed(model, residual=True), torch.randn(4, 1, 40), report)
    assert fid.filter == 5 and fid.query_maps().shape == (4, 4, 40) and fid.hit_rate.min() > 0.9
    fig = fidelity_figure(fid)
    bands = [ax for ax in fig.axes if ax.get_xlabel() == "relative position (key - query)"]
    assert len(bands) == 3 * 4
    for i, layer in enumerate((0, 1, 3)):
        for head in range(4):
            band = np.asarray(bands[4 * i + head].images[0].get_array())
            reach = (band.shape[1] - 1) // 2
            assert int(np.nanargmax(np.nanmean(band, axis=0))) - reach == fid.offsets[layer, head, 1]


# --------------------------------------------------------------------------- the command

def run_json(cli, *args):
    r = cli(*args, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_cli_on_a_preset_reports_the_library_numbers(cli):
    got = run_json(cli, "inspect", "vit-digits", *PLAIN, "--data", "digits", "--samples", "32")
    model, report, _ = initialized_model(IMPULSE)
    fid = init_fidelity(model, training_images(IMPULSE, 32), report)
    assert got["samples"] == 32 and got["source"] == "init" and got["query"] == 36
    assert got["init"] == {"method": "impulse", "filter": 3, "padding": "zero"}
    f = got["fidelity"]
    for name in ("hit_rate", "target_mass", "window_mass"):
        np.testing.assert_allclose(np.array(f[name]), getattr(fid, name), atol=1e-6)
    assert [r["hit_rate"] for r in f["layers"]] == pytest.approx([r["hit_rate"] for r in fid.layer_rows()])
    np.testing.assert_allclose(np.array(got["query_maps"]), fid.query_maps(36), atol=1e-6)
    assert f["offsets"] == [r["offsets"] for r in report["layers"]]

    r = cli("inspect", "vit-digits", *PLAIN, "--data", "digits", "--samples", "32", "--per-head")
    assert r.returncode == 0, r.stderr
    rows = [line.split() for line in r.stdout.splitlines() if line.split()[:1] and line.split()[0].isdigit()]
    assert len(rows) == 16
    for layer, head, _offset, hit, mass, window in rows:
        l, h = int(layer), int(head)
        assert (float(hit), float(mass), float(window)) == pytest.approx(
            (fid.hit_rate[l, h], fid.target_mass[l, h], fid.window_mass[l, h]), abs=5e-4)


def test_cli_flags_change_what_they_say(cli):
    base = ["inspect", "vit-digits", *PLAIN, "--data", "digits", "--samples", "8"]
    cfg = TrainConfig(model="vit-digits", dataset="digits", init="impulse", init_params={"filter": 5, "data_fit": 0},
                      seed=3)
    model, report, _ = initialized_model(cfg)
    images = training_images(cfg, 8)
    fid = init_fidelity(model, images, report)
    got = run_json(cli, *base, "-p", "filter=5", "--seed", "3", "--query", "9")
    assert got["init"]["filter"] == 5 and got["fidelity"]["filter"] == 5 and got["query"] == 9
    assert got["fidelity"]["offsets"] == [r["offsets"] for r in report["layers"]]  # seed 3's draw, from 5x5
    assert got["fidelity"]["offsets"][0] != [[2, -1], [1, -2], [0, 0], [-1, -1]]  # seed 0's draw
    assert np.abs(np.array(got["fidelity"]["offsets"])).max() <= 2
    np.testing.assert_allclose(np.array(got["fidelity"]["hit_rate"]), fid.hit_rate, atol=1e-6)
    np.testing.assert_allclose(np.array(got["query_maps"]), fid.query_maps(9), atol=1e-6)
    # --filter: the window measured, not the offsets
    plain = run_json(cli, *base)
    wide = run_json(cli, *base, "--filter", "5")
    model, report, _ = initialized_model(IMPULSE)
    want = init_fidelity(model, images, report, filter=5)
    assert wide["fidelity"]["filter"] == 5 and wide["fidelity"]["hit_rate"] == plain["fidelity"]["hit_rate"]
    np.testing.assert_allclose(np.array(wide["fidelity"]["window_mass"]), want.window_mass, atol=1e-6)
    assert np.all(np.array(wide["fidelity"]["window_mass"]) > np.array(plain["fidelity"]["window_mass"]))


def test_cli_png_is_the_figure(cli, tmp_path):
    png = tmp_path / "fid.png"
    r = cli("inspect", "vit-digits", *PLAIN, "--data", "digits", "--samples", "16", "--png", png)
    assert r.returncode == 0, r.stderr
    assert f"wrote {png}" in r.stdout and "window" in r.stdout
    head = png.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    width, height = struct.unpack(">II", head[16:24])
    assert 1000 < width < 3000 and 900 < height < 3000  # four heads across, three layers down
    again = cli("inspect", "vit-digits", *PLAIN, "--data", "digits", "--png", png)
    assert again.returncode == 2 and "already exists" in again.stderr


@pytest.mark.slow  # a training run with the default's data fit, then three CLI calls that rebuild it
def test_cli_on_a_train_run_matches_what_train_recorded_and_reads_its_checkpoints(cli, tmp_path):
    from structinit.training.loop import train

    out = tmp_path / "run"
    cfg = TrainConfig(dataset="digits", init="impulse", init_params={"data_fit": 20}, train_size=64, batch_size=32,
                      warmup_epochs=0, epochs=1, out=str(out), threads=1)
    recorded = train(cfg).init_report["data_attention"]
    assert recorded["samples"] == 64
    got = run_json(cli, "inspect", out, "--data", "digits")
    assert got["source"] == "init" and got["samples"] == 64 and got["config_path"] == str(out / "config.json")
    # data_attention_quality (train's record) and the captured attention (inspect) agree
    for row, rec in zip(got["fidelity"]["layers"], recorded["layers"]):
        assert row["hit_rate"] == pytest.approx(rec["hit_rate"], abs=1e-4)
        assert row["target_mass"] == pytest.approx(rec["target_mass"], abs=1e-4)
    text = cli("inspect", out, "--data", "digits").stdout
    assert "train: hit" in text and f"rebuilt from {out / 'config.json'}" in text

    for name in ("checkpoint.pt", "best.pt"):
        ck = run_json(cli, "inspect", out / name, "--data", "digits")
        assert ck["source"] == "checkpoint" and ck["epoch"] == 1
        model, report, _ = initialized_model(cfg)
        model.load_state_dict(torch.load(out / name, weights_only=True)["state_dict"])
        fid = init_fidelity(model, training_images(cfg, 256), report)
        np.testing.assert_allclose(np.array(ck["fidelity"]["target_mass"]), fid.target_mass, atol=1e-6)
        assert ck["fidelity"]["target_mass"] != got["fidelity"]["target_mass"]  # two steps of training moved it


def test_cli_without_impulse_offsets_reports_the_window_share(cli):
    got = run_json(cli, "inspect", "vit-digits", "--init", "mimetic", "--data", "digits", "--samples", "8")
    assert got["fidelity"]["hit_rate"] is None and got["init"]["method"] == "mimetic"
    assert all(r["hit_rate"] is None and 0 < r["window_mass"] < 1 for r in got["fidelity"]["layers"])
    text = cli("inspect", "vit-digits", "--data", "digits", "--samples", "8").stdout  # timm's own init
    assert "the model's own init has no solved offsets: hit rate and target mass are for impulse init" in text


def one_error(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stderr)
    line = error_line(r.stderr)
    assert r.stdout == ""
    for needle in needles:
        assert needle in line, line


def test_cli_refusals_are_one_line(cli, tmp_path):
    from structinit.solver.cache import resolve_key

    shipped = "6095a9c75beb"
    artifact = resolve_key(shipped, None)
    torch.save({"blocks.0.attn.qkv.weight": torch.zeros(3, 3)}, tmp_path / "foreign.pth")
    (tmp_path / "empty").mkdir()
    preset = ["inspect", "vit-digits", *PLAIN]
    one_error(cli(*preset, "--data", "imagenet"), "unknown --data 'imagenet'")
    one_error(cli("inspect", artifact, "--data", "digits"), "is an artifact")
    one_error(cli("inspect", shipped, "--data", "digits"), "is an artifact key")
    one_error(cli("inspect", "nonsense", "--data", "digits"), "not a model preset")
    one_error(cli("inspect", tmp_path / "empty", "--data", "digits"), "not a structinit train run folder")
    one_error(cli("inspect", tmp_path / "foreign.pth", "--data", "digits"), "not a checkpoint written by structinit")
    (tmp_path / "notes.pth").write_text("not a checkpoint")
    r = cli("inspect", tmp_path / "notes.pth", "--data", "digits")  # unreadable: exit 1, as without --data
    assert r.returncode == 1 and error_line(r.stderr).startswith("error: cannot read checkpoint")
    one_error(cli("inspect", "cnn-1d", "--data", "mnist1d"), "no attention layers")
    one_error(cli(*preset, "--data", "mnist1d"), "--data mnist1d holds sequences")
    one_error(cli("inspect", "vit-digits", "-p", "filter=5", "--data", "digits"), "--init-param needs --init")
    one_error(cli(*preset, "--data", "digits", "--layer", "1"), "--layer", "--data")
    one_error(cli(*preset[:2], "--samples", "3"), "--samples need(s) --data")
    one_error(cli(*preset[:2], "--per-head"), "--per-head need(s) --data")
    one_error(cli(*preset, "--data", "digits", "--query", "64"), "--query 64 is out of range")
    one_error(cli(*preset, "--data", "digits", "--png", "x.txt"), ".png")
    one_error(cli("inspect", "--data", "digits"), "--data needs a TARGET")
    one_error(cli(*preset, "-p", "nonsense=1", "--data", "digits"), "has no parameter nonsense")
    one_error(cli(*preset, "--data", "cifar10", "--data-dir", tmp_path / "empty"), "cifar10: expected", "--data-dir")


def test_cli_refusals_on_a_run_folder(cli, tmp_path):
    from structinit.training.rundir import RunDir

    run = RunDir(tmp_path / "run")
    run.create()
    run.write_config({"config": TrainConfig(dataset="digits", init="impulse", init_params={"data_fit": 0}).to_dict()})
    one_error(cli("inspect", run.path, "--data", "synthetic"), "trained on digits", "--data digits")
    one_error(cli("inspect", run.path, "--data", "digits", "--init", "mimetic"), "--init", "own init")
    one_error(cli("inspect", run.path), "is a folder", "--data")


def test_a_class_token_run_records_and_inspects_the_same_numbers(cli, tmp_path):
    """train's record at init skips the class token as inspect does (it used to crash on it)."""
    from structinit.training.loop import train

    out = tmp_path / "cls"
    cfg = TrainConfig(dataset="digits", pool="token", init="impulse", init_params={"data_fit": 0}, train_size=64,
                      epochs=1, out=str(out),
                      threads=1)
    recorded = train(cfg).init_report["data_attention"]
    got = run_json(cli, "inspect", out, "--data", "digits")
    assert got["fidelity"]["prefix"] == 1 and got["samples"] == recorded["samples"] == 64
    for row, rec in zip(got["fidelity"]["layers"], recorded["layers"]):
        assert row["hit_rate"] == pytest.approx(rec["hit_rate"], abs=1e-4)
        assert row["target_mass"] == pytest.approx(rec["target_mass"], abs=1e-4)
    np.testing.assert_allclose(np.array(got["fidelity"]["hit_rate"]),
                               np.array([rec["heads"]["hit_rate"] for rec in recorded["layers"]]), atol=1e-4)


@pytest.mark.slow  # making MNIST-1D takes about 7 s
def test_cli_on_a_sequence_model_draws_bands(cli, tmp_path):
    png = tmp_path / "band.png"
    got = run_json(cli, "inspect", "transformer-1d", *PLAIN, "-p", "filter=5", "--data", "mnist1d",
                   "--samples", "32", "--png", png)
    cfg = TrainConfig(model="transformer-1d", dataset="mnist1d", init="impulse",
                      init_params={"filter": 5, "data_fit": 0})
    model, report, _ = initialized_model(cfg)
    fid = init_fidelity(model, training_images(cfg, 32), report)
    assert got["query"] == 20 and got["init"]["filter"] == 5 and got["png"] == str(png)
    for name in ("hit_rate", "target_mass", "window_mass"):
        np.testing.assert_allclose(np.array(got["fidelity"][name]), getattr(fid, name), atol=1e-6)
    assert np.array(got["query_maps"]).shape == (4, 4, 40)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 50_000


def test_a_run_measures_its_init_with_the_padding_its_offsets_were_solved_for():
    """Circular padding wraps the border queries' targets around the grid: the run's record at init
    is the model's attention against those targets, not the zero-padded ones."""
    from structinit.analysis.fidelity import data_attention_quality
    from structinit.training.loop import train

    cfg = TrainConfig(dataset="digits", init="impulse", init_params={"data_fit": 0, "padding": "circular"},
                      train_size=64, epochs=1, threads=1)
    recorded = train(cfg).init_report["data_attention"]
    model, report, _ = initialized_model(cfg)
    offsets, x = [r["offsets"] for r in report["layers"]], training_images(cfg, 64)
    measured = {p: data_attention_quality(model, x, offsets, report["grid"], padding=p) for p in ("circular", "zero")}
    assert abs(measured["circular"]["target_mass"] - measured["zero"]["target_mass"]) > 0.005
    for name in ("hit_rate", "target_mass"):
        assert recorded[name] == pytest.approx(measured["circular"][name], abs=1e-6), name


def refusal(config) -> str:
    from structinit.errors import UsageError
    from structinit.training.loop import train

    with pytest.raises(UsageError) as exc:
        train(config)
    return exc.value.render(lambda n: f"<{n}>")


CAUSAL_REFUSED = ("<causal>", "causal mask", "transformer-1d", "both ways", "leave it out")
SEQ = dict(model="transformer-1d", dataset="mnist1d", init="impulse", train_size=64, epochs=1, threads=1)


def test_causal_offsets_are_refused_for_the_models_train_builds():
    """They would be solved under a decoder's mask that transformer-1d never applies."""
    assert says(refusal(TrainConfig(**SEQ, init_params={"causal": True})), *CAUSAL_REFUSED)
    TrainConfig(**SEQ, init_params={"causal": False}).validate()


@pytest.mark.slow  # making MNIST-1D takes about 7 s
def test_a_causal_artifact_is_refused_when_train_reads_it(cache_dir, tmp_path):
    """Given by path, it is read at init: refused there, before training, leaving no run folder."""
    from structinit import SolveConfig, solve

    art = solve(SolveConfig(grid=(40,), dim=64, heads=4, filter=5, causal=True, layers=4), cache_dir=cache_dir).artifact
    out = tmp_path / "run"
    given = {"artifact": str(art.path), "data_fit": 0}
    line = refusal(TrainConfig(**SEQ, init_params=given, out=str(out)))
    assert says(line, f"artifact {art.key}", "<causal>", "transformer-1d", "solved without it")
    assert "leave it out" not in line  # the user gave no causal here: the artifact was solved with it
    assert not out.exists()
