#!/bin/bash
# Shared by the launch scripts under examples/: the torchrun command, the DRY_RUN=1 switch,
# the data flags and the output flags. Source it after setting the script's own defaults.
#
# Environment (all optional):
#   GPUS_PER_NODE=8 NNODES=1 NODE_RANK=0 MASTER_ADDR=localhost MASTER_PORT=6000
#   DATA_PATH=<prefix> [SPLIT=949,50,1]   preprocessed .bin/.idx prefix (mock data when unset)
#   CHECKPOINT_PATH TENSORBOARD_PATH       default runs/<RUN_NAME>/{checkpoints,tensorboard}
#   SAVE_INTERVAL LOG_INTERVAL EVAL_INTERVAL EVAL_ITERS
#   LOG_FILE=<file>                        also write stdout/stderr there (tee)
#   DRY_RUN=1                              validate the flags for WORLD_SIZE=GPUS_PER_NODE*NNODES
#                                          and print the layout instead of training
#   PYTHON=python                          interpreter for the dry run
#   PRETRAIN_SCRIPT=pretrain_gpt.py        entry point (pretrain_bert.py, pretrain_t5.py)
#   DRY_RUN_MODEL=gpt                      model family of the dry run (bert, t5)
# Extra flags given to a script ("$@") are appended to its flags; the last occurrence wins.

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
WORLD_SIZE=$((GPUS_PER_NODE * NNODES))
RUN_NAME=${RUN_NAME:-$(basename "$0" .sh)}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-runs/$RUN_NAME/checkpoints}
TENSORBOARD_PATH=${TENSORBOARD_PATH:-runs/$RUN_NAME/tensorboard}

DISTRIBUTED_ARGS=(
    --nproc-per-node "$GPUS_PER_NODE"
    --nnodes "$NNODES"
    --node-rank "$NODE_RANK"
    --master-addr "$MASTER_ADDR"
    --master-port "$MASTER_PORT"
)

# --data-path when DATA_PATH is set, otherwise generated (mock) data.
if [[ -n "${DATA_PATH:-}" ]]; then
    DATA_ARGS=(--data-path $DATA_PATH --split "${SPLIT:-949,50,1}")  # unquoted: "w1 p1 w2 p2" blends
else
    DATA_ARGS=(--mock-data)
fi

OUTPUT_ARGS=(
    --log-interval "${LOG_INTERVAL:-100}"
    --save-interval "${SAVE_INTERVAL:-1000}"
    --eval-interval "${EVAL_INTERVAL:-1000}"
    --eval-iters "${EVAL_ITERS:-10}"
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --tensorboard-dir "$TENSORBOARD_PATH"
)

# launch <pretrain_gpt.py flags...>: torchrun, or the dry run with DRY_RUN=1.
launch() {
    local cmd
    if [[ "${DRY_RUN:-0}" == "1" ]]; then
        cmd=(env "PYTHONPATH=$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}" "WORLD_SIZE=$WORLD_SIZE" RANK=0
             "${PYTHON:-python}" -m megatron.training.dry_run)
        if [[ "${DRY_RUN_MODEL:-gpt}" != "gpt" ]]; then
            cmd+=(--dry-run-model "$DRY_RUN_MODEL")
        fi
        cmd+=("$@")
    else
        # Keeps the kernel order of tensor/sequence-parallel communication (as Megatron's scripts).
        export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
        cmd=(torchrun "${DISTRIBUTED_ARGS[@]}" "$REPO_ROOT/${PRETRAIN_SCRIPT:-pretrain_gpt.py}" "$@")
    fi
    if [[ -n "${LOG_FILE:-}" ]]; then
        mkdir -p "$(dirname "$LOG_FILE")"
        "${cmd[@]}" 2>&1 | tee "$LOG_FILE"
        return "${PIPESTATUS[0]}"
    fi
    "${cmd[@]}"
}
