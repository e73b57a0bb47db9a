"""Megatron-LM's own pretraining test configurations that use the flags of issue 34, run here.

Each dict below is a ``MODEL_ARGS`` block of Megatron-LM's
tests/functional_tests/test_cases/<family>/<case>/model_config.yaml, written out flag for flag
(its ``${...}`` paths replaced by placeholders):

* gpt/gpt3_mcore_te_tp1_pp2_cp4_a2a_p2p_nondeterministic: hierarchical context parallelism
  (``--cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 2 2``), 8 ranks;
* moe/gpt3_mcore_te_tp2_pp1_te_a2a_ovlp_8experts_etp1_ep4_1node: ``--overlap-moe-expert-
  parallel-comm``, 8 ranks;
* gpt/gpt3_mcore_te_tp4_pp1_qk_layernorm_test_mode: ``--test-mode`` with QK layernorm, 4 ranks.
* gpt/gpt3_mcore_te_mfsdp_v2_cp2: Megatron-FSDP (v2, optim_grads_params) with CP 2, 8 ranks
  (trained shrunk to CP 2 in test_megatron_fsdp_e2e.py's spawned world).

Each passes validate_args at its own world size with nothing refused, the start-up note naming
only flags that change speed (Transformer Engine, fused kernels, the overlap, the checkpoint
writer). Shrunk to CPU sizes (2 layers, hidden 64, sequence 64, 3 iterations, mock data, and
fewer ranks: TP 2 for the test-mode case, TP 2 x EP 2 for the overlap, CP 4 = 2 x 2 without
the pipeline for the hierarchical case), each trains through torchrun and logs every iteration.

The other configurations with these flags, DeepSeek proxies (Megatron-FSDP with EP 2 and
multi-latent attention; EP overlap with --delay-wgrad-compute; per-token loss with the sequence
aux loss), pass validation at their world size; they train shrunk in test_megatron_fsdp_e2e.py.
"""

import pytest
import torch

from megatron.training.arguments import parse_args, validate_args
from tests.functional_tests.runner import parse_log_lines, run_pretrain

PLACEHOLDERS = {
    "tensorboard_dir": "/tb",
    "save": "/ckpt",
    "load": "/ckpt",
    "data_path": "/data/text/my-gpt3_00_text_document",
    "vocab_file": "/data/bpe/vocab.json",
    "merge_file": "/data/bpe/merges.txt",
    "data_cache_path": "/data/cache",
}
# The first block that the three files share, in their order.
COMMON = {
    "num_layers": 12,
    "hidden_size": 512,
    "num_attention_heads": 8,
    "log_params_norm": True,
    "log_num_zeros_in_grad": True,
    "log_validation_ppl_to_tensorboard": True,
    "log_timers_to_tensorboard": True,
    "tensorboard_dir": PLACEHOLDERS["tensorboard_dir"],
    "micro_batch_size": 4,
    "global_batch_size": 32,
    "seq_length": 1024,
    "max_position_embeddings": 1024,
    "train_iters": 50,
    "timing_log_level": 0,
    "lr_decay_iters": 320000,
    "save": PLACEHOLDERS["save"],
    "load": PLACEHOLDERS["load"],
    "data_path": PLACEHOLDERS["data_path"],
    "vocab_file": PLACEHOLDERS["vocab_file"],
    "merge_file": PLACEHOLDERS["merge_file"],
    "split": "949,50,1",
    "distributed_backend": "nccl",
    "lr": 0.00015,
    "lr_decay_style": "cosine",
    "min_lr": 1.0e-5,
    "weight_decay": 1e-2,
    "clip_grad": 1.0,
    "lr_warmup_fraction": ".01",
    "log_interval": 1,
    "save_interval": 10000,
    "eval_interval": 1000,
    "eval_iters": 10,
    "transformer_impl": "transformer_engine",
}
HIERARCHICAL_CP = {
    **COMMON,
    "tensor_model_parallel_size": 1,
    "pipeline_model_parallel_size": 2,
    "context_parallel_size": 4,
    "cp_comm_type": "a2a+p2p",
    "hierarchical_context_parallel_sizes": "2 2",
    "sequence_parallel": True,
    "hidden_dropout": 0.0,
    "attention_dropout": 0.0,
    "no_gradient_accumulation_fusion": True,
    "attention_softmax_in_fp32": True,
    "use_mcore_models": True,
    "ckpt_format": "torch_dist",
    "dist_ckpt_strictness": "log_all",
    "data_cache_path": PLACEHOLDERS["data_cache_path"],
    "bf16": True,
    "attention_backend": "flash",
    "log_memory_to_tensorboard": True,
    "async_save": True,
    "use_persistent_ckpt_worker": True,
}
EP_OVERLAP = {
    **COMMON,
    "tensor_model_parallel_size": 2,
    "pipeline_model_parallel_size": 1,
    "expert_model_parallel_size": 4,
    "expert_tensor_parallel_size": 1,
    "disable_bias_linear": True,
    "sequence_parallel": True,
    "num_experts": 8,
    "moe_router_load_balancing_type": "aux_loss",
    "moe_router_topk": 2,
    "moe_aux_loss_coeff": 1e-2,
    "deterministic_mode": True,
    "no_gradient_accumulation_fusion": True,
    "moe_grouped_gemm": True,
    "moe_token_dispatcher_type": "alltoall",
    "overlap_moe_expert_parallel_comm": True,
    "attention_softmax_in_fp32": True,
    "use_mcore_models": True,
    "ckpt_format": "torch_dist",
    "dist_ckpt_strictness": "log_all",
    "data_cache_path": PLACEHOLDERS["data_cache_path"],
    "bf16": True,
    "attention_backend": "unfused",
    "no_bias_gelu_fusion": True,
    "log_memory_to_tensorboard": True,
    "exit_interval": 50,
    "async_save": True,
    "use_persistent_ckpt_worker": True,
}
TEST_MODE = {
    **COMMON,
    "tensor_model_parallel_size": 4,
    "pipeline_model_parallel_size": 1,
    "qk_layernorm": True,
    "test_mode": True,
    "deterministic_mode": True,
    "no_gradient_accumulation_fusion": True,
    "attention_softmax_in_fp32": True,
    "use_mcore_models": True,
    "ckpt_format": "torch_dist",
    "dist_ckpt_optim_fully_reshardable": True,
    "dist_ckpt_strictness": "log_all",
    "data_cache_path": PLACEHOLDERS["data_cache_path"],
    "bf16": True,
    "attention_backend": "unfused",
    "log_memory_to_tensorboard": True,
}
# gpt/gpt3_mcore_te_mfsdp_v2_cp2: a dense GPT on Megatron-FSDP (v2) with CP 2 over 8 GPUs (DP 4):
# Megatron-FSDP shards over the data x context parallel group. Trained shrunk (CP 2, DP 1: the
# shards are over the two CP ranks) in the spawned world of test_megatron_fsdp_e2e.py.
MFSDP_V2_CP2 = {
    "bf16": True,
    "tensor_model_parallel_size": 1,
    "pipeline_model_parallel_size": 1,
    "context_parallel_size": 2,
    "distributed_backend": "nccl",
    "distributed_timeout_minutes": 60,
    "use_megatron_fsdp": True,
    "megatron_fsdp_version": 2,
    "data_parallel_sharding_strategy": "optim_grads_params",
    "ckpt_format": "fsdp_dtensor",
    "no_gradient_accumulation_fusion": True,
    "use_mcore_models": True,
    "transformer_impl": "transformer_engine",
    "attention_backend": "flash",
    "micro_batch_size": 4,
    "global_batch_size": 32,
    "train_iters": 50,
    "seq_length": 1024,
    "max_position_embeddings": 1024,
    "timing_log_level": 0,
    "lr_decay_iters": 320000,
    "data_path": PLACEHOLDERS["data_path"],
    "data_cache_path": PLACEHOLDERS["data_cache_path"],
    "tokenizer_type": "NullTokenizer",
    "vocab_size": 50257,
    "split": "949,50,1",
    "num_layers": 12,
    "hidden_size": 512,
    "num_attention_heads": 8,
    "attention_dropout": 0.0,
    "hidden_dropout": 0.0,
    "attention_softmax_in_fp32": True,
    "clip_grad": 1.0,
    "weight_decay": 1e-2,
    "lr": 0.00015,
    "min_lr": 1.0e-5,
    "lr_decay_style": "cosine",
    "lr_warmup_fraction": ".01",
    "eval_interval": 1000,
    "eval_iters": 10,
    "save_interval": 10000,
    "log_interval": 1,
    "log_params_norm": True,
    "log_num_zeros_in_grad": True,
    "log_memory_to_tensorboard": True,
    "log_timers_to_tensorboard": True,
    "log_validation_ppl_to_tensorboard": True,
    "tensorboard_dir": PLACEHOLDERS["tensorboard_dir"],
    "exit_interval": 50,
}
# (configuration, its world size, the flags the start-up note must name as speed-only)
CASES = {
    "hierarchical_cp": (
        HIERARCHICAL_CP,
        8,
        ["--transformer-impl transformer_engine", "--cp-comm-type a2a+p2p"],
    ),
    "ep_overlap": (
        EP_OVERLAP,
        8,
        ["--transformer-impl transformer_engine", "--overlap-moe-expert-parallel-comm"],
    ),
    "test_mode": (TEST_MODE, 4, ["--transformer-impl transformer_engine"]),
    "mfsdp_v2_cp2": (
        MFSDP_V2_CP2,
        8,
        ["--transformer-impl transformer_engine", "--megatron-fsdp-version 2"],
    ),
}
# CPU sizes: the model, the batch and the data (mock), no checkpoint and no evaluation.
SHRUNK = {
    "num_layers": 2,
    "hidden_size": 64,
    "seq_length": 64,
    "max_position_embeddings": 64,
    "micro_batch_size": 2,
    "global_batch_size": 4,
    "train_iters": 3,
    "eval_iters": 0,
    "save": None,
    "load": None,
    "data_path": None,
    "vocab_file": None,
    "merge_file": None,
    "data_cache_path": None,
    "mock_data": True,
    "tokenizer_type": "NullTokenizer",
    "vocab_size": 128,
}
# The parallel sizes the shrunk runs take, and their process counts.
SHRUNK_LAYOUT = {
    "hierarchical_cp": ({"pipeline_model_parallel_size": 1}, 4),
    "ep_overlap": ({"expert_model_parallel_size": 2}, 2),
    "test_mode": ({"tensor_model_parallel_size": 2}, 2),
}


def argv_of(config):
    """The command line of a MODEL_ARGS block (a value with spaces is several values)."""
    argv = []
    for dest, value in config.items():
        if value is None or value is False:
            continue
        flag = "--" + dest.replace("_", "-")
        argv += [flag] if value is True else [flag] + str(value).split()
    return argv


@pytest.mark.parametrize("name", sorted(CASES))
def test_megatron_test_case_passes_validation(name, monkeypatch):
    config, world_size, no_effect = CASES[name]
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("RANK", "0")
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:  # --deterministic-mode turns on torch's deterministic algorithms in this process
        args = validate_args(parse_args(argv=argv_of(config)))
    finally:
        torch.use_deterministic_algorithms(deterministic)
    note = args.no_effect_note
    assert note.startswith("no effect here (speed only): "), note
    for flag in no_effect:
        assert f"{flag} (" in note or f"{flag}, " in note, (flag, note)


# (mfsdp_v2_cp2 trains in the spawned world of test_megatron_fsdp_e2e.py instead: no launch.)
@pytest.mark.parametrize("name", sorted(SHRUNK_LAYOUT))
def test_megatron_test_case_trains_shrunk_on_cpu(name, tmp_path):
    config, _, _ = CASES[name]
    layout, nproc = SHRUNK_LAYOUT[name]
    shrunk = {**config, **SHRUNK, **layout, "tensorboard_dir": str(tmp_path / "tb")}
    result = run_pretrain(argv_of(shrunk), nproc=nproc)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert sorted(parse_log_lines(result.stdout)) == [1, 2, 3]
    assert "not supported yet" not in result.stdout + result.stderr


# The DeepSeek proxies among the test configurations of these flags: EP overlap with
# --delay-wgrad-compute (moe/deepseek_proxy_fsdp_ep2_fsdp2_ep_overlap and, with Megatron-FSDP
# v2, moe/deepseek_proxy_mfsdp_v2_ep2_ep_overlap) and per-token loss with
# the sequence aux loss (moe/deepseek_proxy_mfsdp_v2_ep2_mb2_per_token_loss). Both use
# multi-latent attention and Megatron-FSDP with expert parallelism.
DEEPSEEK_PROXY = {
    "bf16": True,
    "distributed_timeout_minutes": 60,
    "tensor_model_parallel_size": 1,
    "pipeline_model_parallel_size": 1,
    "expert_model_parallel_size": 2,
    "context_parallel_size": 1,
    "expert_tensor_parallel_size": 1,
    "overlap_grad_reduce": True,
    "overlap_param_gather": True,
    "attention_backend": "unfused",
    "use_megatron_fsdp": True,
    "data_parallel_sharding_strategy": "optim_grads_params",
    "outer_dp_sharding_strategy": "no_shard",
    "deterministic_mode": True,
    "ckpt_format": "fsdp_dtensor",
    "no_gradient_accumulation_fusion": True,
    "use_mcore_models": True,
    "sequence_parallel": True,
    "disable_bias_linear": True,
    "train_iters": 50,
    "exit_duration_in_mins": 60,
    "no_check_for_nan_in_loss_and_grad": True,
    "no_rope_fusion": True,
    "manual_gc": True,
    "manual_gc_interval": 100,
    "transformer_impl": "transformer_engine",
    "seq_length": 1024,
    "data_cache_path": PLACEHOLDERS["data_cache_path"],
    "data_path": PLACEHOLDERS["data_path"],
    "vocab_file": PLACEHOLDERS["vocab_file"],
    "merge_file": PLACEHOLDERS["merge_file"],
    "split": "949,50,1",
    "hidden_size": 512,
    "ffn_hidden_size": 2048,
    "num_attention_heads": 8,
    "kv_channels": 128,
    "max_position_embeddings": 1024,
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
    "moe_ffn_hidden_size": 1024,
    "moe_shared_expert_intermediate_size": 1024,
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
    "q_lora_rank": 256,
    "kv_lora_rank": 128,
    "qk_head_dim": 128,
    "qk_pos_emb_head_dim": 64,
    "v_head_dim": 128,
    "rotary_scaling_factor": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "eval_iters": 10,
    "eval_interval": 200,
    "save_interval": 25,
    "init_method_std": 0.02,
    "log_timers_to_tensorboard": True,
    "log_memory_to_tensorboard": True,
    "log_num_zeros_in_grad": True,
    "log_params_norm": True,
    "log_validation_ppl_to_tensorboard": True,
    "log_throughput": True,
    "log_interval": 1,
    "logging_level": 10,
    "tensorboard_dir": PLACEHOLDERS["tensorboard_dir"],
    "exit_interval": 50,
}
DEEPSEEK_CASES = {
    "deepseek_ep_overlap": {
        **DEEPSEEK_PROXY,
        "overlap_moe_expert_parallel_comm": True,
        "delay_wgrad_compute": True,
        "use_distributed_optimizer": True,
        "num_distributed_optimizer_instances": 1,
        "micro_batch_size": 4,
        "global_batch_size": 32,
        "num_layers": 2,
        "moe_layer_freq": "([0]*1+[1]*1)",
    },
    "deepseek_mfsdp_v2_ep_overlap": {
        **DEEPSEEK_PROXY,
        "overlap_moe_expert_parallel_comm": True,
        "delay_wgrad_compute": True,
        "megatron_fsdp_version": 2,
        "micro_batch_size": 32,
        "global_batch_size": 256,
        "num_layers": 8,
        "moe_layer_freq": "([0]*3+[1]*5)",
    },
    "deepseek_per_token_loss": {
        **DEEPSEEK_PROXY,
        "megatron_fsdp_version": 2,
        "calculate_per_token_loss": True,
        "eod_mask_loss": True,
        "micro_batch_size": 32,
        "global_batch_size": 512,
        "num_layers": 8,
        "moe_layer_freq": "([0]*3+[1]*5)",
    },
}


@pytest.mark.parametrize("name", sorted(DEEPSEEK_CASES))
def test_deepseek_proxies_pass_validation(name, monkeypatch):
    # Megatron-FSDP with expert parallelism, multi-latent attention and the rest: nothing
    # refused at the proxies' own world size (8).
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "0")
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        args = validate_args(parse_args(argv=argv_of(DEEPSEEK_CASES[name])))
    finally:
        torch.use_deterministic_algorithms(deterministic)
    assert args.use_megatron_fsdp and args.expert_model_parallel_size == 2
    assert "--transformer-impl transformer_engine (" in args.no_effect_note


# The three proxies train shrunk (2 layers, the second MoE; EP 2 under Megatron-FSDP) in the
# spawned world of test_megatron_fsdp_e2e.py (megatron_configs_shrunk), without a launch each.


# moe/deepseek_proxy_unsharded_1node: the same proxy on one GPU without Megatron-FSDP or the
# distributed optimizer (2 layers, the first dense), in fp8 without bf16.
_PROXY_ONLY = (
    "bf16 overlap_grad_reduce overlap_param_gather use_megatron_fsdp "
    "data_parallel_sharding_strategy outer_dp_sharding_strategy ckpt_format sequence_parallel"
).split()
DEEPSEEK_UNSHARDED = {
    **{dest: value for dest, value in DEEPSEEK_PROXY.items() if dest not in _PROXY_ONLY},
    "expert_model_parallel_size": 1,
    "fp8_format": "e4m3",
    "fp8_recipe": "tensorwise",
    "micro_batch_size": 4,
    "global_batch_size": 32,
    "num_layers": 2,
    "moe_layer_freq": "([0]*1+[1]*1)",
}


def _validated(config):
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:  # --deterministic-mode turns on torch's deterministic algorithms in this process
        return validate_args(parse_args(argv=argv_of(config)))
    finally:
        torch.use_deterministic_algorithms(deterministic)


def test_deepseek_unsharded_proxy_runs_all_but_fp8_and_trains_shrunk(tmp_path, monkeypatch):
    """moe/deepseek_proxy_unsharded_1node (MLA with q LoRA, a dense then a MoE layer with a
    shared expert, sigmoid router with expert bias, group-limited top-k, the sequence aux loss,
    deterministic mode): only its fp8 flags (Transformer Engine kernels, GPU-only) are
    refused; without them it trains, shrunk, in one process."""
    from megatron.training.arguments import ArgumentValidationError

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(
        ArgumentValidationError,
        match=r"^not supported yet: --fp8-format e4m3 \(fp8/fp4 training needs Transformer "
        r"Engine.*; --fp8-recipe tensorwise \(fp8/fp4 training needs Transformer Engine[^;]*$",
    ):
        _validated(DEEPSEEK_UNSHARDED)
    config = {k: v for k, v in DEEPSEEK_UNSHARDED.items() if not k.startswith("fp8")}
    shrunk = {
        **config,
        **SHRUNK,
        "ffn_hidden_size": 128,
        "num_attention_heads": 4,
        "kv_channels": 16,
        "moe_ffn_hidden_size": 32,
        "moe_shared_expert_intermediate_size": 32,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_head_dim": 16,
        "qk_pos_emb_head_dim": 8,
        "v_head_dim": 16,
        "logging_level": None,  # 10 (debug): the same run with pages of debug output
        "tensorboard_dir": str(tmp_path / "tb"),
    }
    result = run_pretrain(argv_of(shrunk))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    lines = parse_log_lines(result.stdout)
    assert sorted(lines) == [1, 2, 3]
    assert "seq_load_balancing_loss" in lines[3]["losses"], lines[3]
    assert "not supported yet" not in result.stdout + result.stderr
