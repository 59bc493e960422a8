"""Solver recipe names and their parameters, and a solve's defaults (import-light: no torch).

A recipe is a way to compute Q/K for impulse targets (:mod:`structinit.solver.algorithms` holds
the solvers); its parameters all go into the artifact key.

``closed-form`` is this project's own variant of the authors' later construction (logit 10, noise
1, the full pseudo-inverse of the pseudo input); ``authors-2025`` is that construction exactly as
the authors' NeurIPS 2025 code has it (see :func:`structinit.solver.algorithms.solve_authors_2025`).
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

from structinit.errors import UsageError, param

#: Default parameters of each recipe.
RECIPE_DEFAULTS: Dict[str, Dict[str, Any]] = {
    "fast": {"target_mass": 0.3, "ridge": 1e-5},
    "paper": {"iters": 10000, "lr": 1e-4},
    "released": {"iters": 10000, "lr": 1e-4, "norm_every": 100},
    "closed-form": {"logit": 10.0, "noise_std": 1.0, "qk_scale": 7.0},
    # The closed form of "Structured Initialization for Vision Transformers" (NeurIPS 2025), with its constants.
    "authors-2025": {"logit": 1000.0, "noise_scale": 3.0, "noise_std": 0.6, "noise_bound": 2.0, "qk_scale": 7.0},
}
RECIPES = tuple(RECIPE_DEFAULTS)
#: A solve's defaults beside its recipe's parameters, declared once: what ``SolveConfig``, the
#: impulse init and the ``solve`` and ``apply`` commands start from.
DEFAULT_RECIPE = "fast"
DEFAULT_FILTER = 3
DEFAULT_PADDING = "zero"
DEFAULT_OFFSET_ORDER = "random"
DEFAULT_PSEUDO_INPUT = "pe"
#: The algorithm version of each recipe. A change to what a recipe computes (not only to how fast)
#: needs a new number: it enters the artifact key (``SolveConfig.algorithm``) and the run key of
#: every init that solves with it, so results of one version are never taken for another's.
#: Version 1 is left out of keys (every key made before versions existed is version 1).
RECIPE_VERSIONS: Dict[str, int] = {name: 1 for name in RECIPE_DEFAULTS}
#: Parameters that may be zero (all others must be positive).
NON_NEGATIVE = ("ridge",)


def check_recipe(recipe: str) -> str:
    if recipe not in RECIPE_DEFAULTS:
        raise UsageError(f"unknown {param('recipe')} {recipe!r}; choose one of {', '.join(RECIPES)}")
    return recipe


def recipe_params(recipe: str, overrides: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The full parameter set of ``recipe``: its defaults updated with ``overrides`` (``None`` ignored).

    Every value is converted to the default's type and must be finite and positive (``ridge`` may
    be zero); ``target_mass`` must lie in (0, 1).
    """
    params = dict(RECIPE_DEFAULTS[check_recipe(recipe)])
    for name, value in (overrides or {}).items():
        if value is None:
            continue
        if name not in params:
            raise UsageError(f"recipe {recipe!r} has no parameter {param(name)} (it has: {', '.join(params)})")
        kind = type(params[name])
        try:
            if isinstance(value, bool) or (kind is int and isinstance(value, float) and not value.is_integer()):
                raise ValueError
            converted = kind(value)
        except (TypeError, ValueError, OverflowError):
            what = "an integer" if kind is int else "a number"
            raise UsageError(f"{param(name)} of recipe {recipe!r} must be {what}, got {value!r}") from None
        if not math.isfinite(converted):
            raise UsageError(f"{param(name)} of recipe {recipe!r} must be finite, got {value!r}")
        if converted < 0 or (converted == 0 and name not in NON_NEGATIVE):
            need = "non-negative" if name in NON_NEGATIVE else "positive"
            raise UsageError(f"{param(name)} of recipe {recipe!r} must be {need}, got {value!r}")
        params[name] = converted
    if "target_mass" in params and not 0 < params["target_mass"] < 1:
        raise UsageError(f"{param('target_mass')} must lie strictly between 0 and 1, got {params['target_mass']}")
    return params
