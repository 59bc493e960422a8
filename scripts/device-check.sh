#!/usr/bin/env bash
# The GPU checks of structinit in one run of at most 8 minutes on one GPU: the GPU tests, the solver
# benchmark, the default init's data fit at the ViT-T and ViT-S shapes, and the training loop's
# images/s against a bare loop of the same recipe (bf16 autocast). Writes every result as JSON and one
# summary (summary.json, summary.md) into OUT (default: $OUT, else ./device-check).
#
#   scripts/device-check.sh                  # on a machine with a GPU (python3 must have torch, timm,
#                                            # typer, rich, safetensors, filelock, matplotlib, pytest)
#   DEVICE=cpu QUICK=1 scripts/device-check.sh   # the same steps, tiny, on the CPU (a smoke test)
#   FASHION_DIR=/data/fashion-mnist scripts/device-check.sh   # the Fashion-MNIST files for the loop check
#   CHECKS=0 GRID_SECONDS=480 scripts/device-check.sh   # only the Fashion-MNIST grids, most important runs
#                                            # first, for 480 s (scripts/device_grid.py; OUT/grid.tar.gz)
#   GRID_ARGS="--done docs/results/fashion/gpu/fashion-196/runs.csv --done docs/results/fashion/gpu/fashion/runs.csv"
#                                            # ... going on where the last lent GPU stopped
#                                            # (GRID_SECONDS counts the impulse solves too: set
#                                            # STRUCTINIT_CACHE to a folder of solved artifacts to skip them)
#
# Runs from the repository root without installing: PYTHONPATH points at it. Each step has its own
# time limit and the script goes on when one fails; the summary says which failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-${1:-device-check}}"
mkdir -p "$OUT"
DEVICE="${DEVICE:-cuda}"
QUICK="${QUICK:-0}"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 STRUCTINIT_CACHE="${STRUCTINIT_CACHE:-$OUT/cache}"
SI=("$PY" -m structinit)
status=()

step() {  # step NAME SECONDS COMMAND...: run it with a time limit, its output in OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    status+=("$name $rc $((SECONDS - start))")
    echo "$name: exit $rc in $((SECONDS - start)) s" >&2
}

if [ "$QUICK" = 1 ]; then
    fit_model=vit-digits; fit_args=(--dataset digits --samples 32 --steps 20 --train-steps 2)
    vits_args=(--model vit-digits --dataset digits --samples 16 --steps 10 --train-steps 1)
    loop_args=(--model vit-digits --dataset digits --epochs 1 --repeats 1)
    solver_args=(--grid 8x8 --dim 64 --heads 4 --recipes fast,paper --iters 50)
else
    fit_model=vit-t; fit_args=(--image-size 32 --in-chans 3 --train-steps 10)
    vits_args=(--model vit-s --image-size 32 --in-chans 3 --train-steps 10)
    loop_args=(--model vit-fashion-196 --dataset fashion-mnist --batch-size 256 --epochs 1 --repeats 3)
    solver_args=(--grid 16x16 --dim 192 --heads 3)
fi
if [ -n "${FASHION_DIR:-}" ]; then
    loop_args+=(--data-dir "$FASHION_DIR")
fi

CHECKS="${CHECKS:-1}"
if [ "$CHECKS" = 1 ] && [ "$DEVICE" != cpu ]; then
    step gpu-tests 240 env STRUCTINIT_TEST_GPU=1 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests \
        --junitxml="$OUT/gpu-tests.xml"
fi
if [ "$CHECKS" = 1 ]; then
    step solver 120 "${SI[@]}" bench solver "${solver_args[@]}" --device "$DEVICE" --threads 4 --json
    cp "$OUT/solver.log" "$OUT/solver.json" 2>/dev/null
    step fit-vit-t 120 "${SI[@]}" bench fit --model "$fit_model" "${fit_args[@]}" --versions 2 --device "$DEVICE" --json
    step fit-vit-s 120 "${SI[@]}" bench fit "${vits_args[@]}" --versions 2 --device "$DEVICE" --json
    step loop 120 "${SI[@]}" bench loop "${loop_args[@]}" --device "$DEVICE" --json
fi
if [ -n "${GRID_SECONDS:-}" ]; then
    # the runs are small, so workers (one per CPU core, less two) share the GPU; its use every 5 s in gpu.csv
    nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv -l 5 >"$OUT/gpu.csv" 2>/dev/null &
    smi=$!
    quick=(); [ "$QUICK" = 1 ] && quick=(--quick)
    step fashion-grids $((GRID_SECONDS + 120)) "$PY" scripts/device_grid.py --out "$OUT" --device "$DEVICE" \
        --seconds "$GRID_SECONDS" --jobs "${JOBS:-$(( $(nproc) > 3 ? $(nproc) - 2 : 1 ))}" "${quick[@]}" \
        ${FASHION_DIR:+--data-dir "$FASHION_DIR"} ${GRID_ARGS:-}
    kill "$smi" 2>/dev/null
fi

printf '%s\n' "${status[@]}" >"$OUT/status.txt"
"$PY" - "$OUT" <<'PYEOF'
import datetime, json, pathlib, subprocess, sys
out = pathlib.Path(sys.argv[1])
steps = []
for line in (out / "status.txt").read_text().splitlines():
    name, rc, seconds = line.split()
    steps.append({"step": name, "exit": int(rc), "seconds": int(seconds)})
def doc(name):
    text = (out / f"{name}.log").read_text() if (out / f"{name}.log").exists() else ""
    start = text.find("{")
    try:
        return json.loads(text[start:]) if start >= 0 else None
    except ValueError:
        return None
try:
    card = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                          capture_output=True, text=True, timeout=20).stdout.strip()
except (OSError, subprocess.TimeoutExpired):
    card = "no GPU (nvidia-smi not found)"
summary = {"date": datetime.date.today().isoformat(), "card": card, "steps": steps,
           "solver": doc("solver"), "fit_vit_t": doc("fit-vit-t"), "fit_vit_s": doc("fit-vit-s"), "loop": doc("loop")}
(out / "summary.json").write_text(json.dumps(summary, indent=2))
lines = [f"# structinit device check, {summary['date']}", "", f"Card: {card}", "",
         "| step | exit | seconds |", "|---|---|---|"]
lines += [f"| {s['step']} | {s['exit']} | {s['seconds']} |" for s in steps]
for key, title in (("fit_vit_t", "Data fit, ViT-T shape"), ("fit_vit_s", "Data fit, ViT-S shape")):
    d = summary[key]
    if d:
        for r in d["rows"]:
            lines += ["", f"{title}: {d['shape']['preset']}, version {r['version']}: init {r['seconds']:.2f} s "
                          f"(fit {r['fit_seconds']:.2f} s) = {r['train_steps']:.1f} training steps of batch 64 "
                          f"({d['train_step_seconds'] * 1000:.1f} ms each) on {d['shape']['device']}"]
if summary["loop"]:
    l = summary["loop"]
    lines += ["", f"Training loop ({l['preset']}, {l['dataset']}, batch {l['batch_size']}, amp {l['amp']}): bare "
                  f"{l['bare_median']:.0f} images/s, train's loop {l['train_epoch_median']:.0f} images/s, ratio "
                  f"{l['ratio_median']:.3f}"]
if summary["solver"]:
    lines += ["", "Solver (seconds, hit rate, target mass): " + "; ".join(
        f"{r['recipe']} {r['seconds']:.3f} s, {r['hit_rate']:.3f}, {r['target_mass']:.3f}" for r in summary["solver"]["rows"])]
(out / "summary.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PYEOF
