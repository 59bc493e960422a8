"""``structinit apply``: initialize the attention of a saved checkpoint (a thin layer over
:func:`structinit.apply.checkpoint.apply_checkpoint`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence

import typer
from typing_extensions import Annotated

from structinit.apply.options import DEFAULT_PE_SCALE, ApplyOptions
from structinit.cli.common import (
    PARAMS_LISTED,
    CacheDir,
    Device,
    GridOpt,
    JsonOut,
    Progress,
    Seed,
    Threads,
    data_dir_option,
    emit_json,
    examples,
    init_methods,
    listed,
    option,
    shown,
)
from structinit.fit.settings import FIT_DEFAULTS
from structinit.init.base import DEFAULT_METHOD
from structinit.solver.recipes import (
    DEFAULT_FILTER,
    DEFAULT_OFFSET_ORDER,
    DEFAULT_PADDING,
    DEFAULT_RECIPE,
    RECIPE_DEFAULTS,
)

if TYPE_CHECKING:
    from structinit.init.base import InitSpec
    from structinit.init.report import InitReport

EXAMPLES = examples(
    'structinit apply vit.pth --heads 3                  # fitted on noise inputs (no data): writes vit.impulse.pth',
    'structinit apply vit.pth --heads 3 --data images/ --out vit-fit.pth   # fitted to real images',
    'structinit apply vit.pth --heads 3 --data-fit 0 --out vit-plain.pth   # the plain solve (measured to lose)',
    'structinit apply vit.pth --heads 3 --filter 5 --layers 0-5 --target-mass 0.5 --out vit-imp5.pth',
    'structinit apply vit.pth --heads 3 --method mimetic --dry-run',
    'structinit apply learned.pth --heads 3 --fit-pe     # solve for its learned position embedding',
    'structinit apply mha.pt --heads 4 --grid 8x8 --in-place --json',
    'structinit apply bert.pt --heads 12 --filter 5 --set-pe sincos  # a sequence of 512 (the position table)',
    'structinit apply gpt2.pt --heads 12 --filter 3 --causal --set-pe sincos --grid 256 --out gpt2-imp.pt',
    'structinit apply runs/digits/checkpoint.pt --out imp.pt --data digits  # Q/K fitted to the run\'s digits',
    'structinit apply hf-vit/ --data images/     # a save_pretrained folder: writes hf-vit.impulse/ (from_pretrained)',
    'structinit apply vit_t.pth --model vit_tiny_patch16_224 --set-pe sincos --data inputs.pt  # inputs [B, 3, H, W]',
)

#: The library's defaults of what apply is asked to do (the defaults of its options, never typed twice).
DEFAULTS = ApplyOptions()

#: Library parameters this command spells with another flag.
ALIASES = {"init": "--method", "model_name": "--model", "data": "--data", "samples": "--samples",
           "data_fit": "--data-fit"}

#: Flags that are aliases of an init parameter (``-p NAME=VALUE``), kept because users type them: flag
#: -> init parameter. One is refused with a method that has no such parameter.
METHOD_FLAGS = {"--filter": "filter", "--recipe": "recipe", "--target-mass": "target_mass",
                 "--recipe-param": "recipe_params", "--artifact": "artifact", "--share": "share",
                 "--offsets": "offset_order", "--mimetic-vproj": "mimetic_vproj", "--fit-pe": "fit_pe",
                 "--causal": "causal", "--padding": "padding", "--data-fit": "data_fit"}


# --------------------------------------------------------------------------- options

CkptOpt = Annotated[Path, typer.Argument(help="Checkpoint file: timm ViT, Hugging Face ViT/DeiT, BERT-style "
    "encoder or GPT-2, or nn.MultiheadAttention; .pt/.pth/.bin or "
    ".safetensors. Or a Hugging Face folder (save_pretrained's): "
    "written as a folder, CKPT.METHOD by default.")]

MethodOpt = Annotated[str, option("--method", help=f"The init method: {init_methods()}. Its parameters are "
    f"set with -p NAME=VALUE; {PARAMS_LISTED}.")]

InitParamOpt = Annotated[List[str], option("--init-param", help="A parameter of the --method, NAME=VALUE "
    f"(repeatable), e.g. alpha1=0.5 for mimetic; {PARAMS_LISTED}. The 'Same as -p' flags below "
    "are aliases of some of them, refused with a method that has no such parameter.")]


def alias(name: str, value: str, what: str) -> str:
    """The help of a flag that is an alias of the init parameter ``name``: what it is the same as,
    the methods that have the parameter (read from the registry), and what it sets."""
    from structinit.init.registry import methods_with

    return f"Same as -p {name}={value} ({listed(methods_with(name))}): {what}"


def fitting() -> str:
    """The methods with a data fit, read from the registry (what ``--data`` is for)."""
    from structinit.init.registry import fitting_methods

    return fitting_methods()


FilterSizeOpt = Annotated[Optional[int], option("--filter", help=alias("filter", "F", "the filter size f."),
    show_default=shown(DEFAULT_FILTER))]

RecipeOpt = Annotated[Optional[str], option("--recipe", help=alias("recipe", "NAME", "the solver recipe."),
    show_default=DEFAULT_RECIPE)]

TargetMassOpt = Annotated[Optional[float], option("--target-mass", help=alias("target_mass", "M", "the fast "
    "recipe's mean attention on the target token."), show_default=shown(RECIPE_DEFAULTS["fast"]["target_mass"]))]

RecipeParamOpt = Annotated[List[str], option("--recipe-param", help=alias("recipe_params", "JSON", "another "
    "recipe parameter, NAME=VALUE (repeatable), e.g. iters=2000 (-p 'recipe_params={\"iters\": 2000}')."))]

ArtifactOpt = Annotated[Optional[str], option("--artifact", help=alias("artifact", "PATH", "use this solved "
    "artifact (path or cache key) instead of solving."))]

ShareOpt = Annotated[Optional[bool], option("--share", help=alias("share", "true", "one solve reused for every "
    "layer."), show_default=False)]

OffsetsOpt = Annotated[Optional[str], option("--offsets", help=alias("offset_order", "ORDER", "random or centre."),
    show_default=DEFAULT_OFFSET_ORDER)]

MimeticVprojOpt = Annotated[Optional[bool], option("--mimetic-vproj/--no-mimetic-vproj", help=alias(
    "mimetic_vproj", "true|false", "also set V/proj as mimetic init does (the impulse default); "
    "--no-mimetic-vproj keeps the checkpoint's V/proj."), show_default=True)]

FitPeOpt = Annotated[Optional[bool], option("--fit-pe", help=alias("fit_pe", "true", "solve Q/K for the position "
    "embedding the checkpoint has (e.g. a learned one) instead of the sin-cos table."), show_default=False)]

CausalOpt = Annotated[Optional[bool], option("--causal", help=alias("causal", "true", "sequences: offsets only in "
    "the past (needed for a decoder such as GPT-2)."), show_default=False)]

PaddingOpt = Annotated[Optional[str], option("--padding", help=alias("padding", "PAD", "zero or circular."),
    show_default=DEFAULT_PADDING)]

DataFitOpt = Annotated[Optional[int], option("--data-fit", min=0, metavar="STEPS", help=alias("data_fit", "STEPS",
    "Adam steps of the data fit per layer; 0 writes the plain solve, which trains below mimetic init."),
    show_default=shown(FIT_DEFAULTS.steps))]

LayersOpt = Annotated[str, option("--layers", help="Layers to initialize: all, or 0-based indices and ranges "
    "such as 0-3,6 or 6- (from 6 on).")]

HeadsOpt = Annotated[Optional[int], option("--heads", help="Heads per layer, when the checkpoint does not "
    "tell.")]

SetPeOpt = Annotated[Optional[str], option("--set-pe", help="Also write the fixed position embedding: "
    "sincos (1-D on sequence models).")]

PeScaleOpt = Annotated[Optional[float], option("--pe-scale", help="Scale of the --set-pe embedding (positive).",
    show_default=shown(DEFAULT_PE_SCALE))]

OutOpt = Annotated[Optional[Path], option("--out", metavar="PATH", help="Output file; its name sets the format "
    "(.safetensors, else torch). For a Hugging Face folder, the output "
    "folder.", show_default="CKPT.METHOD.EXT")]

ForceOpt = Annotated[bool, option("--force", help="Replace an existing --out (an output folder is kept "
    "as OUT.bak).")]

InPlaceOpt = Annotated[bool, option("--in-place", help="Replace the input atomically, keeping CKPT.bak (or "
    "CKPT.bak.1, ...: a backup is never overwritten).")]

DryRunOpt = Annotated[bool, option("--dry-run", help="Print the plan; solve and write nothing.")]

DataOpt = Annotated[Optional[str], option(
    "--data", metavar="SOURCE", help=f"{fitting()}: fit Q/K to these inputs, run through the model the "
    "checkpoint describes: a dataset (digits, mnist1d, or one read from --data-dir; a structinit train checkpoint "
    "takes its run's own training inputs), a folder of images, a tensor file (.pt, .npy, .safetensors) of inputs "
    "normalized as the model sees them, or noise.", show_default="noise: Gaussian inputs of the model's input "
    "shape, no data")]

SamplesOpt = Annotated[Optional[int], option("--samples", min=1, help="--data: how many inputs (the first); the "
    "fit reads them all.",
    show_default=f"the fit's data_fit_samples, {FIT_DEFAULTS.samples}")]

DataDirOpt = Annotated[Optional[Path], data_dir_option("--data: ")]

ModelNameOpt = Annotated[Optional[str], option("--model", help="The timm model the checkpoint holds, for the "
    "data fit, e.g. vit_tiny_patch16_224 (else timm's arch in the "
    "file, else a ViT of the tensors' shape).")]

ConfigOpt = Annotated[Optional[Path], option("--config", help="The Hugging Face config.json of the checkpoint, "
    "for the data fit (default: the one beside it).")]

VerboseOpt = Annotated[bool, option("--verbose", help="Show every setting, the artifacts and each "
    "layer's replaced tensors.")]


def apply(
    ckpt: CkptOpt,
    method: MethodOpt = DEFAULT_METHOD,
    init_param: InitParamOpt = [],  # noqa: B006
    filter_size: FilterSizeOpt = None,
    recipe: RecipeOpt = None,
    target_mass: TargetMassOpt = None,
    recipe_param: RecipeParamOpt = [],  # noqa: B006
    artifact: ArtifactOpt = None,
    share: ShareOpt = None,
    offsets: OffsetsOpt = None,
    mimetic_vproj: MimeticVprojOpt = None,
    fit_pe: FitPeOpt = None,
    causal: CausalOpt = None,
    padding: PaddingOpt = None,
    data_fit: DataFitOpt = None,
    layers: LayersOpt = "all",
    heads: HeadsOpt = None,
    grid: GridOpt = None,
    set_pe: SetPeOpt = None,
    pe_scale: PeScaleOpt = None,
    seed: Seed = DEFAULTS.seed,
    out: OutOpt = None,
    force: ForceOpt = DEFAULTS.force,
    in_place: InPlaceOpt = DEFAULTS.in_place,
    dry_run: DryRunOpt = DEFAULTS.dry_run,
    data: DataOpt = None,
    samples: SamplesOpt = None,
    data_dir: DataDirOpt = None,
    model_name: ModelNameOpt = None,
    config: ConfigOpt = None,
    verbose: VerboseOpt = False,
    device: Device = DEFAULTS.device,
    threads: Threads = None,
    cache_dir: CacheDir = None,
    json_out: JsonOut = False,
):
    """Initialize the attention of a checkpoint (impulse, mimetic, ...) and write a new file.

    What the method writes changes (Q/K; V/proj for mimetic and impulse, V alone for conditioned
    and for impulse with -p value_init=conditioned; the position table; with
    -p position_subspace=true the patch embedding, class token and output projections too) and the
    result names every changed tensor, read from the tensors; all else is written back as loaded.
    The impulse init is fitted through the model the checkpoint describes (a structinit train run,
    a timm ViT, a Hugging Face ViT/DeiT, BERT or GPT-2) as initialize_model fits it: to --data, else
    to Gaussian noise of the model's input shape; a learned position embedding gets the sin-cos
    table in its place (kept learnable) unless --set-pe or --fit-pe says otherwise. The result says
    how the attention hits its offsets on those inputs; --verbose shows every setting and tensor.
    """
    from structinit.apply.options import ApplyOptions
    from structinit.geometry.grid import parse_grid
    from structinit.init.registry import parse_assignments
    from structinit.runtime import use_threads

    use_threads(threads)
    spec = method_spec(method, init_param, {
        "--filter": filter_size, "--recipe": recipe, "--target-mass": target_mass,
        "--recipe-param": parse_assignments(recipe_param, "recipe_params") or None, "--artifact": artifact,
        "--share": share, "--offsets": offsets, "--mimetic-vproj": mimetic_vproj, "--fit-pe": fit_pe,
        "--causal": causal, "--padding": padding, "--data-fit": data_fit}, samples=samples)
    options = ApplyOptions(out=out, in_place=in_place, dry_run=dry_run, force=force, layers=layers, heads=heads,
                           grid=parse_grid(grid=grid) if grid is not None else None, set_pe=set_pe, pe_scale=pe_scale,
                           seed=seed, cache_dir=cache_dir, device=device, data=data, samples=samples,
                           data_dir=data_dir, model_name=model_name, config=str(config) if config is not None else None)
    report = _apply_with_progress(ckpt, spec, options, method, shown=not json_out)
    show(spec, report, dry_run=dry_run, verbose=verbose, json_out=json_out)


def _apply_with_progress(ckpt, spec, options, method: str, shown: bool):
    """:func:`~structinit.apply.checkpoint.apply_checkpoint` behind a progress bar (``shown``: not
    with ``--json``) whose stage names each step of ``method`` and the data fit's steps; a notice
    (the fit's estimated time, a wait for another process) is always logged above it."""
    from structinit.apply.checkpoint import apply_checkpoint
    from structinit.errors import Notice

    with Progress(f"apply {method}", enabled=shown) as bar:
        def log(message: str) -> None:
            if isinstance(message, Notice):  # the fit's estimated time, a wait for another process: always shown
                bar.log(message)
            else:
                bar.stage(f"apply {method}: {message}")

        return apply_checkpoint(ckpt, spec, options, progress=bar, log=log,
                                fit_progress=lambda d, n: bar.update(d, n, f"apply {method}: data fit"))


def show(spec: InitSpec, report: dict, *, dry_run: bool, verbose: bool, json_out: bool) -> None:
    """Print apply's ``report``: the init's notes on stderr (none on a dry run), then the JSON, or the
    text with the init's own summary (:meth:`~structinit.init.base.InitSpec.summary`)."""
    from structinit.apply.checkpoint import init_report_of

    init = init_report_of(report)
    if not dry_run:
        say_notices(spec, init)
    if json_out:
        emit_json(report)
        return
    summary = [] if dry_run else rendered(spec.summary(init, model=report.get("model")))
    typer.echo(format_verbose(report, init) if verbose else format_report(report, summary))


def method_spec(method: str, init_param: List[str], flags: dict, samples: Optional[int] = None):
    """The spec of ``method`` from ``--init-param`` and the :data:`METHOD_FLAGS` given (``flags``:
    flag -> value, ``None`` where not given; each the alias of one init parameter). An alias of a
    parameter the method does not have is refused naming the flag and the method, and so is a value
    given twice (a flag and ``--init-param``; ``--samples`` and ``data_fit_samples``)."""
    import dataclasses

    from structinit.errors import UsageError
    from structinit.init.registry import init_spec, parse_assignments, parse_init, spec_class

    given = {flag: value for flag, value in flags.items() if value is not None}
    takes = [f.name for f in dataclasses.fields(spec_class(method))] if given else []
    foreign = [flag for flag in given if METHOD_FLAGS[flag] not in takes]
    if foreign:
        one = len(foreign) == 1
        raise UsageError(f"{', '.join(foreign)} {'sets' if one else 'set'} the init parameter{'' if one else 's'} "
                         f"{', '.join(METHOD_FLAGS[f] for f in foreign)}, which the {method} init does not have "
                         f"(it takes: {', '.join(takes) or 'no parameters'})")
    assigned = parse_assignments(init_param)
    for flag, value in given.items():
        name = METHOD_FLAGS[flag]
        if name in assigned:
            text = next(i for i in init_param if i.partition("=")[0].strip().replace("-", "_") == name)
            raise UsageError(f"{_flag_text(flag, value)} and --init-param {text} both set {name}; give one of them")
    if samples is not None and "data_fit_samples" in assigned:
        raise UsageError("--samples and --init-param data_fit_samples both set how many inputs the fit reads; "
                         "give one of them")
    spec = parse_init(method, init_param)
    return init_spec(spec, **{METHOD_FLAGS[flag]: value for flag, value in given.items()}) if given else spec


def _flag_text(flag: str, value) -> str:
    """``flag`` with ``value`` as the user typed it: ``--filter 3``, ``--share``, ``--no-mimetic-vproj``."""
    if isinstance(value, bool):
        return flag if value else "--no-" + flag[2:]
    if isinstance(value, dict):  # --recipe-param NAME=VALUE, read
        return " ".join(f"{flag} {k}={v}" for k, v in value.items())
    return f"{flag} {value}"


def rendered(lines: List[str]) -> List[str]:
    """``lines`` with their marked parameters named by this command's flags."""
    from structinit.cli.common import FLAG_NAMER
    from structinit.errors import StructinitWarning

    return [StructinitWarning(line).render(FLAG_NAMER.get()) for line in lines]


def say_notices(spec: InitSpec, report: InitReport) -> None:
    """One stderr line for each thing the user should know of what was written (the init's
    :meth:`~structinit.init.base.InitSpec.notes`: that the fit ran on noise and real inputs can be
    given, or that the plain solve was written), its parameters named by this command's flags."""
    for note in rendered(spec.notes(report)):
        typer.echo("note: " + note, err=True)


def format_report(r: dict, summary: Sequence[str] = ()) -> str:
    """Terminal text of an apply report: what was written, and the init's ``summary`` (its
    :meth:`~structinit.init.base.InitSpec.summary`, rendered: what its fit ran on, how structured
    the attention is); the details are in ``format_verbose`` and ``--json``."""
    g = r.get("grid")
    shape = f"{r['layout']}, dim {r['dim']}, {r['heads']} heads, depth {r['depth']}" + \
        (f", grid {'x'.join(map(str, g))}" if g else "")
    if r.get("dry_run"):
        head = f"plan (dry run, nothing written): {r['method']} init of {len(r['layers'])} layer(s) into {r['output']}"
    else:
        where = "replaced in place" if r["in_place"] else "wrote"
        backup = f" (backup {r['backup']})" if r.get("backup") else ""
        head = f"{where} {r['output']}{backup}: {r['method']} init of {len(r['layers'])} layer(s) [{shape}]"
    lines = [head]
    if r.get("pos_embed_written"):
        lines.append(f"  position embedding: {r['pos_embed_written']}")
    elif r.get("set_pe"):
        lines.append(f"  position embedding {r['pos_embed_replaced']}: {r['set_pe']} x{r['pe_scale']:g}")
    if r.get("dry_run") and r.get("data_fit"):
        lines.append(f"  Q/K would be fitted {r['data_fit']}")
    lines += [f"  {line}" for line in summary]
    for where, names in (r.get("changed") or {}).items():
        place = "" if len(r["changed"]) == 1 else f" in {where}"
        lines.append(f"  tensors changed{place}: {len(names)} ({compact_names(names) or 'none'}); every other "
                     "tensor and entry written back as loaded")
    if r.get("base_note"):
        lines.append(f"  other weights: {r['base_note']}")
    return "\n".join(lines)


def compact_names(names: List[str]) -> str:
    """Tensor names with their layer index folded: ``blocks.{0-11}.attn.qkv.weight`` for the same
    tensor of consecutive layers (``{0,2}`` otherwise), in first-seen order."""
    import re

    groups: Dict[tuple, List[int]] = {}
    for name in names:
        m = re.match(r"^(.*?\.)(\d+)(\..*)$", name)
        key = (m.group(1), m.group(3)) if m else (name, None)
        groups.setdefault(key, []).append(int(m.group(2)) if m else -1)
    out = []
    for (head, tail), idx in groups.items():
        if tail is None:
            out.append(head)
            continue
        run = len(idx) > 1 and idx == list(range(idx[0], idx[0] + len(idx)))
        inner = f"{idx[0]}-{idx[-1]}" if run else ",".join(map(str, idx))
        out.append(f"{head}{{{inner}}}{tail}" if len(idx) > 1 else f"{head}{idx[0]}{tail}")
    return ", ".join(out)


def format_verbose(r: dict, init: Optional[InitReport] = None) -> str:
    """Terminal text of an apply report with every setting, artifact and replaced tensor (``init``:
    its init's part, :func:`~structinit.apply.checkpoint.init_report_of`, read here when not given)."""
    from structinit.apply.checkpoint import init_report_of

    init = init if init is not None else init_report_of(r)
    g = r.get("grid")
    head = ("plan (dry run, nothing written)" if r.get("dry_run")
            else "replaced in place" if r["in_place"] else "wrote")
    params = ", ".join(f"{k}={v}" for k, v in (r.get("params") or {}).items())
    lines = [
        f"{r['input']}: {r['description']} [{r['layout']}], {r['format']}; state dicts: {', '.join(r['state_dicts'])}",
        f"  dim {r['dim']}, heads {r['heads']}, depth {r['depth']}" + (f", grid {'x'.join(map(str, g))}" if g else ""),
        f"  method {r['method']}" + (f" ({params})" if params else "") + f", seed {r['seed']}",
    ]
    if r.get("artifact"):
        a = r["artifact"]
        lines.append(f"  artifact {a.get('path')} (key {a.get('key')}{', cached' if a.get('cached') else ''})")
    if r.get("set_pe"):
        lines.append(f"  position embedding {r['pos_embed_replaced']} <- {r['set_pe']} x{r['pe_scale']}")
    elif r.get("pos_embed"):
        lines.append(f"  position embedding {r['pos_embed']}: {r.get('pos_embed_kind')}")
    if r.get("measured_on"):
        lines.append(f"  hit rate and target mass measured on {r['measured_on']}")
    fit = init.fit
    if fit is not None and fit.skipped:
        lines.append(f"  data fit {fit.skipped}")
    on_batch = {}
    if fit is not None and fit.layers:
        art = fit.artifact or {}
        lines.append(f"  model {r['model']}" if r.get("model") else "  model (given)")
        lines.append(f"  data fit (version {fit.version}) on {fit.source or 'the batch'}: "
                     f"{fit.seconds or 0:.1f}s{', read from the cache' if art.get('cached') else ''}; "
                     f"fitted artifact {art.get('key')}")
        lines.append(f"  attention on the batch (first {fit.measured_count} inputs), then on the position embedding "
                     "alone (pseudo input):")
        on_batch = {row["layer"]: row for row in fit.layers}
    for row in init.layers:
        q = ""
        b = on_batch.get(row.layer)
        if b is not None:
            q += (f"  batch: hit {b['hit_rate']:.3f} mass {b['target_mass']:.3f}"
                  + (f" window {b['window_mass']:.3f}" if "window_mass" in b else "") + " |")
        if row.hit_rate is not None:
            hit, mass = ("pseudo input: hit", "mass") if b is not None else ("hit rate", "target mass")
            q += f"  {hit} {row.hit_rate:.3f}  {mass} {row.target_mass or 0:.3f}"
        lines.append(f"  layer {row.layer:>3}{q}  replaced: {', '.join(row.replaced)}")
    backup = f" (backup {r['backup']})" if r.get("backup") and not r.get("dry_run") else ""
    fmt = f" ({r['output_format']})" if r.get("output_format") and r.get("output_format") != r.get("format") else ""
    lines.append(f"{head}: {r['output']}{fmt}{backup}")
    return "\n".join(lines)
