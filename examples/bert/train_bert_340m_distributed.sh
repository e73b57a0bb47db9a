#!/bin/bash
# BERT-large (340M) as Megatron's examples/bert/train_bert_340m_distributed.sh trains it: 24 layers,
# hidden 1024, 16 heads, sequence 512, masked LM + sentence order, fp16, linear decay.
#
#   DATA_PATH=data/my-bert_text_sentence VOCAB_FILE=bert-large-uncased-vocab.txt \
#       bash examples/bert/train_bert_340m_distributed.sh
#   DRY_RUN=1 bash examples/bert/train_bert_340m_distributed.sh   # validate flags, print the layout
# DATA_PATH is a sentence-level prefix (tools/preprocess_data.py --split-sentences); BERT has no
# mock data. VOCAB_FILE defaults to the small WordPiece vocabulary shipped in tests/data. Every
# size below is an environment variable; see also examples/common.sh. Extra flags are appended.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
PRETRAIN_SCRIPT=pretrain_bert.py
DRY_RUN_MODEL=bert

TP=${TP:-1}
PP=${PP:-1}
SP=${SP:-0}                      # 1: --sequence-parallel (needs TP > 1)
MBS=${MBS:-4}
GBS=${GBS:-32}
SEQ_LENGTH=${SEQ_LENGTH:-512}
NUM_LAYERS=${NUM_LAYERS:-24}
HIDDEN_SIZE=${HIDDEN_SIZE:-1024}
NUM_HEADS=${NUM_HEADS:-16}
VOCAB_FILE=${VOCAB_FILE:-$REPO_ROOT/tests/data/bert-vocab.txt}

MODEL_ARGS=(
    --num-layers "$NUM_LAYERS"
    --hidden-size "$HIDDEN_SIZE"
    --num-attention-heads "$NUM_HEADS"
    --seq-length "$SEQ_LENGTH"
    --max-position-embeddings "$SEQ_LENGTH"
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
    --lr-decay-iters "${LR_DECAY_ITERS:-990000}"
    --lr-warmup-fraction .01
    --weight-decay 1e-2
    --clip-grad 1.0
    --fp16
)
MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP"
    --pipeline-model-parallel-size "$PP"
)
[[ "$SP" == "1" ]] && MODEL_PARALLEL_ARGS+=(--sequence-parallel)
TOKENIZER_ARGS=(--tokenizer-type BertWordPieceLowerCase --vocab-file "$VOCAB_FILE")

launch "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" "${TOKENIZER_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@"
