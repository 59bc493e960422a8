"""What a fit's report says of the structure it left, and what to try when a layer is weak
(:func:`structure_warning`; :func:`fitted_structure_warning` for a fitted artifact, as ``structinit
inspect`` shows it). The advice names the settings by the impulse init's parameter names, the names
a fit's identity keys them by (:meth:`~structinit.fit.settings.FitSettings.identity`).
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from structinit.errors import param

#: The hit rate on the fit's batch below which a layer's structure is reported as weak.
STRUCTURE_FLOOR = 0.9
#: What the weak-structure warning advises (when the fit used less): steps per layer, and a sharper target mass.
SUGGESTED_STEPS, SUGGESTED_MASS = 1000, 0.8


def structure_warning(report: Dict[str, Any], hint: Optional[str] = None) -> Optional[str]:
    """The warning for an impulse report whose data fit left a layer below :data:`STRUCTURE_FLOOR`
    on the inputs it was fitted to, a batch of real inputs or noise (``None`` when every layer is at
    or above it, or no fit ran), with each layer's figure and what to try: the position subspace
    first where it is off (the one setting measured to structure every layer where a token's content
    fills the stream), then more steps or a sharper target than those used, then inputs; ``hint``
    names how this target takes a stronger position signal (the impulse init's
    :func:`~structinit.init.impulse.position_hint`): it lifts
    the hit rate most, but more structure is not always more accuracy, so it comes last."""
    fit = report.get("data_fit") or {}
    rows = [r for r in fit.get("layers") or [] if r.get("hit_rate") is not None]
    weak = [r for r in rows if r["hit_rate"] < STRUCTURE_FLOOR]
    if not weak:
        return None
    worst = min(weak, key=lambda r: r["hit_rate"])
    noise = fit.get("inputs") == "noise"
    where = "its noise inputs" if noise else "the batch"
    per_layer = " ".join(f"{r['hit_rate']:.2f}" for r in rows)
    others = f" ({len(weak)} layers below {STRUCTURE_FLOOR}; per layer {per_layer})" if len(weak) > 1 else ""
    ways = []
    if not report.get("position_subspace"):
        ways.append(f"the position subspace ({param('position_subspace')}=true: the position table in directions "
                    "nothing else writes, which structures every layer where a token's content fills the stream)")
    steps, mass = fit.get("steps"), fit.get("mass")  # a setting at or past the advice is not advised again
    if not isinstance(steps, (int, float)) or steps < SUGGESTED_STEPS:
        ways.append(f"more steps ({param('data_fit')}={SUGGESTED_STEPS})")
    if not isinstance(mass, (int, float)) or mass < SUGGESTED_MASS:
        ways.append(f"a sharper fit target ({param('data_fit_mass')}={SUGGESTED_MASS:g})")
    ways.append(f"real inputs ({param('data')})" if noise else "more inputs")
    if hint:
        ways.append(f"a stronger position signal ({hint}; compare on validation)")
    tries = f"{', '.join(ways[:-1])} or {ways[-1]}" if len(ways) > 1 else ways[0]
    return (f"the data fit left layer {worst['layer']} hitting its offsets in {worst['hit_rate']:.2f} of the rows on "
            f"{where}{others}: the init is only partly structured; try {tries}")


def fitted_structure_warning(fit: Dict[str, Any]) -> Optional[str]:
    """:func:`structure_warning` for a fitted artifact's ``fit`` record (its identity and report), as
    ``structinit inspect`` shows it."""
    ident = fit.get("identity") or {}
    settings = ident.get("fit") or {}
    inputs = ident.get("inputs")
    kind = inputs.get("kind") if isinstance(inputs, dict) else "data"
    report = {"data_fit": {"layers": (fit.get("report") or {}).get("layers"), "inputs": kind,
                           "steps": settings.get("data_fit"), "mass": settings.get("data_fit_mass")}}
    if settings.get("position_dims"):
        report["position_subspace"] = {"dims": settings["position_dims"]}
    return structure_warning(report)


__all__ = ["structure_warning", "fitted_structure_warning", "STRUCTURE_FLOOR", "SUGGESTED_STEPS", "SUGGESTED_MASS"]
