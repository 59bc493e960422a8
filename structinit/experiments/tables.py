"""A grid's report as text: the paper's tables in Markdown (:func:`markdown`: methods as rows,
settings as columns, the final-epoch test accuracy as mean ± std with the seed count, the paired
difference to the baseline, the paper's number beside ours, unfinished cells marked, the best epoch
shown as such) and as CSV (:func:`cells_csv`, :func:`runs_csv`).
"""

from __future__ import annotations

import csv
import io
from collections import Counter
from typing import Callable, Dict, List, Optional, Tuple

from structinit.experiments.aggregate import CellStats, GridReport, row_specs, software_spread
from structinit.experiments.status import STATES
from structinit.runtime import versions_text

# --------------------------------------------------------------------------- text

def _num(x: Optional[float], sign: bool = False) -> str:
    if x is None:
        return "—"
    return f"{x:+.2f}" if sign else f"{x:.2f}"


def _unfinished(c: CellStats) -> str:
    """What a cell without a finished run is waiting for: ``failed`` (every run failed or is
    damaged: a rerun is needed), ``running`` or ``pending``."""
    states = {k for k, n in c.states.items() if n}
    if states and states <= {"failed", "damaged"}:
        return "failed" if "failed" in states else "damaged"
    return "running" if "running" in states else "pending"


def _spread(mean: Optional[float], std: Optional[float], n: int, expected: Optional[int] = None) -> str:
    """``mean ± std``; one value has no spread: ``mean (1/n)``."""
    if mean is None:
        return "—"
    if std is None:
        return f"{mean:.2f} (1/{expected or n})"
    return f"{mean:.2f} ± {std:.2f}"


def _cell_text(c: CellStats, show_paper: bool) -> str:
    if c.n == 0:
        text = f"{_unfinished(c)} (0/{c.expected})"
    else:
        text = _spread(c.final_mean, c.final_std, c.n, c.expected)
        if c.n < c.expected and c.n > 1:
            text += f" ({c.n}/{c.expected})"
    if show_paper and c.paper is not None:
        text += f" [{c.paper:.2f}]"
    return text


def _held_out(rep: "GridReport") -> Optional[bool]:
    """Whether the grid's runs hold a validation split out (``val_size`` above 0), from the runs'
    own settings or the grid's; ``None`` when some do and some do not."""
    sizes = set()
    for cell in rep.ex.cells:
        if cell.config is not None:
            sizes.add(bool(cell.config.val_size))
            continue
        value = rep.ex.overrides.get("val_size", rep.spec.settings.get("val_size", 0))
        if "val_size" not in rep.ex.overrides:
            chosen = dict(zip([rep.spec.rows, *rep.spec.columns], [cell.row, *cell.column]))
            for axis in rep.spec.axes:
                vid = chosen.get(axis.name)
                for v in axis.values:
                    if v.id == vid and "val_size" in v.settings:
                        value = v.settings["val_size"]
        sizes.add(bool(value))
    return sizes.pop() if len(sizes) == 1 else None


def device_kind(device: Optional[str]) -> str:
    """``cuda:1`` -> ``cuda``; ``None`` (a run that did not record it) -> ``unrecorded``."""
    return device.split(":")[0] if device else "unrecorded"


def device_lines(rep: GridReport) -> List[str]:
    """Markdown lines saying where the finished runs trained, and naming the cells whose seeds
    trained on different kinds of device (the run key leaves the device out: it is the same
    experiment, but the accuracies differ in the last digits and the wall times are not comparable);
    none when no run recorded its device."""
    kind = {(r.row, r.column, r.seed): device_kind(r.device) for r in rep.runs if r.state == "finished"}
    kinds = Counter(kind.values())
    if set(kinds) <= {"unrecorded"}:
        return []
    counts = ", ".join(f"{k} ({n} run{'' if n == 1 else 's'})" for k, n in sorted(kinds.items()))
    by_cell: Dict[Tuple[str, Tuple[str, ...]], set] = {}
    for (row, col, _), k in kind.items():
        by_cell.setdefault((row, col), set()).add(k)
    mixed = [f"{rep.ex.row_label(row)} / {rep.ex.column_label(col)}" for (row, col), k in by_cell.items() if len(k) > 1]
    text = f"Trained on: {counts}."
    if mixed:
        text += (f" Seeds trained on different devices are pooled in {len(mixed)} of the cells "
                 f"({'; '.join(mixed[:4])}{'; ...' if len(mixed) > 4 else ''}): the same settings, but their "
                 "accuracies are not from one kind of machine and their wall times are not comparable.")
    return [text, ""]


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def software_lines(rep: GridReport) -> List[str]:
    """Markdown lines flagging a table whose finished runs ran under different versions (naming
    each field that differs and its values), runs that recorded none beside runs that did, and
    reruns whose final accuracy differs from an earlier runs.csv's (naming the versions that
    differ between the two); none when nothing differs."""
    lines = []
    spread = software_spread(rep.runs)
    if spread:
        what = "; ".join(f"{k} " + ", ".join(f"{v} ({_plural(n, 'run')})" for v, n in sorted(c.items()))
                         for k, c in spread.items())
        lines += [f"Ran under different versions: {what}. The run key leaves these out (the same settings), but "
                  "numerical kernels change between versions, so the same run can end a fraction of a point to a "
                  "point apart (docs/reproducing.md).", ""]
    finished = [r for r in rep.runs if r.final_acc is not None]
    unrecorded = sum(1 for r in finished if not r.versions)
    if unrecorded and unrecorded < len(finished):
        lines += [f"{_plural(unrecorded, 'finished run')} of {len(finished)} recorded no versions (made before runs "
                  "recorded them): whether they ran under the versions of the others is not known.", ""]
    for d in rep.reruns:
        lines += [f"Rerun {d['key']} ({d['cell']}): final {d['final_acc']:.4f} here, {d['earlier_acc']:.4f} in "
                  f"`{d['source']}`; {d['why']}.", ""]
    return lines


def _table(header: List[str], rows: List[List[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def markdown(rep: GridReport, figures: Optional[Dict[str, str]] = None, heading: int = 2) -> str:
    """The report of one grid as markdown (``figures``: name -> file name, linked below the tables)."""
    s = rep.spec
    h = "#" * heading
    has_paper = any(c.paper is not None for c in rep.cells.values())
    lines = _intro_lines(rep, h)
    lines += _final_lines(rep, h, has_paper)
    if s.baseline is not None:
        lines += _delta_lines(rep, h, has_paper)
    if any(c.val_mean is not None for c in rep.cells.values()):
        lines += [f"{h}# Final-epoch validation accuracy (%)", "",
                  "On the images held out of training (the same for every seed): the split to make choices on; "
                  "mean ± std.", ""]
        lines += [_grid_table(rep, _spread_rows(rep, lambda c: (c.val_mean, c.val_std))), ""]
    lines += _best_lines(rep, h)
    if s.paper_note:
        lines += [f"Paper: {s.paper_note}.", ""]
    problems = rep.problems()
    if problems:
        lines += [f"{h}# Problems", ""] + [f"- {p}" for p in problems] + [""]
    if figures:
        lines += [f"{h}# Figures", ""] + [f"![{name}]({fname})" for name, fname in figures.items()] + [""]
    return "\n".join(lines)


def _grid_table(rep: GridReport, body: List[List[str]]) -> str:
    """A table of the grid: a header of the row axis and the column labels above ``body`` (one list
    per row: its label, then one text per column)."""
    return _table([rep.spec.rows.replace("_", " ")] + [rep.ex.column_label(c) for c in rep.columns], body)


def _spread_rows(rep: GridReport,
                 stat: Callable[[CellStats], Tuple[Optional[float], Optional[float]]]) -> List[List[str]]:
    """Every row's label and, per column, ``mean ± std`` of ``stat(cell)`` (a (mean, std) pair)."""
    return [[row_label(rep, r)] + [_spread(*stat(c), c.n, c.expected)
                                     for c in (rep.cells[(r, col)] for col in rep.columns)] for r in rep.rows]


def _intro_lines(rep: GridReport, h: str) -> List[str]:
    """The title and what the tables are of: the grid, its command, the runs taken from an earlier
    report's runs.csv, the seeds and states, the settings changed, the devices trained on."""
    s, ex = rep.spec, rep.ex
    counts = rep.counts()
    total = sum(counts.values())
    lines = [f"{h} {s.title}" + (f" ({rep.name})" if rep.name != s.name else ""), ""]
    if rep.name != s.name:
        lines += [f"One of several expansions of grid {s.name} in `{ex.runs_dir}` (its file or options changed between "
                  f"launches): this one is recorded as `{rep.name}`, and its files and CSV lines carry that name.", ""]
    if s.description:
        lines += [s.description, ""]
    if ex.command:
        lines += ["Command:", "", "```bash", ex.command, "```", ""]
    sources = sorted({r.source for r in rep.runs if r.source})
    if sources:
        taken = sum(1 for r in rep.runs if r.source)
        named = ", ".join(f"`{p}`" for p in sources)
        lines += [f"{taken} of the finished runs are read from {named} (the runs.csv of an earlier report): their "
                  f"folders are not in `{ex.runs_dir}`, so they have no per-epoch curve. To make this report again, "
                  f"give `structinit bench report` the grid and `--out` with "
                  + " ".join(f"`--runs-csv {p}`" for p in sources) + ".", ""]
    state_text = ", ".join(f"{counts[k]} {k}" for k in STATES if counts.get(k))
    lines += [f"Seeds {', '.join(map(str, s.seeds))} ({len(s.seeds)} per cell); {_plural(total, 'run')}: {state_text}. "
              f"Runs in `{ex.runs_dir}`." + (f" Settings changed for the whole grid: "
                                             f"{', '.join(f'{k}={v}' for k, v in ex.overrides.items())}."
                                             if ex.overrides else ""), ""]
    return lines + device_lines(rep) + software_lines(rep)


def _final_lines(rep: GridReport, h: str, has_paper: bool) -> List[str]:
    """The headline table: final-epoch test accuracy, ``[x]`` the paper's number where it has one."""
    lines = [f"{h}# Final-epoch test accuracy (%)", "",
             "Mean ± standard deviation over the seeds that finished; (k/n): k of n seeds finished (one seed "
             "alone has no ±); pending, running or failed (0/n): none finished yet, and what its runs are doing."
             + (f" [x]: the paper's number ({rep.spec.paper_source})." if has_paper else ""), ""]
    body = [[row_label(rep, r)] + [_cell_text(rep.cells[(r, c)], has_paper) for c in rep.columns]
            for r in rep.rows]
    return lines + [_grid_table(rep, body), ""]


#: What each base of the other weights is, in words (the reports' notes).
BASE_WORDS = {"model": "as the model builds it (timm's: Linear weights trunc normal 0.02)",
              "pytorch": "PyTorch's defaults (Kaiming uniform)", "pytorch-mlp": "the MLPs at PyTorch's defaults",
              "pytorch-head": "the classifier at PyTorch's default"}


def _bases(rep: GridReport) -> List[str]:
    return sorted({b for b in (rep.cells[(r, rep.columns[0])].base for r in rep.rows if rep.columns) if b is not None})


def row_label(rep: GridReport, row: str) -> str:
    """The row's label, with the base of the other weights in brackets where the grid's rows carry
    several (tables and figures alike)."""
    base = rep.cells[(row, rep.columns[0])].base if rep.columns else None
    label = rep.ex.row_label(row)
    return f"{label} [{base}]" if base is not None and len(_bases(rep)) > 1 else label


def _delta_lines(rep: GridReport, h: str, has_paper: bool) -> List[str]:
    """The difference of every row to the baseline's method on the same base of the other weights,
    paired by seed (the grid has a baseline)."""
    s, ex = rep.spec, rep.ex
    base = ex.row_label(s.baseline)
    bases = _bases(rep)
    several = len(bases) > 1
    text = (f"Paired by seed: the mean over seeds of (method − {base}) with its standard error; (k): seeds "
            "finished in both." + (" [x]: the paper's difference." if has_paper else ""))
    if several:
        text += (f" Each row is paired with the row of the same init as {base} on the same base of the other weights, "
                 "in brackets (" + "; ".join(f"{b}: {BASE_WORDS.get(b, b)}" for b in bases) + "); —: the grid has no "
                 "such row there (inits are not compared across bases), or no seed finished in both.")
    lines = [f"{h}# Difference to {base}" + (" on the same base" if several else "") + " (percentage points)", "",
             text, ""]
    body = []
    for r in rep.rows:
        first = rep.cells[(r, rep.columns[0])] if rep.columns else None
        if r == s.baseline or (first is not None and first.paired_with is None and first.base is not None
                               and several and _is_baseline_method(rep, r)):
            continue
        label = row_label(rep, r)
        if first is not None and first.paired_with not in (None, s.baseline):
            label += f" vs {ex.row_label(first.paired_with)}"
        row = [label]
        for c in rep.columns:
            st = rep.cells[(r, c)]
            if st.delta_mean is None:
                text = "—"
            else:
                text = _num(st.delta_mean, True) + (f" ± {st.delta_se:.2f}" if st.delta_se is not None else "")
                text += f" ({st.n_paired})"
            if has_paper and st.paper_delta is not None:
                text += f" [{st.paper_delta:+.2f}]"
            row.append(text)
        body.append(row)
    return lines + [_grid_table(rep, body), ""] + _own_base_lines(rep, h)


def _is_baseline_method(rep: GridReport, row: str) -> bool:
    """Whether ``row`` is the baseline's method on another base (the baseline of that base)."""
    specs = row_specs(rep.ex)
    return specs.get(row, (None,))[0] == specs.get(rep.spec.baseline, (None,))[0]


def _own_base_lines(rep: GridReport, h: str) -> List[str]:
    """Each init at its own best base: for every init the grid has on several bases, per column the
    base with the best mean validation accuracy and that row's final test accuracy (none without a
    validation split, or when no init has several bases)."""
    specs = row_specs(rep.ex)
    groups: Dict[str, List[str]] = {}
    for r in rep.rows:
        variant = specs.get(r, (None, None, None))[2]
        if variant is not None:
            groups.setdefault(variant, []).append(r)
    groups = {v: rows for v, rows in groups.items() if len({specs[r][1] for r in rows}) > 1}
    if not groups or not any(c.val_mean is not None for c in rep.cells.values()):
        return []
    body = []
    for rows in groups.values():
        named = next((r for r in rows if rep.cells[(r, rep.columns[0])].base == "model"), rows[0])
        line = [rep.ex.row_label(named) + " (bases: " + ", ".join(rep.cells[(r, rep.columns[0])].base or "?"
                                                                  for r in rows) + ")"]
        for c in rep.columns:
            ranked = [r for r in rows if rep.cells[(r, c)].val_mean is not None]
            if not ranked:
                line.append("—")
                continue
            best = max(ranked, key=lambda r: rep.cells[(r, c)].val_mean or 0.0)
            st = rep.cells[(best, c)]
            line.append(f"{_spread(st.final_mean, st.final_std, st.n, st.expected)} [{st.base}]")
        body.append(line)
    return [f"{h}# Each init at its own best base", "",
            "For every init the grid has on several bases of the other weights: per column, the final-epoch test "
            "accuracy (%) of the base with the best mean validation accuracy, named in brackets.", "",
            _grid_table(rep, body), ""]


def _best_lines(rep: GridReport, h: str) -> List[str]:
    """The best epoch's test accuracy, saying which split chose the epoch (before anything finished:
    which split the runs will choose on)."""
    ons = sorted({c.best_on for c in rep.cells.values() if c.best_on})
    if not ons:  # nothing finished yet: say what the runs will choose on
        held = _held_out(rep)
        ons = ["val"] if held else ["test"] if held is False else ["val", "test"]
    chosen = {"val": "the validation split", "test": "the test split itself (optimistic: no validation split)"}
    lines = [f"{h}# Best epoch (%)", "",
             "Test accuracy at the evaluated epoch with the best accuracy on "
             + " / ".join(chosen.get(o, o) for o in ons) + "; mean ± std. The final epoch above is the headline.",
             ""]
    return lines + [_grid_table(rep, _spread_rows(rep, lambda c: (c.best_mean, c.best_std))), ""]


def cells_csv(reports: List[GridReport]) -> str:
    """One line per (grid, row, column): the aggregates, the paper's number and difference."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["grid", "row_id", "row", "column_id", "column", "n", "expected", "final_mean", "final_std",
                "best_mean", "best_std", "best_on", "delta_mean", "delta_se", "n_paired", "paper", "paper_delta",
                "val_mean", "val_std", "base", "paired_with"])
    for rep in reports:
        for r in rep.rows:
            for c in rep.columns:
                st = rep.cells[(r, c)]
                w.writerow([rep.name, r, rep.ex.row_label(r), "/".join(c), rep.ex.column_label(c), st.n,
                            st.expected] + [_csv(x) for x in (st.final_mean, st.final_std, st.best_mean, st.best_std)]
                           + [st.best_on or ""] + [_csv(st.delta_mean), _csv(st.delta_se), st.n_paired,
                                                   _csv(st.paper), _csv(st.paper_delta), _csv(st.val_mean),
                                                   _csv(st.val_std), st.base or "", st.paired_with or ""])
    return buf.getvalue()


def runs_csv(reports: List[GridReport]) -> str:
    """One line per run of every grid."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["grid", "key", "row_id", "column_id", "seed", "state", "final_acc", "best_acc", "best_epoch",
                "best_on", "final_val_acc", "epochs", "train_images", "wall_seconds", "problem", "algorithms",
                "device", "versions"])
    for rep in reports:
        for r in rep.runs:
            w.writerow([rep.name, r.key, r.row, "/".join(r.column), r.seed, r.state, _csv(r.final_acc),
                        _csv(r.best_acc), r.best_epoch or "", r.best_on or "", _csv(r.final_val_acc), r.epochs or "",
                        r.train_images or "", r.wall_seconds or "", r.problem or "", r.algorithms or "",
                        r.device or "", versions_text(r.versions) if r.versions else ""])
    return buf.getvalue()


def _csv(x: Optional[float]) -> str:
    return "" if x is None else f"{x:.4f}"

