#!/bin/bash
# Llama-3 70B (Meta 2024): 80 layers, hidden 8192, 64 heads in 8 query groups (GQA),
# SwiGLU FFN 28672, RMSNorm, RoPE base 500000, 8192 tokens, vocab 128256.
# Pretraining from scratch in Megatron's Llama style: pre-norm RMSNorm, rotary positions, SwiGLU,
# no linear biases, untied input/output embeddings; Adam (0.9, 0.95, 1e-5), weight decay 0.1,
# clipping 1.0, cosine decay to 10%, 2000 warmup steps, 2M tokens per step (256 x 8192); bf16.
# Default layout: 8 nodes x 8 GPUs, TP 8 x PP 4 x DP 2. Pipeline parallelism is still being
# built: until it lands the run (and DRY_RUN=1) stops with "not supported yet:
# --pipeline-model-parallel-size"; PP=1 with more TP/fewer layers validates today.
#
#   bash examples/llama/train_llama3_70b.sh                         # mock data, token ids only
#   TOKENIZER_MODEL=/models/llama3_70b DATA_PATH=data/corpus_text_document bash examples/llama/train_llama3_70b.sh
#   DRY_RUN=1 bash examples/llama/train_llama3_70b.sh                # validate flags, print the layout
# TOKENIZER_MODEL (a local Hugging Face tokenizer directory) selects --tokenizer-type
# HuggingFaceTokenizer; without it NullTokenizer with the model's vocab size is used.
# Every size and path is an environment variable (see also examples/common.sh); extra flags are
# appended to the command line.
set -euo pipefail

NNODES=${NNODES:-8}
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"

TP=${TP:-8}
PP=${PP:-4}
CP=${CP:-1}
SP=${SP:-1}                       # 1: --sequence-parallel (only used when TP > 1)
MBS=${MBS:-1}
GBS=${GBS:-256}
SEQ_LENGTH=${SEQ_LENGTH:-8192}
NUM_LAYERS=${NUM_LAYERS:-80}
HIDDEN_SIZE=${HIDDEN_SIZE:-8192}
FFN_HIDDEN_SIZE=${FFN_HIDDEN_SIZE:-28672}
NUM_HEADS=${NUM_HEADS:-64}
NUM_QUERY_GROUPS=${NUM_QUERY_GROUPS:-8}
ROTARY_BASE=${ROTARY_BASE:-500000}
VOCAB_SIZE=${VOCAB_SIZE:-128256}
TRAIN_ITERS=${TRAIN_ITERS:-500000}
LR=${LR:-1.5e-4}
MIN_LR=${MIN_LR:-$(awk "BEGIN {print $LR / 10}")}

MODEL_ARGS=(
    --num-layers "$NUM_LAYERS"
    --hidden-size "$HIDDEN_SIZE"
    --ffn-hidden-size "$FFN_HIDDEN_SIZE"
    --num-attention-heads "$NUM_HEADS"
    --group-query-attention
    --num-query-groups "$NUM_QUERY_GROUPS"
    --seq-length "$SEQ_LENGTH"
    --max-position-embeddings "$SEQ_LENGTH"
    --position-embedding-type rope
    --rotary-base "$ROTARY_BASE"
    --normalization RMSNorm
    --norm-epsilon 1e-5
    --swiglu
    --untie-embeddings-and-output-weights
    --disable-bias-linear
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --init-method-std 0.02
    --make-vocab-size-divisible-by "${MAKE_VOCAB_SIZE_DIVISIBLE_BY:-128}"
)
TRAINING_ARGS=(
    --micro-batch-size "$MBS"
    --global-batch-size "$GBS"
    --train-iters "$TRAIN_ITERS"
    --lr "$LR"
    --min-lr "$MIN_LR"
    --lr-decay-style cosine
    --lr-warmup-iters "${LR_WARMUP_ITERS:-2000}"
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --adam-eps 1e-5
    --clip-grad 1.0
    --bf16
)
MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP"
    --pipeline-model-parallel-size "$PP"
    --context-parallel-size "$CP"
)
[[ "$SP" == "1" && "$TP" -gt 1 ]] && MODEL_PARALLEL_ARGS+=(--sequence-parallel)
if [[ -n "${TOKENIZER_MODEL:-}" ]]; then
    TOKENIZER_ARGS=(--tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL")
else
    # NullTokenizer adds its end-of-document id on top of --vocab-size.
    TOKENIZER_ARGS=(--tokenizer-type NullTokenizer --vocab-size "$((VOCAB_SIZE - 1))")
fi

launch "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" "${TOKENIZER_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@"
