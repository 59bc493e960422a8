"""The stages run one way (docs/architecture.md): a module of a stage imports only from its own
stage, the stages before it, and the root modules; nothing imports the CLI. Imports inside
functions count too: a lazy import is still a dependency."""

import ast
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "structinit"
STAGES = ["geometry", "analysis", "solver", "fit", "init", "training", "apply", "benchmarks", "experiments", "cli"]
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
