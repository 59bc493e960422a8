"""Solver recipe names and their parameters (import-light: no torch)."""

from __future__ import annotations

from typing import Any, Dict, Optional

from .errors import UsageError

#: Default parameters of each recipe; all of them go into the artifact key.
RECIPE_DEFAULTS: Dict[str, Dict[str, Any]] = {
    "fast": {"target_mass": 0.3, "ridge": 1e-5},
    "paper": {"iters": 10000, "lr": 1e-4},
    "released": {"iters": 10000, "lr": 1e-4, "norm_every": 100},
    "closed-form": {"logit": 10.0, "noise_std": 1.0, "qk_scale": 7.0},
}
RECIPES = tuple(RECIPE_DEFAULTS)
DEFAULT_RECIPE = "fast"


def recipe_params(recipe: str, overrides: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The full parameter set of ``recipe``: its defaults updated with ``overrides`` (``None`` ignored)."""
    if recipe not in RECIPE_DEFAULTS:
        raise UsageError(f"unknown recipe {recipe!r}; choose one of {', '.join(RECIPES)}")
    params = dict(RECIPE_DEFAULTS[recipe])
    for name, value in (overrides or {}).items():
        if value is None:
            continue
        if name not in params:
            raise UsageError(f"recipe {recipe!r} has no parameter {name!r} (it has: {', '.join(params)})")
        try:
            params[name] = type(params[name])(value)
        except (TypeError, ValueError):
            raise UsageError(f"parameter {name!r} of recipe {recipe!r} must be a number, got {value!r}") from None
        if params[name] <= 0 and name != "ridge":
            raise UsageError(f"parameter {name!r} of recipe {recipe!r} must be positive, got {value!r}")
    if recipe == "fast" and not 0 < params["target_mass"] < 1:
        raise UsageError(f"--target-mass must lie strictly between 0 and 1, got {params['target_mass']}")
    return params
