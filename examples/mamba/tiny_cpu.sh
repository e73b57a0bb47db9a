#!/bin/bash
# A tiny hybrid Mamba / attention model (Nemotron-H style layers) on CPU processes (gloo):
#   NPROC=2 RUN_DIR=runs/mamba_tiny DATA_PATH=<prefix> ITERS=200 bash examples/mamba/tiny_cpu.sh
#   MOCK=1 bash examples/mamba/tiny_cpu.sh            # generated data instead of a corpus
#   DRY_RUN=1 MOCK=1 bash examples/mamba/tiny_cpu.sh  # validate the flags, print the layout
# PATTERN is one symbol per layer: M mamba, * attention, - MLP (E MoE needs --num-experts).
set -euo pipefail
cd "$(dirname "$0")/../.."

NPROC=${NPROC:-2}
RUN_DIR=${RUN_DIR:-runs/mamba_tiny_cpu}
ITERS=${ITERS:-100}
PATTERN=${PATTERN:-M-M*-M-}
HIDDEN=${HIDDEN:-128}
SEQ=${SEQ:-128}
MBS=${MBS:-4}
GBS=${GBS:-16}
VOCAB_FILE=${VOCAB_FILE:-tests/data/gpt2-vocab.json}
MERGE_FILE=${MERGE_FILE:-tests/data/gpt2-merges.txt}

MODEL_ARGS=(
    --num-layers "${#PATTERN}"
    --hybrid-override-pattern="$PATTERN"
    --hidden-size "$HIDDEN"
    --ffn-hidden-size $((4 * HIDDEN))
    --num-attention-heads 4 --group-query-attention --num-query-groups 2
    --mamba-state-dim 16 --mamba-head-dim 32 --mamba-num-groups 2
    --normalization RMSNorm --squared-relu --disable-bias-linear
    --position-embedding-type none --untie-embeddings-and-output-weights
    --seq-length "$SEQ" --max-position-embeddings "$SEQ"
    --attention-dropout 0.0 --hidden-dropout 0.0
)
TRAINING_ARGS=(
    --micro-batch-size "$MBS" --global-batch-size "$GBS" --train-iters "$ITERS"
    --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 10
    --weight-decay 0.1 --clip-grad 1.0 --num-workers 0
)
if [[ "${MOCK:-0}" == "1" ]]; then
    DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 1024)
else
    DATA_ARGS=(
        --data-path "${DATA_PATH:?set DATA_PATH to a preprocessed prefix, or MOCK=1}"
        --split 98,1,1 --tokenizer-type GPT2BPETokenizer
        --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE"
    )
fi
OUTPUT_ARGS=(
    --log-interval 10 --eval-interval 50 --eval-iters 5
    --save "$RUN_DIR/checkpoints" --save-interval "$ITERS"
    --tensorboard-dir "$RUN_DIR/tensorboard"
)
if [[ "${DRY_RUN:-0}" == "1" ]]; then
    exec env WORLD_SIZE="$NPROC" RANK=0 "${PYTHON:-python}" -m megatron.training.dry_run \
        --dry-run-model mamba \
        "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@"
fi
exec torchrun --nproc-per-node "$NPROC" pretrain_mamba.py \
    "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@"
