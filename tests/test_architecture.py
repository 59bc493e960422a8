"""The stages run one way (docs/architecture.md): a module of a stage imports only from its own
stage, the stages before it, and the root modules; nothing imports the CLI. Imports inside
functions count too: a lazy import is still a dependency."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "structinit"
STAGES = ["geometry", "analysis", "solver", "fit", "init", "training", "benchmarks", "experiments", "cli"]
ROOT = {"errors", "runtime", "atomic", "__init__", "__main__"}


def imports(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("structinit"):
            yield node.lineno, node.module
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("structinit"):
                    yield node.lineno, alias.name


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
