"""What a fit's report says of the structure it left, and what to try when a layer is weak
(:func:`structure_warning`; :func:`fitted_structure_warning` for a fitted artifact, as ``structinit
inspect`` shows it).

The advice is derived from the project's own measurements, kept in one table (:data:`SHAPE_CLASSES`;
docs/init-methods.md shows it, :func:`advice_table` writes it): a shape is classed by how many values
a token's content carries against the width of the residual stream, and the warning fires only
where a layer is weak **and** a remedy was measured to structure that class of shape. Where the
whole-stream fit was measured to win (a token of few values: digits, 32x32 images in 2x2 patches)
a partly structured layer is what the winning init looks like, and nothing is advised.
Settings are marked with :func:`~structinit.errors.setting`, so each caller reads them in its own
syntax (a flag, a keyword argument, a grid key).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Dict, List, Optional, Tuple

from structinit.errors import param, setting

#: The hit rate on the fit's inputs below which a layer's structure is reported as weak.
STRUCTURE_FLOOR = 0.9


@dataclass(frozen=True)
class Remedy:
    """A setting measured to lift the structure of a class of shapes: ``name`` set to ``value``
    (``value`` ``None``: real inputs given as ``name``), what it was measured to do to the structure
    and to accuracy, and the result it comes from."""

    name: str
    value: Any
    structure: str
    accuracy: str
    source: str

    def words(self) -> str:
        """The setting, in the caller's syntax once rendered (a marked message)."""
        return f"real inputs ({param(self.name)})" if self.value is None else setting(self.name, self.value)


@dataclass(frozen=True)
class ShapeClass:
    """Shapes whose token carries at least ``at_least`` and at most ``at_most`` times the stream's
    width in values (``None``: unbounded; a class with neither bound holds the shapes no other
    class does), what the default init was measured to do there, and what to try, in order of
    measured effect on the structure (none: nothing is advised)."""

    name: str
    at_most: Optional[Fraction]
    at_least: Optional[Fraction]
    measured_at: str
    default: str
    remedies: Tuple[Remedy, ...] = ()

    @property
    def bounded(self) -> bool:
        return self.at_most is not None or self.at_least is not None

    def holds(self, ratio: Fraction) -> bool:
        return (self.at_least is None or ratio >= self.at_least) and (self.at_most is None or ratio <= self.at_most)


SUBSPACE = Remedy("position_subspace", True,
                  structure="0.96-1.00 per layer held out on ViT-T/S/B at 16x16 patches, without data",
                  accuracy="-0.72 ± 0.36 points against mimetic at 2,000 images where 49 values fill 48 (10 seeds) "
                           "with 4-pixel crops and flips; +0.52 ± 0.22 with flips alone, and a subspace of 4 "
                           "directions without data +1.90 ± 0.25 there (docs/results/conditioned)",
                  source="docs/results/patch16")
REAL_INPUTS = Remedy("data", None,
                     structure="mean 0.18 -> 0.36 per layer held out on ViT-T/16 (whole stream), 0.43 -> 0.84 at 49 "
                               "values into 48 (5 seeds, docs/results/conditioned)",
                     accuracy="not measured",
                     source="docs/results/patch16")

#: The shape classes, in order of the share of the stream a token's content takes.
SHAPE_CLASSES: Tuple[ShapeClass, ...] = (
    ShapeClass("a token of few values (at most a quarter of the stream)", Fraction(1, 4), None,
               "digits at 1 value a token into 64; Fashion-MNIST in 4x4 patches, 16 into 64",
               "0.76-0.97 per layer on noise without data; +2.69 ± 0.90 points over mimetic on 200 digits without "
               "data (10 seeds, docs/results/conditioned), "
               "-0.4 to +1.0 on the same base from 250 to 55,000 Fashion-MNIST images (docs/results/structure-gain)"),
    ShapeClass("between (more than a quarter of the stream, less than all of it)", None, None,
               "not measured", "not measured: compare on a validation split"),
    ShapeClass("a token's content fills the stream (as many values as the stream or more)", None, Fraction(1),
               "Fashion-MNIST in 7x7 patches, 49 values into 48; ViT-T/S/B at 16x16x3 patches, 768 into 192-768",
               "0.01-0.45 per layer held out at ViT-T/16, 0.16-0.80 at 49 into 48 (5 seeds); +0.41 ± 0.41 points over "
               "mimetic at 2,000 images (10 seeds, docs/results/patch16)",
               (SUBSPACE, REAL_INPUTS)),
)


def shape_class(token_values: Optional[int], dim: Optional[int]) -> Optional[ShapeClass]:
    """The class of a shape whose token carries ``token_values`` values into a stream of ``dim``
    (``None`` where either is unknown, e.g. a model of token ids)."""
    if not token_values or not dim:
        return None
    ratio = Fraction(int(token_values), int(dim))
    bounded = [c for c in SHAPE_CLASSES if c.bounded and c.holds(ratio)]
    return bounded[0] if bounded else next(c for c in SHAPE_CLASSES if not c.bounded)


def _remedies(cls: ShapeClass, report: Dict[str, Any], noise: bool) -> List[Remedy]:
    """The class's remedies the fit did not use already (every remedy's setting is looked up here)."""
    used = {"position_subspace": bool(report.get("position_subspace")), "data": not noise}
    return [r for r in cls.remedies if not used[r.name]]


def structure_warning(report: Dict[str, Any]) -> Optional[str]:
    """The warning for an impulse report whose data fit left a layer below :data:`STRUCTURE_FLOOR`
    on the inputs it was fitted to, where the shape's class (:func:`shape_class` of the fit's
    ``token_values`` and the report's ``dim``) has a measured remedy the fit did not use (``None``
    otherwise): the worst layer, each layer's figure, and the remedies in order of measured effect,
    each with what it was measured to do and where."""
    fit = report.get("data_fit") or {}
    rows = [r for r in fit.get("layers") or [] if r.get("hit_rate") is not None]
    weak = [r for r in rows if r["hit_rate"] < STRUCTURE_FLOOR]
    cls = shape_class(fit.get("token_values"), report.get("dim"))
    if not weak or cls is None:
        return None
    noise = fit.get("inputs") == "noise"
    ways = _remedies(cls, report, noise)
    if not ways:
        return None
    worst = min(weak, key=lambda r: r["hit_rate"])
    where = "its noise inputs" if noise else "the batch"
    per_layer = " ".join(f"{r['hit_rate']:.2f}" for r in rows)
    others = f" ({len(weak)} layers below {STRUCTURE_FLOOR}; per layer {per_layer})" if len(weak) > 1 else ""
    tries = "; then ".join(f"{r.words()} ({r.structure}; accuracy: {r.accuracy}; {r.source})" for r in ways)
    return (f"the data fit left layer {worst['layer']} hitting its offsets in {worst['hit_rate']:.2f} of the rows on "
            f"{where}{others}: a token's {fit['token_values']} values fill the stream of {report['dim']}, where "
            f"the whole-stream fit was measured unstructured; for structure try {tries}")


def fitted_structure_warning(fit: Dict[str, Any], grid, dim: int) -> Optional[str]:
    """:func:`structure_warning` for a fitted artifact's ``fit`` record (its identity and report) on
    token ``grid`` (a tuple) and a stream of ``dim``, as ``structinit inspect`` shows it (a fit on
    a batch does not record its inputs' shape: its shape is not classed, and nothing is advised)."""
    import math

    ident = fit.get("identity") or {}
    settings = ident.get("fit") or {}
    inputs = ident.get("inputs")
    kind = inputs.get("kind") if isinstance(inputs, dict) else "data"
    shape = inputs.get("shape") if isinstance(inputs, dict) else None
    values = None
    if shape and grid:
        values = math.prod(int(s) for s in shape) // max(1, math.prod(int(g) for g in grid))
    report: Dict[str, Any] = {"dim": dim, "data_fit": {"layers": (fit.get("report") or {}).get("layers"),
                                                       "inputs": kind, "token_values": values}}
    if settings.get("position_dims"):
        report["position_subspace"] = {"dims": settings["position_dims"]}
    return structure_warning(report)


def advice_table() -> str:
    """:data:`SHAPE_CLASSES` as the markdown table docs/init-methods.md shows (a test keeps them equal)."""
    lines = ["| a token's content, against the stream | measured at | what the default does | what to try, in order "
             "(measured effect) |", "|---|---|---|---|"]
    for c in SHAPE_CLASSES:
        tries = "<br>".join(f"{i}. `{r.name}={json.dumps(r.value)}`" if r.value is not None
                            else f"{i}. real inputs (`{r.name}`)" for i, r in enumerate(c.remedies, 1))
        effects = "; ".join(f"{r.structure}; accuracy: {r.accuracy} ({r.source})" for r in c.remedies)
        what = f"{tries}<br>{effects}" if c.remedies else "nothing is advised (no warning)"
        lines.append(f"| {c.name} | {c.measured_at} | {c.default} | {what} |")
    return "\n".join(lines)


__all__ = ["structure_warning", "fitted_structure_warning", "shape_class", "advice_table", "SHAPE_CLASSES",
           "ShapeClass", "Remedy", "STRUCTURE_FLOOR"]
