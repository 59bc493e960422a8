"""The SLURM launcher: the job script it writes, and a real single-node SLURM cluster (Debian's
slurm-wlm and munge, configured for localhost in a temporary folder) that runs a tiny digits grid
while one task is requeued (as a preemption does) and another is sent the time-limit signal."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import error_line, says
from grids import DIGITS, expand_text, variant

from structinit.errors import UsageError
from structinit.experiments.launch import prepare_runs
from structinit.experiments.slurm import SlurmOptions, render_script, write_job
from structinit.training.rundir import RunDir

REPO = Path(__file__).resolve().parents[1]
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "sinfo")
# 2 init methods x 1 seed x 2 epochs: one task to requeue, one to signal, both running at once on
# two cores. The impulse fit on 16 images (not 256: the fit is not what this tests); ~10 s per
# epoch on a busy 2-core machine, long enough to requeue a task and to signal the other one while
# they train.
GRID = variant(DIGITS, name="slurm-tiny", title="Tiny digits grid on SLURM", batch_size=8, warmup_epochs=0.5,
               lr=0.002, val_size=100, append="init_params = { data_fit_samples = 16 }\n")  # the impulse value's


def mini_expansion(tmp_path):
    return expand_text(GRID, tmp_path / "runs", file="grid.toml", command="structinit bench grid grid.toml")


def test_the_job_script_asks_for_what_was_given(tmp_path):
    ex = mini_expansion(tmp_path)
    cells = prepare_runs(ex)
    opts = SlurmOptions(partition="gpu", time="1-00:00:00", gpus=2, cpus=8, mem="32G", account="lab", qos="high",
                        extra=["--constraint=a100", "#SBATCH --exclusive"], max_concurrent=3, signal_seconds=300)
    job = write_job(ex, cells, opts, command="structinit bench grid grid.toml")
    text = job.script.read_text()
    for line in ("#SBATCH --array=0-1%3", "#SBATCH --signal=USR2@300", "#SBATCH --requeue", "#SBATCH --gres=gpu:2",
                 "#SBATCH --cpus-per-task=8", "#SBATCH --partition=gpu", "#SBATCH --time=1-00:00:00",
                 "#SBATCH --mem=32G", "#SBATCH --account=lab", "#SBATCH --qos=high", "#SBATCH --constraint=a100",
                 "#SBATCH --exclusive", f"#SBATCH --output={job.folder}/logs/%A_%a.log", "--nproc 2",
                 f"{sys.executable} -u -m structinit bench run", "--signal-seconds 300",
                 "structinit bench grid grid.toml"):
        assert line in text, line
    assert os.access(job.script, os.X_OK)
    assert job.tasks.read_text().splitlines() == [str(ex.run_dir(c).absolute()) for c in cells]
    assert "%%{" not in text
    r = subprocess.run(["bash", "-n", str(job.script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr  # valid bash
    plain = render_script(ex, 4, SlurmOptions(), job.folder, None)
    assert "--gres" not in plain and "--partition" not in plain and "#SBATCH --array=0-3\n" in plain


def test_a_task_requeues_itself_alone_not_its_whole_array():
    from structinit.experiments.task import slurm_requeue_target

    # array task 1 of job 7 was given job id 7 itself: `scontrol requeue 7` would requeue the array
    task = {"SLURM_JOB_ID": "7", "SLURM_ARRAY_JOB_ID": "7", "SLURM_ARRAY_TASK_ID": "1"}
    assert slurm_requeue_target(task) == "7_1"
    assert slurm_requeue_target({**task, "SLURM_JOB_ID": "8", "SLURM_ARRAY_TASK_ID": "0"}) == "7_0"
    assert slurm_requeue_target({"SLURM_JOB_ID": "9"}) == "9"  # a plain job
    assert slurm_requeue_target({"SLURM_JOB_ID": "9", "SLURM_ARRAY_TASK_ID": "0"}) == "9"  # half an array's names
    assert slurm_requeue_target({}) is None
    assert slurm_requeue_target({"SLURM_JOB_ID": ""}) is None


@pytest.mark.parametrize("kwargs, message", [
    (dict(time="tomorrow"), "time must look like HH:MM:SS"),
    (dict(gpus=-1), "gpus must be an integer of at least 0"),
    (dict(max_concurrent=0), "max_concurrent must be an integer of at least 1"),
    (dict(partition="a b"), "partition must be one word"),
    (dict(extra=["--a\n--b"]), "sbatch takes one #SBATCH option per use"),
])
def test_bad_slurm_options(kwargs, message):
    with pytest.raises(UsageError, match=message):
        SlurmOptions(**kwargs).validate()


def test_without_sbatch_nothing_is_written(tmp_path, cli):
    (tmp_path / "grid.toml").write_text(GRID)
    r = cli("bench", "grid", "grid.toml", "--launcher", "slurm", cwd=tmp_path, env={"PATH": str(tmp_path / "no")})
    assert r.returncode == 2
    assert says(error_line(r.stderr), "sbatch is not on PATH", "--dry-run", "--launcher local")
    assert not (tmp_path / "runs").exists()
    r = cli("bench", "grid", "grid.toml", "--launcher", "slurm", "--dry-run", "--json", cwd=tmp_path,
            env={"PATH": str(tmp_path / "no")})
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["submitted"] is False and Path(doc["script"]).is_file() and doc["to_launch"] == 2


# --------------------------------------------------------------------------- a real cluster

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """munged + slurmctld + slurmd for localhost, all state in one folder."""

    def __init__(self, root: Path):
        self.root = root
        self.env = dict(os.environ, SLURM_CONF=str(root / "slurm.conf"))

    def run(self, *args, check=True, timeout=60):
        r = subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(args)} failed: {r.stderr or r.stdout}")
        return r

    def start(self):
        root = self.root
        for sub in ("state", "spool", "log"):
            (root / sub).mkdir()
        key = root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        sock = root / "munge.sock"
        subprocess.run(["munged", "--force", f"--socket={sock}", f"--key-file={key}", f"--log-file={root}/log/munged",
                        f"--pid-file={root}/munged.pid", f"--seed-file={root}/munged.seed"], check=True,
                       capture_output=True, timeout=30)
        user = os.environ.get("USER") or __import__("pwd").getpwuid(os.getuid()).pw_name
        cpus = os.cpu_count() or 1
        host = socket.gethostname().split(".")[0]
        (root / "slurm.conf").write_text(f"""\
ClusterName=structinit-test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
AuthInfo=socket={sock}
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld
SlurmctldDebug=verbose
SlurmdLogFile={root}/log/slurmd
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
KillWait=20
MinJobAge=600
# room for a slow, busy machine (CI's can be ten times slower than a laptop): an RPC, a launch or
# the kill of a step that outlasts Slurm's defaults (10 s, 10 s, 60 s) would fail the launch, hold
# the job or drain the node, none of which is what this test is about
MessageTimeout=60
BatchStartTimeout=120
UnkillableStepTimeout=300
SlurmdTimeout=600
NodeName=structinit-node NodeHostname={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=structinit-node Default=YES MaxTime=INFINITE State=UP
""")
        conf = str(root / "slurm.conf")
        subprocess.run(["slurmctld", "-f", conf], env=self.env, check=True, capture_output=True, timeout=30)
        subprocess.run(["slurmd", "-f", conf, "-N", "structinit-node"], env=self.env, check=True, capture_output=True,
                       timeout=30)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 60:
            r = self.run("sinfo", "-h", "-o", "%T", check=False)
            if r.returncode == 0 and r.stdout.strip() == "idle":
                return
            time.sleep(0.5)
        log = (root / "log" / "slurmctld").read_text()[-2000:] if (root / "log" / "slurmctld").exists() else ""
        raise AssertionError(f"the test cluster did not come up: {r.stdout} {r.stderr}\n{log}")

    def diagnose(self, job) -> str:
        """What SLURM says of the job and the node, and the end of its daemons' logs (for a failure
        message)."""
        parts = []
        for args in (("scontrol", "show", "job", str(job)), ("sinfo", "-N", "-o", "%N %T %E")):
            r = self.run(*args, check=False)
            parts.append(f"$ {' '.join(args)}\n{(r.stdout + r.stderr).strip()}")
        for name in ("slurmctld", "slurmd"):
            path = self.root / "log" / name
            lines = path.read_text(errors="replace").splitlines()[-40:] if path.exists() else ["(no log)"]
            parts.append(f"--- {name} log\n" + "\n".join(lines))
        return "\n".join(parts)

    def start_now(self, job) -> None:
        """Let a pending task start now rather than when SLURM would, but never sooner than 2 s
        after SLURM finished requeueing it. SLURM revokes the launch credential of a job it
        requeues while it runs (as of the second the requeue is processed) and refuses a new
        launch whose credential is dated that second or earlier ("Job 1 already killed, do not
        launch batch job"; the job ends FAILED and never runs again). So it keeps a requeued job
        from starting for cred_expire + 1 s (121 s by default) after the requeue finished, when
        it sets the job's SubmitTime; forcing StartTime=now sooner is what a real cluster never
        does, and what made a self-requeued task relaunched 0.7 s later fail."""
        import datetime
        import re

        r = self.run("scontrol", "show", "job", str(job), check=False)
        state, submitted = re.search(r"JobState=(\S+)", r.stdout), re.search(r"SubmitTime=(\S+)", r.stdout)
        if state is None or submitted is None or state.group(1) != "PENDING":  # COMPLETING: requeue not done
            return
        if time.time() < datetime.datetime.fromisoformat(submitted.group(1)).timestamp() + 2:
            return
        self.run("scontrol", "update", f"JobId={job}", "StartTime=now", check=False)

    def stop(self):
        self.run("scancel", "--full", "--user", os.environ.get("USER", "root"), check=False)
        for name in ("slurmd", "slurmctld", "munged"):
            pidfile = self.root / f"{name}.pid"
            try:
                pid = int(pidfile.read_text().strip())
            except (OSError, ValueError):
                continue
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            for _ in range(100):
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        pytest.skip(f"SLURM cannot be used here: {', '.join(missing)} not installed (Debian: apt-get install "
                    "slurm-wlm munge; .ci/run installs them)")
    root = Path(tempfile_short())
    c = Cluster(root)
    try:
        c.start()
        yield c
    finally:
        c.stop()
        if not os.environ.get("STRUCTINIT_KEEP_SLURM"):  # keep the logs for debugging when asked
            shutil.rmtree(root, ignore_errors=True)


def tempfile_short() -> str:
    """A short folder name (munge's socket path must stay under the UNIX socket limit)."""
    import tempfile

    return tempfile.mkdtemp(prefix="si-slurm-", dir="/tmp")


def squeue(cluster, job):
    """``[(task, state, reason), ...]`` of the array's tasks still queued or running. A failed
    ``squeue`` (a controller too busy to answer in time) is tried again, never read as an empty
    queue: an empty queue is how this test knows the array is done."""
    error = ""
    for _ in range(10):
        try:
            r = cluster.run("squeue", "-h", "-j", str(job), "-o", "%i|%T|%r", check=False, timeout=120)
        except subprocess.TimeoutExpired:
            error = "no answer in 120 s"
            continue
        if r.returncode == 0:
            return [tuple(line.strip().split("|", 2)) for line in r.stdout.splitlines() if line.strip()]
        error = (r.stderr or r.stdout).strip()
        time.sleep(3)
    raise AssertionError(f"squeue failed 10 times: {error}\n{cluster.diagnose(job)}")


def structinit(*args, cwd, env, timeout=300):
    full = dict(env, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "structinit", *map(str, args)], cwd=cwd, env=full,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_a_grid_on_slurm_survives_requeue_and_the_time_limit_signal(cluster, tmp_path):
    (tmp_path / "grid.toml").write_text(GRID)
    env = cluster.env
    r = structinit("bench", "grid", "grid.toml", "--launcher", "slurm", "--cpus", "1", "--json", cwd=tmp_path,
                   env=env)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    job = doc["job_id"]
    assert doc["submitted"] and doc["to_launch"] == 2
    runs = [p for p in (tmp_path / "runs").iterdir() if len(p.name) == 12]

    def task(run):
        try:
            return json.loads((run / "task.json").read_text())
        except (OSError, ValueError):
            return None

    def metrics(run):
        return [m["epoch"] for m in RunDir(run).read_metrics()]

    requeued = signalled = None
    started = {}  # run -> when its training was first seen running
    deadline = time.monotonic() + 600
    while (requeued is None or signalled is None) and time.monotonic() < deadline:
        for run in runs:
            t = task(run)
            if not t or t.get("state") != "running" or not t.get("slurm") or run in (requeued, signalled):
                continue
            done = metrics(run)
            log = (run / "log.txt").read_text() if (run / "log.txt").exists() else ""
            slurm = t["slurm"]
            # the task whose own job id is the array's requeues itself: `scontrol requeue` of that
            # id alone would requeue the whole array
            carries_array_id = slurm["job_id"] == slurm["array_job_id"]
            if requeued is None and done == [1] and not carries_array_id:
                # a preemption: the scheduler requeues the running task
                cluster.run("scontrol", "requeue", f"{slurm['array_job_id']}_{slurm['array_task_id']}")
                requeued = run
            elif signalled is None and not done and "trainable params" in log and carries_array_id:
                # a few steps into epoch 1 the time limit approaches: SLURM sends USR2 to the job
                # step (--signal=USR2@...); here scancel sends it to step 0, the training process
                if time.monotonic() - started.setdefault(run, time.monotonic()) > 1:  # an epoch takes ~5 s
                    cluster.run("scancel", "--signal=USR2", f"{t['slurm']['job_id']}.0")
                    signalled = run
        time.sleep(0.2)
    assert requeued is not None and signalled is not None, "no task could be requeued or signalled in time"

    # requeued jobs wait ~2 minutes before they are eligible again; let them start as soon as SLURM
    # can launch them (Cluster.start_now). A restarted task imports torch again and trains its last
    # epoch: minutes on a slow, busy machine. While both tasks are being requeued squeue may list
    # neither, so the array is done when squeue is empty and both runs have finished (or squeue
    # has stayed empty for 2 minutes: a lost task).
    def finished():
        return all((task(run) or {}).get("state") == "finished" for run in runs)

    deadline, empty_since = time.monotonic() + 1500, None
    while time.monotonic() < deadline:
        states = squeue(cluster, job)
        if states:
            empty_since = None
        else:
            empty_since = empty_since or time.monotonic()
            if finished() or time.monotonic() - empty_since > 120:
                break
        for jid, state, reason in states:
            if state == "PENDING":
                cluster.start_now(jid)
                if "held" in reason.lower():  # a launch that failed on a busy node holds the task
                    cluster.run("scontrol", "release", jid, check=False)
        time.sleep(1)
    left = squeue(cluster, job)
    assert not left and finished(), f"the array did not finish: {left}\n" + "\n".join(
        f"{run.name}: {(run / 'log.txt').read_text()[-1500:] if (run / 'log.txt').exists() else 'no log'}"
        for run in runs) + "\n" + cluster.diagnose(job)

    rep = structinit("bench", "report", "runs", "--json", cwd=tmp_path, env=env)
    assert rep.returncode == 0, rep.stderr
    grid = json.loads(rep.stdout)["grids"][0]
    assert grid["counts"] == {"finished": 2} and grid["problems"] == []
    assert sorted((r["row"], r["seed"]) for r in grid["runs"]) == [("impulse", 0), ("mimetic", 0)]
    for r in grid["runs"]:
        assert r["final_acc"] is not None and r["epochs"] == 2 and r["best_on"] == "val"
    for run in runs:
        assert metrics(run) == [1, 2]  # every epoch exactly once
    # the requeued task resumed from its checkpoint after epoch 1, in a restarted job
    final = json.loads((requeued / "final.json").read_text())
    assert final["resumed_from"] == 1
    assert task(requeued)["slurm"]["restart"] >= 1
    assert (requeued / "log.txt").read_text().count("task start:") == 2
    # the signalled task requeued itself and resumed: from epoch 1 when it judged that the epoch
    # in progress fitted in the time left (it finished it before stopping), else from the start
    # (on a slow machine the signal comes a step or two into an epoch of a minute or more)
    log = (signalled / "log.txt").read_text()
    assert "SIGUSR2" in log and "requeued SLURM job" in log and log.count("task start:") == 2
    first_start = log.split("task stopped (SIGUSR2")[0]
    finished_first = "epoch 1/2" in first_start
    assert json.loads((signalled / "final.json").read_text())["resumed_from"] == (1 if finished_first else None)
    assert ("resuming after epoch 1" in log) == finished_first
    st = structinit("bench", "grid", "grid.toml", "--status", "--json", cwd=tmp_path, env=env)
    assert json.loads(st.stdout)["counts"]["finished"] == 2
    again = structinit("bench", "grid", "grid.toml", "--launcher", "slurm", cwd=tmp_path, env=env)
    assert again.returncode == 0 and "nothing to launch: 2 of 2 runs finished" in again.stdout

    shared_fit(cluster, tmp_path / "shared")

    # A refused submission shows SLURM's message and leaves nothing. Asked of this cluster, in this
    # test: a second test using the cluster may run on another xdist worker, which would start a
    # second cluster on the same host beside this one.
    refused = tmp_path / "refused"
    refused.mkdir()
    (refused / "grid.toml").write_text(GRID)
    r = structinit("bench", "grid", "grid.toml", "--launcher", "slurm", "--partition", "nosuch", cwd=refused, env=env)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith("error: SLURM refused the job: ") and "invalid partition" in lines[-1].lower()
    assert "Traceback" not in r.stderr
    assert not list((refused / "runs" / "slurm").iterdir())


# Runs that differ only in their learning rate: the same model (seed 0) and the same first training
# inputs, so the same impulse data fit. One step of training each: what is counted is fits. Six
# tasks on the node's CPUs (two on a 2-core machine): the first ones start together and race for
# the fit, the later ones find it written. Each task starts Python and torch afresh (about 9 s on a
# loaded 2-core machine), so twenty took three minutes of this test's four.
SHARED_TASKS = 6
SHARED = variant(DIGITS, name="slurm-shared-fit", title="Runs of one model and batch", rows="lr", epochs=1,
                 init="impulse", init_params={"data_fit_samples": 16, "data_fit": 100}, train_size=16,
                 batch_size=16, warmup_epochs=0,
                 axes="".join(f'[[axes.lr]]\nid = "{i}"\nlr = {0.001 * (i + 1):.3f}\n' for i in range(SHARED_TASKS)))


def shared_fit(cluster, folder):
    """A SLURM array of tasks with one model seed and one batch fits once; the other tasks read
    the fitted artifact the first wrote (under its lock), and every run starts from the same Q/K."""
    folder.mkdir()
    (folder / "grid.toml").write_text(SHARED)
    cache = folder / "cache"
    env = dict(cluster.env, STRUCTINIT_CACHE=str(cache))
    r = structinit("bench", "grid", "grid.toml", "--launcher", "slurm", "--cpus", "1", "--json", cwd=folder, env=env)
    assert r.returncode == 0, r.stderr
    job = json.loads(r.stdout)["job_id"]
    runs = [p for p in (folder / "runs").iterdir() if len(p.name) == 12]
    assert len(runs) == SHARED_TASKS
    deadline = time.monotonic() + 2400
    while squeue(cluster, job) and time.monotonic() < deadline:
        for jid, state, reason in squeue(cluster, job):
            if state == "PENDING" and "held" in reason.lower():
                cluster.run("scontrol", "release", jid, check=False)
        time.sleep(2)
    states = [json.loads((run / "task.json").read_text())["state"] for run in runs if (run / "task.json").exists()]
    assert states == ["finished"] * SHARED_TASKS, f"{states}\n{cluster.diagnose(job)}"
    fitted = [run for run in runs if "data fit: layer" in (run / "log.txt").read_text()]
    assert len(fitted) == 1, [run.name for run in fitted]  # the others read what it wrote
    assert len(list(cache.glob("*-fit-*.safetensors"))) == 1
    keys = {json.loads((run / "config.json").read_text())["init_report"]["data_fit"]["artifact"]["key"]
            for run in runs}
    assert len(keys) == 1
    cached = [json.loads((run / "config.json").read_text())["init_report"]["data_fit"]["artifact"]["cached"]
              for run in runs]
    assert sorted(cached) == [False] + [True] * (SHARED_TASKS - 1)
