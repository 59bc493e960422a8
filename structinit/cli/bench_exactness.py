"""``structinit bench exactness``: impulse-initialized multi-head attention against a convolution
(a thin layer over :func:`structinit.benchmarks.exactness.run_exactness`)."""

from __future__ import annotations

from typing import Optional

import typer
from typing_extensions import Annotated

from structinit.cli.common import Device, Filter, GridOpt, JsonOut, Progress, Seed, Threads, emit_json, examples, option
from structinit.solver.recipes import DEFAULT_FILTER

#: Library parameter names that bench exactness spells with another flag.
ALIASES = {"padding": "--paddings"}

EXAMPLES = examples(
    'structinit bench exactness                               # 8x8 grid, 3x3 kernel: 9 heads',
    'structinit bench exactness --grid 40 --filter 5 --json   # a sequence of 40, 5 heads',
    'structinit bench exactness --grid 40 --filter 3 --causal --paddings zero',
)


def _floats(text: str, name: str):
    from structinit.errors import UsageError

    try:
        values = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise UsageError(f"{name} must be comma-separated numbers, got {text!r}") from None
    return values


def bench_exactness(
    grid: GridOpt = "8x8",
    filter_size: Filter = DEFAULT_FILTER,
    masses: Annotated[str, option("--masses", help="Comma-separated target masses, each in (0, 1).")] =
        "0.9,0.99,0.999,0.9999",
    paddings: Annotated[Optional[str], option("--paddings", help="Comma-separated paddings: zero (compared "
                                                    "away from the border), circular (compared everywhere).",
                                                    show_default="zero,circular; zero with --causal")] = None,
    channels: Annotated[int, option("--channels", min=1, help="Input channels of the random inputs and "
                                          "kernel.")] = 4,
    out_channels: Annotated[Optional[int], option("--out-channels", min=1, help="Output channels of the "
                                                        "kernel.", show_default="--channels")] = None,
    dim: Annotated[Optional[int], option("--dim", help="Attention dim D (the pseudo input's).",
                                               show_default="32 per head; on sequences at least 3 per "
                                               "position")] = None,
    causal: Annotated[bool, option("--causal", help="Sequences: a causal kernel (the current and past "
                                         "positions) under a causal mask.")] = False,
    ridge: Annotated[float, option("--ridge", help="fast recipe's ridge (small: keep every direction of the "
                                         "position embedding).")] = 1e-9,
    seed: Seed = 0,
    device: Device = "cpu",
    threads: Threads = None,
    json_out: JsonOut = False,
):
    """Show that an impulse-initialized attention layer starts as a convolution (Cordonnier et al.,
    Lemma 1): one head per kernel shift, values set from a random kernel, compared with conv2d
    (conv1d on a sequence) on random inputs as the target mass goes to 1."""
    from structinit.benchmarks.exactness import exactness_table, run_exactness
    from structinit.geometry.grid import parse_grid
    from structinit.runtime import use_threads

    use_threads(threads)  # the thread policy of every command
    mass_list = _floats(masses, "--masses")
    if paddings is None:
        paddings = "zero" if causal else "zero,circular"
    padding_list = [p.strip() for p in paddings.split(",") if p.strip()]
    with Progress("bench exactness", enabled=not json_out) as bar:
        result = run_exactness(parse_grid(grid=grid), filter_size, masses=mass_list, paddings=padding_list,
                               channels=channels, out_channels=out_channels, dim=dim, causal=causal, ridge=ridge,
                               seed=seed, device=device,
                               on_row=lambda r: bar.log(f"{r['padding']} padding, target mass {r['target_mass']:g}: "
                                                        f"relative error {r['rel_error']:.3e}"))
    if json_out:
        emit_json(result)
    else:
        typer.echo(exactness_table(result))
