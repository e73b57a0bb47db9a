#!/bin/bash
# Mixtral 8x7B (Megatron-LM's examples/mixtral flags): 32 layers, 8 experts top-2, GQA, RoPE,
# SwiGLU, RMSNorm; TP=1, PP=4, EP=8 with sequence parallelism, on GPU nodes.
#   DATA_PATH=<prefix> TOKENIZER_MODEL=<tokenizer.model> CHECKPOINT_PATH=<dir> \
#       bash examples/mixtral/train_mixtral_8x7b_distributed.sh
#   DRY_RUN=1 bash examples/mixtral/train_mixtral_8x7b_distributed.sh   # validate, print the layout
# Multi-node: NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT (torchrun's).
set -euo pipefail
cd "$(dirname "$0")/../.."

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-4}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-runs/mixtral_8x7b/checkpoints}
TOKENIZER_MODEL=${TOKENIZER_MODEL:-tokenizer.model}
DATA_PATH=${DATA_PATH:-}

MODEL_ARGS=(
    --disable-bias-linear
    --seq-length 4096
    --max-position-embeddings 32768
    --num-layers 32
    --hidden-size 4096
    --ffn-hidden-size 14336
    --num-attention-heads 32
    --init-method-std 0.01
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --normalization RMSNorm
    --position-embedding-type rope
    --swiglu
    --untie-embeddings-and-output-weights
    --group-query-attention
    --num-query-groups 8
    --rotary-base 1000000
)
MOE_ARGS=(
    --num-experts 8
    --moe-router-topk 2
    --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-2
    --moe-grouped-gemm
    --moe-token-dispatcher-type alltoall
    --overlap-grad-reduce
    --use-distributed-optimizer
    --overlap-param-gather
)
if [[ -n "$DATA_PATH" ]]; then
    DATA_ARGS=(
        --tokenizer-type Llama2Tokenizer
        --tokenizer-model "$TOKENIZER_MODEL"
        --data-path "$DATA_PATH"
        --split 99990,8,2
    )
else
    DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 32000)
fi
TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 256
    --lr 1e-4
    --train-iters 500000
    --lr-decay-iters 320000
    --lr-decay-style cosine
    --min-lr 1.0e-5
    --weight-decay 0.1
    --lr-warmup-iters 500
    --clip-grad 1.0
    --bf16
)
MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 4
    --expert-model-parallel-size 8
    --sequence-parallel
)
LOGGING_ARGS=(
    --log-interval 1
    --save-interval 10000
    --eval-interval 1000
    --eval-iters 10
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --tensorboard-dir "$CHECKPOINT_PATH/tensorboard"
    --no-load-optim
    --no-load-rng
)
ALL_ARGS=(
    "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAINING_ARGS[@]}"
    "${MODEL_PARALLEL_ARGS[@]}" "${LOGGING_ARGS[@]}"
)
if [[ "${DRY_RUN:-0}" == "1" ]]; then
    exec env WORLD_SIZE=$((GPUS_PER_NODE * NNODES)) RANK=0 "${PYTHON:-python}" \
        -m megatron.training.dry_run "${ALL_ARGS[@]}" "$@"
fi
exec torchrun --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK" \
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" pretrain_gpt.py "${ALL_ARGS[@]}" "$@"
