"""Plain-text renderings: the per-head quality table, a checkpoint's report, attention heat maps.

Everything here returns strings (no printing) so the CLI, logs and tests share one rendering.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

import numpy as np

from structinit.analysis.quality import Quality

SHADES = " .:-=+*#%@"


def quality_table(quality: Quality, offsets: np.ndarray) -> str:
    """One line per layer and head (offset ``(dy, dx)`` from ``offsets [L, H, 2]``, MSE, hit rate,
    target mass, Q/K column norms), then the means."""
    lines = [f"{'layer':>5} {'head':>4} {'offset':>8} {'mse':>10} {'hit':>6} {'mass':>6} {'|q|':>7} {'|k|':>7}"]

    def row(first: str, second: str, third: str, c: Dict[str, float]) -> str:
        return (f"{first:>5} {second:>4} {third:>8} {c['mse']:>10.3e} {c['hit_rate']:>6.3f} "
                f"{c['target_mass']:>6.3f} {c['q_norm']:>7.3f} {c['k_norm']:>7.3f}")

    for layer in range(quality.layers):
        for head in range(quality.mse.shape[1]):
            dy, dx = (int(v) for v in offsets[layer, head])
            lines.append(row(str(layer), str(head), f"({dy},{dx})", quality.cell(layer, head)))
    lines.append(row("mean", "", "", quality.summary()))
    return "\n".join(lines)


def checkpoint_report(desc: Dict[str, Any]) -> str:
    """Terminal text for :func:`structinit.init.checkpoints.describe_checkpoint`'s result."""
    g = "x".join(str(s) for s in desc["grid"])
    lines = [
        f"{desc.get('path', 'checkpoint')}: {desc['description']} [{desc['layout']}]",
        f"  format {desc.get('format', '?')}; state dicts: {', '.join(desc.get('state_dicts', ['(top level)']))}",
        f"  grid {g} ({desc['tokens']} tokens), dim {desc['dim']}, heads {desc['heads']}, depth {desc['depth']}, "
        f"prefix tokens {desc['prefix_tokens']}, position embedding: {desc.get('pos_embed_kind') or 'none'}",
        f"  attention on {desc.get('measured_on', 'the LayerNorm sin-cos table')}, against each head's closest "
        "impulse offset:",
        f"  {'layer':>5}  {'hit rate':>8}  {'target mass':>11}  {'mse':>9}  offsets (dy,dx) per head",
    ]
    for row in desc["layers"]:
        offs = " ".join(f"({dy:+d},{dx:+d})" for dy, dx in row["offsets"])
        lines.append(f"  {row['layer']:>5}  {row['hit_rate']:>8.3f}  {row['target_mass']:>11.3f}  "
                     f"{row['mse']:>9.2e}  {offs}")
    on = desc.get("on_inputs")
    if on:
        per = lambda key: " ".join(f"{r[key]:.2f}" for r in on["layers"])  # noqa: E731
        lines.append(f"  attention on {on['inputs']} (as apply measures it), against the same offsets, per layer: "
                     f"hit rate {per('hit_rate')} (mean {on['hit_rate']:.2f}); target mass {per('target_mass')} "
                     f"(mean {on['target_mass']:.2f})")
    elif desc.get("on_inputs_skipped"):
        lines.append(f"  attention through the model not measured: {desc['on_inputs_skipped']}")
    return "\n".join(lines)


def heatmap(values: np.ndarray, marks: Sequence[tuple] = ()) -> List[str]:
    """Render ``values: [H, W]`` (>= 0) as text rows, two characters a cell, scaled to the max.

    ``marks`` is ``[(y, x, char)]``: a cell drawn as ``char`` plus its shade (e.g. the query).
    """
    h, w = values.shape
    top = float(values.max()) or 1.0
    marked = {(y, x): c for y, x, c in marks}
    rows = []
    for y in range(h):
        cells = []
        for x in range(w):
            shade = SHADES[min(len(SHADES) - 1, int(round(values[y, x] / top * (len(SHADES) - 1))))]
            cells.append(marked[(y, x)] + shade if (y, x) in marked else shade * 2)
        rows.append("".join(cells))
    return rows


def query_attention_text(artifact, layer: int, head: int, query: int) -> str:
    """The attention of one query token of one head of an artifact, as a heat map over the grid."""
    from structinit.analysis.quality import artifact_attention

    gh, gw = artifact.config.grid.hw
    attn = artifact_attention(artifact, layer, query)[head, 0].reshape(gh, gw)
    qy, qx = divmod(query, gw)
    dy, dx = (int(v) for v in artifact.offsets[layer, head])
    ty, tx = qy + dy, qx + dx
    inside = 0 <= ty < gh and 0 <= tx < gw
    if artifact.config.padding == "circular":
        ty, tx, inside = ty % gh, tx % gw, True
    if artifact.config.grid.ndim == 1:
        head_line = (f"layer {layer} head {head} query position {query}, offset dx={dx:+d} -> "
                     + (f"target position {tx} gets {attn[ty, tx]:.3f}" if inside else "target outside the sequence"))
    else:
        head_line = (f"layer {layer} head {head} query token {query} (y={qy}, x={qx}), offset ({dy},{dx}) -> "
                     + (f"target (y={ty}, x={tx}) gets {attn[ty, tx]:.3f}" if inside else "target outside the grid"))
    marks = [(qy, qx, "Q")] + ([(ty, tx, "T")] if inside and (ty, tx) != (qy, qx) else [])
    rows = heatmap(attn, marks)
    scale = f"shades '{SHADES}' from 0 to max {attn.max():.3f}; Q marks the query, T its impulse target"
    return "\n".join([head_line, *rows, scale])


def fidelity_table(fid, per_head: bool = False, recorded: Any = None) -> str:
    """A :class:`~structinit.analysis.fidelity.Fidelity` as a table (rich, rendered to text): one
    row per layer (the means over its heads), or with ``per_head`` one per layer and head (with the
    head's offset), then the means over all. Columns: hit rate, target mass (``-`` without
    offsets), window share. ``recorded``: what ``train`` measured at init on the same inputs
    (``data_attention_quality``'s result): its per-layer hit rate and target mass are shown beside."""
    import io

    from rich import box
    from rich.console import Console
    from rich.table import Table

    def num(v) -> str:
        return "-" if v is None or (isinstance(v, float) and np.isnan(v)) else f"{v:.3f}"

    rec = {int(r["layer"]): r for r in (recorded or {}).get("layers", [])} if recorded else {}
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("layer", justify="right")
    if per_head:
        table.add_column("head", justify="right")
        table.add_column("offset", justify="right")
    for name in ("hit rate", "target mass", "window"):
        table.add_column(name, justify="right")
    if rec:
        table.add_column("train: hit", justify="right")
        table.add_column("train: mass", justify="right")

    def measures(l, h=None):
        def get(name):
            v = getattr(fid, name)
            if v is None:
                return None
            return float(v[l, h]) if h is not None else (None if np.isnan(v[l]).all() else float(np.nanmean(v[l])))
        return [num(get("hit_rate")), num(get("target_mass")), num(get("window_mass"))]

    for l in range(fid.layers):
        r = rec.get(l)
        for h in (range(fid.heads) if per_head else [None]):
            cells = [str(l)]
            if per_head:
                off = fid.offsets[l, h] if fid.offsets is not None and (fid.offsets[l] != -9999).all() else None
                cells += [str(h), "-" if off is None else f"({int(off[0])},{int(off[1])})"]
            cells += measures(l, h)
            if rec:
                if per_head:
                    assert h is not None  # per_head: h runs over the heads
                    got = (r or {}).get("heads", {})
                    cells += [num((got.get(m) or [None] * fid.heads)[h]) for m in ("hit_rate", "target_mass")]
                else:
                    cells += [num((r or {}).get(m)) for m in ("hit_rate", "target_mass")]
            table.add_row(*cells)
    summary = fid.summary()
    tail = ["mean"] + (["", ""] if per_head else []) + [num(summary.get(m)) for m in ("hit_rate", "target_mass",
                                                                                       "window_mass")]
    if rec:
        tail += [num(recorded.get("hit_rate")), num(recorded.get("target_mass"))]
    table.add_section()
    table.add_row(*tail)
    out = io.StringIO()
    Console(file=out, width=200, no_color=True, highlight=False, force_terminal=False).print(table)
    return "\n".join(line.rstrip() for line in out.getvalue().splitlines() if line.strip())
