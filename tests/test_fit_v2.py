"""The data fit's version 2 (the default): minibatch steps, the Newton calibration, the model run
block by block; and what stays of version 1 (pinned by ``data_fit_version=1``). Each part is held
to what its docstring says, and the whole fit to a replay of its steps."""

import numpy as np
import pytest
import torch
from conftest import digits_images, says, vit_digits
from grids import DIGITS, variant

from structinit.analysis.capture import LayerInputs, attention_inputs, projection_module
from structinit.errors import UsageError
from structinit.fit.refine import (
    MAX_LOGIT,
    ROWS_PER_STEP,
    calibrate,
    calibrate_on_batch,
    fit_loss,
    refine_qk_minibatch,
    step_images,
)
from structinit.geometry.grid import Grid
from structinit.geometry.targets import impulse_columns
from structinit.init.attention_target import AttentionTarget
from structinit.init.impulse import ImpulseInit
from structinit.init.initialize import initialize_model
from structinit.init.inject import heads_to_rows, read_qk, rows_to_heads
from structinit.init.registry import init_spec

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def digits():
    return digits_images(48)


vit = vit_digits


def problem(seed=0, b=6, n=9, dim=12, heads=3, d=4):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, n, dim, generator=g)
    q, k = torch.randn(heads, dim, d, generator=g), torch.randn(heads, dim, d, generator=g)
    offsets = np.array([[0, 1], [1, 0], [1, 1]])[:heads]
    cols = torch.from_numpy(impulse_columns(Grid((3, 3)), offsets)).long()
    return x, q, k, cols


def mean_mass(x, q, k, cols):
    logits = torch.einsum("bnD,hDd->bhnd", x, q) @ torch.einsum("bnD,hDd->bhnd", x, k).transpose(-1, -2)
    p = torch.softmax(logits / q.shape[-1] ** 0.5, -1)
    rows = cols >= 0
    picked = p.gather(-1, cols.clamp(min=0)[None, :, :, None].expand(x.shape[0], -1, -1, 1)).squeeze(-1)
    return (picked * rows).sum((0, 2)) / (rows.sum(-1) * x.shape[0])


def test_a_step_takes_enough_images_for_its_rows():
    assert step_images(64) == ROWS_PER_STEP // 64 == 16
    assert step_images(256) == 4 and step_images(196) == 6 and step_images(40) == 26 and step_images(4096) == 1
    assert step_images(64, batch=5) == 5


def fitted_problem():
    """A batch and Q/K refined towards their targets, so that a mass of 0.35 is within reach of every head."""
    x, q, k, cols = problem(b=16)
    q, k = refine_qk_minibatch(x, q, k, cols, steps=200, mass=0.6, l2=0.0, lr=3e-2, norm=2.0)
    return x, q, k, cols


def test_calibration_reaches_the_mass_and_agrees_with_the_bisection():
    x, q, k, cols = fitted_problem()
    q2, k2 = calibrate(x, q, k, cols, 0.35, tol=1e-6)
    assert mean_mass(x, q2, k2, cols).tolist() == pytest.approx([0.35] * 3, abs=1e-6)
    q1, k1 = calibrate_on_batch(x, q, k, cols, 0.35)
    torch.testing.assert_close(q2 @ k2.transpose(-1, -2), q1 @ k1.transpose(-1, -2), rtol=1e-4, atol=1e-5)
    # each head is scaled by one factor: the direction of q k^T stays
    for h in range(3):
        ratio = (q2[h] @ k2[h].T) / (q[h] @ k[h].T)
        assert torch.allclose(ratio, ratio.flatten()[0].expand_as(ratio), rtol=1e-4)
    # within the default tolerance of the mass
    assert mean_mass(x, *calibrate(x, q, k, cols, 0.35), cols).tolist() == pytest.approx([0.35] * 3, abs=1e-4)


def test_calibration_uses_only_the_first_images_and_stops_at_the_logit_cap():
    x, q, k, cols = fitted_problem()
    a = calibrate(x, q, k, cols, 0.35, samples=3)
    b = calibrate(x[:3], q, k, cols, 0.35, samples=64)
    torch.testing.assert_close(a[0], b[0])
    torch.testing.assert_close(a[1], b[1])
    assert not torch.allclose(a[0], calibrate(x, q, k, cols, 0.35)[0])
    # a mass the heads cannot reach: every head ends with its largest logit at the cap
    q3, k3 = calibrate(x, q, k, cols, 0.999)
    logits = torch.einsum("bnD,hDd->bhnd", x, q3) @ torch.einsum("bnD,hDd->bhnd", x, k3).transpose(-1, -2) / 2.0
    assert logits.abs().amax(dim=(0, 2, 3)).tolist() == pytest.approx([MAX_LOGIT] * 3, rel=1e-4)


def test_minibatch_refinement_starts_at_the_norm_lowers_the_loss_and_follows_its_seed():
    x, q, k, cols = problem(b=16)
    ticks = []
    q0, k0 = refine_qk_minibatch(x, q, k, cols, steps=0, mass=0.6, l2=0.0, lr=1e-2, norm=2.0)
    assert q0.norm(dim=(-2, -1)).tolist() == pytest.approx([2.0] * 3)
    assert k0.norm(dim=(-2, -1)).tolist() == pytest.approx([2.0] * 3)
    q1, k1 = refine_qk_minibatch(x, q, k, cols, steps=40, mass=0.6, l2=0.0, lr=3e-2, norm=2.0, batch=4, seed=5,
                                 tick=lambda: ticks.append(1))
    assert len(ticks) == 40
    assert float(fit_loss(x, q1, k1, cols, 0.6)) < float(fit_loss(x, q0, k0, cols, 0.6)) - 0.05
    again = refine_qk_minibatch(x, q, k, cols, steps=40, mass=0.6, l2=0.0, lr=3e-2, norm=2.0, batch=4, seed=5)
    other = refine_qk_minibatch(x, q, k, cols, steps=40, mass=0.6, l2=0.0, lr=3e-2, norm=2.0, batch=4, seed=6)
    assert torch.equal(again[0], q1) and not torch.equal(other[0], q1)
    # the draws: step s uses the images torch.randint draws with that seed, the whole batch never
    g = torch.Generator().manual_seed(5)
    draws = torch.randint(0, 16, (40, 4), generator=g)
    q_, k_ = q0.clone().requires_grad_(True), k0.clone().requires_grad_(True)
    opt = torch.optim.Adam([q_, k_], lr=3e-2)
    for s in range(40):
        loss = fit_loss(x[draws[s]], q_, k_, cols, 0.6)
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.testing.assert_close(q_.detach(), q1)


def test_a_stop_request_ends_the_refinement_at_that_step():
    x, q, k, cols = problem()
    seen = []

    def tick():
        seen.append(1)
        if len(seen) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        refine_qk_minibatch(x, q, k, cols, steps=1000, mass=0.6, l2=0.0, lr=1e-2, norm=2.0, tick=tick)
    assert len(seen) == 3


def test_layer_inputs_run_block_by_block_and_see_the_weights_as_they_are_now(digits):
    model = vit(seed=3)
    modules = [projection_module(model, f"blocks.{i}.attn.qkv.weight") for i in range(4)]
    inputs = LayerInputs(model, digits, modules, blocks=model.blocks)
    assert inputs.streamed
    torch.testing.assert_close(inputs(0), attention_inputs(model, digits)[0])
    with torch.no_grad():  # change layer 0 and 1: what layer 2 sees must follow
        model.blocks[0].attn.proj.weight.mul_(3.0)
        model.blocks[1].mlp.fc2.weight.mul_(-2.0)
    got = inputs(2)
    torch.testing.assert_close(got, attention_inputs(model, digits)[2], rtol=1e-5, atol=1e-5)
    with pytest.raises(UsageError, match="layer 1 was asked for after layer 2"):
        inputs(1)


def test_a_model_whose_forward_is_not_its_blocks_in_order_is_run_whole_for_each_layer(digits):
    model = vit(seed=1)

    class Reordered(torch.nn.Module):  # the blocks run last to first: not what blocks[i] in order gives
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self.blocks = inner.blocks

        def forward(self, x):
            m = self.inner
            h = m.norm_pre(m._pos_embed(m.patch_embed(x)))
            for blk in reversed(self.blocks):
                h = blk(h)
            return m.forward_head(m.norm(h))

    wrapped = Reordered(model)
    modules = [blk.attn.qkv for blk in model.blocks]
    inputs = LayerInputs(wrapped, digits, modules, blocks=wrapped.blocks)
    assert not inputs.streamed
    seen = []
    hooks = [b.attn.register_forward_pre_hook(lambda m, a: seen.append(a[0])) for b in model.blocks]
    with torch.no_grad():
        model.eval()
        wrapped(digits)
    for h in hooks:
        h.remove()
    want = dict(zip(reversed(range(4)), seen))  # block 3 ran first
    for i in range(4):
        torch.testing.assert_close(inputs(i), want[i])


def test_a_model_that_cannot_run_the_batch_is_one_usage_error(digits):
    model = vit()
    inputs_ = torch.zeros(4, 3, 8, 8)  # three channels for a one-channel model
    with pytest.raises(UsageError, match=r"the model cannot run on the data given \(RuntimeError"):
        LayerInputs(model, inputs_, [b.attn.qkv for b in model.blocks], blocks=model.blocks)(0)


def test_version_2_is_the_default_and_its_parameters_say_when_they_do_nothing():
    spec = ImpulseInit()
    assert spec.data_fit_version == 2 and spec.to_dict()["params"]["data_fit_version"] == 2
    assert "data_fit_version" not in init_spec("impulse", data_fit_version=1).to_dict()["params"]
    plain = init_spec("impulse", data_fit=0).to_dict()["params"]
    assert "data_fit_version" not in plain and "data_fit_batch" not in plain
    assert init_spec("impulse", data_fit_batch=4).to_dict()["params"]["data_fit_batch"] == 4
    for params, parts in (({"data_fit_version": 3}, ("data_fit_version", "1, 2", "got 3")),
                          ({"data_fit_batch": -1}, ("data_fit_batch", "non-negative", "got -1")),
                          ({"data_fit_batch": 4, "data_fit_version": 1}, ("data_fit_batch", "version 1",
                                                                          "leave it out")),
                          ({"data_fit_batch": 4, "data_fit": 0}, ("data_fit_batch", "data_fit is 0", "leave it out"))):
        with pytest.raises(UsageError) as e:
            init_spec("impulse", **params)
        assert says(str(e.value), "impulse", *parts)


@pytest.mark.parametrize("batch", [0, 3])
def test_the_fit_of_layer_0_is_its_replayed_steps(digits, batch):
    """Version 2's layer 0: minibatch Adam from the written solve on that layer's inputs, with the
    draws seeded by (seed, layer), then the Newton calibration on the first 64 inputs."""
    from pathlib import Path

    from structinit.solver.artifact import read_artifact

    m = vit(seed=2)
    rep = initialize_model(m, "impulse", data=digits, data_fit=15, data_fit_batch=batch, seed=2, mimetic_vproj=False)
    art = read_artifact(Path(rep["artifact"]["path"]))
    x0 = attention_inputs(vit(seed=2), digits)[0].float()
    cols = torch.from_numpy(impulse_columns(art.config.grid, art.offsets[0], art.config.padding)).long()
    spec = ImpulseInit()
    # the fit starts from the rows written into the model, read back (a transposed view: the memory
    # layout changes the last bits of the matrix products, so the replay takes the same one)
    q0, k0 = (rows_to_heads(heads_to_rows(torch.from_numpy(w[0])), 4) for w in (art.q, art.k))
    q, k = refine_qk_minibatch(x0, q0, k0, cols, steps=15,
                               mass=spec.data_fit_mass, l2=spec.data_fit_l2, lr=spec.data_fit_lr,
                               norm=spec.data_fit_norm, batch=batch, seed=2 * 1_000_003 + 0)
    q, k = calibrate(x0, q, k, cols, 0.3)
    t = AttentionTarget(m)
    got_q, got_k = read_qk(t.sd, t.slots[0], t.heads)
    torch.testing.assert_close(got_q, q, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_k, k, rtol=1e-5, atol=1e-6)
    fit = rep["data_fit"]
    assert fit["version"] == 2 and fit["step_images"] == (batch or 16) and fit["streamed"] is True
    assert fit["samples"] == 48 and fit["measured_on"] == 48 and fit["seconds"] > 0
    # calibrated to 0.3 where a head reaches it within the logit cap (after 15 steps some stop just short)
    assert all(0.25 < m <= 0.3001 for row in fit["layers"] for m in row["heads"]["target_mass"])
    assert all(0 < row["window_mass"] <= 1 for row in fit["layers"])


def test_the_fit_reports_each_layer_and_its_progress(digits):
    lines, steps = [], []
    initialize_model(vit(), "impulse", data=digits, data_fit=5, seed=0, log=lines.append,
                     progress=lambda d, n: steps.append((d, n)))
    fitted = [line for line in lines if line.startswith("data fit:")]  # 5 steps: also the weak structure's line
    assert [line.split(" on ")[0] for line in fitted] == [f"data fit: layer {i} ({i + 1}/4)" for i in range(4)]
    assert steps[-1] == (24, 24) and [d for d, _ in steps] == sorted(d for d, _ in steps)


LONG_FIT = variant(DIGITS, name="long-fit", title="One run whose init fits for minutes", train_size=64, epochs=1,
                   axes="""\
[[axes.init]]
id = "impulse"
init = "impulse"
init_params = { data_fit = 1000000 }
""")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGTERM", "SIGUSR2", "Ctrl-C"])
def test_a_stop_request_ends_a_long_fit_within_two_seconds_and_leaves_the_run_to_start_afresh(tmp_path, how, cli):
    """A launcher's SIGTERM, SLURM's USR2 (to ``bench run``) and Ctrl-C (to ``train``) stop the init's
    data fit at its next step: no run files, no fitted artifact, and the task says it was interrupted."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    from conftest import REPO

    (tmp_path / "grid.toml").write_text(LONG_FIT)
    env = dict(os.environ, PYTHONPATH=str(REPO), STRUCTINIT_CACHE=str(tmp_path / "cache"))
    run = [sys.executable, "-m", "structinit"]
    prepared = cli("bench", "grid", "grid.toml", "--launcher", "print", cwd=tmp_path, env=env)  # in process
    assert prepared.returncode == 0, prepared.stderr
    folder = next(p for p in (tmp_path / "runs").iterdir() if len(p.name) == 12)
    if how == "Ctrl-C":
        out = tmp_path / "direct"
        cmd = run + ["train", "--init", "impulse", "--init-param", "data_fit=1000000", "--train-size", "64",
                     "--epochs", "1", "--out", str(out)]
        sig, watch = signal.SIGINT, None
    else:
        out, cmd = folder, run + ["bench", "run", str(folder)]
        sig, watch = getattr(signal, how), folder / "log.txt"
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    started = time.monotonic()
    while time.monotonic() - started < 300:  # until the fit has begun: it holds the lock of its fitted artifact
        if list((tmp_path / "cache" / ".locks").glob("*-fit-*.lock")) and (watch is None or watch.exists()):
            break
        time.sleep(0.1)
    assert time.monotonic() - started < 300, "the fit never started"
    time.sleep(2.0)
    assert proc.poll() is None, proc.communicate()
    import threading

    said = []  # (time, line) of every stderr line: when the process said it was interrupted

    def read():
        for line in proc.stderr:
            said.append((time.monotonic(), line))

    reader = threading.Thread(target=read)
    reader.start()
    sent = time.monotonic()
    proc.send_signal(sig)
    proc.wait(timeout=60)
    reader.join(timeout=10)
    err = "".join(line for _, line in said)
    # the fit stops at its next step and says so: a fit that ignored the signal would run its million
    # steps for hours, so the wait above would time out (no bound on how fast a loaded machine stops)
    stopped = [t for t, line in said if t >= sent and ("interrupted" in line or "task stopped" in line)]
    assert stopped, err
    assert not list((tmp_path / "cache").glob("*-fit-*.safetensors"))
    if how == "Ctrl-C":
        assert proc.returncode == 130 and err.strip().splitlines()[-1] == "error: interrupted"
        assert not out.exists() or not any(out.iterdir())
    else:
        task = json.loads((folder / "task.json").read_text())
        assert task["state"] == "interrupted" and "no epoch had finished: the next task starts the run afresh" in err
        assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == \
            ["config.json", "heartbeat", "log.txt", "task.json"]
        from structinit.training.rundir import RunDir

        assert RunDir(folder).state == "fresh"  # nothing of the run was written: the next task starts it afresh
