"""Megatron-LM's multi-token-prediction pretraining test configuration, shrunk to CPU sizes,
trains here (issue #30).

Megatron's MTP configurations (tests/functional_tests/test_cases/moe/ of Megatron-LM, e.g.
``gpt3_mcore_te_tp2_pp2_ep4_etp1_mtp_resume_torch_dist_fp8`` and
``gpt3_moe_mcore_te_tp2_pp2_ep4_etp1_fine_grained_offloading``, and the DeepSeek proxies) also
use multi-latent attention. The first one runs below with every flag it sets, the
multi-latent-attention ones included (``--multi-latent-attention``, ``--q-lora-rank``,
``--kv-lora-rank``, ``--qk-head-dim``, ``--qk-pos-emb-head-dim``, ``--v-head-dim``,
``--rotary-scaling-factor 40``, ``--mscale``, ``--mscale-all-dim``), but the GPU-only fp8 ones
(``--fp8-format``, ``--fp8-recipe``); sizes, the data (mock) and paths are shrunk, the layout
(TP2 x PP2 with 4 virtual stages x EP4) becomes PP2 with 2 virtual stages at 2 processes,
keeping its MoE routing (sigmoid scores with expert bias, group-limited top-k, shared experts,
sequence auxiliary loss), SP, the distributed optimizer with overlapped reductions, the fused
cross entropy (which the MTP head shares), the async checkpoint save and the logging flags."""

from tests.functional_tests.runner import parse_log_lines, run_pretrain

# The configuration's MODEL_ARGS in its order, sizes shrunk (the original value in a comment).
MTP_FP8_CONFIG = [
    "--distributed-timeout-minutes", "60",
    "--pipeline-model-parallel-size", "2",
    "--num-virtual-stages-per-pipeline-rank", "2",  # 4
    "--context-parallel-size", "1",
    "--expert-tensor-parallel-size", "1",
    "--use-distributed-optimizer",
    "--overlap-grad-reduce",
    "--overlap-param-gather",
    "--attention-backend", "unfused",
    "--use-mcore-models",
    "--sequence-parallel",
    "--disable-bias-linear",
    "--micro-batch-size", "2",  # 4
    "--global-batch-size", "8",  # 32
    "--train-iters", "4",  # 50
    "--exit-duration-in-mins", "230",
    "--no-check-for-nan-in-loss-and-grad",
    "--no-rope-fusion",
    "--cross-entropy-loss-fusion",
    "--cross-entropy-fusion-impl", "native",
    "--manual-gc",
    "--manual-gc-interval", "100",
    "--transformer-impl", "transformer_engine",
    "--seq-length", "64",  # 4096
    "--mock-data",  # the common-pile data
    "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "500",
    "--split", "949,50,1",
    "--num-layers", "4",  # 16
    "--hidden-size", "64",  # 1024
    "--ffn-hidden-size", "128",  # 4096
    "--num-attention-heads", "4",  # 32
    "--kv-channels", "16",  # 128
    "--max-position-embeddings", "64",  # 4096
    "--position-embedding-type", "rope",
    "--rotary-base", "10000",
    "--make-vocab-size-divisible-by", "128",  # 3232
    "--normalization", "RMSNorm",
    "--norm-epsilon", "1e-6",
    "--swiglu",
    "--untie-embeddings-and-output-weights",
    "--multi-latent-attention",
    "--mtp-num-layers", "1",
    "--mtp-loss-scaling-factor", "0.1",
    "--attention-dropout", "0.0",
    "--hidden-dropout", "0.0",
    "--clip-grad", "1.0",
    "--weight-decay", "0.1",
    "--qk-layernorm",
    "--lr-warmup-fraction", ".01",
    "--lr", "0.00015",
    "--min-lr", "1.0e-5",
    "--lr-decay-style", "cosine",
    "--adam-beta1", "0.9",
    "--adam-beta2", "0.95",
    "--num-experts", "8",  # 32
    "--moe-layer-freq", "([0]*1+[1]*3)",  # ([0]*1+[1]*15)
    "--moe-ffn-hidden-size", "32",  # 1024
    "--moe-shared-expert-intermediate-size", "32",  # 1024
    "--moe-router-load-balancing-type", "seq_aux_loss",
    "--moe-router-topk", "4",
    "--moe-token-dispatcher-type", "alltoall",
    "--moe-router-pre-softmax",
    "--moe-grouped-gemm",
    "--moe-aux-loss-coeff", "1e-4",
    "--moe-router-group-topk", "2",
    "--moe-router-num-groups", "4",
    "--moe-router-topk-scaling-factor", "2.0",
    "--moe-router-score-function", "sigmoid",
    "--moe-router-enable-expert-bias",
    "--moe-router-bias-update-rate", "1e-3",
    "--moe-router-dtype", "fp32",
    "--moe-permute-fusion",
    "--q-lora-rank", "32",  # 1536
    "--kv-lora-rank", "16",  # 512
    "--qk-head-dim", "16",  # 128
    "--qk-pos-emb-head-dim", "8",  # 64
    "--v-head-dim", "16",  # 128
    "--rotary-scaling-factor", "40",
    "--mscale", "1.0",
    "--mscale-all-dim", "1.0",
    "--eval-iters", "2",  # 32
    "--eval-interval", "200",
    "--save-interval", "2",  # 25
    "--init-method-std", "0.02",
    "--log-timers-to-tensorboard",
    "--log-memory-to-tensorboard",
    "--log-num-zeros-in-grad",
    "--log-params-norm",
    "--log-validation-ppl-to-tensorboard",
    "--log-throughput",
    "--log-interval", "1",
    "--logging-level", "40",
    "--bf16",
    "--exit-interval", "4",  # 50
    "--async-save",
    "--use-persistent-ckpt-worker",
]  # fmt: skip


def test_megatron_mtp_config_with_mla_trains(tmp_path):
    args = MTP_FP8_CONFIG + [
        "--save", str(tmp_path / "ckpt"),
        "--load", str(tmp_path / "ckpt"),
        "--tensorboard-dir", str(tmp_path / "tb"),
        "--data-cache-path", str(tmp_path / "cache"),
    ]  # fmt: skip
    result = run_pretrain(args, nproc=2)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = parse_log_lines(result.stdout)
    assert sorted(lines) == [1, 2, 3, 4], result.stdout[-3000:]
    for line in lines.values():
        losses = line["losses"]
        assert {"lm loss", "mtp_1 loss", "seq_load_balancing_loss"} <= set(losses), losses
        assert 0 < losses["mtp_1 loss"] < 10, losses
    assert (tmp_path / "ckpt" / "iter_0000004").is_dir()
    assert "not supported yet" not in result.stdout + result.stderr
