#!/bin/bash
# T5-base (220M) as Megatron's examples/t5/train_t5_220m_distributed.sh trains it: 12 + 12 layers,
# hidden 768, 12 heads of 64, FFN 3072, encoder 512 / decoder 128 tokens, 100 sentinels, bf16.
#
#   DATA_PATH=data/my-t5_text_sentence VOCAB_FILE=bert-large-cased-vocab.txt \
#       bash examples/t5/train_t5_220m_distributed.sh
#   DRY_RUN=1 bash examples/t5/train_t5_220m_distributed.sh   # validate flags, print the layout
# DATA_PATH is a sentence-level prefix (tools/preprocess_data.py --split-sentences); T5 has no
# mock data and no pipeline parallelism. VOCAB_FILE defaults to the small WordPiece vocabulary
# shipped in tests/data. See also examples/common.sh. Extra flags are appended.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
PRETRAIN_SCRIPT=pretrain_t5.py
DRY_RUN_MODEL=t5

TP=${TP:-1}
SP=${SP:-0}                      # 1: --sequence-parallel (needs TP > 1)
MBS=${MBS:-64}
GBS=${GBS:-512}
VOCAB_FILE=${VOCAB_FILE:-$REPO_ROOT/tests/data/bert-vocab.txt}

MODEL_ARGS=(
    --encoder-num-layers 12
    --decoder-num-layers 12
    --hidden-size 768
    --num-attention-heads 12
    --kv-channels 64
    --ffn-hidden-size 3072
    --encoder-seq-length 512
    --decoder-seq-length 128
    --max-position-embeddings 512
    --attention-dropout 0.1
    --hidden-dropout 0.1
)
TRAINING_ARGS=(
    --micro-batch-size "$MBS"
    --global-batch-size "$GBS"
    --train-iters "${TRAIN_ITERS:-1000000}"
    --lr 0.0001
    --min-lr 0.00001
    --lr-decay-style linear
    --lr-decay-iters "${LR_DECAY_ITERS:-1000000}"
    --lr-warmup-fraction .01
    --weight-decay 1e-2
    --clip-grad 1.0
    --bf16
)
MODEL_PARALLEL_ARGS=(--tensor-model-parallel-size "$TP")
[[ "$SP" == "1" ]] && MODEL_PARALLEL_ARGS+=(--sequence-parallel)
TOKENIZER_ARGS=(--tokenizer-type BertWordPieceCase --vocab-file "$VOCAB_FILE" --vocab-extra-ids 100)

launch "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" "${TOKENIZER_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@"
