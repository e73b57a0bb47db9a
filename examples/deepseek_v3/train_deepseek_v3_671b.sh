#!/bin/bash
# DeepSeek-V3 671B (Megatron-LM's DeepSeek-V3 recipe flags): 61 layers (the first 3 dense),
# hidden 7168, multi-latent attention (q LoRA 1536, kv LoRA 512, qk head 128 + rope 64, v 128,
# YaRN x40), 256 routed experts top-8 plus a shared expert, sigmoid router with expert bias,
# group-limited top-k (8 groups, top 4), one multi-token-prediction layer, vocab 129280.
# TP=1, PP=8, EP=32 with the distributed optimizer on
# 32 nodes of 8 GPUs.
#   DATA_PATH=<prefix> TOKENIZER_MODEL=<HF dir of deepseek-ai/DeepSeek-V3> \
#       bash examples/deepseek_v3/train_deepseek_v3_671b.sh
#   DRY_RUN=1 bash examples/deepseek_v3/train_deepseek_v3_671b.sh   # validate, print the layout
# The dry run counts 671.03B parameters in the main model and 37.55B active per token: DeepSeek's
# "671B total, 37B activated" (the router's expert bias is a buffer, not a parameter, here as
# in Megatron). The MTP layer adds 11.61B (0.69B active); DeepSeek's "14B of MTP module"
# (685B on Hugging Face) also counts the copies of the embedding and output head that its
# checkpoint stores with that layer (2 x 0.93B), which Megatron shares with the main model.
set -euo pipefail
cd "$(dirname "$0")/../.."

NNODES=${NNODES:-32}
source examples/common.sh

MODEL_ARGS=(
    --num-layers 61
    --hidden-size 7168
    --ffn-hidden-size 18432
    --num-attention-heads 128
    --kv-channels 128
    --seq-length 4096
    --max-position-embeddings 4096
    --position-embedding-type rope
    --rotary-base 10000
    --make-vocab-size-divisible-by 3232
    --normalization RMSNorm
    --norm-epsilon 1e-6
    --swiglu
    --untie-embeddings-and-output-weights
    --disable-bias-linear
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --init-method-std 0.02
    # Multi-latent attention with YaRN.
    --multi-latent-attention
    --qk-layernorm
    --q-lora-rank 1536
    --kv-lora-rank 512
    --qk-head-dim 128
    --qk-pos-emb-head-dim 64
    --v-head-dim 128
    --rotary-scaling-factor 40
    --mscale 1.0
    --mscale-all-dim 1.0
    # Multi-token prediction: one depth.
    --mtp-num-layers 1
    --mtp-loss-scaling-factor 0.1
)
MOE_ARGS=(
    --num-experts 256
    --moe-layer-freq "([0]*3+[1]*58)"
    --moe-ffn-hidden-size 2048
    --moe-shared-expert-intermediate-size 2048
    --moe-router-load-balancing-type seq_aux_loss
    --moe-aux-loss-coeff 1e-4
    --moe-router-topk 8
    --moe-router-num-groups 8
    --moe-router-group-topk 4
    --moe-router-pre-softmax
    --moe-router-topk-scaling-factor 2.5
    --moe-router-score-function sigmoid
    --moe-router-enable-expert-bias
    --moe-router-bias-update-rate 1e-3
    --moe-router-dtype fp32
    --moe-grouped-gemm
    --moe-token-dispatcher-type alltoall
)
if [[ -n "${DATA_PATH:-}" ]]; then
    TOKENIZER_ARGS=(--tokenizer-type HuggingFaceTokenizer
        --tokenizer-model "${TOKENIZER_MODEL:-deepseek-ai/DeepSeek-V3}")
else
    TOKENIZER_ARGS=(--tokenizer-type NullTokenizer --vocab-size 129279)  # + end-of-document
fi
TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 2048
    --train-samples 585937500
    --lr 3.9e-6
    --min-lr 3.9e-7
    --lr-warmup-init 3.9e-7
    --lr-warmup-samples 1536000
    --lr-decay-samples 584765624
    --lr-decay-style cosine
    --adam-beta1 0.9
    --adam-beta2 0.95
    --weight-decay 0.1
    --clip-grad 1.0
    --bf16
    --recompute-granularity selective
    --recompute-modules mlp  # Megatron's recipe also recomputes moe_act (not built here)
)
MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 8
    # Megatron's recipe balances 61 layers with --pipeline-model-parallel-layout "Et|(tt|)*30L"
    # (not implemented here); uneven stages instead: 7 (3 of them dense), 6 x 8, and 6 with
    # the MTP layer and the two output heads.
    --decoder-first-pipeline-num-layers 7
    --decoder-last-pipeline-num-layers 6
    --expert-model-parallel-size 32
    --expert-tensor-parallel-size 1
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
)

launch "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${DATA_ARGS[@]}" "${TOKENIZER_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@"
