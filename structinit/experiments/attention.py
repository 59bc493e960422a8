"""The attention of a grid's models right after initialization, averaged over a batch of real
training images, at the first, middle and last layer, one column per init method: the analogue
of Fig. 3 of "Structured Initialization for Attention in Vision Transformers".

Each model is built and initialized exactly as ``train`` does for the run (same preset, init,
seed; :func:`structinit.training.run_models.initialized_model`), the batch is the run's own
training split (normalized as in training), and the attention is captured from timm's attention
modules by :func:`structinit.analysis.fidelity.attention_fidelity`.

Example::

    entries = grid_attention(expansion, images=64)        # the first column, the first seed
    fig = attention_grid_figure(entries, title="digits")
    print(fidelity_markdown(entries))                     # hit rate and window share per layer
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from structinit.analysis.figures import shown_layers
from structinit.errors import UsageError, param
from structinit.experiments.expand import Cell, Expansion
from structinit.training.run_models import initialized_model, training_images


@dataclass
class AttentionEntry:
    """One init method: its row id and label, the run's settings, and the :class:`Fidelity` of its
    initialized model (``None`` with a ``note`` when the model has no attention to show)."""

    row: str
    label: str
    config: Any
    fidelity: Any = None
    note: Optional[str] = None


def _config_of(ex: Expansion, cell: Cell):
    if cell.config is not None:
        return cell.config
    from structinit.experiments.task import read_run_config

    return read_run_config(ex.run_dir(cell))


def grid_attention(ex: Expansion, column: Optional[Sequence[str]] = None, seed: Optional[int] = None,
                   images: int = 64) -> List[AttentionEntry]:
    """One :class:`AttentionEntry` per row of ``ex`` for the cell in ``column`` (column value ids;
    default: the first column) and ``seed`` (default: the grid's first)."""
    from structinit.analysis.fidelity import init_fidelity

    columns = [tuple(v.id for v in c) for c in ex.spec.column_cells()]
    col = tuple(column) if column is not None else columns[0]
    if col not in columns:
        raise UsageError(f"{param('attention_column')} {'/'.join(col) or '(none)'} is not a column of grid "
                         f"{ex.spec.name}; its columns are {', '.join('/'.join(c) for c in columns)}")
    seed = ex.spec.seeds[0] if seed is None else seed
    if not isinstance(images, int) or images < 1:
        raise UsageError(f"{param('attention_images')} must be at least 1, got {images!r}")
    out = []
    batch_cache: dict = {}
    for row in ex.spec.row_axis.values:
        cell = next((c for c in ex.cells if c.row == row.id and tuple(c.column) == col and c.seed == seed), None)
        if cell is None:
            continue
        config = _config_of(ex, cell)
        model, report, info = initialized_model(config)
        if config.model.family != "vit":
            out.append(AttentionEntry(row.id, row.label, config, None, f"{config.model.name}: no attention"))
            continue
        data_key = (config.dataset, config.train_size, config.val_size, config.data_seed, config.seed, config.data_dir)
        if data_key not in batch_cache:
            batch_cache[data_key] = training_images(config, images)
        fid = init_fidelity(model, batch_cache[data_key], report)
        out.append(AttentionEntry(row.id, row.label, config, fid))
    return out


def attention_grid_figure(entries: List[AttentionEntry], title: str = "attention after initialization",
                          layers: Optional[Sequence[int]] = None):
    """Rows: the first, middle and last layer (or ``layers``); columns: the init methods. Each
    panel is the attention between grid tokens (queries as rows, keys as columns, averaged over
    the images and the heads); all panels share one colour scale (0 to the largest weight shown)
    and one colour bar, so a uniform map is dark, not a bright field of its own scale. A panel's
    title (the method's label, wrapped) gives the share of attention in the ``f x f`` window and,
    for impulse init, the hit rate on the solved offsets."""
    import textwrap

    from matplotlib.figure import Figure

    from structinit.analysis.figures import CMAP

    shown = [e for e in entries if e.fidelity is not None]
    if not shown:
        raise UsageError("no init method of this grid has a model with attention layers to show")
    depth = shown[0].fidelity.layers
    rows = list(layers) if layers is not None else shown_layers(depth)
    fig = Figure(figsize=(2.9 * len(shown) + 1.0, 3.3 * len(rows) + 0.9), layout="constrained")
    axes = fig.subplots(len(rows), len(shown), squeeze=False)
    maps = {e.row: e.fidelity.grid_maps().mean(axis=1) for e in shown}  # [layers, N, N], mean over heads
    top = max(max((float(maps[e.row][l].max()) for e in shown for l in rows if l < e.fidelity.layers),
                  default=0.0), 1e-12)
    im = None
    for j, e in enumerate(shown):
        fid = e.fidelity
        for i, l in enumerate(rows):
            ax = axes[i, j]
            if l >= fid.layers:
                ax.set_visible(False)
                continue
            im = ax.imshow(maps[e.row][l], cmap=CMAP, vmin=0.0, vmax=top, interpolation="nearest")
            label = "\n".join(textwrap.wrap(e.label, 30, break_long_words=False)) or e.label
            text = f"{label}\nlayer {l + 1}/{fid.layers}: window {fid.window_mass[l].mean():.2f}"
            if fid.hit_rate is not None and not np.isnan(fid.hit_rate[l]).all():
                text += f", hit {np.nanmean(fid.hit_rate[l]):.2f}"
            ax.set_title(text, fontsize=8)
            ax.set_xlabel("key token", fontsize=7)
            ax.set_ylabel("query token", fontsize=7)
            ax.tick_params(labelsize=6)
    if im is not None:
        cb = fig.colorbar(im, ax=list(axes.ravel()), shrink=0.6)
        cb.ax.tick_params(labelsize=6)
        cb.set_label("attention weight (one scale for every panel)", fontsize=7)
    skipped = [f"{e.label} ({e.note})" for e in entries if e.fidelity is None]
    f0 = shown[0].fidelity
    fig.suptitle(f"{title}\nattention after initialization, averaged over {f0.images} real training images and "
                 f"the heads ({f0.grid.describe()} tokens, row-major); window: share of attention in the "
                 f"{f0.filter}x{f0.filter} window around the query" + (f"\nnot shown: {', '.join(skipped)}"
                                                                       if skipped else ""), fontsize=9)
    return fig


def column_arg(text: Optional[str]) -> Optional[Tuple[str, ...]]:
    """``"256/h8"`` -> ``("256", "h8")`` (``None`` stays ``None``)."""
    return None if text is None else tuple(p for p in text.split("/") if p)


def fidelity_rows(entries: List[AttentionEntry]) -> List[dict]:
    """Per init method and layer: ``{"row", "label", "layer" (1-based), "hit_rate", "target_mass",
    "window_mass"}`` averaged over heads (``hit_rate``/``target_mass`` ``None`` without solved
    offsets); methods without attention are left out."""
    out = []
    for e in entries:
        if e.fidelity is None:
            continue
        for r in e.fidelity.layer_rows():
            out.append({"row": e.row, "label": e.label, **r, "layer": r["layer"] + 1})
    return out


def fidelity_markdown(entries: List[AttentionEntry]) -> str:
    """A markdown table of :func:`fidelity_rows`: one line per method, hit rate and window share per
    layer."""
    rows = fidelity_rows(entries)
    if not rows:
        return ""
    depth = max(r["layer"] for r in rows)
    head = ["init"] + [f"layer {i}: hit / window" for i in range(1, depth + 1)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in entries:
        mine = {r["layer"]: r for r in rows if r["row"] == e.row}
        if not mine:
            continue
        cells = [f"{'-' if mine[i]['hit_rate'] is None else format(mine[i]['hit_rate'], '.2f')} / "
                 f"{mine[i]['window_mass']:.2f}" if i in mine else "" for i in range(1, depth + 1)]
        lines.append("| " + " | ".join([e.label] + cells) + " |")
    f0 = next(e.fidelity for e in entries if e.fidelity is not None)
    note = (f"On {f0.images} real training images of the run at init. hit: share of query rows whose attention "
            f"peaks on the solved offset (impulse inits; '-' for others); window: share of attention inside the "
            f"{f0.filter}x{f0.filter} window around the query. Both averaged over heads.")
    return note + "\n\n" + "\n".join(lines)


def grid_fidelity_figure(entries: List[AttentionEntry], title: str = "real-data attention fidelity at init"):
    """Two panels against the layer: the hit rate on the solved offset (impulse inits) and the share
    of attention in the ``f x f`` window (every init with attention), one line per method, on the
    real images of :func:`grid_attention`."""
    from matplotlib.figure import Figure

    rows = fidelity_rows(entries)
    shown = [e for e in entries if e.fidelity is not None]
    if not shown:
        raise UsageError("no init method of this grid has a model with attention layers to show")
    fig = Figure(figsize=(10, 4.2), layout="constrained")
    ax_hit, ax_win = fig.subplots(1, 2)
    markers = "osD^vP*Xh"
    for k, e in enumerate(shown):
        mine = [r for r in rows if r["row"] == e.row]
        layers = [r["layer"] for r in mine]
        style = dict(marker=markers[k % len(markers)], label=e.label, color=f"C{k % 10}")
        if all(r["hit_rate"] is not None for r in mine):
            ax_hit.plot(layers, [r["hit_rate"] for r in mine], **style)
        ax_win.plot(layers, [r["window_mass"] for r in mine], **style)
    f0 = shown[0].fidelity
    depth = f0.layers
    for ax, what in ((ax_hit, "hit rate on the solved offset"), (ax_win, f"attention in the {f0.filter}x{f0.filter} "
                                                                       "window")):
        ax.set_xlabel("layer")
        ax.set_ylabel(what)
        ax.set_xticks(range(1, depth + 1))
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    ax_hit.set_title("impulse inits: rows whose attention peaks on the offset", fontsize=9)
    ax_win.set_title("every init: share of attention near the query", fontsize=9)
    handles, labels = ax_win.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=min(len(labels), 4), fontsize=7, frameon=False)
    fig.suptitle(f"{title}\non {f0.images} real training images at init, averaged over the heads "
                 f"({f0.grid.describe()} tokens)", fontsize=10)
    return fig


__all__ = ["grid_attention", "attention_grid_figure", "AttentionEntry", "column_arg", "fidelity_rows",
           "fidelity_markdown", "grid_fidelity_figure"]
