"""``structinit apply CKPT --data SOURCE``: the impulse data fit through the model a checkpoint
describes, for every kind of checkpoint it can build a model for (a structinit train run, timm's
train.py checkpoint, a bare timm state dict, a Hugging Face ViT folder, a 1-D transformer on
MNIST-1D). Each writes the Q/K that ``initialize_model`` writes for the same weights, seed and batch,
and the written model attends to its offsets on held-out real inputs; what cannot be fitted is
refused with one line and nothing written."""

import argparse
import json
import os

import numpy as np
import pytest
import torch
from conftest import error_line, says

from structinit.analysis.fidelity import data_attention_quality
from structinit.geometry.grid import Grid
from structinit.init.initialize import initialize_model
from structinit.training.augment import normalize
from structinit.training.datasets import load_dataset, split_train

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def digits():
    """Fit inputs (the first 128 training digits) and held-out ones (the 360 test digits)."""
    data = load_dataset("digits")
    info = data.info
    return normalize(data.train.images[:128], info.mean, info.std), normalize(data.test.images, info.mean, info.std)


def timm_vit(seed=0, **kw):
    """A timm ViT shaped like the vit-digits preset (8x8 digits, patch 1, dim 64, depth 4, 4 heads) with the
    fixed sin-cos position embedding written."""
    import timm

    from structinit.init.pos_embed import set_sincos_pos_embed

    torch.manual_seed(seed)
    args = dict(img_size=8, patch_size=1, in_chans=1, num_classes=10, embed_dim=64, depth=4, num_heads=4,
                mlp_ratio=2.0, class_token=False, global_pool="avg")
    args.update(kw)
    model = timm.create_model("vit_tiny_patch16_224", **args)
    set_sincos_pos_embed(model)
    return model


def held_out_hits(model, report, x):
    rows = report["layers"]
    q = data_attention_quality(model, x, [r["offsets"] for r in rows], Grid(report["grid"]))
    return [round(r["hit_rate"], 3) for r in q["layers"]]


def written_state(path):
    obj = torch.load(path, weights_only=False) if not str(path).endswith(".safetensors") else None
    if obj is None:
        from safetensors.torch import load_file

        return load_file(str(path))
    return obj.get("state_dict", obj)


def assert_same_attention_weights(got, want, keys):
    for k in keys:
        torch.testing.assert_close(got[k].float(), want[k].float(), rtol=0, atol=1e-6)


@pytest.mark.slow  # a training run and the default fit on 256 digits: seconds on one core
def test_a_structinit_train_checkpoint_gets_the_fit_train_would_give(tmp_path, cli, digits):
    from structinit.training.config import TrainConfig
    from structinit.training.loop import init_inputs, train
    from structinit.training.models import build_model

    out = tmp_path / "run"
    config = TrainConfig(init="trunc-normal", epochs=1, train_size=256, batch_size=64, out=str(out), threads=1, seed=0)
    train(config)
    r = cli("apply", out / "checkpoint.pt", "--out", tmp_path / "imp.pt", "--data", "digits", "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["model"] == "structinit train settings: vit-digits on digits"
    assert rep["data_fit"]["source"] == "digits: the run's first 256 training inputs"
    assert rep["data_fit"]["samples"] == 256 and rep["data_fit"]["artifact"]["cached"] is False
    # initialize_model on the same weights, seed and batch: the same fitted artifact, the same weights
    model = build_model(config.model, num_classes=10, image_size=8, in_chans=1, seed=0)
    model.load_state_dict(torch.load(out / "checkpoint.pt", weights_only=True)["state_dict"])
    batch = init_inputs(split_train(load_dataset("digits"), 256, 0, 0).train, load_dataset("digits").info)
    ref = initialize_model(model, "impulse", data=batch, seed=0)
    assert ref["data_fit"]["artifact"]["key"] == rep["data_fit"]["artifact"]["key"]
    assert ref["data_fit"]["artifact"]["cached"] is True
    got = written_state(tmp_path / "imp.pt")
    assert_same_attention_weights(got, model.state_dict(), [k for k in got if ".attn." in k])
    written = build_model(config.model, num_classes=10, image_size=8, in_chans=1, seed=0)
    written.load_state_dict(got)
    assert min(held_out_hits(written, rep, digits[1])) >= 0.9


@pytest.mark.slow  # the default fit on 96 digits, then two applies that read it: seconds on one core
def test_timms_train_checkpoint_and_a_bare_state_dict_get_the_fit_of_the_model_they_hold(tmp_path, cli, digits):
    """timm's train.py saves ``arch`` (a registered model name) and its ``args`` beside the weights
    and the EMA; a bare state dict tells everything but the heads, which --heads gives."""
    from timm.models import build_model_with_cfg, register_model
    from timm.models.vision_transformer import VisionTransformer

    @register_model
    def structinit_test_vit_digits(pretrained=False, **kwargs):  # a user's own registered timm model
        kwargs = dict(dict(embed_dim=64, depth=4, num_heads=4, mlp_ratio=2.0), **kwargs)
        return build_model_with_cfg(VisionTransformer, "structinit_test_vit_digits", pretrained, **kwargs)

    model = timm_vit(seed=1)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt = tmp_path / "train.pth.tar"
    torch.save({"epoch": 3, "arch": "structinit_test_vit_digits", "state_dict": sd,
                "state_dict_ema": {k: v.clone() for k, v in sd.items()},
                "args": argparse.Namespace(model="structinit_test_vit_digits", img_size=8, num_classes=10)}, ckpt)
    bare = tmp_path / "bare.pt"
    torch.save(sd, bare)
    torch.save(digits[0][:96], tmp_path / "x.pt")
    ref = timm_vit(seed=1)
    want = initialize_model(ref, "impulse", data=digits[0][:96], seed=2)
    for path, extra, how in ((ckpt, [], "timm structinit_test_vit_digits"),
                             (bare, ["--heads", "4"], "timm VisionTransformer built from the tensors' shapes")):
        out = tmp_path / f"o-{path.name}"
        r = cli("apply", path, "--out", out, "--data", tmp_path / "x.pt", "--seed", "2", "--json", *extra)
        assert r.returncode == 0, r.stderr
        rep = json.loads(r.stdout)
        assert rep["model"].startswith(how) and rep["data_source"] == f"{tmp_path / 'x.pt'}: the first 96 inputs"
        assert rep["data_fit"]["artifact"]["key"] == want["data_fit"]["artifact"]["key"]
        saved = torch.load(out, weights_only=False)
        for state in ([saved["state_dict"], saved["state_dict_ema"]] if "state_dict" in saved else [saved]):
            assert_same_attention_weights(state, ref.state_dict(), [k for k in state if ".attn." in k])
            for k, v in state.items():  # everything else as it was
                if ".attn." not in k:
                    assert torch.equal(v, sd[k]), k
        if path == ckpt:
            assert saved["epoch"] == 3 and saved["arch"] == "structinit_test_vit_digits"
    assert min(held_out_hits(ref, want, digits[1])) >= 0.9


@pytest.mark.slow
def test_a_hugging_face_vit_folder_gets_the_fit_through_transformers(tmp_path, cli, digits):
    """A ViT written by save_pretrained (a class token, a learned embedding that --set-pe replaces):
    built from its config.json by transformers, fitted, written back in its own on-disk layout."""
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    cfg = ViTConfig(image_size=8, patch_size=1, num_channels=1, hidden_size=64, num_hidden_layers=4,
                    num_attention_heads=4, intermediate_size=128, num_labels=10, initializer_range=0.2)
    ViTForImageClassification(cfg).save_pretrained(tmp_path / "hf")
    out = tmp_path / "o.safetensors"
    r = cli("apply", tmp_path / "hf" / "model.safetensors", "--set-pe", "sincos", "--data", "digits",
            "--samples", "128", "--out", out, "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["model"].startswith("transformers ViTForImageClassification from")
    assert rep["data_fit"]["source"] == "digits: the first 128 training inputs, normalized with its mean and std"
    # the written file, loaded by transformers, attends by its offsets on held-out digits (its class token a key)
    import shutil

    shutil.copy(out, tmp_path / "hf" / "model.safetensors")
    model = ViTForImageClassification.from_pretrained(tmp_path / "hf").eval()
    seen = []
    hooks = [layer.attention.q_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
             for layer in model.vit.layers]
    with torch.no_grad():
        model(digits[1])
    for h in hooks:
        h.remove()
    hits = []
    from structinit.geometry.targets import impulse_columns

    for layer, (x, row) in enumerate(zip(seen, rep["layers"])):
        att = model.vit.layers[layer].attention
        q = att.q_proj(x).view(x.shape[0], x.shape[1], 4, 16).transpose(1, 2)
        k = att.k_proj(x).view(x.shape[0], x.shape[1], 4, 16).transpose(1, 2)
        p = torch.softmax(q @ k.transpose(-1, -2) / 4.0, -1)[:, :, 1:, :]  # grid queries, every key
        cols = torch.from_numpy(impulse_columns(Grid((8, 8)), np.asarray(row["offsets"]))) + 1
        has = cols >= 1
        hits.append(float(((p.argmax(-1) == cols) & has).sum() / (has.sum() * x.shape[0])))
    assert min(hits) >= 0.9, hits
    assert [round(h, 2) for h in hits] == pytest.approx([round(r["hit_rate"], 2) for r in rep["data_fit"]["layers"]],
                                                        abs=0.05)


@pytest.mark.slow
def test_bert_and_gpt2_folders_take_token_ids_and_gpt2_needs_causal_offsets(tmp_path, cli):
    """Sequence models from save_pretrained: the fit runs token ids [B, L] through them; the grid is the
    ids' length; GPT-2 (a decoder) needs --causal, and its written attention is fitted under its mask."""
    from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    BertModel(BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                         max_position_embeddings=64, vocab_size=100)).save_pretrained(tmp_path / "bert")
    GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=100, bos_token_id=0,
                               eos_token_id=0)).save_pretrained(tmp_path / "gpt2")
    torch.save(torch.randint(0, 100, (32, 24)), tmp_path / "ids.pt")
    for name, extra in (("bert", []), ("gpt2", ["--causal"])):
        r = cli("apply", tmp_path / name / "model.safetensors", "--set-pe", "sincos", "--data", tmp_path / "ids.pt",
                "--out", tmp_path / f"{name}.safetensors", "--json", *extra)
        assert r.returncode == 0, r.stderr
        rep = json.loads(r.stdout)
        assert rep["grid"] == [24] and rep["data_fit"]["samples"] == 32
        assert rep["artifact"]["config"].get("causal", False) is (name == "gpt2")
        assert min(row["hit_rate"] for row in rep["data_fit"]["layers"]) >= 0.9
    r = cli("apply", tmp_path / "gpt2" / "model.safetensors", "--set-pe", "sincos", "--data", tmp_path / "ids.pt",
            "--out", tmp_path / "g2.safetensors")
    assert r.returncode == 2 and says(error_line(r.stderr), "hf-gpt2", "earlier tokens", "--causal")
    torch.save(torch.randint(0, 1000, (4, 24)), tmp_path / "big.pt")
    r = cli("apply", tmp_path / "bert" / "model.safetensors", "--set-pe", "sincos", "--data", tmp_path / "big.pt",
            "--out", tmp_path / "b2.safetensors")
    assert r.returncode == 2 and "token ids must lie in 0..99" in r.stderr


@pytest.mark.slow  # a training run on MNIST-1D and the default fit: seconds on one core
def test_a_1d_transformer_on_mnist1d_gets_the_fit_of_its_run(tmp_path, cli):
    from structinit.training.config import TrainConfig
    from structinit.training.loop import train
    from structinit.training.run_models import run_model

    out = tmp_path / "run"
    train(TrainConfig(model="transformer-1d", dataset="mnist1d", init="trunc-normal", epochs=1, train_size=200,
                      val_size=500, batch_size=50, out=str(out), threads=1))
    r = cli("apply", out / "checkpoint.pt", "--out", tmp_path / "imp.pt", "--data", "mnist1d", "--filter", "5",
            "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["grid"] == [40] and rep["data_fit"]["samples"] == 200
    model = run_model(tmp_path / "imp.pt").model
    data = split_train(load_dataset("mnist1d"), 200, 500, 0)
    assert min(held_out_hits(model, rep, data.val.images[:300])) >= 0.9


# --------------------------------------------------------------------------- refusals


@pytest.fixture(scope="module")
def bare_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bare")
    torch.save(timm_vit().state_dict(), folder / "vit.pt")
    return folder / "vit.pt"


class _RunsCode:
    def __reduce__(self):
        return (print, ("this ran",))


@pytest.mark.parametrize("make, args, message", [
    (None, ["--data", "digits", "--dry-run"], "--data fits Q/K on real inputs and --dry-run writes nothing; give "
                                              "one of them"),
    (None, ["--samples", "8"], "--samples needs --data"),
    (None, ["--data", "digits", "--method", "mimetic"], "--data is for the impulse data fit; the mimetic init does "
                                                         "not use it"),
    (None, ["--data", "nowhere"], "--data 'nowhere' is neither a dataset"),
    (None, ["--data", "digits", "--model", "vit_tiny_patch16_224"], "the checkpoint is not a vit_tiny_patch16_224: "
                                                                    "its tensors have dim 64 and depth 4"),
    (lambda p: torch.save(torch.zeros(4, 1, 16, 16), p), ["--data", "{x}"],
     "has inputs of shape [1, 16, 16]; the model takes [1, 8, 8]"),
    (lambda p: torch.save(torch.randint(0, 255, (4, 1, 8, 8), dtype=torch.uint8), p), ["--data", "{x}"],
     "is uint8; give float inputs normalized as the model sees them"),
    (lambda p: torch.save(torch.rand(4, 1, 8, 8) * 255, p), ["--data", "{x}"], "does not look normalized"),
    (lambda p: torch.save(_RunsCode(), p), ["--data", "{x}"], "refusing to load a pickle that asks to run code"),
    (lambda p: np.save(p.with_suffix(".npy"), np.zeros((4, 1, 8, 8), dtype=object), allow_pickle=True),
     ["--data", "{npy}"], "holds object values, not numbers"),  # pickled objects: never loaded
    (lambda p: np.save(p.with_suffix(".npy"), np.float32(0.5)), ["--data", "{npy}"],
     "is a single number (a 0-d tensor); give a batch [B, ...]"),  # NumPy's ascontiguousarray made it [1]
    (lambda p: os.mkfifo(p), ["--data", "{x}"], "x.pt: a FIFO (named pipe), not a regular file"),
    (lambda p: os.symlink("/dev/zero", p), ["--data", "{x}"], "x.pt: a character device, not a regular file"),
])
def test_what_cannot_be_fitted_is_refused_with_one_line_and_nothing_written(tmp_path, cli, bare_checkpoint, make,
                                                                            args, message):
    x = tmp_path / "x.pt"
    if make is not None:
        make(x)
    args = [a.format(x=x, npy=x.with_suffix(".npy")) for a in args]
    before = sorted(p.name for p in tmp_path.iterdir())
    r = cli("apply", bare_checkpoint, "--heads", "4", "--out", tmp_path / "o.pt", *args)
    assert r.returncode == 2, r.stderr
    assert message in error_line(r.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_checkpoint_without_a_model_to_build_is_refused(tmp_path, cli, digits):
    mha = torch.nn.MultiheadAttention(64, 4)
    torch.save(mha.state_dict(), tmp_path / "mha.pt")
    torch.save(digits[0][:8], tmp_path / "x.pt")
    r = cli("apply", tmp_path / "mha.pt", "--heads", "4", "--grid", "8x8", "--data", tmp_path / "x.pt",
            "--out", tmp_path / "o.pt")
    assert r.returncode == 2 and says(error_line(r.stderr), "--data", "cannot build the model", "torch-mha")
    assert not (tmp_path / "o.pt").exists()


@pytest.mark.slow  # the default noise fit (256 inputs x 300 steps a layer): seconds on one core
def test_without_data_the_noise_fit_is_written_and_one_line_says_so(tmp_path, cli, bare_checkpoint):
    r = cli("apply", bare_checkpoint, "--heads", "4", "--out", tmp_path / "o.pt")
    assert r.returncode == 0, r.stderr
    notes = [line for line in r.stderr.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and notes[0].startswith("note: impulse: no data given, so Q/K were fitted on 256 Gaussian "
                                                   "noise inputs"), r.stderr
    weak = [line for line in r.stderr.splitlines() if line.startswith("warning:")]  # on noise, said as on data
    assert all("of the rows on its noise inputs" in line for line in weak), r.stderr
    assert notes[0].endswith("give real inputs (--data) to fit those")
    assert "Traceback" not in r.stderr
    assert r.stdout.startswith(f"wrote {tmp_path / 'o.pt'}: impulse init of 4 layer(s)")
    assert "Q/K fitted through timm VisionTransformer built from the tensors' shapes" in r.stdout
    assert "on noise: 256 Gaussian inputs N(0, 1) of shape [1, 8, 8] (no data)" in r.stdout
    plain = cli("apply", bare_checkpoint, "--heads", "4", "--out", tmp_path / "p.pt", "--data-fit", "0")
    assert plain.returncode == 0 and plain.stderr.startswith("note: --data-fit 0 writes the plain solve, which real "
                                                             "inputs wash out")
    assert "Q/K: the plain solve (--data-fit 0)" in plain.stdout


@pytest.mark.slow  # under mutmut a library warning comes from its trampoline, and the CLI cannot tell it is ours
def test_a_fit_left_partly_structured_where_content_fills_the_stream_advises_the_subspace_as_a_flag(tmp_path, cli):
    from conftest import filling_images, vit_filling

    torch.save(vit_filling().state_dict(), tmp_path / "fill.pt")
    torch.save(filling_images(16), tmp_path / "x.pt")
    r = cli("apply", tmp_path / "fill.pt", "--heads", "4", "--out", tmp_path / "o.pt", "--data", tmp_path / "x.pt",
            "--init-param", "data_fit=1")
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("warning:")]
    assert len(lines) == 1 and "the data fit left layer" in lines[0], r.stderr
    # given real inputs, the subspace is what is left to try, written as apply takes it
    assert "for structure try -p position_subspace=true (" in lines[0] and "real inputs" not in lines[0]


def test_a_folder_of_images_is_read_resized_and_standardized(tmp_path, cli, bare_checkpoint):
    """Real digits written as 16x16 PNGs in class folders: read in path order, resized to the model's
    8x8 input, standardized with their own mean and std, and fitted to; an unreadable image is named."""
    from PIL import Image

    from structinit.apply.inputs import fit_inputs_for
    from structinit.apply.models import checkpoint_model
    from structinit.init.checkpoints import load_checkpoint

    data = load_dataset("digits")
    for i in range(24):
        folder = tmp_path / "images" / str(int(data.train.labels[i]))
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(data.train.images[i, 0].numpy()).resize((16, 16)).save(folder / f"{i:03d}.png")
    built = checkpoint_model(load_checkpoint(bare_checkpoint), heads=4)
    got = fit_inputs_for(str(tmp_path / "images"), built, samples=20)
    assert tuple(got.x.shape) == (20, 1, 8, 8)
    assert got.source == (f"{tmp_path / 'images'}: 20 images, resized to 8x8 and standardized with their own mean "
                          "and std")
    assert float(got.x.mean()) == pytest.approx(0, abs=1e-5) and float(got.x.std()) == pytest.approx(1, abs=0.01)
    r = cli("apply", bare_checkpoint, "--heads", "4", "--data", tmp_path / "images", "--out", tmp_path / "o.pt",
            "--data-fit", "20", "--json")  # 20 fit steps: what is tested is the images read, not the fit
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["data_fit"]["samples"] == 24 and rep["data_source"].endswith("24 images, resized to 8x8 and "
                                                                           "standardized with their own mean and std")
    (tmp_path / "images" / "0" / "broken.png").write_bytes(b"not a png")
    r = cli("apply", bare_checkpoint, "--heads", "4", "--data", tmp_path / "images", "--out", tmp_path / "p.pt")
    assert r.returncode == 2 and "broken.png is not a readable image" in r.stderr
    assert not (tmp_path / "p.pt").exists()


def test_noise_as_the_source_needs_no_data_and_is_the_noise_fit_of_initialize_model(tmp_path, cli, bare_checkpoint):
    model = timm_vit()
    want = initialize_model(model, "impulse", data_fit_inputs="noise", data_fit=20, seed=1)
    r = cli("apply", bare_checkpoint, "--heads", "4", "--data", "noise", "--init-param", "data_fit=20", "--seed", "1",
            "--out", tmp_path / "o.pt", "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["data_source"] == "noise: 256 Gaussian inputs N(0, 1) of shape [1, 8, 8] (no data)"
    assert rep["data_fit"]["artifact"] == {**want["data_fit"]["artifact"], "cached": True}
    assert rep["data_fit"]["inputs"] == "noise"
    bare = cli("apply", bare_checkpoint, "--heads", "4", "--init-param", "data_fit=20", "--seed", "1",
               "--out", tmp_path / "p.pt", "--json")  # no --data at all: the same fit
    assert json.loads(bare.stdout)["data_fit"]["artifact"] == rep["data_fit"]["artifact"]
