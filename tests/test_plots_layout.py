"""The learning-curve figure's layout with many rows: the committed conditioned grid (14 rows, two
sizes, read from its committed runs.csv) keeps its panel at a readable size, its legend beside the
panel and clear of the title, and its axis label clear of the title."""

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GRID = REPO / "docs/results/conditioned/grid.toml"
RUNS = REPO / "docs/results/conditioned/proxy/runs.csv"


def overlap(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


@pytest.fixture(scope="module")
def drawn(tmp_path_factory):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from structinit.experiments.expand import expand
    from structinit.experiments.gridspec import load_grid
    from structinit.experiments.plots import learning_curve_figure
    from structinit.experiments.report import collect, read_runs_csv

    ex = expand(load_grid(str(GRID)), runs_dir=tmp_path_factory.mktemp("none") / "runs", only=["train_size=2000,10000"])
    rep = collect(ex, read_runs_csv(RUNS))
    fig = learning_curve_figure(rep)
    FigureCanvasAgg(fig).draw()
    return rep, fig


def test_many_rows_keep_the_panel_readable_and_the_legend_beside_it(drawn):
    rep, fig = drawn
    (ax,) = [a for a in fig.axes if a.get_visible()]
    legend = ax.get_legend()
    assert len(rep.rows) >= 14 and len(legend.get_texts()) >= 14
    renderer = fig.canvas.get_renderer()
    box, leg = ax.get_window_extent(renderer), legend.get_window_extent(renderer)
    assert ax.get_position().height >= 0.5 and ax.get_position().width >= 0.4
    assert leg.x0 >= box.x1 and leg.y1 <= fig.bbox.y1 and leg.x1 <= fig.bbox.x1  # beside the panel, inside the figure
    title = fig._suptitle.get_window_extent(renderer)
    assert not overlap(title, leg) and not overlap(title, ax.yaxis.label.get_window_extent(renderer))
    assert not overlap(title, box)
    colors = [tuple(line.get_color()) for line in legend.get_lines()]
    assert len(set(colors)) == len(colors)  # no two rows drawn alike


def test_the_curves_figure_with_many_rows_keeps_its_panels_and_puts_its_legend_beside_them(drawn):
    """It put its legend below panels of a fixed height: with 30 rows the layout collapsed (matplotlib
    gave up on it) and the legend covered the panels. Every committed run of the grid is given an
    epoch record here (runs.csv holds none; the layout is what is tested, not the numbers)."""
    import dataclasses
    import warnings

    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from structinit.experiments.plots import curves_figure

    rep, _ = drawn
    runs = [dataclasses.replace(r, metrics=[{"epoch": e, "test_acc": r.final_acc - 2 * (3 - e)} for e in (1, 2, 3)])
            if r.final_acc is not None else r for r in rep.runs]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "constrained_layout not applied" is a warning
        fig = curves_figure(dataclasses.replace(rep, runs=runs))
        FigureCanvasAgg(fig).draw()
    renderer = fig.canvas.get_renderer()
    panels = [a for a in fig.axes if a.get_visible()]
    assert len(panels) == 2
    legend = panels[-1].get_legend()
    assert len(legend.get_texts()) >= 25
    leg = legend.get_window_extent(renderer)
    title = fig._suptitle.get_window_extent(renderer)
    for ax in panels:
        box = ax.get_window_extent(renderer)
        assert ax.get_position().height >= 0.5 and not overlap(box, leg) and not overlap(box, title)
        assert not overlap(title, ax.title.get_window_extent(renderer))
    assert leg.x1 <= fig.bbox.x1 and leg.y1 <= fig.bbox.y1 and not overlap(title, leg)
    colors = [tuple(line.get_color()) for line in legend.get_lines()]
    assert len(set(colors)) == len(colors)  # no two rows drawn alike
