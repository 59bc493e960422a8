#!/usr/bin/env bash
# Launch `structinit train` with torchrun on one node or across a cluster (SLURM or by hand).
#
#   cli/torchrun.sh --model vit-t --dataset cifar10 --data-dir /data --init impulse --out runs/c10
#
# Processes per node: $NPROC, else the visible GPUs (nvidia-smi), else 1 (CPU, gloo).
# Nodes: $NNODES, else $SLURM_JOB_NUM_NODES, else 1. Under SLURM the first node of the job is the
# rendezvous host; otherwise set $MASTER_ADDR (default localhost) and $MASTER_PORT (default 29500).
# Run it once per node (e.g. `srun --ntasks-per-node=1 cli/torchrun.sh ...`). Extra torchrun
# options go in $TORCHRUN_ARGS. Every argument is passed to `structinit train` unchanged; a killed
# job restarted with the same arguments plus --resume continues from its last checkpoint.
set -euo pipefail

if [[ -z "${NPROC:-}" ]]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        NPROC=$(nvidia-smi -L | grep -c '^GPU' || true)
    fi
    if [[ -z "${NPROC:-}" || "$NPROC" -lt 1 ]]; then
        NPROC=${CUDA_VISIBLE_DEVICES:+$(awk -F, '{print NF}' <<<"$CUDA_VISIBLE_DEVICES")}
        NPROC=${NPROC:-1}
    fi
fi
NNODES=${NNODES:-${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}}
if [[ -z "${MASTER_ADDR:-}" && -n "${SLURM_JOB_NODELIST:-}" ]] && command -v scontrol >/dev/null 2>&1; then
    MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
fi
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-29500}
RDZV_ID=${RDZV_ID:-${SLURM_JOB_ID:-structinit}}
PYTHON=${PYTHON:-python}

# One CPU thread per process unless told otherwise (torchrun's own default, made explicit).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

# shellcheck disable=SC2086
exec "$PYTHON" -m torch.distributed.run \
    --nnodes="$NNODES" --nproc_per_node="$NPROC" \
    --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$RDZV_ID" \
    ${TORCHRUN_ARGS:-} \
    -m structinit train "$@"
