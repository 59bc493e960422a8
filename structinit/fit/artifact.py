"""Fitted artifacts: the data fit's Q/K, stored, found and shared like a solve's.

The file is ``n{N}-d{D}-h{heads}-f{f}-fit-{key}.safetensors`` in the artifact cache, its key the
hash of what the fit depends on (:func:`structinit.fit.identity.fit_identity`), written atomically
under the key's lock by the routine every cached artifact goes through
(:func:`structinit.solver.cache.load_or_compute`): of many processes fitting the same model to the
same inputs (the tasks of a SLURM array that share a model seed), one fits, the others say that they
wait and then read its result. A copy that is corrupt, or holds another artifact than its name
says, is reported, set aside and fitted again, never loaded.

Example::

    art, cached = load_or_fit(settings, target, plain, inputs, writer, seed=0)  # the model is not written on a hit
    art.fit["identity"]["weights"]      # sha256:... of the weights the fit read
    art.q.shape                         # [layers, heads, D, d], the fitted Q/K of every layer
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Dict, Optional, Tuple, Union

import numpy as np

from structinit.analysis.quality import measure
from structinit.fit.identity import fit_identity
from structinit.fit.inputs import FitInputs
from structinit.fit.layers import FitTarget, LayerWriter, fit_layers
from structinit.fit.settings import FitSettings
from structinit.geometry.targets import causal_mask, impulse_columns
from structinit.solver.artifact import Artifact, fit_filename, fit_key
from structinit.solver.cache import load_or_compute


def load_or_fit(settings: FitSettings, target: FitTarget, plain: Artifact, inputs: FitInputs, writer: LayerWriter,
                seed: int = 0, cache_dir: Union[str, os.PathLike, None] = None,
                progress: Optional[Callable[[int, int], None]] = None,
                log: Optional[Callable[[str], None]] = None,
                warn: Optional[Callable[[str], None]] = None) -> Tuple[Artifact, bool]:
    """``(artifact, cached)``: the fitted artifact of ``target``'s model (an
    :class:`~structinit.init.attention_target.AttentionTarget`) on ``inputs`` from the plain artifact
    ``plain``, from the cache, or fitted now (``writer`` writes the fitted layers into the model as
    it goes) and stored. ``progress``/``log`` follow the fit (see
    :class:`~structinit.fit.layers.LayerFit`; ``log`` also hears a wait for another process's fit);
    ``warn(message)`` hears of an unusable cached copy, which is set aside and fitted again
    (default: a :class:`~structinit.errors.StructinitWarning`). The artifact's ``fit["source"]`` is
    this call's ``inputs.source``, and ``fit["cached"]`` whether it was read from the cache."""
    if warn is None:
        def warn(message: str) -> None:
            import warnings

            from structinit.errors import StructinitWarning

            warnings.warn(StructinitWarning(message), stacklevel=3)
    identity = fit_identity(settings, target, plain, inputs, seed)
    key = fit_key(identity)
    art, cached = load_or_compute(
        fit_filename(plain.config, key),
        lambda: run_fit(settings, target, plain, inputs, writer, seed, identity, progress, log),
        key=key, fitted=True, cache_dir=cache_dir, warn=warn, wait=log, what="fitted")
    assert art.fit is not None  # a fitted artifact: run_fit's, or a cached one load_or_compute checked is fitted
    art.fit = {**art.fit, "source": inputs.source, "cached": cached}  # this call's inputs, not the first fitter's
    return art, cached


def run_fit(settings: FitSettings, target: FitTarget, plain: Artifact, inputs: FitInputs, writer: LayerWriter,
            seed: int, identity: Dict[str, Any], progress: Optional[Callable[[int, int], None]] = None,
            log: Optional[Callable[[str], None]] = None) -> Artifact:
    """Fit every selected layer of ``target``'s model, in order, and return the fitted
    :class:`~structinit.solver.artifact.Artifact` (its ``stats`` measure the fitted Q/K on the
    pseudo input; its ``fit`` holds ``identity``, ``source`` and the fit's report)."""
    c = plain.config
    start = time.perf_counter()
    q, k, offsets, report = fit_layers(settings, target, plain, inputs.x, seed, writer, progress, log)
    depth = target.depth
    src = [0 if plain.depth == 1 else i for i in range(depth)]
    layer_inputs = np.stack([plain.layer_input(s) for s in src])
    columns = np.stack([impulse_columns(c.grid, offsets[i], c.padding) for i in range(depth)])
    quality = measure(layer_inputs, q, k, columns, causal_mask(c.grid, c.causal))
    device = next(target.model.parameters()).device
    stats = {"layers": quality.to_stats(), "summary": quality.summary(), "seconds": time.perf_counter() - start,
             "device": str(device), "measured_on": "the pseudo input (the fitted Q/K)"}
    return Artifact(config=c, q=q, k=k, offsets=offsets, pseudo_input=plain.pseudo_input,
                    pseudo_input_rest=plain.pseudo_input_rest, stats=stats,
                    fit={"identity": identity, "source": inputs.source, "report": report})


__all__ = ["load_or_fit", "run_fit"]
