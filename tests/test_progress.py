"""The plain progress lines of a log (stderr not a terminal): a line every 10% of the work or every
30 s, whichever comes first, with the time left; no line per tenth of work done in a blink (a
model's layers written) and never "about 0 s left". The clock is a fake one the test advances, so
nothing here depends on how fast the machine is."""

import re

import pytest

from structinit.cli import common
from structinit.cli.common import Progress

LINE = re.compile(r"^(?P<label>.*): (?P<done>\d+)/(?P<total>\d+) \((?P<at>[\d.]+)s(, about (?P<left>.+) left)?\)$")


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(common.time, "monotonic", c)
    monkeypatch.setattr(common, "is_tty", lambda: False)
    return c


def lines(capsys):
    return [line for line in capsys.readouterr().err.splitlines() if line]


def test_work_done_in_a_blink_prints_its_stage_alone_and_no_zero_time_left(clock, capsys):
    """12 layers written in the same instant after a long stage: the stage's line, not 12 counts."""
    with Progress("apply impulse") as bar:
        clock.now += 30.0  # a data fit
        bar.stage("apply impulse: writing (top level)")
        for i in range(1, 13):
            bar.update(i, 12)
    said = lines(capsys)
    assert said == ["apply impulse: writing (top level) (30.0s)"]


def test_steady_work_gets_a_line_per_tenth_with_the_time_left(clock, capsys):
    with Progress("solve") as bar:
        for i in range(1, 101):
            clock.now += 0.5
            bar.update(i, 100)
    said = [LINE.match(line) for line in lines(capsys)]  # the first once the work has taken 2 s
    assert all(said) and [int(m["done"]) for m in said] == [4, *range(10, 101, 10)]
    lefts = [m["left"] for m in said]
    assert lefts[:-1] == [f"{s} s" for s in (48, 45, 40, 35, 30, 25, 20, 15, 10, 5)] and lefts[-1] is None


def test_slow_work_gets_a_line_every_30_seconds_and_a_quick_end_no_zero_left(clock, capsys):
    """A tenth that takes 100 s still gets a line every 30 s; the last steps, done in under a
    second, say no "about 0 s left"."""
    with Progress("setup") as bar:
        for i in range(1, 1001):
            clock.now += 1.0
            bar.update(i * 10, 100_000)
        for i in range(10_001, 100_001, 10_000):  # the rest at once
            bar.update(i, 100_000)
    said = [LINE.match(line) for line in lines(capsys)]
    assert all(said), said
    at = [float(m["at"]) for m in said]
    assert at[0] <= 30.0 and max(b - a for a, b in zip(at, at[1:])) <= 30.0
    assert all(m["left"] for m in said if int(m["done"]) < 10_000)
    assert not any(m["left"] and m["left"].startswith("0 ") for m in said)


def test_a_fractional_count_is_shown_to_a_tenth(clock, capsys):
    with Progress("runs") as bar:
        clock.now += 5.0
        bar.update(2.4444, 10)
        clock.now += 5.0
        bar.update(3.0, 10)
    assert lines(capsys) == ["runs: 2.4/10 (5.0s)", "runs: 3/10 (10.0s, about 63 s left)"]  # 7 runs at 9 s


def test_a_local_launch_reports_the_running_runs_share_of_their_epochs(tmp_path, monkeypatch):
    """While runs train, the launcher's progress counts each running run's epochs done (from its
    metrics.jsonl) as a share of a run: one finished run and a run at epoch 3 of 4 is 1.75 of 3."""
    from grids import TINY_GRID, expand_text

    from structinit.experiments import launch
    from structinit.training.rundir import RunDir

    monkeypatch.setattr(launch, "PARTIAL_EVERY", 0.0)
    ex = expand_text(TINY_GRID, tmp_path, overrides=["epochs=4"])
    cells = ex.unique_cells()[:3]
    said = []
    got = launch._Results(ex, None, {str(ex.run_dir(c)): c for c in cells}, None, lambda m: None,
                          lambda done, total: said.append((done, total)), total=3, done=1)
    running = str(ex.run_dir(cells[1]))
    got.running = {running: launch._epochs_of(cells[1]), str(ex.run_dir(cells[2])): launch._epochs_of(cells[2])}
    rd = RunDir(running)
    rd.create()
    rd.write_metrics([{"epoch": 0}] + [{"epoch": e, "test_acc": 10.0} for e in (1, 2, 3)])  # the init's line, 3 epochs
    got.partial()
    assert got.running[running] == 4 and said == [(1.75, 3)]
