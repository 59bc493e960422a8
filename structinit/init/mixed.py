"""Mixed initialization: two registered init methods in one model, split by depth and by head.

The layers below ``split_layer`` get the ``lower`` method, the layers from it up the ``upper``
one (depth schedule: e.g. impulse filters in the early layers, where position carries the most,
and mimetic init above). With ``split_head``, the heads ``h < split_head`` of the lower layers keep
the lower method's Q/K and the heads from it up get the upper method's Q/K rows (and their q/k
bias rows); every other weight of a lower layer (V, the output projection) stays the lower
method's, so that, say, half the heads read the position subspace of the impulse init and half
the whole stream as mimetic init draws it.

Order of the writes: the lower method first, on its layers (on every layer where it can write no
selection: the impulse init with ``position_subspace``, whose subspace every layer must keep), with
the data it fits to; then the upper method on its layers (every layer with ``split_head``); then,
with ``split_head``, each lower layer is put back as the lower method left it except the upper
heads' Q/K rows. A weight of an upper layer that the upper method does not write keeps what was
there before it: the model's own where the lower method writes only its layers.

Shapes: ``heads`` ``H`` of ``d = D / H`` rows each in the q and k blocks (see
:mod:`structinit.init.inject`); layer indices 0-based.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from structinit.errors import UsageError, nest_settings, param
from structinit.init.base import InitSpec, InitWarning, register
from structinit.init.report import InitReport


@dataclass
class MixedPrepared:
    """What :meth:`MixedInit.prepare` made: the lower method's own prepared part and the data the
    upper one may fit to; :meth:`MixedInit.write` adds the upper part's (made once the lower
    method is written), which copies of the model get as they are."""

    lower: Any
    data: Any = None
    source: Optional[str] = None
    upper: Any = None


def _part_spec(owner: str, which: str, method: str, params: Dict[str, Any]) -> InitSpec:
    """The spec of one part (``which``: ``lower`` or ``upper``), refusals naming that parameter."""
    from structinit.init.registry import init_spec, spec_class

    try:
        cls = spec_class(method)
    except UsageError:
        from structinit.init.registry import INIT_METHODS

        parts = [n for n, c in INIT_METHODS.items() if n != owner and not c.needs_model]
        raise UsageError(f"{owner} parameter {param(which)} must be an init method that writes selected layers "
                         f"({', '.join(parts)}), got {method!r}") from None
    if cls.method == owner or cls.needs_model:
        why = "it is this method" if cls.method == owner else "it resets the whole model, not selected layers"
        raise UsageError(f"{owner} parameter {param(which)} cannot be {method} ({why})")
    try:
        return init_spec(method, **params)
    except UsageError as exc:
        raise UsageError(f"{owner} parameter {param(which + '_params')}: {exc.render()}") from None


def _short_params(spec: InitSpec) -> Dict[str, Any]:
    """``spec``'s parameters that differ from its defaults (the canonical form of a part's params)."""
    default = type(spec)().params()
    return {k: v for k, v in spec.params().items() if v != default.get(k)}


@register
@dataclass(frozen=True)
class MixedInit(InitSpec):
    """Two init methods in one model (see the module docstring): ``lower`` (default ``impulse``)
    with ``lower_params`` in layers ``[0, split_layer)``, ``upper`` (default ``mimetic``) with
    ``upper_params`` in layers ``[split_layer, depth)``. ``split_layer`` defaults to half the depth
    (rounded down), or to the whole depth with ``split_head``; ``split_head`` (default none) gives
    the heads ``h >= split_head`` of the lower layers the upper method's Q/K. A part is any
    registered method that writes selected layers; the upper one starts from the model's weights
    (its ``base`` stays ``model``), and every weight neither writes starts from the lower one's.

    Report: ``lower`` and ``upper`` (the parts' own reports), ``split_layer``, ``split_head``, and
    per selected layer ``layers[i]``: ``method`` (the part whose Q/K it has; ``mixed`` for a
    lower layer split by head), ``heads_lower`` (the heads with the lower method's Q/K) and
    ``replaced`` (the tensors either part wrote in it).
    """

    method = "mixed"
    writes = "what each part writes in its layers (Q/K rows of the upper heads, with split_head)"
    needs_grid = True
    lower: str = "impulse"
    lower_params: Dict[str, Any] = field(default_factory=dict)
    upper: str = "mimetic"
    upper_params: Dict[str, Any] = field(default_factory=dict)
    split_layer: Optional[int] = None
    split_head: Optional[int] = None

    def validate(self) -> None:
        self.check_positive("split_layer", "split_head")
        low = _part_spec(self.method, "lower", self.lower, self.lower_params)
        up = _part_spec(self.method, "upper", self.upper, self.upper_params)
        if up.other_weights != "model":
            raise UsageError(f"{self.method} parameter {param('upper_params')}: the upper part starts from the "
                             f"weights the lower one leaves, so its base must be model, got {up.other_weights}")
        object.__setattr__(self, "lower_params", _short_params(low))
        object.__setattr__(self, "upper_params", _short_params(up))
        object.__setattr__(self, "_parts", (low, up))

    @property
    def parts(self) -> Tuple[InitSpec, InitSpec]:
        """``(lower, upper)``: the two parts' specs."""
        return self._parts  # type: ignore[attr-defined]

    @property
    def other_weights(self) -> str:
        return self.parts[0].other_weights

    def algorithms(self) -> Dict[str, int]:
        """The parts' algorithms, each named after its part (``lower recipe fast``)."""
        out = {}
        for which, spec in zip(("lower", "upper"), self.parts):
            out.update({f"{which} {name}": v for name, v in spec.to_dict().get("algorithms", {}).items()})
        return out

    # ---- the data fit: the parts'

    @property
    def uses_data(self) -> bool:
        return any(p.uses_data for p in self.parts)

    @property
    def fit_samples(self) -> int:
        return max(p.fit_samples for p in self.parts)

    def _with_parts(self, low: InitSpec, up: InitSpec) -> "MixedInit":
        import dataclasses

        return dataclasses.replace(self, lower_params=_short_params(low), upper_params=_short_params(up))

    def with_fit_samples(self, samples: int) -> "MixedInit":
        return self._with_parts(*(p.with_fit_samples(samples) for p in self.parts))

    def without_fit(self) -> "MixedInit":
        return self._with_parts(*(p.without_fit() for p in self.parts))

    # ---- the split

    def splits(self, depth: int, heads: int) -> Tuple[int, Optional[int]]:
        """``(split_layer, split_head)`` for a model of ``depth`` layers and ``heads`` heads (the
        defaults resolved); :class:`UsageError` naming the parameter where a part would write nothing."""
        layer = self.split_layer if self.split_layer is not None else (depth if self.split_head else depth // 2)
        if layer > depth or (layer == depth and not self.split_head) or layer < 1:
            top = f"{depth}" if self.split_head else f"{depth - 1} (the model has {depth} layers)"
            raise UsageError(f"{self.method} parameter {param('split_layer')} must be 1 to {top}, got {layer}: "
                             "either part would write nothing")
        if self.split_head is not None and self.split_head >= heads:
            raise UsageError(f"{self.method} parameter {param('split_head')} must be 1 to {heads - 1} (the model has "
                             f"{heads} heads), got {self.split_head}: the upper heads would be none")
        return layer, self.split_head

    def _layers(self, t) -> Tuple[List[int], List[int]]:
        """``(lower, upper)``: the selected layers each part writes in ``t``."""
        split, head = self.splits(t.depth, t.heads)
        low, up = self.parts
        lower = list(t.layers) if low.writes_every_layer() else [i for i in t.layers if i < split]
        upper = list(t.layers) if head else [i for i in t.layers if i >= split]
        return lower, upper

    def _target(self, t, layers: List[int]):
        from structinit.init.attention_target import AttentionTarget

        return AttentionTarget(t.model if t.model is not None else t.sd, t.grid, t.heads, layers,
                               need_grid=self.needs_grid, progress=t.progress)

    # ---- refusals

    def check_target(self, target) -> None:
        lower, upper = self._layers(target)
        if not lower or not upper:
            raise UsageError(f"{self.method}: the selected {param('layers')} {target.layers} leave the "
                             f"{'lower' if not lower else 'upper'} part nothing to write (split_layer "
                             f"{self.splits(target.depth, target.heads)[0]})")
        low, up = self.parts
        low.check_target(self._target(target, lower))
        up.check_target(self._target(target, upper))
        if up.replaces_pos_embed(target) or up.writes_every_layer():
            raise UsageError(f"{self.method} parameter {param('upper')} {self.upper} would rewrite what every layer "
                             "reads (the position embedding); give it as the lower part")

    def check_shape(self, grid, dim: int, heads: int, depth: int, seed: int = 0, cache_dir=None) -> None:
        self.splits(depth, heads)
        for p in self.parts:
            p.check_shape(grid, dim, heads, depth, seed, cache_dir)

    def check_pos_embed(self, target) -> None:
        for p in self.parts:
            p.check_pos_embed(target)

    def replaces_pos_embed(self, target) -> bool:
        return self.parts[0].replaces_pos_embed(target)

    def presolves(self, shape, seed: int = 0) -> List[Any]:
        return [c for p in self.parts for c in p.presolves(shape, seed)]

    def planned(self, slot) -> List[str]:
        return sorted(set(self.parts[0].planned(slot)) | set(self.parts[1].planned(slot)))

    # ---- the steps

    def prepare(self, target, *, seed: int = 0, cache_dir=None, device: str = "cpu", data=None, source=None,
                progress=None, fit_progress=None, log=None, stage=None) -> MixedPrepared:
        """The lower part's prepare on its layers (its solve and data fit); the upper part's is made
        in :meth:`write`, after the lower part is written (it may fit to what the model then is)."""
        low = self.parts[0]
        sub = self._target(target, self._layers(target)[0])
        made = low.prepare(sub, seed=seed, cache_dir=cache_dir, device=device, data=data if low.uses_data else None,
                           source=source, progress=progress, fit_progress=fit_progress, log=log, stage=stage)
        return MixedPrepared(made, data, source)

    def write(self, target, prepared=None, *, seed: int = 0, cache_dir=None, device: str = "cpu") -> InitReport:
        if prepared is None:
            prepared = self.prepare(target, seed=seed, cache_dir=cache_dir, device=device)
        return self._write(target, prepared, None, seed, cache_dir, device)

    def write_copy(self, target, shared, *, first: bool, seed: int = 0, cache_dir=None, device: str = "cpu",
                   progress=None, stage=None) -> InitReport:
        """Each part's own copy write, with what it made on the model (or on the first copy)."""
        return self._write(target, shared, first, seed, cache_dir, device)

    def _write(self, t, prepared: MixedPrepared, first: Optional[bool], seed: int, cache_dir, device: str):
        """Both parts into ``t`` (``first``: ``None`` writes the model the parts prepared on, else a copy)."""
        low, up = self.parts
        lower, upper = self._layers(t)
        lt, ut = self._target(t, lower), self._target(t, upper)
        if first is None:
            low_report = low.write(lt, prepared.lower, seed=seed, cache_dir=cache_dir, device=device)
        else:
            low_report = low.write_copy(lt, prepared.lower, first=first, seed=seed, cache_dir=cache_dir, device=device)
        split, head = self.splits(t.depth, t.heads)
        kept = self._snapshot(t, [i for i in lower if i < split]) if head else {}
        if prepared.upper is None:
            prepared.upper = up.prepare(ut, seed=seed, cache_dir=cache_dir, device=device,
                                        data=prepared.data if up.uses_data else None, source=prepared.source)
            up_report = up.write(ut, prepared.upper, seed=seed, cache_dir=cache_dir, device=device)
        else:
            up_report = up.write_copy(ut, prepared.upper, first=bool(first), seed=seed, cache_dir=cache_dir,
                                      device=device)
        heads_up = self._restore(t, kept, head) if head else {}
        return self._report(t, low_report, up_report, split, head, heads_up)

    def _snapshot(self, t, layers: List[int]) -> Dict[str, Any]:
        """Copies of every tensor of the attention of ``layers`` (what :meth:`_restore` puts back)."""
        keys = {k for i in layers for k in _slot_keys(t.det.slots[i])}
        return {k: t.sd[k].detach().clone() for k in keys}

    def _restore(self, t, kept: Dict[str, Any], head: int) -> Dict[int, List[str]]:
        """Put back the tensors of ``kept`` except the Q/K rows (and q/k bias rows) of the heads from
        ``head`` up, which keep what the upper part wrote. Returns the rows so kept, per layer."""
        import torch

        from structinit.init.inject import label, read_part, write_part

        d = t.dim // t.heads
        layers = sorted({s.index for s in t.det.slots if any(k in kept for k in _slot_keys(s))})
        rows = {}
        for i in layers:
            slot = t.det.slots[i]
            parts = [p for p in (slot.q, slot.k, slot.q_bias, slot.k_bias) if p is not None]
            mine = [type(p)(p.key, p.start + head * d, p.stop, p.transposed) for p in parts]
            upper_rows = [read_part(t.sd, p) for p in mine]
            with torch.no_grad():
                for k in _slot_keys(slot):
                    t.sd[k].copy_(kept[k])
            for p, value in zip(mine, upper_rows):
                write_part(t.sd, p, value)
            rows[i] = [label(p) for p in mine]
        return rows

    def _report(self, t, low_report: InitReport, up_report: InitReport, split: int, head: Optional[int],
                heads_up) -> InitReport:
        def replaced(report: InitReport, i: int) -> List[str]:
            return [k for row in report.layers if row.layer == i for k in row.replaced]

        rows = []
        for i in t.layers:
            if i >= split:
                rows.append({"layer": i, "method": self.upper, "heads_lower": [], "replaced": replaced(up_report, i)})
            elif head:
                rows.append({"layer": i, "method": self.method, "heads_lower": list(range(head)),
                             "replaced": sorted(set(replaced(low_report, i)) | set(heads_up.get(i, [])))})
            else:
                rows.append({"layer": i, "method": self.lower, "heads_lower": list(range(t.heads)),
                             "replaced": replaced(low_report, i)})
        return InitReport.from_dict({"method": self.method, "layout": t.layout, "dim": t.dim, "heads": t.heads,
                                     "params": self.params(), "split_layer": split, "split_head": head,
                                     "lower": low_report.to_dict(), "upper": up_report.to_dict(), "layers": rows})

    # ---- what the user is told: the parts'

    @staticmethod
    def part_reports(report: InitReport) -> Tuple[InitReport, InitReport]:
        """The lower and the upper part's own reports, read back from ``report``'s ``extra``."""
        return InitReport.from_dict(report.extra["lower"]), InitReport.from_dict(report.extra["upper"])

    def warnings(self, report: InitReport, target, *, checkpoint: bool = False,
                 pe_scale: Optional[float] = None) -> List[InitWarning]:
        (low, up), (low_report, up_report) = self.parts, self.part_reports(report)
        said = []
        for which, part, own, base in (("lower", low, low_report, self.lower_params),
                                       ("upper", up, up_report, self.upper_params)):
            for w in part.warnings(own, target, checkpoint=checkpoint, pe_scale=pe_scale):
                # a part's advice is set through this init's <which>_params
                said.append(dataclasses.replace(w, text=nest_settings(w.text, f"{which}_params", base)))
        return said

    def notes(self, report: InitReport) -> List[str]:
        (low, up), (low_report, up_report) = self.parts, self.part_reports(report)
        return low.notes(low_report) + up.notes(up_report)


def _slot_keys(slot) -> List[str]:
    """Every tensor key one attention layer's parts live in (weights and biases, the output projection)."""
    keys = {p.key for p in (slot.q, slot.k, slot.v, slot.q_bias, slot.k_bias, slot.v_bias) if p is not None}
    if slot.proj is not None:
        keys.add(slot.proj)
    return sorted(keys)
