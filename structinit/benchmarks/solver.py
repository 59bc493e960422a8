"""Solver benchmark: every recipe on one shape, in one process, timed the same way."""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional

from structinit.errors import UsageError, param
from structinit.geometry.grid import Grid
from structinit.solver.config import SolveConfig
from structinit.solver.recipes import RECIPES


def run_solver_bench(grid: Grid, dim: int, heads: int, filter_size: int, layers: int, recipes: List[str], *,
                     match: Optional[str] = "paper", target_mass: Optional[float] = None,
                     iters: Optional[int] = None, seed: int = 0, device: str = "auto",
                     progress: Optional[Callable[[int, int], None]] = None,
                     on_recipe: Optional[Callable[[str, int, int], None]] = None) -> Dict:
    """Solve the same targets with each recipe (no cache) and return ``{"shape", "rows"}``.

    Each row: ``recipe``, ``params``, ``seconds`` (solver wall time, device synchronized), ``mse``,
    ``hit_rate``, ``target_mass`` (means over layers x heads), ``device``. When ``match`` names a
    recipe that runs too, it runs before ``fast``, ``fast`` is asked for the mean target mass it
    reached, and ``speedup_vs_<match>`` is reported on the fast row; otherwise ``fast`` uses
    ``target_mass``. ``progress(done, total)`` follows iterative solvers; ``on_recipe(name, i, n)``
    is called as each recipe starts.
    """
    from structinit.solver.run import compute

    unknown = [r for r in recipes if r not in RECIPES]
    if unknown or not recipes:
        raise UsageError(f"unknown {param('recipes')} {', '.join(unknown) or '(none given)'}; choose from "
                         f"{', '.join(RECIPES)}")
    if match is not None and (match not in RECIPES or match == "fast"):
        raise UsageError(f"{param('match')} must name a recipe other than fast, got {match!r}")
    # The recipe fast is matched to (when it runs too), else None.
    matching = match if match is not None and match in recipes and "fast" in recipes else None
    order = list(recipes)
    if matching is not None and order.index(matching) > order.index("fast"):
        order.remove(matching)
        order.insert(order.index("fast"), matching)
    rows: List[Dict[str, Any]] = []
    reached: Dict[str, Dict[str, Any]] = {}
    for i, name in enumerate(order):
        if on_recipe:
            on_recipe(name, i, len(order))
        params: Dict = {}
        if name in ("paper", "released") and iters is not None:
            params["iters"] = iters
        if name == "fast":
            if matching is not None:
                params["target_mass"] = reached[matching]["target_mass"]
            elif target_mass is not None:
                params["target_mass"] = target_mass
        config = SolveConfig(grid=grid, dim=dim, heads=heads, filter=filter_size, layers=layers, recipe=name,
                             params=params, seed=seed)
        t0 = time.perf_counter()
        art = compute(config, device, progress=progress)
        total = time.perf_counter() - t0
        row = {"recipe": name, "params": config.params, "seconds": art.stats["seconds"], "total_seconds": total,
               "device": art.stats["device"], **art.stats["summary"]}
        reached[name] = row
        rows.append(row)
    if matching is not None:
        fast, ref = reached["fast"], reached[matching]
        fast[f"speedup_vs_{match}"] = ref["seconds"] / max(fast["seconds"], 1e-9)
        fast[f"mass_gap_vs_{match}"] = fast["target_mass"] - ref["target_mass"]
    return {"shape": {"grid": list(Grid(grid)), "dim": dim, "heads": heads, "filter": filter_size, "layers": layers},
            "rows": rows}


def solver_bench_table(result: Dict) -> str:
    """Plain-text table of :func:`run_solver_bench`'s result."""
    s = result["shape"]
    lines = [f"shape: {'x'.join(map(str, s['grid']))} grid, dim {s['dim']}, {s['heads']} heads, filter {s['filter']}, "
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
