#!/bin/bash
# GPT-3 Small (125M): hyper-parameters of the GPT-3 paper (Brown et al. 2020, table 2.1): sequence 2048,
# 300B training tokens, linear warmup over 375M tokens, cosine decay to 10% over 260B tokens,
# Adam (0.9, 0.95, 1e-8), weight decay 0.1, gradient clipping 1.0; bf16.
#
#   bash examples/gpt3/train_gpt3_125m.sh                    # mock data, 1 node(s) x 8 GPUs
#   DATA_PATH=data/my-corpus_text_document VOCAB_FILE=gpt2-vocab.json MERGE_FILE=gpt2-merges.txt \
#       NNODES=4 NODE_RANK=0 MASTER_ADDR=node0 bash examples/gpt3/train_gpt3_125m.sh
#   DRY_RUN=1 bash examples/gpt3/train_gpt3_125m.sh           # validate flags, print the layout
# Every size and path below is an environment variable; see also examples/common.sh. Extra
# flags are appended: bash examples/gpt3/train_gpt3_125m.sh --train-samples 1000000
set -euo pipefail

NNODES=${NNODES:-1}
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"

TP=${TP:-1}
PP=${PP:-1}
CP=${CP:-1}
SP=${SP:-0}                      # 1: --sequence-parallel (needs TP > 1)
MBS=${MBS:-4}
GBS=${GBS:-256}                   # 256 x 2048 tokens per step
SEQ_LENGTH=${SEQ_LENGTH:-2048}
NUM_LAYERS=${NUM_LAYERS:-12}
HIDDEN_SIZE=${HIDDEN_SIZE:-768}
NUM_HEADS=${NUM_HEADS:-12}
LR=${LR:-6.0e-4}
MIN_LR=${MIN_LR:-6.0e-5}
TRAIN_SAMPLES=${TRAIN_SAMPLES:-146484375}      # 300B tokens / 2048
LR_DECAY_SAMPLES=${LR_DECAY_SAMPLES:-126953125} # 260B tokens / 2048
LR_WARMUP_SAMPLES=${LR_WARMUP_SAMPLES:-183105}  # 375M tokens / 2048

MODEL_ARGS=(
    --num-layers "$NUM_LAYERS"
    --hidden-size "$HIDDEN_SIZE"
    --num-attention-heads "$NUM_HEADS"
    --seq-length "$SEQ_LENGTH"
    --max-position-embeddings "$SEQ_LENGTH"
    --position-embedding-type learned_absolute
    --normalization LayerNorm
    --attention-dropout 0.1
    --hidden-dropout 0.1
    --init-method-std "${INIT_STD:-0.02}"
)
TRAINING_ARGS=(
    --micro-batch-size "$MBS"
    --global-batch-size "$GBS"
    --train-samples "$TRAIN_SAMPLES"
    --lr "$LR"
    --min-lr "$MIN_LR"
    --lr-decay-style cosine
    --lr-decay-samples "$LR_DECAY_SAMPLES"
    --lr-warmup-samples "$LR_WARMUP_SAMPLES"
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --adam-eps 1e-8
    --clip-grad 1.0
    --bf16
)
MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP"
    --pipeline-model-parallel-size "$PP"
    --context-parallel-size "$CP"
)
[[ "$SP" == "1" ]] && MODEL_PARALLEL_ARGS+=(--sequence-parallel)
# The GPT-2 BPE when its files are given; otherwise ids without a tokenizer (mock data), with
# the GPT-2 vocab size (NullTokenizer adds the end-of-document id on top of --vocab-size).
if [[ -n "${VOCAB_FILE:-}" ]]; then
    TOKENIZER_ARGS=(--tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB_FILE"
                    --merge-file "${MERGE_FILE:?set MERGE_FILE with VOCAB_FILE}")
else
    TOKENIZER_ARGS=(--tokenizer-type NullTokenizer --vocab-size "${VOCAB_SIZE:-50256}")
fi

launch "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" "${TOKENIZER_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@"
