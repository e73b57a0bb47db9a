#!/bin/bash
# Nemotron-H 8B (nvidia/Nemotron-H-8B-Base-8K): 52 layers (24 Mamba-2, 4 attention, 24 MLP),
# hidden 4096, 32 query heads in 8 groups of 128, squared-ReLU MLP of 21504, Mamba-2 with 128
# heads of 64, state 128, 8 groups; RMSNorm, no position embeddings, untied output layer,
# vocabulary 131072, sequence 8192: 8,100,852,736 parameters. The pattern and sizes are those of
# Megatron-Bridge's NemotronHModel8BProvider; the count is transformers' NemotronHForCausalLM
# built from them. The training hyperparameters (learning rate, batch, init) are not published
# with the model: ours.
#
#   DATA_PATH=data/my-corpus_text_document TOKENIZER_MODEL=<hf tokenizer> \
#       bash examples/mamba/train_nemotron_h_8b.sh
#   DRY_RUN=1 bash examples/mamba/train_nemotron_h_8b.sh   # validate flags, print the layout
# TP (default 2) with SP; the Mamba heads and groups split over TP. See examples/common.sh.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
PRETRAIN_SCRIPT=pretrain_mamba.py
DRY_RUN_MODEL=mamba

TP=${TP:-2}
PP=${PP:-1}
MBS=${MBS:-1}
GBS=${GBS:-768}
SEQ_LENGTH=${SEQ_LENGTH:-8192}
PATTERN="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"

MODEL_ARGS=(
    --num-layers 52
    --hybrid-override-pattern="$PATTERN"
    --hidden-size 4096
    --ffn-hidden-size 21504
    --num-attention-heads 32
    --group-query-attention
    --num-query-groups 8
    --kv-channels 128
    --mamba-num-heads 128
    --mamba-head-dim 64
    --mamba-state-dim 128
    --mamba-num-groups 8
    --squared-relu
    --normalization RMSNorm
    --disable-bias-linear
    --position-embedding-type none
    --untie-embeddings-and-output-weights
    --seq-length "$SEQ_LENGTH"
    --max-position-embeddings "$SEQ_LENGTH"
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --init-method-std 0.014
)
TRAINING_ARGS=(
    --micro-batch-size "$MBS"
    --global-batch-size "$GBS"
    --train-iters "${TRAIN_ITERS:-500000}"
    --lr 8e-4
    --min-lr 8e-6
    --lr-decay-style cosine
    --lr-warmup-iters "${LR_WARMUP_ITERS:-2000}"
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --clip-grad 1.0
    --bf16
)
MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP"
    --pipeline-model-parallel-size "$PP"
)
[[ "$TP" -gt 1 ]] && MODEL_PARALLEL_ARGS+=(--sequence-parallel)
if [[ -n "${TOKENIZER_MODEL:-}" ]]; then
    TOKENIZER_ARGS=(--tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL")
else
    # The NullTokenizer adds its end-of-document token: 131071 + 1 = the published 131072.
    TOKENIZER_ARGS=(--tokenizer-type NullTokenizer --vocab-size 131071)
fi

launch "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" "${TOKENIZER_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@"
