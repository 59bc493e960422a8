"""Figures of a grid report (matplotlib, PNG): every seed visible, means with their spread, the
paper's number where it has one. Built on :class:`matplotlib.figure.Figure` (no display needed)
and written with :func:`structinit.analysis.figures.save_png`.

- :func:`accuracy_figure`: final accuracy per method, one panel per column, each seed a dot (methods
  and columns without a finished seed left out);
- :func:`learning_curve_figure`: accuracy against training-set size (grids with a ``train_size`` axis),
  each line drawn through :func:`gapped_line`;
- :func:`curves_figure`: test accuracy against epoch per method, one panel per column.

So that a figure cannot mislead: the panels of a figure share one accuracy scale (a gap of two
points looks the same in every panel), long labels are wrapped rather than squeezing the panels,
and legends sit outside the data, below or beside the panels.
"""

from __future__ import annotations

import math
import textwrap
from typing import Dict, List, Optional, Tuple

from structinit.experiments.report import GridReport, RunResult, row_label

#: Panels per row of a figure.
PANELS_PER_ROW = 4
#: Labels longer than this (characters) are wrapped onto more lines.
LABEL_WIDTH = 26


def wrap(text: str, width: int = LABEL_WIDTH) -> str:
    """``text`` on lines of at most ``width`` characters (a word longer than that stays whole)."""
    return "\n".join(textwrap.wrap(str(text), width, break_long_words=False, break_on_hyphens=False)) or str(text)


def _limits(values: List[float], pad: float = 0.06) -> Optional[Tuple[float, float]]:
    """Axis limits that hold every value with a margin (``None`` without values)."""
    if not values:
        return None
    lo, hi = min(values), max(values)
    span = max(hi - lo, 1.0)
    return lo - pad * span, hi + pad * span


def _colors(n: int) -> List:
    """``n`` distinct colours: tab10's; tab20's past ten; tab20, tab20b and tab20c's past twenty (60);
    past that, ``n`` points evenly along turbo (no two lines of one figure alike)."""
    from matplotlib import colormaps

    if n <= 20:
        cmap = colormaps["tab10" if n <= 10 else "tab20"]
        return [cmap(i) for i in range(n)]
    table = [colormaps[name](i) for name in ("tab20", "tab20b", "tab20c") for i in range(20)]
    if n <= len(table):
        return table[:n]
    return [colormaps["turbo"](i / (n - 1)) for i in range(n)]


#: Width (inches) of the legend column beside the panels, and height of one of its text lines.
LEGEND_WIDTH, LEGEND_LINE = 3.6, 0.155


def _legend_lines(labels: List[str]) -> float:
    """The height (inches) a one-column legend of ``labels`` takes (each entry its lines and a gap)."""
    return sum(LEGEND_LINE * (label.count("\n") + 1) + 0.09 for label in labels) + 0.4


def _handles_labels(axes) -> Tuple[list, List[str]]:
    """Each label drawn in any of ``axes`` once, with its first handle (what one figure legend shows)."""
    handles, labels = [], []
    for ax in axes:
        for h, label in zip(*ax.get_legend_handles_labels()):
            if label not in labels:
                handles.append(h)
                labels.append(label)
    return handles, labels


def _legend_right(fig, axes) -> None:
    """One legend for the figure, in a column right of the panels (never over the data)."""
    handles, labels = _handles_labels(axes)
    if handles:  # on the first row's last panel, so that the layout keeps it below the figure's title
        top_right = axes[min(len(axes), PANELS_PER_ROW) - 1]
        top_right.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, ncols=1,
                         fontsize=8, frameon=False)


def _panels(n: int, width: float, height: float, extra_width: float = 0.0, **share):
    from matplotlib.figure import Figure

    cols = min(n, PANELS_PER_ROW)
    rows = math.ceil(n / cols)
    fig = Figure(figsize=(width * cols + extra_width, height * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False, **share)
    flat = [ax for row in axes for ax in row]
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def _legend_below(fig, axes) -> None:
    """One legend for the figure, below the panels (never over the data)."""
    handles, labels = _handles_labels(axes)
    if handles:
        fig.legend(handles, labels, loc="outside lower center", ncols=min(len(labels), 4), fontsize=8,
                   frameon=False)


def _by_cell(rep: GridReport) -> Dict[Tuple[str, Tuple[str, ...]], List[RunResult]]:
    out: Dict[Tuple[str, Tuple[str, ...]], List[RunResult]] = {}
    for r in rep.runs:
        out.setdefault((r.row, r.column), []).append(r)
    return out


def _subtitle(rep: GridReport) -> str:
    n = len(rep.spec.seeds)
    done = {c.n for c in rep.cells.values() if c.n}
    count = f"{n}" if done <= {n} else f"{min(done)}-{max(done)} of {n}"
    return f"{rep.name}: final-epoch test accuracy, {count} seed{'s' if n > 1 else ''} per cell"


def finished_rows_and_columns(rep: GridReport) -> Tuple[List[str], List[Tuple[str, ...]]]:
    """The rows (methods) and the columns of ``rep`` that hold at least one finished seed, in the
    grid's order: what :func:`accuracy_figure` draws."""
    done = {key for key, st in rep.cells.items() if st.n}
    rows = [row for row in rep.rows if any((row, col) in done for col in rep.columns)]
    columns = [col for col in rep.columns if any((row, col) in done for row in rep.rows)]
    return rows, columns


def accuracy_figure(rep: GridReport):
    """One panel per column: a row per method, each finished seed a dot, the mean ± std as a bar,
    the paper's number as a red cross; the seeds of a cell that have not finished as ``(k/n)`` at
    the panel's right edge. Every panel has the same accuracy scale; the method names, wrapped, are
    written once per row of panels; the legend is below the panels. A method or a column without
    a single finished seed is left out (named in the title), so no panel is drawn empty; ``None``
    when no run has finished."""
    from matplotlib.transforms import blended_transform_factory

    ex = rep.ex
    rows, columns = finished_rows_and_columns(rep)
    if not columns:
        return None
    by_cell = _by_cell(rep)
    labels = [wrap(row_label(rep, row)) for row in reversed(rows)]
    lines = max((label.count("\n") + 1 for label in labels), default=1)
    height = max(0.45, 0.16 * lines + 0.22) * len(rows) + 1.7
    label_width = 0.075 * max((len(line) for label in labels for line in label.splitlines()), default=10)
    fig, axes = _panels(len(columns), 3.2, height, extra_width=label_width, sharey=True)
    colors = dict(zip(rep.rows, _colors(len(rep.rows))))  # a method's colour as in the other figures
    values: List[float] = []
    for ax, col in zip(axes, columns):
        for i, row in enumerate(rows):
            y = len(rows) - 1 - i
            runs = by_cell.get((row, col), [])
            accs = [r.final_acc for r in runs if r.final_acc is not None]
            st = rep.cells[(row, col)]
            if accs:
                mean = st.final_mean
                assert mean is not None  # the cell's mean is over these same finished runs
                values += accs
                jitter = [(k - (len(accs) - 1) / 2) * 0.08 for k in range(len(accs))]
                ax.scatter(accs, [y + j for j in jitter], s=18, color=colors[row], alpha=0.8, zorder=3,
                           label="each seed")
                ax.errorbar([mean], [y], xerr=[st.final_std or 0.0], fmt="|", color="black", markersize=14,
                            capsize=4, zorder=4, label="mean ± std")
                values += [mean - (st.final_std or 0.0), mean + (st.final_std or 0.0)]
            if st.paper is not None:
                values.append(st.paper)
                ax.scatter([st.paper], [y], marker="x", color="red", s=40, zorder=5, label="the paper's number")
            if st.n < st.expected:
                ax.text(1.0, y, f" {st.n}/{st.expected}", fontsize=7, va="center", ha="left", color="0.35",
                        transform=blended_transform_factory(ax.transAxes, ax.transData))
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels(labels, fontsize=8)
        ax.set_ylim(-0.6, len(rows) - 0.4)
        ax.set_xlabel("test accuracy after\nthe last epoch (%)", fontsize=8)
        ax.set_title(wrap(ex.column_label(col), 30), fontsize=9)
        ax.grid(axis="x", alpha=0.3)
        ax.tick_params(axis="x", labelsize=8)
    limits = _limits(values)
    for ax in axes:
        if limits:
            ax.set_xlim(*limits)  # one accuracy scale for every panel
        if ax.get_subplotspec().colspan.start != 0:
            ax.tick_params(axis="y", labelleft=False)
    _legend_below(fig, axes)
    fig.suptitle(f"{rep.spec.title}\n{_subtitle(rep)}; k/n at the right: only k of n seeds finished; one accuracy "
                 "scale for every panel" + _left_out(rep, rows, columns), fontsize=10)
    return fig


def _left_out(rep: GridReport, rows: List[str], columns: List[Tuple[str, ...]]) -> str:
    """A title line naming the methods and columns a figure leaves out for want of a finished seed
    (empty when none is)."""
    parts = []
    methods = [row_label(rep, row) for row in rep.rows if row not in rows]
    if methods:
        parts.append("methods " + "; ".join(methods))
    panels = [rep.ex.column_label(col) for col in rep.columns if col not in columns]
    if panels:
        parts.append("columns " + "; ".join(panels))
    return "\n" + wrap("not shown, no seed finished yet: " + "; ".join(parts), 120) if parts else ""


def gapped_line(points: List[Optional[Tuple[float, float, float]]]) -> Tuple[List[float], List[float], List[float]]:
    """``xs, means, stds`` of one learning-curve line from ``points``, one per column in axis order:
    ``(images, mean, std)`` for a measured cell, ``None`` for a cell without finished runs. A missing
    cell between two measured ones becomes a NaN, which breaks the line there: a line drawn across
    it would suggest values that were never measured. Missing cells at either end are dropped."""
    line: List[Tuple[float, float, float]] = []
    for point in points:
        if point is not None:
            line.append(point)
        elif line and not math.isnan(line[-1][0]):
            line.append((math.nan, math.nan, math.nan))
    while line and math.isnan(line[-1][0]):
        line.pop()
    return [p[0] for p in line], [p[1] for p in line], [p[2] for p in line]


def learning_curve_figure(rep: GridReport):
    """Accuracy against the number of training images (log scale), one line per method (mean ±
    std), every seed a faint dot, the line broken where a size has no finished run; one panel per
    value of the other column axes. ``None`` when the grid has no ``train_size`` axis among its
    columns."""
    axis_name = rep.learning_curve_axis()
    if axis_name is None:
        return None
    spec = rep.spec
    names = list(spec.columns)
    k = names.index(axis_name)
    others = sorted({c[:k] + c[k + 1:] for c in rep.columns}, key=lambda o: [c[:k] + c[k + 1:] for c in
                                                                             rep.columns].index(o))
    by_cell = _by_cell(rep)
    labels = [wrap(row_label(rep, row), 40) for row in rep.rows]
    panel_rows = math.ceil(len(others) / min(len(others), PANELS_PER_ROW))
    # The legend beside the panels sets the figure's height when it is the taller: the panels then grow
    # with it rather than shrink under it.
    height = max(4.2, (_legend_lines(labels) + 1.0) / panel_rows)
    fig, axes = _panels(len(others), 6.0, height, extra_width=LEGEND_WIDTH)
    colors = _colors(len(rep.rows))
    values: List[float] = []
    for ax, other in zip(axes, others):
        cols = [c for c in rep.columns if c[:k] + c[k + 1:] == other]
        for i, row in enumerate(rep.rows):
            points: List[Optional[Tuple[float, float, float]]] = []
            for col in cols:
                accs = [r.final_acc for r in by_cell.get((row, col), []) if r.final_acc is not None]
                sizes = [r.train_images for r in by_cell.get((row, col), []) if r.train_images]
                if not accs or not sizes:
                    points.append(None)
                    continue
                n = sizes[0]
                ax.scatter([n] * len(accs), accs, s=10, color=colors[i], alpha=0.35)
                st = rep.cells[(row, col)]
                mean = st.final_mean
                assert mean is not None  # the cell's mean is over these same finished runs
                values.extend(accs + [mean - (st.final_std or 0.0), mean + (st.final_std or 0.0)])
                points.append((n, mean, st.final_std or 0.0))
            xs, means, stds = gapped_line(points)
            if xs:
                ax.errorbar(xs, means, yerr=stds, color=colors[i], marker="o", markersize=4, capsize=3,
                            label=labels[i])
        ax.set_xscale("log")
        sizes = sorted({r.train_images for r in rep.runs if r.train_images})
        if sizes:
            ax.set_xticks(sizes)
            ax.set_xticklabels([str(s) for s in sizes])
            ax.minorticks_off()
        ax.set_xlabel("training images (log scale)")
        ax.set_ylabel("final-epoch test accuracy (%)")
        if other:
            ax.set_title(wrap(" / ".join(spec.axis(n).value(v).label
                                         for n, v in zip(names[:k] + names[k + 1:], other)), 40), fontsize=10)
        ax.grid(alpha=0.3)
    limits = _limits(values)
    for ax in axes:
        if limits:
            ax.set_ylim(*limits)  # one accuracy scale for every panel
    _legend_right(fig, axes)
    width = int(fig.get_figwidth() * 11)  # characters of the title's font on one line of the figure
    fig.suptitle(wrap(f"{spec.title}. {_subtitle(rep)}: mean ± std (bars), each seed a dot", width), fontsize=10)
    return fig


def curves_figure(rep: GridReport):
    """Test accuracy against epoch, one line per method (mean over the finished seeds at each
    evaluated epoch, the band: min to max over seeds), one panel per column. ``None`` without
    finished runs."""
    from matplotlib.ticker import MaxNLocator

    by_cell = _by_cell(rep)
    if not any(r.metrics for r in rep.runs):
        return None
    drawn = [row for row in rep.rows if any(r.final_acc is not None and r.metrics for col in rep.columns
                                            for r in by_cell.get((row, col), []))]
    panel_rows = math.ceil(len(rep.columns) / min(len(rep.columns), PANELS_PER_ROW))
    # As the learning curve's: the legend beside the panels sets the height when it is the taller.
    height = max(3.4, (_legend_lines([wrap(row_label(rep, row), 40) for row in drawn]) + 1.0) / panel_rows)
    fig, axes = _panels(len(rep.columns), 4.2, height, extra_width=LEGEND_WIDTH)
    colors = dict(zip(drawn, _colors(len(drawn))))  # distinct among the rows drawn
    values: List[float] = []
    for ax, col in zip(axes, rep.columns):
        seeds = []
        for row in drawn:
            runs = [r for r in by_cell.get((row, col), []) if r.final_acc is not None and r.metrics]
            if not runs:
                continue
            seeds.append(len(runs))
            per_epoch: Dict[int, List[float]] = {}
            for r in runs:
                for m in r.metrics:
                    if "test_acc" in m:
                        per_epoch.setdefault(int(m["epoch"]), []).append(float(m["test_acc"]))
            epochs = sorted(e for e, v in per_epoch.items() if len(v) == len(runs))
            if not epochs:
                continue
            mean = [sum(per_epoch[e]) / len(per_epoch[e]) for e in epochs]
            ax.plot(epochs, mean, color=colors[row], marker="." if len(epochs) < 30 else None,
                    label=wrap(row_label(rep, row), 40))
            values.extend(v for e in epochs for v in per_epoch[e])
            if len(runs) > 1:
                ax.fill_between(epochs, [min(per_epoch[e]) for e in epochs], [max(per_epoch[e]) for e in epochs],
                                color=colors[row], alpha=0.15, linewidth=0)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("epoch")
        ax.set_ylabel("test accuracy (%)")
        count = "" if not seeds else f" ({min(seeds)} seed{'s' if max(seeds) > 1 else ''})" if min(seeds) == max(
            seeds) else f" ({min(seeds)}-{max(seeds)} seeds)"
        ax.set_title(wrap(rep.ex.column_label(col) + count, 40), fontsize=10)
        ax.grid(alpha=0.3)
        if not ax.get_legend_handles_labels()[0]:
            ax.text(0.5, 0.5, "no finished runs yet", ha="center", va="center", transform=ax.transAxes, color="0.5")
    limits = _limits(values)
    for ax in axes:
        if limits:
            ax.set_ylim(*limits)  # one accuracy scale for every panel
    _legend_right(fig, axes)
    fig.suptitle(f"{rep.spec.title}\n{rep.name}: test accuracy at every evaluated epoch, mean over seeds "
                 "(band: min to max; in brackets: seeds per method)", fontsize=10)
    return fig


def report_figures(rep: GridReport) -> Dict[str, object]:
    """The figures that apply to ``rep``: ``{"accuracy": fig, "learning-curve": fig, "curves": fig}``."""
    out: Dict[str, Optional[object]] = {"accuracy": accuracy_figure(rep), "learning-curve":
                                        learning_curve_figure(rep), "curves": curves_figure(rep)}
    return {k: v for k, v in out.items() if v is not None}


__all__ = ["accuracy_figure", "finished_rows_and_columns", "gapped_line", "learning_curve_figure", "curves_figure",
           "report_figures"]
