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
cross entropy (which the MTP head shares), the async checkpoint save and the logging flags.

``gpt3_moe_mcore_te_tp2_pp2_ep4_etp1_fine_grained_offloading`` (selective recompute of
layernorm, mla_up_proj, mlp and moe_act; fine-grained activation offloading; the layout
``Et*3|(tt|)*6mL``; the EP overlap) and ``deepseek_proxy_ep2_pp2_1node_conv`` (the same
recompute and offloading at PP 2 x EP 2, deterministic mode, fp8) then train shrunk in one
spawned world of 4: nothing refused but the fp8 flags (GPU-only kernels)."""

import json
import os

import pytest

from tests.functional_tests.runner import parse_log_lines, run_pretrain
from tests.unit_tests.dist_utils import run_distributed

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


# Two more of Megatron's MLA configurations (moe/<case>/model_config.yaml), as dicts of their
# MODEL_ARGS (test_megatron_test_cases.argv_of writes the command line), with the selective
# recompute of Megatron's MLA modules and fine-grained activation offloading (memory only: named
# as without effect here). gpt3_moe_mcore_te_tp2_pp2_ep4_etp1_fine_grained_offloading also
# places its layers with --pipeline-model-parallel-layout "Et*3|(tt|)*6mL" (the YAML escapes
# it for the shell), which sets 4 virtual stages per rank, the last holding only the MTP layer
# and the loss.
FINE_GRAINED_OFFLOADING = {
    "distributed_timeout_minutes": 60,
    "tensor_model_parallel_size": 2,
    "pipeline_model_parallel_size": 2,
    "expert_model_parallel_size": 2,  # 4
    "context_parallel_size": 1,
    "expert_tensor_parallel_size": 1,
    "use_distributed_optimizer": True,
    "attention_backend": "unfused",
    "use_mcore_models": True,
    "sequence_parallel": True,
    "disable_bias_linear": True,
    "micro_batch_size": 1,
    "global_batch_size": 4,  # 8
    "train_iters": 2,  # 50
    "exit_duration_in_mins": 230,
    "no_check_for_nan_in_loss_and_grad": True,
    "no_rope_fusion": True,
    "cross_entropy_loss_fusion": True,
    "cross_entropy_fusion_impl": "native",
    "manual_gc": True,
    "manual_gc_interval": 100,
    "recompute_granularity": "selective",
    "recompute_modules": "layernorm mla_up_proj mlp moe_act",  # "[layernorm ... moe_act]"
    "fine_grained_activation_offloading": True,
    "offload_modules": "expert_fc1 moe_act attn_norm mlp_norm qkv_linear core_attn attn_proj",
    "transformer_impl": "transformer_engine",
    "seq_length": 64,  # 4096
    "mock_data": True,  # the Pile shard
    "tokenizer_type": "NullTokenizer",
    "vocab_size": 500,
    "split": "949,50,1",
    "num_layers": 3,  # 15
    "moe_layer_freq": "([0]*1+[1]*2)",  # ([0]*3+[1]*12)
    "pipeline_model_parallel_layout": "Et|(t|)*2mL",  # Et*3|(tt|)*6mL
    "hidden_size": 64,  # 1024
    "ffn_hidden_size": 128,  # 4096
    "num_attention_heads": 4,  # 32
    "kv_channels": 16,  # 128
    "max_position_embeddings": 64,  # 4096
    "position_embedding_type": "rope",
    "rotary_base": 10000,
    "make_vocab_size_divisible_by": 128,  # 3232
    "normalization": "RMSNorm",
    "norm_epsilon": 1e-6,
    "swiglu": True,
    "untie_embeddings_and_output_weights": True,
    "multi_latent_attention": True,
    "mtp_num_layers": 1,
    "mtp_loss_scaling_factor": 0.1,
    "attention_dropout": 0.0,
    "hidden_dropout": 0.0,
    "clip_grad": 1.0,
    "weight_decay": 0.1,
    "qk_layernorm": True,
    "lr_warmup_fraction": ".01",
    "lr": 0.00015,
    "min_lr": 1.0e-5,
    "lr_decay_style": "cosine",
    "adam_beta1": 0.9,
    "adam_beta2": 0.95,
    "num_experts": 8,  # 32
    "moe_ffn_hidden_size": 32,  # 1024
    "moe_shared_expert_intermediate_size": 32,  # 1024
    "moe_router_load_balancing_type": "seq_aux_loss",
    "moe_router_topk": 4,
    "moe_token_dispatcher_type": "alltoall",
    "moe_router_pre_softmax": True,
    "moe_grouped_gemm": True,
    "moe_aux_loss_coeff": 1e-4,
    "moe_router_group_topk": 2,
    "moe_router_num_groups": 4,
    "moe_router_topk_scaling_factor": 2.0,
    "moe_router_score_function": "sigmoid",
    "moe_router_enable_expert_bias": True,
    "moe_router_bias_update_rate": 1e-3,
    "moe_router_dtype": "fp32",
    "moe_permute_fusion": True,
    "q_lora_rank": 32,  # 1536
    "kv_lora_rank": 16,  # 512
    "qk_head_dim": 16,  # 128
    "qk_pos_emb_head_dim": 8,  # 64
    "v_head_dim": 16,  # 128
    "rotary_scaling_factor": 40,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "eval_iters": 0,  # 32 (never reached: --eval-interval 200)
    "eval_interval": 200,
    "init_method_std": 0.02,
    "log_timers_to_tensorboard": True,
    "log_memory_to_tensorboard": True,
    "log_num_zeros_in_grad": True,
    "log_params_norm": True,
    "log_validation_ppl_to_tensorboard": True,
    "log_throughput": True,
    "log_interval": 1,
    "logging_level": 40,
    "bf16": True,
    "exit_interval": None,  # 50 (it would end the spawned process at once: --train-iters ends)
    "overlap_moe_expert_parallel_comm": True,
}  # (no --save/--load: the checkpoint of this configuration is the MTP one's above)
# moe/deepseek_proxy_ep2_pp2_1node_conv: a 2-layer DeepSeek proxy (MLA, a dense then a MoE
# layer) at PP 2 x EP 2 in fp8 (GPU-only: refused here, and dropped to train).
DEEPSEEK_EP2_PP2_CONV = {
    "distributed_timeout_minutes": 60,
    "tensor_model_parallel_size": 1,
    "pipeline_model_parallel_size": 2,
    "expert_model_parallel_size": 2,
    "context_parallel_size": 1,
    "expert_tensor_parallel_size": 1,
    "use_distributed_optimizer": True,
    "overlap_grad_reduce": True,
    "overlap_param_gather": True,
    "fp8_format": "hybrid",
    "fp8_recipe": "tensorwise",
    "use_mcore_models": True,
    "sequence_parallel": True,
    "disable_bias_linear": True,
    "micro_batch_size": 2,  # 128
    "global_batch_size": 8,  # 1024
    "train_iters": 2,  # 1000
    "exit_duration_in_mins": 60,
    "cross_entropy_fusion_impl": "te",
    "manual_gc": True,
    "manual_gc_interval": 10,
    "deterministic_mode": True,
    "seed": 42,
    "transformer_impl": "transformer_engine",
    "recompute_granularity": "selective",
    "recompute_modules": "layernorm mla_up_proj moe_act",  # "[layernorm mla_up_proj moe_act]"
    "fine_grained_activation_offloading": True,
    "offload_modules": "core_attn attn_proj",
    "seq_length": 64,  # 1024
    "mock_data": True,  # the Pile shard
    "tokenizer_type": "NullTokenizer",
    "vocab_size": 500,
    "split": "949,50,1",
    "num_layers": 2,
    "hidden_size": 64,  # 512
    "ffn_hidden_size": 128,  # 2048
    "num_attention_heads": 4,  # 8
    "kv_channels": 16,  # 128
    "max_position_embeddings": 64,  # 1024
    "position_embedding_type": "rope",
    "rotary_base": 10000,
    "make_vocab_size_divisible_by": 64,
    "normalization": "RMSNorm",
    "norm_epsilon": 1e-6,
    "swiglu": True,
    "untie_embeddings_and_output_weights": True,
    "multi_latent_attention": True,
    "attention_dropout": 0.0,
    "hidden_dropout": 0.0,
    "clip_grad": 1.0,
    "weight_decay": 0.1,
    "qk_layernorm": True,
    "lr_warmup_fraction": ".01",
    "lr": 0.00015,
    "min_lr": 1.0e-5,
    "lr_decay_style": "cosine",
    "adam_beta1": 0.9,
    "adam_beta2": 0.95,
    "num_experts": 8,
    "moe_layer_freq": "([0]*1+[1]*1)",
    "moe_ffn_hidden_size": 32,  # 1024
    "moe_shared_expert_intermediate_size": 32,  # 1024
    "moe_router_load_balancing_type": "seq_aux_loss",
    "moe_router_topk": 2,
    "moe_grouped_gemm": True,
    "moe_aux_loss_coeff": 1e-4,
    "moe_router_group_topk": 4,
    "moe_router_num_groups": 4,
    "moe_router_topk_scaling_factor": 2.5,
    "moe_router_score_function": "sigmoid",
    "moe_router_enable_expert_bias": True,
    "moe_router_bias_update_rate": 1e-3,
    "moe_router_dtype": "fp32",
    "moe_permute_fusion": True,
    "moe_router_pre_softmax": True,
    "moe_token_dispatcher_type": "alltoall",
    "q_lora_rank": 32,  # 256
    "kv_lora_rank": 16,  # 128
    "qk_head_dim": 16,  # 128
    "qk_pos_emb_head_dim": 8,  # 64
    "v_head_dim": 16,  # 128
    "rotary_scaling_factor": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "eval_iters": 0,  # 10 (never reached: --eval-interval 100)
    "eval_interval": 100,
    "init_method_std": 0.02,
    "log_timers_to_tensorboard": True,
    "log_memory_to_tensorboard": True,
    "log_num_zeros_in_grad": True,
    "log_params_norm": True,
    "log_validation_ppl_to_tensorboard": True,
    "log_throughput": True,
    "log_interval": 1,
}
# The values of the fine-grained offloading configuration that its shrunk form changes.
FINE_GRAINED_OFFLOADING_AS_WRITTEN = {
    "expert_model_parallel_size": 4,
    "global_batch_size": 8,
    "num_layers": 15,
    "moe_layer_freq": "([0]*3+[1]*12)",
    "pipeline_model_parallel_layout": "Et*3|(tt|)*6mL",
    "num_experts": 32,
}
GPU_ONLY = ("fp8_format", "fp8_recipe")
SHRUNK_CONFIGS = {
    "fine_grained_offloading": FINE_GRAINED_OFFLOADING,
    "deepseek_ep2_pp2_conv": {k: v for k, v in DEEPSEEK_EP2_PP2_CONV.items() if k not in GPU_ONLY},
}
# The start-up note names these as changing memory or speed only.
NO_EFFECT = ["--fine-grained-activation-offloading", "--offload-modules"]


def _train_shrunk_configs(rank, world_size, tmp):
    from tests.functional_tests.test_log_line_parity import _train
    from tests.functional_tests.test_megatron_test_cases import argv_of

    results = {}
    for name, config in SHRUNK_CONFIGS.items():
        tb = os.path.join(tmp, name)
        received, _ = _train(argv_of({**config, "tensorboard_dir": tb}))
        results[name] = received
    if rank == world_size - 1:  # the last pipeline stage holds the losses
        with open(os.path.join(tmp, "results.json"), "w") as f:
            json.dump(results, f)


def test_megatron_fine_grained_offloading_and_deepseek_conv_configs_train(tmp_path, monkeypatch):
    """Both pass validation with nothing refused but the fp8 kernels (their start-up note names
    the offloading as memory only), then train shrunk, 2 iterations each, in one spawned world
    of 4 (TP2 x PP2 with 2 virtual stages from the layout, EP2; PP2 x DP2 x EP2)."""
    from megatron.training.arguments import ArgumentValidationError
    from tests.functional_tests.test_megatron_test_cases import _validated

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(
        ArgumentValidationError,
        match=r"^not supported yet: --fp8-format hybrid \(fp8/fp4 training needs Transformer "
        r"Engine.*; --fp8-recipe tensorwise \(fp8/fp4 training needs Transformer Engine[^;]*$",
    ):
        _validated(DEEPSEEK_EP2_PP2_CONV)
    for name, config in SHRUNK_CONFIGS.items():
        args = _validated(config)
        for flag in NO_EFFECT:
            assert f"{flag}" in args.no_effect_note, (name, args.no_effect_note)
    args = _validated(FINE_GRAINED_OFFLOADING)
    assert args.virtual_pipeline_model_parallel_size == 2
    # At its own sizes and 8 ranks the layout as written gives 4 virtual stages per rank.
    monkeypatch.setenv("WORLD_SIZE", "8")
    args = _validated({**FINE_GRAINED_OFFLOADING, **FINE_GRAINED_OFFLOADING_AS_WRITTEN})
    assert args.virtual_pipeline_model_parallel_size == 4
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert "--offload-modules expert_fc1" in args.no_effect_note, args.no_effect_note

    run_distributed(_train_shrunk_configs, 4, str(tmp_path))
    with open(tmp_path / "results.json") as f:
        results = json.load(f)
    for name, received in results.items():
        assert [got["iteration"] for got in received] == [1, 2], (name, received)
        for got in received:
            losses = got["losses"]
            assert 0 < losses["lm loss"] < 10 and "seq_load_balancing_loss" in losses, got
    assert 0 < results["fine_grained_offloading"][-1]["losses"]["mtp_1 loss"] < 10
