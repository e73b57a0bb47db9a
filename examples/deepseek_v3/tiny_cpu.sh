#!/bin/bash
# A tiny DeepSeek-V3 on CPU processes (gloo): every feature of the 671B script at toy sizes.
# Multi-latent attention (q and kv LoRA, decoupled RoPE, YaRN), the first layer dense and the
# rest mixtures of 16 experts top-4 with a shared expert, sigmoid router with expert bias,
# group-limited top-k (4 groups, top 2), sequence-level aux loss, one MTP layer.
#   bash examples/deepseek_v3/tiny_cpu.sh                     # mock data, 1 process
#   LAYOUT=ep2 DATA_PATH=<prefix> bash examples/deepseek_v3/tiny_cpu.sh
#   DRY_RUN=1 bash examples/deepseek_v3/tiny_cpu.sh           # validate, print the layout
# LAYOUT: ep1 (one process), ep2 (EP=2, 2 processes), pp2 (PP=2, MTP on the last stage).
# The log goes to $RUN_ROOT/$LAYOUT.log. Overridable: RUN_ROOT ITERS SEQ MBS GBS LR PYTHON.
set -euo pipefail
cd "$(dirname "$0")/../.."

LAYOUT=${LAYOUT:-ep1}
RUN_ROOT=${RUN_ROOT:-runs/tiny_deepseek_cpu}
ITERS=${ITERS:-10}
SEQ=${SEQ:-64}
MBS=${MBS:-2}
GBS=${GBS:-8}
LR=${LR:-1e-3}
PYTHON=${PYTHON:-python}

case "$LAYOUT" in
    ep1) NPROC=1; PARALLEL=() ;;
    ep2) NPROC=2; PARALLEL=(--expert-model-parallel-size 2) ;;
    pp2) NPROC=2; PARALLEL=(--pipeline-model-parallel-size 2) ;;
    *) echo "error: LAYOUT=$LAYOUT is not one of ep1 ep2 pp2" >&2; exit 2 ;;
esac

ARGS=(
    --num-layers 4 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4
    --kv-channels 16 --seq-length "$SEQ" --max-position-embeddings "$SEQ"
    --position-embedding-type rope --rotary-base 10000
    --normalization RMSNorm --norm-epsilon 1e-6 --swiglu
    --untie-embeddings-and-output-weights --disable-bias-linear
    --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.02
    --multi-latent-attention --qk-layernorm --q-lora-rank 32 --kv-lora-rank 16
    --qk-head-dim 16 --qk-pos-emb-head-dim 8 --v-head-dim 16
    --rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0
    --mtp-num-layers 1 --mtp-loss-scaling-factor 0.1
    --num-experts 16 --moe-layer-freq "([0]*1+[1]*3)" --moe-ffn-hidden-size 32
    --moe-shared-expert-intermediate-size 32
    --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4
    --moe-router-topk 4 --moe-router-num-groups 4 --moe-router-group-topk 2
    --moe-router-pre-softmax --moe-router-topk-scaling-factor 2.5
    --moe-router-score-function sigmoid --moe-router-enable-expert-bias
    --moe-router-bias-update-rate 1e-3 --moe-router-dtype fp32
    --moe-token-dispatcher-type alltoall
    --micro-batch-size "$MBS" --global-batch-size "$GBS" --train-iters "$ITERS"
    --lr "$LR" --min-lr "$(echo "$LR" | awk '{print $1 / 10}')" --lr-decay-style cosine
    --lr-warmup-iters 2 --adam-beta1 0.9 --adam-beta2 0.95 --weight-decay 0.1 --clip-grad 1.0
    --num-workers 0 --seed 1234 --log-interval 1 --eval-iters 0 --log-throughput
)
if [[ -n "${DATA_PATH:-}" ]]; then
    ARGS+=(--data-path "$DATA_PATH" --split 98,1,1 --tokenizer-type GPT2BPETokenizer
        --vocab-file tests/data/gpt2-vocab.json --merge-file tests/data/gpt2-merges.txt)
else
    ARGS+=(--mock-data --tokenizer-type NullTokenizer --vocab-size 1000)
fi
if [[ "${DRY_RUN:-0}" == "1" ]]; then
    exec env WORLD_SIZE="$NPROC" RANK=0 "$PYTHON" -m megatron.training.dry_run \
        "${ARGS[@]}" "${PARALLEL[@]}" "$@"
fi
mkdir -p "$RUN_ROOT"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
if [[ "$NPROC" == "1" ]]; then
    "$PYTHON" pretrain_gpt.py "${ARGS[@]}" "${PARALLEL[@]}" "$@" 2>&1 | tee "$RUN_ROOT/$LAYOUT.log"
else
    "$PYTHON" -m torch.distributed.run --nproc-per-node "$NPROC" --rdzv-backend c10d \
        --rdzv-endpoint localhost:0 pretrain_gpt.py "${ARGS[@]}" "${PARALLEL[@]}" "$@" \
        2>&1 | tee "$RUN_ROOT/$LAYOUT.log"
fi
