"""``structinit inspect``: what an artifact (or a checkpoint) holds; no argument lists the cache."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from typing_extensions import Annotated

from structinit.cli.common import CacheDir, Force, GridOpt, JsonOut, Threads, emit_json, examples

EXAMPLES = examples(
    'structinit inspect                                     # list the cache',
    'structinit inspect 6095a9c75beb --layer 2 --head 1 --query 27',
    'structinit inspect 6095a9c75beb --png attention.png',
    'structinit inspect vit.pth --heads 3                   # a checkpoint: layout and attention quality',
)


def _is_artifact_file(path: Path) -> bool:
    if path.suffix != ".safetensors":
        return False
    try:
        from safetensors import safe_open

        with safe_open(str(path), "np") as fh:
            return (fh.metadata() or {}).get("format", "").startswith("structinit/")
    except Exception:  # noqa: BLE001 - unreadable: read_artifact reports what is wrong with it
        return True


def inspect(
    target: Annotated[Optional[str], typer.Argument(help="Artifact path or key, or a checkpoint file; omit to list "
                                                    "the cache.")] = None,
    layer: Annotated[Optional[int], typer.Option("--layer", help="Artifact: layer whose attention is drawn.",
                                                 show_default="0")] = None,
    head: Annotated[Optional[int], typer.Option("--head", help="Artifact: head whose attention is drawn in the "
                                                "terminal.", show_default="0")] = None,
    query: Annotated[Optional[int], typer.Option("--query", help="Artifact: query token.",
                                                 show_default="the grid centre")] = None,
    png: Annotated[Optional[str], typer.Option("--png", help="Artifact: write the layer's attention (all heads) as a "
                                               "PNG figure (an existing file only with --force).")] = None,
    force: Force = False,
    heads: Annotated[Optional[int], typer.Option("--heads", help="Checkpoint: heads, when the checkpoint does not "
                                                 "say.")] = None,
    grid: GridOpt = None,
    cache_dir: CacheDir = None,
    threads: Threads = None,
    json_out: JsonOut = False,
):
    """Show an artifact's config, quality and attention, a checkpoint's layout and attention
    quality, or (no argument) list the cache."""
    from structinit.errors import UsageError
    from structinit.runtime import use_threads
    from structinit.solver.cache import check_cache_dir, resolve_key

    use_threads(threads)
    check_cache_dir(cache_dir)
    if cache_dir is not None and not cache_dir.expanduser().is_dir():
        raise UsageError(f"--cache-dir {cache_dir} does not exist")
    artifact_only = {"--layer": layer, "--head": head, "--query": query, "--png": png, "--force": force or None}
    checkpoint_only = {"--heads": heads, "--grid": grid}
    if target is None:
        given = [f for f, v in {**artifact_only, **checkpoint_only}.items() if v is not None]
        if given:
            raise UsageError(f"{', '.join(given)} need(s) an artifact or checkpoint to inspect; listing the cache "
                             "takes none")
        return _list(cache_dir, json_out)
    path = Path(target).expanduser()
    if not path.exists():
        found = resolve_key(target, cache_dir)
        if found is None:
            raise UsageError(f"{target}: no such file, and no cached artifact has that key (run `structinit "
                             "inspect` to list them)")
        path = found
    if path.is_dir():
        raise UsageError(f"{path} is a folder; give an artifact or checkpoint file")
    if _is_artifact_file(path):
        given = [f for f, v in checkpoint_only.items() if v is not None]
        if given:
            raise UsageError(f"{', '.join(given)} apply to a checkpoint; {path.name} is an artifact (its shape is "
                             "in its config)")
        return _show_artifact(path, layer or 0, head or 0, query, png, force, json_out)
    given = [f for f, v in artifact_only.items() if v is not None]
    if given:
        raise UsageError(f"{', '.join(given)} apply to an artifact; {path.name} is a checkpoint (inspect shows its "
                         "layout and per-layer quality; draw an artifact's attention instead)")
    return _show_checkpoint(path, heads, grid, json_out)


def _list(cache_dir, json_out: bool) -> None:
    from structinit.errors import ArtifactError
    from structinit.solver.artifact import read_artifact
    from structinit.solver.cache import list_artifacts, user_cache_dir

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


def _show_artifact(path: Path, layer: int, head: int, query: Optional[int], png: Optional[str], force: bool,
                   json_out: bool) -> None:
    from structinit.analysis.text import quality_table, query_attention_text
    from structinit.errors import UsageError
    from structinit.solver.artifact import read_artifact

    art = read_artifact(path)
    cfg = art.config
    if not 0 <= layer < cfg.layers:
        raise UsageError(f"--layer {layer} is out of range: the artifact has {cfg.layers} layer(s)")
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
        title = f"structinit artifact {art.key}: layer {layer} of {cfg.layers}, {cfg.describe()}"
        save_png(attention_figure(artifact_attention(art, layer), cfg.grid, query, art.offsets[layer], title,
                                  cfg.padding), target, force=force)
    if json_out:
        emit_json({"path": str(path), "key": art.key, "config": cfg.to_dict(), "version": art.version,
                   "offsets": art.offsets.tolist(), "stats": art.stats, "png": str(png) if png else None})
        return
    typer.echo(f"artifact  {path}")
    typer.echo(f"key       {art.key}   (structinit {art.version}, solved in {art.stats.get('seconds', 0):.3f} s on "
               f"{art.stats.get('device', '?')})")
    typer.echo(f"config    {cfg.canonical_json()}")
    typer.echo(quality_table(art.quality, art.offsets))
    typer.echo("")
    typer.echo(query_attention_text(art, layer, head, query))
    if png is not None:
        typer.echo(f"wrote {png}")


def _show_checkpoint(path: Path, heads: Optional[int], grid: Optional[str], json_out: bool) -> None:
    from structinit.analysis.text import checkpoint_report
    from structinit.geometry.grid import parse_grid
    from structinit.init.checkpoints import describe_checkpoint

    desc = describe_checkpoint(path, heads=heads, grid=parse_grid(grid=grid) if grid else None)
    if json_out:
        emit_json(desc)
    else:
        typer.echo(checkpoint_report(desc))
