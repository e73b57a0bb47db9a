#!/bin/bash
# A tiny BERT on CPU processes (gloo), on a sentence-level corpus (`make prepare-ds-sample-bert`).
#   NPROC=2 RUN_DIR=runs/bert_tiny DATA_PATH=<prefix>_text_sentence ITERS=200 bash examples/bert/tiny_cpu.sh
#   DRY_RUN=1 DATA_PATH=x bash examples/bert/tiny_cpu.sh   # validate the flags, print the layout
# Extra flags are appended (e.g. --tensor-model-parallel-size 2, --bert-no-binary-head).
set -euo pipefail
cd "$(dirname "$0")/../.."

NPROC=${NPROC:-2}
RUN_DIR=${RUN_DIR:-runs/bert_tiny_cpu}
ITERS=${ITERS:-100}
SEQ=${SEQ:-128}
ARGS=(
    --num-layers "${NUM_LAYERS:-4}" --hidden-size "${HIDDEN:-128}" --num-attention-heads "${HEADS:-4}"
    --seq-length "$SEQ" --max-position-embeddings "$SEQ"
    --micro-batch-size "${MBS:-4}" --global-batch-size "${GBS:-16}" --train-iters "$ITERS"
    --lr 1e-3 --min-lr 1e-4 --lr-decay-style linear --lr-warmup-iters 10 --weight-decay 1e-2
    --clip-grad 1.0 --num-workers 0
    --data-path "${DATA_PATH:?set DATA_PATH to a sentence-level prefix (make prepare-ds-sample-bert)}"
    --split 98,2,0 --tokenizer-type BertWordPieceLowerCase
    --vocab-file "${VOCAB_FILE:-tests/data/bert-vocab.txt}"
    --log-interval 10 --eval-interval 50 --eval-iters 5
    --save "$RUN_DIR/checkpoints" --save-interval "$ITERS" --tensorboard-dir "$RUN_DIR/tensorboard"
)
if [[ "${DRY_RUN:-0}" == "1" ]]; then
    exec env WORLD_SIZE="$NPROC" RANK=0 "${PYTHON:-python}" -m megatron.training.dry_run \
        --dry-run-model bert "${ARGS[@]}" "$@"
fi
exec torchrun --nproc-per-node "$NPROC" pretrain_bert.py "${ARGS[@]}" "$@"
