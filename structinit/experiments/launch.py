"""Launching a grid's pending runs: preparing them (the manifest, each run's ``config.json``, every
impulse artifact solved once into the cache), then the ``local`` launcher (worker processes on this
machine) or the ``print`` launcher (the ``structinit train`` command of every run, for any
scheduler). The SLURM launcher is :mod:`structinit.experiments.slurm`.

Example::

    ex = expand(load_grid("digits"), overrides=["epochs=2"], seeds=2, runs_dir="runs")
    todo = prepare_runs(ex)                  # the cells to run (pending or failed)
    presolve(todo)                           # impulse artifacts into the cache, once
    summary = run_local(ex, todo, jobs=2)    # two runs at a time, one thread each on 2 cores
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from structinit.errors import StructinitError, UsageError, param
from structinit.experiments.expand import Cell, Expansion
from structinit.experiments.status import grid_status

LAUNCHERS = ("local", "slurm", "print")


def check_launcher(name: str) -> str:
    if name not in LAUNCHERS:
        raise UsageError(f"unknown {param('launcher')} {name!r}; choose one of {', '.join(LAUNCHERS)}")
    return name


def cpu_count() -> int:
    """CPUs this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS
        return os.cpu_count() or 1


# --------------------------------------------------------------------------- preparing

def prepare_runs(ex: Expansion, check: Optional[Callable[[List[Cell]], None]] = None) -> List[Cell]:
    """Record the grid (its manifest) and give every run to launch (pending; failed or damaged: a
    rerun retries it, a damaged one after its task sets the damaged files aside) its folder with
    ``config.json``. Running and finished runs are left alone. Returns the cells to launch, one per
    distinct run. ``check(cells)`` is called with them before anything is written (e.g.
    :func:`check_environment`)."""
    from structinit.training.rundir import RunDir

    st = grid_status(ex)
    todo_keys = {r["key"] for r in st.runs if r["state"] in ("pending", "failed", "damaged")}
    todo = [c for c in ex.unique_cells() if c.key in todo_keys]
    if check is not None:
        check(todo)
    ex.write_manifest()
    for cell in todo:
        rd = RunDir(ex.run_dir(cell))
        why = config_problem(rd, cell.key)
        if why is None:
            continue
        if cell.config is None:
            raise UsageError(f"run {cell.key} has no usable config.json ({why or 'none'}) and the grid was not "
                             "expanded from its file: run `structinit bench grid GRID.toml` with its grid file")
        if why:  # the grid holds the settings: the damaged file is kept aside and written anew
            import warnings

            from structinit.errors import StructinitWarning

            rd.lock()  # a task that holds it is writing the run: RunBusy says so
            try:
                aside = rd.set_aside_files([rd.CONFIG], why)
            finally:
                rd.unlock()
            warnings.warn(StructinitWarning(f"{why}: moved to {aside} and written again from the grid"),
                          stacklevel=2)
        rd.create()
        rd.write_config({"config": cell.config.to_dict(), "key": cell.key, "grid": ex.spec.name})
    return todo


def config_problem(rd: Any, key: str) -> Optional[str]:
    """Why the ``config.json`` of run folder ``rd`` (a :class:`~structinit.training.rundir.RunDir`)
    is not the settings of run ``key``: ``""`` when there is none, ``None`` when it is sound, else a
    line (it does not parse, is not a regular file, lacks the settings or describes another run)."""
    from structinit.errors import StructinitError
    from structinit.training.config import TrainConfig

    path = rd.file(rd.CONFIG)
    if not os.path.lexists(path):
        return ""
    try:
        doc = rd.read_config()
        if not isinstance(doc, dict) or not isinstance(doc.get("config"), dict):
            return f"{path} holds no run settings"
        found = TrainConfig.from_dict(doc["config"]).key
    except StructinitError as exc:
        return str(exc)
    except (KeyError, TypeError, ValueError) as exc:
        return f"{path} is unreadable ({type(exc).__name__}: {exc})"
    return None if found == key else f"{path} describes run {found}, not run {key}"


def check_environment(cells: List[Cell], launcher: str = "local", warn: Callable[[str], None] = lambda m: None) -> None:
    """Find the mistakes every run would make alike once, before any is launched: a dataset whose
    files are not where the runs read them (each dataset and folder checked once), and on this
    machine (``local``) a CUDA device without a GPU. Runs launched elsewhere (``slurm``,
    ``print``) may see other files and devices: a missing dataset is then one line to ``warn``."""
    from structinit.training.datasets import check_files

    seen: Set[Tuple[str, Optional[str], bool]] = set()
    devices: Dict[str, Cell] = {}
    for cell in cells:
        cfg = cell.config
        if cfg is None:
            continue
        devices.setdefault(str(cfg.device), cell)
        where = (cfg.dataset, cfg.data_dir, bool(cfg.download))
        if where in seen:
            continue
        seen.add(where)
        try:
            check_files(cfg.dataset, cfg.data_dir, cfg.download)
        except UsageError as exc:
            runs = sum(1 for c in cells if c.config is not None
                       and (c.config.dataset, c.config.data_dir, bool(c.config.download)) == where)
            text = f"{runs} run(s) to launch read {cfg.dataset}, and {exc.args[0]}"
            if launcher == "local":
                raise UsageError(text) from None
            warn(f"{text} (seen from this machine; the runs fail where their nodes do not see the files either)")
    if launcher == "local":
        from structinit.runtime import resolve_device

        for device in devices:
            if device.startswith("cuda"):
                try:
                    resolve_device(device)
                except UsageError:
                    runs = sum(1 for c in cells if c.config is not None and str(c.config.device) == device)
                    raise UsageError(f"{runs} run(s) to launch ask for {param('device')} {device} (set by the grid or "
                                     f"{param('overrides')}), and this machine has no CUDA GPU; give device=cpu or "
                                     "auto, or launch them where a GPU is (--launcher slurm or print)") from None


def init_solves(cells: List[Cell]) -> list:
    """The distinct :class:`~structinit.solver.config.SolveConfig` the inits of ``cells`` will ask for
    and that can be made before the runs start (:meth:`~structinit.init.base.InitSpec.presolves`:
    ``impulse``'s solve, ``impulse-2024``'s shared one). The shape comes from the run's model itself
    (built once per architecture, and only for an init that asks, and read as the init reads it), so
    any model the init supports is solved for correctly."""
    import json

    from structinit.init.attention_target import AttentionTarget
    from structinit.training.datasets import dataset_info
    from structinit.training.models import build_model

    out: Dict[str, Any] = {}
    shapes: Dict[str, Any] = {}
    for cell in cells:
        cfg = cell.config
        if cfg is None or cfg.init is None:
            continue
        arch = json.dumps([cfg.model.to_dict(), cfg.dataset, cfg.image_size], sort_keys=True, default=str)

        def shape(cfg=cfg, arch=arch):
            if arch not in shapes:
                info = dataset_info(cfg.dataset)
                model = build_model(cfg.model, num_classes=info.num_classes or 1000,
                                    image_size=cfg.image_size or info.image_size, in_chans=info.in_chans,
                                    default_patch=info.default_patch)
                t = AttentionTarget(model, need_grid=True)
                shapes[arch] = (t.grid, t.dim, t.heads, t.depth)
            return shapes[arch]

        for sc in cfg.init.presolves(shape, seed=cfg.seed):
            out.setdefault(sc.filename, sc)
    return list(out.values())


def presolve(cells: List[Cell], log: Callable[[str], None] = lambda m: None, device: str = "auto",
             threads: Optional[int] = None, progress: Optional[Callable[[int, int], None]] = None,
             stage: Callable[[str], None] = lambda words: None) -> Dict[str, Any]:
    """Solve every impulse artifact ``cells`` need into the cache (one at a time, before any run
    starts, so that no two tasks wait on the same solve). Returns counts and seconds.

    An artifact already in the cache is read in silence; one that is solved is named to ``stage``
    as its solve starts (``artifact 2/5: ...``, the count of all the artifacts), its steps go to
    ``progress(done, total)`` as the solver takes them (at least once a second), and a long solve's
    estimated time to ``log`` first. Each artifact is in the cache once solved, so a setup stopped
    part way (Ctrl-C, SIGTERM) keeps what it solved and the next one goes on from there."""
    solves = init_solves(cells)
    if not solves:
        return {"artifacts": 0, "solved": 0, "seconds": 0.0}
    from structinit.solver.run import solve

    t0 = time.perf_counter()
    solved = 0
    for i, sc in enumerate(solves):
        steps = _named_steps(f"artifact {i + 1}/{len(solves)}: {sc.describe()}", stage, progress)
        result = solve(sc, device=device, threads=threads, progress=steps, log=log)
        if not result.cached:
            solved += 1
            assert result.artifact.path is not None  # solve() wrote it into the cache
            log(f"solved impulse artifact {i + 1}/{len(solves)}: {result.artifact.path.name}")
    return {"artifacts": len(solves), "solved": solved, "seconds": round(time.perf_counter() - t0, 3)}


def _named_steps(words: str, stage: Callable[[str], None],
                 progress: Optional[Callable[[int, int], None]]) -> Callable[[int, int], None]:
    """A solve's ``progress(done, total)`` that names the solve to ``stage`` at its first step (a
    solve read from the cache takes none, and is not named) and passes every step on to ``progress``."""
    started: List[bool] = []

    def steps(done: int, total: int) -> None:
        if not started:
            started.append(True)
            stage(words)
        if progress is not None:
            progress(done, total)

    return steps


# --------------------------------------------------------------------------- print

def print_commands(ex: Expansion, cells: List[Cell]) -> List[Dict[str, Any]]:
    """``structinit train`` commands for ``cells``: ``[{"key", "cell", "out", "argv", "command"}]``."""
    from structinit.experiments.task import shell_command, train_command

    out = []
    for cell in cells:
        argv = train_command(cell.config)
        out.append({"key": cell.key, "cell": ex.describe(cell), "out": str(ex.run_dir(cell)), "argv": argv,
                    "command": shell_command(argv)})
    return out


# --------------------------------------------------------------------------- local

@dataclass
class LocalSummary:
    """What :func:`run_local` did. ``overhead_seconds``: wall time outside ``train`` per run,
    measured on this launch (worker start-up included)."""

    launched: int
    outcomes: Dict[str, int]
    wall_seconds: float
    train_seconds: float
    jobs: int
    threads: Optional[int]
    interrupted: bool = False
    runs: List[Dict[str, Any]] = field(default_factory=list)

    @property
    def overhead_seconds(self) -> Optional[float]:
        if not self.launched:
            return None
        return max(0.0, self.wall_seconds * self.jobs - self.train_seconds) / self.launched

    def to_dict(self) -> Dict[str, Any]:
        return {"launched": self.launched, "outcomes": self.outcomes, "wall_seconds": round(self.wall_seconds, 3),
                "train_seconds": round(self.train_seconds, 3), "jobs": self.jobs, "threads": self.threads,
                "interrupted": self.interrupted, "overhead_seconds_per_run": None if self.overhead_seconds is None
                else round(self.overhead_seconds, 3), "runs": self.runs}


class Interrupted(KeyboardInterrupt):
    """A signal that stops the launcher (SIGTERM), raised as Ctrl-C raises KeyboardInterrupt, and
    naming it: ``signal_name``."""

    def __init__(self, signal_name: str):
        super().__init__(signal_name)
        self.signal_name = signal_name


def interruption_name(exc: BaseException) -> str:
    """The signal a KeyboardInterrupt came from: ``SIGTERM`` (an :class:`Interrupted`), else ``SIGINT``."""
    return exc.signal_name if isinstance(exc, Interrupted) else "SIGINT"


def warm_up() -> None:
    """Import what training needs (torch, timm, the training modules) once per worker, so that
    the runs do not pay for it."""
    import timm  # noqa: F401
    import torch  # noqa: F401

    import structinit.training.loop  # noqa: F401
    import structinit.training.models  # noqa: F401


def _worker(tasks, results, threads: Optional[int], default_threads: int, device: Optional[str],
            why: Any = None) -> None:
    """A local worker process: runs tasks from ``tasks`` until it gets ``None`` or SIGTERM. It
    starts with SIGINT, SIGTERM and SIGUSR2 blocked (:func:`run_local`), so that one sent while it
    starts waits for its handlers: SIGINT is ignored (the launcher decides; it sends SIGTERM), and
    a SIGTERM that came meanwhile stops it before it takes a run. ``why``: a shared byte array in
    which the launcher names the signal it passes on (its run logs then say what was sent)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from structinit.experiments.task import run_task

    stopper = _worker_stopper(why)
    stopper.install()  # unblocks SIGTERM and SIGUSR2
    if hasattr(signal, "pthread_sigmask"):  # a Ctrl-C that came meanwhile is dropped
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    os.environ["OMP_NUM_THREADS"] = str(threads or default_threads)  # before torch is imported
    try:
        if not stopper.event.is_set():  # stopped while it started: no run, so nothing to import
            warm_up()
        parent = os.getppid()

        def watch_parent():  # a launcher killed outright must not leave its workers training
            while not stopper.event.wait(2.0):
                if os.getppid() != parent:
                    stopper.request("the launcher is gone")

        threading.Thread(target=watch_parent, daemon=True).start()
        while not stopper.event.is_set():
            try:
                path = tasks.get(timeout=0.5)
            except queue.Empty:
                continue
            if path is None:
                break
            results.put(("start", path, None))
            try:
                outcome = run_task(path, threads=threads, default_threads=default_threads, device=device,
                                   stopper=stopper).to_dict()
            except Exception as exc:  # noqa: BLE001 - the launcher reports it and goes on
                msg = exc.render() if hasattr(exc, "render") else f"{type(exc).__name__}: {exc}"
                outcome = {"key": Path(path).name, "path": path, "state": "failed", "seconds": 0.0,
                           "train_seconds": 0.0, "final_acc": None, "error": msg.splitlines()[0], "requeued": False}
            results.put(("done", path, outcome))
    finally:
        stopper.retire()  # the worker exits next: a SIGTERM now has nothing left to stop


def _worker_stopper(why: Any) -> Any:
    """A worker's :class:`~structinit.experiments.task.Stopper` whose SIGTERM, when the launcher
    sent it on for a signal of its own (named in the shared ``why``), is logged as that signal."""
    from structinit.experiments.task import Stopper

    class WorkerStopper(Stopper):
        def _on_signal(self, signum: int, frame: Any) -> None:
            sent = why.value.decode() if why is not None and signum == signal.SIGTERM else ""
            if sent:
                self.request(f"{sent} to the launcher")
            else:
                super()._on_signal(signum, frame)

    return WorkerStopper()


def run_local(ex: Expansion, cells: List[Cell], *, jobs: int = 1, threads: Optional[int] = None,
              device: Optional[str] = None, progress: Optional[Callable[[float, int], None]] = None,
              log: Callable[[str], None] = lambda m: None, stop_timeout: float = 120.0) -> LocalSummary:
    """Train ``cells`` in ``jobs`` worker processes on this machine, ``threads`` torch threads each
    (default: the CPUs divided between the workers). ``progress(done, total)`` after every run and,
    while runs train, every :data:`PARTIAL_EVERY` seconds with ``done`` counting each running run's
    share of its epochs done (``2.4``: two runs finished and 40% of a third, as its
    ``metrics.jsonl`` says), so one long run is not a silent phase;
    ``log`` gets one line per finished run. Ctrl-C (KeyboardInterrupt) or SIGTERM stops the workers
    at their next step and returns with ``interrupted``; a second one kills them. Without
    ``threads``, runs whose settings set ``threads`` keep them."""
    import multiprocessing as mp

    if not isinstance(jobs, int) or jobs < 1:
        raise UsageError(f"{param('jobs')} must be at least 1, got {jobs!r}")
    t0 = time.perf_counter()
    jobs = min(jobs, max(len(cells), 1))
    default_threads = max(1, cpu_count() // jobs)
    summary = LocalSummary(len(cells), {}, 0.0, 0.0, jobs, threads or default_threads)
    if not cells:
        return summary
    ctx = mp.get_context("spawn")
    tasks, results = ctx.Queue(), ctx.Queue()
    by_path = {str(ex.run_dir(c)): c for c in cells}
    for path in by_path:
        tasks.put(path)
    for _ in range(jobs):
        tasks.put(None)
    why: Any = ctx.Array("c", 32)  # the signal the launcher passes on to its workers (empty: none yet)
    workers = [ctx.Process(target=_worker, args=(tasks, results, threads, default_threads, device, why), daemon=True)
               for _ in range(jobs)]
    got = _Results(ex, results, by_path, summary, log, progress, total=len(cells))
    old_term = sigterm_interrupts()  # before any worker starts: a SIGTERM from here on is a Ctrl-C
    try:
        _start_workers(workers)
        if progress:
            progress(0, got.total)
        while got.done < got.total and any(w.is_alive() for w in workers):
            got.collect(0.5)
            got.partial()
        while got.collect(0.2):  # results sent just before the workers exited
            pass
    except KeyboardInterrupt as exc:
        why.value = interruption_name(exc).encode()
        _stop_workers(workers, got, stop_timeout)
    finally:
        for w in workers:
            if w.is_alive():
                w.kill()
            if w.pid is not None:  # started
                w.join(timeout=5)
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
    lost = got.total - got.done
    if lost and not summary.interrupted:
        summary.outcomes["failed"] = summary.outcomes.get("failed", 0) + lost
        log(f"{lost} run(s) got no result: a worker process died (out of memory?); see their log.txt")
    summary.wall_seconds = time.perf_counter() - t0
    return summary


def _start_workers(workers: List[Any]) -> None:
    """Start ``workers`` with SIGINT, SIGTERM and SIGUSR2 blocked (a child keeps the mask of the
    thread that started it, across exec): one sent to a worker while it starts waits until the
    worker's handlers are in place (:func:`_worker`) instead of ending it half-started. In the main
    thread, a Ctrl-C or SIGTERM to the launcher meanwhile is held until every worker has started
    (each gets the launcher's SIGTERM then), and raised as KeyboardInterrupt after."""
    from structinit.experiments.task import STOP_SIGNALS

    held: List[int] = []
    main = threading.current_thread() is threading.main_thread()
    handled = (signal.SIGINT, signal.SIGTERM)
    saved = {sig: signal.signal(sig, lambda signum, frame: held.append(signum)) for sig in handled} if main else {}
    blockable = hasattr(signal, "pthread_sigmask")  # not on Windows
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, *STOP_SIGNALS}) if blockable else None
    try:
        for w in workers:
            w.start()
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        if mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    if held:
        raise Interrupted("SIGTERM") if held[0] == signal.SIGTERM else KeyboardInterrupt


def sigterm_interrupts() -> Any:
    """In the main thread, make SIGTERM raise :class:`Interrupted` (a KeyboardInterrupt, as Ctrl-C
    raises one); returns the handler it replaced (to put back with ``signal.signal``), ``None``
    elsewhere (where signals cannot be handled)."""
    def on_term(signum, frame):
        raise Interrupted("SIGTERM")

    if threading.current_thread() is threading.main_thread():
        return signal.signal(signal.SIGTERM, on_term)
    return None


#: Seconds between two reports of the running runs' progress (:meth:`_Results.partial`).
PARTIAL_EVERY = 5.0


def _epochs_of(cell: Optional[Cell]) -> Optional[int]:
    """The epochs ``cell``'s run trains for (its resolved hyperparameters), ``None`` if not known."""
    try:
        return int(cell.config.hparams()["epochs"]) if cell is not None and cell.config is not None else None
    except (StructinitError, KeyError, TypeError, ValueError):
        return None


@dataclass
class _Results:
    """What :func:`run_local` has heard from its workers: ``done`` of ``total`` runs finished, each
    outcome counted into ``summary`` (its ``outcomes``, ``train_seconds`` and ``runs``), logged and
    reported to ``progress``. ``by_path``: the cell of each run folder."""

    ex: Expansion
    results: Any  # the workers' queue of ("start" | "done", path, outcome)
    by_path: Dict[str, Cell]
    summary: LocalSummary
    log: Callable[[str], None]
    progress: Optional[Callable[[float, int], None]]
    total: int
    done: int = 0
    #: The runs started and not done, with the epochs each trains for (``None``: not known).
    running: Dict[str, Optional[int]] = field(default_factory=dict)
    said: float = field(default_factory=time.monotonic)

    def partial(self) -> None:
        """Every :data:`PARTIAL_EVERY` seconds, ``progress`` with the running runs' shares of their
        epochs done (read from their ``metrics.jsonl``) added to the runs finished."""
        if self.progress is None or time.monotonic() - self.said < PARTIAL_EVERY:
            return
        from structinit.training.rundir import RunDir

        self.said = time.monotonic()
        share = 0.0
        for path, epochs in self.running.items():
            if epochs:
                share += min(len(RunDir(path).read_metrics(strict=False)), epochs) / epochs
        self.progress(self.done + min(share, len(self.running) * 0.999), self.total)

    def collect(self, block: float) -> bool:
        """Take one message, waiting up to ``block`` seconds; ``False`` when none came."""
        try:
            kind, path, outcome = self.results.get(timeout=block)
        except queue.Empty:
            return False
        if kind == "start":
            self.running[path] = _epochs_of(self.by_path.get(path))
            return True
        self.running.pop(path, None)
        self.done += 1
        outcomes = self.summary.outcomes
        outcomes[outcome["state"]] = outcomes.get(outcome["state"], 0) + 1
        self.summary.train_seconds += outcome.get("train_seconds") or 0.0
        cell = self.by_path.get(path)
        outcome["cell"] = self.ex.describe(cell) if cell else path
        self.summary.runs.append(outcome)
        acc = f"final {outcome['final_acc']:.2f}%" if outcome.get("final_acc") is not None else ""
        err = f": {outcome['error']}" if outcome.get("error") else ""
        self.log(f"[{self.done}/{self.total}] {outcome['state']} {outcome['cell']} {acc} ({outcome['seconds']:.1f}s) "
                 f"{path}{err}")
        if self.progress:
            self.progress(self.done, self.total)
        return True


def _stop_workers(workers: List[Any], got: _Results, stop_timeout: float) -> None:
    """After Ctrl-C or SIGTERM: mark the launch interrupted, ask every live worker to stop at its
    next step (SIGTERM), and collect what they send for up to ``stop_timeout`` seconds (a second
    Ctrl-C ends the wait; the caller then kills them)."""
    got.summary.interrupted = True
    got.log("interrupted: stopping the runs at their next step (Ctrl-C again to kill them)")
    for w in workers:
        if w.is_alive() and w.pid is not None:  # a live process has a pid
            os.kill(w.pid, signal.SIGTERM)
    deadline = time.monotonic() + stop_timeout
    try:
        while any(w.is_alive() for w in workers) and time.monotonic() < deadline:
            got.collect(0.2)
        while got.collect(0.2):
            pass
    except KeyboardInterrupt:
        pass


__all__ = ["prepare_runs", "check_environment", "presolve", "init_solves", "print_commands", "run_local",
           "LocalSummary", "LAUNCHERS", "cpu_count", "check_launcher", "Interrupted", "interruption_name",
           "sigterm_interrupts"]
