"""Nothing on disk or on the command line is trusted by `apply` and the fitted-artifact cache: an
artifact under a fitted artifact's name must be that fit, bad inputs are one `error:` line (exit 2)
with nothing written, and the report names this call's inputs."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import error_line, says, vit_digits

from structinit.init.initialize import initialize_model
from structinit.solver.artifact import read_artifact

pytestmark = pytest.mark.usefixtures("one_torch_thread")
FIT = dict(data_fit=10, filter=5, data_fit_samples=16)  # a shape whose plain solve is not shipped: every artifact is
# the user cache's; 16 noise inputs, not 256: these tests are about the files, the fit is tested in test_data_fit


vit = vit_digits


@pytest.fixture
def checkpoint(tmp_path):
    """A timm ViT of the digits shape (sin-cos table, 4 heads) as a bare state dict."""
    path = tmp_path / "vit.pt"
    torch.save(vit().state_dict(), path)
    return path


def one_error(r, code=2, *needles):
    assert r.returncode == code, (r.returncode, r.stderr)
    line = error_line(r.stderr)
    for needle in needles:
        assert needle in line, (needle, line)
    return line


def test_another_artifact_under_a_fitted_name_is_set_aside_and_the_fit_recomputed(cache_dir):
    """C5: the plain solve copied to where the fitted artifact lives is a valid artifact of another
    kind: reported, set aside (kept, not deleted) and fitted again; the report is the fit's."""
    first = initialize_model(vit(), "impulse", **FIT)
    fitted = Path(first["data_fit"]["artifact"]["path"])
    plain = Path(first["artifact"]["path"])
    assert fitted.parent == plain.parent == cache_dir
    fitted.write_bytes(plain.read_bytes())
    with pytest.warns(UserWarning, match=r"ignoring unusable artifact: .* holds the plain solve .*, not the fitted "
                                         r"artifact " + first["data_fit"]["artifact"]["key"]) as seen:
        again = initialize_model(vit(), "impulse", **FIT)
    assert "set aside as " + fitted.name + ".set-aside" in str(seen.list[0].message)
    assert (fitted.parent / (fitted.name + ".set-aside")).read_bytes() == plain.read_bytes()
    assert again["data_fit"]["artifact"]["cached"] is False
    assert again["data_fit"]["layers"] == first["data_fit"]["layers"]
    assert read_artifact(fitted).fit is not None


def test_an_edited_header_of_a_fitted_artifact_is_caught(cache_dir):
    from safetensors.numpy import load, save

    first = initialize_model(vit(), "impulse", **FIT)
    path = Path(first["data_fit"]["artifact"]["path"])
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    meta = json.loads(raw[8:8 + n])["__metadata__"]
    fit = json.loads(meta["fit"])
    fit["report"]["layers"][0]["hit_rate"] = 1.0  # a better number than the fit measured
    meta["fit"] = json.dumps(fit, sort_keys=True)
    path.write_bytes(save(load(raw), metadata=meta))
    with pytest.warns(UserWarning, match="header checksum mismatch"):
        again = initialize_model(vit(), "impulse", **FIT)
    assert again["data_fit"]["artifact"]["cached"] is False
    assert again["data_fit"]["layers"][0]["hit_rate"] == first["data_fit"]["layers"][0]["hit_rate"] < 1.0


def test_a_folder_at_an_artifacts_name_is_set_aside(cache_dir):
    """C10: a folder where an artifact file belongs: set aside in one warning, then computed."""
    first = initialize_model(vit(), "impulse", **FIT)
    for key in ("artifact", "data_fit"):
        path = Path((first[key]["artifact"] if key == "data_fit" else first[key])["path"])
        assert path.parent == cache_dir  # never the shipped artifacts
        path.unlink()
        path.mkdir()
        (path / "inside").write_text("kept")
    with pytest.warns(UserWarning, match="a folder, not an artifact file") as seen:
        again = initialize_model(vit(), "impulse", **FIT)
    folders = [str(w.message) for w in seen.list if "a folder, not an artifact file" in str(w.message)]
    assert len(folders) == 2 and again["data_fit"]["artifact"]["cached"] is False  # the solve's and the fit's
    assert Path(again["artifact"]["path"]).is_file()
    assert sorted(p.name for p in cache_dir.glob("*.set-aside")) == sorted(
        Path(p).name + ".set-aside" for p in (first["artifact"]["path"], first["data_fit"]["artifact"]["path"]))
    assert all((p / "inside").read_text() == "kept" for p in cache_dir.glob("*.set-aside"))


@pytest.mark.parametrize("make, args, message", [
    (None, ["--data", ""], "--data needs a source"),
    (lambda d: torch.save(torch.randn(4, 1, 8, 8), d / "x.pt"), ["--data", "{d}/x.pt", "--data-dir", "{d}"],
     "--data-dir is where a named dataset is read from; --data is the tensor file"),
    (lambda d: torch.save(torch.tensor(3.0), d / "x.pt"), ["--data", "{d}/x.pt"], "is a single number (a 0-d tensor)"),
    (lambda d: np.save(d / "x.npy", np.array(["a", "b"])), ["--data", "{d}/x.npy"], "holds <U1 values, not numbers"),
    (lambda d: np.save(d / "x.npy", np.zeros(4, dtype=[("a", "f4"), ("b", "i4")])), ["--data", "{d}/x.npy"],
     "values, not numbers"),
    (lambda d: torch.save(torch.randn(4, 1, 8, 8).to_sparse(), d / "x.pt"), ["--data", "{d}/x.pt"],
     "is a sparse tensor"),
])
def test_inputs_that_are_no_batch_are_one_line_and_nothing_is_written(tmp_path, cli, checkpoint, make, args,
                                                                       message):
    """D40 (an empty --data, e.g. an unset shell variable, would read the current folder), G13 (an
    option that would do nothing), D13, D26, D27, D30 (tensors that are no batch of inputs)."""
    if make is not None:
        make(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    r = cli("apply", checkpoint, "--heads", "4", "--out", tmp_path / "o.pt", *[a.format(d=tmp_path) for a in args])
    one_error(r, 2, message)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_inputs_of_another_precision_are_cast_not_refused(tmp_path, cli, checkpoint, dtype):
    """Every tensor file format that can hold the precision (NumPy has no bfloat16) is read, and the
    fit runs on its values cast to float32: the fitted artifact's batch is those values, and the
    three files are one fit."""
    from safetensors.torch import save_file

    from structinit.fit.identity import batch_digest
    from structinit.training.augment import normalize
    from structinit.training.datasets import load_dataset

    data = load_dataset("digits")
    x = normalize(data.train.images[:32], data.info.mean, data.info.std).to(dtype)
    files = [tmp_path / "x.pt", tmp_path / "x.safetensors"]
    torch.save(x, files[0])
    save_file({"inputs": x}, str(files[1]))
    if dtype != torch.bfloat16:
        np.save(tmp_path / "x.npy", x.numpy())
        files.append(tmp_path / "x.npy")
    keys = set()
    for i, f in enumerate(files):
        r = cli("apply", checkpoint, "--heads", "4", "--data", f, "-p", "data_fit=5", "--out", tmp_path / f"o{i}.pt",
                "--json")
        assert r.returncode == 0, (f.name, r.stderr)
        fit = json.loads(r.stdout)["data_fit"]
        assert fit["samples"] == 32 and fit["inputs"] == "data" and fit["artifact"]["cached"] is (i > 0), f.name
        assert read_artifact(fit["artifact"]["path"]).fit["identity"]["batch"] == batch_digest(x.float()), f.name
        keys.add(fit["artifact"]["key"])
    assert len(keys) == 1


def test_a_hugging_face_checkpoint_without_transformers_says_what_to_install(tmp_path, cli, monkeypatch):
    """H1: the model of a Hugging Face checkpoint is built by transformers; without it --data is one
    line naming the extra to install, and without --data the plain solve is written, saying why."""
    from safetensors.torch import save_file

    d, h = 32, 4
    sd = {"embeddings.position_embeddings": torch.randn(1, 17, d), "embeddings.cls_token": torch.zeros(1, 1, d),
          "embeddings.patch_embeddings.projection.weight": torch.randn(d, 1, 2, 2)}
    for i in range(2):
        for p in ("query", "key", "value"):
            sd[f"encoder.layer.{i}.attention.attention.{p}.weight"] = torch.randn(d, d) * 0.02
            sd[f"encoder.layer.{i}.attention.attention.{p}.bias"] = torch.zeros(d)
        sd[f"encoder.layer.{i}.attention.output.dense.weight"] = torch.randn(d, d) * 0.02
    (tmp_path / "hf").mkdir()
    save_file(sd, tmp_path / "hf" / "model.safetensors")
    (tmp_path / "hf" / "config.json").write_text(json.dumps({
        "model_type": "vit", "hidden_size": d, "num_attention_heads": h, "num_hidden_layers": 2, "image_size": 8,
        "patch_size": 2, "num_channels": 1}))
    torch.save(torch.randn(4, 1, 8, 8), tmp_path / "x.pt")
    monkeypatch.setitem(__import__("sys").modules, "transformers", None)  # not installed
    r = cli("apply", tmp_path / "hf" / "model.safetensors", "--data", tmp_path / "x.pt", "--out", tmp_path / "o.st")
    one_error(r, 2, "built by Hugging Face transformers, which is not installed", "pip install 'structinit[hf]'")
    for plain in ([], ["--dry-run"]):  # no data: the missing extra is the cause, not the learned position embedding
        r = cli("apply", tmp_path / "hf" / "model.safetensors", *plain, "--out", tmp_path / "o.st")
        line = one_error(r, 2, "built by Hugging Face transformers, which is not installed", "structinit[hf]",
                         "--set-pe sincos")
        assert "is not the sin-cos table" not in line
    assert not (tmp_path / "o.st").exists()
    r = cli("apply", tmp_path / "hf" / "model.safetensors", "--set-pe", "sincos", "--out", tmp_path / "p.safetensors",
            "--json")
    assert r.returncode == 0, r.stderr
    assert "which is not installed (pip install 'structinit[hf]'" in json.loads(r.stdout)["data_fit"]["skipped"]


def test_a_cached_fit_is_reported_with_this_calls_inputs(tmp_path, cli, checkpoint):
    """R1: two files of the same inputs give one fit; the second call reads it from the cache and its
    report names its own file, the same in data_source and data_fit.source."""
    x = torch.randn(16, 1, 8, 8)
    torch.save(x, tmp_path / "a.pt")
    torch.save(x.clone(), tmp_path / "b.pt")
    reps = []
    for name in ("a", "b"):
        r = cli("apply", checkpoint, "--heads", "4", "--data", tmp_path / f"{name}.pt", "-p", "data_fit=5", "--out",
                tmp_path / f"o-{name}.pt", "--json")
        assert r.returncode == 0, r.stderr
        reps.append(json.loads(r.stdout))
    a, b = reps
    assert a["data_fit"]["artifact"]["key"] == b["data_fit"]["artifact"]["key"]
    assert a["data_fit"]["artifact"]["cached"] is False and b["data_fit"]["artifact"]["cached"] is True
    for rep, name in ((a, "a"), (b, "b")):
        assert rep["data_source"] == rep["data_fit"]["source"] == f"{tmp_path / (name + '.pt')}: the first 16 inputs"
    text = cli("apply", checkpoint, "--heads", "4", "--data", tmp_path / "b.pt", "-p", "data_fit=5", "--out",
               tmp_path / "o-c.pt").stdout
    assert f"on {tmp_path / 'b.pt'}: the first 16 inputs" in text and "read from the cache" in text
    assert os.path.exists(tmp_path / "o-c.pt")


def _hf_folder(folder, d=32, h=4):
    """A Hugging Face ViT folder as save_pretrained lays it out (config.json and model.safetensors),
    made without transformers."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    sd = {"embeddings.position_embeddings": torch.randn(1, 17, d), "embeddings.cls_token": torch.zeros(1, 1, d),
          "embeddings.patch_embeddings.projection.weight": torch.randn(d, 1, 2, 2)}
    for i in range(2):
        for p in ("query", "key", "value"):
            sd[f"encoder.layer.{i}.attention.attention.{p}.weight"] = torch.randn(d, d) * 0.02
            sd[f"encoder.layer.{i}.attention.attention.{p}.bias"] = torch.zeros(d)
        sd[f"encoder.layer.{i}.attention.output.dense.weight"] = torch.randn(d, d) * 0.02
    folder.mkdir()
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({
        "model_type": "vit", "hidden_size": d, "num_attention_heads": h, "num_hidden_layers": 2, "image_size": 8,
        "patch_size": 2, "num_channels": 1}))
    return folder


def test_a_hugging_face_folder_is_read_as_its_weights_and_written_as_a_folder(tmp_path, cli):
    """Issue 45: `apply DIR` on a save_pretrained folder is the apply of its weights file, written
    as a folder of the same files (DIR.METHOD beside it); in place, its weights file is replaced and
    kept as model.safetensors.bak. A folder that is not one is refused saying what one holds, and
    sharded weights are refused naming the index."""
    from safetensors.torch import load_file

    src = _hf_folder(tmp_path / "vit")
    args = ["--set-pe", "sincos", "--data-fit", "0", "--json"]
    r = cli("apply", src, *args)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    out = tmp_path / "vit.impulse"
    assert rep["output"] == str(out) and sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    r = cli("apply", src / "model.safetensors", *args, "--out", tmp_path / "file.safetensors")
    assert r.returncode == 0, r.stderr
    folder_sd, file_sd = load_file(out / "model.safetensors"), load_file(tmp_path / "file.safetensors")
    assert sorted(folder_sd) == sorted(file_sd) and all(torch.equal(folder_sd[k], file_sd[k]) for k in file_sd)
    assert (out / "config.json").read_text() == (src / "config.json").read_text()
    r = cli("apply", src, *args, "--in-place")
    assert r.returncode == 0, r.stderr
    inplace = load_file(src / "model.safetensors")
    assert all(torch.equal(inplace[k], file_sd[k]) for k in file_sd) and (src / "model.safetensors.bak").is_file()
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "weights.pt").write_bytes(b"")
    r = cli("apply", tmp_path / "plain", *args)
    assert r.returncode == 2 and says(error_line(r.stderr), str(tmp_path / "plain"), "is a folder",
                                      "the checkpoint file inside it", "config.json")
    (src / "model.safetensors.index.json").write_text("{}")
    r = cli("apply", src, *args, "--out", tmp_path / "sharded")
    assert r.returncode == 2 and says(error_line(r.stderr), "shards", "model.safetensors.index.json")
    assert not (tmp_path / "sharded").exists()
