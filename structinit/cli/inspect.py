"""``structinit inspect``: what an artifact (or a checkpoint) holds; no argument lists the cache;
with ``--data``, a model's attention on real inputs (a train run, its checkpoint, or a preset)."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional

import typer
from typing_extensions import Annotated

from structinit.cli.common import (
    PARAMS_LISTED,
    CacheDir,
    Force,
    GridOpt,
    JsonOut,
    Threads,
    data_dir_option,
    emit_json,
    examples,
    init_methods,
    option,
    seed_option,
    shown,
)
from structinit.solver.recipes import DEFAULT_FILTER
from structinit.training.config import FIDELITY_SAMPLES, TrainConfig

EXAMPLES = examples(
    'structinit inspect                                     # list the cache',
    'structinit inspect 6095a9c75beb --layer 2 --head 1 --query 27',
    'structinit inspect 6095a9c75beb --png attention.png',
    'structinit inspect vit.pth --heads 3                   # a checkpoint: layout and attention quality',
    'structinit inspect vit-digits --init impulse --data digits --png fidelity.png   # attention on real images',
    'structinit inspect vit-digits --init impulse -p filter=5 --data digits --samples 64 --per-head',
    'structinit inspect runs/digits-imp --data digits       # a train run at init (its checkpoint.pt: that epoch)',
)

#: Library parameter names that inspect spells with another flag.
ALIASES = {"dataset": "--data", "init_params": "--init-param", "filter": "--filter", "model_name": "--model"}


def _is_artifact_file(path: Path) -> bool:
    if path.suffix != ".safetensors":
        return False
    from structinit.atomic import regular_file

    try:
        regular_file(path)  # a FIFO would block safe_open: read_artifact says what it is instead
    except OSError:
        return True
    try:
        from safetensors import safe_open

        with safe_open(str(path), "np") as fh:
            return (fh.metadata() or {}).get("format", "").startswith("structinit/")
    except Exception:  # noqa: BLE001 - unreadable: read_artifact reports what is wrong with it
        return True


# --------------------------------------------------------------------------- options

TargetOpt = Annotated[Optional[str], typer.Argument(help="Artifact path or key, a checkpoint file or a Hugging "
    "Face folder (as apply takes them); omit to list the cache. With --data: a train run folder, its checkpoint.pt "
    "or best.pt, or a model preset.")]

LayerOpt = Annotated[Optional[int], option("--layer", help="Artifact: layer whose attention is drawn.",
    show_default="0")]

HeadOpt = Annotated[Optional[int], option("--head", help="Artifact: head whose attention is drawn in the "
    "terminal.", show_default="0")]

QueryOpt = Annotated[Optional[int], option("--query", help="Artifact, --data: query token drawn.",
    show_default="the grid centre")]

PngOpt = Annotated[Optional[str], option("--png", help="Artifact: write the layer's attention (all heads) as a "
    "PNG figure; --data: the first, middle and last layer's (an "
    "existing file only with --force).")]

HeadsOpt = Annotated[Optional[int], option("--heads", help="Checkpoint: heads, when the checkpoint does not "
    "say.")]

ModelNameOpt = Annotated[Optional[str], option("--model", help="Checkpoint: the timm model it holds, to measure "
    "the model's attention on noise inputs as apply does, e.g. vit_tiny_patch16_224 (else timm's arch in the file, "
    "else a ViT of the tensors' shape).")]

ConfigOpt = Annotated[Optional[Path], option("--config", help="Checkpoint: its Hugging Face config.json (default: "
    "the one beside it).")]

DataOpt = Annotated[Optional[str], option(
    "--data", metavar="DATASET", help="Measure a model's attention on the first training inputs of this "
    "dataset (digits, synthetic, mnist1d; cifar10, cifar100, svhn with --data-dir): per layer and head, the "
    "hit rate and mass on the solved offset and the share inside the f x f window. TARGET is then a train run "
    "folder (the model at init), its checkpoint.pt or best.pt (that epoch's weights), or a model preset with "
    "--init. --png draws the first, middle and last layer.")]

SamplesOpt = Annotated[Optional[int], option("--samples", min=1, help="--data: how many training inputs.",
    show_default=shown(FIDELITY_SAMPLES))]

InitOpt = Annotated[Optional[str], option("--init", help="--data with a preset: attention init method "
    f"({init_methods()}).",
    show_default="the model's own")]

InitParamOpt = Annotated[List[str], option("--init-param", help="--data with a preset: a parameter "
    f"of the --init, NAME=VALUE (repeatable), as in train; {PARAMS_LISTED}.")]

SeedOpt = Annotated[Optional[int], seed_option("the model and its init, as in train", "--data with a preset: ",
    show_default=str(TrainConfig().seed))]

DataDirOpt = Annotated[Optional[Path], data_dir_option("--data: ", first="a run's own, else ")]

FilterOpt = Annotated[Optional[int], option("--filter", min=1, help="--data: the window f whose "
    "attention share is measured.",
    show_default=f"the solved filter, else {DEFAULT_FILTER}")]

PerHeadOpt = Annotated[bool, option("--per-head", help="--data: one table row per layer and head.")]


def inspect(
    target: TargetOpt = None,
    layer: LayerOpt = None,
    head: HeadOpt = None,
    query: QueryOpt = None,
    png: PngOpt = None,
    force: Force = False,
    heads: HeadsOpt = None,
    grid: GridOpt = None,
    model_name: ModelNameOpt = None,
    config: ConfigOpt = None,
    data: DataOpt = None,
    samples: SamplesOpt = None,
    init: InitOpt = None,
    init_param: InitParamOpt = [],  # noqa: B006
    seed: SeedOpt = None,
    data_dir: DataDirOpt = None,
    filter_: FilterOpt = None,
    per_head: PerHeadOpt = False,
    cache_dir: CacheDir = None,
    threads: Threads = None,
    json_out: JsonOut = False,
):
    """Show an artifact's config, quality and attention, a checkpoint's layout and attention
    quality (on its position embedding alone, and through its model on noise inputs as apply
    measures it), or (no argument) list the cache. With --data: a model's attention on real inputs."""
    from structinit.errors import UsageError
    from structinit.runtime import use_threads
    from structinit.solver.cache import check_cache_dir

    use_threads(threads)
    check_cache_dir(cache_dir)
    if cache_dir is not None and not cache_dir.expanduser().is_dir():
        raise UsageError(f"--cache-dir {cache_dir} does not exist")
    data_only = {"--samples": samples, "--init": init, "--init-param": init_param or None, "--seed": seed,
                 "--data-dir": data_dir, "--filter": filter_, "--per-head": per_head or None}
    if data is not None:
        given = [f for f, v in {"--layer": layer, "--head": head, "--heads": heads, "--grid": grid,
                                "--model": model_name, "--config": config}.items() if v is not None]
        if given:
            raise UsageError(f"{', '.join(given)} do(es) not apply with --data (it measures every layer and head; "
                             "--query picks the token drawn)")
        if target is None:
            raise UsageError("--data needs a TARGET: a train run folder, its checkpoint.pt or best.pt, or a model "
                             "preset (with --init)")
        return _show_data(target, data, samples or FIDELITY_SAMPLES, init, init_param, seed, data_dir, filter_,
                          per_head, query, png, force, cache_dir, json_out)
    given = [f for f, v in data_only.items() if v is not None]
    if given:
        raise UsageError(f"{', '.join(given)} need(s) --data DATASET (they set up the measure on real inputs)")
    artifact_only = {"--layer": layer, "--head": head, "--query": query, "--png": png, "--force": force or None}
    checkpoint_only = {"--heads": heads, "--grid": grid, "--model": model_name, "--config": config}
    if target is None:
        given = [f for f, v in {**artifact_only, **checkpoint_only}.items() if v is not None]
        if given:
            raise UsageError(f"{', '.join(given)} need(s) an artifact or checkpoint to inspect; listing the cache "
                             "takes none")
        return _list(cache_dir, json_out)
    path = _target_path(target, cache_dir)
    if path.is_file() and _is_artifact_file(path):
        given = [f for f, v in checkpoint_only.items() if v is not None]
        if given:
            raise UsageError(f"{', '.join(given)} apply to a checkpoint; {path.name} is an artifact (its shape is "
                             "in its config)")
        return _show_artifact(path, layer or 0, head or 0, query, png, force, json_out)
    given = [f for f, v in artifact_only.items() if v is not None]
    if given:
        raise UsageError(f"{', '.join(given)} apply to an artifact; {path.name} is a checkpoint (inspect shows its "
                         "layout and per-layer quality; draw an artifact's attention instead)")
    return _show_checkpoint(path, heads, grid, model_name, config, json_out)


def _target_path(target: str, cache_dir) -> Path:
    """What ``target`` names: a file, a cached artifact's key, or a Hugging Face model's folder."""
    from structinit.apply.files import HF_CONFIG, HF_WEIGHTS
    from structinit.errors import UsageError
    from structinit.solver.cache import resolve_key

    path = Path(target).expanduser()
    if not path.exists():
        found = resolve_key(target, cache_dir)
        if found is None:
            raise UsageError(f"{target}: no such file, and no cached artifact has that key (run `structinit "
                             "inspect` to list them)")
        path = found
    hf = (path / HF_CONFIG).exists() and any((path / name).exists() for name in HF_WEIGHTS)
    if path.is_dir() and not hf:
        raise UsageError(f"{path} is a folder and not a Hugging Face model's (config.json and its weights); give an "
                         "artifact or checkpoint file (a train run folder is measured on real inputs with --data "
                         "DATASET)")
    return path


def _list(cache_dir, json_out: bool) -> None:
    from structinit.errors import ArtifactError
    from structinit.solver.artifact import read_artifact
    from structinit.solver.cache import list_artifacts, user_cache_dir

    entries = []
    for path in list_artifacts(cache_dir):
        try:
            art = read_artifact(path)
            s = art.stats.get("summary", {})
            what = art.config.describe() + (f", fitted to {art.fit.get('source') or 'real inputs'}" if art.fit else "")
            entries.append({"path": str(path), "key": art.key, "config": what, "fitted": bool(art.fit),
                            "hit_rate": s.get("hit_rate"), "target_mass": s.get("target_mass"), "ok": True})
        except ArtifactError as exc:
            entries.append({"path": str(path), "ok": False, "error": str(exc)})
    if json_out:
        emit_json({"cache_dir": str(user_cache_dir(cache_dir)), "artifacts": entries})
        return
    typer.echo(f"user cache: {user_cache_dir(cache_dir)} (then the shipped artifacts)")
    if not entries:
        typer.echo("no artifacts yet; make one with: structinit solve --tokens 256 --dim 192 --heads 3")
    for e in entries:
        if e["ok"]:
            typer.echo(f"{e['key']}  {e['config']}  hit {e['hit_rate']:.3f}  mass {e['target_mass']:.3f}  {e['path']}")
        else:
            typer.echo(f"{'CORRUPT':<12}  {e['error']}")


def _show_artifact(path: Path, layer: int, head: int, query: Optional[int], png: Optional[str], force: bool,
                   json_out: bool) -> None:
    from structinit.analysis.text import quality_table, query_attention_text
    from structinit.errors import UsageError
    from structinit.solver.artifact import read_artifact

    art = read_artifact(path)
    cfg = art.config
    if not 0 <= layer < art.depth:
        raise UsageError(f"--layer {layer} is out of range: the artifact has {art.depth} layer(s)")
    if not 0 <= head < cfg.heads:
        raise UsageError(f"--head {head} is out of range: the artifact has {cfg.heads} head(s)")
    gh, gw = cfg.grid.hw
    if query is None:
        query = (gh // 2) * gw + gw // 2
    if not 0 <= query < cfg.tokens:
        raise UsageError(f"--query {query} is out of range: the grid has {cfg.tokens} tokens")
    if png is not None:
        from structinit.analysis.figures import attention_figure, check_output, save_png
        from structinit.analysis.quality import artifact_attention

        target = check_output(png, force)
        png = str(target)
        title = f"structinit artifact {art.key}: layer {layer} of {art.depth}, {cfg.describe()}"
        if art.fit:
            title += ", fitted Q/K on the pseudo input"
        save_png(attention_figure(artifact_attention(art, layer), cfg.grid, query, art.offsets[layer], title,
                                  cfg.padding), target, force=force)
    if json_out:
        emit_json({"path": str(path), "key": art.key, "config": cfg.to_dict(), "version": art.version,
                   "offsets": art.offsets.tolist(), "stats": art.stats, "fit": art.fit,
                   "png": str(png) if png else None})
        return
    typer.echo(f"artifact  {path}")
    made = "fitted" if art.fit else "solved"
    typer.echo(f"key       {art.key}   (structinit {art.version}, {made} in {art.stats.get('seconds', 0):.3f} s on "
               f"{art.stats.get('device', '?')})")
    typer.echo(f"config    {cfg.canonical_json()}")
    if art.fit:
        from structinit.errors import StructinitWarning
        from structinit.fit.advice import fitted_structure_warning

        typer.echo(fit_text(art.fit))
        weak = fitted_structure_warning(art.fit, cfg.grid, cfg.dim)
        if weak:  # its remedies are settings of the init: written as `structinit apply` takes them
            from structinit.cli.apply import ALIASES, apply
            from structinit.cli.common import CommandSyntax, declared_flags

            syntax = CommandSyntax(declared_flags(apply), ALIASES)
            typer.echo("warning: impulse: " + StructinitWarning(weak).render(syntax), err=True)
        typer.echo("quality of the fitted Q/K on the pseudo input (what the solve was made for):")
    typer.echo(quality_table(art.quality, art.offsets))
    typer.echo("")
    typer.echo(query_attention_text(art, layer, head, query))
    if png is not None:
        typer.echo(f"wrote {png}")


def fit_text(fit: dict) -> str:
    """Terminal lines saying what a fitted artifact was fitted to and what it measured on that batch."""
    ident, rep = fit.get("identity", {}), fit.get("report", {})
    f = ident.get("fit", {})
    noise = ident.get("inputs") if isinstance(ident.get("inputs"), dict) else None
    if noise is not None:  # noise inputs are named by their kind, seed, count and shape, not a digest
        inputs = (f"fitted to {noise.get('samples')} Gaussian noise inputs N(0, 1) of shape {noise.get('shape')}, "
                  f"drawn with seed {noise.get('seed')} (no data)")
    else:
        inputs = (f"fitted to {fit.get('source') or 'a batch of real inputs'} ({ident.get('samples')} inputs, "
                  f"{str(ident.get('batch', '?'))[:19]}...)")
    lines = [inputs,
             f"  from the plain solve {ident.get('plain')}, layers {ident.get('layers')} of {ident.get('depth')}, "
             f"seed {ident.get('seed')}, through model weights {ident.get('weights', '?')[:19]}...",
             f"  data fit version {f.get('data_fit_version')}: {f.get('data_fit')} steps, calibrated to target mass "
             f"{f.get('calibrated_to')}"]
    for row in rep.get("layers", []):
        window = f"  window {row['window_mass']:.3f}" if "window_mass" in row else ""
        lines.append(f"  layer {row['layer']:>3} on the batch: hit rate {row['hit_rate']:.3f}  target mass "
                     f"{row['target_mass']:.3f}{window}")
    return "\n".join(lines)


def _show_checkpoint(path: Path, heads: Optional[int], grid: Optional[str], model_name: Optional[str],
                     config: Optional[Path], json_out: bool) -> None:
    from structinit.analysis.text import checkpoint_report
    from structinit.apply.measure import inspect_checkpoint
    from structinit.geometry.grid import parse_grid

    desc = inspect_checkpoint(path, heads=heads, grid=parse_grid(grid=grid) if grid is not None else None,
                              model_name=model_name, config=str(config) if config is not None else None)
    if json_out:
        emit_json(desc)
    else:
        typer.echo(checkpoint_report(desc))


def _data_model(target: str, dataset: str, init, init_param, seed, data_dir, cache_dir):
    """The model ``inspect --data`` measures (see :mod:`structinit.training.run_models`)."""
    from structinit.errors import UsageError
    from structinit.solver.cache import resolve_key
    from structinit.training.datasets import dataset_info
    from structinit.training.models import PRESETS
    from structinit.training.run_models import preset_model, run_model

    dataset_info(dataset)  # an unknown dataset is named before anything is built
    path = Path(target).expanduser()
    if path.exists():
        if path.is_file() and _is_artifact_file(path):
            raise UsageError(f"--data measures a model on real inputs; {path.name} is an artifact (inspect it "
                             "without --data to see its attention on the pseudo input)")
        own = {"--init": init, "--init-param": init_param or None, "--seed": seed}
        given = [f for f, v in own.items() if v is not None]
        if given:
            raise UsageError(f"{', '.join(given)} apply to a model preset; {path} is a train run, measured with its "
                             "own init and seed")
        inspected = run_model(path, data_dir=data_dir, cache_dir=cache_dir)
        if inspected.config.dataset != dataset:
            raise UsageError(f"{path} was trained on {inspected.config.dataset}; --data {dataset} would feed it "
                             f"other inputs (give --data {inspected.config.dataset})")
        return inspected
    if target in PRESETS:
        from structinit.init.registry import parse_assignments
        from structinit.training.config import TrainConfig

        if init is None and init_param:
            raise UsageError("--init-param needs --init")
        seeded: Dict[str, int] = {"seed": seed} if seed is not None else {}  # else TrainConfig's own
        config = TrainConfig(model=target, dataset=dataset, init=init, init_params=parse_assignments(init_param),
                             data_dir=str(data_dir) if data_dir is not None else None, **seeded)
        return preset_model(config, cache_dir=cache_dir)
    if resolve_key(target, cache_dir) is not None:
        raise UsageError(f"--data measures a model on real inputs; {target} is an artifact key (inspect it without "
                         "--data to see its attention on the pseudo input)")
    raise UsageError(f"{target}: no such file or folder, and not a model preset (choose a train run folder, its "
                     f"checkpoint.pt or best.pt, or one of {', '.join(PRESETS)})")


def _show_data(target: str, dataset: str, samples: int, init, init_param, seed, data_dir, filter_, per_head: bool,
               query, png, force: bool, cache_dir, json_out: bool) -> None:
    from structinit.analysis.fidelity import centre_query, init_fidelity, report_settings
    from structinit.analysis.text import fidelity_table
    from structinit.errors import UsageError
    from structinit.training.run_models import training_images

    target_png = None
    if png is not None:
        from structinit.analysis.figures import check_output

        target_png = check_output(png, force)  # before the work, so a bad name costs nothing
    inspected = _data_model(target, dataset, init, init_param, seed, data_dir, cache_dir)
    config, info = inspected.config, inspected.info
    images = training_images(config, samples)
    fid = init_fidelity(inspected.model, images, inspected.report, filter=filter_)
    if query is None:
        query = centre_query(fid.grid)
    if not 0 <= query < fid.grid.tokens:
        raise UsageError(f"--query {query} is out of range: the grid has {fid.grid.tokens} tokens")
    settings = report_settings(inspected.report)
    method = f"init {settings['method']}" if settings["method"] else "the model's own init"
    where = (f"at init, rebuilt from {inspected.config_path}" if inspected.source == "init" and inspected.config_path
             else "at init" if inspected.source == "init" else f"{target} after epoch {inspected.epoch}")
    recorded = inspected.recorded if fid.images == _recorded_samples(inspected.recorded) else None
    if target_png is not None:
        from structinit.analysis.figures import fidelity_figure, save_png

        title = f"{config.model.name}, {method}, on {dataset} ({where})"
        save_png(fidelity_figure(fid, query=query, title=title), target_png, force=force)
    kind = "sequences" if info.is_sequence else "images"
    if json_out:
        emit_json({"target": target, "source": inspected.source, "epoch": inspected.epoch,
                   "config_path": inspected.config_path, "model": config.model.name, "dataset": dataset,
                   "init": {"method": settings["method"], "filter": settings["filter"], "padding": settings["padding"]},
                   "config": config.to_dict(), "samples": fid.images, "query": query,
                   "fidelity": fid.to_dict(), "query_maps": fid.query_maps(query).round(6),
                   "recorded": inspected.recorded, "png": str(target_png) if target_png else None})
        return
    solved = (f" (filter {settings['filter']}, padding {settings['padding']})" if settings["filter"] else "")
    grid = (f"a sequence of {fid.grid.tokens} tokens" if fid.grid.ndim == 1 else f"the {fid.grid.describe()} grid")
    typer.echo(f"model     {config.model.name}: {fid.layers} layers x {fid.heads} heads on {grid}, {method}{solved}; "
               f"{where}")
    typer.echo(f"inputs    the first {fid.images} training {kind} of {dataset}, as the model sees them"
               + ("" if info.is_sequence else " (normalized)"))
    typer.echo(fidelity_table(fid, per_head=per_head, recorded=recorded))
    window = f"{fid.filter} positions" if fid.grid.ndim == 1 else f"{fid.filter}x{fid.filter} window"
    if fid.hit_rate is None:
        typer.echo(f"{method} has no solved offsets: hit rate and target mass are for impulse init; window is "
                   f"the share of each query's attention inside the {window} around it")
    else:
        typer.echo(f"hit rate: share of queries whose strongest key is the solved offset's target; target mass: "
                   f"mean attention on that target; window: share of attention inside the {window} around the "
                   f"query; over grid queries and {fid.images} inputs"
                   + ("; train: what train recorded at init (config.json)" if recorded else ""))
    if target_png is not None:
        typer.echo(f"wrote {target_png}")


def _recorded_samples(recorded) -> Optional[int]:
    return int(recorded["samples"]) if isinstance(recorded, dict) and "samples" in recorded else None
