"""The GPU paths, on a real CUDA GPU: solving on the GPU gives the CPU's solution, training runs
with mixed precision and resumes, the data fit runs on GPU tensors, torchrun joins an NCCL group,
and a local grid shares one GPU between workers.

Skipped unless ``STRUCTINIT_TEST_GPU=1`` (the rest of the suite hides CUDA; see conftest.py) and a
GPU is present: ``STRUCTINIT_TEST_GPU=1 python -m pytest -m gpu tests``. CI has no GPU.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from grids import TINY_GRID, variant

from structinit.solver.config import SolveConfig
from structinit.solver.run import compute
from structinit.training.config import TrainConfig
from structinit.training.loop import train
from structinit.training.rundir import RunDir

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")]

REPO = Path(__file__).resolve().parents[1]
TINY = dict(model="vit-digits", dataset="digits", patch=2, depth=1, dim=32, heads=2, lr=1e-2, warmup_epochs=0.5,
            batch_size=32, init="mimetic", threads=1)


@pytest.mark.parametrize("recipe,params", [("fast", {}), ("closed-form", {}), ("authors-2025", {}),
                                           ("paper", {"iters": 300})])
def test_a_gpu_solve_gives_the_cpu_solution(recipe, params):
    config = SolveConfig(grid=(8, 8), dim=64, heads=4, filter=3, layers=2, recipe=recipe, params=params)
    cpu, gpu = compute(config, device="cpu"), compute(config, device="cuda")
    assert gpu.stats["device"] == torch.cuda.get_device_name(0) and cpu.stats["device"] == "cpu"
    np.testing.assert_array_equal(gpu.offsets, cpu.offsets)
    # closed-form's attention is flat to float32 precision (logits within about 1e-6 of each other,
    # mass 1/N), so which key wins a row's argmax is rounding, and the two devices round differently
    flat = float(cpu.quality.target_mass.max()) < 2.0 / config.grid.tokens
    for measure in ("target_mass",) if flat else ("hit_rate", "target_mass"):
        np.testing.assert_allclose(getattr(gpu.quality, measure), getattr(cpu.quality, measure), atol=0.02,
                                   err_msg=measure)
    # the attention logits the solution gives, not the factors (Q/K are defined up to a rotation)
    x = torch.from_numpy(cpu.pseudo_input)
    logits = {a.stats["device"]: torch.einsum("nd,lhde,mf,lhfe->lhnm", x, torch.from_numpy(a.q), x,
                                              torch.from_numpy(a.k)) for a in (cpu, gpu)}
    ref = logits["cpu"]
    assert torch.allclose(logits[gpu.stats["device"]], ref, atol=0.05 * float(ref.abs().max()))


def test_the_memory_free_for_a_gpu_solve_is_the_devices_free_memory():
    from structinit.solver.run import available_memory

    before = torch.cuda.mem_get_info(0)[0]
    free = available_memory("cuda:0")
    total = torch.cuda.mem_get_info(0)[1]
    assert abs(free - before) < 256 * 2 ** 20 and free < total  # free, not total; other processes may allocate


def test_training_on_the_gpu_uses_bf16_learns_and_resumes(tmp_path):
    straight = train(TrainConfig(epochs=4, device="cuda", out=str(tmp_path / "straight"), **TINY))
    config = json.loads((tmp_path / "straight" / "config.json").read_text())
    assert straight.device == "cuda:0" and config["resolved"]["device"] == "cuda:0"
    assert config["resolved"]["amp"] == ("bfloat16" if torch.cuda.is_bf16_supported() else "float16")
    assert straight.final_acc > 60.0
    # stopped after epoch 2 (where a kill would leave it: the epoch's checkpoint on disk), then resumed
    half = tmp_path / "resumed"

    class Stop(Exception):
        pass

    def stop_after_two(record):
        if record["epoch"] == 2:
            raise Stop

    with pytest.raises(Stop):
        train(TrainConfig(epochs=4, device="cuda", out=str(half), **TINY), on_epoch=stop_after_two)
    resumed = train(TrainConfig(epochs=4, device="cuda", out=str(half), resume=True, **TINY))
    assert resumed.resumed_from == 2
    assert [row["epoch"] for row in RunDir(half).read_metrics()] == [1, 2, 3, 4]
    full = TrainConfig(epochs=4, device="cpu", out=str(tmp_path / "cpu"), amp="off", **TINY)
    cpu = train(full)
    # the same optimization as on the CPU, up to bf16 rounding
    assert straight.metrics[0]["train_loss"] == pytest.approx(cpu.metrics[0]["train_loss"], rel=0.05)
    assert abs(straight.final_acc - cpu.final_acc) < 10.0


def test_the_data_fit_runs_on_gpu_tensors():
    from structinit.analysis.fidelity import data_attention_quality
    from structinit.geometry.grid import Grid
    from structinit.init.initialize import initialize_model
    from structinit.training.augment import normalize
    from structinit.training.datasets import load_dataset
    from structinit.training.models import ModelConfig, build_model

    data = load_dataset("digits")
    x = normalize(data.train.images[:96], data.info.mean, data.info.std).cuda()
    held_out = normalize(data.test.images[:64], data.info.mean, data.info.std).cuda()
    model = build_model(ModelConfig("vit-digits"), num_classes=10, image_size=8, in_chans=1, seed=0).cuda()
    report = initialize_model(model, "impulse", seed=0, data=x, data_fit=120, data_fit_samples=96)
    assert next(model.parameters()).is_cuda  # left where it was
    rows = report["layers"]
    quality = data_attention_quality(model, held_out, [r["offsets"] for r in rows], Grid(report["grid"]),
                                     layers=[r["layer"] for r in rows])
    assert min(r["hit_rate"] for r in quality["layers"]) > 0.8
    assert report["data_fit"]["calibrated_to"] == pytest.approx(0.3)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_torchrun_joins_an_nccl_group_on_the_gpu(tmp_path):
    out = tmp_path / "ddp"
    args = ["--model", "vit-digits", "--dataset", "digits", "--patch", "2", "--depth", "1", "--dim", "32",
            "--heads", "2", "--lr", "1e-2", "--warmup-epochs", "0.5", "--batch-size", "32", "--init", "mimetic"]
    env = dict(os.environ, NPROC="1", NNODES="1", MASTER_ADDR="localhost", MASTER_PORT=str(_free_port()),
               PYTHON=sys.executable, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    r = subprocess.run([str(REPO / "cli" / "torchrun.sh"), *args, "--epochs", "2", "--out", str(out), "--json"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout)
    assert summary["device"] == "cuda:0" and summary["world_size"] == 1
    assert summary["final_acc"] > 40.0


def test_a_local_grid_shares_the_gpu_between_workers(cli, tmp_path):
    grid = tmp_path / "grid.toml"
    grid.write_text(variant(TINY_GRID, name="gpu-tiny", title=None, lr=None, warmup_epochs=None))
    out = cli("bench", "grid", str(grid), "--out", str(tmp_path / "runs"), "--jobs", "2", "--threads", "1", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["outcomes"] == {"finished": 4}
    finals = [json.loads(p.read_text()) for p in (tmp_path / "runs").glob("*/final.json")]
    assert len(finals) == 4 and {f["device"] for f in finals} == {"cuda:0"}
