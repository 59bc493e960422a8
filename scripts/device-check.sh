#!/usr/bin/env bash
# The GPU checks of structinit (issue 40) in one run of about 8 minutes on one GPU. It measures
#   - the GPU tests (pytest -m gpu) and the solver benchmark at the ViT-T shape;
#   - the default impulse init at the ViT-T shape (12 layers, 16x16 = 256 tokens, dim 192, 3 heads;
#     noise images 3x32x32) and at ViT-S/16 on 224x224 (196 tokens, dim 384, 6 heads): the plain solve
#     uncached and cached, the data fit with data and without (--data-free), in seconds and in training
#     steps of the same model at batch 128 in bf16; the ViT-T fit once more under torch.profiler
#     (OUT/profile-vit-t: ops table and trace);
#   - train's loop against a bare PyTorch loop of the same model, data, optimizer, precision and batch
#     (ViT-T at 32x32, batch 128, bf16; images/s, median of 3), and against the same bare loop of
#     timm's vit_tiny_patch16_224 built at 32x32;
# and writes OUT/device-check.json (device, date, fit_vit_t_seconds, fit_vit_t_training_steps,
# train_vs_bare_loop, train_vs_timm_loop, ..., the floors, every step's raw output) and OUT/summary.md
# (scripts/device_summary.py). OUT: the first argument, else $OUT, else ./device-check.
#
#   scripts/device-check.sh OUT              # on a machine with a GPU (python3 must have torch, timm,
#                                            # typer, rich, safetensors, filelock, matplotlib, pytest)
#   DEVICE=cpu QUICK=1 scripts/device-check.sh OUT   # the same steps, tiny, on the CPU (a smoke test)
#   PYTHON=.venv/bin/python ...              # another interpreter than python3
#   FASHION_DIR=/data/fashion-mnist ...      # also the loop on Fashion-MNIST at 196 tokens (loop-fashion)
#   CHECKS=0 GRID_SECONDS=480 scripts/device-check.sh   # only the Fashion-MNIST grids, most important runs
#                                            # first, for 480 s (scripts/device_grid.py; OUT/grid.tar.gz)
#   CHECKS=0 GRIDS=converged KEEP_CHECKPOINTS=1 GRID_SECONDS=480 scripts/device-check.sh
#                                            # the converged-budget grid instead (30 epochs a run;
#                                            # docs/results/fashion/gpu/converged/grid.toml), its
#                                            # checkpoints packed so that the next machine resumes them
#   GRID_ARGS="--done docs/results/fashion/gpu/fashion-196/runs.csv --done docs/results/fashion/gpu/fashion/runs.csv"
#                                            # ... going on where the last lent GPU stopped
#                                            # (GRID_SECONDS counts the impulse solves too: set
#                                            # STRUCTINIT_CACHE to a folder of solved artifacts to skip them)
#
# Runs from the repository root without installing: PYTHONPATH points at it. Each step has its own
# time limit (together 480 s on a GPU) and the script goes on when one fails; the summary says which
# failed. The figures are measurements: nothing here asserts them.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-${OUT:-device-check}}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
DEVICE="${DEVICE:-cuda}"
QUICK="${QUICK:-0}"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 STRUCTINIT_CACHE="${STRUCTINIT_CACHE:-$OUT/cache}"
SI=("$PY" -m structinit)
status=()

step() {  # step NAME SECONDS COMMAND...: run it with a time limit; stdout in OUT/NAME.out, stderr in OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.out" 2>"$OUT/$name.log"
    local rc=$?
    status+=("$name $rc $((SECONDS - start))")
    echo "$name: exit $rc in $((SECONDS - start)) s" >&2
}

# the shapes: ViT-T and ViT-S/16 at 224 on the GPU; on QUICK=1 the smallest preset, every option kept
shared=(--train-batch 128 --amp bf16 --data-free --versions 2 --device "$DEVICE" --json)
if [ "$QUICK" = 1 ]; then
    shared=(--train-batch 32 --amp bf16 --data-free --versions 2 --device "$DEVICE" --json)
    fit_t=(--model vit-digits --image-size 8 --in-chans 3 --samples 16 --steps 10 --train-steps 1
           --profile "$OUT/profile-vit-t" --profile-steps 3)
    fit_s=(--model vit-digits --image-size 16 --in-chans 3 --patch 4 --samples 16 --steps 10 --train-steps 1)
    loop=(--model vit-digits --dataset noise --image-size 8 --in-chans 3 --images 128 --batch-size 64 --epochs 1
          --repeats 1)
    loop_fashion=(--model vit-digits --dataset fashion-mnist --epochs 1 --repeats 1)
    solver=(--grid 8x8 --dim 64 --heads 4 --recipes fast,paper --iters 50)
else
    fit_t=(--model vit-t --image-size 32 --in-chans 3 --train-steps 10 --profile "$OUT/profile-vit-t")
    fit_s=(--model vit-s --image-size 224 --patch 16 --in-chans 3 --train-steps 10)
    loop=(--model vit-t --dataset noise --image-size 32 --in-chans 3 --images 12800 --batch-size 128 --epochs 1
          --repeats 3)
    loop_fashion=(--model vit-fashion-196 --dataset fashion-mnist --batch-size 256 --epochs 1 --repeats 3)
    solver=(--grid 16x16 --dim 192 --heads 3)
fi

CHECKS="${CHECKS:-1}"
if [ "$CHECKS" = 1 ] && [ "$DEVICE" != cpu ]; then
    step gpu-tests 120 env STRUCTINIT_TEST_GPU=1 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests \
        --junitxml="$OUT/gpu-tests.xml"
fi
if [ "$CHECKS" = 1 ]; then
    step solver 45 "${SI[@]}" bench solver "${solver[@]}" --device "$DEVICE" --threads 4 --json
    step fit-vit-t 90 "${SI[@]}" bench fit "${fit_t[@]}" "${shared[@]}"
    step fit-vit-s 120 "${SI[@]}" bench fit "${fit_s[@]}" "${shared[@]}"
    step loop 105 "${SI[@]}" bench loop "${loop[@]}" --amp bf16 --timm-model vit_tiny_patch16_224 \
        --device "$DEVICE" --json
    if [ -n "${FASHION_DIR:-}" ]; then
        step loop-fashion 90 "${SI[@]}" bench loop "${loop_fashion[@]}" --data-dir "$FASHION_DIR" \
            --device "$DEVICE" --json
    fi
fi
if [ -n "${GRID_SECONDS:-}" ]; then
    # the runs are small, so workers (one per CPU core, less two) share the GPU; its use every 5 s in gpu.csv
    nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv -l 5 >"$OUT/gpu.csv" 2>/dev/null &
    smi=$!
    grid_flags=()
    [ "$QUICK" = 1 ] && grid_flags+=(--quick)
    [ "${KEEP_CHECKPOINTS:-0}" = 1 ] && grid_flags+=(--keep-checkpoints)
    step fashion-grids $((GRID_SECONDS + 120)) "$PY" scripts/device_grid.py --out "$OUT" --device "$DEVICE" \
        --seconds "$GRID_SECONDS" --jobs "${JOBS:-$(( $(nproc) > 3 ? $(nproc) - 2 : 1 ))}" \
        --grids "${GRIDS:-fashion}" "${grid_flags[@]}" ${FASHION_DIR:+--data-dir "$FASHION_DIR"} ${GRID_ARGS:-}
    kill "$smi" 2>/dev/null
fi

printf '%s\n' "${status[@]}" >"$OUT/status.txt"
"$PY" scripts/device_summary.py "$OUT" "$DEVICE" "$QUICK"
