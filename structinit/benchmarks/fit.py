"""The default init's cost: :func:`run_fit_bench` times the impulse init on one model preset, in
seconds and in training steps of the same model (batch 64 in full precision unless
``train_batch``/``amp`` say otherwise), the unit the init's cost is judged in: a fit worth 100
training steps costs what 100 steps of the run cost. It times

- the plain solve with nothing cached (forced past the user cache and the artifacts the package
  ships), then the plain init again from the cache (what every later run of the shape pays);
- the data fit (each version asked for) with inputs given as ``data``: the dataset's first training
  images when one is named (normalized as ``train`` does), else Gaussian noise images of the
  preset's input shape (the fit's cost does not depend on what the images show; its hit rate does,
  so it is reported only for real inputs);
- with ``data_free``, the same fit without ``data``: ``initialize_model(model, "impulse")``, which
  fits on noise inputs of the model's input shape that the library draws itself;
- with ``profile_dir``, one more fit under :mod:`torch.profiler` (see :func:`profile_summary`).

Example::

    result = run_fit_bench("vit-digits", dataset="digits", versions=(1, 2))
    print(fit_bench_table(result))
    run_fit_bench("vit-t", train_batch=128, amp="bf16", data_free=True, device="cuda", profile_dir="prof")
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from structinit.benchmarks.loop import NOISE_IMAGE_SIZE, NOISE_IN_CHANS
from structinit.errors import StructinitError, StructinitWarning, UsageError, param
from structinit.fit.settings import FIT_DEFAULTS
from structinit.init.report import InitReport
from structinit.runtime import device_name, synchronize

#: CUDA runtime calls counted as kernel launches and as host waits by :func:`profile_summary`.
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
#: The matrix products among torch's ops (the leaves ``matmul``/``linear`` call, so none counts twice).
MATMUL_OPS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm")


def _model_and_inputs(preset: str, dataset: Optional[str], image_size: int, in_chans: int, samples: int,
                      seed: int, patch: Optional[int] = None):
    """The preset's model (seeded) and ``samples`` inputs: the dataset's first training images as
    ``train`` normalizes them, or Gaussian noise images ``[samples, in_chans, image_size, image_size]``
    (``patch``: the model's patch size, over the preset's own; else the dataset's default, 2 on noise)."""
    import torch

    from structinit.training.augment import normalize
    from structinit.training.datasets import dataset_info, load_dataset
    from structinit.training.models import ModelConfig, build_model

    if dataset is not None:
        info = dataset_info(dataset)
        if not info.in_memory or info.is_sequence:
            raise UsageError(f"{param('dataset')} {dataset}: the fit benchmark takes an in-memory image dataset")
        data = load_dataset(dataset)
        x = normalize(data.train.images[:samples], info.mean, info.std)
        image_size, in_chans, classes, default_patch = info.image_size, info.in_chans, info.num_classes, \
            info.default_patch
    else:
        x = torch.randn(samples, in_chans, image_size, image_size, generator=torch.Generator().manual_seed(seed))
        classes, default_patch = 10, 2
    # a given patch is the model's (over the preset's own); else the dataset's default, 2 on noise
    model = build_model(ModelConfig(preset, patch=patch), num_classes=classes, image_size=image_size,
                        in_chans=in_chans, default_patch=default_patch, seed=seed)
    return model, x


def train_step_seconds(model, x, steps: int, batch: int = 64, dtype=None) -> float:
    """Seconds per AdamW step (forward, backward, update) of ``model`` on batches of ``batch`` of
    ``x`` (on the model's device), the median over ``steps`` steps after two warm-up steps;
    ``dtype`` (``torch.bfloat16``, ``torch.float16``): the forward pass under autocast to it, as
    ``train``'s mixed precision runs it (``None``: full precision)."""
    import torch

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    xb = x[:batch] if x.shape[0] >= batch else x.repeat((batch + x.shape[0] - 1) // x.shape[0], 1, 1, 1)[:batch]
    y = torch.zeros(xb.shape[0], dtype=torch.long, device=xb.device)
    kind = xb.device.type
    times = []
    model.train()
    for i in range(steps + 2):
        t0 = time.perf_counter()
        with torch.autocast(kind, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = torch.nn.functional.cross_entropy(model(xb).float(), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        synchronize(xb.device)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _timed(fn: Callable[[], Any], dev: str):
    """``(result, seconds)`` of ``fn()``, the device's queue drained before and after."""
    synchronize(dev)
    t0 = time.perf_counter()
    out = fn()
    synchronize(dev)
    return out, time.perf_counter() - t0


def _fit_row(rep: InitReport, version: int, steps: int, seconds: float, step: float,
             real_inputs: bool) -> Dict[str, Any]:
    fit = rep.fit
    if fit is None or not rep.fit_ran:
        raise StructinitError(f"the {rep.method} init ran no data fit to time")
    row = {"version": version, "steps": steps, "seconds": seconds, "fit_seconds": fit.seconds,
           "train_steps": seconds / step, "step_images": fit.extra.get("step_images"), "samples": fit.samples,
           "inputs": fit.inputs, "cached": bool((fit.artifact or {}).get("cached"))}
    if real_inputs:
        hits = [r["hit_rate"] for r in fit.layers or []]
        row.update(hit_rate=sum(hits) / len(hits), min_layer_hit_rate=min(hits))
    return row


def _plain_solve(model, seed: int, cache: str) -> Dict[str, Any]:
    """Solve the default impulse spec's plain artifact for ``model`` into ``cache``, forced (nothing
    read from any cache, the package's shipped artifacts included), timed; on the CPU, as
    ``initialize_model`` and ``train`` solve."""
    from structinit.init.attention_target import AttentionTarget
    from structinit.init.registry import init_spec
    from structinit.solver.cache import shipped_cache_dir
    from structinit.solver.run import solve, solved_layers

    t = AttentionTarget(model, need_grid=True)
    (config,) = init_spec("impulse").presolves(lambda: (t.grid, t.dim, t.heads, t.depth), seed)
    t0 = time.perf_counter()
    result = solve(config, cache_dir=cache, device="cpu", force=True)
    seconds = time.perf_counter() - t0
    shipped = shipped_cache_dir()
    name = Path(result.artifact.path).name if result.artifact.path else ""
    return {"seconds": seconds, "device": "cpu", "layers_solved": len(solved_layers(config)),
            "artifact": name, "shipped": bool(shipped and name and (shipped / name).is_file()),
            "path": result.artifact.path}


def _profiled_fit(model, x, *, version: int, steps: int, samples: int, seed: int, plain_path, dev: str,
                  out_dir: Path) -> Dict[str, Any]:
    """Fit ``model`` (version ``version``, ``steps`` Adam steps) once more under :mod:`torch.profiler`,
    from a scratch cache holding only the plain artifact ``plain_path`` (so the fit runs, not a cached
    copy), and write the profile into ``out_dir``; returns :func:`profile_summary` of it."""
    import tempfile
    import warnings

    from torch.profiler import ProfilerActivity, profile

    from structinit.atomic import atomic_path, copy_file, write_text
    from structinit.init.initialize import initialize_model

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.startswith("cuda") else [])
    with tempfile.TemporaryDirectory() as scratch:
        copy_file(plain_path, Path(scratch) / Path(plain_path).name)
        with warnings.catch_warnings(), profile(activities=activities, record_shapes=True) as prof:
            warnings.simplefilter("ignore", StructinitWarning)  # a short fit is weak on purpose: its cost counts
            _, seconds = _timed(lambda: initialize_model(model, "impulse", seed=seed, data=x,
                                                         data_fit_version=version, cache_dir=scratch,
                                                         data_fit_samples=samples, data_fit=steps), dev)
    summary = profile_summary(prof.key_averages(), seconds)
    by = "self_device_time_total" if dev.startswith("cuda") else "self_cpu_time_total"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        write_text(out_dir / "fit-ops.txt",
            f"impulse data fit, version {version}, {steps} steps, under torch.profiler: {seconds:.3f} s\n\n"
            f"by op, sorted by {by}:\n{prof.key_averages().table(sort_by=by, row_limit=40)}\n\n"
            f"by op and input shapes (the matrix products' sizes), sorted by {by}:\n"
            f"{prof.key_averages(group_by_input_shape=True).table(sort_by=by, row_limit=40)}\n")
        with atomic_path(out_dir / "fit-trace.json.gz") as trace:
            prof.export_chrome_trace(str(trace))
    except OSError as exc:
        raise StructinitError(f"cannot write the profile into {param('profile_dir')} {out_dir}: "
                              f"{exc.strerror or exc}") from None
    summary.update(dir=str(out_dir), files=["fit-ops.txt", "fit-trace.json.gz"], version=version, steps=steps,
                   by=by,
                   trace_bytes=(out_dir / "fit-trace.json.gz").stat().st_size)
    return summary


def profile_summary(averages, seconds: float) -> Dict[str, Any]:
    """What a profile of the fit says about where its ``seconds`` went, from torch.profiler's
    ``key_averages()``: ``kernel_launches`` (CUDA launch calls), ``host_syncs`` (the host waiting
    for the device: stream, device and event synchronizations), ``item_calls`` (``.item()``-style
    reads of one value, each a wait on a GPU), ``matmuls`` (calls, device and CPU seconds and the
    mean device microseconds per call: many calls of a few microseconds are small matrix products
    bound by launches), ``device_busy_seconds`` (kernels' total time; against ``seconds`` it says how
    much of the time the device worked) and ``top`` (the ten ops with the most self time)."""
    def dev_us(e, total: bool = False) -> float:
        name = "device_time_total" if total else "self_device_time_total"
        return float(getattr(e, name, 0.0) or 0.0)

    count = {e.key: e for e in averages}
    launches = sum(count[k].count for k in LAUNCH_CALLS if k in count)
    syncs = {k: count[k].count for k in SYNC_CALLS if k in count}
    mm = [count[k] for k in MATMUL_OPS if k in count]
    mm_calls = sum(e.count for e in mm)
    mm_dev = sum(dev_us(e, total=True) for e in mm) / 1e6
    busy = sum(dev_us(e) for e in averages) / 1e6
    top = sorted(averages, key=lambda e: dev_us(e) or e.self_cpu_time_total, reverse=True)[:10]
    return {"seconds": seconds, "kernel_launches": launches, "host_syncs": sum(syncs.values()), "syncs": syncs,
            "item_calls": count["aten::_local_scalar_dense"].count if "aten::_local_scalar_dense" in count else 0,
            "matmuls": {"calls": mm_calls, "device_seconds": mm_dev,
                        "cpu_seconds": sum(e.cpu_time_total for e in mm) / 1e6,
                        "mean_device_us": mm_dev * 1e6 / mm_calls if mm_calls and mm_dev else None},
            "device_busy_seconds": busy,
            "top": [{"op": e.key, "calls": e.count, "self_device_seconds": dev_us(e) / 1e6,
                     "self_cpu_seconds": e.self_cpu_time_total / 1e6} for e in top]}


def _check_fit_bench(dataset: Optional[str], patch: Optional[int], versions: Sequence[int], *, amp: str,
                     profile_dir, profile_over: float, **counts: int) -> None:
    """Refuse :func:`run_fit_bench`'s bad settings (a :class:`UsageError` naming the parameter) before
    anything is built; ``counts``: the settings that must be at least 1."""
    from structinit.fit.settings import FIT_VERSIONS
    from structinit.training.config import AMP_MODES

    bad = [v for v in versions if v not in FIT_VERSIONS]
    if bad or not versions:
        raise UsageError(f"{param('versions')} must be among {', '.join(map(str, FIT_VERSIONS))}, got "
                         f"{', '.join(map(str, versions)) or '(none)'}")
    repeated = sorted({v for v in versions if list(versions).count(v) > 1})
    if repeated:  # each version is one row: a repeat would time the same fit twice, as a second row
        raise UsageError(f"{param('versions')} names version {', '.join(map(str, repeated))} more than once; each "
                         "version is timed once")
    for name, value in counts.items():
        if value < 1:
            raise UsageError(f"{param(name)} must be at least 1, got {value}")
    if amp not in AMP_MODES:
        raise UsageError(f"unknown {param('amp')} {amp!r}; choose one of {', '.join(AMP_MODES)}")
    if patch is not None and patch < 1:
        raise UsageError(f"{param('patch')} must be at least 1, got {patch}")
    if patch is not None and dataset is not None:
        raise UsageError(f"{param('patch')} sets the patch on noise images; {param('dataset')} {dataset} has its own")
    if profile_over < 0:
        raise UsageError(f"{param('profile_over')} must be at least 0 seconds, got {profile_over}")
    if profile_dir is not None and Path(profile_dir).exists() and not Path(profile_dir).is_dir():
        raise UsageError(f"{param('profile_dir')} {profile_dir} is not a folder")


def _time_solve_and_step(model, x, seed: int, cache, dev: str, train_steps: int, train_batch: int, dtype,
                         say: Callable[[str], None]):
    """``(solve, step)``: the plain solve timed uncached and cached (``solve``, its ``path`` included)
    and one training step's seconds (``step``) of ``model`` on ``x``."""
    from structinit.init.initialize import initialize_model

    say("solving the plain artifact (nothing cached)")
    solve = _plain_solve(model, seed, cache)
    say("the plain init from the cache")
    _, cached_seconds = _timed(lambda: initialize_model(model, "impulse", seed=seed, data_fit=0,
                                                        cache_dir=cache), dev)
    say(f"timing {train_steps} training steps at batch {train_batch}")
    step = train_step_seconds(model, x, train_steps, train_batch, dtype)
    solve.update(cached_seconds=cached_seconds, train_steps=solve["seconds"] / step,
                 cached_train_steps=cached_seconds / step)
    return solve, step


def _shape_row(preset: str, arch: Dict[str, Any], inputs: str, dev: str) -> Dict[str, Any]:
    """The benchmark's ``shape``: the model's preset and attention shape, its inputs, the torch threads
    and the device's name."""
    import torch

    return {"preset": preset, "grid": arch["grid"], "dim": arch["dim"], "heads": arch["heads"],
            "depth": arch["depth"], "inputs": inputs, "threads": torch.get_num_threads(),
            "device": device_name(dev)}


def run_fit_bench(preset: str = "vit-digits", *, dataset: Optional[str] = None,
                  image_size: int = NOISE_IMAGE_SIZE, in_chans: int = NOISE_IN_CHANS, patch: Optional[int] = None,
                  versions: Sequence[int] = (2,), samples: int = FIT_DEFAULTS.samples, train_steps: int = 10,
                  train_batch: int = 64, amp: str = "off", steps: int = FIT_DEFAULTS.steps, seed: int = 0,
                  cache_dir=None, device: str = "cpu", data_free: bool = False,
                  profile_dir=None, profile_over: float = 0.0, profile_steps: int = 30,
                  progress: Optional[Callable[[str], None]] = None,
                  init_params: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Time the default impulse init on ``preset`` (see the module docstring), each fit on a fresh
    model, and ``train_steps`` training steps of the model at batch ``train_batch`` with ``amp``
    (``train``'s mixed precision: ``off``, the default, ``bf16``, ``fp16`` or ``auto``: bf16 on a
    GPU). ``patch``: the model's patch on noise images, over the preset's own (default: the preset's,
    else 2; ViT-S/16 at 224: ``image_size=224, patch=16``). ``steps``: the fit's Adam steps (300, the
    default; fewer to time a slow version's steps and scale). ``device``: where the model, the
    inputs and so the fit are (the plain solve runs on the CPU, as ``initialize_model`` and ``train``
    run it).

    Returns ``{"shape", "train_step_seconds", "train_batch", "amp", "solve", "rows"}``, with
    ``data_free_rows`` when ``data_free`` and ``profile`` when ``profile_dir``. ``solve``: ``seconds``
    (the plain solve, nothing cached) and ``cached_seconds`` (the plain init from the cache), each also
    in ``train_steps``/``cached_train_steps``; ``shipped``: whether the package ships that artifact (a
    first init then reads it instead of solving). Each row: ``version``, ``seconds`` (the whole init,
    its plain solve cached), ``fit_seconds`` (the fit itself), ``train_steps`` (``seconds`` in
    training steps), ``inputs`` (``data`` or ``noise``), ``cached`` (always false: each fit runs),
    ``hit_rate``/``min_layer_hit_rate`` on the batch (real inputs only), ``step_images``.

    ``profile_dir``: when the first version's init (with data) took over ``profile_over`` seconds,
    that fit runs again for ``profile_steps`` Adam steps under torch.profiler (``fit-ops.txt``, the
    ops' table, and ``fit-trace.json.gz``, a Chrome trace); ``profile`` is :func:`profile_summary`
    of it, or says why it was skipped. ``init_params``: more of the impulse init's parameters for
    every timed init (``{"position_subspace": True}``: the subspace's fit), named in the result."""
    import tempfile

    from structinit.runtime import resolve_device
    from structinit.training.loop import amp_dtype, amp_name

    _check_fit_bench(dataset, patch, versions, samples=samples, train_steps=train_steps,
                     train_batch=train_batch, steps=steps, profile_steps=profile_steps, amp=amp,
                     profile_dir=profile_dir, profile_over=profile_over)
    dev = resolve_device(device)
    dtype = amp_dtype(amp, dev)
    say = progress or (lambda message: None)
    model, x = _model_and_inputs(preset, dataset, image_size, in_chans, samples, seed, patch)
    arch = model.structinit_arch
    model, x = model.to(dev), x.to(dev)
    fits = _TimedFits(preset, dataset, image_size, in_chans, patch, samples, seed, steps, dict(init_params or {}), dev)

    out: Dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as scratch:
        fits.cache = cache_dir or scratch
        solve, fits.step = _time_solve_and_step(model, x, seed, fits.cache, dev, train_steps, train_batch, dtype, say)
        plain_path = solve.pop("path")
        rows: List[Dict[str, Any]] = []
        for v in versions:
            say(f"data fit version {v}")
            rows.append(fits.fit(v, x))
        out["rows"] = rows
        if data_free:
            say("the same fits without data (on noise of the model's input shape)")
            out["data_free_rows"] = [fits.fit(v, None) for v in versions]
        if profile_dir is not None:
            out["profile"] = _maybe_profile(rows[0], profile_over, lambda first: _profiled_fit(
                fits.fresh(), x, version=first["version"], steps=profile_steps, samples=samples, seed=seed,
                plain_path=plain_path, dev=dev, out_dir=Path(profile_dir)), say)
    inputs = dataset or f"noise [{samples}, {in_chans}, {image_size}, {image_size}]"
    return {"shape": _shape_row(preset, arch, inputs, dev), "train_step_seconds": fits.step, "train_batch": train_batch,
            "amp": amp_name(dtype), "solve": solve, "init_params": dict(init_params or {}), **out}


@dataclass
class _TimedFits:
    """The fits :func:`run_fit_bench` times, each on a fresh model of ``preset`` (as
    :func:`_model_and_inputs` builds it, on ``dev``): the default impulse init with ``steps`` Adam
    steps on ``samples`` inputs and ``init_params``, its plain solve read from ``cache``; ``step``
    (the seconds of one training step) is the unit of each row."""

    preset: str
    dataset: Optional[str]
    image_size: int
    in_chans: int
    patch: Optional[int]
    samples: int
    seed: int
    steps: int
    init_params: Dict[str, Any]
    dev: str
    cache: Any = None
    step: float = 0.0

    def fresh(self):
        """A fresh model of the preset, on the device."""
        return _model_and_inputs(self.preset, self.dataset, self.image_size, self.in_chans, 1, self.seed,
                                 self.patch)[0].to(self.dev)

    def fit(self, version: int, data) -> Dict[str, Any]:
        """The row of one timed init with data fit ``version`` on ``data`` (``None``: the fit runs on
        noise of the model's input shape and logs one line saying so)."""
        from structinit.init.initialize import initialize_model

        m = self.fresh()
        rep, total = _timed(lambda: initialize_model(
            m, "impulse", seed=self.seed, data=data, data_fit_version=version, cache_dir=self.cache,
            data_fit_samples=self.samples, data_fit=self.steps, log=lambda line: None, **self.init_params), self.dev)
        return _fit_row(rep, version, self.steps, total, self.step, data is not None and self.dataset is not None)


def _maybe_profile(first: Dict[str, Any], over: float, profile: Callable[[Dict[str, Any]], Dict[str, Any]],
                   say: Callable[[str], None]) -> Dict[str, Any]:
    """The profile of the first timed fit (``profile(first row)``) when its init took over ``over``
    seconds, else why it was skipped."""
    if first["seconds"] <= over:
        return {"skipped": f"the init took {first['seconds']:.2f} s, not over {over:g} s"}
    say(f"profiling data fit version {first['version']}")
    return profile(first)


def fit_bench_table(result: Dict[str, Any]) -> str:
    """Plain-text table of :func:`run_fit_bench`'s result."""
    s = result["shape"]
    batch, amp = result.get("train_batch", 64), result.get("amp", "off")
    given = "".join(f", {k}={v}" for k, v in (result.get("init_params") or {}).items())
    lines = [f"{s['preset']}: grid {'x'.join(map(str, s['grid']))}, dim {s['dim']}, {s['heads']} heads, depth "
             f"{s['depth']}; inputs {s['inputs']}; {s['threads']} thread(s); {s['device']}"
             + (f"; impulse{given}" if given else ""),
             f"one training step at batch {batch}" + (f", {amp} autocast" if amp != "off" else "") +
             f": {result['train_step_seconds']:.3f} s"]
    solve = result.get("solve")
    if solve:
        lines.append(f"plain solve ({solve['device']}, {solve['layers_solved']} layer(s), nothing cached): "
                     f"{solve['seconds']:.2f} s = {solve['train_steps']:.1f} steps; the plain init from the cache: "
                     f"{solve['cached_seconds']:.3f} s = {solve['cached_train_steps']:.2f} steps"
                     + (" (the package ships this artifact)" if solve.get("shipped") else ""))
    lines.append(f"{'version':>7} {'data':>9} {'steps':>5} {'init s':>8} {'fit s':>8} {'= steps':>8} "
                 f"{'imgs/step':>9} {'hit':>6} {'min hit':>8}")
    for given, r in [("given", r) for r in result["rows"]] + [("none", r) for r in result.get("data_free_rows", [])]:
        hit = f"{r['hit_rate']:>6.3f} {r['min_layer_hit_rate']:>8.3f}" if "hit_rate" in r else f"{'-':>6} {'-':>8}"
        lines.append(f"{r['version']:>7} {given:>9} {r['steps']:>5} {r['seconds']:>8.2f} {r['fit_seconds']:>8.2f} "
                     f"{r['train_steps']:>8.1f} {str(r['step_images'] or 'all'):>9} {hit}")
    prof = result.get("profile")
    if prof and "skipped" in prof:
        lines.append(f"profile: skipped ({prof['skipped']})")
    elif prof:
        mm = prof["matmuls"]
        mean = f", {mm['mean_device_us']:.1f} us each on the device" if mm["mean_device_us"] is not None else ""
        lines.append(f"profile ({prof['dir']}): a fit of {prof['steps']} steps, {prof['seconds']:.2f} s under the "
                     f"profiler; {prof['kernel_launches']} kernel "
                     f"launches, {prof['host_syncs']} host syncs, {prof['item_calls']} item reads, "
                     f"{mm['calls']} matrix products{mean}; device busy {prof['device_busy_seconds']:.2f} s")
    return "\n".join(lines)


__all__ = ["run_fit_bench", "fit_bench_table", "train_step_seconds", "profile_summary"]
