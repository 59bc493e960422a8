"""``structinit bench fit``: the default impulse init with its data fit timed against training
steps of the same model (a thin layer over :func:`structinit.benchmarks.fit.run_fit_bench`)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from typing_extensions import Annotated

from structinit.benchmarks.loop import NOISE_IMAGE_SIZE, NOISE_IN_CHANS
from structinit.cli.common import (
    Device,
    InitParam,
    JsonOut,
    Progress,
    Seed,
    Threads,
    emit_json,
    examples,
    option,
    shown,
)
from structinit.fit.settings import FIT_DEFAULTS

#: Library parameters this command spells with another flag.
ALIASES = {"profile_dir": "--profile"}

EXAMPLES = examples(
    'structinit bench fit --model vit-digits --dataset digits --versions 1,2 --threads 1   # real digits',
    'structinit bench fit --model vit-t --image-size 32 --in-chans 3 --threads 1          # ViT-T shape, noise',
    'structinit bench fit --model vit-digits --image-size 8 --in-chans 1 --data-free -p position_subspace=true '
    '   # the fit in the position subspace',
    'structinit bench fit --model vit-s --image-size 224 --patch 16 --train-batch 128 --amp bf16 --data-free '
    '--device cuda --profile prof --profile-over 2   # ViT-S/16 at 224 on a GPU',
)


def bench_fit(
    model: Annotated[str, option("--model", help="A ViT preset (see structinit train --help).")] = "vit-digits",
    dataset: Annotated[Optional[str], option("--dataset", help="Real inputs: an in-memory image dataset "
                                                   "(digits, fashion-mnist, ...); without it, noise images.",
                                                   show_default="noise")] = None,
    image_size: Annotated[Optional[int], option("--image-size", min=1, help="Noise images: side.",
                                                      show_default=shown(NOISE_IMAGE_SIZE))] = None,
    in_chans: Annotated[Optional[int], option("--in-chans", min=1, help="Noise images: channels.",
                                                    show_default=shown(NOISE_IN_CHANS))] = None,
    patch: Annotated[Optional[int], option("--patch", min=1, help="Noise images: the model's patch size "
                                                 "(ViT-S/16 at 224: --image-size 224 --patch 16).",
                                                 show_default="2")] = None,
    versions: Annotated[str, option("--versions", help="Data fit versions to time, comma-separated.")] = "2",
    samples: Annotated[int, option("--samples", min=1, help="Inputs the fit gets.")] = FIT_DEFAULTS.samples,
    steps: Annotated[int, option("--steps", min=1, help="The fit's Adam steps (fewer: to time a slow "
                                       "version's steps; the init then is not the default).")] = FIT_DEFAULTS.steps,
    train_steps: Annotated[int, option("--train-steps", min=1, help="Training steps timed as the "
                                             "unit.")] = 10,
    train_batch: Annotated[int, option("--train-batch", min=1, help="Batch size of those training "
                                             "steps.")] = 64,
    amp: Annotated[str, option("--amp", help="Mixed precision of those training steps, as train's: off, "
                                     "bf16, fp16, or auto (bf16/fp16 on a GPU, off on the CPU).")] = "off",
    data_free: Annotated[bool, option("--data-free", help="Also time each fit without data (on noise "
                                            "inputs of the model's input shape, as initialize_model(model, "
                                            "\"impulse\") fits).")] = False,
    profile: Annotated[Optional[Path], option("--profile", help="Profile the first version's fit once "
                                                    "more (torch.profiler) into this folder: fit-ops.txt, "
                                                    "fit-trace.json.gz.", metavar="DIR")] = None,
    profile_over: Annotated[float, option("--profile-over", min=0.0, help="With --profile: only when that "
                                                "init took longer than this many seconds.")] = 0.0,
    profile_steps: Annotated[int, option("--profile-steps", min=1, help="With --profile: the profiled fit's "
                                               "Adam steps (every phase of the fit, fewer steps: a small "
                                               "profile).")] = 30,
    init_param: InitParam = [],  # noqa: B006
    seed: Seed = 0,
    device: Device = "cpu",
    threads: Threads = None,
    json_out: JsonOut = False,
):
    """Time the default impulse init with its data fit against training steps of the same model
    (``--init-param``: another setting of it, such as the position subspace)."""
    from structinit.benchmarks.fit import fit_bench_table, run_fit_bench
    from structinit.errors import UsageError
    from structinit.init.registry import init_spec, parse_assignments
    from structinit.runtime import use_threads

    if dataset is not None and (image_size is not None or in_chans is not None):
        raise UsageError("--image-size and --in-chans shape the noise images; --dataset has its own")
    if profile is None and (profile_over or profile_steps != 30):
        raise UsageError("--profile-over and --profile-steps need --profile DIR")
    try:
        wanted = [int(v) for v in versions.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"--versions takes comma-separated integers, got {versions!r}") from None
    params = parse_assignments(init_param)
    init_spec("impulse", **params)  # refuse an unknown or bad parameter before any work
    use_threads(threads)
    with Progress("bench fit", enabled=not json_out) as bar:
        result = run_fit_bench(model, dataset=dataset, image_size=image_size or 32, in_chans=in_chans or 3,
                               patch=patch, versions=wanted, samples=samples, train_steps=train_steps,
                               train_batch=train_batch, amp=amp, steps=steps, seed=seed, device=device,
                               data_free=data_free, profile_dir=profile, profile_over=profile_over,
                               profile_steps=profile_steps, progress=bar.stage, init_params=params)
    if json_out:
        emit_json(result)
    else:
        typer.echo(fit_bench_table(result))
