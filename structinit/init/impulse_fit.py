"""The data fit's settings of impulse init, read from its parameters (a mixin of
:class:`~structinit.init.impulse.ImpulseInit`, which holds them): whether it fits, on how many
samples, its :class:`~structinit.fit.settings.FitSettings` and the mass it calibrates each head to.
"""

from __future__ import annotations

from typing import Optional

from structinit.fit.settings import FitSettings
from structinit.solver.recipes import recipe_params


class ImpulseDataFit:
    """What impulse init's data fit runs with (see :class:`~structinit.init.impulse.ImpulseInit`
    for each parameter)."""

    data_fit: int
    data_fit_mass: float
    data_fit_l2: float
    data_fit_lr: float
    data_fit_norm: float
    data_fit_samples: int
    data_fit_version: int
    data_fit_batch: int
    self_weight: float
    target_mass: Optional[float]
    mimetic_vproj: bool
    alpha2: float
    beta2: float

    @property
    def uses_data(self) -> bool:
        """Whether :meth:`prepare` fits Q/K to inputs (``data_fit``; without a batch, to noise inputs of
        the model's input shape; without either, it keeps the plain solve)."""
        return self.data_fit > 0

    @property
    def fit_samples(self) -> int:
        return self.data_fit_samples if self.data_fit else 0

    def fit_off(self) -> str:
        return "data_fit is 0" if not self.data_fit else ""

    def fit_settings(self, subspace=None):
        """The data fit's :class:`~structinit.fit.settings.FitSettings` from this spec's parameters
        (``subspace``: the target's :class:`~structinit.init.position_subspace.PositionSubspace`,
        whose size and gain change what each layer sees)."""

        writes = {"mimetic_vproj": self.mimetic_vproj, "alpha2": self.alpha2, "beta2": self.beta2}
        if subspace is not None:
            writes.update(position_dims=subspace.dims, position_gain=round(subspace.gain, 9))
            if subspace.rest_scale:
                writes.update(position_rest=subspace.rest_scale)
            if subspace.keep_norms:
                writes.update(position_keep_norms=True)
        return FitSettings(steps=self.data_fit, mass=self.data_fit_mass, l2=self.data_fit_l2, lr=self.data_fit_lr,
                           norm=self.data_fit_norm, samples=self.data_fit_samples, version=self.data_fit_version,
                           batch=self.data_fit_batch, self_weight=self.self_weight,
                           calibrated_to=self.calibration_mass(),
                           writes=writes)

    def calibration_mass(self) -> float:
        """The mean attention on the target token that ``data_fit`` calibrates each head to:
        ``target_mass``, or the ``fast`` recipe's default."""
        if self.target_mass is not None:
            return float(self.target_mass)
        return float(recipe_params("fast", {})["target_mass"])
