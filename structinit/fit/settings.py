"""The data fit's settings (:class:`FitSettings`), one frozen record from the impulse init's
``data_fit*`` parameters; its defaults are the fit's defaults, declared here once (the impulse init's
parameters and the commands read them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict

from structinit.solver.recipes import RECIPE_DEFAULTS

#: The data fit's algorithm versions (see :mod:`structinit.fit.refine`) and the default.
FIT_VERSIONS = (1, 2)
DEFAULT_FIT_VERSION = 2


@dataclass(frozen=True)
class FitSettings:
    """How a data fit runs. ``steps`` Adam steps (learning rate ``lr``) per layer, from every head
    rescaled to Frobenius norm ``norm``, on the cross-entropy to a target of ``mass`` on the offset's
    token plus ``l2`` times the weights' squares; on at most ``samples`` inputs; ``version`` the
    algorithm (1: every step on the whole batch; 2: ``batch`` inputs a step, 0 for enough for
    1,024 query rows a head); ``self_weight`` an identity term mixed into every head after the
    steps; then each head calibrated to mean attention ``calibrated_to`` on its target token.
    ``writes``: what the init writes beside Q/K before each layer is captured (mimetic V/proj's
    settings), which changes what later layers see and so is part of the fit's identity."""

    steps: int = 300
    mass: float = 0.6
    l2: float = 1e-4
    lr: float = 1e-2
    norm: float = 5.0
    samples: int = 256
    version: int = DEFAULT_FIT_VERSION
    batch: int = 0
    self_weight: float = 0.0
    calibrated_to: float = RECIPE_DEFAULTS["fast"]["target_mass"]
    writes: Dict[str, Any] = field(default_factory=dict)

    def identity(self) -> Dict[str, Any]:
        """Every setting that changes the fitted Q/K, by the impulse init's parameter names (the
        ``fit`` entry of a fitted artifact's identity)."""
        return {"data_fit": self.steps, "data_fit_mass": self.mass, "data_fit_l2": self.l2,
                "data_fit_lr": self.lr, "data_fit_norm": self.norm, "data_fit_samples": self.samples,
                "data_fit_version": self.version, "data_fit_batch": self.batch, "self_weight": self.self_weight,
                **self.writes, "calibrated_to": self.calibrated_to}


#: The fit's defaults, declared once (the impulse init's ``data_fit*`` parameters start from them).
FIT_DEFAULTS = FitSettings()


__all__ = ["FIT_DEFAULTS", "FitSettings", "FIT_VERSIONS", "DEFAULT_FIT_VERSION"]
