"""``structinit apply``: initialize the attention of a saved checkpoint (a thin layer over
:func:`structinit.init.apply.apply_checkpoint`)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer
from typing_extensions import Annotated

from structinit.cli.common import CacheDir, Device, GridOpt, JsonOut, Progress, Threads, emit_json, examples

EXAMPLES = examples(
    'structinit apply vit.pth --heads 3                  # impulse-3: writes vit.impulse.pth',
    'structinit apply vit.pth --heads 3 --filter 5 --layers 0-5 --target-mass 0.5 --out vit-imp5.pth',
    'structinit apply vit.pth --heads 3 --method mimetic --dry-run',
    'structinit apply learned.pth --heads 3 --fit-pe     # solve for its learned position embedding',
    'structinit apply mha.pt --heads 4 --grid 8x8 --in-place --json',
    'structinit apply bert.pt --heads 12 --filter 5 --set-pe sincos  # a sequence of 512 (the position table)',
    'structinit apply gpt2.pt --heads 12 --filter 3 --causal --set-pe sincos --grid 256 --out gpt2-imp.pt',
    'structinit apply runs/digits/checkpoint.pt --out imp.pt --data digits  # + attention on real digits',
)

#: Flags that only the impulse method takes: flag -> init parameter.
IMPULSE_FLAGS = {"--filter": "filter", "--recipe": "recipe", "--target-mass": "target_mass",
                 "--recipe-param": "recipe_params", "--artifact": "artifact", "--share": "share",
                 "--offsets": "offset_order", "--mimetic-vproj": "mimetic_vproj", "--fit-pe": "fit_pe",
                 "--causal": "causal", "--padding": "padding"}


def apply(
    ckpt: Annotated[Path, typer.Argument(help="Checkpoint file: timm ViT, Hugging Face ViT/DeiT, BERT-style "
                                         "encoder or GPT-2, or nn.MultiheadAttention; .pt/.pth/.bin or "
                                         ".safetensors.")],
    method: Annotated[str, typer.Option("--method", help="impulse, mimetic, kaiming or trunc-normal.")] = "impulse",
    init_param: Annotated[List[str], typer.Option("--init-param", "-p", help="Init parameter NAME=VALUE (repeatable), "
                                                  "e.g. alpha1=0.5 for mimetic.")] = [],  # noqa: B006
    filter_size: Annotated[Optional[int], typer.Option("--filter", "-f", help="impulse: filter size f.",
                                                       show_default="3")] = None,
    recipe: Annotated[Optional[str], typer.Option("--recipe", "-r", help="impulse: solver recipe.",
                                                  show_default="fast")] = None,
    target_mass: Annotated[Optional[float], typer.Option("--target-mass", help="impulse, fast recipe: mean "
                                                         "attention on the target token.", show_default="0.3")] = None,
    recipe_param: Annotated[List[str], typer.Option("--recipe-param", help="impulse: another recipe parameter, "
                                                    "NAME=VALUE (repeatable), e.g. iters=2000.")] = [],  # noqa: B006
    artifact: Annotated[Optional[str], typer.Option("--artifact", help="impulse: use this solved artifact (path or "
                                                    "cache key) instead of solving.")] = None,
    share: Annotated[Optional[bool], typer.Option("--share", help="impulse: one solve reused for every layer.",
                                                  show_default=False)] = None,
    offsets: Annotated[Optional[str], typer.Option("--offsets", help="impulse: random or centre.",
                                                   show_default="random")] = None,
    mimetic_vproj: Annotated[Optional[bool], typer.Option("--mimetic-vproj/--no-mimetic-vproj", help="impulse: also "
                                                          "set V/proj as mimetic init does (the impulse default); "
                                                          "--no-mimetic-vproj keeps the checkpoint's V/proj.",
                                                          show_default=True)] = None,
    fit_pe: Annotated[Optional[bool], typer.Option("--fit-pe", help="impulse: solve Q/K for the position embedding "
                                                   "the checkpoint has (e.g. a learned one) instead of the sin-cos "
                                                   "table.", show_default=False)] = None,
    causal: Annotated[Optional[bool], typer.Option("--causal", help="impulse, sequences: offsets only in the past "
                                                   "(needed for a decoder such as GPT-2).", show_default=False)] = None,
    padding: Annotated[Optional[str], typer.Option("--padding", help="impulse: zero or circular.",
                                                   show_default="zero")] = None,
    layers: Annotated[str, typer.Option("--layers", help="Layers to initialize: all, or 0-based indices and ranges "
                                        "such as 0-3,6 or 6- (from 6 on).")] = "all",
    heads: Annotated[Optional[int], typer.Option("--heads", help="Heads per layer, when the checkpoint does not "
                                                 "tell.")] = None,
    grid: GridOpt = None,
    set_pe: Annotated[Optional[str], typer.Option("--set-pe", help="Also write the fixed position embedding: "
                                                  "sincos (1-D on sequence models).")] = None,
    pe_scale: Annotated[Optional[float], typer.Option("--pe-scale", help="Scale of the --set-pe embedding (positive).",
                                                      show_default="1")] = None,
    seed: Annotated[int, typer.Option("--seed", min=0, help="Seed of the offsets and random draws.")] = 0,
    out: Annotated[Optional[str], typer.Option("--out", "-o", help="Output file; its name sets the format "
                                               "(.safetensors, else torch).", show_default="CKPT.METHOD.EXT")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing --out.")] = False,
    in_place: Annotated[bool, typer.Option("--in-place", help="Replace the input atomically, keeping CKPT.bak (or "
                                           "CKPT.bak.1, ...: a backup is never overwritten).")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan; solve and write nothing.")] = False,
    data: Annotated[Optional[str], typer.Option(
        "--data", metavar="DATASET", help="Also measure the written attention on the first training inputs of "
        "this dataset (the run's own), through the model a structinit train checkpoint describes: per layer, hit "
        "rate and target mass on the solved offsets and the share inside the f x f window.")] = None,
    samples: Annotated[int, typer.Option("--samples", min=1, help="--data: how many training inputs.")] = 256,
    data_dir: Annotated[Optional[Path], typer.Option("--data-dir", help="--data: dataset folder (cifar10, cifar100, "
                                                     "svhn), instead of the run's.", show_default=False)] = None,
    device: Device = "cpu",
    threads: Threads = None,
    cache_dir: CacheDir = None,
    json_out: JsonOut = False,
):
    """Initialize the attention of a checkpoint (impulse, mimetic, ...) and write a new file.

    Only the Q/K rows and biases of the chosen layers change (plus V/proj for mimetic and for
    impulse unless --no-mimetic-vproj, and the position embedding with --set-pe); everything else
    is kept bit for bit. A checkpoint has no model to run data through, so impulse's fit to real
    inputs (the default in train) does not run here: Q/K are the plain solve, and the report says
    so. Reports, per layer, what was replaced and the attention's hit rate and target mass,
    measured from the written weights on the checkpoint's own LayerNorm'd position embedding. A
    learned position embedding needs --set-pe sincos or --fit-pe for the impulse method. With
    --data, a checkpoint written by structinit train is also measured on real inputs.
    """
    from structinit.errors import UsageError
    from structinit.geometry.grid import parse_grid
    from structinit.init.apply import apply_checkpoint
    from structinit.init.specs import parse_assignments, parse_init
    from structinit.runtime import use_threads

    use_threads(threads)
    given = {"--filter": filter_size, "--recipe": recipe, "--target-mass": target_mass,
             "--recipe-param": parse_assignments(recipe_param, "recipe_params") or None, "--artifact": artifact,
             "--share": share, "--offsets": offsets, "--mimetic-vproj": mimetic_vproj, "--fit-pe": fit_pe,
             "--causal": causal, "--padding": padding}
    given = {flag: value for flag, value in given.items() if value is not None}
    if given and method != "impulse":
        flags = ", ".join(given)
        raise UsageError(f"{flags} {'applies' if len(given) == 1 else 'apply'} to --method impulse, not {method}")
    spec = parse_init(method, init_param)
    if given:
        from structinit.init.specs import init_spec

        spec = init_spec(spec, **{IMPULSE_FLAGS[flag]: value for flag, value in given.items()})
    run_config = None
    if data is None and (samples != 256 or data_dir is not None):
        raise UsageError("--samples and --data-dir need --data DATASET")
    if data is not None:
        from structinit.bench.attention import train_checkpoint_config
        from structinit.training.datasets import dataset_info

        if dry_run:
            raise UsageError("--data measures the written weights, and --dry-run writes none")
        dataset_info(data)  # an unknown dataset is named before anything is read
        try:
            run_config = train_checkpoint_config(ckpt, data_dir)
        except UsageError as exc:
            raise UsageError(f"--data: {exc}") from None
        if run_config.dataset != data:
            raise UsageError(f"{ckpt} was trained on {run_config.dataset}; --data {data} would feed it other inputs "
                             f"(give --data {run_config.dataset})")
    with Progress(f"apply {method}", enabled=not json_out) as bar:
        report = apply_checkpoint(ckpt, spec, out=out, in_place=in_place, dry_run=dry_run, force=force,
                                  layers=layers, heads=heads, grid=parse_grid(grid=grid) if grid else None,
                                  set_pe=set_pe, pe_scale=pe_scale, seed=seed, cache_dir=cache_dir, device=device,
                                  progress=bar, log=lambda msg: bar.stage(f"apply {method}: {msg}"))
        fid = None
        if run_config is not None:
            from structinit.bench.attention import applied_fidelity

            bar.stage(f"apply {method}: attention on {samples} {data} training inputs")
            fid = applied_fidelity(run_config, report["output"], report, samples)
            report["data_attention"] = {"dataset": data, "samples": fid.images, **fid.summary(),
                                        "layers": fid.layer_rows(), "filter": fid.filter}
    if json_out:
        emit_json(report)
        return
    typer.echo(format_report(report))
    if fid is not None:
        from structinit.analysis.text import fidelity_table

        typer.echo(f"attention of the written weights on the first {fid.images} training inputs of {data}:")
        typer.echo(fidelity_table(fid))
        window = f"{fid.filter} positions" if fid.grid.ndim == 1 else f"{fid.filter}x{fid.filter} window"
        typer.echo(("hit rate: share of queries whose strongest key is the solved offset's target; target mass: "
                    "mean attention on that target; " if fid.hit_rate is not None else "")
                   + f"window: share of attention inside the {window} around the query")


def format_report(r: dict) -> str:
    """Terminal text of an apply report (or plan)."""
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
    if (r.get("data_fit") or {}).get("skipped"):
        lines.append(f"  data fit {r['data_fit']['skipped']}")
    for row in r["layers"]:
        q = ""
        if "hit_rate" in row:
            q = f"  hit rate {row['hit_rate']:.3f}  target mass {row['target_mass']:.3f}"
        lines.append(f"  layer {row['layer']:>3}{q}  replaced: {', '.join(row['replaced'])}")
    backup = f" (backup {r['backup']})" if r.get("backup") and not r.get("dry_run") else ""
    fmt = f" ({r['output_format']})" if r.get("output_format") and r.get("output_format") != r.get("format") else ""
    lines.append(f"{head}: {r['output']}{fmt}{backup}")
    return "\n".join(lines)
