"""Figures of a grid report (matplotlib, PNG): every seed visible, means with their spread, the
paper's number where it has one. Built on :class:`matplotlib.figure.Figure` (no display needed)
and written with :func:`structinit.analysis.figures.save_png`.

- :func:`accuracy_figure`: final accuracy per method, one panel per column, each seed a dot;
- :func:`learning_curve_figure`: accuracy against training-set size (grids with a ``train_size`` axis);
- :func:`curves_figure`: test accuracy against epoch per method, one panel per column.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

from structinit.bench.report import GridReport, RunResult

#: Panels per row of a figure.
PANELS_PER_ROW = 4


def _colors(n: int) -> List:
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    return [cmap(i % 10) for i in range(n)]


def _panels(n: int, width: float, height: float):
    from matplotlib.figure import Figure

    cols = min(n, PANELS_PER_ROW)
    rows = math.ceil(n / cols)
    fig = Figure(figsize=(width * cols, height * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def _by_cell(rep: GridReport) -> Dict[Tuple[str, Tuple[str, ...]], List[RunResult]]:
    out: Dict[Tuple[str, Tuple[str, ...]], List[RunResult]] = {}
    for r in rep.runs:
        out.setdefault((r.row, r.column), []).append(r)
    return out


def _subtitle(rep: GridReport) -> str:
    n = len(rep.spec.seeds)
    done = {c.n for c in rep.cells.values() if c.n}
    count = f"{n}" if done <= {n} else f"{min(done)}-{max(done)} of {n}"
    return f"{rep.spec.name}: final-epoch test accuracy, {count} seed{'s' if n > 1 else ''} per cell"


def accuracy_figure(rep: GridReport):
    """One panel per column: a row per method, each finished seed a dot, the mean ± std as a bar,
    the paper's number as a red cross; unfinished seeds counted in the method's label."""
    ex = rep.ex
    rows, columns = rep.rows, rep.columns
    by_cell = _by_cell(rep)
    fig, axes = _panels(len(columns), 4.6, 0.5 * len(rows) + 1.6)
    colors = _colors(len(rows))
    labelled = set()

    def label_once(name: str) -> Optional[str]:
        if name in labelled:
            return None
        labelled.add(name)
        return name

    for ax, col in zip(axes, columns):
        for i, row in enumerate(rows):
            y = len(rows) - 1 - i
            runs = by_cell.get((row, col), [])
            accs = [r.final_acc for r in runs if r.final_acc is not None]
            st = rep.cells[(row, col)]
            if accs:
                jitter = [(k - (len(accs) - 1) / 2) * 0.08 for k in range(len(accs))]
                ax.scatter(accs, [y + j for j in jitter], s=18, color=colors[i], alpha=0.8, zorder=3,
                           label=label_once("each seed") if ax is axes[0] else None)
                ax.errorbar([st.final_mean], [y], xerr=[st.final_std or 0.0], fmt="|", color="black", markersize=14,
                            capsize=4, zorder=4, label=label_once("mean ± std") if ax is axes[0] else None)
            if st.paper is not None:
                ax.scatter([st.paper], [y], marker="x", color="red", s=40, zorder=5,
                           label=label_once("paper") if ax is axes[0] else None)
        labels = []
        for row in reversed(rows):
            st = rep.cells[(row, col)]
            labels.append(ex.row_label(row) + (f" ({st.n}/{st.expected})" if st.n < st.expected else ""))
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels(labels, fontsize=8)
        ax.set_ylim(-0.6, len(rows) - 0.4)
        ax.set_xlabel("test accuracy after the last epoch (%)")
        ax.set_title(ex.column_label(col), fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    if axes:
        axes[0].legend(fontsize=7, loc="best")
    fig.suptitle(f"{rep.spec.title}\n{_subtitle(rep)}; (k/n): k of n seeds finished", fontsize=10)
    return fig


def learning_curve_figure(rep: GridReport):
    """Accuracy against the number of training images (log scale), one line per method (mean ±
    std), every seed a faint dot; one panel per value of the other column axes. ``None`` when the
    grid has no ``train_size`` axis among its columns."""
    axis_name = rep.learning_curve_axis()
    if axis_name is None:
        return None
    spec, ex = rep.spec, rep.ex
    names = list(spec.columns)
    k = names.index(axis_name)
    others = sorted({c[:k] + c[k + 1:] for c in rep.columns}, key=lambda o: [c[:k] + c[k + 1:] for c in
                                                                             rep.columns].index(o))
    by_cell = _by_cell(rep)
    fig, axes = _panels(len(others), 6.0, 4.2)
    colors = _colors(len(rep.rows))
    for ax, other in zip(axes, others):
        cols = [c for c in rep.columns if c[:k] + c[k + 1:] == other]
        for i, row in enumerate(rep.rows):
            xs, means, stds = [], [], []
            for col in cols:
                runs = [r for r in by_cell.get((row, col), []) if r.final_acc is not None]
                sizes = [r.train_images for r in by_cell.get((row, col), []) if r.train_images]
                if not runs or not sizes:
                    continue
                n = sizes[0]
                ax.scatter([n] * len(runs), [r.final_acc for r in runs], s=10, color=colors[i], alpha=0.35)
                st = rep.cells[(row, col)]
                xs.append(n)
                means.append(st.final_mean)
                stds.append(st.final_std or 0.0)
            if xs:
                ax.errorbar(xs, means, yerr=stds, color=colors[i], marker="o", markersize=4, capsize=3,
                            label=ex.row_label(row))
        ax.set_xscale("log")
        sizes = sorted({r.train_images for r in rep.runs if r.train_images})
        if sizes:
            ax.set_xticks(sizes)
            ax.set_xticklabels([str(s) for s in sizes])
            ax.minorticks_off()
        ax.set_xlabel("training images (log scale)")
        ax.set_ylabel("test accuracy after the last epoch (%)")
        if other:
            ax.set_title(" / ".join(spec.axis(n).value(v).label for n, v in zip(names[:k] + names[k + 1:], other)),
                         fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"{spec.title}\n{_subtitle(rep)}: mean ± std (bars), each seed a dot", fontsize=10)
    return fig


def curves_figure(rep: GridReport):
    """Test accuracy against epoch, one line per method (mean over the finished seeds at each
    evaluated epoch, the band: min to max over seeds), one panel per column. ``None`` without
    finished runs."""
    from matplotlib.ticker import MaxNLocator

    by_cell = _by_cell(rep)
    if not any(r.metrics for r in rep.runs):
        return None
    fig, axes = _panels(len(rep.columns), 4.6, 3.6)
    colors = _colors(len(rep.rows))
    for ax, col in zip(axes, rep.columns):
        for i, row in enumerate(rep.rows):
            runs = [r for r in by_cell.get((row, col), []) if r.final_acc is not None and r.metrics]
            if not runs:
                continue
            per_epoch: Dict[int, List[float]] = {}
            for r in runs:
                for m in r.metrics:
                    if "test_acc" in m:
                        per_epoch.setdefault(int(m["epoch"]), []).append(float(m["test_acc"]))
            epochs = sorted(e for e, v in per_epoch.items() if len(v) == len(runs))
            if not epochs:
                continue
            mean = [sum(per_epoch[e]) / len(per_epoch[e]) for e in epochs]
            ax.plot(epochs, mean, color=colors[i], marker="." if len(epochs) < 30 else None,
                    label=f"{rep.ex.row_label(row)} ({len(runs)})")
            if len(runs) > 1:
                ax.fill_between(epochs, [min(per_epoch[e]) for e in epochs], [max(per_epoch[e]) for e in epochs],
                                color=colors[i], alpha=0.15, linewidth=0)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("epoch")
        ax.set_ylabel("test accuracy (%)")
        ax.set_title(rep.ex.column_label(col), fontsize=10)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="lower right")
        else:
            ax.text(0.5, 0.5, "no finished runs yet", ha="center", va="center", transform=ax.transAxes, color="0.5")
    fig.suptitle(f"{rep.spec.title}\n{rep.spec.name}: test accuracy at every evaluated epoch, mean over seeds "
                 "(band: min to max; in brackets: seeds)", fontsize=10)
    return fig


def report_figures(rep: GridReport) -> Dict[str, object]:
    """The figures that apply to ``rep``: ``{"accuracy": fig, "learning-curve": fig, "curves": fig}``."""
    out: Dict[str, Optional[object]] = {"accuracy": accuracy_figure(rep), "learning-curve":
                                        learning_curve_figure(rep), "curves": curves_figure(rep)}
    return {k: v for k, v in out.items() if v is not None}


__all__ = ["accuracy_figure", "learning_curve_figure", "curves_figure", "report_figures"]
