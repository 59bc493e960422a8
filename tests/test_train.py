"""train(): real digits runs that learn, run files, resume after SIGKILL, torchrun with 2 gloo processes."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import error_line, says

from structinit.errors import UsageError
from structinit.init.registry import parse_assignments as parse_init_params
from structinit.training.config import TrainConfig
from structinit.training.loop import epoch_permutation, lr_at, shard_batches, train
from structinit.training.rundir import RunDir

# A ViT small enough for seconds per run on 2 cores: digits at patch 2 (4x4 tokens), one block.
TINY = dict(model="vit-digits", dataset="digits", patch=2, depth=1, dim=32, heads=2, lr=1e-2, warmup_epochs=0.5,
            batch_size=32, init="mimetic", threads=1)
TINY_ARGS = ["--model", "vit-digits", "--dataset", "digits", "--patch", "2", "--depth", "1", "--dim", "32",
             "--heads", "2", "--lr", "1e-2", "--warmup-epochs", "0.5", "--batch-size", "32", "--init", "mimetic"]
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _one_thread():
    # Two OpenMP threads on a loaded 2-core machine are many times slower than one.
    old = torch.get_num_threads()
    yield
    torch.set_num_threads(old)


def test_lr_schedule():
    lrs = [lr_at(s, 100, 10, 1e-3, 1e-6) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert lrs[10] == pytest.approx(1e-3) and lrs[-1] == pytest.approx(1e-6, abs=1e-6)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))  # cosine decays monotonically
    assert lr_at(55, 100, 10, 1e-3, 1e-6) == pytest.approx((1e-3 + 1e-6) / 2)


def test_two_shards_cover_the_single_process_batch():
    one = list(shard_batches(100, 8, 0, 1, seed=3, epoch=2))
    r0 = list(shard_batches(100, 8, 0, 2, seed=3, epoch=2))
    r1 = list(shard_batches(100, 8, 1, 2, seed=3, epoch=2))
    assert len(one) == len(r0) == len(r1) == 12  # drop-last: 100 // 8
    for b, a0, a1 in zip(one, r0, r1):
        assert torch.equal(b, torch.cat([a0, a1]))
    assert not torch.equal(epoch_permutation(100, 3, 2), epoch_permutation(100, 3, 3))


def test_parse_init_params():
    got = parse_init_params(["filter=5", "share=true", "recipe=released", "target-mass=0.3", "pe_scale=none"])
    assert got == {"filter": 5, "share": True, "recipe": "released", "target_mass": 0.3, "pe_scale": None}
    with pytest.raises(UsageError, match="NAME=VALUE"):
        parse_init_params(["filter"])


@pytest.mark.slow  # four digits epochs that must learn (seconds)
def test_digits_run_learns_and_writes_its_files(tmp_path):
    out = tmp_path / "run"
    result = train(TrainConfig(epochs=4, out=str(out), **TINY))
    assert result.best_acc > 60.0  # chance is 10%
    assert result.params["trainable"] < result.params["total"]  # the frozen sin-cos PE
    rows = RunDir(out).read_metrics()
    assert [r["epoch"] for r in rows] == [1, 2, 3, 4]
    assert {"train_loss", "train_acc", "test_loss", "test_acc", "lr", "images_per_s"} <= set(rows[0])
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]
    final = json.loads((out / "final.json").read_text())
    assert final["best_epoch"]["test_acc"] == pytest.approx(result.best_acc)
    assert final["final_acc"] == rows[-1]["test_acc"] == result.final_acc
    assert final["best_epoch"]["selected_on"] == "test"  # no validation split in this run
    assert final["params"] == result.params and final["wall_seconds"] > 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["resolved"]["hparams"]["opt_eps"] == 1e-8 and cfg["resolved"]["model"]["grid"] == [4, 4]
    assert cfg["config"]["init_params"] == {"base": "pytorch-mlp"}  # train's base, written with the run
    # The base resets its block's fc1 and fc2.
    assert cfg["init_report"]["method"] == "mimetic" and cfg["init_report"]["base_reset"] == 2
    # checkpoint.pt is a timm-style training checkpoint.
    ck = torch.load(out / "checkpoint.pt", weights_only=True)
    assert ck["epoch"] == 4 and ck["arch"] == "vit-digits" and "blocks.0.attn.qkv.weight" in ck["state_dict"]
    assert not any(p.name.endswith(".tmp") for p in out.iterdir())
    # Reusing the directory without --resume is refused; --resume of a finished run returns it.
    with pytest.raises(UsageError, match="already holds a run"):
        train(TrainConfig(epochs=4, out=str(out), **TINY))
    again = train(TrainConfig(epochs=4, out=str(out), resume=True, **TINY))
    assert again.best_acc == result.best_acc and len(RunDir(out).read_metrics()) == 4


def test_impulse_init_parameters_reach_the_init_library(tmp_path):
    cfg = dict(TINY, init="impulse", init_params={"filter": 3, "target_mass": 0.5, "data_fit": 5})
    result = train(TrainConfig(epochs=1, **cfg))
    report = result.init_report
    assert report["method"] == "impulse" and report["grid"] == [4, 4]
    assert report["artifact"]["config"]["params"]["target_mass"] == 0.5
    assert report["data_fit"]["steps"] == 5
    with pytest.raises(UsageError, match="no parameter"):
        train(TrainConfig(epochs=1, **dict(TINY, init="impulse", init_params={"bogus": 1})))


def test_convmixer_with_frozen_filters_trains_around_them(tmp_path):
    from structinit.training.models import ModelConfig, build_model, convmixer_depthwise

    out = tmp_path / "cm"
    cfg = TrainConfig(model="convmixer-256", dataset="synthetic", dim=16, depth=2, kernel=3, filters="box",
                      epochs=2, out=str(out), threads=1, seed=5)
    train(cfg)
    sd = torch.load(out / "checkpoint.pt", weights_only=True)["state_dict"]
    fresh = build_model(ModelConfig("convmixer-256", dim=16, depth=2, kernel=3, filters="box"), num_classes=4,
                        image_size=8, in_chans=1, default_patch=1, seed=5)
    for i, conv in enumerate(convmixer_depthwise(fresh)):
        assert torch.equal(sd[f"blocks.{i}.0.fn.0.weight"], conv.weight)  # frozen: unchanged by training
    assert not torch.equal(sd["blocks.0.1.weight"], fresh.blocks[0][1].weight)  # the pointwise convs trained
    with pytest.raises(UsageError, match="init applies to the ViT presets"):
        train(TrainConfig(model="convmixer-256", dataset="synthetic", init="impulse", epochs=1))


def test_imagefolder_streams_through_a_dataloader(tmp_path):
    from PIL import Image

    for split in ("train", "val"):
        for c in range(2):
            for j in range(8):
                path = tmp_path / "data" / split / f"c{c}" / f"{j}.png"
                path.parent.mkdir(parents=True, exist_ok=True)
                Image.new("RGB", (24, 20), (200 * c, 40 + 10 * j, 90)).save(path)
    result = train(TrainConfig(model="vit-digits", dataset="imagefolder", data_dir=str(tmp_path / "data"),
                               image_size=16, patch=4, depth=1, dim=32, heads=2, batch_size=8, epochs=2, workers=0,
                               threads=1, out=str(tmp_path / "run")))
    assert result.epochs == 2 and result.params["total"] > 0
    cfg = json.loads((tmp_path / "run" / "config.json").read_text())
    assert cfg["resolved"]["dataset"]["num_classes"] == 2 and cfg["resolved"]["model"]["grid"] == [4, 4]


def _env(extra=None):
    env = dict(os.environ, **ONE_THREAD)
    env.update(extra or {})
    return env


@pytest.mark.slow
def test_resume_after_sigkill_repeats_and_skips_nothing(tmp_path, cli):
    out = tmp_path / "killed"
    epochs = 8
    args = ["train", *TINY_ARGS, "--epochs", str(epochs), "--out", str(out)]
    proc = subprocess.Popen([sys.executable, "-m", "structinit", *args], env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    try:
        while len(RunDir(out).read_metrics()) < 2:
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "the run did not finish two epochs"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    done = len(RunDir(out).read_metrics())
    assert 2 <= done < epochs and not (out / "final.json").exists()
    r = cli(*args, "--resume", "--json", env=ONE_THREAD)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    rows = RunDir(out).read_metrics()
    assert [row["epoch"] for row in rows] == list(range(1, epochs + 1))
    # metrics.jsonl is appended before the checkpoint is replaced: a kill in between leaves one
    # epoch more in the log than in the checkpoint, and the resume drops and redoes it.
    assert summary["epochs"] == epochs and summary["resumed_from"] in (done - 1, done)
    assert "resuming" in r.stderr
    # Data order, optimizer state and RNG come back: the resumed run is the uninterrupted one.
    ref = train(TrainConfig(epochs=epochs, **TINY))
    for got, want in zip(rows, ref.metrics):
        assert got["test_acc"] == pytest.approx(want["test_acc"], abs=0.3)
        assert got["train_loss"] == pytest.approx(want["train_loss"], rel=1e-3)


def test_resume_refuses_changed_settings(tmp_path, cli):
    out = tmp_path / "run"
    train(TrainConfig(epochs=1, out=str(out), **TINY))
    r = cli("train", *TINY_ARGS, "--epochs", "2", "--lr", "0.5", "--out", out, "--resume", env=ONE_THREAD)
    assert r.returncode == 2 and "differ" in r.stderr and "lr" in r.stderr and "Traceback" not in r.stderr
    r = cli("train", *TINY_ARGS, "--epochs", "1", "--out", out, env=ONE_THREAD)
    assert r.returncode == 2 and r.stderr.startswith("error:") and "--resume" in r.stderr


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_torchrun_two_gloo_processes_match_one(tmp_path):
    out = tmp_path / "ddp"
    epochs = 3
    # cli/torchrun.sh is `python -m torch.distributed.run ... -m structinit train "$@"`.
    cmd = [str(REPO / "cli" / "torchrun.sh"), *TINY_ARGS, "--epochs", str(epochs), "--out", str(out), "--json"]
    env = _env({"NPROC": "2", "NNODES": "1", "MASTER_ADDR": "localhost", "MASTER_PORT": str(_free_port()),
                "PYTHON": sys.executable})
    # three processes each import torch: minutes on a slow machine beside another test worker
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout)  # only rank 0 printed
    assert summary["world_size"] == 2
    rows = RunDir(out).read_metrics()
    assert [row["epoch"] for row in rows] == [1, 2, 3]  # only rank 0 wrote
    assert json.loads((out / "config.json").read_text())["resolved"]["world_size"] == 2
    ref = train(TrainConfig(epochs=epochs, **TINY))
    # Same global batch of 32 (16 per process): the same optimization up to float summation order.
    assert ref.metrics[0]["train_loss"] == pytest.approx(rows[0]["train_loss"], rel=1e-3)
    assert abs(ref.final_acc - summary["final_acc"]) <= 2.0
    assert summary["final_acc"] > 50.0


def test_each_process_refuses_a_batch_it_cannot_split_before_any_process_group(tmp_path, monkeypatch):
    """Each process refuses before the process group is made: under load, a process that refused after
    joining it left another crashing with a traceback in Gloo's connect. With torchrun's variables set
    and no rendezvous to reach (no MASTER_ADDR), only a refusal made first can return at all."""
    for name, value in {"WORLD_SIZE": "3", "RANK": "1", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    out = tmp_path / "run"
    with pytest.raises(UsageError) as err:
        train(TrainConfig(epochs=1, out=str(out), **TINY))  # a global batch of 32
    says(err.value.render(), "batch_size", "32", "not divisible", "3 processes")
    assert not out.exists()


@pytest.mark.slow
def test_torchrun_refuses_a_global_batch_its_processes_cannot_split(tmp_path):
    out = tmp_path / "ddp"
    cmd = [str(REPO / "cli" / "torchrun.sh"), *TINY_ARGS, "--epochs", "1", "--out", str(out)]  # a batch of 32
    env = _env({"NPROC": "3", "NNODES": "1", "MASTER_ADDR": "localhost", "MASTER_PORT": str(_free_port()),
                "PYTHON": sys.executable})
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode != 0
    assert "error: --batch-size 32 (the global batch) is not divisible by the 3 processes" in r.stderr, r.stderr[-3000:]
    # each process exits 2 with that line; the only traceback is torchrun's own report of failed children
    assert "structinit/training" not in r.stderr and not out.exists()


def test_cli_usage_errors(cli, tmp_path):
    r = cli("train", "--model", "convmixer-256", "--pool", "avg", "--epochs", "1")
    assert r.returncode == 2 and says(error_line(r.stderr), "--pool", "--pos-embed", "ViT presets")
    r = cli("train", "--epochs", "0")
    assert r.returncode == 2 and "--epochs must be a positive integer" in r.stderr
    r = cli("train", "--init-param", "filter=3", "--epochs", "1", env=ONE_THREAD)
    assert r.returncode == 2 and "--init-param needs --init" in r.stderr and "Traceback" not in r.stderr
    r = cli("train", "--help")
    assert r.returncode == 0 and "Example" in r.stdout and "torchrun" in r.stdout
