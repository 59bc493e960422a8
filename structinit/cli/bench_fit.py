"""``structinit bench fit``: the default impulse init with its data fit timed against training
steps of the same model (a thin layer over :func:`structinit.benchmarks.fit.run_fit_bench`)."""

from __future__ import annotations

from typing import Optional

import typer
from typing_extensions import Annotated

from structinit.cli.common import Device, JsonOut, Progress, Seed, Threads, emit_json, examples

EXAMPLES = examples(
    'structinit bench fit --model vit-digits --dataset digits --versions 1,2 --threads 1   # real digits',
    'structinit bench fit --model vit-t --image-size 32 --in-chans 3 --threads 1          # ViT-T shape, noise',
)


def bench_fit(
    model: Annotated[str, typer.Option("--model", help="A ViT preset (see structinit train --help).")] = "vit-digits",
    dataset: Annotated[Optional[str], typer.Option("--dataset", help="Real inputs: an in-memory image dataset "
                                                   "(digits, fashion-mnist, ...); without it, noise images.",
                                                   show_default="noise")] = None,
    image_size: Annotated[Optional[int], typer.Option("--image-size", min=1, help="Noise images: side.",
                                                      show_default="32")] = None,
    in_chans: Annotated[Optional[int], typer.Option("--in-chans", min=1, help="Noise images: channels.",
                                                    show_default="3")] = None,
    versions: Annotated[str, typer.Option("--versions", help="Data fit versions to time, comma-separated.")] = "2",
    samples: Annotated[int, typer.Option("--samples", min=1, help="Inputs the fit gets.")] = 256,
    steps: Annotated[int, typer.Option("--steps", min=1, help="The fit's Adam steps (fewer: to time a slow "
                                       "version's steps; the init then is not the default).")] = 300,
    train_steps: Annotated[int, typer.Option("--train-steps", min=1, help="Training steps (batch 64) timed as the "
                                             "unit.")] = 10,
    seed: Seed = 0,
    device: Device = "cpu",
    threads: Threads = None,
    json_out: JsonOut = False,
):
    """Time the default impulse init with its data fit against training steps of the same model."""
    from structinit.benchmarks.fit import fit_bench_table, run_fit_bench
    from structinit.errors import UsageError
    from structinit.runtime import use_threads

    if dataset is not None and (image_size is not None or in_chans is not None):
        raise UsageError("--image-size and --in-chans shape the noise images; --dataset has its own")
    try:
        wanted = [int(v) for v in versions.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"--versions takes comma-separated integers, got {versions!r}") from None
    use_threads(threads)
    with Progress("bench fit", enabled=not json_out) as bar:
        result = run_fit_bench(model, dataset=dataset, image_size=image_size or 32, in_chans=in_chans or 3,
                               versions=wanted, samples=samples, train_steps=train_steps, steps=steps, seed=seed,
                               device=device,
                               progress=bar.stage)
    if json_out:
        emit_json(result)
    else:
        typer.echo(fit_bench_table(result))
