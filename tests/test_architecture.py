"""The stages run one way (docs/architecture.md): a module of a stage imports only from its own
stage, the stages before it, and the root modules; nothing imports the CLI. Imports inside
functions count too: a lazy import is still a dependency."""

import ast
import functools
import os
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "structinit"
STAGES = ["geometry", "analysis", "solver", "fit", "init", "training", "families", "apply", "benchmarks", "experiments",
          "cli"]
ROOT = {"errors", "runtime", "atomic", "keys", "__init__", "__main__"}


@functools.lru_cache(maxsize=None)
def imports(path: Path):
    """``(line, module)`` of every structinit import in the file at ``path`` (parsed once a session:
    four tests read every module's imports)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("structinit"):
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.startswith("structinit")]
    return tuple(found)


def stage_of(module: str):
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_import_goes_down_the_stages():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        own = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        if own in ROOT or own == "data":
            continue
        for line, module in imports(path):
            target = stage_of(module)
            if target in ROOT:
                continue
            if STAGES.index(target) > STAGES.index(own):
                wrong.append(f"{rel}:{line} ({own}) imports {module} ({target})")
    assert wrong == []


def test_benchmarks_and_experiments_are_siblings():
    """Neither imports the other (the architecture doc draws them side by side)."""
    wrong = [f"{path.relative_to(PACKAGE)}:{line} imports {module}"
             for own, other in (("benchmarks", "experiments"), ("experiments", "benchmarks"))
             for path in sorted((PACKAGE / own).rglob("*.py"))
             for line, module in imports(path) if stage_of(module) == other]
    assert wrong == []


def test_the_root_modules_import_no_stage():
    wrong = [f"{name}.py:{line} imports {module}" for name in ROOT - {"__init__", "__main__"}
             for line, module in imports(PACKAGE / f"{name}.py") if stage_of(module) not in ROOT]
    assert wrong == []


def import_graph():
    """``{module: modules it imports}`` over the package (module-level and lazy imports alike)."""
    names = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    graph = {name: set() for name in names}
    for name, path in names.items():
        for _, module in imports(path):
            while module not in names and "." in module:
                module = module.rsplit(".", 1)[0]
            if module in names and module not in (name, "structinit"):
                graph[name].add(module)
    return graph


def cycles(graph):
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_itself_through_others():
    """No import circle anywhere, lazy imports included: a circle hidden by an import inside a
    function is still two modules that cannot be understood (or changed) one without the other."""
    assert cycles(import_graph()) == []


def test_the_circle_check_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_every_module_is_named_in_the_architecture_doc():
    """docs/architecture.md describes every module as the code has it: a module added, moved or
    renamed without its line there fails here."""
    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    missing = []
    for name in sorted(import_graph()):
        short = name.split(".", 1)[1] if "." in name else "structinit"
        if name.endswith("__main__") or name.split(".")[-1] in ("errors", "runtime", "atomic", "keys"):
            short = name.rsplit(".", 1)[-1]
        if name.split(".")[-1] == "__init__" or name == "structinit.data":
            continue
        if f"`{short}`" not in doc and f"`{name}`" not in doc:
            missing.append(name)
    assert missing == []


# --------------------------------------------------------------------------- one writer

def _handles(tree):
    """The names bound by ``with atomic_write(...) as NAME`` (or ``atomic_path``) in ``tree``:
    writing to them is writing through the one writer."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.With):
            for item in node.items:
                fn = getattr(item.context_expr, "func", None)
                if getattr(fn, "id", getattr(fn, "attr", "")) in ("atomic_write", "atomic_path") \
                        and isinstance(item.optional_vars, ast.Name):
                    names.add(item.optional_vars.id)
    return names


def writes_outside_the_writer(tree):
    """``(line, what)`` of every call in ``tree`` that writes a file other than through
    :mod:`structinit.atomic`: ``open`` for writing or appending, ``os.open`` with ``O_CREAT``,
    ``Path.write_text``/``write_bytes``/``touch``, ``torch.save``/``np.save``/``save_file``,
    ``savefig`` or a profiler's trace to a path (not to a handle the writer opened), a
    ``shutil`` copy."""
    handles = _handles(tree)

    def into_handle(arg) -> bool:
        return arg is not None and any(isinstance(n, ast.Name) and n.id in handles for n in ast.walk(arg))

    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        fn = node.func
        name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
        owner = getattr(fn.value, "id", "") if isinstance(fn, ast.Attribute) else ""
        args = list(node.args)
        if name == "open" and owner == "os":
            if any(isinstance(n, ast.Attribute) and n.attr == "O_CREAT" for n in ast.walk(node)):
                found.append((node.lineno, "os.open(..., O_CREAT)"))
        elif name == "open":
            modes = args[1:2] + [k.value for k in node.keywords if k.arg == "mode"]
            if any(isinstance(m, ast.Constant) and set(str(m.value)) & set("wax+") for m in modes):
                found.append((node.lineno, "open for writing"))
        elif isinstance(fn, ast.Attribute) and name in ("write_text", "write_bytes", "touch"):
            found.append((node.lineno, f"Path.{name}"))
        elif name in ("save", "save_file") and len(args) >= 2 and not into_handle(args[0 if owner == "np" else 1]):
            found.append((node.lineno, f"{owner + '.' if owner else ''}{name} to a path"))
        elif name in ("savefig", "export_chrome_trace") and not into_handle(args[0] if args else None):
            found.append((node.lineno, f"{name} to a path"))
        elif owner == "shutil" and name.startswith("copy"):
            found.append((node.lineno, f"shutil.{name}"))
    return found


def test_every_file_is_written_through_the_one_writer():
    """Every file structinit writes goes through :mod:`structinit.atomic` (a temp file moved into
    place, an exclusive create, an appended line): no module opens a file for writing, saves a
    tensor or a figure to a path, or copies a file by itself."""
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "atomic.py":
            continue
        wrong += [f"{rel}:{line} {what}" for line, what in writes_outside_the_writer(ast.parse(path.read_text()))]
    assert wrong == []


def test_the_writer_check_finds_each_way_of_writing():
    code = ('open(p, "w")\nopen(p, mode="ab")\np.write_text("x")\ntorch.save(x, p)\nshutil.copy2(a, b)\n'
            'fig.savefig("a.png")\nos.open(p, os.O_CREAT | os.O_WRONLY)\nopen(p)\nopen(p, "rb")\n'
            'with atomic_write(p) as fh:\n    fig.savefig(fh)\n    torch.save(x, fh)\n'
            'write_text(p, "x")\nx.copy()\nfh.write(save(tensors))\n')
    assert sorted(line for line, _ in writes_outside_the_writer(ast.parse(code))) == [1, 2, 3, 4, 5, 6, 7]


# --------------------------------------------------------------------------- one reader

#: Calls that read a file other than through ``atomic.read_regular``/``read_regular_text``, each
#: with why it may: the file was checked a regular file first (``regular_file`` in the function
#: itself, or in the caller named), so a FIFO or a device is refused, never waited on, and the reader
#: streams it in parts (a checkpoint may not fit in memory twice); or it is not a user's path.
READ_EXCEPTIONS = {
    "apply/inputs.py:_folder_inputs": ("is_file", "Pillow decodes the images that Path.is_file() listed"),
    "apply/tensor_files.py:tensor_file_format": ("apply/inputs.py:fit_inputs_for", "its first bytes"),
    "apply/tensor_files.py:read_npy": ("apply/inputs.py:fit_inputs_for", "the header against the size, then NumPy"),
    "apply/tensor_files.py:_safetensors_header": ("apply/inputs.py:fit_inputs_for", "the header alone"),
    "apply/tensor_files.py:read_safetensors_inputs": ("apply/inputs.py:fit_inputs_for", "one tensor"),
    "cli/inspect.py:_is_artifact_file": ("here", "safetensors reads the header's metadata"),
    "init/checkpoints.py:sniff_format": ("init/checkpoints.py:check_checkpoint_path", "its first bytes"),
    "init/checkpoints.py:_pickle_bytes": ("here", "a torch.save zip's data.pkl, through zipfile"),
    "init/checkpoints.py:read_object": ("init/checkpoints.py:check_checkpoint_path",
                                       "torch or safetensors read the checkpoint in parts"),
    "training/run_checkpoint.py:_read_torch": ("here", "torch reads the checkpoint in parts"),
    "experiments/gridspec.py:load_grid": ("package data", "a shipped grid, through importlib.resources"),
    "experiments/slurm.py:render_script": ("package data", "the sbatch template, through importlib.resources"),
    "experiments/torchrun.py:_children": ("system file", "/proc/PID/stat: the training processes"),
    "runtime.py:_read": ("system file", "/proc and /sys: the CPUs this process may use"),
    "solver/run.py:available_memory": ("system file", "/proc/meminfo"),
}

#: Readers that take a path: ``(owner, name)`` of a call, ``owner`` empty for a plain name.
PATH_READERS = {("np", "load"), ("numpy", "load"), ("torch", "load"), ("Image", "open"), ("zipfile", "ZipFile"),
                ("", "ZipFile"), ("", "safe_open"), ("", "load_file")}


def reads_outside_the_reader(tree):
    """``(line, function, what)`` of every call in ``tree`` that reads a file by itself: ``open``
    for reading, ``Path.read_text``/``read_bytes``, and the readers of :data:`PATH_READERS`."""
    found = []

    def read_call(node):
        fn = node.func
        name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
        owner = getattr(fn.value, "id", "") if isinstance(fn, ast.Attribute) else ""
        if isinstance(fn, ast.Name) and name == "open":
            modes = node.args[1:2] + [k.value for k in node.keywords if k.arg == "mode"]
            if not any(isinstance(m, ast.Constant) and set(str(m.value)) & set("wax+") for m in modes):
                return "open"
        elif isinstance(fn, ast.Attribute) and name in ("read_text", "read_bytes"):
            return f"Path.{name}"
        elif (owner, name) in PATH_READERS:
            return f"{owner + '.' if owner else ''}{name}"
        return None

    def visit(node, where):
        for child in ast.iter_child_nodes(node):
            what = read_call(child) if isinstance(child, ast.Call) else None
            if what:
                found.append((child.lineno, where, what))
            visit(child, child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else where)

    visit(tree, "<module>")
    return found


def _calls_regular_file(rel: str, function: str) -> bool:
    tree = ast.parse((PACKAGE / rel).read_text())
    return any(isinstance(node, ast.FunctionDef) and node.name == function and any(
        isinstance(c, ast.Call) and getattr(c.func, "id", getattr(c.func, "attr", "")) == "regular_file"
        for c in ast.walk(node)) for node in ast.walk(tree))


@pytest.mark.skipif("MUTANT_UNDER_TEST" in os.environ, reason="mutmut's copy renames every function")
def test_every_file_is_read_through_the_one_reader():
    """Every file structinit reads goes through :mod:`structinit.atomic`'s checked reader (a regular
    file only, its size known first), or is one of :data:`READ_EXCEPTIONS`: a file checked a regular
    file first (the check is looked for where the exception says), or not a user's path."""
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel != "atomic.py":
            found |= {f"{rel}:{where}" for _, where, _ in reads_outside_the_reader(ast.parse(path.read_text()))}
    assert sorted(found - set(READ_EXCEPTIONS)) == []  # a new reader: read through atomic, or say why not
    assert sorted(set(READ_EXCEPTIONS) - found) == []  # an exception no longer needed is dropped
    for where, (checked, _) in READ_EXCEPTIONS.items():
        if checked == "here" or ":" in checked:  # the regular_file check is where it says
            assert _calls_regular_file(*(where if checked == "here" else checked).split(":")), where


def test_the_reader_check_finds_each_way_of_reading():
    code = ('open(p)\nopen(p, "rb")\np.read_text()\np.read_bytes()\nnp.load(p)\ntorch.load(p)\n'
            'safe_open(str(p), "pt")\nzipfile.ZipFile(p)\nImage.open(p)\nload_file(p)\n'
            'def f():\n    open(p, "w")\n    read_regular(p)\n    os.open(p, os.O_RDONLY)\n    json.loads(t)\n')
    found = reads_outside_the_reader(ast.parse(code))
    assert [line for line, _, _ in found] == list(range(1, 11))
    assert {where for _, where, _ in found} == {"<module>"}
    assert reads_outside_the_reader(ast.parse("def g():\n    x = open(p)\n")) == [(2, "g", "open")]
    assert _calls_regular_file("apply/inputs.py", "fit_inputs_for")
    assert not _calls_regular_file("apply/tensor_files.py", "read_npy")


# --------------------------------------------------------------------------- one owner of the run folder

def test_the_run_folder_has_one_owner():
    """Every file of a run's folder is named in one module, :mod:`structinit.training.rundir`, and
    read and written through its :class:`RunDir`: no other module spells ``final.json``,
    ``task.json``, ``log.txt``... (``config.json`` is also a Hugging Face model's settings file,
    named once for that as ``init.checkpoints.HF_CONFIG``)."""
    from structinit.training.rundir import RunDir

    names = {RunDir.CONFIG, RunDir.METRICS, RunDir.CHECKPOINT, RunDir.BEST, RunDir.FINAL, RunDir.TASK, RunDir.LOG,
             RunDir.HEARTBEAT, RunDir.LOCK, RunDir.WHY}
    allowed = {"training/rundir.py": names, "init/checkpoints.py": {"config.json"},
               "solver/cache.py": {".lock"}}  # the suffix of an artifact's lock file in the cache
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names - allowed.get(rel, set()):
                wrong.append(f"{rel}:{node.lineno} names {node.value!r}")
    assert wrong == []


# --------------------------------------------------------------------------- size limits

FUNCTION_LINES = 80  # a function longer than this is split (docs/architecture.md)
CLASS_LINES = 250
MODULE_LINES = 600


def oversized(root):
    """``(where, lines)`` of every function longer than ``FUNCTION_LINES``, every class longer than
    ``CLASS_LINES`` and every module longer than ``MODULE_LINES`` under ``root``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        text = path.read_text()
        if len(text.splitlines()) > MODULE_LINES:
            found.append((rel, len(text.splitlines())))
        for node in ast.walk(ast.parse(text)):
            lines = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and lines > FUNCTION_LINES:
                found.append((f"{rel}:{node.name}", lines))
            elif isinstance(node, ast.ClassDef) and lines > CLASS_LINES:
                found.append((f"{rel}:{node.name}", lines))
    return found


@pytest.mark.skipif("MUTANT_UNDER_TEST" in os.environ, reason="mutmut's copy wraps every function in trampolines")
def test_functions_classes_and_modules_stay_under_their_size_limits():
    assert oversized(PACKAGE) == []


def test_the_size_check_finds_a_long_function_a_long_class_and_a_long_module(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(FUNCTION_LINES))
    (tmp_path / "m.py").write_text(f"def long():\n{body}\n\n\nclass Big:\n" + "\n".join(
        f"    y{i} = {i}" for i in range(CLASS_LINES)) + "\n\n\ndef short():\n    return 1\n")
    assert oversized(tmp_path) == [("m.py:long", FUNCTION_LINES + 1), ("m.py:Big", CLASS_LINES + 1)]
    (tmp_path / "m.py").write_text("x = 1\n" * MODULE_LINES)
    assert oversized(tmp_path) == []
    (tmp_path / "m.py").write_text("x = 1\n" * (MODULE_LINES + 1))
    assert oversized(tmp_path) == [("m.py", MODULE_LINES + 1)]

# --------------------------------------------------------------------------- options declared once

def option_declarations(tree, src):
    """``(line, what)`` of every ``typer.Option(...)`` in ``tree`` (a flag's declaration) and of
    every ``option("--flag", ...)`` (a use of the one declaration), with the flag."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            fn = ast.get_source_segment(src, node.func)
            first = node.args[0].value if node.args and isinstance(node.args[0], ast.Constant) else None
            if fn in ("typer.Option", "Option"):
                found.append((node.lineno, "declares", first))
            elif fn == "option":
                found.append((node.lineno, "uses", first))
    return found


def test_every_option_is_declared_once():
    """Each flag's short letter and how its value is read are declared once, in ``cli.common.FLAGS``
    (a flag not there is its long name alone); a command takes it through ``option("--flag",
    help=...)``, naming it by its long flag and adding what is its own (its help, the default it
    shows), and never declares a flag with ``typer.Option`` itself."""
    import pytest

    from structinit.cli.common import FLAGS, option

    declared, unknown = [], []
    for path in sorted((PACKAGE / "cli").glob("*.py")):
        src = path.read_text()
        for line, what, flag in option_declarations(ast.parse(src), src):
            if what == "declares" and not (path.name == "common.py" and flag is None):
                declared.append(f"{path.name}:{line} typer.Option({flag!r})")
            elif what == "uses" and not (path.name == "common.py" and flag is None) and not (
                    isinstance(flag, str) and flag.startswith("--")):
                unknown.append(f"{path.name}:{line} option({flag!r})")
    assert declared == [] and unknown == []
    names = [name for decl in FLAGS.values() for name in decl["names"]]
    assert len(names) == len(set(names))  # a name (a short letter too) stands for one option
    assert all(long == decl["names"][0] for long, decl in FLAGS.items())
    assert all(len(decl) > 1 or len(decl["names"]) > 1 for decl in FLAGS.values())  # nothing but its name: not there
    for bad in (("-f",), ("--filter", ("-x",))):  # a short letter given by a command, not by FLAGS
        with pytest.raises(ValueError, match="short letter"):
            option(bad[0], also=bad[1] if len(bad) > 1 else ())


def test_a_flag_takes_one_type_in_every_command():
    """``--out`` is a path in every command that has it, ``--seed`` an integer...: the value a flag
    takes is the same type wherever it appears (``None`` allowed where the command has no default)."""
    import typing

    import typer.main

    from structinit.cli.app import app

    def commands(group, path=()):
        for name, cmd in getattr(group, "commands", {}).items():
            yield from commands(cmd, path + (name,)) if getattr(cmd, "commands", None) else [(path + (name,), cmd)]

    types = {}
    for path, cmd in commands(typer.main.get_command(app)):
        hints = typing.get_type_hints(cmd.callback, include_extras=True)
        for hint in hints.values():
            args = typing.get_args(hint)
            infos = [a for a in args[1:] if type(a).__name__ == "OptionInfo"]
            if not infos:
                continue
            flag = infos[0].default if isinstance(infos[0].default, str) else infos[0].param_decls[0]
            inner = [a for a in typing.get_args(args[0]) if a is not type(None)] or [args[0]]
            types.setdefault(flag, {}).setdefault(str(inner[0]), []).append(" ".join(path))
    assert {flag: kinds for flag, kinds in types.items() if len(kinds) > 1} == {}
