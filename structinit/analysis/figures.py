"""Figures a person looks at (matplotlib, written as PNG): every one has a title, labelled axes and
a colour bar with its scale. An attention figure has one colour scale for all its panels (0 to the
largest weight shown), so a uniform map looks uniform and dark beside a sharp one instead of
filling its own scale.

Figures are built on :class:`matplotlib.figure.Figure` directly (no pyplot state, no display
needed) and written with :func:`save_png`, atomically, never over an existing file unless asked.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

import numpy as np

from structinit.errors import StructinitError, UsageError, param

CMAP = "viridis"


def check_output(path: Union[str, os.PathLike], force: bool = False, name: str = "png") -> Path:
    """``path`` as a :class:`~pathlib.Path` if a file may be written there: a non-empty name, an
    existing folder, and no existing file unless ``force`` (then a regular file only)."""
    if path is None or str(path).strip() == "":
        raise UsageError(f"{param(name)} needs a file name")
    path = Path(path).expanduser()
    if path.is_dir():
        raise UsageError(f"{param(name)} {path} is a folder; give a file name")
    if path.suffix.lower() != ".png":
        raise UsageError(f"{param(name)} {path}: give a file name ending in .png (a PNG is what is written)")
    if not path.parent.is_dir():
        raise UsageError(f"{param(name)}: folder {path.parent} does not exist")
    if path.exists() and (not force or not path.is_file()):
        raise UsageError(f"{param(name)} {path} already exists; choose another name"
                         + (f" or pass {param('force')} to replace it" if path.is_file() else ""))
    return path


def save_png(fig, path: os.PathLike, dpi: int = 110, force: bool = False) -> Path:
    """Write ``fig`` as a PNG at ``path`` atomically (a temp file beside it, then moved into place):
    created exclusively, so an existing file (say, one another process wrote meanwhile) is never
    replaced unless ``force``. Nothing is left behind on failure (a full or read-only disk)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from structinit.atomic import OutputExists, atomic_write

    path = Path(path)
    FigureCanvasAgg(fig)
    try:
        with atomic_write(path, exclusive=not force) as fh:
            fig.savefig(fh, format="png", dpi=dpi, bbox_inches="tight")
    except OutputExists:
        raise StructinitError(f"{path} appeared while the figure was drawn (another process?); not replaced") from None
    except OSError as exc:
        raise StructinitError(f"cannot write {path}: {exc.strerror or exc}") from None
    return path


def attention_figure(attn: np.ndarray, grid, query: int, offsets: Optional[np.ndarray] = None,
                     title: str = "attention", padding: str = "zero"):
    """One column per head: the query token's attention over the token grid (top; the query marked
    with a white square, the impulse target with a red circle) and the full ``N x N`` attention
    matrix (bottom; rows are queries). ``attn: [heads, N, N]``, ``offsets: [heads, 2]``.

    One colour scale for every panel (attention weight, 0 to the largest weight in the figure),
    with one colour bar. A sequence (a 1-D grid) is drawn by :func:`band_figure`."""
    from matplotlib.figure import Figure

    from structinit.geometry.grid import Grid

    if Grid(grid).ndim == 1:
        return band_figure(attn, query, offsets, title, padding)
    heads, n, _ = attn.shape
    gh, gw = Grid(grid).hw
    qy, qx = divmod(int(query), gw)
    fig = Figure(figsize=(3.0 * heads + 1.0, 6.4), layout="constrained")
    axes = fig.subplots(2, heads, squeeze=False)
    top_weight = max(float(attn.max()), 1e-12)  # one scale for the figure
    fig.suptitle(f"{title}\ntop: the attention of query token {query} (row {qy}, col {qx}; white square) over the "
                 "grid, its impulse target circled red; bottom: all queries (rows) x keys (columns)", fontsize=10)
    for h in range(heads):
        top, bottom = axes[0, h], axes[1, h]
        qmap = attn[h, query].reshape(gh, gw)
        im = top.imshow(qmap, cmap=CMAP, vmin=0, vmax=top_weight, interpolation="nearest")
        head_title = f"head {h}"
        top.plot(qx, qy, marker="s", markersize=9, markerfacecolor="none", markeredgecolor="white", markeredgewidth=2)
        if offsets is not None:
            dy, dx = (int(v) for v in offsets[h])
            head_title += f", offset (dy={dy}, dx={dx})"
            ty, tx = qy + dy, qx + dx
            if padding == "circular":
                ty, tx = ty % gh, tx % gw
            if 0 <= ty < gh and 0 <= tx < gw:
                top.plot(tx, ty, marker="o", markersize=10, markerfacecolor="none", markeredgecolor="red",
                         markeredgewidth=2)
        top.set_title(head_title, fontsize=9)
        top.set_xlabel("token column x")
        top.set_ylabel("token row y")
        bottom.imshow(attn[h], cmap=CMAP, vmin=0, vmax=top_weight, interpolation="nearest")
        bottom.set_xlabel("key token")
        bottom.set_ylabel("query token")
        bottom.set_title(f"head {h}: {n} x {n} attention", fontsize=9)
    fig.colorbar(im, ax=list(axes.ravel()), shrink=0.6, label="attention weight\n(one scale for every panel)")
    return fig


def band_figure(attn: np.ndarray, query: int, offsets: Optional[np.ndarray] = None, title: str = "attention",
                padding: str = "zero", reach: Optional[int] = None):
    """1-D attention, one column per head: the query token's attention over the sequence (top; the
    query a dashed grey line, the impulse target a red circle) and the attention of every query as a
    band (bottom): row ``q`` shows the attention on keys ``q + r`` for relative positions ``r`` in
    ``-reach .. reach`` (default: 8, or more to hold every offset), so an impulse filter is a bright
    column at its offset ``dx``, marked by dashed red lines. ``attn: [heads, L, L]``,
    ``offsets: [heads, 2]`` as ``(0, dx)``. The bands share one colour scale (attention weight, 0
    to the largest weight in any of them) and one colour bar; keys outside the sequence are blank
    (with ``circular`` padding they wrap around)."""
    from matplotlib.figure import Figure

    heads, n, _ = attn.shape
    dxs = [int(o[-1]) for o in offsets] if offsets is not None else []
    reach = band_reach(n, dxs, reach)
    fig = Figure(figsize=(3.6 * heads, 7.0), layout="constrained")
    axes = fig.subplots(2, heads, squeeze=False, gridspec_kw={"height_ratios": [1, 2]})
    fig.suptitle(f"{title}\ntop: the attention of query token {query} (dashed line) over the sequence, its impulse "
                 "target circled red; bottom: every query's attention by relative position key - query (the band), "
                 "the head's offset between dashed red lines (blank: keys outside the sequence)", fontsize=10)
    positions = np.arange(n)
    bands = [relative_band(attn[h], reach, padding) for h in range(heads)]
    band_top = max(max(float(np.nanmax(b)) if np.isfinite(b).any() else 0.0 for b in bands), 1e-12)
    weight_top = max(float(attn[:, query].max()) * 1.15, 1e-12)
    for h in range(heads):
        top, bottom = axes[0, h], axes[1, h]
        top.bar(positions, attn[h, query], width=1.0, color="tab:blue")
        top.axvline(query, color="grey", linestyle="--", linewidth=1)
        head_title = f"head {h}"
        dx = dxs[h] if dxs else None
        if dx is not None:
            head_title += f", offset dx={dx:+d}"
            target = query + dx
            if padding == "circular":
                target %= n
            if 0 <= target < n:
                top.plot(target, attn[h, query, target], marker="o", markersize=10, markerfacecolor="none",
                         markeredgecolor="red", markeredgewidth=2)
        top.set_title(head_title, fontsize=9)
        top.set_xlim(-0.5, n - 0.5)
        top.set_ylim(0, weight_top)  # one scale for every head
        top.set_xlabel("key position")
        top.set_ylabel("attention weight")
        im = bottom.imshow(bands[h], cmap=CMAP, vmin=0, vmax=band_top, aspect="auto",
                           interpolation="nearest", extent=(-reach - 0.5, reach + 0.5, n - 0.5, -0.5))
        if dx is not None:
            for edge in (dx - 0.5, dx + 0.5):
                bottom.axvline(edge, color="red", linestyle="--", linewidth=1)
        bottom.set_xlabel("relative position (key - query)")
        bottom.set_ylabel("query position")
        bottom.set_title(f"head {h}: the band, {2 * reach + 1} relative positions", fontsize=9)
    fig.colorbar(im, ax=list(axes[1]), shrink=0.8, label="attention weight\n(one scale for every band)")
    return fig


def band_reach(n: int, dxs: Sequence[int] = (), reach: Optional[int] = None) -> int:
    """How many relative positions either side a band shows: ``reach`` (default 8, or more to hold
    every offset ``dxs`` with a position to spare), at most ``n - 1``."""
    reach = int(reach or max([8] + [abs(int(d)) + 2 for d in dxs]))
    return max(1, min(reach, n - 1))


def relative_band(attn: np.ndarray, reach: int, padding: str = "zero") -> np.ndarray:
    """One head's ``[L, L]`` attention by relative position: ``[L, 2 * reach + 1]``, row ``q``
    holding the attention on keys ``q - reach .. q + reach``; NaN for keys outside the sequence
    (with ``circular`` padding they wrap around)."""
    n = attn.shape[-1]
    rel = np.arange(-reach, reach + 1)
    queries = np.arange(n)
    keys = queries[:, None] + rel[None, :]
    if padding == "circular":
        keys, inside = keys % n, np.ones(keys.shape, dtype=bool)
    else:
        inside = (keys >= 0) & (keys < n)
    return np.where(inside, attn[queries[:, None], np.clip(keys, 0, n - 1)], np.nan)


def shown_layers(depth: int) -> List[int]:
    """The first, middle and last layer (0-based; fewer when the model has fewer)."""
    return sorted({0, (depth - 1) // 2, depth - 1})


def fidelity_figure(fid, query: Optional[int] = None, layers: Optional[Sequence[int]] = None,
                    title: str = "attention after initialization on real inputs"):
    """The analogue of Fig. 3 of the structured-initialization paper for one model: rows are the
    first, middle and last layer (or ``layers``), columns the heads. ``fid``: a
    :class:`~structinit.analysis.fidelity.Fidelity` with its maps kept.

    On an image grid each panel is the attention of query token ``query`` (default: the centre
    token; white square) over the ``H x W`` grid of keys, averaged over the real inputs, with the
    head's impulse target circled red and the ``f x f`` window dashed. On a sequence each panel is
    the head's band: every query's attention by relative position ``key - query`` (as in
    :func:`band_figure`), the offset between dashed red lines. One colour scale for the figure
    (attention weight, 0 to the largest weight shown) and one colour bar, so layers and heads
    compare at a glance. Panel titles give the head's hit rate, target mass and window share over
    all queries and inputs."""
    from matplotlib.figure import Figure

    rows = list(layers) if layers is not None else shown_layers(fid.layers)
    bad = [l for l in rows if not 0 <= l < fid.layers]
    if bad:
        raise UsageError(f"{param('layers')} {bad} are out of range: the model has {fid.layers} attention layers")
    view = _FidelityPanels.of(fid, query, rows)
    heads = fid.heads
    fig = Figure(figsize=(2.9 * heads + 1.2, (3.6 if view.seq else 3.3) * len(rows) + 1.5), layout="constrained")
    axes = fig.subplots(len(rows), heads, squeeze=False)
    for i, l in enumerate(rows):
        for h in range(heads):
            im = view.draw(axes[i, h], l, h)
    cb = fig.colorbar(im, ax=list(axes.ravel()), shrink=0.6)
    cb.set_label("attention weight (one scale for every panel)", fontsize=7)
    cb.ax.tick_params(labelsize=6)
    fig.suptitle(view.suptitle(title, rows), fontsize=9)
    return fig


@dataclass
class _FidelityPanels:
    """What the panels of :func:`fidelity_figure` show. ``fid``: the Fidelity; ``q``: the query token
    (row-major); ``panels[layer][head]``: the query's ``[H, W]`` map on an image grid, the head's
    ``[L, 2 * reach + 1]`` band on a sequence; ``top``: the figure's one colour scale (its largest
    weight); ``targets``: ``[layers, heads, 2]`` the query's target ``(y, x)`` per head, or ``None``."""

    fid: Any
    seq: bool
    q: int
    targets: Optional[np.ndarray]
    panels: Dict[int, List[np.ndarray]]
    top: float
    reach: int = 0

    @classmethod
    def of(cls, fid: Any, query: Optional[int], rows: List[int]) -> "_FidelityPanels":
        from structinit.analysis.fidelity import centre_query

        seq = fid.grid.ndim == 1
        q = centre_query(fid.grid) if query is None else int(query)
        qmaps = fid.query_maps(q)  # [layers, heads, *grid]
        targets = fid.targets(q)
        offsets = fid.offsets
        reach = 0
        if seq:
            dxs = [int(d) for d in offsets[..., 1].ravel() if d != -9999] if offsets is not None else []
            reach = band_reach(fid.grid.tokens, dxs)
            bands = fid.grid_maps()
            panels = {l: [relative_band(bands[l, h], reach, fid.padding) for h in range(fid.heads)] for l in rows}
        else:
            panels = {l: [qmaps[l, h] for h in range(fid.heads)] for l in rows}
        top = max(max(float(np.nanmax(p)) if np.isfinite(p).any() else 0.0 for ps in panels.values() for p in ps),
                  1e-12)  # one scale for the figure
        return cls(fid, seq, q, targets, panels, top, reach)

    def draw(self, ax: Any, l: int, h: int) -> Any:
        """Draw head ``h`` of layer ``l`` into ``ax``; returns its image (for the colour bar)."""
        fid, offsets = self.fid, self.fid.offsets
        has_offset = offsets is not None and not (offsets[l] == -9999).any()
        text = f"layer {l}, head {h}"
        if has_offset:
            dy, dx = (int(v) for v in offsets[l, h])
            text += f": offset dx={dx:+d}" if self.seq else f": offset ({dy:+d},{dx:+d})"
        stats = [f"window {fid.window_mass[l, h]:.2f}"]
        if fid.hit_rate is not None and not np.isnan(fid.hit_rate[l, h]):
            stats = [f"hit {fid.hit_rate[l, h]:.2f}", f"mass {fid.target_mass[l, h]:.2f}", *stats]
        ax.set_title(text + "\n" + ", ".join(stats), fontsize=8)
        if self.seq:
            reach = self.reach
            im = ax.imshow(self.panels[l][h], cmap=CMAP, vmin=0, vmax=self.top, aspect="auto",
                           interpolation="nearest", extent=(-reach - 0.5, reach + 0.5, fid.grid.tokens - 0.5, -0.5))
            if has_offset:
                for edge in (dx - 0.5, dx + 0.5):
                    ax.axvline(edge, color="red", linestyle="--", linewidth=1)
            ax.set_xlabel("relative position (key - query)", fontsize=7)
            ax.set_ylabel("query position", fontsize=7)
        else:
            im = self._draw_grid_panel(ax, l, h)
        ax.tick_params(labelsize=6)
        return im

    def _draw_grid_panel(self, ax: Any, l: int, h: int) -> Any:
        """An image grid's panel: the query's map, the query (white square), its window (dashed) and
        the head's target (red circle)."""
        from matplotlib.patches import Rectangle

        fid, targets = self.fid, self.targets
        qy, qx = divmod(self.q, fid.grid.hw[1])
        lo = -(fid.filter // 2)
        im = ax.imshow(self.panels[l][h], cmap=CMAP, vmin=0, vmax=self.top, interpolation="nearest")
        ax.plot(qx, qy, marker="s", markersize=8, markerfacecolor="none", markeredgecolor="white",
                markeredgewidth=1.5)
        ax.add_patch(Rectangle((qx + lo - 0.5, qy + lo - 0.5), fid.filter, fid.filter, fill=False,
                               edgecolor="white", linestyle="--", linewidth=1))
        if targets is not None and targets[l, h, 0] >= 0:
            ty, tx = (int(v) for v in targets[l, h])
            ax.plot(tx, ty, marker="o", markersize=10, markerfacecolor="none", markeredgecolor="red",
                    markeredgewidth=2)
        ax.set_xlabel("key column x", fontsize=7)
        ax.set_ylabel("key row y", fontsize=7)
        return im

    def suptitle(self, title: str, rows: List[int]) -> str:
        """The figure's title: ``title``, the layers shown, what a panel shows and what its title measures."""
        fid, q = self.fid, self.q
        gh, gw = fid.grid.hw
        qy, qx = divmod(q, gw)
        solved = fid.offsets is not None
        if self.seq:
            what = (f"each head's attention by relative position (key - query), for every query position of the "
                    f"{fid.grid.tokens}-token sequence"
                    + ("; the solved offset between dashed red lines" if solved else ""))
        else:
            what = (f"the attention of query token {q} (row {qy}, col {qx}; white square) over the {gh}x{gw} grid "
                    f"of keys; dashed box: the {fid.filter}x{fid.filter} window"
                    + ("; red circle: the query's target under the head's solved offset" if solved else ""))
        window = f"{fid.filter} positions around the query" if self.seq else f"{fid.filter}x{fid.filter} window"
        measured = "hit rate and target mass on its solved offset and its share" if solved else "share"
        return (f"{title}\nrows: layers {', '.join(map(str, rows))} of 0-{fid.layers - 1}, averaged over "
                f"{fid.images} real inputs\n{what}\npanel titles: the head's {measured} of attention in the "
                f"{window}, over all queries and inputs")
