"""``structinit train``: a thin layer over :func:`structinit.training.train` (also under torchrun)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import typer

from ..app import app
from .common import cli_errors, emit_json, is_tty

EXAMPLE = """
Examples:

  structinit train --model vit-digits --dataset digits --init impulse --epochs 40 --out runs/digits-imp

  structinit train --model vit-t --dataset cifar10 --data-dir ~/data --init impulse --init-param filter=5 --out runs/c10

  structinit train --model convmixer-256 --kernel 8 --filters box --dataset cifar10 --data-dir ~/data --out runs/cm

  structinit train --out runs/c10 --resume ...same settings...        (continue a killed run)

  torchrun --nproc_per_node=4 -m structinit train --model vit-s --dataset cifar100 --data-dir ~/data --out runs/s
"""


def parse_init_params(items: List[str]) -> Dict[str, Any]:
    """``["filter=5", "share=true", "recipe=released"]`` -> ``{"filter": 5, "share": True, "recipe": "released"}``
    (values read as JSON where they parse, else as strings; ``-`` in names becomes ``_``)."""
    from ..errors import UsageError

    out: Dict[str, Any] = {}
    for item in items:
        name, sep, value = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or not name:
            raise UsageError(f"--init-param must look like NAME=VALUE, got {item!r}")
        text = value.strip()
        if text.lower() in ("none", "null"):
            out[name] = None
            continue
        if text.lower() in ("true", "false"):
            out[name] = text.lower() == "true"
            continue
        try:
            out[name] = json.loads(text)
        except ValueError:
            out[name] = text
    return out


def _fmt(record: Dict[str, Any], epochs: int) -> str:
    return (f"epoch {record['epoch']}/{epochs}  loss {record['train_loss']:.4f}  train {record['train_acc']:.2f}%  "
            f"test {record['test_acc']:.2f}%  lr {record['lr']:.2e}  {record['images_per_s']:.0f} img/s  "
            f"{record['epoch_seconds']:.1f}s")


@app.command(epilog=EXAMPLE)
@cli_errors
def train(
    model: str = typer.Option("vit-digits", "--model", "-m", help="Preset: vit-t, vit-t-h8, vit-s, vit-s-h16, vit-d8, vit-digits, vit-t-cls, vit-t-learned-pe, vit-t-cls-learned-pe, convit, convmixer-256, convmixer-512."),
    dataset: str = typer.Option("digits", "--dataset", "-d", help="digits | synthetic | cifar10 | cifar100 | svhn | imagefolder."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Run directory (config.json, metrics.jsonl, checkpoint.pt, best.pt, final.json)."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in --out from its last checkpoint (start it if there is none)."),
    init: Optional[str] = typer.Option(None, "--init", help="ViT init method: kaiming | trunc-normal | mimetic | impulse (default: timm's own)."),
    init_param: List[str] = typer.Option([], "--init-param", "-p", help="Init parameter NAME=VALUE (repeatable), e.g. filter=5, target_mass=0.3, mimetic_vproj=true."),
    data_dir: Optional[Path] = typer.Option(None, "--data-dir", help="Dataset folder (torchvision files; imagefolder: train/ and val/). Default $STRUCTINIT_DATA or ./data."),
    download: bool = typer.Option(False, "--download", help="Download cifar10/cifar100/svhn into --data-dir first (needs network)."),
    image_size: Optional[int] = typer.Option(None, "--image-size", help="imagefolder: image side (default 224)."),
    dim: Optional[int] = typer.Option(None, "--dim", help="Override the preset's embedding dim."),
    heads: Optional[int] = typer.Option(None, "--heads", help="Override the preset's heads."),
    depth: Optional[int] = typer.Option(None, "--depth", help="Override the preset's depth."),
    patch: Optional[int] = typer.Option(None, "--patch", help="Patch size (default: 1 digits, 2 on 32x32, 16 imagefolder)."),
    mlp_ratio: Optional[float] = typer.Option(None, "--mlp-ratio", help="Override the preset's MLP ratio."),
    pool: Optional[str] = typer.Option(None, "--pool", help="ViT pooling: avg | token (class token)."),
    pos_embed: Optional[str] = typer.Option(None, "--pos-embed", help="ViT position embedding: sincos (fixed) | learned."),
    kernel: Optional[int] = typer.Option(None, "--kernel", help="ConvMixer depthwise kernel size (3, 5, 8...)."),
    filters: str = typer.Option("trained", "--filters", help="ConvMixer depthwise filters: trained | random | impulse | box (frozen)."),
    drop_path: float = typer.Option(0.0, "--drop-path", help="Stochastic depth rate."),
    epochs: Optional[int] = typer.Option(None, "--epochs", "-e", help="Epochs (default 200; digits 40; ConvMixer 100)."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", "-b", help="Global batch size (default 512; digits 64)."),
    lr: Optional[float] = typer.Option(None, "--lr", help="Peak learning rate (default 1e-3; ConvMixer 1e-2)."),
    min_lr: Optional[float] = typer.Option(None, "--min-lr", help="Cosine floor (default 1e-6)."),
    weight_decay: Optional[float] = typer.Option(None, "--weight-decay", help="AdamW weight decay (default 0.01)."),
    warmup_epochs: Optional[float] = typer.Option(None, "--warmup-epochs", help="Linear warm-up epochs (default 10; digits 4)."),
    opt_eps: Optional[float] = typer.Option(None, "--opt-eps", help="AdamW eps (default 1e-3)."),
    grad_clip: Optional[float] = typer.Option(None, "--grad-clip", help="Gradient norm clip, 0 for none (default 3.0)."),
    label_smoothing: Optional[float] = typer.Option(None, "--label-smoothing", help="Label smoothing (default 0)."),
    augment: Optional[str] = typer.Option(None, "--augment", help="randaugment | crop-flip | flip | none (default: randaugment on image sets, none on digits)."),
    randaug_n: Optional[int] = typer.Option(None, "--randaug-n", help="RandAugment ops per image (default 2)."),
    randaug_m: Optional[int] = typer.Option(None, "--randaug-m", help="RandAugment magnitude (default 9)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the init, data order and augmentation."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda | cuda:N (under torchrun: cuda:LOCAL_RANK)."),
    amp: str = typer.Option("auto", "--amp", help="Mixed precision: auto (bf16/fp16 on GPU, off on CPU) | bf16 | fp16 | off."),
    compile_: bool = typer.Option(False, "--compile", help="torch.compile the model (slow to start; for long GPU runs)."),
    workers: int = typer.Option(4, "--workers", help="DataLoader workers (imagefolder only)."),
    threads: Optional[int] = typer.Option(None, "--threads", help="CPU threads per process (default: torch's; torchrun sets 1)."),
    json_out: bool = typer.Option(False, "--json", help="Print the final summary as JSON on stdout."),
):
    """Train a model of the paper's comparison with the paper's recipe (SPEC 5).

    Writes into --out: config.json, metrics.jsonl (one line per epoch), checkpoint.pt (every
    epoch, atomically), best.pt and final.json. Runs unchanged under torchrun (DDP; NCCL on GPUs,
    gloo on CPU); only rank 0 writes and prints. A progress bar on a terminal, plain lines otherwise.
    """
    from ..distributed import launched_by_torchrun
    from ..training import TrainConfig, train as run_training

    config = TrainConfig(
        model=model, dataset=dataset, out=str(out) if out is not None else None, resume=resume, dim=dim, heads=heads,
        depth=depth, patch=patch, mlp_ratio=mlp_ratio, pool=pool, pos_embed=pos_embed, kernel=kernel, filters=filters,
        drop_path=drop_path, init=init, init_params=parse_init_params(init_param),
        data_dir=str(data_dir) if data_dir is not None else None, download=download, image_size=image_size,
        augment=augment, epochs=epochs, batch_size=batch_size, lr=lr, min_lr=min_lr, weight_decay=weight_decay,
        warmup_epochs=warmup_epochs, opt_eps=opt_eps, grad_clip=grad_clip, label_smoothing=label_smoothing,
        randaug_n=randaug_n, randaug_m=randaug_m, seed=seed, device=device, amp=amp, compile=compile_,
        workers=workers, threads=threads)
    recipe = config.validate()  # before torch is imported
    n_epochs = int(recipe["epochs"])
    rank0 = not launched_by_torchrun() or _env_rank() == 0

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if is_tty() and rank0:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                      TimeElapsedColumn(), TimeRemainingColumn(), transient=True) as bar:
            task = bar.add_task("training", total=None)

            def on_step(epoch: int, step: int, steps: int) -> None:
                bar.update(task, description=f"epoch {epoch}/{n_epochs}", completed=step, total=steps)

            def say(msg: str) -> None:
                bar.console.print(msg, markup=False, highlight=False)

            def on_epoch(record: Dict[str, Any]) -> None:
                say(_fmt(record, n_epochs))

            result = run_training(config, on_step=on_step, on_epoch=on_epoch, log=say)
    else:
        result = run_training(config, on_epoch=lambda r: log(_fmt(r, n_epochs)), log=log)
    if not rank0:
        return
    summary = result.summary()
    if json_out:
        emit_json(summary)
    else:
        typer.echo(f"best {result.best_acc:.2f}% (epoch {result.best_epoch}), last {result.last_acc:.2f}%, "
                   f"{result.epochs} epochs in {result.wall_seconds:.1f}s, {result.params.get('trainable', 0):,} "
                   f"trainable params" + (f"; wrote {result.out}" if result.out else ""))


def _env_rank() -> int:
    import os

    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0
