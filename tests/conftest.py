"""Shared test fixtures: every test gets its own empty user cache; the CLI runs in-process (``cli``)
or as the real console entry point in a subprocess (``cli_process``).

Test scratch folders (``tmp_path``) are made on a RAM file system (``/dev/shm``) where there is one
with room and ``TMPDIR`` names no other place: the code under test fsyncs every file it writes
(hundreds in the fast tier, about 8 ms each on this machine's disk, a tenth of the tier's time),
and what a test writes is scratch. ``STRUCTINIT_TEST_DISK_TMP=1`` keeps them on disk.

Every process runs one torch thread unless ``OMP_NUM_THREADS`` says otherwise. The suite tests
what CI runs, on the CPU: CUDA is hidden (``device="auto"`` means the CPU) unless
``STRUCTINIT_TEST_GPU=1``, which runs the GPU paths (``pytest -m gpu``, tests/test_gpu.py) on a
machine with a GPU. Set before torch initializes CUDA, so it holds for subprocesses too."""

import contextlib
import io
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _scratch_in_memory(shm: Path = Path("/dev/shm"), room: int = 4 * 2 ** 30) -> None:
    """Make the test scratch folders on ``shm`` (see the module docstring) when it is a writable
    folder with ``room`` bytes free and neither ``TMPDIR`` nor ``STRUCTINIT_TEST_DISK_TMP`` says
    otherwise (pytest's ``tmp_path`` folders live under ``tempfile.gettempdir()``)."""
    if os.environ.get("TMPDIR") or os.environ.get("STRUCTINIT_TEST_DISK_TMP") == "1":
        return
    try:
        st = os.statvfs(shm)
    except OSError:
        return
    if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK) and st.f_bavail * st.f_frsize >= room:
        tempfile.tempdir = str(shm)


_scratch_in_memory()
GPU_TESTS = os.environ.get("STRUCTINIT_TEST_GPU") == "1"
if not GPU_TESTS:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
# One torch thread per process unless the caller says otherwise: CI runs two pytest workers on two
# cores, and each spawns training processes, so a second thread per process only contends (set
# before torch is imported, so it holds for this process and every subprocess).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The Ctrl-C tests send SIGINT to the processes they start. A suite started in the background by a
# non-interactive shell (or under nohup) ignores SIGINT, and an ignored signal stays ignored across
# exec: the children would never see it. A handler (unlike SIG_IGN) is reset to the default on exec.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="GPU test: run with STRUCTINIT_TEST_GPU=1 on a machine with CUDA")
    for item in items:
        if "gpu" in item.keywords and not GPU_TESTS:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    cache = tmp_path / "user-cache"
    monkeypatch.setenv("STRUCTINIT_CACHE", str(cache))
    return cache


@pytest.fixture
def one_torch_thread():
    """Run the test on one torch thread (contended threads on a small machine are far slower),
    restoring the count after."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture
def cache_dir(_isolated_cache):
    return _isolated_cache


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str


def run_cli_process(*args, env=None, cwd=None, timeout=900) -> CliResult:
    """Run ``python -m structinit ARGS`` in a subprocess (the real entry point)."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    r = subprocess.run([sys.executable, "-m", "structinit", *map(str, args)], capture_output=True, text=True,
                       env=full_env, cwd=cwd, timeout=timeout)
    return CliResult(r.returncode, r.stdout, r.stderr)


def run_cli(*args, env=None, cwd=None) -> CliResult:
    """Run ``structinit ARGS`` in this process through :func:`structinit.cli.app.main`, with ``env``
    added to the environment and ``cwd`` as the working folder for the call."""
    from structinit.cli.app import main

    out, err = io.StringIO(), io.StringIO()
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    os.environ.update({k: str(v) for k, v in (env or {}).items()})
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main([str(a) for a in args])
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
    return CliResult(code, out.getvalue(), err.getvalue())


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture
def cli_process():
    return run_cli_process


#: What a refused command may print on stderr before its one ``error:`` line: progress (a stage or a
#: count, each with the seconds taken, printed once work has taken 2 s: a loaded machine gets there
#: sooner than an idle one), the fit's estimated time, a wait for another process, train's line
#: about the run it starts, a warning or note.
SIDE_LINE = re.compile(r"^(.*\(\d+(\.\d+)?s[,)].*|data fit: .*|waiting for another process .*|warning: .*|note: .*"
                       r"|\S+ \([\d,]+ trainable params\) on .*)$")


def error_line(stderr: str) -> str:
    """The one ``error:`` line of a refused command's ``stderr``, checked: no traceback, exactly one
    ``error:`` line and it comes last, and every line before it is progress or a notice
    (:data:`SIDE_LINE`), never another library's output. A test asserts on what this returns, never
    on stderr holding one line: how many progress lines come first depends on the machine's load."""
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], stderr
    assert all(SIDE_LINE.match(line) for line in lines[:-1]), stderr
    return errors[0]


def says(message: str, *parts: str) -> bool:
    """Assert that ``message`` names every one of ``parts`` (the parameter or flag, the cause, the
    value refused, the way out) and return ``True``: what a message test checks, never a whole
    sentence, so rewording passes and a message that loses its parameter or its cause fails."""
    missing = [part for part in parts if part not in message]
    assert not missing, f"{message!r} does not name {missing}"
    return True


@contextlib.contextmanager
def feeding_fifo(path, data: bytes = b""):
    """A FIFO (named pipe) at ``path`` that gives every reader that opens it ``data`` and then the end
    of the file, for as long as the block runs: code that reads it when it must not gets an answer
    instead of waiting forever, so a test of such code fails on its assertion and never hangs.
    Yields ``path``; afterwards the feeder is stopped (the FIFO may have been moved aside meanwhile:
    it is found by its inode)."""
    os.mkfifo(path)
    inode = os.stat(path).st_ino
    folder = Path(path).parent
    stop = threading.Event()

    def where():
        return next((p for p in folder.iterdir() if p.name.startswith(Path(path).name) and not p.is_symlink()
                     and os.lstat(p).st_ino == inode), None)

    def feed():
        while not stop.is_set():
            now = where()
            if now is None:
                return
            try:
                fd = os.open(now, os.O_WRONLY)  # waits for a reader (or for the stop below)
            except OSError:
                return
            try:
                if not stop.is_set():
                    os.write(fd, data)
            except OSError:  # the reader went away
                pass
            finally:
                os.close(fd)
            while not stop.is_set():  # this reader sees the end of the file before a writer opens for the next
                try:
                    probe = os.open(now, os.O_WRONLY | os.O_NONBLOCK)
                except OSError:  # ENXIO: no reader has it open any more
                    break
                os.close(probe)
                stop.wait(0.01)

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    try:
        yield path
    finally:
        stop.set()
        for _ in range(1000):  # a reader's end opened without blocking lets the feeder's open return, and it stops
            now = where()
            if now is None or not feeder.is_alive():
                break
            os.close(os.open(now, os.O_RDONLY | os.O_NONBLOCK))
            feeder.join(0.01)
        feeder.join(10)
        assert not feeder.is_alive(), "the FIFO feeder did not stop"


def digest(path) -> str:
    """SHA-256 of a file's bytes: to show that a test left a user's file exactly as it was."""
    import hashlib

    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def digits_images(n, split="train"):
    """The first ``n`` images of sklearn's digits ``split`` (train or test), normalized as the digits
    runs normalize them: real inputs for a data fit or a measurement."""
    from structinit.training.augment import normalize
    from structinit.training.datasets import load_dataset

    data = load_dataset("digits")
    return normalize(getattr(data, split).images[:n], data.info.mean, data.info.std)


def vit_digits(seed=0, **preset):
    """The ``vit-digits`` model (8x8 digits, patch 1: 64 tokens, dim 64, 4 blocks of 4 heads) built with
    ``seed``; ``preset`` overrides the preset's settings (``pool="token"``)."""
    from structinit.training.models import ModelConfig, build_model

    return build_model(ModelConfig("vit-digits", **preset), num_classes=10, image_size=8, in_chans=1, seed=seed)


def vit_filling(seed=0):
    """A ViT whose token's content fills its residual stream (16x16 images in 4x4 patches: 16 values a
    token into dim 16, a 4x4 grid, 4 blocks of 4 heads): the class of shape where the whole-stream
    fit was measured unstructured and the weak-structure warning advises (see structinit.fit.advice)."""
    from structinit.training.models import ModelConfig, build_model

    return build_model(ModelConfig("vit-digits", patch=4, dim=16), num_classes=10, image_size=16, in_chans=1,
                       seed=seed)


def filling_images(n, split="train"):
    """The first ``n`` digits of ``split`` upsampled to 16x16 (bilinear), the inputs of :func:`vit_filling`."""
    import torch.nn.functional as F

    return F.interpolate(digits_images(n, split), size=(16, 16), mode="bilinear", align_corners=False)


def hold_lock(folder: Path):
    """Another process that holds ``folder``'s run lock until it is killed."""
    code = ("import sys, time; from structinit.training.rundir import RunDir; RunDir(sys.argv[1]).lock(); "
            "print('held', flush=True); time.sleep(600)")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", code, str(folder)], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "held"
    return proc


def wait_for(cond, timeout=300, every=0.2):
    """``cond()``'s first true value, polled every ``every`` seconds; fails after ``timeout`` (a hang
    bound, not a speed: nothing here asserts how fast a loaded machine gets there)."""
    import time

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        value = cond()
        if value:
            return value
        time.sleep(every)
    raise AssertionError("timed out waiting")
