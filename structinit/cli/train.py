"""``structinit train``: a thin layer over :func:`structinit.training.loop.train` (also under torchrun)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, List, Optional

import typer
from typing_extensions import Annotated

from structinit.cli.common import Device, JsonOut, Out, Progress, Threads, emit_json, examples, path_arg

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

Opt = typer.Option


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


def train(
    ctx: typer.Context,
    model: Annotated[str, Opt("--model", help="Preset: vit-t, vit-t-h8, vit-s, vit-s-h16, vit-d8, vit-digits, "
                              "vit-t-cls, vit-t-learned-pe, vit-t-cls-learned-pe, convit, convmixer-256, "
                              "convmixer-512; for sequences transformer-1d or cnn-1d.")] = "vit-digits",
    dataset: Annotated[str, Opt("--dataset", help="digits, synthetic, cifar10, cifar100, svhn or "
                                "imagefolder; mnist1d (sequences).")] = "digits",
    shuffle_seq: Annotated[bool, Opt("--shuffle-seq", help="mnist1d: permute the positions of every sequence the "
                                     "same way (the check that a gain comes from locality).")] = False,
    out: Out = None,
    resume: Annotated[bool, Opt("--resume", help="Continue the run in --out from its last checkpoint (start it if "
                                "there is none).")] = False,
    init: Annotated[Optional[str], Opt("--init", help="Attention init method (ViTs, transformer-1d): kaiming, "
                                       "trunc-normal, mimetic, impulse, or the authors' exact impulse-2024 / "
                                       "impulse-2025.",
                                       show_default="timm's own")] = None,
    init_param: Annotated[List[str], Opt("--init-param", "-p", help="Init parameter NAME=VALUE (repeatable), e.g. "
                                         "filter=5, target_mass=0.3, mimetic_vproj=true.")] = [],  # noqa: B006
    data_dir: Annotated[Optional[Path], Opt("--data-dir", help="Dataset folder (torchvision's files; imagefolder: "
                                            "train/ and val/).", show_default="$STRUCTINIT_DATA, else ./data",
                                            parser=path_arg, metavar="DIR")] = None,
    download: Annotated[bool, Opt("--download", help="Download cifar10/cifar100/svhn into --data-dir first (needs "
                                  "network).")] = False,
    image_size: Annotated[Optional[int], Opt("--image-size", help="imagefolder: image side.",
                                             show_default="224")] = None,
    train_size: Annotated[Optional[int], Opt("--train-size", help="Train on a stratified subset of this many images "
                                             "(drawn with --data-seed).", show_default="all")] = None,
    val_size: Annotated[int, Opt("--val-size", help="Hold out this many training images as a validation split "
                                 "(stratified, the same for every seed).")] = 0,
    data_seed: Annotated[Optional[int], Opt("--data-seed", help="Seed of the training subset.",
                                            show_default="--seed")] = None,
    dim: Annotated[Optional[int], Opt("--dim", help="Override the preset's embedding dim.")] = None,
    heads: Annotated[Optional[int], Opt("--heads", help="Override the preset's heads.")] = None,
    depth: Annotated[Optional[int], Opt("--depth", help="Override the preset's depth.")] = None,
    patch: Annotated[Optional[int], Opt("--patch", help="Patch size.", show_default="1 digits, 2 on 32x32, "
                                        "16 imagefolder")] = None,
    mlp_ratio: Annotated[Optional[float], Opt("--mlp-ratio", help="Override the preset's MLP ratio.")] = None,
    pool: Annotated[Optional[str], Opt("--pool", help="ViT pooling: avg or token (class token).")] = None,
    pos_embed: Annotated[Optional[str], Opt("--pos-embed", help="ViT position embedding: sincos (fixed) or "
                                            "learned.")] = None,
    kernel: Annotated[Optional[int], Opt("--kernel", help="ConvMixer depthwise kernel size; cnn-1d kernel "
                                         "size.")] = None,
    window: Annotated[Optional[int], Opt("--window", help="transformer-1d: values each token embeds (odd; 1: one "
                                         "value per position).", show_default="1")] = None,
    filters: Annotated[str, Opt("--filters", help="ConvMixer depthwise filters: trained, or frozen random, impulse "
                                "or box.")] = "trained",
    drop_path: Annotated[float, Opt("--drop-path", help="Stochastic depth rate.")] = 0.0,
    epochs: Annotated[Optional[int], Opt("--epochs", "-e", help="Epochs.", show_default="200; digits 40; "
                                         "ConvMixer 100")] = None,
    batch_size: Annotated[Optional[int], Opt("--batch-size", "-b", help="Global batch size.",
                                             show_default="512; digits 64")] = None,
    lr: Annotated[Optional[float], Opt("--lr", help="Peak learning rate.", show_default="1e-3; ConvMixer 1e-2")] = None,
    min_lr: Annotated[Optional[float], Opt("--min-lr", help="Cosine floor.", show_default="1e-6")] = None,
    weight_decay: Annotated[Optional[float], Opt("--weight-decay", help="AdamW weight decay.",
                                                 show_default="0.01")] = None,
    warmup_epochs: Annotated[Optional[float], Opt("--warmup-epochs", help="Linear warm-up epochs.",
                                                  show_default="10; digits 2")] = None,
    opt_eps: Annotated[Optional[float], Opt("--opt-eps", help="AdamW eps.", show_default="1e-3; digits 1e-8")] = None,
    grad_clip: Annotated[Optional[float], Opt("--grad-clip", help="Gradient norm clip, 0 for none.",
                                              show_default="3.0")] = None,
    label_smoothing: Annotated[Optional[float], Opt("--label-smoothing", help="Label smoothing.",
                                                    show_default="0")] = None,
    augment: Annotated[Optional[str], Opt("--augment", help="randaugment, crop-flip, flip or none.",
                                          show_default="randaugment; none on digits")] = None,
    randaug_n: Annotated[Optional[int], Opt("--randaug-n", help="RandAugment ops per image.", show_default="2")] = None,
    randaug_m: Annotated[Optional[int], Opt("--randaug-m", help="RandAugment magnitude.", show_default="9")] = None,
    eval_every: Annotated[Optional[int], Opt("--eval-every", help="Epochs between evaluations (the last epoch is "
                                             "always evaluated).", show_default="epochs // 50, at least 1")] = None,
    seed: Annotated[int, Opt("--seed", min=0, help="Seed of the init, data order and augmentation.")] = 0,
    device: Device = "auto",
    amp: Annotated[str, Opt("--amp", help="Mixed precision: auto (bf16/fp16 on GPU, off on CPU), bf16, fp16 or "
                            "off.")] = "auto",
    compile_: Annotated[bool, Opt("--compile", help="torch.compile the model (slow to start; for long GPU "
                                  "runs).")] = False,
    workers: Annotated[int, Opt("--workers", help="DataLoader workers (imagefolder only).")] = 4,
    threads: Threads = None,
    json_out: JsonOut = False,
):
    """Train a model of the paper's comparison with the paper's recipe.

    Writes into --out: config.json, metrics.jsonl (one line per epoch; an impulse init's attention
    on real training inputs as epoch 0), checkpoint.pt (every
    epoch, atomically), best.pt and final.json. The headline is the final epoch's test accuracy;
    the best epoch is chosen on --val-size's validation split when there is one. Runs unchanged
    under torchrun (DDP; NCCL on GPUs, gloo on CPU); only rank 0 writes and prints.
    """
    from structinit.errors import StructinitError
    from structinit.init.registry import parse_assignments
    from structinit.runtime import use_threads
    from structinit.training.config import TrainConfig, long_warmup
    from structinit.training.distributed import launched_by_torchrun
    from structinit.training.loop import train as run_training

    fields = dict(
        model=model, dataset=dataset, out=str(out) if out is not None else None, resume=resume, dim=dim, heads=heads,
        depth=depth, patch=patch, mlp_ratio=mlp_ratio, pool=pool, pos_embed=pos_embed, kernel=kernel, filters=filters,
        drop_path=drop_path, window=window, shuffle_seq=shuffle_seq, init=init,
        init_params=parse_assignments(init_param),
        data_dir=str(data_dir) if data_dir is not None else None, download=download, image_size=image_size,
        augment=augment, train_size=train_size, val_size=val_size, data_seed=data_seed, epochs=epochs,
        batch_size=batch_size, lr=lr, min_lr=min_lr, weight_decay=weight_decay, warmup_epochs=warmup_epochs,
        opt_eps=opt_eps, grad_clip=grad_clip, label_smoothing=label_smoothing, randaug_n=randaug_n,
        randaug_m=randaug_m, eval_every=eval_every, seed=seed, device=device, amp=amp, compile=compile_,
        workers=workers, threads=threads)
    if resume and out is not None:
        fields = _with_run_settings(ctx, fields, out)
    config = TrainConfig(**fields)
    hp = config.validate()  # before torch is imported
    n_epochs = int(hp["epochs"])
    use_threads(threads)
    rank0 = not launched_by_torchrun() or os.environ.get("RANK", "0") == "0"
    too_long = long_warmup(hp) if rank0 else None
    with Progress("training", enabled=rank0, plain=False) as bar:
        def on_step(e: int, s: int, n: int) -> None:
            nonlocal too_long
            if too_long:  # said once training starts (a run refused before that gets its error line alone)
                bar.log("warning: " + StructinitError(too_long).render(lambda n: "--" + n.replace("_", "-")))
                too_long = None
            bar.update(s, n, f"epoch {e}/{n_epochs}")

        result = run_training(config, on_step=on_step, on_epoch=lambda r: bar.log(_fmt(r, n_epochs)), log=bar.log,
                              on_init=lambda d, n: bar.update(d, n, "init: data fit"))
    if not rank0:
        return
    if json_out:
        emit_json(result.summary())
        return
    best = (f"best epoch {result.best_epoch} ({result.best_acc:.2f}%, chosen on the {result.best_on} split)"
            if result.best_epoch else "no evaluated epoch")
    wrote = f"; wrote {result.out}" if result.out else ""
    typer.echo(f"final {result.final_acc:.2f}% after {result.epochs} epochs; {best}; {result.wall_seconds:.1f}s, "
               f"{result.params.get('trainable', 0):,} trainable params{wrote}")
