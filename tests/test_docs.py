"""The docs tier (``pytest -m docs``): what README.md and docs/ say is what the tool does.

- Every ``structinit`` command in a code block of README.md or docs/ (docs/results/ included) names
  only options its command has, checked by the command's own parser (Typer's click command).
- Every line of a ```bash block in README.md and docs/*.md either runs here, in a scratch folder,
  in the order written (``structinit ...`` in process through the same ``main`` the console script
  runs, ``python -c CODE`` as that code), or is listed in :data:`NOT_RUN` with the reason it cannot
  run on a CPU without downloads in the suite's time. docs/results/ is not run: its commands are
  hours of training.
- Every output block (a fence without a language) is produced by the command (between
  scripts/docs_tables.py's markers, which it regenerates), or says the machine and date it comes
  from, or is listed in :data:`NOT_OUTPUT` (a diagram, a folder layout).
- The tables and counts scripts/docs_tables.py writes equal the committed docs.
- No placeholder survives (TODO, TBD, XXX, FIXME, a line that is one ALL_CAPS word, an ALL_CAPS_NAME
  outside code).

Running the blocks is marked ``slow`` too (it solves, inspects and applies); the rest is fast.
"""

import importlib.util
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

import pytest
from conftest import REPO, run_cli

pytestmark = pytest.mark.docs

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RESULTS = sorted((REPO / "docs" / "results").rglob("*.md"))

FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.S | re.M)
#: Words that end a command on a line: a redirect, a pipe, a second command.
SHELL_OPERATORS = {">", ">>", "2>", "2>&1", "|", "||", "&&", ";", "&"}

#: Lines of README.md and docs/*.md ```bash blocks that the suite does not run: (file, a text that
#: is in each such line of that file) -> why. Every other line runs (test_every_bash_line_runs_or_is_listed).
NOT_RUN = {
    ("docs/init-methods.md", "bench grid docs/results/conditioned/grid.toml"): "the qk_scale screen: 12 training "
                                                                                "runs of 2,000 images (hours on a CPU)",
    ("docs/init-methods.md", "--only train_size=2000 --seeds 3 --jobs 1"): "the same command's second line",
    ("README.md", "python3 -m venv .venv"): "makes a virtualenv and installs from the package index (the "
                                            "second line is the suite itself)",
    ("docs/apply.md", "vit.pth"): "the user's own ViT-T checkpoint (3 heads): a fit of its 12 layers takes minutes "
                                  "on one CPU thread; tests/test_apply*.py run these options on small checkpoints "
                                  "they build",
    ("docs/apply.md", "runs/digits/checkpoint.pt"): "needs a finished `structinit train` run (minutes); "
                                                    "tests/test_apply_data.py applies to one",
    ("docs/apply.md", "train.pth.tar"): "a checkpoint of timm's train.py, the user's own",
    ("docs/apply.md", "hf-vit/"): "a Hugging Face ViT folder, the user's own (tests/test_apply_sequence_models.py "
                                  "and test_checkpoint_models.py build them)",
    ("docs/apply.md", "from_pretrained('hf-vit.impulse')"): "loads the folder the apply line above writes from "
                                                            "the user's own hf-vit/",
    ("docs/apply.md", "deit_tiny.pth"): "a pretrained DeiT checkpoint (a download)",
    ("docs/apply.md", "mha.pt"): "the user's own nn.MultiheadAttention checkpoint (tests/test_apply.py builds one)",
    ("docs/apply.md", "--model vit_tiny_patch16_224 --out vit_t_imp.pt"): "fits 12 ViT-T layers on noise inputs: "
                                                                          "minutes on one CPU thread",
    ("docs/apply.md", "--data cifar_batch.pt"): "needs 256 CIFAR-10 images (a download)",
    ("docs/apply.md", "python train.py /data/cifar10"): "timm's train.py script on CIFAR-10 (a download, hours)",
    ("docs/bench-fit.md", "bench fit --model vit-digits"): "times the data fit against training steps: minutes",
    ("docs/bench-fit.md", "bench fit --model vit-t "): "times a ViT-T data fit: minutes on a CPU",
    ("docs/bench-fit.md", "bench loop --model vit-digits"): "trains epochs of two loops, 3 repeats: minutes",
    ("docs/bench-fit.md", "--device cuda"): "needs a CUDA GPU",
    ("docs/bench-fit.md", "scripts/device-check.sh"): "the GPU machine's check script (minutes; its CPU smoke "
                                                      "test about a minute)",
    ("docs/bench-solver.md", "structinit bench solver  "): "paper and released run 10,000 Adam steps: minutes",
    ("docs/bench-solver.md", "--device cuda"): "needs a CUDA GPU",
    ("docs/bench-solver.md", "--recipes paper,fast --json"): "paper runs 10,000 Adam steps: minutes",
    ("docs/bench-solver.md", "--threads 1"): "a timing measurement (the Threads section), 30-170 s each here",
    ("docs/bench-solver.md", "--threads 2"): "a timing measurement (the Threads section), 30-170 s each here",
    ("docs/bench-solver.md", "solver_scaling.py"): "measures solves up to 100x100 grids: many minutes",
    ("docs/bench-solver.md", "/usr/bin/time -v"): "a 64x64 solve of 12 ViT-B layers, measured: about 20 s",
    ("docs/bench.md", "digits --jobs 2"): "trains the digits grid: hours",
    ("docs/bench.md", "bench report runs"): "reports finished runs (hours of training first); "
                                            "tests/test_bench_report.py reports real runs",
    ("docs/bench.md", "bench report digits"): "reports finished runs (hours of training first)",
    ("docs/bench.md", "--launcher slurm"): "needs a SLURM cluster and CIFAR/SVHN/ImageNet data "
                                           "(tests/test_bench_slurm.py runs a real one)",
    ("docs/bench.md", "..."): "an excerpt of the job script SLURM runs (lines left out), not a command",
    ("docs/bench.md", "srun --unbuffered"): "an excerpt of the job script SLURM runs, not a command",
    ("docs/bench.md", "RUN=$(sed"): "an excerpt of the job script SLURM runs, not a command",
    ("docs/bench.md", "export STRUCTINIT_CACHE=..."): "an excerpt of the job script SLURM runs, not a command",
    ("docs/bench.md", "--launcher print > commands.txt"): "solves the grid's 10 impulse artifacts first: about "
                                                          "2 minutes here",
    ("docs/bench.md", "--set epochs=2"): "the reduced grid, measured: 12 minutes",
    ("docs/inspect.md", "--data digits"): "fits the model's Q/K to 256 digits first: over a minute here "
                                          "(tests/test_inspect_data.py measures the same)",
    ("docs/inspect.md", "--data mnist1d"): "fits a 1-D model to MNIST-1D first: over a minute here",
    ("docs/reproducing.md", "export STRUCTINIT_CACHE=/shared"): "the cluster recipe: a shared folder",
    ("docs/reproducing.md", "--launcher slurm"): "needs a SLURM cluster and CIFAR-10 data",
    ("docs/reproducing.md", "digits --jobs 2"): "trains the digits grid: hours",
    ("docs/reproducing.md", "bench report runs"): "reports finished runs (hours of training first)",
    ("docs/sequences.md", "structinit train"): "trains a 1-D transformer on MNIST-1D: minutes",
    ("docs/sequences.md", "bench grid mnist1d"): "trains the MNIST-1D grid: hours",
    ("docs/solve.md", "--recipe released"): "the released recipe's 10,000 Adam steps: minutes",
    ("docs/testing.md", "python -m pytest"): "the test suite itself",
    ("docs/testing.md", "mypy"): "the type check; tests/test_typing.py runs it (slow)",
    ("docs/testing.md", "scripts/mutation.py"): "mutation testing: hours, in the background",
    ("docs/train.md", "structinit train"): "training runs: minutes to days, CIFAR/ImageNet downloads",
    ("docs/train.md", "--init "): "fragments of train's command line, not commands (their options are checked)",
    ("docs/train.md", "torchrun"): "multi-process training (tests/test_train.py runs torchrun with gloo)",
    ("docs/train.md", "srun --nodes"): "needs a SLURM cluster",
    ("docs/train.md", "--data-dir /datasets"): "needs a SLURM cluster and ImageNet",
}

#: Blocks that start from files another doc's block makes: (file, text of the block's first line)
#: -> (file, a pattern of the lines of its bash blocks to run first).
NEEDS = {
    ("docs/sequences.md", "structinit solve --grid 40"): ("docs/apply.md", r"import (BertConfig|GPT2Config)"),
    ("docs/inspect.md", "structinit inspect "): ("docs/apply.md", r"timm\.create_model\('vit_tiny_patch16_224'"),
}

#: Fragments of one command's line (a block of options): (file, text in the line) -> the command.
FRAGMENTS = {("docs/train.md", "--init "): ("train",)}

#: Output-looking blocks that are not a command's output: (file, text of the block's first line) -> what.
NOT_OUTPUT = {
    ("docs/architecture.md", "geometry -> analysis"): "a diagram of the stages",
    ("docs/bench.md", "runs/"): "the layout of a runs folder",
}

DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
MACHINE = re.compile(r"machine|GPU|CPU|H100|cores?\b", re.I)


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repository
    line: int  # of the opening fence
    lang: str
    text: str
    before: str  # the paragraph before the fence

    def lines(self) -> List[Tuple[int, str]]:
        """Logical lines (backslash continuations joined) with their line numbers in the file."""
        out, pending, start = [], "", 0
        for i, raw in enumerate(self.text.splitlines()):
            if not pending:
                start = self.line + 1 + i
            if raw.rstrip().endswith("\\"):
                pending += raw.rstrip()[:-1]
                continue
            out.append((start, pending + raw))
            pending = ""
        return [(n, s.strip()) for n, s in out if s.strip()]

    def commands(self) -> List[Tuple[int, str]]:
        """:meth:`lines` less those that are only a comment (``#SBATCH`` lines included)."""
        return [(n, s) for n, s in self.lines() if not s.startswith("#")]


def _rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def blocks(path: Path) -> List[Block]:
    text = path.read_text(encoding="utf-8")
    out = []
    for m in FENCE.finditer(text):
        indent = len(m.group("indent"))
        body = "\n".join(line[indent:] for line in m.group("body").splitlines())
        before = text[:m.start()].rstrip().split("\n\n")[-1]
        out.append(Block(_rel(path), text.count("\n", 0, m.start()) + 1, m.group("lang"), body, before))
    return out


def words(line: str) -> List[str]:
    """The shell words of ``line`` (comments dropped); a prompt ``$ `` is left out."""
    line = line[2:] if line.startswith("$ ") else line
    return shlex.split(line, comments=True)


def structinit_args(line: str) -> Optional[List[str]]:
    """The arguments after ``structinit`` on ``line`` (``structinit ...``, ``python -m structinit
    ...``, behind ``/usr/bin/time -v`` or ``torchrun ... -m``), up to a shell operator; None if no
    structinit command is on it."""
    try:
        ws = words(line)
    except ValueError:  # an unbalanced quote: not a shell line (an excerpt of output)
        return None
    if "structinit" not in ws:
        return None
    args = ws[ws.index("structinit") + 1:]
    for i, w in enumerate(args):
        if w in SHELL_OPERATORS or w.startswith((">", "|")):
            return args[:i]
    return args


def option_problem(args: List[str]) -> Optional[str]:
    """What is wrong with the options of ``structinit ARGS`` (None: nothing), from the command's own
    parser: an option the command lacks, one without its value, an extra argument."""
    from structinit.cli.app import click_command

    cmd = click_command()
    args = list(args)
    while getattr(cmd, "commands", None) and args and not args[0].startswith("-"):
        if args[0] not in cmd.commands:
            return f"no command {args[0]!r}"
        cmd = cmd.commands[args.pop(0)]
    try:
        parser = cmd.make_parser(cmd.context_class(cmd))
        _, extra, _ = parser.parse_args(args)
    except Exception as exc:  # click's UsageError family, as Typer vendors it
        message = getattr(exc, "format_message", None)
        return message() if message else str(exc)
    if extra and not getattr(cmd, "commands", None):
        return f"unexpected extra argument(s) {extra}"
    return None


def all_blocks(paths) -> List[Block]:
    return [b for p in paths for b in blocks(p)]


# --------------------------------------------------------------------------- options


def _commands_in(paths):
    for b in all_blocks(paths):
        if b.lang not in ("", "bash", "console", "sh", "shell"):
            continue
        for n, line in b.commands():
            fragment = next((cmd for (f, t), cmd in FRAGMENTS.items() if f == b.path and t in line), None)
            if fragment and line.startswith("-"):
                yield b.path, n, line, [*fragment, *words(line)]
                continue
            args = structinit_args(line)
            if args is not None:
                yield b.path, n, line, args


def _inline_commands_in(paths):
    """``structinit ...`` in inline code (one backtick) outside the code blocks; ``...`` (text left
    out) is dropped."""
    for path in paths:
        text = path.read_text(encoding="utf-8")
        prose = FENCE.sub(lambda m: "\n" * m.group().count("\n"), text)
        for m in re.finditer(r"(?<![`\w])`(structinit [^`]+)`", prose):
            args = structinit_args(m.group(1))
            if args is not None:
                yield _rel(path), prose.count("\n", 0, m.start()) + 1, m.group(1), [a for a in args if a != "..."]


def test_every_structinit_command_in_a_code_block_names_only_options_it_has():
    found, problems = 0, []
    for path, n, line, args in [*_commands_in(DOCS + RESULTS), *_inline_commands_in(DOCS + RESULTS)]:
        found += 1
        problem = option_problem(args)
        if problem:
            problems.append(f"{path}:{n}: {problem}: {line}")
    assert found > 250, found  # the extraction finds the docs' commands (186 in blocks, 95 inline when written)
    assert not problems, "\n".join(problems)


def test_the_option_check_catches_what_it_is_for():
    assert option_problem(["bench", "grid", "digits", "--jobs", "2"]) is None
    assert option_problem(["solve", "--tokens", "64", "-f", "3", "--json"]) is None
    assert "--dimm" in option_problem(["solve", "--dimm", "3"])
    assert "--heads" in option_problem(["apply", "x.pt", "--heads"])  # its value missing
    assert option_problem(["bench", "nonsense"]) == "no command 'nonsense'"
    assert "extra" in option_problem(["inspect", "a", "b"])
    assert structinit_args("OMP_NUM_THREADS=1 torchrun -m structinit train --out d > log  # x") == ["train", "--out",
                                                                                                   "d"]
    assert structinit_args("python -c 'print(1)'") is None


#: A command's page -> the commands whose options its inline code names.
PAGE_COMMANDS = {
    "docs/apply.md": [("apply",)], "docs/solve.md": [("solve",)], "docs/inspect.md": [("inspect",)],
    "docs/train.md": [("train",)], "docs/bench.md": [("bench", "grid"), ("bench", "report"), ("bench", "run")],
    "docs/bench-solver.md": [("bench", "solver")], "docs/bench-fit.md": [("bench", "fit"), ("bench", "loop")],
    "docs/bench-exactness.md": [("bench", "exactness")],
}
#: Flags in a command's page that belong to another program: page -> {flag: whose}.
OTHER_PROGRAMS = {
    "docs/apply.md": {"--initial-checkpoint": "timm's train.py"},
    "docs/train.md": {"--nproc_per_node": "torchrun"},
    "docs/bench.md": {f: "sbatch (the job script's #SBATCH lines)" for f in
                      ("--array", "--constraint", "--cpus-per-task", "--gres", "--open-mode", "--output", "--signal")},
    "docs/bench-fit.md": {"--grids": "scripts/device_grid.py", "--plan": "scripts/device_grid.py"},
}


def _options_of(path) -> set:
    from structinit.cli.app import click_command

    cmd = click_command()
    for name in path:
        cmd = cmd.commands[name]
    return {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)} | {"--help", "-h"}


def _named_command(span: str):
    """The structinit command a span of inline code starts with (``bench report --x``: bench report)."""
    from structinit.cli.app import click_command

    cmd, path = click_command(), []
    for word in span.split():
        if word not in getattr(cmd, "commands", {}):
            break
        cmd, path = cmd.commands[word], [*path, word]
    return tuple(path) if path and not getattr(cmd, "commands", None) else None


def test_every_flag_a_command_page_names_is_an_option_of_its_command():
    problems = []
    for page, commands in PAGE_COMMANDS.items():
        known = set().union(*(_options_of(c) for c in commands))
        other = OTHER_PROGRAMS.get(page, {})
        prose = FENCE.sub("", (REPO / page).read_text(encoding="utf-8"))
        for m in re.finditer(r"(?<!`)`([^`\n]+)`", prose):
            span = m.group(1)
            if span.startswith("structinit "):
                continue  # a whole command: test_every_structinit_command_... parses it
            named = _named_command(span)
            allowed = _options_of(named) if named else known
            for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", span):
                if flag not in allowed and flag not in other:
                    problems.append(f"{page}: {flag} in `{span}`")
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------- bash blocks run


def _not_run_reason(path: str, line: str) -> Optional[str]:
    return next((why for (f, text), why in NOT_RUN.items() if f == path and text in line), None)


def _bash_blocks() -> List[Block]:
    return [b for b in all_blocks(DOCS) if b.lang == "bash"]


def _runnable(line: str) -> bool:
    ws = words(line)
    return bool(ws) and (ws[0] == "structinit" or ws[:2] == ["python", "-c"])


def test_every_bash_line_runs_or_is_listed():
    """Each line is one the runner runs (``structinit ...`` or ``python -c``) or has its reason in
    NOT_RUN, and every NOT_RUN entry still names a line (no stale reasons)."""
    unlisted, used = [], set()
    for b in _bash_blocks():
        for n, line in b.commands():
            keys = [(f, t) for (f, t) in NOT_RUN if f == b.path and t in line]
            used.update(keys)
            if not keys and not _runnable(line):
                unlisted.append(f"{b.path}:{n}: {line}")
    assert not unlisted, "neither runnable nor in NOT_RUN:\n" + "\n".join(unlisted)
    assert not set(NOT_RUN) - used, f"NOT_RUN entries that match no line: {sorted(set(NOT_RUN) - used)}"
    assert all(len(why) > 10 for why in NOT_RUN.values())


def _run_line(path: str, n: int, line: str, scratch: Path) -> None:
    ws = words(line)
    if ws[:2] == ["python", "-c"]:
        here = os.getcwd()
        os.chdir(scratch)
        try:
            exec(compile(ws[2], f"{path}:{n}", "exec"), {"__name__": "__main__"})
        finally:
            os.chdir(here)
        return
    args = structinit_args(line)
    assert args is not None, line
    r = run_cli(*args, cwd=scratch)
    assert r.returncode == 0, f"{path}:{n}: {line}\n{r.stderr}"
    rest = ws[ws.index("structinit") + 1 + len(args):]
    if rest[:1] == [">"]:
        (scratch / rest[1]).write_text(r.stdout)


def _blocks_to_run():
    out = []
    for b in _bash_blocks():
        lines = [(n, s) for n, s in b.commands() if not _not_run_reason(b.path, s)]
        if lines:
            out.append(pytest.param(b, lines, id=f"{b.path}:{b.line}"))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("block, lines", _blocks_to_run())
def test_bash_block_runs_as_written(block, lines, tmp_path, one_torch_thread):
    """The block's runnable lines, in order, in a scratch folder (files one line writes, the next reads)."""
    need = next((other for (f, first), other in NEEDS.items()
                 if f == block.path and block.commands()[0][1].startswith(first)), None)
    for n, line in _needed_lines(*need) if need else []:
        _run_line(need[0], n, line, tmp_path)
    for n, line in lines:
        _run_line(block.path, n, line, tmp_path)


def _needed_lines(path: str, pattern: str) -> List[Tuple[int, str]]:
    return [(n, s) for b in _bash_blocks() if b.path == path for n, s in b.commands() if re.search(pattern, s)]


def test_the_blocks_that_need_another_blocks_files_find_them():
    for (path, first), (other, pattern) in NEEDS.items():
        assert any(b.path == path and b.commands()[0][1].startswith(first) for b in _bash_blocks()), path
        found = _needed_lines(other, pattern)
        assert found and all(_runnable(s) and not _not_run_reason(other, s) for _, s in found), (other, found)
    assert len(_needed_lines(*NEEDS[("docs/sequences.md", "structinit solve --grid 40")])) == 2  # bert.pt, gpt2.pt


# --------------------------------------------------------------------------- outputs shown


def test_every_output_shown_is_generated_or_says_where_it_comes_from():
    unlabelled = []
    for path in DOCS:
        for b in blocks(path):
            if b.lang:
                continue
            first = b.lines()[0][1] if b.lines() else ""
            if any(f == b.path and first.startswith(t) for (f, t) in NOT_OUTPUT):
                continue
            if b.before.splitlines()[-1].startswith("<!-- docs_tables: "):
                continue  # scripts/docs_tables.py writes it (test_the_docs_tables_and_counts_are_...)
            if not (DATE.search(b.before) and MACHINE.search(b.before)):
                unlabelled.append(f"{b.path}:{b.line}: {first}")
    assert not unlabelled, "output blocks without the machine and date they come from:\n" + "\n".join(unlabelled)


# --------------------------------------------------------------------------- generated tables


def _docs_tables():
    spec = importlib.util.spec_from_file_location("docs_tables", REPO / "scripts" / "docs_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_docs_tables_and_counts_are_what_the_script_writes():
    stale = _docs_tables().stale()
    assert not stale, f"stale: {[_rel(p) for p in stale]}; run python scripts/docs_tables.py"


def test_the_tables_script_counts_and_lists_every_shipped_grid(tmp_path):
    from structinit.experiments.gridspec import load_grid, shipped_grids

    dt = _docs_tables()
    table = dt.grid_table()
    for name in shipped_grids():
        assert f"| `{name}` |" in table and f" {load_grid(name).runs} (" in table
    assert dt.count_runs("digits --set epochs=2 --seeds 2 --only train_size=100,250") == \
        load_grid("digits").cells // 2 * 2  # half the sizes, two seeds
    apply_options = dt.options_list(["apply"])
    assert apply_options.startswith("`structinit apply`: ") and "`--heads`" in apply_options
    assert "`--figures` / `--no-figures`" in dt.options_list(["bench", "report"])
    # a stale count is found and rewritten; markers elsewhere are left alone
    doc = tmp_path / "docs"
    doc.mkdir()
    (doc / "x.md").write_text("It makes <!-- runs: table1 -->7<!-- /runs --> runs. <!-- note -->a<!-- /note -->\n")
    (tmp_path / "README.md").write_text("no markers\n")
    stale = dt.stale(tmp_path)
    want = "It makes <!-- runs: table1 -->12<!-- /runs --> runs. <!-- note -->a<!-- /note -->\n"
    assert list(stale.values()) == [want]


# --------------------------------------------------------------------------- placeholders


PLACEHOLDER_WORDS = re.compile(r"\b(TODO|TBD|FIXME|XXX+)\b")
CAPS_LINE = re.compile(r"^\s*[A-Z][A-Z0-9_]{3,}\s*$", re.M)
CAPS_NAME = re.compile(r"\b[A-Z][A-Z0-9]*_[A-Z0-9_]+\b")


def placeholders(text: str) -> List[str]:
    """The placeholder-looking words of a markdown ``text``: TODO, TBD, FIXME, XXX anywhere but in
    inline code (where the docs name them); outside code, a line that is one ALL-CAPS word, and an
    ALL_CAPS_NAME (code names them in backticks)."""
    found = [m.group() for m in PLACEHOLDER_WORDS.finditer(re.sub(r"(?<!`)`[^`\n]+`(?!`)", "", text))]
    prose = re.sub(r"<!--.*?-->", "", FENCE.sub("", text), flags=re.S)
    found += [m.group().strip() for m in CAPS_LINE.finditer(prose)]
    found += [m.group() for m in CAPS_NAME.finditer(re.sub(r"`[^`]*`", "", prose))]
    return found


def test_no_placeholder_survives():
    found = {}
    for path in DOCS + RESULTS:
        hits = placeholders(path.read_text(encoding="utf-8"))
        if hits:
            found[_rel(path)] = hits
    assert not found, found


def test_the_placeholder_check_finds_what_it_is_for():
    assert placeholders("## Threads\n\nTHREADS_TABLE\n") == ["THREADS_TABLE", "THREADS_TABLE"]
    assert placeholders("a TODO here; TBD.\n```bash\nx  # FIXME\n```\n") == ["TODO", "TBD", "FIXME"]
    assert placeholders("it fails on `TODO` and `XXX`") == []
    assert placeholders("set `OMP_NUM_THREADS=1`, the `CORRUPT` mark\n```bash\nFOO_BAR=1 x\n```\n") == []



def test_every_parameter_of_every_built_in_method_is_in_the_init_methods_page():
    """The help of --init-param says the built-in methods' parameters are listed in
    docs/init-methods.md (issue 53): each one is named there in code (`name` or name=)."""
    import dataclasses

    from structinit.init.registry import BUILTIN_MODULES, INIT_METHODS

    page = (REPO / "docs" / "init-methods.md").read_text(encoding="utf-8")
    modules = {m.__name__ for m in BUILTIN_MODULES}
    missing = [f"{method}.{f.name}" for method, cls in INIT_METHODS.items() if cls.__module__ in modules
               for f in dataclasses.fields(cls) if f"`{f.name}" not in page and f"{f.name}=" not in page]
    assert missing == []
