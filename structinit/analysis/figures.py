"""Figures a person looks at (matplotlib, written as PNG): every one has a title, labelled axes and
a colour bar with its scale.

Figures are built on :class:`matplotlib.figure.Figure` directly (no pyplot state, no display
needed) and written with :func:`save_png`, atomically, never over an existing file unless asked.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import numpy as np

from structinit.errors import StructinitError, UsageError, param

CMAP = "viridis"


def check_output(path: os.PathLike, force: bool = False, name: str = "png") -> Path:
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

    Each panel has its own colour bar (attention weight, 0 to the panel's maximum)."""
    from matplotlib.figure import Figure

    from structinit.geometry.grid import Grid

    heads, n, _ = attn.shape
    gh, gw = Grid(grid).hw
    qy, qx = divmod(int(query), gw)
    fig = Figure(figsize=(3.4 * heads, 6.4), layout="constrained")
    axes = fig.subplots(2, heads, squeeze=False)
    fig.suptitle(f"{title}\ntop: the attention of query token {query} (row {qy}, col {qx}; white square) over the "
                 "grid, its impulse target circled red; bottom: all queries (rows) x keys (columns)", fontsize=10)
    for h in range(heads):
        top, bottom = axes[0, h], axes[1, h]
        qmap = attn[h, query].reshape(gh, gw)
        im = top.imshow(qmap, cmap=CMAP, vmin=0, vmax=max(float(qmap.max()), 1e-12), interpolation="nearest")
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
        fig.colorbar(im, ax=top, shrink=0.8, label="attention weight")
        im2 = bottom.imshow(attn[h], cmap=CMAP, vmin=0, vmax=max(float(attn[h].max()), 1e-12),
                            interpolation="nearest")
        bottom.set_xlabel("key token")
        bottom.set_ylabel("query token")
        bottom.set_title(f"head {h}: {n} x {n} attention", fontsize=9)
        fig.colorbar(im2, ax=bottom, shrink=0.8, label="attention weight")
    return fig
