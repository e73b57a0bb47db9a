"""Tests of megatron/training/arguments.py: flag defaults, derived values, validation rules,
refused flags (the flag policy table; its own tests are in test_flag_policy.py), print_args and
--help.

Expected defaults are the literal values of Megatron-LM's argument parser, written out here
rather than read back from our parser.
"""

import argparse
import re
import signal

import pytest
import torch

from megatron.core.transformer.enums import AttnBackend
from megatron.training.arguments import (
    ArgumentValidationError,
    add_tokenizer_args,
    parse_and_validate_args,
    parse_args,
    print_args,
    validate_args,
)
from megatron.training.flags.types import layer_pattern_type
from tests.unit_tests.tiny_configs import tiny_argv

# A small model that passes every rule and uses no unimplemented feature: tiny_argv().
make_argv = tiny_argv


@pytest.fixture(autouse=True)
def single_process_env(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)


def run(*extra, world_size=1, drop=(), defaults=None):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WORLD_SIZE", str(world_size))
        return validate_args(parse_args(argv=make_argv(*extra, drop=drop)), defaults)


def error_of(*extra, world_size=1, drop=()):
    with pytest.raises(ArgumentValidationError) as info:
        run(*extra, world_size=world_size, drop=drop)
    return str(info.value)


# ------------------------------------------------------------------ defaults (parse only)
DEFAULTS = {
    # network size
    "num_layers": None,
    "hidden_size": None,
    "ffn_hidden_size": None,
    "kv_channels": None,
    "num_attention_heads": None,
    "group_query_attention": False,
    "num_query_groups": 1,
    "max_position_embeddings": None,
    "position_embedding_type": "learned_absolute",
    "rotary_base": 10000,
    "rotary_percent": 1.0,
    "rotary_interleaved": False,
    "use_rope_scaling": False,
    "rope_scaling_factor": 8.0,
    "make_vocab_size_divisible_by": 128,
    "normalization": "LayerNorm",
    "layernorm_epsilon": 1e-5,
    "layernorm_zero_centered_gamma": False,
    "swiglu": False,
    "squared_relu": False,
    "untie_embeddings_and_output_weights": False,
    "add_position_embedding": True,
    "bert_binary_head": True,
    "qk_layernorm": False,
    "add_bias_linear": True,
    "add_qkv_bias": False,
    "attention_backend": AttnBackend.auto,
    "transformer_impl": "transformer_engine",
    "mtp_num_layers": None,
    "spec": None,
    "use_cpu_initialization": None,
    "perform_initialization": True,
    # fusions
    "masked_softmax_fusion": True,
    "bias_gelu_fusion": True,
    "bias_swiglu_fusion": True,
    "bias_dropout_fusion": True,
    "apply_rope_fusion": True,
    "gradient_accumulation_fusion": True,
    "no_persist_layer_norm": False,
    "cross_entropy_loss_fusion": False,
    "cross_entropy_fusion_impl": "native",
    "calculate_per_token_loss": False,
    # regularization / optimizer
    "attention_dropout": 0.1,
    "hidden_dropout": 0.1,
    "weight_decay": 0.01,
    "start_weight_decay": None,
    "end_weight_decay": None,
    "weight_decay_incr_style": "constant",
    "clip_grad": 1.0,
    "adam_beta1": 0.9,
    "adam_beta2": 0.999,
    "adam_eps": 1e-8,
    "sgd_momentum": 0.9,
    "optimizer": "adam",
    "optimizer_cpu_offload": False,
    "use_precision_aware_optimizer": False,
    "main_grads_dtype": "fp32",
    "exp_avg_dtype": "fp32",
    # training
    "micro_batch_size": None,
    "global_batch_size": None,
    "rampup_batch_size": None,
    "step_batch_size_schedule": None,
    "train_iters": None,
    "train_samples": None,
    "exit_interval": None,
    "exit_duration_in_mins": None,
    "exit_signal_handler": False,
    "exit_signal": signal.SIGTERM,
    "recompute_activations": False,
    "recompute_granularity": None,
    "recompute_method": None,
    "recompute_num_layers": None,
    "recompute_modules": None,
    "dataloader_type": None,
    "empty_unused_memory_level": 0,
    "manual_gc": False,
    "manual_gc_interval": 0,
    "check_for_nan_in_loss_and_grad": True,
    "check_for_spiky_loss": False,
    "profile": False,
    "profile_step_start": 10,
    "profile_step_end": 12,
    "profile_ranks": [],
    "deterministic_mode": False,
    "rerun_mode": "validate_results",
    "cuda_graph_impl": "none",
    "sequence_parallel": False,
    # initialization
    "seed": 1234,
    "data_parallel_random_init": False,
    "init_method_std": 0.02,
    "init_method_xavier_uniform": False,
    "te_rng_tracker": False,
    # learning rate
    "lr": None,
    "min_lr": 0.0,
    "lr_decay_style": "linear",
    "lr_decay_iters": None,
    "lr_decay_samples": None,
    "lr_warmup_fraction": None,
    "lr_warmup_iters": 0,
    "lr_warmup_samples": 0,
    "lr_warmup_init": 0.0,
    "lr_wsd_decay_style": "exponential",
    "decoupled_lr": None,
    "decoupled_min_lr": None,
    "override_opt_param_scheduler": False,
    "use_checkpoint_opt_param_scheduler": False,
    # checkpointing
    "save": None,
    "load": None,
    "save_interval": None,
    "save_retain_interval": None,
    "no_save_optim": None,
    "no_save_rng": None,
    "no_load_optim": None,
    "no_load_rng": None,
    "finetune": False,
    "pretrained_checkpoint": None,
    "ckpt_step": None,
    "use_checkpoint_args": False,
    "exit_on_missing_checkpoint": False,
    "ckpt_format": "torch_dist",
    "auto_detect_ckpt_format": False,
    "ckpt_convert_format": None,
    "async_save": False,
    "dist_ckpt_strictness": "assume_ok_unexpected",
    "ckpt_fully_parallel_save": True,
    "non_persistent_ckpt_type": None,
    # mixed precision
    "fp16": False,
    "bf16": False,
    "loss_scale": None,
    "initial_loss_scale": 4294967296,
    "min_loss_scale": 1.0,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "accumulate_allreduce_grads_in_fp32": False,
    "grad_reduce_in_bf16": False,
    "fp16_lm_cross_entropy": False,
    "fp8": None,
    "fp8_recipe": "delayed",
    "fp8_amax_history_len": 1,
    "fp8_amax_compute_algo": "most_recent",
    "fp8_param_gather": False,
    # distributed
    "tensor_model_parallel_size": 1,
    "pipeline_model_parallel_size": 1,
    "context_parallel_size": 1,
    "cp_comm_type": ["p2p"],
    "hierarchical_context_parallel_sizes": None,
    "expert_model_parallel_size": 1,
    "expert_tensor_parallel_size": None,
    "num_layers_per_virtual_pipeline_stage": None,
    "microbatch_group_size_per_vp_stage": None,
    "overlap_p2p_comm": True,
    "distributed_backend": "nccl",
    "distributed_timeout_minutes": 10,
    "local_rank": 0,
    "use_distributed_optimizer": False,
    "overlap_grad_reduce": False,
    "overlap_param_gather": False,
    "ddp_bucket_size": None,
    "data_parallel_sharding_strategy": "optim_grads_params",
    "use_torch_fsdp2": False,
    "use_tp_pp_dp_mapping": False,
    "use_gloo_process_groups": True,
    # validation
    "eval_iters": 100,
    "eval_interval": None,
    "skip_train": False,
    "full_validation": False,
    # data
    "data_path": None,
    "split": None,
    "train_data_path": None,
    "data_cache_path": None,
    "mmap_bin_files": True,
    "mock_data": False,
    "seq_length": None,
    "mask_prob": 0.15,
    "short_seq_prob": 0.1,
    "num_workers": 2,
    "reset_position_ids": False,
    "reset_attention_mask": False,
    "eod_mask_loss": False,
    "create_attention_mask_in_dataloader": True,
    "num_dataset_builder_threads": 1,
    "mid_level_dataset_surplus": 0.005,
    "fim_data": False,
    "fim_rate": 0.5,
    "fim_spm_rate": 0.5,
    # tokenizer
    "tokenizer_type": None,
    "vocab_file": None,
    "merge_file": None,
    "tokenizer_model": None,
    "vocab_size": None,
    "padded_vocab_size": None,
    "vocab_extra_ids": 0,
    "tiktoken_pattern": None,
    "tiktoken_num_special_tokens": 1000,
    "null_tokenizer_eod_id": None,
    "null_tokenizer_pad_id": -1,
    "trust_remote_code": False,
    # moe / mla
    "num_experts": None,
    "moe_layer_freq": 1,
    "moe_ffn_hidden_size": None,
    "moe_router_topk": 2,
    "moe_router_load_balancing_type": "aux_loss",
    "moe_aux_loss_coeff": 0.0,
    "moe_router_score_function": "softmax",
    "moe_router_bias_update_rate": 1e-3,
    "moe_token_dispatcher_type": "allgather",
    "moe_token_drop_policy": "probs",
    "moe_expert_capacity_factor": None,
    "multi_latent_attention": False,
    "q_lora_rank": None,
    "kv_lora_rank": 32,
    "qk_head_dim": 128,
    "qk_pos_emb_head_dim": 64,
    "v_head_dim": 128,
    # logging
    "log_interval": 100,
    "log_params_norm": False,
    "log_num_zeros_in_grad": False,
    "log_throughput": False,
    "timing_log_level": 0,
    "timing_log_option": "minmax",
    "tensorboard_dir": None,
    "tensorboard_log_interval": 1,
    "log_timers_to_tensorboard": False,
    "log_loss_scale_to_tensorboard": True,
    "log_memory_interval": None,
    "wandb_project": None,
    "wandb_exp_name": None,
    "wandb_save_dir": None,
    "wandb_entity": None,
    # inference / misc / vision
    "inference_max_seq_length": 2560,
    "inference_max_requests": 8,
    "max_tokens_to_oom": 12000,
    "yaml_cfg": None,
    "adlr_autoresume": False,
    "img_h": 224,
    "img_w": 224,
    "patch_dim": 16,
}


def test_defaults_match_megatron():
    args = parse_args(argv=[])
    wrong = {
        dest: (getattr(args, dest, "<missing>"), expected)
        for dest, expected in DEFAULTS.items()
        if getattr(args, dest, "<missing>") != expected
        or type(getattr(args, dest, None)) is not type(expected)
    }
    assert not wrong, wrong


def test_rank_world_size_and_local_rank_from_env(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "5")
    args = parse_args(argv=[])
    assert (args.rank, args.world_size, args.local_rank) == (3, 8, 5)
    assert parse_args(argv=["--local_rank", "2"]).local_rank == 2
    assert parse_args(argv=["--local-rank", "1"]).local_rank == 1


def test_flag_spellings_and_dests():
    args = parse_args(
        argv=[
            "--persistent-save-interval",
            "7",
            "--no-save-optim",
            "--fp8-format",
            "hybrid",
            "--disable-bias-linear",
            "--no-rope-fusion",
            "--override-opt_param-scheduler",
            "--use-checkpoint-opt-param-scheduler",
            "--inference-max-requests",
            "4",
            "--microbatch-group-size-per-virtual-pipeline-stage",
            "3",
            "--use-nccl-ub",
            "--data-path",
            "0.3",
            "a",
            "0.7",
            "b",
            "--rampup-batch-size",
            "16",
            "8",
            "300",
            "--moe-router-load-balancing-type",
            "aux_loss",
            "sinkhorn",
            "--moe-aux-loss-coeff",
            "0.01",
            "--moe-layer-freq",
            "([1]*2+[0])*2",
            "--no-create-attention-mask-in-dataloader",
        ]
    )
    assert args.save_interval == 7 and args.no_save_optim is True
    assert args.fp8 == "hybrid"
    assert args.add_bias_linear is False and args.apply_rope_fusion is False
    assert args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler
    assert args.inference_max_requests == 4 and args.microbatch_group_size_per_vp_stage == 3
    assert args.nccl_ub is True
    assert args.data_path == ["0.3", "a", "0.7", "b"]
    assert args.rampup_batch_size == [16, 8, 300]  # Megatron's: type=int, nargs=3
    assert args.moe_router_load_balancing_type == ["aux_loss", "sinkhorn"]
    assert args.moe_aux_loss_coeff == [0.01]
    assert args.moe_layer_freq == [1, 1, 0, 1, 1, 0]
    assert args.create_attention_mask_in_dataloader is False


# ------------------------------------------------------------------ parsing failures
@pytest.mark.parametrize(
    "argv", [["--no-such-flag"], ["--num-lay", "2"], ["--position-embedding-type", "alibi"]]
)
def test_unknown_or_invalid_flag_exits_2(argv, capsys):
    with pytest.raises(SystemExit, match="^2$"):
        parse_args(argv=argv)
    assert "error:" in capsys.readouterr().err


def test_ignore_unknown_args():
    args = parse_args(argv=["--no-such-flag", "--seed", "7"], ignore_unknown_args=True)
    assert args.seed == 7


@pytest.mark.parametrize(
    "argv, hint",
    [
        (["--data-impl", "mmap"], ".bin/.idx"),
        (["--use-legacy-models"], "legacy"),
        (["--no-query-key-layer-scaling"], "--apply-query-key-layer-scaling"),
        (["--tokenizer-type", "Llama3Tokenizer"], "HuggingFaceTokenizer"),
    ],
)
def test_removed_flags_fail_with_a_hint(argv, hint, capsys):
    with pytest.raises(SystemExit, match="^2$"):
        parse_args(argv=argv, ignore_unknown_args=True)
    err = capsys.readouterr().err
    assert argv[0] in err and "no longer supported" in err and hint in err


@pytest.mark.parametrize(
    "argv, hint",
    [
        (["--checkpoint-activations"], "--recompute-activations"),
        (["--batch-size", "8"], "--micro-batch-size"),
        (["--warmup", "10"], "--lr-warmup-fraction"),
        (["--model-parallel-size", "2"], "--tensor-model-parallel-size"),
    ],
)
def test_flags_megatron_parses_but_refuses_end_with_their_hint(argv, hint, capsys):
    """Megatron still parses these and asserts they are unset: one error line, exit 2."""
    with pytest.raises(SystemExit, match="^2$"):
        parse_and_validate_args(argv=make_argv(*argv))
    err = capsys.readouterr().err
    assert err.startswith(f"error: {argv[0]} is no longer supported: ") and hint in err


def test_layer_pattern_type_rejects_code():
    assert layer_pattern_type("3") == 3
    assert layer_pattern_type("[1,0]*2") == [1, 0, 1, 0]
    for bad in ("__import__('os')", "[1]*9**9", "[1, 2.5]", "abc"):
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(repr(bad))):
            layer_pattern_type(bad)


def test_help_lists_groups(capsys):
    with pytest.raises(SystemExit, match="^0$"):
        parse_args(argv=["--help"])
    out = capsys.readouterr().out
    assert "Megatron-LM Arguments" in out
    for title in (
        "network size:",
        "regularization:",
        "training:",
        "initialization:",
        "learning rate:",
        "checkpointing:",
        "mixed precision:",
        "distributed:",
        "validation:",
        "data and dataloader:",
        "tokenizer:",
        "moe:",
        "mla:",
        "logging:",
        "inference:",
        "Transformer-Engine:",
        "experimental:",
    ):
        assert f"\n{title}\n" in out, title
    assert "--use-legacy-models" not in out  # removed flags are hidden


def test_tokenizer_group_is_reusable():
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--input")
    parser = add_tokenizer_args(parser)
    args = parser.parse_args(
        [
            "--input",
            "x.jsonl",
            "--tokenizer-type",
            "GPT2BPETokenizer",
            "--vocab-file",
            "v.json",
            "--merge-file",
            "m.txt",
        ]
    )
    assert (args.tokenizer_type, args.vocab_file, args.merge_file) == (
        "GPT2BPETokenizer",
        "v.json",
        "m.txt",
    )
    assert args.vocab_extra_ids == 0 and args.tokenizer_model is None


def test_extra_args_provider():
    def extra(parser):
        parser.add_argument_group(title="mine").add_argument("--my-flag", type=int, default=3)
        return parser

    assert parse_args(extra, argv=["--my-flag", "5"]).my_flag == 5


# ------------------------------------------------------------------ derived values
def test_base_config_validates_with_derived_values(capsys):
    args = run()
    assert args.ffn_hidden_size == 256  # 4 * 64
    assert args.kv_channels == 16  # 64 // 4
    assert args.num_query_groups == 4  # no GQA: one group per head
    assert args.global_batch_size == 2 and args.data_parallel_size == 1
    assert args.params_dtype == torch.float32
    assert args.dataloader_type == "single"
    assert (args.consumed_train_samples, args.consumed_valid_samples) == (0, 0)
    assert args.encoder_num_layers == 4 and args.encoder_seq_length == 128
    assert args.start_weight_decay == args.end_weight_decay == 0.01
    assert args.add_qkv_bias is True  # biases on => QKV bias on
    assert args.apply_rope_fusion is False  # learned_absolute positions
    assert args.expert_tensor_parallel_size == 1
    assert args.virtual_pipeline_model_parallel_size is None
    assert not hasattr(args, "recompute_activations")
    assert args.transformer_impl == "local"
    assert "--transformer-impl transformer_engine" in args.no_effect_note
    out = capsys.readouterr().out
    assert (
        "using world size: 1, data-parallel size: 1, context-parallel size: 1, hierarchical "
        "context-parallel sizes: None, tensor-model-parallel size: 1, "
        "pipeline-model-parallel size: 1"
    ) in out
    assert "setting global batch size to 2" in out


@pytest.mark.parametrize(
    "hidden, heads, swiglu, ffn",
    [
        (64, 4, False, 256),
        (64, 4, True, 128),
        (4096, 32, True, 10880),
        (4096, 32, False, 16384),
        (1536, 12, True, 4096),
    ],
)
def test_ffn_hidden_size_default(hidden, heads, swiglu, ffn):
    extra = ["--hidden-size", hidden, "--num-attention-heads", heads] + (["--swiglu"] * swiglu)
    assert run(*extra).ffn_hidden_size == ffn
    assert int((4 * hidden * 2 / 3) / 64) * 64 == ffn or not swiglu


def test_explicit_ffn_kv_and_gqa_are_kept():
    args = run(
        "--ffn-hidden-size",
        100,
        "--kv-channels",
        32,
        "--group-query-attention",
        "--num-query-groups",
        2,
    )
    assert (args.ffn_hidden_size, args.kv_channels, args.num_query_groups) == (100, 32, 2)


def test_global_batch_size_and_data_parallel_size(capsys):
    args = run(world_size=4)
    assert args.data_parallel_size == 4 and args.global_batch_size == 8
    assert "setting global batch size to 8" in capsys.readouterr().out
    args = run("--global-batch-size", 32, world_size=4)
    assert args.global_batch_size == 32


def test_parallel_sizes_derive_data_parallel_size(capsys):
    args = run(
        "--tensor-model-parallel-size",
        2,
        "--pipeline-model-parallel-size",
        2,
        "--context-parallel-size",
        2,
        world_size=16,
    )
    assert args.data_parallel_size == 2
    assert args.expert_tensor_parallel_size == 2  # defaults to TP
    assert (
        "using world size: 16, data-parallel size: 2, context-parallel size: 2, "
        "hierarchical context-parallel sizes: None, tensor-model-parallel size: 2, "
        "pipeline-model-parallel size: 2"
    ) in capsys.readouterr().out


def test_virtual_pipeline_size():
    args = run(
        "--num-layers",
        8,
        "--pipeline-model-parallel-size",
        2,
        "--num-layers-per-virtual-pipeline-stage",
        2,
        "--micro-batch-size",
        1,
        "--global-batch-size",
        2,
        world_size=2,
    )
    assert args.virtual_pipeline_model_parallel_size == 2
    args = run(
        "--num-layers",
        8,
        "--pipeline-model-parallel-size",
        2,
        "--num-layers-per-virtual-pipeline-stage",
        4,
        world_size=2,
    )
    assert args.virtual_pipeline_model_parallel_size is None  # one stage per rank
    assert args.overlap_p2p_comm is False and args.align_param_gather is False


@pytest.mark.parametrize(
    "extra, dtype",
    [((), torch.float32), (("--fp16",), torch.float16), (("--bf16",), torch.bfloat16)],
)
def test_params_dtype(extra, dtype):
    assert run(*extra).params_dtype == dtype


def test_bf16_accumulates_in_fp32_and_fp16_dynamic_scaling_skips_nan_check():
    args = run("--bf16")
    assert args.accumulate_allreduce_grads_in_fp32 is True
    assert args.check_for_nan_in_loss_and_grad is True
    args = run("--fp16")
    assert args.accumulate_allreduce_grads_in_fp32 is False
    assert args.check_for_nan_in_loss_and_grad is False  # dynamic scaling expects infs
    assert run("--fp16", "--loss-scale", 1024).check_for_nan_in_loss_and_grad is True


def test_grad_reduce_in_bf16_turns_off_fp32_accumulation():
    assert run("--bf16", "--grad-reduce-in-bf16").accumulate_allreduce_grads_in_fp32 is False


def test_sequence_parallel_without_tp_is_disabled_with_warning(capsys):
    args = run("--sequence-parallel")
    assert args.sequence_parallel is False
    assert "WARNING" in capsys.readouterr().out


def test_deprecated_position_flags():
    assert run("--use-rotary-position-embeddings").position_embedding_type == "rope"
    args = run("--use-rotary-position-embeddings")
    assert args.apply_rope_fusion is True
    assert run("--no-position-embedding").position_embedding_type == "none"
    assert (
        run("--position-embedding-type", "rope", "--no-position-embedding").position_embedding_type
        == "rope"
    )


def test_use_flash_attn_selects_the_flash_backend_unless_one_is_given():
    assert run().attention_backend is AttnBackend.auto
    assert run("--use-flash-attn").attention_backend is AttnBackend.flash
    assert (
        run("--use-flash-attn", "--attention-backend", "fused").attention_backend
        is AttnBackend.fused
    )


def test_bias_flags():
    args = run("--disable-bias-linear")
    assert args.add_qkv_bias is False and args.bias_gelu_fusion is False
    assert run("--disable-bias-linear", "--add-qkv-bias").add_qkv_bias is True


def test_defaults_applied_only_when_unset(capsys):
    args = run(
        "--vocab-file",
        "v.json",
        "--merge-file",
        "m.txt",
        drop=("--tokenizer-type", "--vocab-size"),
        defaults={"tokenizer_type": "GPT2BPETokenizer"},
    )
    assert args.tokenizer_type == "GPT2BPETokenizer"
    args = run(defaults={"tokenizer_type": "GPT2BPETokenizer"})
    assert args.tokenizer_type == "NullTokenizer"
    assert "overriding default arguments for tokenizer_type" in capsys.readouterr().out


def test_split_default_and_encoder_aliases(capsys):
    args = run("--data-path", "corpus", drop=("--mock-data",))
    assert args.split == "969, 30, 1"
    assert "--split" in capsys.readouterr().out
    args = run(
        "--encoder-num-layers", 6, "--encoder-seq-length", 64, drop=("--num-layers", "--seq-length")
    )
    assert (args.num_layers, args.seq_length) == (6, 64)


def test_deterministic_mode_turns_on_torch_determinism(monkeypatch):
    calls = []  # recorded instead of applied: the real call is global and slow (~2 s)
    monkeypatch.setattr(torch, "use_deterministic_algorithms", calls.append)
    run()
    assert calls == []
    run("--deterministic-mode")
    assert calls == [True]


def test_recompute_and_exit_signal_and_eval_batch():
    import signal

    args = run("--recompute-activations")
    assert args.recompute_granularity == "selective"
    args = run(
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "block",
        "--recompute-num-layers",
        0,
        "--exit-signal",
        "SIGUSR1",
        "--eval-global-batch-size",
        8,
        "--eval-micro-batch-size",
        4,
    )
    assert args.recompute_method == "block" and args.exit_signal == signal.SIGUSR1
    assert run().exit_signal == signal.SIGTERM


def test_validate_args_is_idempotent():
    args = run("--bf16", "--recompute-activations", "--swiglu")
    before = dict(vars(args))
    assert vars(validate_args(args)) == before


def test_skip_train_needs_no_train_iters():
    assert run("--skip-train", drop=("--train-iters",)).train_iters is None


# ------------------------------------------------------------------ validation rules
RULES = [
    ("fp16_bf16", ["--fp16", "--bf16"], 1, ["--fp16 and --bf16 are mutually exclusive"]),
    (
        "world_size",
        ["--tensor-model-parallel-size", 4],
        6,
        [
            "world size (6) is not divisible by tensor-model-parallel size (4) x "
            "pipeline-model-parallel size (1) x context-parallel size (1) = 4"
        ],
    ),
    (
        "gbs_divisible",
        ["--global-batch-size", 6],
        2,
        [
            "--global-batch-size (6) is not divisible by --micro-batch-size (2) x data-parallel "
            "size (2) = 4"
        ],
    ),
    (
        "iters_and_samples",
        ["--train-samples", 100],
        1,
        ["--train-iters and --train-samples are mutually exclusive"],
    ),
    (
        "decay_samples_in_iter_mode",
        ["--lr-decay-samples", 100],
        1,
        ["--lr-decay-samples (100)", "--train-iters", "use --lr-decay-iters"],
    ),
    (
        "warmup_samples_in_iter_mode",
        ["--lr-warmup-samples", 5],
        1,
        ["--lr-warmup-samples (5)", "--train-iters"],
    ),
    (
        "warmup_fraction_and_iters",
        ["--lr-warmup-fraction", 0.1, "--lr-warmup-iters", 2],
        1,
        ["--lr-warmup-fraction and --lr-warmup-iters are mutually exclusive"],
    ),
    (
        "warmup_not_shorter_than_decay",
        ["--lr-warmup-iters", 10],
        1,
        ["--lr-warmup-iters (10)", "--train-iters (10)"],
    ),
    ("min_lr", ["--min-lr", 0.1], 1, ["--min-lr (0.1) must be <= --lr (0.001)"]),
    ("wsd_needs_anneal_length", ["--lr-decay-style", "WSD"], 1, ["--lr-wsd-decay-iters"]),
    (
        "save_needs_interval",
        ["--save", "/tmp/ckpt", "--ckpt-format", "torch"],
        1,
        ["--save needs --save-interval > 0 (got None)"],
    ),
    (
        "save_interval_positive",
        ["--save", "/tmp/ckpt", "--persistent-save-interval", 0],
        1,
        ["--save needs --save-interval > 0 (got 0)"],
    ),
    (
        "retain_multiple",
        ["--save-interval", 10, "--save-retain-interval", 15],
        1,
        ["--save-retain-interval (15) must be a multiple of --save-interval (10)"],
    ),
    (
        "memory_interval",
        ["--log-interval", 10, "--log-memory-interval", 15],
        1,
        ["--log-memory-interval (15)", "--log-interval (10)"],
    ),
    (
        "max_positions",
        ["--seq-length", 512],
        1,
        ["--max-position-embeddings (256) must be >= --seq-length (512)"],
    ),
    (
        "heads_tp",
        ["--tensor-model-parallel-size", 3],
        3,
        ["--num-attention-heads (4) is not divisible by --tensor-model-parallel-size (3)"],
    ),
    (
        "heads_groups",
        ["--group-query-attention", "--num-query-groups", 3],
        1,
        ["--num-attention-heads (4) is not divisible by --num-query-groups (3)"],
    ),
    (
        "groups_tp",
        [
            "--num-attention-heads",
            12,
            "--hidden-size",
            96,
            "--group-query-attention",
            "--num-query-groups",
            3,
            "--tensor-model-parallel-size",
            2,
        ],
        2,
        ["--num-query-groups (3) must be a multiple of --tensor-model-parallel-size (2)"],
    ),
    (
        "hidden_heads",
        ["--hidden-size", 66],
        1,
        ["--hidden-size (66) is not divisible by --num-attention-heads (4)"],
    ),
    (
        "pipeline_layers",
        ["--pipeline-model-parallel-size", 3],
        3,
        [
            "number of layers (--num-layers 4 = 4) is not divisible by "
            "--pipeline-model-parallel-size (3)"
        ],
    ),
    (
        "pipeline_embedding",
        ["--pipeline-model-parallel-size", 2, "--account-for-embedding-in-pipeline-split"],
        2,
        ["--account-for-embedding-in-pipeline-split) = 5", "--pipeline-model-parallel-size (2)"],
    ),
    (
        "pipeline_uneven",
        ["--pipeline-model-parallel-size", 3, "--decoder-first-pipeline-num-layers", 1],
        3,
        ["--num-layers (4) minus the first/last stage layers"],
    ),
    (
        "vpp_layers",
        ["--pipeline-model-parallel-size", 2, "--num-layers-per-virtual-pipeline-stage", 3],
        2,
        [
            "layers per pipeline stage (2) are not divisible by "
            "--num-layers-per-virtual-pipeline-stage (3)"
        ],
    ),
    (
        "vpp_needs_pp",
        ["--num-virtual-stages-per-pipeline-rank", 2],
        1,
        ["--pipeline-model-parallel-size > 1 (got 1)"],
    ),
    (
        "vpp_no_overlap_needs_pp3",
        [
            "--pipeline-model-parallel-size",
            2,
            "--num-virtual-stages-per-pipeline-rank",
            2,
            "--no-overlap-p2p-communication",
        ],
        2,
        ["--no-overlap-p2p-communication", "--pipeline-model-parallel-size > 2 (got 2)"],
    ),
    (
        "vpp_flags_exclusive",
        ["--num-layers-per-virtual-pipeline-stage", 1, "--num-virtual-stages-per-pipeline-rank", 2],
        1,
        [
            "--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank "
            "are mutually exclusive"
        ],
    ),
    ("tp_comm_overlap", ["--tp-comm-overlap"], 1, ["--tp-comm-overlap needs --sequence-parallel"]),
    (
        "cp_seq_length",
        ["--context-parallel-size", 2, "--seq-length", 126],
        2,
        ["--seq-length (126) must be a multiple of 2 x --context-parallel-size (2) = 4"],
    ),
    (
        "cp_hierarchical",
        ["--context-parallel-size", 2, "--hierarchical-context-parallel-sizes", 2, 2],
        2,
        ["--hierarchical-context-parallel-sizes", "multiply to 4"],
    ),
    (
        "cp_a2a_p2p",
        ["--context-parallel-size", 2, "--cp-comm-type", "a2a+p2p"],
        2,
        ["--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes"],
    ),
    (
        "param_gather_needs_dist_opt",
        ["--overlap-param-gather", "--overlap-grad-reduce"],
        1,
        ["--overlap-param-gather needs --use-distributed-optimizer"],
    ),
    (
        "param_gather_needs_grad_overlap",
        ["--overlap-param-gather", "--use-distributed-optimizer"],
        1,
        ["--overlap-param-gather needs --overlap-grad-reduce"],
    ),
    (
        "fsdp2_dist_opt",
        [
            "--use-torch-fsdp2",
            "--no-gradient-accumulation-fusion",
            "--untie-embeddings-and-output-weights",
            "--use-distributed-optimizer",
        ],
        1,
        ["--use-torch-fsdp2 does not support --use-distributed-optimizer"],
    ),
    (
        "fsdp2_grad_fusion",
        ["--use-torch-fsdp2", "--untie-embeddings-and-output-weights"],
        1,
        ["--use-torch-fsdp2", "--no-gradient-accumulation-fusion"],
    ),
    (
        "megatron_fsdp_ckpt",
        ["--use-megatron-fsdp"],
        1,
        ["--use-megatron-fsdp needs --ckpt-format fsdp_dtensor (got torch_dist)"],
    ),
    (
        "selective_with_method",
        ["--recompute-activations", "--recompute-method", "uniform"],
        1,
        ["--recompute-method uniform cannot be used with --recompute-granularity selective"],
    ),
    (
        "selective_with_num_layers",
        ["--recompute-granularity", "selective", "--recompute-num-layers", 2],
        1,
        ["--recompute-num-layers 2 cannot be used with --recompute-granularity selective"],
    ),
    (
        "full_needs_method",
        ["--recompute-granularity", "full"],
        1,
        ["--recompute-granularity full needs --recompute-method"],
    ),
    (
        "full_needs_num_layers",
        ["--recompute-granularity", "full", "--recompute-method", "block"],
        1,
        ["--recompute-granularity full needs --recompute-num-layers"],
    ),
    (
        "uniform_num_layers_range",
        [
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "uniform",
            "--recompute-num-layers",
            0,
        ],
        1,
        ["--recompute-num-layers (0) must be in [1, 4] with --recompute-method uniform"],
    ),
    (
        "method_needs_full",
        ["--recompute-method", "block"],
        1,
        ["--recompute-method/--recompute-num-layers need --recompute-granularity full"],
    ),
    (
        "eval_batch_sizes",
        ["--eval-global-batch-size", 6, "--eval-micro-batch-size", 4],
        1,
        ["evaluation global batch size (6) is not divisible by evaluation micro batch size (4)"],
    ),
    (
        "distribute_saved",
        ["--distribute-saved-activations"],
        1,
        ["--distribute-saved-activations needs --tensor-model-parallel-size > 1"],
    ),
    (
        "ep_needs_experts",
        ["--expert-model-parallel-size", 2],
        2,
        ["--expert-model-parallel-size 2 needs --num-experts"],
    ),
    (
        "experts_ep",
        ["--num-experts", 3, "--expert-model-parallel-size", 2],
        2,
        ["--num-experts (3) is not divisible by --expert-model-parallel-size (2)"],
    ),
    (
        "rampup_needs_samples",
        ["--rampup-batch-size", 2, 2, 100],
        1,
        ["--rampup-batch-size needs sample-based training", "--train-samples"],
    ),
    (
        "step_schedule_and_gbs",
        ["--step-batch-size-schedule", "0:16", "--global-batch-size", 16],
        1,
        ["--step-batch-size-schedule and --global-batch-size are mutually exclusive"],
    ),
    ("fp16_lm_ce", ["--fp16-lm-cross-entropy"], 1, ["--fp16-lm-cross-entropy needs --fp16"]),
    (
        "fp32_residual",
        ["--fp32-residual-connection"],
        1,
        ["--fp32-residual-connection needs --fp16 or --bf16"],
    ),
    (
        "wd_incr_needs_ends",
        ["--weight-decay-incr-style", "linear"],
        1,
        ["--weight-decay-incr-style linear needs --start-weight-decay and --end-weight-decay"],
    ),
    (
        "wd_constant_no_ends",
        ["--start-weight-decay", 0.1],
        1,
        ["--start-weight-decay/--end-weight-decay need --weight-decay-incr-style"],
    ),
    (
        "swiglu_squared_relu",
        ["--swiglu", "--squared-relu"],
        1,
        ["--swiglu and --squared-relu are mutually exclusive"],
    ),
    (
        "two_data_sources",
        ["--data-path", "corpus"],
        1,
        ["only one data source can be given, got --mock-data and --data-path"],
    ),
    ("wandb_name", ["--wandb-project", "p"], 1, ["--wandb-project needs --wandb-exp-name"]),
    (
        "cuda_graph_deprecated",
        ["--enable-cuda-graph", "--cuda-graph-impl", "local"],
        1,
        ["--enable-cuda-graph is deprecated and cannot be combined with --cuda-graph-impl local"],
    ),
    (
        "deterministic_flash",
        ["--deterministic-mode", "--use-flash-attn"],
        1,
        ["--deterministic-mode cannot be combined with --use-flash-attn"],
    ),
]


@pytest.mark.parametrize(
    "extra, world_size, fragments", [r[1:] for r in RULES], ids=[r[0] for r in RULES]
)
def test_validation_rule(extra, world_size, fragments):
    message = error_of(*extra, world_size=world_size)
    for fragment in fragments:
        assert fragment in message, message


@pytest.mark.parametrize(
    "drop, extra, fragment",
    [
        (("--micro-batch-size",), (), "--micro-batch-size is required"),
        (("--num-layers",), (), "--num-layers is required"),
        (("--hidden-size",), (), "--hidden-size is required"),
        (("--max-position-embeddings",), (), "--max-position-embeddings is required"),
        (("--seq-length",), (), "--seq-length is required"),
        (("--train-iters",), (), "one of --train-iters or --train-samples is required"),
        (
            ("--train-iters",),
            ("--train-samples", 100, "--lr-decay-iters", 5),
            "--lr-decay-iters (5) cannot be used with --train-samples",
        ),
        (
            ("--train-iters",),
            ("--train-samples", 1000, "--global-batch-size", 16, "--rampup-batch-size", 2, 4, 100),
            "--global-batch-size (16) minus the --rampup-batch-size start (2) is not divisible by "
            "the increment (4)",
        ),
        (("--vocab-size",), (), "--tokenizer-type NullTokenizer needs --vocab-size"),
        (
            ("--tokenizer-type", "--vocab-size"),
            ("--tokenizer-type", "GPT2BPETokenizer"),
            "--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file",
        ),
    ],
)
def test_required_and_mode_rules(drop, extra, fragment):
    assert fragment in error_of(*extra, drop=drop)


def test_rampup_accepted_with_train_samples():
    args = run(
        "--train-samples",
        1000,
        "--global-batch-size",
        16,
        "--rampup-batch-size",
        4,
        4,
        100,
        drop=("--train-iters",),
    )
    assert args.rampup_batch_size == [4, 4, 100] and args.global_batch_size == 16


# ------------------------------------------------------------------ not supported yet
def test_param_gather_overlap_with_optimizer_step_has_no_effect_here():
    args = run(
        "--use-distributed-optimizer",
        "--overlap-grad-reduce",
        "--overlap-param-gather",
        "--overlap-param-gather-with-optimizer-step",
        "--pipeline-model-parallel-size",
        2,
        "--num-layers-per-virtual-pipeline-stage",
        1,
        "--global-batch-size",
        8,
        world_size=2,
    )
    assert "--overlap-param-gather-with-optimizer-step (" in args.no_effect_note


def test_distributed_optimizer_and_overlap_accepted():
    args = run(
        "--use-distributed-optimizer",
        "--overlap-grad-reduce",
        "--overlap-param-gather",
        "--ddp-num-buckets",
        3,
    )
    assert args.use_distributed_optimizer and args.overlap_grad_reduce and args.overlap_param_gather
    assert args.ddp_num_buckets == 3


def test_bucket_count_and_size_exclusive():
    message = error_of("--ddp-num-buckets", 2, "--ddp-bucket-size", 1000)
    assert "--ddp-num-buckets 2" in message and "--ddp-bucket-size 1000" in message


def test_checkpoint_formats(capsys):
    with pytest.raises(SystemExit, match="^2$"):  # zarr left Megatron's choices
        parse_args(argv=make_argv("--ckpt-format", "zarr"))
    assert "invalid choice: 'zarr'" in capsys.readouterr().err
    args = run(
        "--save",
        "/tmp/ckpt",
        "--save-interval",
        5,
        "--ckpt-format",
        "torch",
        "--load",
        "/tmp/ckpt",
        "--finetune",
        "--no-save-optim",
        "--no-load-rng",
    )
    assert args.use_dist_ckpt is False
    args = run(
        "--save",
        "/tmp/ckpt",
        "--save-interval",
        5,
        "--async-save",
        "--save-retain-interval",
        10,
        "--auto-detect-ckpt-format",
        "--dist-ckpt-strictness",
        "log_all",
    )
    assert args.ckpt_format == "torch_dist" and args.use_dist_ckpt is True and args.async_save
    assert error_of("--async-save", "--ckpt-format", "torch") == (
        "not supported yet: --async-save (asynchronous saving needs --ckpt-format torch_dist)"
    )


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--moe-use-upcycling"], "--moe-use-upcycling"),
        (["--yarn-beta-fast", 16], "--yarn-beta-fast 16.0"),
        (["--fp8-format", "hybrid", "--bf16"], "--fp8-format hybrid"),
        (["--optimizer", "lion"], "--optimizer lion"),
        (["--yaml-cfg", "cfg.yaml"], "--yaml-cfg cfg.yaml"),
        (["--position-embedding-type", "yarn"], "--position-embedding-type yarn"),
        (
            ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", "t.json"],
            "--tokenizer-type TikTokenizer",
        ),
        (["--dataloader-type", "external"], "--dataloader-type external"),
        (["--step-batch-size-schedule", "0:16"], "--step-batch-size-schedule 0:16"),
        (["--async-save", "--ckpt-format", "torch"], "--async-save"),
        (["--use-pytorch-profiler"], "--use-pytorch-profiler"),
        (["--record-memory-history"], "--record-memory-history"),
    ],
)
def test_not_supported_features(extra, flag):
    message = error_of(*extra)
    assert message.startswith(f"not supported yet: {flag} ("), message


def test_distributed_optimizer_instances_are_validated_as_megatron_does():
    args = run(
        "--num-distributed-optimizer-instances", 2, "--use-distributed-optimizer", world_size=4
    )
    assert args.num_distributed_optimizer_instances == 2
    from megatron.training.configs import ddp_config_from_args

    assert ddp_config_from_args(args).num_distributed_optimizer_instances == 2
    assert error_of("--num-distributed-optimizer-instances", 2, world_size=4) == (
        "--num-distributed-optimizer-instances > 1 needs --use-distributed-optimizer"
    )
    assert error_of(
        "--num-distributed-optimizer-instances", 3, "--use-distributed-optimizer", world_size=4
    ) == (
        "--num-distributed-optimizer-instances 3 does not divide the data-parallel x "
        "context-parallel size 4"
    )


def test_not_supported_lists_every_offender():
    message = error_of("--async-save", "--ckpt-format", "torch", "--use-pytorch-profiler")
    assert message.count("; ") == 1
    assert "--async-save (" in message and "--use-pytorch-profiler (" in message


def test_transformer_impl_is_never_an_error():
    for impl, note in (
        ("transformer_engine", True),
        ("local", False),
        ("inference_optimized", True),
    ):
        args = run("--transformer-impl", impl)
        assert args.transformer_impl == "local"
        assert (f"--transformer-impl {impl} (" in (args.no_effect_note or "")) == note


# ------------------------------------------------------------------ printing
def test_print_args_format(capsys):
    args = argparse.Namespace(rank=0, zeta=1, Alpha="x", beta_long_name=[1, 2])
    print_args("arguments", args)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "------------------------ arguments ------------------------"
    assert lines[-1] == "-------------------- end of arguments ---------------------"
    body = lines[1:-1]
    assert [line.split()[0] for line in body] == ["Alpha", "beta_long_name", "rank", "zeta"]
    assert body[0] == "  Alpha " + "." * 43 + " x"
    assert body[1] == "  beta_long_name " + "." * 34 + " [1, 2]"
    assert all(line.index(" ", 3 + len(line.split()[0])) == 51 for line in body)


def test_print_args_only_on_rank_0(capsys):
    print_args("arguments", argparse.Namespace(rank=1, a=1))
    assert capsys.readouterr().out == ""


def test_validate_args_leaves_printing_to_the_caller(capsys):
    args = run()
    assert "arguments ----" not in capsys.readouterr().out
    print_args("arguments", args)
    assert "  micro_batch_size " + "." * 32 + " 2\n" in capsys.readouterr().out


# ------------------------------------------------------------------ parse_and_validate_args
def test_parse_and_validate_args_exits_2_with_one_line(capsys):
    with pytest.raises(SystemExit, match="^2$"):
        parse_and_validate_args(argv=make_argv("--fp16", "--bf16"))
    assert capsys.readouterr().err == "error: --fp16 and --bf16 are mutually exclusive\n"


def test_parse_and_validate_args_returns_args():
    args = parse_and_validate_args(
        args_defaults={"tokenizer_type": "GPT2BPETokenizer"}, argv=make_argv()
    )
    assert args.global_batch_size == 2 and args.tokenizer_type == "NullTokenizer"
