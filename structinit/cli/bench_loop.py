"""``structinit bench loop``: images per second of train's epoch loop against a bare PyTorch loop
(a thin layer over :func:`structinit.benchmarks.loop.run_loop_bench`)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from typing_extensions import Annotated

from structinit.benchmarks.loop import NOISE_IMAGE_SIZE, NOISE_IMAGES, NOISE_IN_CHANS
from structinit.cli.common import (
    Device,
    JsonOut,
    Progress,
    Seed,
    Threads,
    data_dir_option,
    emit_json,
    examples,
    option,
    shown,
)

EXAMPLES = examples(
    'structinit bench loop --model vit-digits --dataset digits --threads 1',
    'structinit bench loop --model vit-t --dataset noise --image-size 32 --batch-size 128 --amp bf16 '
    '--timm-model vit_tiny_patch16_224 --device cuda   # ViT-T at 32x32 against timm\'s own',
)


def bench_loop(
    model: Annotated[str, option("--model", help="A preset (see structinit train --help).")] = "vit-digits",
    dataset: Annotated[str, option("--dataset", help="An in-memory dataset, or noise: Gaussian noise images "
                                         "(--image-size, --in-chans, --images) with random labels.")] = "digits",
    batch_size: Annotated[int, option("--batch-size", min=1, help="Batch size.")] = 64,
    epochs: Annotated[int, option("--epochs", min=1, help="Epochs a repeat.")] = 2,
    repeats: Annotated[int, option("--repeats", min=1, help="Repeats of each loop, alternating.")] = 3,
    seed: Seed = 0,
    device: Device = "cpu",
    amp: Annotated[str, option("--amp", help="Mixed precision, as train's: auto (bf16/fp16 on a GPU, off on "
                                     "the CPU), bf16, fp16 or off.")] = "auto",
    data_dir: Annotated[Optional[Path], data_dir_option()] = None,
    image_size: Annotated[Optional[int], option("--image-size", min=1, help="Noise images: side.",
                                                      show_default=shown(NOISE_IMAGE_SIZE))] = None,
    in_chans: Annotated[Optional[int], option("--in-chans", min=1, help="Noise images: channels.",
                                                    show_default=shown(NOISE_IN_CHANS))] = None,
    images: Annotated[Optional[int], option("--images", min=1, help="Noise images: how many (an epoch).",
                                                  show_default=shown(NOISE_IMAGES))] = None,
    timm_model: Annotated[Optional[str], option("--timm-model", help="Also time the bare loop on timm's "
                                                      "model of this name (e.g. vit_tiny_patch16_224), built at "
                                                      "the data's size and the preset's patch, without a class "
                                                      "token, average-pooled.")] = None,
    threads: Threads = None,
    json_out: JsonOut = False,
):
    """Images per second of train's epoch loop against a bare PyTorch loop of the same recipe."""
    from structinit.benchmarks.loop import loop_bench_table, run_loop_bench
    from structinit.runtime import use_threads

    use_threads(threads)
    with Progress("bench loop", enabled=not json_out) as bar:
        result = run_loop_bench(model, None if dataset == "noise" else dataset, batch_size=batch_size,
                                epochs=epochs, repeats=repeats, seed=seed, device=device, amp=amp, data_dir=data_dir,
                                image_size=image_size, in_chans=in_chans, images=images, timm_model=timm_model,
                                progress=bar.stage)
    if json_out:
        emit_json(result)
    else:
        typer.echo(loop_bench_table(result))
