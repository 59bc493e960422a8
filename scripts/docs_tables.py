"""Write the numbers and tables in the docs that the tool itself can compute, so that they cannot go stale.

Two kinds of marker in README.md and docs/*.md (HTML comments: invisible where the markdown is rendered):

- a block, ``<!-- docs_tables: NAME -->`` ... ``<!-- /docs_tables: NAME -->``, whose lines between the markers
  are :data:`BLOCKS` ``[NAME]()``: the grid table of docs/bench.md (every shipped grid, its title and run
  count), the grid-per-table table of docs/reproducing.md, the output of ``bench grid NAME --status`` in an
  empty folder, every option of a command (``options-apply``, ``options-bench-grid``: the end of each command's
  page);
- a list in a sentence, ``<!-- NAME -->`` ... ``<!-- /NAME -->``, whose text is :data:`INLINE_LISTS`
  ``[NAME]()`` (the modules whose every function mypy requires annotated, from pyproject.toml; the built-in
  init methods, from the registry);
- a run count in a sentence, ``<!-- runs: GRID [--seeds S] [--only AXIS=IDS ...] -->N<!-- /runs -->``, where
  ``N`` is how many runs ``structinit bench grid GRID ...`` makes with those options (``--set`` changes no
  count and is not written there).

    python scripts/docs_tables.py            # rewrite what is out of date, naming each file it writes
    python scripts/docs_tables.py --check    # exit 1, naming the stale files, when any is out of date

tests/test_docs.py checks that the committed docs equal what this writes. Rerun it after changing a shipped
grid (structinit/data/grids/*.toml).
"""

import argparse
import contextlib
import io
import os
import re
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Callable, Dict, List

REPO = Path(__file__).resolve().parents[1]

#: Where the markers may be: README.md and the docs' own pages (not docs/results/, which records runs).
DOC_FILES = ["README.md", "docs/*.md"]

BLOCK = re.compile(r"(<!-- docs_tables: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /docs_tables: (?P=name) -->)",
                   re.S)
RUNS = re.compile(r"(<!-- runs: (?P<args>[^>]*?) -->)(?P<body>[^<]*)(<!-- /runs -->)")
INLINE = re.compile(r"(<!-- (?P<name>[\w-]+) -->)(?P<body>[^<]*)(<!-- /(?P=name) -->)")

#: The paper's table each shipped grid reproduces, and the data it reads below ``--data-dir``
#: (docs/reproducing.md); the runs per seed are counted from the grid.
REPRODUCES = {
    "table1": ("Table 1: ViT-T, class token / average pooling x learnable / sin-cos PE, CIFAR-10",
               "`cifar-10-batches-py/`"),
    "table2": ("Table 2: five inits x CIFAR-10, CIFAR-100, SVHN, ImageNet-1K (ViT-T)",
               "`cifar-10-batches-py/`, `cifar-100-python/`, `train_32x32.mat` + `test_32x32.mat`, "
               "`imagenet/{train,val}/<class>/`"),
    "table3": ("Table 3: five inits x ViT-T/h3, ViT-T/h8, ViT-S/h6, ViT-S/h16, CIFAR-100", "`cifar-100-python/`"),
    "table4": ("Table 4: ConvMixer filters trained / random / impulse / box, kernels 3/5/8, dims 256/512",
               "`cifar-10-batches-py/`"),
    "table5": ("Table 5: ViT depth 8, dims 256/512 x heads 4-32, five inits, CIFAR-10", "`cifar-10-batches-py/`"),
    "table6": ("Table 6 (appendix): pseudo input of the solve, first / following layers, shared / per-layer solve",
               "`cifar-10-batches-py/`"),
    "table7": ("Table 7 (appendix): as Table 5 at dims 64/128", "`cifar-10-batches-py/`"),
    "digits": ("the CPU-scale learning curve (no table in the paper)", "none (scikit-learn's digits)"),
}


def _summaries() -> List[Dict]:
    from structinit.experiments.gridspec import load_grid, shipped_grids

    return [load_grid(name).summary() for name in shipped_grids()]


def grid_table() -> str:
    """docs/bench.md: every shipped grid, its title and its runs (cells x seeds), as ``bench grid --list``."""
    lines = ["| grid | what (its title) | runs (cells x seeds) |", "|---|---|---|"]
    for s in _summaries():
        shape = " x ".join(f"{len(v)} {k}" for k, v in s["axes"].items())
        lines.append(f"| `{s['name']}` | {s['title']} | {s['runs']} ({shape} x {len(s['seeds'])} seeds) |")
    return "\n".join(lines) + "\n"


def reproducing_table() -> str:
    """docs/reproducing.md: which grid reproduces which table, its runs per seed and its data."""
    cells = {s["name"]: s["cells"] for s in _summaries()}
    lines = ["| table | grid | runs per seed | data (below `--data-dir`) |", "|---|---|---|---|"]
    for name, (table, data) in REPRODUCES.items():
        lines.append(f"| {table} | `{name}` | {cells[name]} | {data} |")
    return "\n".join(lines) + "\n"


def _cli_output(argv: List[str]) -> str:
    """What ``structinit ARGV`` prints on stdout, run in process in an empty scratch folder."""
    from structinit.cli.app import main

    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    with tempfile.TemporaryDirectory() as scratch:
        os.chdir(scratch)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = main(argv)
        finally:
            os.chdir(here)
    if code != 0:
        raise SystemExit(f"structinit {' '.join(argv)} failed ({code}): {err.getvalue()}")
    return out.getvalue()


def status_block(grid: str) -> Callable[[], str]:
    def make() -> str:
        return "```\n" + _cli_output(["bench", "grid", grid, "--status"]) + "```\n"
    return make


def options_list(path: List[str]) -> str:
    """Every option of ``structinit PATH`` in the order ``--help`` lists them (a command's page ends with it)."""
    from structinit.cli.app import click_command

    cmd = click_command()
    for name in path:
        cmd = cmd.commands[name]
    flags = []
    for p in cmd.params:
        if p.param_type_name == "option":
            longs = [o for o in (*p.opts, *p.secondary_opts) if o.startswith("--")]
            flags.append(" / ".join(f"`{o}`" for o in longs))
    return f"`structinit {' '.join(path)}`: " + ", ".join(flags) + ".\n"


#: Block name -> its text; ``options-CMD`` (``options-apply``, ``options-bench-grid``) is every option
#: of that command (:func:`options_list`).
BLOCKS: Dict[str, Callable[[], str]] = {
    "grids": grid_table,
    "reproducing": reproducing_table,
    "status-digits": status_block("digits"),
}


def block_text(name: str) -> str:
    if name.startswith("options-"):
        return options_list(name[len("options-"):].split("-"))
    if name not in BLOCKS:
        raise SystemExit(f"unknown docs_tables block {name!r}; known: {', '.join(BLOCKS)}, options-CMD")
    return BLOCKS[name]()


def typed_modules() -> str:
    """docs/testing.md: the modules pyproject.toml's mypy override requires fully annotated
    (``disallow_untyped_defs``), without the ``structinit.`` prefix, the package root last."""
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        import tomli as tomllib  # type: ignore[no-redef]

    doc = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    modules = [m for o in doc["tool"]["mypy"]["overrides"] if o.get("disallow_untyped_defs")
               for m in ([o["module"]] if isinstance(o["module"], str) else o["module"])]
    names = [f"`{m[len('structinit.'):]}`" for m in modules if m != "structinit"]
    return ", ".join(names) + (" and the package root" if "structinit" in modules else "")


def builtin_methods() -> str:
    """docs/apply.md: the built-in init methods, read from the registry in its order (the methods the
    modules of ``BUILTIN_MODULES`` register; a plugin installed where the docs are built is left out)."""
    from structinit.init.registry import BUILTIN_MODULES, INIT_METHODS

    modules = {m.__name__ for m in BUILTIN_MODULES}
    names = [f"`{name}`" for name, cls in INIT_METHODS.items() if cls.__module__ in modules]
    return ", ".join(names[:-1]) + " and " + names[-1]


#: Inline list name -> its text.
INLINE_LISTS: Dict[str, Callable[[], str]] = {"typed-modules": typed_modules, "init-methods": builtin_methods}


def count_runs(args: str) -> int:
    """The runs of ``structinit bench grid ARGS`` (``GRID [--seeds S] [--only AXIS=IDS ...] [--set ...]``)."""
    from structinit.experiments.gridspec import load_grid, parse_seeds, parse_selection, restrict

    words = shlex.split(args)
    grid, rest = words[0], words[1:]
    seeds, only = None, []
    while rest:
        flag, value, rest = rest[0], rest[1], rest[2:]
        if flag == "--seeds":
            seeds = value
        elif flag == "--only":
            only.append(value)
        elif flag != "--set":
            raise SystemExit(f"runs marker {args!r}: {flag} does not belong in a run count")
    spec = restrict(load_grid(grid), parse_selection(only))
    return spec.cells * len(parse_seeds(seeds) if seeds is not None else spec.seeds)


def render(text: str, cache: Dict[str, str]) -> str:
    """``text`` with every marker's contents as this script computes them (``cache``: block texts)."""
    def block(m: "re.Match[str]") -> str:
        name = m.group("name")
        if name not in cache:
            cache[name] = block_text(name)
        return m.group(1) + cache[name] + m.group(4)

    def inline(m: "re.Match[str]") -> str:
        name = m.group("name")
        if name not in INLINE_LISTS:
            return m.group(0)  # another comment that happens to have a closing twin: not ours
        if name not in cache:
            cache[name] = INLINE_LISTS[name]()
        return m.group(1) + cache[name] + m.group(4)

    text = INLINE.sub(inline, BLOCK.sub(block, text))
    return RUNS.sub(lambda m: m.group(1) + f"{count_runs(m.group('args')):,}" + m.group(4), text)


def doc_paths(root: Path = REPO) -> List[Path]:
    return sorted(p for pattern in DOC_FILES for p in root.glob(pattern))


def stale(root: Path = REPO) -> Dict[Path, str]:
    """Each doc whose markers' contents differ from what they should be -> its text as it should be."""
    cache: Dict[str, str] = {}
    out = {}
    for path in doc_paths(root):
        text = path.read_text(encoding="utf-8")
        new = render(text, cache)
        if new != text:
            out[path] = new
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="only check: exit 1 naming the stale files")
    args = ap.parse_args(argv)
    todo = stale()
    for path, text in todo.items():
        rel = path.relative_to(REPO)
        if args.check:
            print(f"stale: {rel} (python scripts/docs_tables.py rewrites it)", file=sys.stderr)
        else:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {rel}")
    if not todo:
        print("the docs' tables and counts are up to date")
    return 1 if (args.check and todo) else 0


if __name__ == "__main__":
    sys.exit(main())
