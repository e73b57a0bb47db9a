#!/bin/bash
# GPT-2 large (774M: 36 layers, hidden 1280, 20 heads, sequence 1024) in one parallel layout, for
# side-by-side ablations. LAYOUT picks the layout and the number of processes:
#   baseline  1 GPU
#   dp2       2 GPUs, data parallel
#   tp2       2 GPUs, tensor parallel
#   sp2       2 GPUs, tensor parallel + sequence parallel
#   cp2       2 GPUs, context parallel
#   pp2       2 GPUs, pipeline parallel (refused with "not supported yet" until PP lands)
# Every layout trains the same model on the same data with the same global batch, seed and no
# dropout, so their loss curves should lie on top of each other.
#
#   LAYOUT=tp2 bash examples/gpt2/train_gpt2_large.sh
#   LAYOUT=dp2 DATA_PATH=runs/data/corpus_text_document ITERS=500 bash examples/gpt2/train_gpt2_large.sh
#   DRY_RUN=1 LAYOUT=cp2 bash examples/gpt2/train_gpt2_large.sh
# Sizes (NUM_LAYERS HIDDEN HEADS SEQ MBS GBS ITERS LR), PRECISION (bf16|fp16|fp32) and paths are
# environment variables; `make ablate-cpu` runs the six layouts of a tiny version on CPU.
# The log goes to stdout and to LOG_FILE (default $RUN_ROOT/$LAYOUT.log; LOG_FILE= turns it off).
set -euo pipefail

LAYOUT=${LAYOUT:-baseline}
case "$LAYOUT" in
    baseline) NPROC=1; LAYOUT_ARGS=() ;;
    dp2) NPROC=2; LAYOUT_ARGS=() ;;
    # TP pads the vocab to a multiple of 128 x TP; 64 keeps the padded vocab (whose dummy rows
    # enter the softmax) the same as in the other layouts.
    tp2) NPROC=2; LAYOUT_ARGS=(--tensor-model-parallel-size 2 --make-vocab-size-divisible-by 64) ;;
    sp2) NPROC=2; LAYOUT_ARGS=(--tensor-model-parallel-size 2 --make-vocab-size-divisible-by 64
                               --sequence-parallel) ;;
    cp2) NPROC=2; LAYOUT_ARGS=(--context-parallel-size 2) ;;
    pp2) NPROC=2; LAYOUT_ARGS=(--pipeline-model-parallel-size 2) ;;
    *) echo "error: LAYOUT must be one of baseline dp2 tp2 sp2 cp2 pp2 (got '$LAYOUT')" >&2; exit 2 ;;
esac
GPUS_PER_NODE=${GPUS_PER_NODE:-$NPROC}
RUN_ROOT=${RUN_ROOT:-runs/gpt2large}
RUN_NAME=${RUN_NAME:-gpt2large-$LAYOUT}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-$RUN_ROOT/$LAYOUT/checkpoints}
TENSORBOARD_PATH=${TENSORBOARD_PATH:-$RUN_ROOT/$LAYOUT/tensorboard}
if [[ "${DRY_RUN:-0}" != "1" ]]; then
    LOG_FILE=${LOG_FILE-$RUN_ROOT/$LAYOUT.log}
fi
LOG_INTERVAL=${LOG_INTERVAL:-1}
EVAL_ITERS=${EVAL_ITERS:-0}
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"

NUM_LAYERS=${NUM_LAYERS:-36}
HIDDEN=${HIDDEN:-1280}
HEADS=${HEADS:-20}
SEQ=${SEQ:-1024}
MBS=${MBS:-4}
GBS=${GBS:-32}
ITERS=${ITERS:-200}
LR=${LR:-2.5e-4}
PRECISION=${PRECISION:-bf16}

MODEL_ARGS=(
    --num-layers "$NUM_LAYERS"
    --hidden-size "$HIDDEN"
    --num-attention-heads "$HEADS"
    --seq-length "$SEQ"
    --max-position-embeddings "$SEQ"
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --init-method-std 0.02
)
TRAINING_ARGS=(
    --micro-batch-size "$MBS"
    --global-batch-size "$GBS"
    --train-iters "$ITERS"
    --lr "$LR"
    --min-lr "$(awk "BEGIN {print $LR / 10}")"
    --lr-decay-style cosine
    --lr-warmup-iters "${LR_WARMUP_ITERS:-$((ITERS / 10))}"
    --weight-decay 0.1
    --adam-beta2 0.95
    --clip-grad 1.0
    --seed "${SEED:-1234}"
    --num-workers "${NUM_WORKERS:-2}"
)
case "$PRECISION" in
    bf16) TRAINING_ARGS+=(--bf16) ;;
    fp16) TRAINING_ARGS+=(--fp16) ;;
    fp32) ;;
    *) echo "error: PRECISION must be bf16, fp16 or fp32 (got '$PRECISION')" >&2; exit 2 ;;
esac
# Mock data by default; with DATA_PATH the GPT-2 BPE files that tokenized it (the defaults are
# the small BPE shipped in tests/data, used by `make prepare-ds-<name>`).
if [[ -n "${DATA_PATH:-}" ]]; then
    TOKENIZER_ARGS=(--tokenizer-type GPT2BPETokenizer
                    --vocab-file "${VOCAB_FILE:-$REPO_ROOT/tests/data/gpt2-vocab.json}"
                    --merge-file "${MERGE_FILE:-$REPO_ROOT/tests/data/gpt2-merges.txt}")
else
    TOKENIZER_ARGS=(--tokenizer-type NullTokenizer --vocab-size "${VOCAB_SIZE:-50256}")
fi
# Only the final checkpoint: ablations compare curves, not resumes.
OUTPUT_ARGS+=(--save-interval "$ITERS" --eval-interval "$ITERS")

launch "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${LAYOUT_ARGS[@]}" "${DATA_ARGS[@]}" \
    "${TOKENIZER_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@"
