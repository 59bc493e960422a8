"""``structinit apply``: initialize the attention of a saved checkpoint (a thin layer over
:func:`structinit.apply.apply_checkpoint`)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from ..app import app
from .common import cli_errors, emit_json

EXAMPLE = """
Examples:

  structinit apply vit.pth --heads 3                    (impulse-3; writes vit.impulse.pth)

  structinit apply vit.pth --filter 5 --layers 0-5 --target-mass 0.5 --out vit-imp5.pth

  structinit apply model.safetensors --method mimetic --heads 12 --dry-run

  structinit apply mha.pt --heads 4 --grid 8x8 --in-place --json
"""


def _recipe_params(items: List[str]) -> dict:
    from ..errors import UsageError

    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise UsageError(f"--recipe-param must look like NAME=VALUE, got {item!r}")
        try:
            out[name.strip().replace("-", "_")] = float(value) if any(c in value for c in ".eE") else int(value)
        except ValueError:
            raise UsageError(f"--recipe-param {item!r}: the value must be a number") from None
    return out


@app.command(epilog=EXAMPLE)
@cli_errors
def apply(
    ckpt: Path = typer.Argument(..., help="Checkpoint file: timm / Hugging Face ViT / nn.MultiheadAttention, .pt/.pth/.safetensors."),
    method: str = typer.Option("impulse", "--method", help="impulse | mimetic | kaiming | trunc-normal."),
    filter_size: int = typer.Option(3, "--filter", "-f", help="impulse: filter size f."),
    recipe: str = typer.Option("fast", "--recipe", "-r", help="impulse: fast | paper | released | closed-form."),
    target_mass: Optional[float] = typer.Option(None, "--target-mass", "-m", help="impulse, fast recipe: mean attention on the target token (softness; default 0.3)."),
    recipe_param: List[str] = typer.Option([], "--recipe-param", help="impulse: another recipe parameter, NAME=VALUE (repeatable), e.g. iters=2000."),
    artifact: Optional[str] = typer.Option(None, "--artifact", help="impulse: use this solved artifact (path or cache key) instead of solving."),
    share: bool = typer.Option(False, "--share", help="impulse: one solve reused for every layer."),
    offsets: str = typer.Option("random", "--offsets", help="impulse: random | centre."),
    mimetic_vproj: bool = typer.Option(False, "--mimetic-vproj", help="impulse: also set V/proj as mimetic init does."),
    layers: str = typer.Option("all", "--layers", "-l", help="Layers to initialize: all, or indices/ranges such as 0-3,6 (0-based)."),
    heads: Optional[int] = typer.Option(None, "--heads", help="Heads per layer, when the checkpoint does not tell."),
    grid: Optional[str] = typer.Option(None, "--grid", help="Patch grid HxW, when the checkpoint does not tell."),
    set_pe: Optional[str] = typer.Option(None, "--set-pe", help="Also write the fixed position embedding: sincos."),
    pe_scale: float = typer.Option(1.0, "--pe-scale", help="Scale of the --set-pe embedding."),
    seed: int = typer.Option(0, "--seed", help="Seed of the offsets and random draws."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Output file (default: NAME.METHOD.EXT beside the input)."),
    in_place: bool = typer.Option(False, "--in-place", help="Replace the input atomically, keeping CKPT.bak."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan; solve and write nothing."),
    device: str = typer.Option("cpu", "--device", help="impulse: where to solve (auto | cpu | cuda)."),
    cache_dir: Optional[Path] = typer.Option(None, "--cache-dir", help="Artifact cache folder."),
    json_out: bool = typer.Option(False, "--json", help="Print a JSON document instead of text."),
):
    """Initialize the attention of a checkpoint (impulse, mimetic, ...) and write a new file.

    Only the Q/K rows and biases of the chosen layers change (plus V/proj for mimetic or
    --mimetic-vproj, and the position embedding with --set-pe); everything else is kept bit for
    bit. Reports, per layer, what was replaced and the attention's hit rate and target mass,
    measured from the written weights on the sin-cos pseudo input.
    """
    from ..apply import apply_checkpoint
    from ..shapes import parse_grid

    params = {}
    if method == "impulse":
        params = dict(filter=filter_size, recipe=recipe, target_mass=target_mass, share=share,
                      offset_order=offsets, mimetic_vproj=mimetic_vproj, device=device, cache_dir=cache_dir)
        rp = _recipe_params(recipe_param)
        if rp:
            params["recipe_params"] = rp
        if artifact:
            params["artifact"] = artifact
        params = {k: v for k, v in params.items() if v is not None}
    report = apply_checkpoint(ckpt, method=method, out=out, in_place=in_place, dry_run=dry_run, layers=layers,
                              heads=heads, grid=parse_grid(grid=grid) if grid else None, set_pe=set_pe,
                              pe_scale=pe_scale, seed=seed, **params)
    if json_out:
        emit_json(report)
        return
    typer.echo(format_report(report))


def format_report(r: dict) -> str:
    """Terminal text of an apply report (or plan)."""
    g = r.get("grid")
    head = "plan (dry run, nothing written)" if r.get("dry_run") else ("replaced in place" if r["in_place"] else "wrote")
    lines = [
        f"{r['input']}: {r['description']} [{r['layout']}], {r['format']}; state dicts: {', '.join(r['state_dicts'])}",
        f"  dim {r['dim']}, heads {r['heads']}, depth {r['depth']}" + (f", grid {g[0]}x{g[1]}" if g else ""),
        f"  method {r['method']}" + (f" {r['params']}" if r.get("params") else "") + f", seed {r['seed']}",
    ]
    if r.get("artifact"):
        a = r["artifact"]
        lines.append(f"  artifact {a.get('path')} (key {a.get('key')}{', cached' if a.get('cached') else ''})")
    if r.get("set_pe"):
        lines.append(f"  position embedding {r['pos_embed_replaced']} <- {r['set_pe']} x{r['pe_scale']}")
    for row in r["layers"]:
        q = ""
        if "hit_rate" in row:
            q = f"  hit rate {row['hit_rate']:.3f}  target mass {row['target_mass']:.3f}"
        lines.append(f"  layer {row['layer']:>3}{q}  replaced: {', '.join(row['replaced'])}")
    lines.append(f"{head}: {r['output']}" + (f" (backup {r['backup']})" if r.get("backup") and not r.get("dry_run") else ""))
    return "\n".join(lines)
