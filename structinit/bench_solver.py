"""Solver benchmark: every recipe on one shape, in one process, timed the same way."""

from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional

from .config import SolveConfig
from .errors import UsageError
from .recipes import RECIPES
from .shapes import Grid


def run_solver_bench(grid: Grid, dim: int, heads: int, filter_size: int, layers: int, recipes: List[str], *,
                     match: Optional[str] = "paper", target_mass: Optional[float] = None,
                     iters: Optional[int] = None, seed: int = 0, device: str = "auto",
                     progress: Optional[Callable[[int, int], None]] = None) -> Dict:
    """Solve the same targets with each recipe (no cache) and return ``{"shape", "rows"}``.

    Each row: ``recipe``, ``params``, ``seconds`` (solver wall time, device synchronized), ``mse``,
    ``hit_rate``, ``target_mass`` (means over layers x heads), ``device``. With ``match``, ``fast``
    is asked for the mean target mass that recipe reached (so it must run earlier in ``recipes``);
    ``speedup_vs_<match>`` is then reported on the fast row.
    """
    from .solve import compute

    unknown = [r for r in recipes if r not in RECIPES]
    if unknown or not recipes:
        raise UsageError(f"unknown recipe(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(RECIPES)}")
    if match is not None:
        if match not in RECIPES or match == "fast":
            raise UsageError(f"--match must name a recipe other than fast, got {match!r}")
        if "fast" in recipes and (match not in recipes or recipes.index(match) > recipes.index("fast")):
            raise UsageError(f"--match {match} needs {match} to run before fast in --recipes")
    rows, reached = [], {}
    for i, name in enumerate(recipes):
        params: Dict = {}
        if name in ("paper", "released") and iters is not None:
            params["iters"] = iters
        if name == "fast":
            if match is not None and match in reached:
                params["target_mass"] = reached[match]["target_mass"]
            elif target_mass is not None:
                params["target_mass"] = target_mass
        config = SolveConfig(grid=grid, dim=dim, heads=heads, filter=filter_size, layers=layers, recipe=name,
                             params=params, seed=seed)
        t0 = time.perf_counter()
        art = compute(config, device)
        total = time.perf_counter() - t0
        row = {"recipe": name, "params": config.params, "seconds": art.stats["seconds"], "total_seconds": total,
               "device": art.stats["device"], **art.stats["summary"]}
        reached[name] = row
        rows.append(row)
        if progress:
            progress(i + 1, len(recipes))
    if match is not None and "fast" in reached and match in reached:
        fast, ref = reached["fast"], reached[match]
        fast[f"speedup_vs_{match}"] = ref["seconds"] / max(fast["seconds"], 1e-9)
        fast[f"mass_gap_vs_{match}"] = fast["target_mass"] - ref["target_mass"]
    h, w = grid
    return {"shape": {"grid": [h, w], "dim": dim, "heads": heads, "filter": filter_size, "layers": layers},
            "rows": rows}


def solver_bench_table(result: Dict) -> str:
    """Plain-text table of :func:`run_solver_bench`'s result."""
    s = result["shape"]
    lines = [f"shape: {s['grid'][0]}x{s['grid'][1]} grid, dim {s['dim']}, {s['heads']} heads, filter {s['filter']}, "
             f"{s['layers']} layer(s)",
             f"{'recipe':<12} {'seconds':>9} {'mse':>10} {'hit':>6} {'mass':>6}  params"]
    for r in result["rows"]:
        params = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r["params"].items())
        lines.append(f"{r['recipe']:<12} {r['seconds']:>9.3f} {r['mse']:>10.3e} {r['hit_rate']:>6.3f} "
                     f"{r['target_mass']:>6.3f}  {params}")
        for key in r:
            if key.startswith("speedup_vs_"):
                lines.append(f"  fast vs {key[11:]}: {r[key]:.0f}x less solver time, target mass gap "
                             f"{r['mass_gap_vs_' + key[11:]]:+.4f}")
    lines.append(f"device: {result['rows'][0]['device']}" if result["rows"] else "")
    return "\n".join(lines)
