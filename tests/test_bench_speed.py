"""``structinit bench fit`` and ``bench loop``: what they time and report (their numbers are
measurements for docs/bench-fit.md, not asserted here), and their refusals."""

import json
from pathlib import Path

import pytest
from conftest import error_line

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_bench_fit_times_each_version_against_training_steps(cli):
    # 30 of the fit's 300 steps: what is tested is what the benchmark times and reports (every layer
    # still hits its offsets in over 0.7 of the rows)
    r = cli("bench", "fit", "--dataset", "digits", "--versions", "2", "--samples", "16", "--steps", "30",
            "--train-steps", "1", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["shape"] == {"preset": "vit-digits", "grid": [8, 8], "dim": 64, "heads": 4, "depth": 4,
                            "inputs": "digits", "threads": 1, "device": "cpu"}
    (row,) = doc["rows"]
    assert row["version"] == 2 and row["samples"] == 16 and row["step_images"] == 16
    assert row["seconds"] >= row["fit_seconds"] > 0 and doc["train_step_seconds"] > 0
    assert row["train_steps"] == pytest.approx(row["seconds"] / doc["train_step_seconds"])
    assert 0.5 < row["min_layer_hit_rate"] <= row["hit_rate"] <= 1
    text = cli("bench", "fit", "--model", "vit-digits", "--image-size", "8", "--in-chans", "1", "--samples", "8",
               "--steps", "20", "--train-steps", "1")
    assert text.returncode == 0 and "inputs noise [8, 1, 8, 8]" in text.stdout and " -" in text.stdout


@pytest.mark.slow  # two repeats of two real training loops: seconds on one core
def test_bench_loop_compares_trains_loop_with_a_bare_one(cli):
    # the synthetic set's 512 images, not digits' 1,437: the loops' arithmetic is what is tested
    r = cli("bench", "loop", "--dataset", "synthetic", "--epochs", "1", "--repeats", "2", "--batch-size", "256",
            "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert len(doc["bare"]) == len(doc["train_epoch"]) == len(doc["ratio"]) == 2
    assert doc["ratio"] == pytest.approx([o / b for o, b in zip(doc["train_epoch"], doc["bare"])])
    assert all(v > 0 for v in doc["bare"] + doc["train_epoch"])


def test_bench_fit_times_the_solve_and_the_data_free_fit(cli):
    """The GPU check's options on a tiny shape: the training steps at another batch in bf16, the plain
    solve uncached and cached (each also in training steps), the fit without data beside the fit with
    it (neither read from a cache)."""
    r = cli("bench", "fit", "--image-size", "8", "--in-chans", "1", "--patch", "2", "--samples", "8", "--steps", "5",
            "--train-steps", "1", "--train-batch", "8", "--amp", "bf16", "--data-free", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["shape"]["grid"] == [4, 4] and doc["train_batch"] == 8 and doc["amp"] == "bfloat16"
    step, solve = doc["train_step_seconds"], doc["solve"]
    assert solve["device"] == "cpu" and solve["layers_solved"] >= 1 and solve["seconds"] > 0
    assert solve["train_steps"] == pytest.approx(solve["seconds"] / step)
    assert solve["cached_train_steps"] == pytest.approx(solve["cached_seconds"] / step)
    (given,), (free,) = doc["rows"], doc["data_free_rows"]
    assert (given["inputs"], free["inputs"]) == ("data", "noise") and not given["cached"] and not free["cached"]
    assert free["version"] == given["version"] == 2 and free["steps"] == 5 and free["seconds"] >= free["fit_seconds"]
    assert doc.get("profile") is None


@pytest.mark.slow  # torch.profiler costs two seconds of CPU to start, whatever it profiles
def test_bench_fit_profiles_a_short_fit_where_asked(cli, tmp_path):
    """A profile of a short fit written where asked, and none where the init took longer than
    --profile-over."""
    prof = tmp_path / "prof"
    r = cli("bench", "fit", "--image-size", "8", "--in-chans", "1", "--patch", "2", "--samples", "8", "--steps", "5",
            "--train-steps", "1", "--profile", str(prof), "--profile-steps", "3", "--json")
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)["profile"]
    assert p["steps"] == 3 and p["dir"] == str(prof) and p["kernel_launches"] == 0 and p["matmuls"]["calls"] > 0
    assert sorted(f.name for f in prof.iterdir()) == ["fit-ops.txt", "fit-trace.json.gz"]
    assert "by op and input shapes" in (prof / "fit-ops.txt").read_text()
    skip = cli("bench", "fit", "--image-size", "8", "--in-chans", "1", "--samples", "8", "--steps", "2",
               "--train-steps", "1", "--profile", str(tmp_path / "none"), "--profile-over", "1000")
    assert skip.returncode == 0 and "profile: skipped (the init took" in skip.stdout
    assert not (tmp_path / "none").exists()


@pytest.mark.filterwarnings("ignore:impulse. the data fit left:UserWarning")
def test_the_uncached_solve_is_solved_even_where_the_package_ships_it(tmp_path):
    from structinit.benchmarks.fit import run_fit_bench

    doc = run_fit_bench("vit-digits", dataset="digits", samples=8, steps=2, train_steps=1, cache_dir=tmp_path)
    assert doc["solve"]["shipped"] is True and (tmp_path / doc["solve"]["artifact"]).is_file()
    assert "data_free_rows" not in doc and "profile" not in doc and doc["amp"] == "off" and doc["train_batch"] == 64


def test_bench_loop_times_timms_own_model_in_a_third_loop(cli):
    r = cli("bench", "loop", "--dataset", "noise", "--image-size", "8", "--in-chans", "1", "--images", "64",
            "--batch-size", "32", "--epochs", "1", "--repeats", "2", "--timm-model", "test_vit", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["dataset"] == "noise [64, 1, 8, 8]" and doc["images"] == 64 and doc["timm_model"] == "test_vit"
    assert len(doc["timm_bare"]) == len(doc["timm_ratio"]) == 2 and all(v > 0 for v in doc["timm_bare"])
    assert doc["timm_ratio"] == pytest.approx([o / t for o, t in zip(doc["train_epoch"], doc["timm_bare"])])
    assert doc["timm_ratio_median"] == pytest.approx(sum(doc["timm_ratio"]) / 2)


@pytest.mark.parametrize("args, message", [
    (["fit", "--versions", "3"], "versions must be among 1, 2, got 3"),
    (["fit", "--versions", "two"], "--versions takes comma-separated integers, got 'two'"),
    (["fit", "--versions", "2,2"], "error: --versions names version 2 more than once; each version is timed once"),
    (["fit", "--dataset", "digits", "--image-size", "8"], "--image-size and --in-chans shape the noise images"),
    (["fit", "--dataset", "mnist1d"], "the fit benchmark takes an in-memory image dataset"),
    (["loop", "--batch-size", "5000"], "--batch-size 5000 is larger than the 1437 training images of digits"),
    (["fit", "--amp", "fp8"], "error: unknown --amp 'fp8'; choose one of auto, bf16, fp16, off"),
    (["fit", "--dataset", "digits", "--patch", "2"], "--patch sets the patch on noise images; --dataset digits has"),
    (["fit", "--profile-over", "2"], "error: --profile-over and --profile-steps need --profile DIR"),
    (["fit", "--profile", "pyproject.toml"], "error: --profile pyproject.toml is not a folder"),
    (["loop", "--amp", "fp8"], "error: unknown --amp 'fp8'; choose one of auto, bf16, fp16, off"),
    (["loop", "--images", "8"], "--image-size, --in-chans and --images shape the noise images; --dataset digits"),
    (["loop", "--dataset", "noise", "--images", "8"], "--batch-size 64 is larger than the 8 training images of noise"),
    (["loop", "--timm-model", "no_such_vit"], "error: unknown --timm-model 'no_such_vit': not a timm model name"),
    (["loop", "--timm-model", "test_resnet"], "error: --timm-model test_resnet: timm cannot build it at 8x8, patch 1"),
])
def test_bad_benchmark_settings_are_one_line(cli, args, message, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[1])  # pyproject.toml: a file, not a folder
    r = cli("bench", *args)
    assert r.returncode == 2 and message in error_line(r.stderr)


@pytest.mark.slow
def test_the_device_check_script_runs_its_steps_and_summarizes_them(tmp_path):
    """scripts/device-check.sh in its CPU smoke mode: every step runs, and device-check.json and
    summary.md say what each measured, on the CPU, without judging the GPU's floors (on a GPU the same
    script adds the GPU tests and measures at the ViT-T and ViT-S/16 shapes)."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "out"
    env = dict(os.environ, DEVICE="cpu", QUICK="1", PYTHON=sys.executable)
    r = subprocess.run(["bash", str(repo / "scripts" / "device-check.sh"), str(out)], cwd=repo, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    doc = json.loads((out / "device-check.json").read_text())
    assert [(s["step"], s["exit"]) for s in doc["steps"]] == [("solver", 0), ("fit-vit-t", 0), ("fit-vit-s", 0),
                                                              ("loop", 0)]
    assert doc["device"].startswith("cpu (no GPU)") and doc["quick"] is True and doc["gpu_tests"] is None
    assert doc["fit_vit_t_seconds"] > 0 and doc["fit_vit_t_training_steps"] > 0 and doc["date"]
    assert doc["fit_vit_t_data_free_seconds"] > 0 and doc["fit_vit_s_solve_uncached_seconds"] > 0
    assert doc["train_vs_bare_loop"] > 0 and doc["train_vs_timm_loop"] > 0
    assert set(doc["floors"].values()) == {None}  # a CPU smoke test judges no floor
    assert doc["raw"]["fit-vit-s"]["shape"]["grid"] == [4, 4] and doc["raw"]["loop"]["timm_model"] == \
        "vit_tiny_patch16_224"
    assert {r["recipe"] for r in doc["raw"]["solver"]["rows"]} == {"fast", "paper"}
    assert (out / "profile-vit-t" / "fit-ops.txt").is_file()
    md = (out / "summary.md").read_text()
    assert md.startswith("# structinit device check, ") and "Device: cpu (no GPU)" in md and "| loop | 0 |" in md
