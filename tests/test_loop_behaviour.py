"""The training loop's behaviour, in process and in seconds: the learning rate it sets and logs is
the schedule's at that step, the best epoch is chosen where documented, a resumed run is the
uninterrupted one, and forced failures (divergence, a failed write) end in the documented error
with nothing half-written."""

import json
import math

import pytest
import torch
from conftest import says

from structinit.errors import StructinitError, UsageError
from structinit.training.config import TrainConfig
from structinit.training.loop import StepContext, build_optimizer, evaluate, lr_at, train, train_epoch
from structinit.training.rundir import CHECKPOINT_FORMAT, RunDir, load_train_checkpoint

# 320 digits in batches of 32: 10 steps an epoch, a tenth of a second each epoch.
QUICK = dict(model="vit-digits", dataset="digits", patch=2, depth=1, dim=32, heads=2, lr=1e-2, warmup_epochs=0.5,
             batch_size=32, train_size=320, threads=1)
STEPS = 10


@pytest.fixture(autouse=True)
def _keep_threads():
    old = torch.get_num_threads()
    yield
    torch.set_num_threads(old)


def files(path):
    return sorted(p.name for p in path.iterdir())


class Stop(Exception):
    """Raised from on_epoch to stop a run as a kill after an epoch's checkpoint would."""


def train_until(config, epoch):
    """Train ``config`` and stop it (:class:`Stop`) right after ``epoch``'s checkpoint."""
    def stop(record):
        if record["epoch"] == epoch:
            raise Stop

    with pytest.raises(Stop):
        train(config, on_epoch=stop)


def test_logged_lr_is_the_schedule_at_each_epochs_last_step(tmp_path):
    epochs = 4
    out = tmp_path / "run"
    seen = []
    result = train(TrainConfig(epochs=epochs, out=str(out), min_lr=1e-4, **QUICK),
                   on_step=lambda e, s, n: seen.append((e, s, n)))
    total, warmup = epochs * STEPS, round(0.5 * STEPS)
    for record in result.metrics:
        last_step = record["epoch"] * STEPS - 1
        assert record["lr"] == pytest.approx(lr_at(last_step, total, warmup, 1e-2, 1e-4), rel=1e-12)
    assert 1e-4 < result.metrics[-1]["lr"] < 1.3e-4  # the last step's lr: the cosine reaches min_lr one step later
    assert len({r["lr"] for r in result.metrics}) == epochs  # no restart per epoch
    assert seen == [(e, s, STEPS) for e in range(1, epochs + 1) for s in range(1, STEPS + 1)]
    ck = load_train_checkpoint(out / "checkpoint.pt")
    assert all(g["lr"] == pytest.approx(result.metrics[-1]["lr"]) for g in ck["optimizer"]["param_groups"])
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["resolved"]["steps_per_epoch"] == STEPS and cfg["resolved"]["train_images"] == 320
    assert cfg["resolved"]["hparams"]["min_lr"] == 1e-4 and cfg["key"] == result.key


def test_train_epoch_sets_the_lr_of_every_step_before_it():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    opt, trainable = build_optimizer(net, {"lr": 0.1, "opt_eps": 1e-8, "weight_decay": 0.05})
    assert [g["weight_decay"] for g in opt.param_groups] == [0.05, 0.0]  # matrices only
    assert {id(p) for p in opt.param_groups[0]["params"]} == {id(net[0].weight), id(net[2].weight)}
    assert len(trainable) == 4
    used = []
    opt.register_step_pre_hook(lambda o, args, kwargs: used.append([g["lr"] for g in o.param_groups]))
    sc = StepContext(net=net, opt=opt, trainable=trainable, criterion=torch.nn.CrossEntropyLoss(),
                     autocast=lambda: torch.autocast("cpu", enabled=False), grad_clip=0.5)
    x, y = torch.randn(5, 6, 4), torch.randint(0, 3, (5, 6))
    steps = []
    sums, lr = train_epoch(sc, zip(x, y), lambda s: 0.01 * (s + 1), on_step=steps.append)
    assert used == [[0.01 * (s + 1)] * 2 for s in range(5)] and lr == pytest.approx(0.05)
    assert steps == [1, 2, 3, 4, 5] and net.training
    # with lr 0 the weights stay, so the sums are the loss and hits of these weights
    sums, _ = train_epoch(sc, zip(x, y), lambda s: 0.0)
    with torch.no_grad():
        logits = net(x.reshape(-1, 4))
        want_loss = float(torch.nn.functional.cross_entropy(logits, y.reshape(-1), reduction="sum"))
        want_correct = int((logits.argmax(-1) == y.reshape(-1)).sum())
    assert sums.dtype == torch.float64 and sums.tolist() == pytest.approx([want_loss, want_correct, 30])
    ev = evaluate(net, zip(x, y), lambda: torch.autocast("cpu", enabled=False), "cpu")
    assert ev.dtype == torch.float64 and ev.tolist() == pytest.approx([want_loss, want_correct, 30])
    assert not net.training  # evaluate leaves the model in eval mode


def test_an_epoch_without_batches_sums_nothing_and_has_no_lr():
    net = torch.nn.Linear(4, 3)
    opt, trainable = build_optimizer(net, {"lr": 0.1, "opt_eps": 1e-8, "weight_decay": 0.0})
    sc = StepContext(net=net, opt=opt, trainable=trainable, criterion=torch.nn.CrossEntropyLoss(),
                     autocast=lambda: torch.autocast("cpu", enabled=False), grad_clip=0.0)
    sums, lr = train_epoch(sc, [], lambda s: 0.1)
    assert math.isnan(lr) and sums.dtype == torch.float64 and sums.tolist() == [0.0, 0.0, 0.0]


def test_gradients_are_clipped_to_grad_clip():
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 3)
    opt, trainable = build_optimizer(net, {"lr": 0.0, "opt_eps": 1e-8, "weight_decay": 0.0})
    norms = []
    opt.register_step_pre_hook(lambda o, a, k: norms.append(float(torch.norm(torch.stack(
        [p.grad.norm() for p in trainable])))))
    sc = StepContext(net=net, opt=opt, trainable=trainable, criterion=torch.nn.CrossEntropyLoss(),
                     autocast=lambda: torch.autocast("cpu", enabled=False), grad_clip=1e-3)
    x, y = 100 * torch.randn(1, 8, 4), torch.randint(0, 3, (1, 8))
    train_epoch(sc, zip(x, y), lambda s: 0.0)
    assert norms[0] == pytest.approx(1e-3, rel=1e-4)
    sc.grad_clip = 0.0  # no clipping
    train_epoch(sc, zip(x, y), lambda s: 0.0)
    assert norms[1] > 1e-2


def test_an_interrupted_run_resumed_is_the_uninterrupted_run(tmp_path):
    # random crops draw from torch's generator: the resume must restore it, not only the weights
    settings = dict(QUICK, seed=3, init="mimetic", augment="crop-flip")
    ref = train(TrainConfig(epochs=4, **settings))
    out = tmp_path / "run"
    cfg = TrainConfig(epochs=4, out=str(out), **settings)

    train_until(cfg, 2)
    assert RunDir(out).state == "resumable" and len(RunDir(out).read_metrics()) == 2
    # a kill between the metrics append and the checkpoint leaves one more line in the log
    RunDir(out).append_metrics({"epoch": 3, "train_loss": 123.0})
    RunDir(out).write_final({"stale": True})  # a result that does not belong to the checkpoint
    logs, states = [], []
    resumed = train(TrainConfig(epochs=4, out=str(out), resume=True, **settings), log=logs.append,
                    on_epoch=lambda r: states.append(RunDir(out).state))
    assert states == ["resumable", "resumable"]  # not "finished" while it trains
    assert resumed.resumed_from == 2 and any(f"resuming {out} after epoch 2/4" in m for m in logs)
    rows = RunDir(out).read_metrics()
    assert [r["epoch"] for r in rows] == [1, 2, 3, 4] and rows[2]["train_loss"] != 123.0
    for got, want in zip(rows, ref.metrics):
        for key in ("train_loss", "train_acc", "lr", "test_acc", "test_loss"):
            assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), (got["epoch"], key)
    assert resumed.final_acc == pytest.approx(ref.final_acc) and resumed.best_epoch == ref.best_epoch
    assert resumed.metrics == rows
    final = json.loads((out / "final.json").read_text())
    assert final["resumed_from"] == 2 and final["epochs"] == 4 and "stale" not in final
    assert final["wall_seconds"] >= load_train_checkpoint(out / "checkpoint.pt")["elapsed"] - 1e-3
    # resuming a finished run returns its result without training
    again = train(TrainConfig(epochs=4, out=str(out), resume=True, **settings), log=logs.append)
    assert again.resumed_from == 4 and again.final_acc == final["final_acc"] and again.best_acc == resumed.best_acc
    assert again.metrics == rows and again.key == cfg.key and any("finished all 4 epochs" in m for m in logs)
    assert again.best_epoch == resumed.best_epoch and again.best_on == "test" and again.epochs == 4
    assert again.final_val_acc is None and again.out == str(out) and again.params == resumed.params


@pytest.mark.parametrize("init, params", [("impulse", {"data_fit": 5, "data_fit_samples": 16}),
                                           ("impulse-2025", {})])
def test_a_resumed_run_keeps_its_init_record_and_refits_nothing(tmp_path, monkeypatch, init, params):
    """The checkpoint holds the weights: a resume does not fit the init to data again (minutes on a
    CPU), keeps the report and epoch-0 attention it recorded, and still gets what the init sets
    besides weights (impulse-2025 makes the frozen sin-cos embedding learnable)."""
    import warnings

    settings = dict(QUICK, seed=2, init=init, init_params=params)
    ref = train(TrainConfig(epochs=2, **settings))
    out = tmp_path / "run"

    train_until(TrainConfig(epochs=2, out=str(out), **settings), 1)
    config_before = json.loads((out / "config.json").read_text())
    epoch0 = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][0]
    assert epoch0["epoch"] == 0 and epoch0["init_attention"] == config_before["init_report"]["data_attention"]

    import structinit.fit.refine as data_fit

    def refit(*args, **kwargs):
        raise AssertionError("the data fit ran again on resume")

    monkeypatch.setattr(data_fit, "refine_qk", refit)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "data_fit not run" warning either
        resumed = train(TrainConfig(epochs=2, out=str(out), resume=True, **settings))
    assert resumed.resumed_from == 1
    assert resumed.params == ref.params  # the trainable count: the init's requires_grad came back too
    assert resumed.init_report == config_before["init_report"]  # the run's own, "cached" and all
    assert resumed.init_report["data_attention"] == ref.init_report["data_attention"]
    for key in ("train_loss", "test_acc", "test_loss"):
        assert resumed.metrics[-1][key] == pytest.approx(ref.metrics[-1][key], rel=1e-6, abs=1e-9), key
    config_after = json.loads((out / "config.json").read_text())
    assert config_after["init_report"] == config_before["init_report"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[0] == epoch0 and [r["epoch"] for r in rows] == [0, 1, 2]


def test_a_finished_runs_result_comes_from_its_checkpoint_field_by_field(tmp_path):
    """Every field from the checkpoint's own record (the last epoch's accuracies, not another's),
    and where it is read: the world and device of the processes reading it. The end-to-end test
    below runs two epochs in one CPU process, where epoch 1 is also the last but one and the world
    and device are the defaults."""
    from types import SimpleNamespace

    from structinit.training.result import result_from_checkpoint

    metrics = [{"epoch": e, "test_acc": 10.0 * e, "val_acc": 20.0 + e} for e in (1, 2, 3)]
    ck = {"metrics": metrics, "best_acc": 30.0, "best_epoch": 3, "best_on": "val", "elapsed": 12.5,
          "params": {"total": 7}, "epoch": 3}
    r = result_from_checkpoint(ck, RunDir(tmp_path / "run"), SimpleNamespace(world=4, device="cuda:1"), "abc")
    assert (r.final_acc, r.final_val_acc, r.best_acc, r.best_epoch, r.best_on) == (30.0, 23.0, 30.0, 3, "val")
    assert (r.epochs, r.wall_seconds, r.params, r.metrics, r.resumed_from) == (3, 12.5, {"total": 7}, metrics, 3)
    assert (r.out, r.key, r.world_size, r.device) == (str(tmp_path / "run"), "abc", 4, "cuda:1")


def test_a_runs_final_record_names_the_versions_it_ran_under_and_its_key_does_not(tmp_path):
    """final.json, config.json and the checkpoint record Python, torch, timm, numpy, structinit,
    the platform and the device as this process has them; the run key is the same without them."""
    import platform

    import numpy
    import timm

    from structinit import __version__

    out = tmp_path / "run"
    config = TrainConfig(epochs=1, out=str(out), **QUICK)
    train(config)
    final = json.loads((out / "final.json").read_text())
    want = {"python": platform.python_version(), "torch": torch.__version__, "timm": timm.__version__,
            "numpy": numpy.__version__, "structinit": __version__, "platform": platform.platform(), "device": "cpu"}
    assert {k: final["versions"][k] for k in want} == want
    assert json.loads((out / "config.json").read_text())["versions"] == final["versions"]
    assert load_train_checkpoint(out / "checkpoint.pt")["versions"] == final["versions"]
    assert final["key"] == config.key and "versions" not in json.dumps(config.to_dict())


def test_a_finished_run_trained_again_returns_the_result_it_returned(tmp_path):
    """From its checkpoint, without training: every field as the run returned it, but the time
    (the checkpoint's, before the last evaluation) and where it resumed from."""
    from dataclasses import asdict

    out = tmp_path / "run"
    first = train(TrainConfig(epochs=2, out=str(out), val_size=64, seed=1, init="mimetic", **QUICK))
    final = json.loads((out / "final.json").read_text())
    (out / "final.json").write_text(json.dumps(dict(final, final_acc=-1.0, wall_seconds=0)))  # the checkpoint is
    # the record, not this (a final.json that does not check out is damaged: tests/test_run_integrity.py)
    logs = []
    again = train(TrainConfig(epochs=2, out=str(out), val_size=64, seed=1, init="mimetic", resume=True, **QUICK),
                  log=logs.append)
    assert any(f"{out} finished all 2 epochs already" in m for m in logs)
    ck = load_train_checkpoint(out / "checkpoint.pt")
    assert again.wall_seconds == ck["elapsed"] and 0 < again.wall_seconds <= first.wall_seconds
    assert again.resumed_from == 2 and first.resumed_from is None
    assert again.best_on == "val" and again.final_val_acc == first.metrics[-1]["val_acc"]
    assert again.world_size == 1 and again.device == "cpu"
    differ = {"wall_seconds", "resumed_from", "init_report"}
    assert {k: v for k, v in asdict(again).items() if k not in differ} == \
        {k: v for k, v in asdict(first).items() if k not in differ}


def test_the_run_line_and_the_evaluation_match_the_weights(tmp_path):
    from structinit.training.augment import normalize
    from structinit.training.datasets import DATASETS, load_dataset
    from structinit.training.models import build_model

    out = tmp_path / "run"
    logs = []
    result = train(TrainConfig(epochs=2, out=str(out), val_size=50, init="kaiming", **QUICK), log=logs.append)
    trainable = result.params["trainable"]
    assert logs[0] == (f"vit-digits ({trainable:,} trainable params) on digits (320 train / 50 val / 360 test), "
                       "2 epochs x 10 steps of 32, 1 process(es) on cpu, init kaiming")
    plain = []
    train(TrainConfig(epochs=1, **QUICK), log=plain.append)
    assert plain[0].endswith("(320 train / 360 test), 1 epochs x 10 steps of 32, 1 process(es) on cpu, init default")
    # the last record's test accuracy and loss are what the checkpointed weights give on the test split
    ck = load_train_checkpoint(out / "checkpoint.pt")
    model = build_model(TrainConfig(**QUICK).model, num_classes=10, image_size=8, in_chans=1,
                        default_patch=1)
    model.load_state_dict(ck["state_dict"])
    model.eval()
    test = load_dataset("digits").test
    info = DATASETS["digits"]
    with torch.no_grad():
        logits = model(normalize(test.images, info.mean, info.std))
    last = result.metrics[-1]
    assert last["test_acc"] == pytest.approx(100.0 * float((logits.argmax(-1) == test.labels).float().mean()))
    assert last["test_loss"] == pytest.approx(float(torch.nn.functional.cross_entropy(logits, test.labels)), rel=1e-5)
    assert last["images_per_s"] > 0 and last["epoch_seconds"] > 0 and 0 <= last["train_acc"] <= 100
    assert result.world_size == 1 and result.device == "cpu" and result.wall_seconds > 0
    assert result.summary()["last"] == last and result.last_acc == result.final_acc == last["test_acc"]
    assert result.init_report["method"] == "kaiming"


def test_amp_modes_and_the_optimizer():
    from structinit.training.loop import amp_dtype

    assert [amp_dtype(m, "cpu") for m in ("auto", "off", "bf16", "fp16")] == [None, None, torch.bfloat16, torch.float16]
    assert amp_dtype("off", "cuda") is None and amp_dtype("fp16", "cuda") is torch.float16
    assert amp_dtype("auto", "cuda") is (torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    net[1].weight.requires_grad_(False)
    opt, trainable = build_optimizer(net, {"lr": 0.3, "opt_eps": 1e-7, "weight_decay": 0.2})
    assert [p.shape for p in trainable] == [(4, 3), (4,), (4,)]  # the frozen LayerNorm weight is left out
    assert [len(g["params"]) for g in opt.param_groups] == [1, 2]
    assert all(g["lr"] == 0.3 and g["eps"] == 1e-7 for g in opt.param_groups)
    assert isinstance(opt, torch.optim.AdamW)


def test_batches_are_a_seeded_permutation_split_over_processes():
    from structinit.training.loop import epoch_permutation, shard_batches

    perm = epoch_permutation(50, seed=2, epoch=1)
    assert sorted(perm.tolist()) == list(range(50)) and torch.equal(perm, epoch_permutation(50, 2, 1))
    assert not torch.equal(perm, epoch_permutation(50, 2, 0)) and not torch.equal(perm, epoch_permutation(50, 3, 1))
    assert not torch.equal(epoch_permutation(50, 0, 1), epoch_permutation(50, 1, 0))
    one = list(shard_batches(50, 8, rank=0, world=1, seed=2, epoch=1))
    assert len(one) == 6 and all(len(b) == 8 for b in one)  # 50 // 8, the last 2 dropped
    assert torch.equal(torch.cat(one), perm[:48])
    parts = [list(shard_batches(50, 8, rank=r, world=4, seed=2, epoch=1)) for r in range(4)]
    for s in range(6):
        assert torch.equal(torch.cat([parts[r][s] for r in range(4)]), one[s])
        assert all(len(parts[r][s]) == 2 for r in range(4))


def test_best_epoch_is_chosen_on_validation_and_written_to_best_pt(tmp_path):
    out = tmp_path / "run"
    result = train(TrainConfig(epochs=5, val_size=100, eval_every=2, out=str(out), **QUICK))
    rows = result.metrics
    evaluated = [r for r in rows if "test_acc" in r]
    assert [r["epoch"] for r in evaluated] == [2, 4, 5]  # every second epoch, and the last
    assert all("val_acc" in r and "val_loss" in r for r in evaluated)
    assert all("val_acc" not in r and "test_acc" not in r for r in rows if r not in evaluated)
    best = max(evaluated, key=lambda r: (r["val_acc"], -r["epoch"]))  # the first of equal scores
    assert result.best_on == "val" and result.best_epoch == best["epoch"] and result.best_acc == best["test_acc"]
    ck = torch.load(out / "best.pt", weights_only=True)
    assert ck["epoch"] == best["epoch"] and ck["test_acc"] == best["test_acc"] and ck["selected_on"] == "val"
    assert ck["arch"] == "vit-digits" and ck["args"] == TrainConfig(
        epochs=5, val_size=100, eval_every=2, out=str(out), **QUICK).to_dict()
    final = json.loads((out / "final.json").read_text())
    assert final["best_epoch"] == {"epoch": best["epoch"], "test_acc": best["test_acc"], "selected_on": "val"}
    assert final["final_acc"] == rows[-1]["test_acc"] and final["final_val_acc"] == rows[-1]["val_acc"]
    assert final["last"] == rows[-1] and final["epochs"] == 5 and final["world_size"] == 1 and final["device"] == "cpu"
    assert final["key"] == result.key and final["out"] == str(out) and final["resumed_from"] is None
    ck = load_train_checkpoint(out / "checkpoint.pt")
    assert ck["format"] == CHECKPOINT_FORMAT and ck["epoch"] == 5 and ck["best_epoch"] == best["epoch"]
    assert ck["best_on"] == "val" and ck["key"] == result.key and ck["metrics"] == rows
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["resolved"]["val_images"] == 100 and cfg["resolved"]["train_images"] == 320


def test_forced_divergence_is_the_documented_error_and_writes_no_epoch(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(StructinitError, match=r"the loss diverged \(not finite\) in epoch 1; try a lower lr or amp "):
        train(TrainConfig(epochs=3, out=str(out), **dict(QUICK, lr=1e6, grad_clip=0.0)))
    assert not out.exists()  # a run that failed before its first checkpoint leaves nothing behind
    with pytest.raises(StructinitError, match="diverged"):  # through an init that overflows the logits
        train(TrainConfig(epochs=1, init="mimetic", init_params={"alpha1": 1e38}, **QUICK))


def test_a_run_trains_on_the_torch_threads_it_is_given():
    torch.set_num_threads(2)  # restored after the test (_keep_threads)
    seen = []
    train(TrainConfig(epochs=1, **dict(QUICK, train_size=64)), on_epoch=lambda r: seen.append(torch.get_num_threads()))
    assert seen == [1]


def test_something_in_the_way_of_the_checkpoint_is_refused_before_training(tmp_path):
    out = tmp_path / "run"
    (out / "checkpoint.pt").mkdir(parents=True)  # not this run's: never written over or removed
    with pytest.raises(UsageError, match=r"run already holds a run \(checkpoint\.pt\); pass resume"):
        train(TrainConfig(epochs=2, out=str(out), **QUICK))
    assert files(out) == ["checkpoint.pt"] and (out / "checkpoint.pt").is_dir()
    (out / "metrics.jsonl").write_text("")
    with pytest.raises(UsageError) as exc:
        train(TrainConfig(epochs=2, out=str(out), **QUICK))
    assert exc.value.render(lambda n: f"--{n.replace('_', '-')}") == (
        f"{out} already holds a run (checkpoint.pt, metrics.jsonl); pass --resume to continue it or choose "
        "another --out")


class FileSizeLimit:
    """Writes beyond ``limit`` bytes fail with "File too large", as on a full disk (root included)."""

    def __init__(self, limit):
        self.limit = limit

    def __enter__(self):
        import resource
        import signal

        self.handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        self.soft, self.hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (self.limit, self.hard))

    def __exit__(self, *exc):
        import resource
        import signal

        resource.setrlimit(resource.RLIMIT_FSIZE, (self.soft, self.hard))
        signal.signal(signal.SIGXFSZ, self.handler)


def test_a_full_disk_while_checkpointing_is_the_documented_error(tmp_path):
    """A write that fails part-way is one clear error naming the cause, and the temp file is gone."""
    out = tmp_path / "run"
    with FileSizeLimit(60 * 1024):  # config, metrics and the best weights fit, a checkpoint does not
        with pytest.raises(StructinitError, match=r"cannot write .*checkpoint\.pt: File too large$"):
            train(TrainConfig(epochs=2, out=str(out), **QUICK))
    assert not out.exists()  # failed before its first checkpoint: no half-made run, no temp file
    # torch.save reports a failure inside a record as an OSError and one at a record's end as a
    # RuntimeError: limits across the file meet both
    run = RunDir(tmp_path / "direct")
    run.create()
    state = {"w": torch.arange(4000, dtype=torch.float32), "epoch": 1}
    for limit in range(1000, 6000, 500):
        with FileSizeLimit(limit):
            with pytest.raises(StructinitError, match=r"cannot write .*checkpoint\.pt: File too large$"):
                run.save_checkpoint(state)
    assert files(run.path) == []


def test_run_files_and_their_errors(tmp_path):
    run = RunDir(tmp_path / "r")
    assert run.state == "fresh" and not run.holds_run() and run.read_config() is None and run.read_final() is None
    run.create()
    run.write_metrics([{"epoch": 1}, {"epoch": 2}])
    assert run.holds_run() and run.state == "damaged"  # metrics, but neither a checkpoint nor a run's config.json
    assert "no checkpoint.pt and no run's config.json" in run.damage()
    run.write_config({"config": {}, "key": "k"})
    assert run.state == "fresh"  # a run's own start, stopped before its first checkpoint
    run.file(run.CONFIG).unlink()
    with open(run.file(run.METRICS), "a") as f:
        f.write('{"epoch": 3, "tor')  # a torn last line
    assert run.read_metrics() == [{"epoch": 1}, {"epoch": 2}]
    run.save_checkpoint({"epoch": 2, "key": "k"})
    assert run.state == "resumable" and run.load_checkpoint() == {"epoch": 2, "key": "k", "format": CHECKPOINT_FORMAT}
    run.write_final({"final_acc": 1.0})
    assert run.state == "damaged" and "config.json is missing" in run.damage()  # nothing to check it against
    run.write_config({"key": "k", "resolved": {"hparams": {"epochs": 2}}})
    assert run.state == "damaged" and "is run None's result, not run k's" in run.damage()
    run.write_final({"final_acc": 1.0, "key": "k", "epochs": 2})
    assert run.state == "finished" and run.read_final() == {"final_acc": 1.0, "key": "k", "epochs": 2}
    assert (run.path / "final.json").read_text().endswith("}\n")
    run.clear_final()
    run.clear_final()  # a second clear is fine
    assert run.state == "resumable"
    run.write_config({"b": 1, "a": [1]})
    assert run.read_config() == {"a": [1], "b": 1}
    (run.path / "final.json").write_text("{broken")
    with pytest.raises(StructinitError, match=r"final\.json is unreadable"):
        run.read_final()
    torch.save({"epoch": 1}, run.file(run.BEST))
    with pytest.raises(StructinitError, match="is not a structinit training checkpoint"):
        load_train_checkpoint(run.file(run.BEST))
    assert run.load_checkpoint(map_location="meta")["epoch"] == 2  # map_location is passed on
    run.save_checkpoint({"w": torch.ones(2)})
    assert run.load_checkpoint(map_location="meta")["w"].device.type == "meta"
    assert load_train_checkpoint(run.file(run.CHECKPOINT), "meta")["w"].device.type == "meta"
    good = run.file(run.CHECKPOINT).read_bytes()
    for damaged in (b"garbage", b"", good[: len(good) // 2]):
        run.file(run.CHECKPOINT).write_bytes(damaged)
        with pytest.raises(StructinitError) as exc:
            run.load_checkpoint()
        ckpt = run.file(run.CHECKPOINT)
        assert says(str(exc.value), f"cannot read checkpoint {ckpt}", "not a torch checkpoint")
    from test_checkpoints import _CreatesFile

    marker = tmp_path / "pwned.txt"
    torch.save({"format": CHECKPOINT_FORMAT, "x": _CreatesFile(marker)}, run.file(run.CHECKPOINT))
    with pytest.raises(StructinitError) as exc:
        run.load_checkpoint()
    assert str(exc.value).endswith(": refused: unpickling it would run code (io.open); nothing of it was run") \
        and not marker.exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match=r"out .*file exists and is not a directory"):
        RunDir(tmp_path / "file")
    with pytest.raises(StructinitError) as exc:
        RunDir(tmp_path / "file" / "sub").create()
    assert says(str(exc.value), "cannot create run folder", str(tmp_path / "file" / "sub"), "Not a directory")
    blocked = RunDir(tmp_path / "blocked")
    blocked.create()
    metrics = blocked.file(blocked.METRICS)
    metrics.mkdir()
    for write, why in ((lambda: blocked.append_metrics({"epoch": 1}), "a folder, not a regular file"),
                       (lambda: blocked.write_metrics([]), "Is a directory")):
        with pytest.raises(StructinitError) as exc:
            write()
        assert says(str(exc.value), f"cannot write {metrics}", why)


def test_run_files_are_sorted_readable_json(tmp_path):
    """config.json and final.json indented with sorted keys (two runs diff line by line), one
    sorted-key record per line in metrics.jsonl; values JSON cannot hold are written as text."""
    run = RunDir(tmp_path / "a" / "b")  # parents are created
    run.create()
    run.write_config({"b": 1, "a": {"z": [1, 2], "y": tmp_path}})
    assert run.file(run.CONFIG).read_text() == (
        '{\n  "a": {\n    "y": "' + str(tmp_path) + '",\n    "z": [\n      1,\n      2\n    ]\n  },\n  "b": 1\n}\n')
    run.write_final({"z": 1, "a": 2})
    assert run.file(run.FINAL).read_text() == '{\n  "a": 2,\n  "z": 1\n}\n'
    run.write_metrics([{"b": 1, "a": 2}])
    run.append_metrics({"d": 1, "c": 2})
    assert run.file(run.METRICS).read_text() == '{"a": 2, "b": 1}\n{"c": 2, "d": 1}\n'
    (run.path / "final.json").unlink()
    (run.path / "final.json").mkdir()
    with pytest.raises(StructinitError) as exc:
        run.write_final({})
    assert says(str(exc.value), f"cannot write {run.file(run.FINAL)}", "Is a directory")


def test_settings_that_cannot_run_are_refused_before_training(tmp_path):
    with pytest.raises(UsageError, match="batch_size 400 is larger than the 320 training images"):
        train(TrainConfig(epochs=1, **dict(QUICK, batch_size=400)))
    out = tmp_path / "run"
    train(TrainConfig(epochs=1, out=str(out), **QUICK))
    with pytest.raises(UsageError, match=r"differ from the run in .*: lr 0\.01 in the run, 0\.02 now"):
        train(TrainConfig(epochs=1, out=str(out), resume=True, **dict(QUICK, lr=0.02)))
    (out / "config.json").write_text(json.dumps({"config": {"no_such_setting": 1}}))
    with pytest.raises(StructinitError, match=r"config\.json is unreadable"):
        train(TrainConfig(epochs=1, out=str(out), resume=True, **QUICK))


@pytest.mark.parametrize("before, now, told", [
    ({"window": 3}, {}, "window 3 in the run, None now"),           # set in the run only
    ({}, {"shuffle_seq": True}, "shuffle_seq None in the run, True now"),  # set now only
    ({"window": 3}, {"shuffle_seq": True}, "shuffle_seq None in the run, True now; window 3 in the run, None now"),
])
def test_resume_refuses_a_setting_that_only_one_side_sets(tmp_path, before, now, told):
    """Settings left at their defaults are not written, so a change may leave a key on one side only."""
    seq = dict(model="transformer-1d", dataset="mnist1d", epochs=1, threads=1)
    out = tmp_path / "run"
    run = RunDir(out)
    run.create()
    run.write_config({"config": TrainConfig(**seq, **before, out=str(out)).to_dict()})
    with pytest.raises(UsageError) as exc:
        train(TrainConfig(**seq, **now, out=str(out), resume=True))
    assert says(exc.value.render(lambda n: f"<{n}>"), "<resume>", "differ from the run", str(out), told)


def test_the_summary_written_to_final_json():
    """Its time in milliseconds; no per-epoch metrics, only the last (none for a run of no epochs)."""
    from structinit.training.loop import TrainResult

    kw = dict(final_acc=90.0, best_acc=91.0, best_epoch=2, best_on="val", wall_seconds=12.34567,
              params={"total": 5, "trainable": 4}, final_val_acc=89.0, out="o", key="k", resumed_from=1)
    done = TrainResult(epochs=2, metrics=[{"epoch": 1}, {"epoch": 2, "test_acc": 90.0}], **kw).summary()
    assert done == {"final_acc": 90.0, "final_val_acc": 89.0,
                    "best_epoch": {"epoch": 2, "test_acc": 91.0, "selected_on": "val"}, "epochs": 2,
                    "wall_seconds": 12.346, "params": {"total": 5, "trainable": 4}, "out": "o", "key": "k",
                    "resumed_from": 1, "world_size": 1, "device": "cpu", "init_seconds": None,
                    "last": {"epoch": 2, "test_acc": 90.0}, "versions": None}
    assert TrainResult(epochs=0, metrics=[], **kw).summary()["last"] is None
    assert TrainResult(epochs=0, metrics=[], init_seconds=3.25, **kw).summary()["init_seconds"] == 3.25


def test_lr_schedule_shape():
    lr, low = 1e-2, 1e-4
    assert lr_at(0, 100, 10, lr, low) == pytest.approx(lr / 10)
    assert lr_at(4, 100, 10, lr, low) == pytest.approx(lr / 2)
    assert lr_at(10, 100, 10, lr, low) == pytest.approx(lr)
    assert lr_at(100, 100, 10, lr, low) == pytest.approx(low)  # clamped past the end
    assert lr_at(1000, 100, 10, lr, low) == pytest.approx(low)
    assert lr_at(0, 100, 0, lr, low) == pytest.approx(lr)  # no warm-up
    mid = lr_at(55, 100, 10, lr, low)
    assert mid == pytest.approx(low + 0.5 * (lr - low) * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(5, 5, 5, lr, low) == pytest.approx(lr)  # warm-up as long as the run: the span is at least 1
    assert lr_at(6, 6, 5, lr, low) == pytest.approx(low)  # one step after warm-up: the cosine ends at its end


@pytest.mark.skipif(tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 4),
                    reason="fused AdamW on the CPU needs torch 2.4")
def test_the_optimizer_is_fused_where_torch_has_it_and_plain_where_it_has_not(monkeypatch):
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
    hp = {"lr": 0.3, "opt_eps": 1e-7, "weight_decay": 0.2}
    opt, _ = build_optimizer(net, hp)
    assert opt.defaults["fused"] is True and opt.defaults["lr"] == 0.3 and opt.defaults["eps"] == 1e-7

    real = torch.optim.AdamW

    def without_fused(params, **kwargs):  # a torch older than 2.4 on the CPU
        if kwargs.pop("fused", None):
            raise RuntimeError("`fused=True` requires all the params to be floating point Tensors of supported devices")
        return real(params, **kwargs)

    monkeypatch.setattr(torch.optim, "AdamW", without_fused)
    opt, trainable = build_optimizer(net, hp)
    assert isinstance(opt, real) and not opt.defaults["fused"]
    assert (opt.defaults["lr"], opt.defaults["eps"]) == (0.3, 1e-7)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.2, 0.0] and len(trainable) == 4


def test_resuming_from_a_corrupt_checkpoint_is_one_error_line(tmp_path, cli):
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoint.pt").write_bytes(b"\x80\x02garbage")
    r = cli("train", "--epochs", "1", "--train-size", "100", "--out", out, "--resume", "--threads", "1")
    # a damaged run: its checkpoint set aside (kept), said in one line, the run trained afresh
    aside = [p for p in out.iterdir() if p.name.startswith("damaged-")]
    assert r.returncode == 0 and len(aside) == 1, r.stderr
    assert (aside[0] / "checkpoint.pt").read_bytes() == b"\x80\x02garbage"
    said = [line for line in r.stderr.splitlines() if "was damaged" in line]
    assert len(said) == 1 and "not a readable checkpoint" in said[0] and "training it afresh" in said[0]


@pytest.mark.slow  # three short training runs (about 10 s)
def test_the_impulse_inits_attention_on_real_inputs_is_metrics_epoch_zero(tmp_path):
    """An impulse run writes its init's attention on real training inputs as metrics.jsonl's first
    line (epoch 0): once, also after a resume; the readers of epoch records (RunDir, bench status
    and bench report) skip it."""
    from grids import TINY_GRID, expand_text, variant

    from structinit.experiments.launch import prepare_runs
    from structinit.experiments.report import collect
    from structinit.experiments.status import run_status
    from structinit.experiments.task import run_task

    settings = dict(QUICK, init="impulse", init_params={"data_fit": 0})
    out = tmp_path / "run"

    train_until(TrainConfig(epochs=2, out=str(out), **settings), 1)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in lines] == [0, 1]
    first = lines[0]["init_attention"]
    assert first["samples"] == 256 and len(first["layers"]) == 1 and 0 <= first["hit_rate"] <= 1
    result = train(TrainConfig(epochs=2, out=str(out), resume=True, **settings))
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in lines] == [0, 1, 2]
    assert lines[0]["init_attention"] == result.init_report["data_attention"] == first
    assert [r["epoch"] for r in RunDir(out).read_metrics()] == [1, 2] and result.epochs == 2

    text = variant(TINY_GRID, name="one", title="One impulse run", seeds=1, columns=["train_size"], lr=None,
                   warmup_epochs=None, axes="""\
[[axes.init]]
id = "impulse"
init = "impulse"
init_params = { data_fit = 0 }
[[axes.train_size]]
id = "320"
train_size = 320
""")
    ex = expand_text(text, tmp_path / "runs")
    (cell,) = prepare_runs(ex)
    assert run_task(ex.run_dir(cell), threads=1).state == "finished"
    assert (ex.run_dir(cell) / "metrics.jsonl").read_text().startswith('{"epoch": 0, "init_attention": ')
    assert run_status(ex.run_dir(cell)).epochs_done == 2
    rep = collect(ex)
    assert rep.problems() == [] and [m["epoch"] for m in rep.runs[0].metrics] == [1, 2]


def test_the_init_sees_the_first_training_inputs_as_the_model_does():
    """Images normalized with the dataset's statistics; sequences as stored (already standardized)."""
    from structinit.training.datasets import TensorSplit, dataset_info
    from structinit.training.loop import FIDELITY_SAMPLES, init_inputs

    seqs = TensorSplit(images=torch.randn(300, 1, 40), labels=torch.zeros(300, dtype=torch.long))
    assert torch.equal(init_inputs(seqs, dataset_info("mnist1d")), seqs.images[:FIDELITY_SAMPLES])
    info = dataset_info("digits")
    images = TensorSplit(images=torch.randint(0, 256, (300, 1, 8, 8), dtype=torch.uint8),
                         labels=torch.zeros(300, dtype=torch.long))
    want = (images.images[:FIDELITY_SAMPLES].float() / 255 - info.mean[0]) / info.std[0]
    assert torch.allclose(init_inputs(images, info), want, atol=1e-6)


@pytest.mark.slow  # bf16 autocast on a CPU: about 2 minutes on a busy 2-core machine
def test_bf16_autocast_on_the_cpu_is_recorded_in_the_runs_settings(tmp_path):
    """``amp`` is asked for explicitly here (``auto`` means full precision on a CPU); the run
    records the dtype it trained under, which is what tells a bf16 run from a full-precision one."""
    out = tmp_path / "run"
    few = dict(QUICK, train_size=64)  # two steps: bf16 autocast on a CPU is slow
    result = train(TrainConfig(epochs=1, out=str(out), amp="bf16", **few))
    resolved = json.loads((out / "config.json").read_text())["resolved"]
    assert resolved["amp"] == "bfloat16" and math.isfinite(result.metrics[-1]["train_loss"])
    off = train(TrainConfig(epochs=1, out=str(tmp_path / "off"), **few))  # amp auto: off on a CPU
    assert json.loads((tmp_path / "off" / "config.json").read_text())["resolved"]["amp"] == "off"
    assert off.metrics[-1]["train_loss"] != result.metrics[-1]["train_loss"]  # bf16 rounding changed the run


def test_a_dataset_that_must_not_be_flipped_is_never_flipped():
    """Digits (like SVHN) are not mirror-symmetric: ``augment=flip`` on them trains exactly as
    ``none`` (the dataset's ``hflip`` reaches the augmentation)."""
    plain = train(TrainConfig(epochs=1, seed=4, augment="none", **QUICK))
    flip = train(TrainConfig(epochs=1, seed=4, augment="flip", **QUICK))
    assert flip.metrics[-1]["train_loss"] == plain.metrics[-1]["train_loss"]
    assert flip.metrics[-1]["test_acc"] == plain.metrics[-1]["test_acc"]


def first_epoch_loss(**settings):
    """The first epoch's training loss of a mimetic run of ``QUICK`` with ``settings``: it shows which
    data the run saw."""
    return train(TrainConfig(epochs=1, init="mimetic", seed=0, **{**QUICK, **settings})).metrics[-1]["train_loss"]


def test_the_data_seed_reaches_the_data_the_run_trains_on(tmp_path):
    """``data_seed`` picks the training subset (``seed`` when unset)."""
    default = first_epoch_loss()
    assert first_epoch_loss(data_seed=0) == default and first_epoch_loss(data_seed=5) != default


@pytest.mark.slow  # MNIST-1D is generated afresh on each load: 2-3 s of CPU each, twice
def test_the_shuffled_positions_reach_the_data_the_run_trains_on(tmp_path):
    """``shuffle_seq`` permutes a sequence's positions."""
    seq = dict(model="transformer-1d", dataset="mnist1d", depth=1, dim=16, heads=2, patch=None, train_size=64,
               batch_size=16, val_size=0)
    assert first_epoch_loss(**seq, shuffle_seq=True) != first_epoch_loss(**seq)


def test_a_run_killed_before_its_first_checkpoint_fits_its_init_again_on_resume(tmp_path):
    """Killed in epoch 1 (SIGKILL, a node lost), a run leaves its config.json, with the init's
    report, and no checkpoint: its resume starts over and fits the init to data again (a report
    with no weights behind it is not reused), ending as the uninterrupted run. The run's seed
    reaches the solve, and the log line reports the attention the report holds."""
    import shutil

    settings = dict(QUICK, seed=3, init="impulse", init_params={"data_fit": 5, "data_fit_samples": 16})
    logs = []
    ref = train(TrainConfig(epochs=1, out=str(tmp_path / "ref"), **settings), log=logs.append)
    rep, seen = ref.init_report, ref.init_report["data_attention"]
    assert rep["artifact"]["config"]["seed"] == 3
    assert (f"impulse attention at init on {seen['samples']} training inputs: hit rate {seen['hit_rate']:.3f}, "
            f"target mass {seen['target_mass']:.3f} (on the pseudo input: {rep['hit_rate']:.3f}, "
            f"{rep['target_mass']:.3f})") in logs

    out = tmp_path / "run"  # what the killed run left: its config.json alone
    out.mkdir()
    shutil.copy(tmp_path / "ref" / "config.json", out / "config.json")
    resumed = train(TrainConfig(epochs=1, out=str(out), resume=True, **settings))
    assert resumed.resumed_from is None and resumed.init_report["data_attention"] == seen
    for key in ("train_loss", "test_acc", "test_loss"):
        assert resumed.metrics[-1][key] == pytest.approx(ref.metrics[-1][key], rel=1e-6, abs=1e-9), key


def test_a_run_is_its_seed_and_records_its_version(tmp_path):
    """The same seed trains the same run whatever the process's RNG did before (the model is built
    from the run's seed); config.json names the structinit that wrote it."""
    import structinit

    settings = dict(QUICK, epochs=1, init="mimetic", seed=3, val_size=64)
    torch.manual_seed(123)
    a = train(TrainConfig(out=str(tmp_path / "a"), **settings))
    torch.manual_seed(456)
    b = train(TrainConfig(**settings))
    for key in ("train_loss", "test_acc", "test_loss"):
        assert a.metrics[-1][key] == b.metrics[-1][key], key
    assert json.loads((tmp_path / "a" / "config.json").read_text())["version"] == structinit.__version__
    # the checkpoint keeps the score the best epoch was chosen by (validation accuracy), which a
    # resume compares later epochs against; each epoch's time is its own, within the run's
    ck = load_train_checkpoint(tmp_path / "a" / "checkpoint.pt")
    assert ck["best_score"] == max(r["val_acc"] for r in a.metrics) and ck["best_on"] == "val"
    assert 0 < a.metrics[-1]["epoch_seconds"] <= a.wall_seconds


def test_a_dataset_read_from_disk_trains_with_the_noise_fit_and_its_default_patch(tmp_path):
    """An ImageNet-style folder is read from disk batch by batch: the impulse init's data fit,
    which needs the training inputs in memory, runs on noise inputs of the model's input shape with
    a line saying so, and the model takes the dataset's default patch (16) when none is given."""
    from PIL import Image

    for split in ("train", "val"):
        for c, cls in enumerate(("cat", "dog")):
            for j in range(4):
                (tmp_path / split / cls).mkdir(parents=True, exist_ok=True)
                Image.new("RGB", (56, 52), (120 * c, 60 + 20 * j, 30)).save(tmp_path / split / cls / f"{j}.png")
    import warnings

    from structinit.errors import StructinitWarning

    logs = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", StructinitWarning)  # said in the run's log, not warned
        result = train(TrainConfig(model="vit-t", dataset="imagefolder", data_dir=str(tmp_path), image_size=48,
                                   depth=1, dim=32, heads=2, epochs=1, batch_size=4, val_size=0, workers=0,
                                   threads=1, init="impulse", init_params={"data_fit": 20},
                                   out=str(tmp_path / "run")), log=logs.append)
    assert ("the init's data fit needs training inputs held in memory and imagefolder is read from disk: it runs on "
            "noise inputs of the model's input shape") in logs
    assert any(line.startswith("impulse: no data given, so Q/K were fitted on 256 Gaussian noise inputs")
               for line in logs)
    fit = result.init_report["data_fit"]
    assert fit["inputs"] == "noise"
    assert fit["source"] == "noise: 256 Gaussian inputs N(0, 1) of shape [3, 48, 48] (no data)"
    resolved = json.loads((tmp_path / "run" / "config.json").read_text())["resolved"]
    assert resolved["model"]["patch"] == 16 and resolved["model"]["grid"] == [3, 3]
