"""Plain-text renderings of a solve: the per-head quality table and attention heat maps.

Everything here returns strings (no printing) so the CLI, logs and tests share one rendering.
"""

from __future__ import annotations

from typing import List, Sequence

import numpy as np

from .artifact import Artifact

SHADES = " .:-=+*#%@"


def quality_table(artifact: Artifact) -> str:
    """One line per layer and head: offset, MSE, hit rate, target mass, Q/K column norms."""
    lines = [f"{'layer':>5} {'head':>4} {'offset':>8} {'mse':>10} {'hit':>6} {'mass':>6} {'|q|':>7} {'|k|':>7}"]
    for l, layer in enumerate(artifact.stats["layers"]):
        for h, c in enumerate(layer):
            dy, dx = (int(v) for v in artifact.offsets[l, h])
            lines.append(f"{l:>5} {h:>4} {f'({dy},{dx})':>8} {c['mse']:>10.3e} {c['hit_rate']:>6.3f} "
                         f"{c['target_mass']:>6.3f} {c['q_norm']:>7.3f} {c['k_norm']:>7.3f}")
    s = artifact.stats.get("summary", {})
    if s:
        lines.append(f"{'mean':>5} {'':>4} {'':>8} {s['mse']:>10.3e} {s['hit_rate']:>6.3f} {s['target_mass']:>6.3f} "
                     f"{s['q_norm']:>7.3f} {s['k_norm']:>7.3f}")
    return "\n".join(lines)


def attention_rows(artifact: Artifact, layer: int) -> np.ndarray:
    """Attention of every head of ``layer`` on its pseudo input: ``[heads, N, N]`` (NumPy)."""
    import torch

    from .quality import attention_maps

    x = torch.from_numpy(artifact.layer_input(layer))
    q = torch.from_numpy(artifact.q[layer])
    k = torch.from_numpy(artifact.k[layer])
    return attention_maps(x.unsqueeze(0), q, k).numpy()


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


def query_attention_text(artifact: Artifact, layer: int, head: int, query: int) -> str:
    """The attention of one query token of one head, as a heat map over the patch grid."""
    gh, gw = artifact.config.grid
    attn = attention_rows(artifact, layer)[head, query].reshape(gh, gw)
    qy, qx = divmod(query, gw)
    dy, dx = (int(v) for v in artifact.offsets[layer, head])
    ty, tx = qy + dy, qx + dx
    inside = 0 <= ty < gh and 0 <= tx < gw
    if artifact.config.padding == "circular":
        ty, tx, inside = ty % gh, tx % gw, True
    head_line = (f"layer {layer} head {head} query token {query} (y={qy}, x={qx}), offset ({dy},{dx}) -> "
                 + (f"target (y={ty}, x={tx}) gets {attn[ty, tx]:.3f}" if inside else "target outside the grid"))
    marks = [(qy, qx, "Q")]
    rows = heatmap(attn, marks)
    scale = f"shades '{SHADES}' from 0 to max {attn.max():.3f}; Q marks the query"
    return "\n".join([head_line, *rows, scale])
