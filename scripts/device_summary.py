"""Gather what scripts/device-check.sh measured into OUT/device-check.json and OUT/summary.md.

Each step of the check left ``OUT/NAME.out`` (its stdout: JSON for the benchmarks) and
``OUT/NAME.log`` (its stderr); ``OUT/status.txt`` has one ``NAME EXIT SECONDS`` line a step. The
JSON's headline fields are the figures of issue 40 (``device``, ``date``, ``fit_vit_t_seconds``,
``fit_vit_t_training_steps``, ``train_vs_bare_loop``, ``train_vs_timm_loop``, ...), each ``null``
where its step failed; ``floors`` says which floor each meets (``null``: not judged here, e.g. the
2 s floor is an H100's and is not judged on the CPU); ``raw`` keeps every step's whole output.

Usage: python3 scripts/device_summary.py OUT DEVICE QUICK
"""

from __future__ import annotations

import datetime
import json
import platform
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Dict, List, Optional

FIT_VIT_T_FLOOR_SECONDS = 2.0  # on an H100
LOOP_FLOOR = 0.95  # train's loop / a bare loop, images/s


def read_json(out: Path, name: str) -> Optional[Dict[str, Any]]:
    """The JSON a step printed (``OUT/NAME.out``), or ``None`` where it printed none."""
    path = out / f"{name}.out"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def gpu_tests(out: Path) -> Optional[Dict[str, int]]:
    """Counts of the GPU tests' JUnit report (``None`` where they did not run)."""
    try:
        root = ET.parse(out / "gpu-tests.xml").getroot()
    except (OSError, ET.ParseError):
        return None
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return None
    return {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}


def device_name(device: str, docs: List[Optional[Dict[str, Any]]]) -> str:
    """What ran the check: on the CPU, ``cpu (no GPU): <processor>``; else the card torch named in
    the benchmarks' output, or what nvidia-smi names where none ran."""
    if device == "cpu":
        model = platform.processor() or platform.machine()
        try:
            model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                         if line.startswith("model name"))
        except (OSError, StopIteration):
            pass
        return f"cpu (no GPU): {model}"
    for d in docs:
        where = (d or {}).get("shape", d or {}).get("device")
        if where and where != "cpu":
            return str(where)
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        smi = ""
    return smi or f"{device} (no benchmark ran; nvidia-smi named no card)"


def fit_fields(prefix: str, d: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """The headline figures of one ``bench fit --json``: the init with data (``_seconds``, its plain
    solve cached), the fit alone, without data, and the plain solve uncached and cached, each in
    seconds and in training steps of the same model."""
    keys = ["seconds", "fit_only_seconds", "training_steps", "data_free_seconds", "data_free_training_steps",
            "solve_uncached_seconds", "solve_uncached_training_steps", "solve_cached_seconds",
            "solve_cached_training_steps", "train_step_seconds", "hit_rate"]
    if not d:
        return {f"{prefix}_{k}": None for k in keys}
    row, solve = d["rows"][0], d["solve"]
    free = (d.get("data_free_rows") or [{}])[0]
    values = [row["seconds"], row["fit_seconds"], row["train_steps"], free.get("seconds"), free.get("train_steps"),
              solve["seconds"], solve["train_steps"], solve["cached_seconds"], solve["cached_train_steps"],
              d["train_step_seconds"], row.get("hit_rate")]
    return {f"{prefix}_{k}": v for k, v in zip(keys, values)}


def summarize(out: Path, device: str, quick: bool) -> Dict[str, Any]:
    steps = []
    for line in filter(str.strip, (out / "status.txt").read_text().splitlines()):
        name, rc, seconds = line.split()
        steps.append({"step": name, "exit": int(rc), "seconds": int(seconds)})
    raw = {s["step"]: read_json(out, s["step"]) for s in steps if s["step"] not in ("gpu-tests", "fashion-grids")}
    fit_t, fit_s, loop = raw.get("fit-vit-t"), raw.get("fit-vit-s"), raw.get("loop")
    doc: Dict[str, Any] = {
        "device": device_name(device, [fit_t, fit_s, loop]),
        "date": datetime.date.today().isoformat(),
        "quick": quick,
        "train_batch": (fit_t or {}).get("train_batch"), "amp": (fit_t or {}).get("amp"),
        **fit_fields("fit_vit_t", fit_t),
        **fit_fields("fit_vit_s", fit_s),
        "train_vs_bare_loop": (loop or {}).get("ratio_median"),
        "train_vs_timm_loop": (loop or {}).get("timm_ratio_median"),
        "loop_images_per_second": {k: (loop or {}).get(f"{k}_median") for k in ("bare", "train_epoch", "timm_bare")},
        "gpu_tests": gpu_tests(out),
        "steps": steps,
    }
    on_gpu = device != "cpu" and not quick
    t = doc["fit_vit_t_seconds"]
    doc["floors"] = {
        "fit_vit_t_under_2_s": (t < FIT_VIT_T_FLOOR_SECONDS) if on_gpu and t is not None else None,
        "train_vs_bare_loop_at_least_0.95": _at_least(doc["train_vs_bare_loop"], on_gpu),
        "train_vs_timm_loop_at_least_0.95": _at_least(doc["train_vs_timm_loop"], on_gpu),
    }
    doc["profile"] = (fit_t or {}).get("profile")
    doc["raw"] = raw
    return doc


def _at_least(ratio: Optional[float], judged: bool) -> Optional[bool]:
    return ratio >= LOOP_FLOOR if judged and ratio is not None else None


def _num(v: Any, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def markdown(doc: Dict[str, Any]) -> str:
    """summary.md: the steps, then the figures and the floors."""
    lines = [f"# structinit device check, {doc['date']}", "", f"Device: {doc['device']}"
             + (" (QUICK=1: tiny shapes, a smoke test; no figure here is a measurement)" if doc["quick"] else ""),
             "", "| step | exit | seconds |", "|---|---|---|"]
    lines += [f"| {s['step']} | {s['exit']} | {s['seconds']} |" for s in doc["steps"]]
    if doc["gpu_tests"]:
        lines += ["", "GPU tests: " + ", ".join(f"{k} {v}" for k, v in doc["gpu_tests"].items())]
    batch = f"batch {doc['train_batch']}, amp {doc['amp']}"
    lines += ["", f"| shape | what | seconds | training steps ({batch}) |", "|---|---|---|---|"]
    for prefix, step, name in (("fit_vit_t", "fit-vit-t", "ViT-T"), ("fit_vit_s", "fit-vit-s", "ViT-S/16 at 224")):
        s = (doc["raw"].get(step) or {}).get("shape")
        shape = f"{name} ({s['preset']}, grid {'x'.join(map(str, s['grid']))}, dim {s['dim']})" if s else name
        for what, key in (("init with data (plain solve cached)", ""), ("init without data", "_data_free"),
                          ("plain solve, uncached", "_solve_uncached"), ("plain init, cached", "_solve_cached")):
            secs = doc[f"{prefix}{key}_seconds"]
            steps = doc[f"{prefix}{key}_training_steps"]
            lines.append(f"| {shape} | {what} | {_num(secs, '.3f')} | {_num(steps, '.1f')} |")
    ips = doc["loop_images_per_second"]
    lines += ["", f"Training loop, images/s (median): bare {_num(ips['bare'], '.0f')}, train's "
                  f"{_num(ips['train_epoch'], '.0f')}, timm's model in the bare loop {_num(ips['timm_bare'], '.0f')}; "
                  f"train / bare {_num(doc['train_vs_bare_loop'], '.3f')}, train / timm "
                  f"{_num(doc['train_vs_timm_loop'], '.3f')}"]
    lines += ["", "Floors (null: not judged on this device or in QUICK mode):"]
    lines += [f"- {k}: {json.dumps(v)}" for k, v in doc["floors"].items()]
    prof = doc.get("profile")
    if prof and "skipped" not in prof:
        lines += ["", f"Profile of the ViT-T fit ({prof['dir']}): {prof['kernel_launches']} kernel launches, "
                      f"{prof['host_syncs']} host syncs, {prof['item_calls']} item reads, "
                      f"{prof['matmuls']['calls']} matrix products, device busy {prof['device_busy_seconds']:.2f} s "
                      f"of {prof['seconds']:.2f} s"]
    return "\n".join(lines) + "\n"


def main() -> None:
    out, device, quick = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
    doc = summarize(out, device, quick)
    (out / "device-check.json").write_text(json.dumps(doc, indent=2) + "\n")
    text = markdown(doc)
    (out / "summary.md").write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
