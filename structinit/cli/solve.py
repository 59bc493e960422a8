"""``structinit solve``: Q/K for a shape and recipe, stored in (or read from) the cache."""

from __future__ import annotations

from typing import Optional

import typer
from typing_extensions import Annotated

from structinit.cli.common import (
    CacheDir,
    Causal,
    Depth,
    Device,
    Dim,
    Filter,
    GridOpt,
    Heads,
    JsonOut,
    Offsets,
    Padding,
    Progress,
    Recipe,
    Seed,
    Share,
    TargetMass,
    Threads,
    Tokens,
    emit_json,
    examples,
    option,
    shown,
)
from structinit.solver.recipes import (
    DEFAULT_FILTER,
    DEFAULT_OFFSET_ORDER,
    DEFAULT_PADDING,
    DEFAULT_PSEUDO_INPUT,
    DEFAULT_RECIPE,
    RECIPE_DEFAULTS,
)

EXAMPLES = examples(
    'structinit solve --tokens 256 --dim 192 --heads 3 --filter 3',
    'structinit solve --grid 14x14 --dim 768 --heads 12 --depth 12 --target-mass 0.5 --json',
    'structinit solve --tokens 64 --dim 64 --heads 4 --recipe released --share --depth 4 --iters 500',
    'structinit solve --grid 40 --dim 64 --heads 4 --filter 5 --depth 4      # a sequence of 40 tokens',
    'structinit solve --grid 1024 --dim 768 --heads 12 --filter 3 --causal   # a decoder (GPT-2 sized)',
)

#: Library parameter -> flag, where the two differ.
ALIASES = {"layers": "--depth"}


def artifact_summary(result) -> dict:
    """The JSON that ``solve --json`` prints: path, key, cache status, config and quality."""
    art = result.artifact
    return {"path": str(art.path), "key": art.key, "cached": result.cached, "config": art.config.to_dict(),
            "offsets": art.offsets.tolist(), "stats": art.stats}


def solve(
    tokens: Tokens = None,
    grid: GridOpt = None,
    dim: Dim = 192,
    heads: Heads = 3,
    filter_size: Filter = DEFAULT_FILTER,
    layers: Depth = 1,
    share: Share = False,
    recipe: Recipe = DEFAULT_RECIPE,
    target_mass: TargetMass = None,
    ridge: Annotated[Optional[float], option(
        "--ridge", help="fast recipe: ridge strength, relative to s_max^4.",
        show_default=shown(RECIPE_DEFAULTS["fast"]["ridge"]))] = None,
    iters: Annotated[Optional[int], option(
        "--iters", help="paper/released recipes: Adam iterations.",
        show_default=shown(RECIPE_DEFAULTS["paper"]["iters"]))] = None,
    lr: Annotated[Optional[float], option(
        "--lr", help="paper/released recipes: Adam learning rate.",
        show_default=shown(RECIPE_DEFAULTS["paper"]["lr"]))] = None,
    norm_every: Annotated[Optional[int], option(
        "--norm-every", help="released recipe: column-norm reset period.",
        show_default=shown(RECIPE_DEFAULTS["released"]["norm_every"]))] = None,
    pseudo_input: Annotated[str, option("--pseudo-input", help="pe, uniform, gaussian, pe+uniform or "
                                        "pe+gaussian (the paper's Table 6).")] = DEFAULT_PSEUDO_INPUT,
    pseudo_input_rest: Annotated[Optional[str], option("--pseudo-input-rest", help="Pseudo input of the layers "
                                                             "after the first.", show_default="same")] = None,
    padding: Padding = DEFAULT_PADDING,
    causal: Causal = False,
    offsets: Offsets = DEFAULT_OFFSET_ORDER,
    seed: Seed = 0,
    device: Device = "auto",
    threads: Threads = None,
    cache_dir: CacheDir = None,
    force: Annotated[bool, option("--force", help="Solve again even if the cache has it.")] = False,
    json_out: JsonOut = False,
):
    """Solve Q/K so that each head's attention is an impulse filter, and cache the result."""
    from structinit.analysis.text import quality_table
    from structinit.geometry.grid import parse_grid
    from structinit.runtime import use_threads
    from structinit.solver.config import SolveConfig
    from structinit.solver.run import solve as run_solve

    threads = use_threads(threads)
    if tokens is None and grid is None:
        tokens = 256
    overrides = {"target_mass": target_mass, "ridge": ridge, "iters": iters, "lr": lr, "norm_every": norm_every}
    config = SolveConfig(grid=parse_grid(tokens, grid), dim=dim, heads=heads, filter=filter_size, layers=layers,
                         share=share, recipe=recipe, params={k: v for k, v in overrides.items() if v is not None},
                         pseudo_input=pseudo_input, pseudo_input_rest=pseudo_input_rest, padding=padding,
                         offset_order=offsets, seed=seed, causal=causal)
    with Progress(f"solving {config.recipe}", enabled=not json_out) as bar:
        def warn(message: str) -> None:  # shown with --json too (on stderr): the bar is then off
            if json_out:
                typer.echo(f"warning: {message}", err=True)
            else:
                bar.log(f"warning: {message}")

        result = run_solve(config, cache_dir=cache_dir, device=device, force=force, progress=bar, warn=warn,
                           threads=threads, log=bar.log)
    if json_out:
        emit_json(artifact_summary(result))
        return
    art = result.artifact
    how = "cache hit" if result.cached else f"solved in {art.stats['seconds']:.3f} s on {art.stats['device']}"
    params = ", ".join(f"{k}={v}" for k, v in art.config.params.items())
    typer.echo(f"artifact  {art.path}")
    typer.echo(f"key       {art.key}  ({how})")
    typer.echo(f"config    {art.config.describe()} ({params}), pseudo input {art.config.pseudo_input}, "
               f"{art.config.padding} padding{', causal mask' if art.config.causal else ''}, seed {art.config.seed}")
    typer.echo(quality_table(art.quality, art.offsets))
