"""``structinit bench``: benchmarks. ``bench solver`` runs the solvers side by side on one shape."""

from __future__ import annotations

from typing import List, Optional

import typer

from ..app import app
from .common import cli_errors, emit_json, progress

bench_app = typer.Typer(help="Benchmarks: solvers side by side (more to come: the paper's grid).", no_args_is_help=True)
app.add_typer(bench_app, name="bench")

EXAMPLE = """
Examples:

  structinit bench solver                      # ViT-T shape: 256 tokens, dim 192, 3 heads, f=3

  structinit bench solver --recipes fast,paper --json

  structinit bench solver --grid 14x14 --dim 768 --heads 12 --layers 12 --recipes fast --device cuda
"""


@bench_app.command("solver", epilog=EXAMPLE)
@cli_errors
def bench_solver(
    tokens: Optional[int] = typer.Option(None, "--tokens", "-n", help="Patch tokens (default 256)."),
    grid: Optional[str] = typer.Option(None, "--grid", help="Patch grid HxW."),
    dim: int = typer.Option(192, "--dim", "-d"),
    heads: int = typer.Option(3, "--heads"),
    filter_size: int = typer.Option(3, "--filter", "-f"),
    layers: int = typer.Option(1, "--layers", "-l"),
    recipes: str = typer.Option("paper,released,closed-form,fast", "--recipes", help="Comma-separated recipes, run in this order."),
    match: Optional[str] = typer.Option("paper", "--match", help="Ask fast for the target mass this recipe reached ('none' to use --target-mass)."),
    target_mass: Optional[float] = typer.Option(None, "--target-mass", "-m", help="fast's target mass when not matching."),
    iters: Optional[int] = typer.Option(None, "--iters", help="Iterations for paper/released [default 10000]."),
    seed: int = typer.Option(0, "--seed"),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda."),
    threads: Optional[int] = typer.Option(None, "--threads", help="torch CPU threads [default: torch's]."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
):
    """Run solver recipes on one shape in one process: seconds, MSE, hit rate, target mass."""
    from ..bench_solver import run_solver_bench, solver_bench_table
    from ..shapes import parse_grid
    from ..solve import set_threads

    set_threads(threads)

    if tokens is None and grid is None:
        tokens = 256
    names: List[str] = [r.strip() for r in recipes.split(",") if r.strip()]
    match = None if (match or "").lower() in ("", "none") else match
    with progress("bench solver", enabled=not json_out) as update:
        rows = run_solver_bench(parse_grid(tokens, grid), dim, heads, filter_size, layers, names, match=match,
                                target_mass=target_mass, iters=iters, seed=seed, device=device, progress=update)
    if json_out:
        emit_json(rows)
    else:
        typer.echo(solver_bench_table(rows))
