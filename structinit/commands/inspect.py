"""``structinit inspect``: what a cached artifact (or a checkpoint) holds; no argument lists the cache."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..app import app
from .common import cli_errors, emit_json

EXAMPLE = """
Examples:

  structinit inspect                                   # list the cache

  structinit inspect e0fba236d20f --layer 0 --head 1 --query 136

  structinit inspect n256-d192-h3-f3-e0fba236d20f.safetensors --png attn.png

  structinit inspect model.pt --heads 3                # a checkpoint: layout and attention quality
"""


def _is_artifact_file(path: Path) -> bool:
    if path.suffix != ".safetensors":
        return False
    try:
        from safetensors import safe_open

        with safe_open(str(path), "np") as fh:
            return (fh.metadata() or {}).get("format", "").startswith("structinit/")
    except Exception:  # noqa: BLE001 - unreadable: read_artifact reports what is wrong with it
        return True


@app.command(epilog=EXAMPLE)
@cli_errors
def inspect(
    target: Optional[str] = typer.Argument(None, help="Artifact path or key, or a checkpoint; omit to list the cache."),
    layer: int = typer.Option(0, "--layer", help="Layer whose attention is drawn."),
    head: int = typer.Option(0, "--head", help="Head whose attention is drawn in the terminal."),
    query: Optional[int] = typer.Option(None, "--query", help="Query token (default: the grid centre)."),
    png: Optional[Path] = typer.Option(None, "--png", help="Write the layer's attention maps (all heads) as a PNG image."),
    heads: Optional[int] = typer.Option(None, "--heads", help="Checkpoints only: heads, when the checkpoint does not say."),
    grid: Optional[str] = typer.Option(None, "--grid", help="Checkpoints only: patch grid HxW, when it cannot be inferred."),
    cache_dir: Optional[Path] = typer.Option(None, "--cache-dir", help="Cache folder to list or search."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
):
    """Show an artifact's config, quality and attention, a checkpoint's layout, or list the cache."""
    from ..errors import UsageError

    if target is None:
        return _list(cache_dir, json_out)
    path = Path(target).expanduser()
    if not path.exists():
        from ..cache import resolve_key

        found = resolve_key(target, cache_dir)
        if found is None:
            raise UsageError(f"{target}: no such file, and no cached artifact has that key (run `structinit inspect` to list them)")
        path = found
    if path.is_dir():
        raise UsageError(f"{path} is a folder; give an artifact or checkpoint file")
    if _is_artifact_file(path):
        return _show_artifact(path, layer, head, query, png, json_out)
    return _show_checkpoint(path, heads, grid, json_out)


def _list(cache_dir, json_out: bool) -> None:
    from ..artifact import read_artifact
    from ..cache import list_artifacts, user_cache_dir
    from ..errors import ArtifactError

    entries = []
    for path in list_artifacts(cache_dir):
        try:
            art = read_artifact(path)
            s = art.stats.get("summary", {})
            entries.append({"path": str(path), "key": art.key, "config": art.config.describe(),
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


def _show_artifact(path: Path, layer: int, head: int, query: Optional[int], png: Optional[Path], json_out: bool) -> None:
    from ..artifact import read_artifact
    from ..errors import UsageError
    from ..report import attention_rows, quality_table, query_attention_text

    art = read_artifact(path)
    cfg = art.config
    if not 0 <= layer < cfg.layers:
        raise UsageError(f"--layer {layer} is out of range: the artifact has {cfg.layers} layer(s)")
    if not 0 <= head < cfg.heads:
        raise UsageError(f"--head {head} is out of range: the artifact has {cfg.heads} head(s)")
    gh, gw = cfg.grid
    if query is None:
        query = (gh // 2) * gw + gw // 2
    if not 0 <= query < cfg.tokens:
        raise UsageError(f"--query {query} is out of range: the grid has {cfg.tokens} tokens")
    if png is not None:
        from ..png import attention_figure, write_png

        if png.parent and not png.parent.exists():
            raise UsageError(f"--png: folder {png.parent} does not exist")
        write_png(png, attention_figure(attention_rows(art, layer), cfg.grid, query))
    if json_out:
        emit_json({"path": str(path), "key": art.key, "config": cfg.to_dict(), "version": art.version,
                   "offsets": art.offsets.tolist(), "stats": art.stats, "png": str(png) if png else None})
        return
    typer.echo(f"artifact  {path}")
    typer.echo(f"key       {art.key}   (structinit {art.version}, solved in {art.stats.get('seconds', 0):.3f} s on "
               f"{art.stats.get('device', '?')})")
    typer.echo(f"config    {cfg.canonical_json()}")
    typer.echo(quality_table(art))
    typer.echo("")
    typer.echo(query_attention_text(art, layer, head, query))
    if png is not None:
        typer.echo(f"wrote {png}")


def _show_checkpoint(path: Path, heads: Optional[int], grid: Optional[str], json_out: bool) -> None:
    from ..checkpoints import describe_checkpoint, format_checkpoint_report
    from ..shapes import parse_grid

    desc = describe_checkpoint(path, heads=heads, grid=parse_grid(grid=grid) if grid else None)
    if json_out:
        emit_json(desc)
    else:
        typer.echo(format_checkpoint_report(desc))
