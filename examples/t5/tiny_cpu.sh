#!/bin/bash
# A tiny T5 on CPU processes (gloo), on a sentence-level corpus (`make prepare-ds-sample-bert`).
#   NPROC=2 RUN_DIR=runs/t5_tiny DATA_PATH=<prefix>_text_sentence ITERS=200 bash examples/t5/tiny_cpu.sh
#   DRY_RUN=1 DATA_PATH=x bash examples/t5/tiny_cpu.sh   # validate the flags, print the layout
# Extra flags are appended (e.g. --tensor-model-parallel-size 2 --sequence-parallel).
set -euo pipefail
cd "$(dirname "$0")/../.."

NPROC=${NPROC:-2}
RUN_DIR=${RUN_DIR:-runs/t5_tiny_cpu}
ITERS=${ITERS:-100}
ARGS=(
    --encoder-num-layers "${NUM_LAYERS:-2}" --decoder-num-layers "${NUM_LAYERS:-2}"
    --hidden-size "${HIDDEN:-128}" --num-attention-heads "${HEADS:-4}"
    --encoder-seq-length "${SEQ:-128}" --decoder-seq-length "${DEC_SEQ:-64}"
    --max-position-embeddings "${SEQ:-128}"
    --micro-batch-size "${MBS:-4}" --global-batch-size "${GBS:-16}" --train-iters "$ITERS"
    --lr 1e-3 --min-lr 1e-4 --lr-decay-style linear --lr-warmup-iters 10 --weight-decay 1e-2
    --clip-grad 1.0 --num-workers 0
    --data-path "${DATA_PATH:?set DATA_PATH to a sentence-level prefix (make prepare-ds-sample-bert)}"
    --split 98,2,0 --tokenizer-type BertWordPieceLowerCase --vocab-extra-ids 100
    --vocab-file "${VOCAB_FILE:-tests/data/bert-vocab.txt}"
    --log-interval 10 --eval-interval 50 --eval-iters 5
    --save "$RUN_DIR/checkpoints" --save-interval "$ITERS" --tensorboard-dir "$RUN_DIR/tensorboard"
)
if [[ "${DRY_RUN:-0}" == "1" ]]; then
    exec env WORLD_SIZE="$NPROC" RANK=0 "${PYTHON:-python}" -m megatron.training.dry_run \
        --dry-run-model t5 "${ARGS[@]}" "$@"
fi
exec torchrun --nproc-per-node "$NPROC" pretrain_t5.py "${ARGS[@]}" "$@"
