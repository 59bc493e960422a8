"""The fit of a model, layer by layer (:class:`LayerFit`, :func:`fit_layers`).

Layers are fitted in increasing order: layer ``i``'s input is captured on the batch as layers
``0..i-1`` make it once they are fitted and written, then its heads are refined and calibrated
(:mod:`structinit.fit.refine`) and written back. What is written is the init's business: a
:class:`LayerWriter` writes a layer's starting point (the plain solve's Q/K and whatever the init
sets beside them, such as mimetic V/proj) and the fitted Q/K.

Shapes: inputs ``[B, T, D]`` (``T`` = prefix tokens such as a class token, then the grid's ``N``);
per-head weights ``q, k: [H, D, d]``; target columns ``[H, N]`` over the grid, ``[H, T]`` once
prefixed (``-1``: no target, not fitted).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Protocol, Sequence, Tuple

import numpy as np

from structinit.analysis.capture import LayerInputs, attention_inputs, projection_module
from structinit.errors import Notice, UsageError
from structinit.fit import refine
from structinit.fit.settings import FitSettings
from structinit.geometry.grid import Grid
from structinit.runtime import duration_text
from structinit.solver.self_shift import add_self_term

#: Steps of the first layer timed before the fit's duration is estimated.
TIMED_STEPS = 5
#: An estimate at or above this many seconds is said (``log``) before the rest of the fit runs.
SAY_FIT_ESTIMATE = 5.0


#: :func:`fit_layers`' result: ``(q, k, offsets, report)``.
FittedLayers = Tuple[np.ndarray, np.ndarray, np.ndarray, Dict[str, Any]]


class FitTarget(Protocol):
    """The model a fit runs on, as an :class:`~structinit.init.attention_target.AttentionTarget`
    holds it (the fit stage comes before the init stage, so it names what it reads instead): the
    ``model``, its detected layout ``det`` (``det.slots[i].q.key``: layer ``i``'s q weight), its
    ``grid``, its ``depth``, the selected ``layers`` and their ``slots``, and the model's
    ``family`` (whose ``blocks(model)`` the layer inputs are streamed through)."""

    @property
    def model(self) -> Any: ...

    @property
    def family(self) -> Any: ...

    @property
    def det(self) -> Any: ...

    @property
    def grid(self) -> Optional[Grid]: ...

    @property
    def depth(self) -> int: ...

    @property
    def layers(self) -> Sequence[int]: ...

    @property
    def slots(self) -> Iterable[Any]: ...


class LayerWriter(Protocol):
    """Writes a layer of the model being fitted (``slot``: the layer's
    :class:`~structinit.init.layouts.AttnSlot`). ``reads``: an orthonormal basis ``[D, k]`` of the
    directions Q/K may read (the fit then runs on the layer inputs projected onto it), or ``None``
    for the whole stream."""

    reads: Any

    def start(self, slot) -> Tuple[Any, Any]:
        """Write the layer's starting Q/K and what the init writes beside them; return the Q/K read back."""

    def write(self, slot, q, k) -> None:
        """Write the fitted ``q, k [H, D, d]`` into the layer."""

    def read(self, slot) -> Tuple[Any, Any]:
        """The layer's Q/K as written, ``[H, D, d]`` each."""


def prefixed_columns(columns, tokens: int):
    """Grid target columns ``[H, N]`` as columns over all ``tokens`` (``T = prefix + N``) of a
    model with prefix tokens (a class token) first: prefix rows get ``-1`` (no target: not fitted),
    grid targets shift by the prefix. ``[H, T]`` int64."""
    import torch

    cols = torch.as_tensor(np.asarray(columns)).long()
    prefix = int(tokens) - int(cols.shape[1])
    if prefix < 0:
        raise UsageError(f"the model has {tokens} tokens, fewer than the {cols.shape[1]} of the grid")
    if not prefix:
        return cols
    shifted = torch.where(cols >= 0, cols + prefix, cols)
    return torch.cat([torch.full((cols.shape[0], prefix), -1, dtype=torch.long), shifted], dim=1)


def prefixed_mask(mask, tokens: int):
    """A grid's visible-key mask ``[N, N]`` (or ``None``) over all ``tokens`` with prefix tokens
    first (they see and are seen by every token), as a bool tensor ``[T, T]``."""
    import torch

    if mask is None:
        return None
    m = torch.as_tensor(np.asarray(mask)).bool()
    prefix = int(tokens) - int(m.shape[0])
    if not prefix:
        return m
    full = torch.ones(tokens, tokens, dtype=torch.bool)
    full[prefix:, prefix:] = m
    return full


class LayerFit:
    """One model's fit, layer by layer in increasing order. ``target``: an
    :class:`~structinit.init.attention_target.AttentionTarget` holding the model; ``x``: the batch, as the
    model takes it; ``window``: the filter size (the report's share of attention inside its window).
    ``progress(done, total)`` follows every step (it may raise to stop the fit); ``log(message)``
    hears the estimated duration once the first steps are timed, and a line per layer."""

    def __init__(self, settings: FitSettings, target: FitTarget, x, seed: int, window: int,
                 progress: Optional[Callable[[int, int], None]] = None, log: Optional[Callable[[str], None]] = None):
        self.settings, self.t, self.x, self.seed, self.window = settings, target, x, seed, window
        self.progress, self.log = progress, log
        self.total = len(target.layers) * (settings.steps + 1)
        self.done = 0
        self.inputs: Optional[LayerInputs] = None
        self.seconds = 0.0
        self.streamed = False
        self.step_images: Optional[int] = None
        self.measured: List[Dict[str, Any]] = []
        self.measured_on = 0
        self.started = time.perf_counter()
        self.steps_started: Optional[float] = None
        self.estimate: Optional[float] = None

    def tick(self) -> None:
        self.done += 1
        if self.done == TIMED_STEPS and self.estimate is None:
            self.say_estimate()
        self.poll()

    def poll(self) -> None:
        if self.progress is not None:
            self.progress(self.done, self.total)

    def say_estimate(self) -> None:
        """Estimate the whole fit from the time its first steps took (and the first layer's capture) and
        say it."""
        began = self.steps_started if self.steps_started is not None else self.started
        per_step = (time.perf_counter() - began) / max(self.done, 1)
        self.estimate = (began - self.started) + per_step * self.total
        if self.log is not None and self.estimate >= SAY_FIT_ESTIMATE:
            device = next(self.t.model.parameters()).device
            self.log(Notice(f"data fit: {len(self.t.layers)} layers x {self.settings.steps} steps on "
                            f"{int(self.x.shape[0])} inputs, about {duration_text(self.estimate)} on {device} "
                            "(estimated from its first steps)"))

    def layer_input(self, index: int):
        if self.settings.version == 1:  # the whole model on the whole batch for every layer, as it was
            return attention_inputs(self.t.model, self.x)[index].float()
        if self.inputs is None:
            modules = [projection_module(self.t.model, s.q.key) for s in self.t.det.slots]
            self.inputs = LayerInputs(self.t.model, self.x, modules, between=self.poll,
                                      blocks=self.t.family.blocks(self.t.model))
            self.streamed = self.inputs.streamed
        return self.inputs(index)

    def fit(self, slot, q, k, cols, mask, writer: LayerWriter) -> None:
        """Refine layer ``slot`` from ``q, k`` (the written plain solve), mix in the self term,
        calibrate and write it through ``writer``."""
        s = self.settings
        start = time.perf_counter()
        x = self.layer_input(slot.index)
        if self.steps_started is None:
            self.steps_started = time.perf_counter()
        columns = prefixed_columns(cols, x.shape[1])
        visible = prefixed_mask(mask, x.shape[1])
        reads = getattr(writer, "reads", None)
        if reads is not None:  # Q/K read only a subspace: fit in its coordinates, write back into the stream
            x = x @ reads.to(x.device)
            q, k = reads.T @ q, reads.T @ k
        if s.version == 1:
            q, k = refine.refine_qk(x, q, k, columns, steps=s.steps, mass=s.mass, l2=s.l2, lr=s.lr, norm=s.norm,
                                    mask=visible)
            self.done += s.steps
        else:
            self.step_images = min(refine.step_images(x.shape[1], s.batch), int(x.shape[0]))
            q, k = refine.refine_qk_minibatch(
                x, q, k, columns, steps=s.steps, mass=s.mass, l2=s.l2, lr=s.lr, norm=s.norm, batch=s.batch,
                mask=visible, seed=self.seed * 1_000_003 + slot.index, tick=self.tick)
        if s.self_weight:
            q, k = add_self_term(q, k, s.self_weight)
        calibrate = refine.calibrate_on_batch if s.version == 1 else refine.calibrate
        q, k = calibrate(x, q, k, columns, s.calibrated_to, visible)
        if s.version > 1:
            self.measure(slot.index, x, q, k, columns, visible)
        if reads is not None:
            q, k = reads @ q, reads @ k
        writer.write(slot, q, k)
        self.tick()
        took = time.perf_counter() - start
        self.seconds += took
        if self.log is not None:
            self.log(f"data fit: layer {slot.index} ({self.t.layers.index(slot.index) + 1}/{len(self.t.layers)}) "
                     f"on {int(x.shape[0])} inputs in {took:.1f}s")

    def measure(self, index: int, x, q, k, columns, visible) -> None:
        """Layer ``index``'s attention with the written ``q, k`` on (the first
        :data:`~structinit.fit.refine.CALIBRATION_SAMPLES` of) its fitted inputs ``x``: hit rate,
        target mass (per head too) and the share inside the filter's window, over grid queries."""
        import torch

        from structinit.analysis.fidelity import window_mask
        from structinit.analysis.quality import attention_maps, attention_quality

        grid = self.t.grid
        assert grid is not None  # the impulse init, which fits, needs the grid (needs_grid)
        sub = x[:refine.CALIBRATION_SAMPLES]
        prefix = int(x.shape[1]) - grid.tokens
        attn = attention_maps(sub[:, None], q[None].to(sub.device), k[None].to(sub.device),
                              None if visible is None else visible.to(sub.device))[:, :, prefix:, :]
        got = attention_quality(attn, columns[:, prefix:].to(sub.device))
        window = torch.from_numpy(window_mask(grid, self.window, prefix)).to(attn.device)
        heads = {m: [round(float(v), 6) for v in got[m].mean(0)] for m in ("hit_rate", "target_mass")}
        self.measured.append({"layer": index, **{m: float(np.mean(v)) for m, v in heads.items()},
                              "window_mass": float((attn * window).sum(-1).mean()), "heads": heads})
        self.measured_on = int(sub.shape[0])

    def report(self, rows, config) -> Dict[str, Any]:
        """The fit's record: per layer the attention on the fitted inputs (version 1: the whole
        batch through the model; version 2: measured as each layer was written)."""
        if self.settings.version == 1:
            from structinit.analysis.fidelity import data_attention_quality

            out = data_attention_quality(self.t.model, self.x, [r["offsets"] for r in rows], config.grid,
                                         padding=config.padding, causal=config.causal,
                                         layers=[r["layer"] for r in rows])
        else:
            layers = self.measured
            mean = {m: float(np.mean([r[m] for r in layers])) for m in ("hit_rate", "target_mass", "window_mass")}
            out = {"samples": int(self.x.shape[0]), "measured_on": self.measured_on, "layers": layers, **mean}
        out.update(seconds=round(self.seconds, 3), streamed=self.streamed, step_images=self.step_images)
        return out


def fit_layers(settings: FitSettings, target: FitTarget, plain, x, seed: int, writer: LayerWriter,
               progress: Optional[Callable[[int, int], None]] = None,
               log: Optional[Callable[[str], None]] = None) -> FittedLayers:
    """Fit every selected layer of ``target``'s model on ``x``, starting from the plain artifact
    ``plain``: ``(q, k, offsets, report)`` with ``q, k: [depth, H, D, d]`` (the plain solve's in the
    layers not fitted) and ``offsets: [depth, H, 2]``."""
    from structinit.geometry.targets import causal_mask, impulse_columns

    t, c = target, plain.config
    src = [0 if plain.depth == 1 else i for i in range(t.depth)]
    q = np.stack([plain.q[s] for s in src]).astype(np.float32)
    k = np.stack([plain.k[s] for s in src]).astype(np.float32)
    offsets = np.stack([plain.offsets[s] for s in src]).astype(np.int32)
    mask = causal_mask(c.grid, c.causal)
    fitter = LayerFit(settings, t, x, seed, c.filter, progress, log)
    for slot in t.slots:
        rq, rk = writer.start(slot)
        cols = impulse_columns(c.grid, offsets[slot.index], c.padding)
        fitter.fit(slot, rq, rk, cols, mask, writer)
        fq, fk = writer.read(slot)
        q[slot.index], k[slot.index] = fq.numpy(), fk.numpy()
    report = fitter.report([{"layer": i, "offsets": offsets[i].tolist()} for i in t.layers], c)
    return q, k, offsets, report


__all__ = ["FitTarget", "LayerFit", "LayerWriter", "fit_layers", "prefixed_columns", "prefixed_mask"]
