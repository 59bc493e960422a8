"""``structinit train``: a thin layer over :func:`structinit.training.loop.train` (also under torchrun)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

import typer
from typing_extensions import Annotated

from structinit.cli.common import (
    PARAMS_LISTED,
    Device,
    JsonOut,
    Out,
    Progress,
    Threads,
    data_dir_option,
    emit_json,
    examples,
    init_methods,
    listed,
    option,
    seed_option,
)
from structinit.training.augment import AUGMENTS, SHIFT_PIXELS
from structinit.training.config import TRAIN_BASE, TrainConfig
from structinit.training.datasets import DATASETS
from structinit.training.models import FILTERS, SEQUENCE_PRESETS

if TYPE_CHECKING:
    from structinit.training.loop import TrainResult

EXAMPLES = examples(
    'structinit train --dataset digits --init impulse --epochs 2 --out runs/digits-imp',
    'structinit train --out runs/digits-imp --resume          # continue a run (its own settings) or say it is done',
    'structinit train --dataset digits --train-size 250 --val-size 300 --init mimetic --epochs 2 --json',
    'structinit train --dataset digits --init impulse -p filter=5 -p target_mass=0.5 -p mimetic_vproj=true --epochs 2',
    'structinit train --dataset digits --train-size 100 --val-size 300 --init impulse -p data_fit=300 '
    '-p mimetic_vproj=true --epochs 2   # Q/K fitted to the training images',
    'structinit train --model convmixer-256 --kernel 3 --filters box --dataset synthetic --epochs 1 --dim 64',
    'structinit train --model transformer-1d --dataset mnist1d --init impulse -p filter=5 --epochs 1 --out runs/m1',
    'structinit train --model cnn-1d --dataset mnist1d --shuffle-seq --epochs 1 --out runs/m1-cnn-shuffled',
    'torchrun --standalone --nproc_per_node=2 -m structinit train --dataset synthetic --epochs 1 --out runs/ddp',
)



#: Every setting of a run at its library default (``TrainConfig()`` in the flat form): the defaults of
#: this command's options, never typed twice.
DEFAULTS = TrainConfig().to_dict()

#: TrainConfig fields whose command-line parameter has another name.
_PARAM_OF = {"compile": "compile_", "init_params": "init_param"}


def _with_run_settings(ctx: typer.Context, fields: Dict[str, Any], out: Path) -> Dict[str, Any]:
    """On --resume, every setting not given on the command line is the run's own (from its
    config.json), so `train --out DIR --resume` continues the run as it was started."""
    from structinit.training.rundir import RunDir

    stored = (RunDir(out).read_config() or {}).get("config")
    if not isinstance(stored, dict):
        return fields
    merged = dict(fields)
    for name in fields:
        source = ctx.get_parameter_source(_PARAM_OF.get(name, name))
        # compared by name: newer Typer releases vendor their own copy of click's ParameterSource
        if getattr(source, "name", "DEFAULT") == "DEFAULT" and name in stored and name not in ("out", "resume"):
            merged[name] = stored[name]
    return merged


def _fmt(record: Dict[str, Any], epochs: int) -> str:
    text = (f"epoch {record['epoch']}/{epochs}  loss {record['train_loss']:.4f}  train {record['train_acc']:.2f}%")
    if "val_acc" in record:
        text += f"  val {record['val_acc']:.2f}%"
    if "test_acc" in record:
        text += f"  test {record['test_acc']:.2f}%"
    return text + (f"  lr {record['lr']:.2e}  {record['images_per_s']:.0f} img/s  {record['epoch_seconds']:.1f}s")


# --------------------------------------------------------------------------- options

def _presets() -> str:
    """The model presets, read from the library: the image ones, then those for sequences."""
    from structinit.training.models import OTHER_PRESETS, SEQUENCE_PRESETS, VIT_PRESETS

    return f"{', '.join([*VIT_PRESETS, *OTHER_PRESETS])}; for sequences {listed(list(SEQUENCE_PRESETS))}"


def _datasets() -> str:
    """The datasets, read from the library: the image ones, then the sequences."""
    from structinit.training.datasets import DATASETS

    images = [name for name, info in DATASETS.items() if info.kind != "sequence"]
    return f"{listed(images)}; {listed([n for n in DATASETS if n not in images])} (sequences)"


ModelOpt = Annotated[str, option("--model", help=f"Preset: {_presets()}.")]

DatasetOpt = Annotated[str, option("--dataset", help=f"{_datasets()}.")]

ShuffleSeqOpt = Annotated[bool, option("--shuffle-seq", help="mnist1d: permute the positions of every sequence the "
    "same way (the check that a gain comes from locality).")]

ResumeOpt = Annotated[bool, option("--resume", help="Continue the run in --out from its last checkpoint (start it if "
    "there is none).")]

def _based() -> str:
    """The methods with a ``base`` parameter, read from the registry (the --init help names them)."""
    from structinit.init.registry import methods_with

    return listed(methods_with("base"), "and")


InitOpt = Annotated[Optional[str], option("--init", help="Attention init method (ViTs, transformer-1d): "
    f"{init_methods()}. {_based()} start the weights they do not write from "
    f"base={TRAIN_BASE} (the MLPs at PyTorch's default; chosen on validation) "
    "unless -p base=... says otherwise (base=model: timm's init).",
    show_default="timm's own")]

InitParamOpt = Annotated[List[str], option("--init-param", help="A parameter of the --init, NAME=VALUE "
    f"(repeatable), e.g. filter=5, target_mass=0.3, mimetic_vproj=true for impulse; {PARAMS_LISTED}.")]

DataDirOpt = Annotated[Optional[Path], data_dir_option()]

DownloadOpt = Annotated[bool, option("--download", help="Download cifar10/cifar100/svhn into --data-dir first (needs "
    "network).")]

ImageSizeOpt = Annotated[Optional[int], option("--image-size", help="imagefolder: image side.",
    show_default=str(DATASETS["imagefolder"].image_size))]

TrainSizeOpt = Annotated[Optional[int], option("--train-size", help="Train on a stratified subset of this many images "
    "(drawn with --data-seed).", show_default="all")]

ValSizeOpt = Annotated[int, option("--val-size", help="Hold out this many training images as a validation split "
    "(stratified, the same for every seed).")]

DataSeedOpt = Annotated[Optional[int], option("--data-seed", help="Seed of the training subset.",
    show_default="--seed")]

DimOpt = Annotated[Optional[int], option("--dim", help="Override the preset's embedding dim.")]

HeadsOpt = Annotated[Optional[int], option("--heads", help="Override the preset's heads.")]

DepthOpt = Annotated[Optional[int], option("--depth", help="Override the preset's depth.")]

PatchOpt = Annotated[Optional[int], option("--patch", help="Patch size.", show_default="1 digits, 2 on 32x32, "
    "16 imagefolder")]

MlpRatioOpt = Annotated[Optional[float], option("--mlp-ratio", help="Override the preset's MLP ratio.")]

PoolOpt = Annotated[Optional[str], option("--pool", help="ViT pooling: avg or token (class token).")]

PosEmbedOpt = Annotated[Optional[str], option("--pos-embed", help="ViT position embedding: sincos (fixed) or "
    "learned.")]

KernelOpt = Annotated[Optional[int], option("--kernel", help="ConvMixer depthwise kernel size; cnn-1d kernel "
    "size.")]

WindowOpt = Annotated[Optional[int], option("--window", help="transformer-1d: values each token embeds (odd; 1: one "
    "value per position).", show_default=str(SEQUENCE_PRESETS["transformer-1d"]["window"]))]

FiltersOpt = Annotated[str, option("--filters", help=f"ConvMixer depthwise filters: {FILTERS[0]}, or frozen "
    f"{listed(list(FILTERS[1:]))}.")]

def recipe_default(name: str) -> str:
    """The help's default of training setting ``name``, read from the recipe (``HPARAMS``) and its
    per-dataset and per-model changes: e.g. ``"200; digits 40; ConvMixer 100"``."""
    from structinit.training.config import DATASET_HPARAMS, HPARAMS, MODEL_HPARAMS

    names = {"convmixer": "ConvMixer"}
    parts = [f"{HPARAMS[name]:g}"]
    parts += [f"{names.get(k, k)} {v[name]:g}" for k, v in {**DATASET_HPARAMS, **MODEL_HPARAMS}.items() if name in v]
    return "; ".join(parts)


def augment_default() -> str:
    """The help's default of ``--augment``, read from the datasets: the most common kind, then each
    other kind with its datasets, e.g. ``"randaugment; none on digits, synthetic"``."""
    from collections import Counter

    kinds: Dict[str, List[str]] = {}
    for name, info in DATASETS.items():
        kinds.setdefault(info.augment, []).append(name)
    common = Counter({k: len(v) for k, v in kinds.items()}).most_common(1)[0][0]
    return "; ".join([common] + [f"{k} on {', '.join(v)}" for k, v in kinds.items() if k != common])


DropPathOpt = Annotated[float, option("--drop-path", help="Stochastic depth rate.")]

EpochsOpt = Annotated[Optional[int], option("--epochs", help="Epochs.", show_default=recipe_default("epochs"))]

BatchSizeOpt = Annotated[Optional[int], option("--batch-size", help="Global batch size.",
    show_default=recipe_default("batch_size"))]

LrOpt = Annotated[Optional[float], option("--lr", help="Peak learning rate.", show_default=recipe_default("lr"))]

MinLrOpt = Annotated[Optional[float], option("--min-lr", help="Cosine floor.", show_default=recipe_default("min_lr"))]

WeightDecayOpt = Annotated[Optional[float], option("--weight-decay", help="AdamW weight decay.",
    show_default=recipe_default("weight_decay"))]

WarmupEpochsOpt = Annotated[Optional[float], option("--warmup-epochs", help="Linear warm-up epochs.",
    show_default=recipe_default("warmup_epochs"))]

OptEpsOpt = Annotated[Optional[float], option("--opt-eps", help="AdamW eps.", show_default=recipe_default("opt_eps"))]

GradClipOpt = Annotated[Optional[float], option("--grad-clip", help="Gradient norm clip, 0 for none.",
    show_default=recipe_default("grad_clip"))]

LabelSmoothingOpt = Annotated[Optional[float], option("--label-smoothing", help="Label smoothing.",
    show_default=recipe_default("label_smoothing"))]

AugmentOpt = Annotated[Optional[str], option("--augment", help=f"{', '.join(AUGMENTS[:-1])} or {AUGMENTS[-1]} "
    f"(shift: up to {SHIFT_PIXELS} pixels each way, no flip).",
    show_default=augment_default())]

RandaugNOpt = Annotated[Optional[int], option("--randaug-n", help="RandAugment ops per image.",
    show_default=recipe_default("randaug_n"))]

RandaugMOpt = Annotated[Optional[int], option("--randaug-m", help="RandAugment magnitude.",
    show_default=recipe_default("randaug_m"))]

EvalEveryOpt = Annotated[Optional[int], option("--eval-every", help="Epochs between evaluations (the last epoch is "
    "always evaluated).", show_default="epochs // 50, at least 1")]

SeedOpt = Annotated[int, seed_option("the init, data order and augmentation")]

AmpOpt = Annotated[str, option("--amp", help="Mixed precision: auto (bf16/fp16 on GPU, off on CPU), bf16, fp16 or "
    "off.")]

CompileOpt = Annotated[bool, option("--compile", help="torch.compile the model (slow to start; for long GPU "
    "runs).")]

WorkersOpt = Annotated[int, option("--workers", help="DataLoader workers (imagefolder only).")]


def train(
    ctx: typer.Context,
    model: ModelOpt = DEFAULTS["model"],
    dataset: DatasetOpt = DEFAULTS["dataset"],
    shuffle_seq: ShuffleSeqOpt = DEFAULTS["shuffle_seq"],
    out: Out = None,
    resume: ResumeOpt = DEFAULTS["resume"],
    init: InitOpt = None,
    init_param: InitParamOpt = [],  # noqa: B006
    data_dir: DataDirOpt = None,
    download: DownloadOpt = DEFAULTS["download"],
    image_size: ImageSizeOpt = None,
    train_size: TrainSizeOpt = None,
    val_size: ValSizeOpt = DEFAULTS["val_size"],
    data_seed: DataSeedOpt = None,
    dim: DimOpt = None,
    heads: HeadsOpt = None,
    depth: DepthOpt = None,
    patch: PatchOpt = None,
    mlp_ratio: MlpRatioOpt = None,
    pool: PoolOpt = None,
    pos_embed: PosEmbedOpt = None,
    kernel: KernelOpt = None,
    window: WindowOpt = None,
    filters: FiltersOpt = DEFAULTS["filters"],
    drop_path: DropPathOpt = DEFAULTS["drop_path"],
    epochs: EpochsOpt = None,
    batch_size: BatchSizeOpt = None,
    lr: LrOpt = None,
    min_lr: MinLrOpt = None,
    weight_decay: WeightDecayOpt = None,
    warmup_epochs: WarmupEpochsOpt = None,
    opt_eps: OptEpsOpt = None,
    grad_clip: GradClipOpt = None,
    label_smoothing: LabelSmoothingOpt = None,
    augment: AugmentOpt = None,
    randaug_n: RandaugNOpt = None,
    randaug_m: RandaugMOpt = None,
    eval_every: EvalEveryOpt = None,
    seed: SeedOpt = DEFAULTS["seed"],
    device: Device = DEFAULTS["device"],
    amp: AmpOpt = DEFAULTS["amp"],
    compile_: CompileOpt = DEFAULTS["compile"],
    workers: WorkersOpt = DEFAULTS["workers"],
    threads: Threads = None,
    json_out: JsonOut = False,
):
    """Train a model of the paper's comparison with the paper's recipe.

    Writes into --out: config.json, metrics.jsonl (one line per epoch; an impulse init's attention
    on real training inputs as epoch 0), checkpoint.pt (every
    epoch, atomically), best.pt and final.json. The headline is the final epoch's test accuracy;
    the best epoch is chosen on --val-size's validation split when there is one. Runs unchanged
    under torchrun (DDP; NCCL on GPUs, gloo on CPU); only rank 0 writes and prints. SIGTERM stops
    it at the next optimizer step (every process at the same one under torchrun), the last epoch's
    checkpoint kept: one error line and exit code 143; --resume continues.
    """
    fields = _config_fields(dict(locals()))  # first: the command's parameters alone
    result = _train_stoppable(ctx, fields, out, resume, threads)
    if result is None:  # a process of torchrun other than rank 0: it prints nothing
        return
    if json_out:
        emit_json(result.summary())
        return
    typer.echo(result_line(result))


def _train_stoppable(ctx: typer.Context, fields: Dict[str, Any], out: Optional[Path], resume: bool,
                     threads: Optional[int]) -> Optional[TrainResult]:
    """Train ``fields`` (with ``resume``, the run in ``out``, whose settings it takes) with SIGTERM as a
    stop request (from the start of the process when it was started as ``structinit train``, whose
    entry point installed it before loading the command line): a stopped run ends as
    :func:`_stopped` says. The result as :func:`_train_with_progress` returns it."""
    from structinit.experiments.task import command_stopper
    from structinit.training.loop import TrainingStopped

    stopper = command_stopper(requeue_signal=False)
    try:
        if resume and out is not None:
            fields = _with_run_settings(ctx, fields, out)
        return _train_with_progress(fields, threads, stopper.event.is_set)
    except TrainingStopped as exc:
        raise _stopped(exc.epochs_done, out) from None
    finally:
        stopper.release()  # ignored from now on when this command is the process, else put back


def _stopped(epochs_done: int, out: Optional[Path]) -> typer.Exit:
    """The end of a run stopped by SIGTERM: one ``error:`` line (on rank 0) and exit code 143, the
    shell's code for a process ended by SIGTERM."""
    from structinit.cli.common import fail
    from structinit.training.distributed import launched_by_torchrun

    if launched_by_torchrun() and os.environ.get("RANK", "0") != "0":
        return typer.Exit(143)
    if out is not None and epochs_done:
        kept = (f"the checkpoint of epoch {epochs_done} is kept in {out}: the same command with --resume "
                "continues the run")
    else:
        kept = "no epoch had finished, so nothing of the run is kept"
    return fail(f"interrupted (SIGTERM); {kept}", 143)


def _train_with_progress(fields: Dict[str, Any], threads: Optional[int],
                         stop: Optional[Callable[[], bool]] = None) -> Optional[TrainResult]:
    """Run :func:`structinit.training.loop.train` on ``TrainConfig(**fields)`` with ``threads`` torch
    threads, behind a progress bar with the epoch lines and a long warm-up's warning logged above it;
    ``stop`` is its stop request. Returns its result on rank 0 (or without torchrun), ``None`` on the
    other ranks."""
    from structinit.errors import StructinitError
    from structinit.runtime import use_threads
    from structinit.training.config import TrainConfig, long_warmup
    from structinit.training.distributed import launched_by_torchrun
    from structinit.training.loop import TrainingStopped
    from structinit.training.loop import train as run_training

    config = TrainConfig(**fields)
    hp = config.validate()  # before torch is imported
    n_epochs = int(hp["epochs"])
    use_threads(threads)
    rank0 = not launched_by_torchrun() or os.environ.get("RANK", "0") == "0"
    alone = not launched_by_torchrun()
    too_long = long_warmup(hp) if rank0 else None
    with Progress("training", enabled=rank0, plain=False) as bar:
        def on_step(e: int, s: int, n: int) -> None:
            nonlocal too_long
            if too_long:  # said once training starts (a run refused before that gets its error line alone)
                bar.log("warning: " + StructinitError(too_long).render(lambda n: "--" + n.replace("_", "-")))
                too_long = None
            bar.update(s, n, f"epoch {e}/{n_epochs}")

        def on_init(done: int, total: int) -> None:
            # a stop ends a lone process's data fit at its next step; under torchrun every process
            # fits and only this one is told, so they stop together before the first epoch
            if alone and stop is not None and stop():
                raise TrainingStopped(0)
            bar.update(done, total, "init: data fit")

        result = run_training(config, on_step=on_step, on_epoch=lambda r: bar.log(_fmt(r, n_epochs)), log=bar.log,
                              on_init=on_init, stop=stop)
    return result if rank0 else None


def _config_fields(given: dict) -> dict:
    """``TrainConfig``'s settings from the command's parameters: the same names, but for the
    ``NAME=VALUE`` init parameters (parsed), ``compile_`` (``compile``) and paths (as text)."""
    from structinit.init.registry import parse_assignments

    fields = {k: v for k, v in given.items() if k not in ("ctx", "json_out", "init_param", "compile_")}
    fields.update(init_params=parse_assignments(given["init_param"]), compile=given["compile_"])
    for name in ("out", "data_dir"):
        fields[name] = str(fields[name]) if fields[name] is not None else None
    return fields


def result_line(result) -> str:
    """The one line that ends a run: the final accuracy first, the best epoch labelled as such."""
    best = (f"best epoch {result.best_epoch} ({result.best_acc:.2f}%, chosen on the {result.best_on} split)"
            if result.best_epoch else "no evaluated epoch")
    wrote = f"; wrote {result.out}" if result.out else ""
    return (f"final {result.final_acc:.2f}% after {result.epochs} epochs; {best}; {result.wall_seconds:.1f}s, "
            f"{result.params.get('trainable', 0):,} trainable params{wrote}")
