"""Writing the impulse init (:class:`~structinit.init.impulse.ImpulseInit`) into a target, in two
steps that every path shares (``initialize_model``, ``structinit train``, ``apply_checkpoint``):

1. :func:`prepare` makes what is written: it resets the base weights (``base``), writes the
   position table a target with a learned embedding needs, solves (or reads) the plain artifact and,
   on a model, fits it to the inputs (a batch given, else noise inputs of the model's input shape;
   :mod:`structinit.fit`). On a checkpoint, ``apply_checkpoint`` prepares on the model the file
   describes and writes the result into every copy of the model in the file.
2. :func:`write` writes the (fitted) artifact's Q/K of every selected layer, mimetic V/proj and the
   self term, checks each write against the solve, and reports what the attention is at init.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import numpy as np

from structinit.analysis.quality import measure
from structinit.errors import StructinitError, UsageError, param
from structinit.fit.inputs import FitInputs, data_inputs, noise_inputs
from structinit.geometry.targets import causal_mask, impulse_columns
from structinit.init.baselines import apply_base, generator
from structinit.init.conditioned import write_identity_value
from structinit.init.impulse_checks import check_artifact, check_causal
from structinit.init.inject import read_qk, write_qk, write_vproj
from structinit.init.mimetic import mimetic_v_proj
from structinit.init.pos_embed import write_sincos
from structinit.init.position_subspace import PositionSubspace
from structinit.init.report import InitReport, layers_line
from structinit.solver.self_shift import add_self_term

#: The scale of the sin-cos table written in place of a learned position embedding (see ``pe_scale``).
AUTO_PE_SCALE = 1.0
#: Why no fit ran, by case (the report's ``data_fit.skipped``).
NO_MODEL = ("not run: a checkpoint or state dict holds no model to run inputs through, so Q/K are the plain solve "
            "on the position embedding alone, which real inputs mostly wash out (data_fit=0 asks for it explicitly)")
NO_SHAPE = ("not run: the model does not tell its input shape (a model of token ids?) and no inputs were given, so "
            "Q/K are the plain solve on the position embedding alone, which real inputs mostly wash out; give data")


@dataclass
class Prepared:
    """What :func:`prepare` made: ``artifact`` (fitted, or the plain solve), ``plain`` (the plain
    solve) and whether each came from the cache, the fit's ``inputs`` (``None``: no fit ran, and
    ``skipped`` says why, unless ``data_fit`` is 0), what was written into the position embedding
    (``pos_embed_written``: words, or ``None``) and the modules ``base`` reset; ``on_model``: it was
    made on a model (its fit ran there), not on a state dict."""

    artifact: Any
    plain: Any
    cached: Optional[bool]
    fit_cached: Optional[bool] = None
    inputs: Optional[FitInputs] = None
    skipped: Optional[str] = None
    pos_embed_written: Optional[str] = None
    pe_scale: Optional[float] = None
    base_reset: Optional[int] = None
    subspace: Optional[PositionSubspace] = None
    on_model: bool = False


class ImpulseWriter:
    """Writes one target's layers for the fit (:class:`~structinit.fit.layers.LayerWriter`) and
    after it: the plain solve's Q/K and mimetic V/proj drawn from ``generator(seed + 1)`` in layer
    order, so that every pass over the layers writes the same V/proj. With a position ``subspace``
    each layer's writes into the stream are projected out of it (projections are idempotent, so a
    second pass writes the same), and :attr:`reads` tells the fit to read only the subspace."""

    def __init__(self, spec, target, artifact, seed: int, subspace: Optional[PositionSubspace] = None):
        self.spec, self.t, self.artifact = spec, target, artifact
        self.gen = generator(seed + 1)
        self.subspace = subspace
        #: The basis ``[D, k]`` Q/K may read (``None``: the whole stream).
        self.reads = subspace.basis if subspace is not None else None

    def place(self, slot):
        """Write ``artifact``'s Q/K of layer ``slot`` (and mimetic V/proj, or conditioned init's V with
        ``value_init="conditioned"``): ``(keys written, q, k)``
        with ``q, k`` read back ``[H, D, d]``."""
        import torch

        art, t = self.artifact, self.t
        src = 0 if art.depth == 1 else slot.index
        keys = write_qk(t.sd, slot, torch.from_numpy(art.q[src]), torch.from_numpy(art.k[src]))
        if self.spec.mimetic_vproj and self.spec.value_init == "conditioned":
            keys += write_identity_value(t.sd, slot, t.dim)
        elif self.spec.mimetic_vproj:
            w_v, w_p, _ = mimetic_v_proj(t.dim, self.spec.alpha2, self.spec.beta2, self.gen)
            keys += write_vproj(t.sd, slot, w_v, w_p)
        if self.subspace is not None:
            self.subspace.project_layer(t, slot)
        rq, rk = read_qk(t.sd, slot, t.heads)
        return keys, rq, rk

    def start(self, slot):
        _, rq, rk = self.place(slot)
        return rq, rk

    def write(self, slot, q, k) -> None:
        write_qk(self.t.sd, slot, q, k)

    def read(self, slot):
        return read_qk(self.t.sd, slot, self.t.heads)


class ContentWriter:
    """With ``content_qk`` (:mod:`structinit.init.content_qk`): each layer's heads get Q/K on the
    content directions in the columns the position part leaves free, drawn from
    ``generator(seed + CONTENT_SEED_OFFSET)`` in layer order; otherwise it writes nothing."""

    def __init__(self, spec, target, subspace: Optional[PositionSubspace], seed: int):
        from structinit.init.content_qk import CONTENT_SEED_OFFSET

        self.spec, self.t, self.subspace = spec, target, subspace
        self.gen = generator(seed + CONTENT_SEED_OFFSET)
        #: Whether there is anything to write (``content_qk`` needs the subspace, which validation checks).
        self.on = spec.content_qk != "none" and subspace is not None

    def add(self, slot, rq, rk):
        """Write layer ``slot``'s Q/K with the content part added; ``(q, k)`` read back ``[H, D, d]``
        (``rq, rk`` as they were when there is nothing to add)."""
        if not self.on or self.subspace is None:
            return rq, rk
        from structinit.init.content_qk import with_content

        spec = self.spec
        q, k = with_content(rq, rk, self.subspace.basis, spec.content_qk, spec.content_scale, self.gen,
                            spec.content_zero_keys)
        write_qk(self.t.sd, slot, q, k)
        return read_qk(self.t.sd, slot, self.t.heads)

    def record(self) -> Dict[str, Any]:
        """The report's ``content_qk``: the method, its scale and the columns of each head it wrote."""
        assert self.subspace is not None
        columns = self.t.dim // self.t.heads - self.subspace.dims
        return {"method": self.spec.content_qk, "scale": self.spec.content_scale, "columns": columns,
                **({"zero_keys": True} if self.spec.content_zero_keys else {})}


def fit_inputs(spec, t, data, seed: int, source: Optional[str]):
    """``(inputs, skipped)``: what the data fit of ``spec`` runs on for target ``t`` (the batch
    ``data``; noise of its shape with ``data_fit_inputs="noise"``; without ``data``, noise of the
    model's input shape), or ``(None, why not)`` when it cannot run without data (no model; no input
    shape; q/k that are not linear maps). Given ``data``, a target the fit cannot run on is refused
    (:meth:`~structinit.init.impulse.ImpulseInit.check_data_target`)."""
    if not spec.data_fit:
        return None, None
    if data is not None:
        spec.check_data_target(t)
        if spec.data_fit_inputs == "data":
            return data_inputs(data, spec.data_fit_samples, source), None
        return noise_inputs(tuple(data.shape[1:]), spec.data_fit_samples, seed), None
    if t.model is None:
        return None, NO_MODEL
    shape = t.inputs.noise_shape if t.inputs is not None else None
    if shape is None:
        return None, NO_SHAPE
    try:
        spec.check_data_target(t)
    except UsageError as exc:  # the default, not asked for: a model it cannot fit keeps the plain solve, and says why
        return None, f"not run: {exc.render()}, so Q/K are the plain solve (data_fit=0 asks for it explicitly)"
    return noise_inputs(shape, spec.data_fit_samples, seed), None


def write_position(spec, t, given) -> tuple:
    """Write the position table ``spec`` asks for into model target ``t``: ``pe_scale`` times the
    sin-cos table; or, where the model's embedding is not the table (timm's learned one) and
    nothing else was asked (no ``pe_scale``, ``fit_pe`` or artifact), the table x1 in its place
    (kept learnable); ``pe_factor`` scales the model's own. Returns ``(words or None, scale or None)``."""
    import torch

    auto = given is None and t.model is not None and spec.replaces_pos_embed(t)
    words, scale = None, spec.pe_scale
    if auto:
        # A learned embedding (timm's trunc normal 0.02) tells the layers almost nothing of position: the
        # sin-cos table takes its place, learnable as it was (see docs/results/stock-models).
        scale = AUTO_PE_SCALE
        words = f"sin-cos table x{AUTO_PE_SCALE:g} in place of the model's own {t.pos_key}, kept learnable"
    if scale is not None:
        if t.model is None or t.pos_key is None:
            raise UsageError(f"impulse parameter {param('pe_scale')} needs a model with a position embedding; on a "
                             "checkpoint write the embedding with set_pe")
        write_sincos(t.sd[t.pos_key], t.grid, scale, name=t.pos_key)  # in place: the model's own tensor
        words = words or f"sin-cos table x{scale:g} (pe_scale)"
    if spec.pe_factor is not None:
        if t.model is None or t.pos_key is None:
            raise UsageError(f"impulse parameter {param('pe_factor')} scales a model's position embedding; the "
                             "target has none (on a checkpoint, scale it before)")
        with torch.no_grad():
            t.sd[t.pos_key].mul_(spec.pe_factor)
        words = f"the model's own {t.pos_key} x{spec.pe_factor:g} (pe_factor)"
    return words, scale


def prepare(spec, t, *, seed: int = 0, cache_dir=None, device: str = "cpu", artifact=None,
            cached: Optional[bool] = None, progress=None, check_pe: bool = True, data=None, fit_progress=None,
            log=None, source: Optional[str] = None, stage=None) -> Prepared:
    """Step 1 (see the module docstring): the artifact to write into target ``t``, with the model's
    base, position table and data fit done. Arguments as :meth:`ImpulseInit.prepare`; ``stage(words)``
    hears "solving" (or "reading the artifact") before the artifact is made."""
    from structinit.fit.artifact import load_or_fit

    if artifact is None and spec.artifact is not None:  # a given fitted artifact is written as it is, not fitted on
        from structinit.solver.cache import resolve_artifact

        given = resolve_artifact(spec.artifact, cache_dir)
        if given.fit:
            artifact, cached = given, None
    given_fit = artifact is not None and bool(getattr(artifact, "fit", None))
    base_reset = apply_base(t, spec.base, seed, spec.method)
    inputs, skipped = fit_inputs(spec, t, data, seed, source) if not given_fit else (None, None)
    subspace = None
    if spec.position_subspace:
        subspace = PositionSubspace.for_target(t, spec.position_dims, spec.pe_scale, seed, spec.position_rest,
                                                spec.position_keep_norms)
        pe_written, pe_scale = subspace.write_table(t), spec.pe_scale
        subspace.project_embedding(t)
    else:
        pe_written, pe_scale = write_position(spec, t, artifact)
    if artifact is None:
        if stage is not None:
            stage("solving" if spec.artifact is None else "reading the artifact")
        artifact, cached = spec.artifact_for(t, seed, cache_dir, device, progress)
    elif check_pe:
        spec.check_pos_embed(t, artifact)
    if given_fit and check_pe and t.model is not None:  # on the model the fit ran through: the same weights?
        from structinit.fit.identity import check_fitted_to

        check_fitted_to(artifact, t, t.inputs.shape if t.inputs is not None else None)
    plain = artifact
    check_artifact(plain, t.grid, t.dim, t.heads, t.layers)
    check_causal(t, plain.config.causal)
    out = Prepared(artifact, plain, cached, inputs=inputs, skipped=skipped, pos_embed_written=pe_written,
                   pe_scale=pe_scale, base_reset=base_reset, subspace=subspace, on_model=t.model is not None)
    if inputs is not None:
        out.artifact, out.fit_cached = load_or_fit(spec.fit_settings(subspace), t, plain, inputs,
                                                   ImpulseWriter(spec, t, plain, seed, subspace), seed, cache_dir,
                                                   fit_progress, log)
    elif given_fit:
        out.fit_cached = cached
    return out


def write(spec, t, prepared: Prepared, seed: int) -> InitReport:
    """Step 2 (see the module docstring): write ``prepared.artifact`` into every selected layer of
    ``t`` and return the init's report. The report's per-layer ``hit_rate``/``target_mass``/``mse``
    are measured from the written weights on the target's own LayerNorm'd position embedding
    (``measured_on`` says which input), ``solved`` on the artifact's pseudo input (where the write is
    checked against the solve: a difference over ``tolerance`` is a :class:`StructinitError`)."""
    art = prepared.artifact
    mask = causal_mask(art.config.grid, art.config.causal)
    own = t.own_input()
    writer = ImpulseWriter(spec, t, art, seed, prepared.subspace)
    solved = art.stats.get("layers", [])
    content = ContentWriter(spec, t, prepared.subspace, seed)
    rows = []
    for slot in t.slots:
        src = 0 if art.depth == 1 else slot.index
        keys, rq, rk = writer.place(slot)
        rq, rk = content.add(slot, rq, rk)
        cols = impulse_columns(art.config.grid, art.offsets[src], art.config.padding)
        placed = measure(art.layer_input(src), rq, rk, cols, mask)
        if src < len(solved):
            check_placed(spec, slot.index, solved[src], placed)
        if spec.self_weight and not art.fit:  # a fitted artifact has the self term mixed in already
            write_qk(t.sd, slot, *add_self_term(rq, rk, spec.self_weight))
            rq, rk = read_qk(t.sd, slot, t.heads)
            placed = measure(art.layer_input(src), rq, rk, cols, mask)
        same = own is None or np.allclose(own, art.layer_input(src), atol=1e-5)
        got = placed if same else measure(own, rq, rk, cols, mask)
        rows.append({"layer": slot.index, "replaced": keys, "offsets": art.offsets[src].tolist(), **got.layer_row(),
                     "solved": {m: float(getattr(placed, m).mean()) for m in ("hit_rate", "target_mass")}})
    out = report(spec, t, prepared, rows, own is not None)
    if content.on:
        out["content_qk"] = content.record()
    return InitReport.from_dict(out)


def check_placed(spec, layer: int, solved: List[Dict[str, Any]], placed) -> None:
    """Raise :class:`StructinitError` when the written weights of ``layer`` give another hit rate or
    target mass than the solve (``solved``: its heads' stats) by more than ``spec.tolerance``."""
    for name in ("hit_rate", "target_mass"):
        want = float(np.mean([h[name] for h in solved]))
        got = float(getattr(placed, name).mean())
        if abs(want - got) > spec.tolerance:
            raise StructinitError(f"layer {layer}: the written weights give {name} {got:.3f} but the solve has "
                                  f"{want:.3f}; the Q/K rows were not placed as the layout expects")


def noise_notice(report: InitReport) -> Optional[str]:
    """The line that says a fit ran on noise because no data was given (``None`` otherwise)."""
    fit = report.fit
    if fit is None or fit.inputs != "noise" or not fit.default_inputs:
        return None
    return (f"impulse: no data given, so Q/K were fitted on {fit.samples} Gaussian noise inputs (the "
            f"normalized input's statistics; on digits this trains within half a point of a fit on real images); "
            f"give real inputs ({param('data')}) to fit those")


def summary(spec, report: InitReport, model: Optional[str] = None) -> List[str]:
    """What a command prints of an impulse init (:meth:`~structinit.init.base.InitSpec.summary`):
    where Q/K were fitted (through ``model``, words) and the attention on those inputs, per layer;
    else that they are the plain solve (and why), with the attention on the position embedding alone."""
    lines = _summary(spec, report, model)
    content = report.extra.get("content_qk")
    if content:
        lines.append(f"content Q/K ({content['method']}, {param('content_scale')} {content['scale']:g}"
                     f"{', zero keys' if content.get('zero_keys') else ''}) written into {content['columns']} columns "
                     "of each head after the fit: the figures above are the position part's alone"
                     + ("" if content.get("zero_keys") else ", and on real inputs the content logits move them"))
    return lines


def _summary(spec, report: InitReport, model: Optional[str]) -> List[str]:
    fit = report.fit
    alone = layers_line("hit rate", [row.hit_rate for row in report.layers])
    if fit is not None and fit.layers:
        art = fit.artifact or {}
        cached = (", read from the cache" if art.get("cached") else
                  f", the given {param('artifact')}" if art.get("given") else "")
        rows = fit.layers
        return [f"Q/K fitted through {model or 'the model'} on {fit.source} ({fit.seconds or 0:.1f}s{cached})",
                f"attention on {fit.measured_count} of those inputs, per layer: "
                + layers_line("hit rate", [r.get("hit_rate") for r in rows]) + "; "
                + layers_line("target mass", [r.get("target_mass") for r in rows])]
    if fit is not None and fit.skipped:
        return [f"Q/K: the plain solve (data fit {fit.skipped})"] + (
            [f"attention on the position embedding alone: {alone}"] if alone else [])
    if not spec.data_fit:
        return [f"Q/K: the plain solve ({param('data_fit')} 0); on the position embedding alone, which real "
                f"inputs wash out: {alone}"]
    return [f"attention on the position embedding alone: {alone}"] if alone else []


def fit_record(spec, prepared: Prepared) -> Optional[Dict[str, Any]]:
    """The report's ``data_fit``: what the fit did and on what (``None`` when it is off)."""
    art = prepared.artifact
    if not art.fit:
        return {"skipped": prepared.skipped} if prepared.skipped else None
    out = dict(art.fit["report"])
    inputs = prepared.inputs
    fit = spec.fit_settings(prepared.subspace)
    out.update(steps=fit.steps, mass=fit.mass, l2=fit.l2, lr=fit.lr, norm=fit.norm, calibrated_to=fit.calibrated_to,
               version=fit.version, inputs=inputs.kind if inputs is not None else None,
               default_inputs=inputs is not None and inputs.kind == "noise" and spec.data_fit_inputs == "data",
               token_values=inputs.token_values(int(np.prod(art.config.grid))) if inputs is not None else None,
               source=inputs.source if inputs is not None else art.fit.get("source"),
               artifact={"key": art.key, "path": str(art.path) if art.path else None,
                         "cached": prepared.fit_cached,
                         **({"given": True} if inputs is None and spec.artifact is not None else {})})
    return out


def report(spec, t, prepared: Prepared, rows, own: bool) -> Dict[str, Any]:
    """The init's JSON-able report (see :meth:`ImpulseInit.apply`)."""
    art, plain = prepared.artifact, prepared.plain
    given_fit = bool(plain.fit)
    measured_on = (f"{t.pos_key} ({t.pos_embed_kind()}), LayerNorm'd" if own
                   else f"the artifact's pseudo input ({art.config.pseudo_input}; the target has no position "
                        "embedding)")
    return {"method": "impulse", "layout": t.layout, "grid": list(t.grid), "dim": t.dim, "heads": t.heads,
            "artifact": ({"key": plain.key, "path": str(plain.path) if plain.path else None,
                          "cached": prepared.cached, "config": plain.config.to_dict()} if not given_fit else
                         {"key": plain.fit["identity"]["plain"], "path": None, "cached": None,
                          "config": plain.config.to_dict()}),
            "mimetic_vproj": spec.mimetic_vproj,
            **({"value_init": spec.value_init} if spec.value_init != "mimetic" else {}),
            "pe_scale": spec.pe_scale, "fit_pe": spec.fit_pe,
            "pos_embed_written": prepared.pos_embed_written,
            **({"position_subspace": prepared.subspace.record()} if prepared.subspace is not None else {}),
            "self_weight": spec.self_weight, "data_fit": fit_record(spec, prepared),
            **({"base_reset": prepared.base_reset} if prepared.base_reset is not None else {}),
            "measured_on": measured_on, "layers": rows,
            "hit_rate": float(np.mean([r["hit_rate"] for r in rows])),
            "target_mass": float(np.mean([r["target_mass"] for r in rows]))}


__all__ = ["Prepared", "ImpulseWriter", "prepare", "write", "fit_inputs", "write_position", "noise_notice", "summary"]
