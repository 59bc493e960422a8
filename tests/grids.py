"""The digits grid the grid tests share, and the helpers that derive, expand and train it.

``DIGITS`` is the plain grid: the stock ``vit-digits`` on sklearn's digits, Mimetic against the
impulse init, one seed, two epochs. ``TINY_GRID`` is the same grid on the model the tests that
train use (``TINY``: 2x2 patches, one layer 32 wide, two heads; an epoch of digits in about a
second) with two seeds. A test that needs another grid derives it with :func:`variant`, which
names every setting it changes, so what a test trains stays visible in the test.

``DIGITS`` keeps ``rows`` on line 3 and ``epochs`` on line 7: tests/test_bench_cli.py checks that a
typo is reported at its line."""

import math
import sys

import torch

from structinit.experiments.expand import expand
from structinit.experiments.gridspec import parse_grid_text
from structinit.experiments.launch import prepare_runs
from structinit.experiments.task import run_task

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python < 3.11
    import tomli as tomllib

DIGITS = """\
name = "digits-grid"
seeds = 1
rows = "init"
[settings]
model = "vit-digits"
dataset = "digits"
epochs = 2
[[axes.init]]
id = "mimetic"
init = "mimetic"
[[axes.init]]
id = "impulse"
init = "impulse"
"""

#: The model of the grids that train: 2x2 patches, one layer 32 wide with two heads, its learning
#: rate and a warm-up that fits in one epoch.
TINY = dict(patch=2, depth=1, dim=32, heads=2, lr=0.01, batch_size=32, warmup_epochs=0.5)

#: Mimetic against Kaiming, with labels: the init axis of the grids that train and report (neither
#: method solves or fits anything, so a run costs its training alone).
MIMETIC_KAIMING = """\
[[axes.init]]
id = "mimetic"
label = "Mimetic"
init = "mimetic"
init_params = { base = "pytorch" }
[[axes.init]]
id = "kaiming"
label = "Kaiming"
init = "kaiming"
"""

#: The keys a grid file has above its tables (the rest of :func:`variant`'s keywords are settings).
HEADER = ("name", "title", "description", "seeds", "rows", "columns", "baseline")


def toml_value(value) -> str:
    """``value`` as TOML writes it in a grid file (strings, numbers, booleans, lists, inline tables)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"no TOML for {value!r}")


def variant(text: str = DIGITS, *, axes: str = None, append: str = "", **changes) -> str:
    """``text`` with ``changes`` made: a key of the file's header (``name``, ``seeds``, ...) or of its
    ``[settings]`` set to a value (replaced where it stands, else added at the end of its part) or
    removed (``None``); ``axes`` replaces every axis (all from the first ``[[axes.`` or ``[axes]``
    on), and ``append`` is added at the end (more axes, a ``[paper]`` table)."""
    lines = text.splitlines()
    settings = lines.index("[settings]")
    first_axis = next(i for i, line in enumerate(lines) if line.startswith(("[[axes.", "[axes]")))
    parts = {"header": lines[:settings], "settings": lines[settings + 1:first_axis]}
    rest = lines[first_axis:] if axes is None else axes.splitlines()
    for key, value in changes.items():
        part = parts["header" if key in HEADER else "settings"]
        at = next((i for i, line in enumerate(part) if line.split(" = ")[0] == key), None)
        if value is None:
            assert at is not None, f"{key} is not in the grid"
            del part[at]
        elif at is None:
            part.append(f"{key} = {toml_value(value)}")
        else:
            part[at] = f"{key} = {toml_value(value)}"
    out = "\n".join([*parts["header"], "[settings]", *parts["settings"], *rest]) + "\n" + append
    tomllib.loads(out)  # a variant is a TOML file whatever it changed
    return out


#: The grid of the tests that train: ``DIGITS`` on the tiny model, two seeds.
TINY_GRID = variant(DIGITS, name="tiny", title="Tiny digits grid", seeds=2, **TINY)


def expand_text(text: str, runs_dir, *, file=None, **kw):
    """The expansion of grid ``text``, read as the file ``file`` (default ``NAME.toml`` of the name it
    gives), into ``runs_dir`` (``kw``: :func:`expand`'s overrides, seeds, only, command)."""
    name = tomllib.loads(text)["name"]
    return expand(parse_grid_text(text, file or f"{name}.toml", name), runs_dir=runs_dir, **kw)


def train_grid(ex, *, skip=lambda cell: False, state=lambda cell: "finished"):
    """Prepare ``ex`` and train each of its runs but those ``skip(cell)`` leaves pending, in this
    process on one torch thread; each run's task must end as ``state(cell)`` says. Returns ``ex``."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for cell in prepare_runs(ex):
            if not skip(cell):
                assert run_task(ex.run_dir(cell), threads=1).state == state(cell), cell
    finally:
        torch.set_num_threads(old)
    return ex


def trained_grid(folder, text, *, file="grid.toml", **kw):
    """``text`` written to ``folder/file`` and its runs under ``folder/runs`` trained as
    :func:`train_grid` does (``kw``), with the command ``structinit bench grid FILE``; returns the
    expansion."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / file).write_text(text)
    ex = expand_text(text, folder / "runs", file=file, command=f"structinit bench grid {file}")
    return train_grid(ex, **kw)
