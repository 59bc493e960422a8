"""``structinit bench solver``: the solver recipes side by side on one shape, in one process (a
thin layer over :func:`structinit.benchmarks.solver.run_solver_bench`)."""

from __future__ import annotations

from typing import List, Optional

import typer
from typing_extensions import Annotated

from structinit.cli.common import (
    Depth,
    Device,
    Dim,
    Filter,
    GridOpt,
    Heads,
    JsonOut,
    Progress,
    Seed,
    Threads,
    Tokens,
    emit_json,
    examples,
    option,
    shown,
)
from structinit.solver.recipes import DEFAULT_FILTER, RECIPE_DEFAULTS

EXAMPLES = examples(
    'structinit bench solver --tokens 64 --dim 64 --heads 4 --iters 300      # all four recipes, paper shortened',
    'structinit bench solver --tokens 64 --dim 64 --heads 4 --recipes fast,paper --iters 200 --json',
    'structinit bench solver --grid 14x14 --dim 768 --heads 12 --depth 12 --recipes fast',
)


ALL_RECIPES = "paper,released,closed-form,fast"


def _effective_match(match: Optional[str], names: List[str], target_mass: Optional[float],
                     iters: Optional[int]) -> Optional[str]:
    """The recipe fast matches (``None``: none), refusing options that would have no effect."""
    from structinit.errors import UsageError

    if match is None:
        match = "paper" if "paper" in names and "fast" in names else None
    elif match.strip().lower() == "none":
        match = None
    elif match not in names or "fast" not in names:
        raise UsageError(f"--match {match} compares fast with {match}; both must be in --recipes "
                         f"(got {','.join(names) or 'none'})")
    if target_mass is not None and "fast" not in names:
        raise UsageError("--target-mass is the fast recipe's, which is not in --recipes")
    if target_mass is not None and match is not None:
        raise UsageError(f"--target-mass has no effect while fast matches {match}'s mass; add --match none to set it")
    if iters is not None and not {"paper", "released"} & set(names):
        raise UsageError("--iters is for the paper and released recipes, and neither is in --recipes")
    return match


def bench_solver(
    tokens: Tokens = None,
    grid: GridOpt = None,
    dim: Dim = 192,
    heads: Heads = 3,
    filter_size: Filter = DEFAULT_FILTER,
    layers: Depth = 1,
    recipes: Annotated[str, option("--recipes", help="Comma-separated recipes.")] = ALL_RECIPES,
    match: Annotated[Optional[str], option("--match", help="Ask fast for the target mass this recipe reached "
                                                 "('none': use --target-mass).",
                                                 show_default="paper, when paper and fast both run")] = None,
    target_mass: Annotated[Optional[float], option(
        "--target-mass", help="fast's target mass when not matching.",
        show_default=shown(RECIPE_DEFAULTS["fast"]["target_mass"]))] = None,
    iters: Annotated[Optional[int], option(
        "--iters", help="Iterations of paper/released.", show_default=shown(RECIPE_DEFAULTS["paper"]["iters"]))] = None,
    seed: Seed = 0,
    device: Device = "auto",
    threads: Threads = None,
    json_out: JsonOut = False,
):
    """Run solver recipes on one shape in one process: seconds, MSE, hit rate, target mass."""
    from structinit.benchmarks.solver import run_solver_bench, solver_bench_table
    from structinit.geometry.grid import parse_grid
    from structinit.runtime import use_threads

    use_threads(threads)
    if tokens is None and grid is None:
        tokens = 256
    names: List[str] = [r.strip() for r in recipes.split(",") if r.strip()]
    match = _effective_match(match, names, target_mass, iters)
    with Progress("bench solver", enabled=not json_out) as bar:
        result = run_solver_bench(parse_grid(tokens, grid), dim, heads, filter_size, layers, names, match=match,
                                  target_mass=target_mass, iters=iters, seed=seed, device=device, progress=bar,
                                  on_recipe=lambda name, i, n: bar.stage(f"recipe {i + 1}/{n}: {name}"))
    if json_out:
        emit_json(result)
    else:
        typer.echo(solver_bench_table(result))
