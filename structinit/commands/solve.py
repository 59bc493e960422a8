"""``structinit solve``: Q/K for a shape and recipe, stored in (or read from) the cache."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..app import app
from .common import cli_errors, emit_json, progress

EXAMPLE = """
Examples:

  structinit solve --tokens 256 --dim 192 --heads 3 --filter 3

  structinit solve --grid 14x14 --dim 768 --heads 12 --layers 12 --target-mass 0.5 --json

  structinit solve --tokens 256 --dim 192 --heads 3 --recipe released --share --layers 12
"""


def artifact_summary(result) -> dict:
    """The JSON that ``solve --json`` prints: path, key, cache status, config and quality."""
    art = result.artifact
    return {
        "path": str(art.path),
        "key": art.key,
        "cached": result.cached,
        "config": art.config.to_dict(),
        "offsets": art.offsets.tolist(),
        "stats": art.stats,
    }


@app.command(epilog=EXAMPLE)
@cli_errors
def solve(
    tokens: Optional[int] = typer.Option(None, "--tokens", "-n", help="Number of patch tokens N (a perfect square). Default 256 when --grid is not given."),
    grid: Optional[str] = typer.Option(None, "--grid", help="Patch grid HxW (for non-square grids)."),
    dim: int = typer.Option(192, "--dim", "-d", help="Embedding dimension D (divisible by heads and by 4)."),
    heads: int = typer.Option(3, "--heads", help="Attention heads per layer."),
    filter_size: int = typer.Option(3, "--filter", "-f", help="Impulse filter size f (offsets drawn from the f x f window)."),
    layers: int = typer.Option(1, "--layers", "-l", help="Layers, each with its own offsets and solve."),
    share: bool = typer.Option(False, "--share", help="Solve once and reuse it for every layer (the released code's default)."),
    recipe: str = typer.Option("fast", "--recipe", "-r", help="fast | paper | released | closed-form."),
    target_mass: Optional[float] = typer.Option(None, "--target-mass", "-m", help="fast: mean attention on the target token, in (1/N, 1) [default 0.3]. Lower is softer."),
    ridge: Optional[float] = typer.Option(None, "--ridge", help="fast: ridge strength, relative to s_max^4 [default 1e-5]."),
    iters: Optional[int] = typer.Option(None, "--iters", help="paper/released: Adam iterations [default 10000]."),
    lr: Optional[float] = typer.Option(None, "--lr", help="paper/released: Adam learning rate [default 1e-4]."),
    norm_every: Optional[int] = typer.Option(None, "--norm-every", help="released: column-norm reset period [default 100]."),
    pseudo_input: str = typer.Option("pe", "--pseudo-input", help="pe | uniform | gaussian | pe+uniform | pe+gaussian (Table 6)."),
    pseudo_input_rest: Optional[str] = typer.Option(None, "--pseudo-input-rest", help="Pseudo input of layers after the first [default: same]."),
    padding: str = typer.Option("zero", "--padding", help="zero (paper) | circular (wrap-around)."),
    offsets: str = typer.Option("random", "--offsets", help="random (a draw per head) | centre (centre first: 4,1,5,3,7,... for f=3)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the offsets, noise and random inits."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda."),
    threads: Optional[int] = typer.Option(None, "--threads", help="torch CPU threads [default: torch's]."),
    cache_dir: Optional[Path] = typer.Option(None, "--cache-dir", help="Cache folder [default $STRUCTINIT_CACHE, else $XDG_CACHE_HOME/structinit]."),
    force: bool = typer.Option(False, "--force", help="Solve again even if the cache has it."),
    json_out: bool = typer.Option(False, "--json", help="Print a JSON document instead of the table."),
):
    """Solve Q/K so that each head's attention is an impulse filter, and cache the result."""
    from ..config import SolveConfig
    from ..report import quality_table
    from ..shapes import parse_grid
    from ..solve import solve as run_solve

    if tokens is None and grid is None:
        tokens = 256
    overrides = {"target_mass": target_mass, "ridge": ridge, "iters": iters, "lr": lr, "norm_every": norm_every}
    config = SolveConfig(grid=parse_grid(tokens, grid), dim=dim, heads=heads, filter=filter_size, layers=layers,
                         share=share, recipe=recipe, params={k: v for k, v in overrides.items() if v is not None},
                         pseudo_input=pseudo_input, pseudo_input_rest=pseudo_input_rest, padding=padding,
                         offset_order=offsets, seed=seed)
    warn = lambda msg: typer.echo(f"warning: {msg}", err=True)  # noqa: E731
    slow = config.recipe in ("paper", "released") and not json_out
    with progress(f"solving {config.recipe}", enabled=slow) as update:
        result = run_solve(config, cache_dir=cache_dir, device=device, force=force, progress=update, warn=warn,
                           threads=threads)
    if json_out:
        emit_json(artifact_summary(result))
        return
    art = result.artifact
    how = "cache hit" if result.cached else f"solved in {art.stats['seconds']:.3f} s on {art.stats['device']}"
    params = ", ".join(f"{k}={v}" for k, v in art.config.params.items())
    typer.echo(f"artifact  {art.path}")
    typer.echo(f"key       {art.key}  ({how})")
    typer.echo(f"config    {art.config.describe()} ({params}), pseudo input {art.config.pseudo_input}, "
               f"{art.config.padding} padding, seed {art.config.seed}")
    typer.echo(quality_table(art))
