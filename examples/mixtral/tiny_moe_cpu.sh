#!/bin/bash
# A tiny mixture-of-experts GPT (4 experts, top-2, shared expert) on CPU processes (gloo).
#   LAYOUT=ep2 bash examples/mixtral/tiny_moe_cpu.sh         # mock data, 2 processes, EP=2
#   LAYOUT=ep2tp2 DATA_PATH=<prefix> bash examples/mixtral/tiny_moe_cpu.sh
#   DRY_RUN=1 LAYOUT=ep2 bash examples/mixtral/tiny_moe_cpu.sh  # validate, print the layout
# LAYOUT: ep1 (one process), ep2 (EP=2), ep2tp2 (EP=2 x TP=2 with sequence parallelism,
# 4 processes). The log goes to $RUN_ROOT/$LAYOUT.log. Overridable: RUN_ROOT ITERS NUM_LAYERS
# HIDDEN HEADS SEQ MBS GBS LR EXPERTS PYTHON.
set -euo pipefail
cd "$(dirname "$0")/../.."

LAYOUT=${LAYOUT:-ep1}
RUN_ROOT=${RUN_ROOT:-runs/tiny_moe_cpu}
ITERS=${ITERS:-40}
NUM_LAYERS=${NUM_LAYERS:-4}
HIDDEN=${HIDDEN:-128}
HEADS=${HEADS:-4}
SEQ=${SEQ:-128}
MBS=${MBS:-4}
GBS=${GBS:-16}
LR=${LR:-1e-3}
EXPERTS=${EXPERTS:-4}
PYTHON=${PYTHON:-python}

case "$LAYOUT" in
    ep1) NPROC=1; PARALLEL=() ;;
    ep2) NPROC=2; PARALLEL=(--expert-model-parallel-size 2) ;;
    ep2tp2)
        NPROC=4
        PARALLEL=(--expert-model-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel)
        ;;
    *) echo "error: LAYOUT=$LAYOUT is not one of ep1 ep2 ep2tp2" >&2; exit 2 ;;
esac

ARGS=(
    --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN" --num-attention-heads "$HEADS"
    --seq-length "$SEQ" --max-position-embeddings "$SEQ"
    --attention-dropout 0.0 --hidden-dropout 0.0
    --swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear
    --num-experts "$EXPERTS" --moe-router-topk 2 --moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3
    --moe-shared-expert-intermediate-size "$HIDDEN" --moe-token-dispatcher-type alltoall
    --micro-batch-size "$MBS" --global-batch-size "$GBS" --train-iters "$ITERS"
    --lr "$LR" --min-lr "$(echo "$LR" | awk '{print $1 / 10}')" --lr-decay-style cosine
    --lr-warmup-iters 4 --clip-grad 1.0 --num-workers 0 --seed 1234
    --log-interval 1 --eval-iters 0
)
if [[ -n "${DATA_PATH:-}" ]]; then
    ARGS+=(--data-path "$DATA_PATH" --split 98,1,1 --tokenizer-type GPT2BPETokenizer
        --vocab-file tests/data/gpt2-vocab.json --merge-file tests/data/gpt2-merges.txt)
else
    # 1000 tokens (+1 end-of-document) pad to 1024 at TP=1 and TP=2 alike: the same model.
    ARGS+=(--mock-data --tokenizer-type NullTokenizer --vocab-size 1000)
fi
if [[ "${DRY_RUN:-0}" == "1" ]]; then
    exec env WORLD_SIZE="$NPROC" RANK=0 "$PYTHON" -m megatron.training.dry_run \
        "${ARGS[@]}" "${PARALLEL[@]}" "$@"
fi
mkdir -p "$RUN_ROOT"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
if [[ "$NPROC" == "1" ]]; then
    "$PYTHON" pretrain_gpt.py "${ARGS[@]}" "${PARALLEL[@]}" "$@" > "$RUN_ROOT/$LAYOUT.log" 2>&1
else
    "$PYTHON" -m torch.distributed.run --nproc-per-node "$NPROC" --rdzv-backend c10d \
        --rdzv-endpoint localhost:0 pretrain_gpt.py "${ARGS[@]}" "${PARALLEL[@]}" "$@" \
        > "$RUN_ROOT/$LAYOUT.log" 2>&1
fi
