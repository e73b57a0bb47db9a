"""Megatron-LM command-line arguments: parse_args, validate_args, print_args.

The flags live in megatron/training/argument_groups/ (one `_add_<x>_args` per argparse
group, registered in Megatron's order below); the cross-flag rules of `validate_args` live in
argument_groups/validation.py. This module holds the public API and the table of flags that
parse but are not implemented yet (NOT_SUPPORTED_YET).
"""

import argparse
import os
import sys

from megatron.training.argument_groups import validation as rules
from megatron.training.argument_groups.data import (
    _add_data_args,
    _add_sft_args,
    _add_tokenizer_args,
    add_tokenizer_args,
)
from megatron.training.argument_groups.misc import (
    _add_autoresume_args,
    _add_experimental_args,
    _add_ft_package_args,
    _add_inference_args,
    _add_logging_args,
    _add_straggler_detector_args,
)
from megatron.training.argument_groups.model import (
    _add_mla_args,
    _add_moe_args,
    _add_network_size_args,
    _add_transformer_engine_args,
    _add_vision_args,
)
from megatron.training.argument_groups.system import (
    _add_checkpointing_args,
    _add_distributed_args,
    _add_mixed_precision_args,
)
from megatron.training.argument_groups.training import (
    _add_initialization_args,
    _add_learning_rate_args,
    _add_regularization_args,
    _add_rerun_machine_args,
    _add_training_args,
    _add_validation_args,
)
from megatron.training.argument_groups.validation import ArgumentValidationError

__all__ = [
    "ArgumentValidationError",
    "NOT_SUPPORTED_YET",
    "add_megatron_arguments",
    "add_tokenizer_args",
    "parse_args",
    "validate_args",
    "print_args",
    "parse_and_validate_args",
]


# --------------------------------------------------------------------------------------
# Flags accepted by the parser whose behaviour is NOT IMPLEMENTED YET in this code base.
# validate_args raises "not supported yet: --flag [value] (reason)" when one of them is set;
# silently ignoring a flag would be worse. Delete an entry when its feature lands.
# dest: (is_unsupported(value, args), flag, reason)
# Performance-only knobs (kernel fusions, bucket sizes, gc, empty_cache) are not listed:
# this code base honours them trivially by computing the same result the plain way.
# --------------------------------------------------------------------------------------
def _on(value, args):
    return bool(value)


def _given(value, args):
    return value is not None


def _above(limit):
    return lambda value, args: value is not None and value > limit


def _one_of(*values):
    return lambda value, args: value in values


def _not_one_of(*values):
    return lambda value, args: value not in values


def _ckpt_format_in_use(value, args):
    return value not in ("torch", "torch_dist") and bool(
        args.save or args.load or args.pretrained_checkpoint
    )


_TE = "needs Transformer Engine, which this code base does not use"
_NYI = "is not implemented yet"

NOT_SUPPORTED_YET = {
    # Parallelism: data, tensor (+sequence) and context parallelism run today.
    "hierarchical_context_parallel_sizes": (
        _given,
        "--hierarchical-context-parallel-sizes",
        f"context parallelism {_NYI}",
    ),
    "expert_model_parallel_size": (
        _above(1),
        "--expert-model-parallel-size",
        f"expert parallelism {_NYI}",
    ),
    "pipeline_model_parallel_layout": (
        _given,
        "--pipeline-model-parallel-layout",
        f"custom pipeline layouts {_NYI}",
    ),
    "num_distributed_optimizer_instances": (
        _above(1),
        "--num-distributed-optimizer-instances",
        f"several distributed-optimizer instances {_NYI}",
    ),
    "overlap_param_gather_with_optimizer_step": (
        _on,
        "--overlap-param-gather-with-optimizer-step",
        f"dispatching the first chunk's param gather inside the optimizer step {_NYI} "
        "(--overlap-param-gather works)",
    ),
    "defer_embedding_wgrad_compute": (
        _on,
        "--defer-embedding-wgrad-compute",
        f"deferred embedding wgrad {_NYI}",
    ),
    "init_model_with_meta_device": (
        _on,
        "--init-model-with-meta-device",
        f"meta-device initialization {_NYI}",
    ),
    "tp_comm_overlap": (_on, "--tp-comm-overlap", _TE),
    "nccl_ub": (_on, "--use-nccl-ub", f"NCCL user buffers {_NYI}"),
    "use_sharp": (_on, "--use-sharp", f"SHARP {_NYI}"),
    "lazy_mpu_init": (_on, "--lazy-mpu-init", f"lazy model-parallel init {_NYI}"),
    # Model features beyond the plain GPT layer.
    "num_experts": (_given, "--num-experts", f"mixture of experts {_NYI}"),
    "multi_latent_attention": (_on, "--multi-latent-attention", f"multi-latent attention {_NYI}"),
    "mtp_num_layers": (_on, "--mtp-num-layers", f"multi-token prediction {_NYI}"),
    "hybrid_layer_pattern": (_given, "--hybrid-layer-pattern", f"hybrid models {_NYI}"),
    "hybrid_override_pattern": (_given, "--hybrid-override-pattern", f"hybrid models {_NYI}"),
    "hybrid_attention_ratio": (_above(0), "--hybrid-attention-ratio", f"hybrid models {_NYI}"),
    "hybrid_mlp_ratio": (_above(0), "--hybrid-mlp-ratio", f"hybrid models {_NYI}"),
    "is_hybrid_model": (_on, "--is-hybrid-model", f"hybrid models {_NYI}"),
    "position_embedding_type": (
        _one_of("yarn", "mrope", "relative"),
        "--position-embedding-type",
        f"this position embedding {_NYI}",
    ),
    "rope_type": (_one_of("yarn"), "--rope-type", f"YaRN {_NYI}"),
    "rotary_seq_len_interpolation_factor": (
        _given,
        "--rotary-seq-len-interpolation-factor",
        f"RoPE position interpolation {_NYI}",
    ),
    "no_rope_freq": (_given, "--no-rope-freq", f"skipping RoPE per layer {_NYI}"),
    "openai_gelu": (_on, "--openai-gelu", f"the OpenAI GeLU variant {_NYI}"),
    "onnx_safe": (_on, "--onnx-safe", f"ONNX export workarounds {_NYI}"),
    "fp32_residual_connection": (_on, "--fp32-residual-connection", f"fp32 residuals {_NYI}"),
    "apply_query_key_layer_scaling": (
        _on,
        "--apply-query-key-layer-scaling",
        f"query-key layer scaling {_NYI}",
    ),
    "attention_softmax_in_fp32": (
        lambda value, args: value and (args.fp16 or args.bf16),
        "--attention-softmax-in-fp32",
        f"an fp32 softmax inside fp16/bf16 attention {_NYI}",
    ),
    "fp16_lm_cross_entropy": (_on, "--fp16-lm-cross-entropy", f"fp16 cross entropy {_NYI}"),
    "embedding_init_method_std": (
        _given,
        "--embedding-init-method-std",
        f"a separate embedding init {_NYI}",
    ),
    "decoder_num_layers": (_given, "--decoder-num-layers", f"encoder-decoder models {_NYI}"),
    "decoder_seq_length": (_given, "--decoder-seq-length", f"encoder-decoder models {_NYI}"),
    "vision_pretraining": (_on, "--vision-pretraining", f"vision models {_NYI}"),
    # Precision and optimizer.
    "fp8": (_given, "--fp8-format", f"fp8 training {_TE}"),
    "fp8_param_gather": (_on, "--fp8-param-gather", f"fp8 parameters {_TE}"),
    "first_last_layers_bf16": (_on, "--first-last-layers-bf16", f"fp8 training {_TE}"),
    "te_rng_tracker": (_on, "--te-rng-tracker", _TE),
    "use_precision_aware_optimizer": (
        _on,
        "--use-precision-aware-optimizer",
        f"the precision-aware optimizer {_NYI}",
    ),
    "optimizer_cpu_offload": (_on, "--optimizer-cpu-offload", f"optimizer CPU offload {_NYI}"),
    "optimizer": (_not_one_of("adam", "sgd"), "--optimizer", "only adam and sgd are implemented"),
    "freeze_all_layers": (_on, "--freeze-all-layers", f"layer freezing {_NYI}"),
    # Memory savers.
    "recompute_modules": (
        lambda value, args: bool(set(value or ()) - {"core_attn", "mlp"}),
        "--recompute-modules",
        "only core_attn and mlp can be recomputed yet",
    ),
    "cpu_offloading_num_layers": (
        _above(0),
        "--cpu-offloading-num-layers",
        f"activation offloading {_NYI}",
    ),
    "cuda_graph_impl": (_not_one_of("none"), "--cuda-graph-impl", f"CUDA graphs {_NYI}"),
    # Checkpointing: torch and torch_dist formats (megatron/training/checkpointing*.py).
    # --use-persistent-ckpt-worker is honoured trivially: async saves run in a thread.
    "ckpt_format": (
        _ckpt_format_in_use,
        "--ckpt-format",
        "checkpoints are written and read in the torch or torch_dist format only",
    ),
    "async_save": (
        lambda value, args: bool(value) and args.ckpt_format != "torch_dist",
        "--async-save",
        "asynchronous saving needs --ckpt-format torch_dist",
    ),
    "ckpt_convert_update_legacy_dist_opt_format": (
        _on,
        "--ckpt-convert-update-legacy-dist-opt-format",
        f"converting legacy distributed-optimizer checkpoints {_NYI}",
    ),
    "non_persistent_save_interval": (
        _given,
        "--non-persistent-save-interval",
        f"non-persistent checkpoints {_NYI}",
    ),
    "non_persistent_ckpt_type": (
        _given,
        "--non-persistent-ckpt-type",
        f"non-persistent checkpoints {_NYI}",
    ),
    "load_main_params_from_ckpt": (
        _on,
        "--load-main-params-from-ckpt",
        f"loading main params only {_NYI}",
    ),
    # Training loop.
    "step_batch_size_schedule": (
        _given,
        "--step-batch-size-schedule",
        f"step batch-size schedules {_NYI}; use --rampup-batch-size",
    ),
    "check_for_spiky_loss": (_on, "--check-for-spiky-loss", f"the spiky-loss check {_NYI}"),
    "rerun_mode": (_one_of("report_stats"), "--rerun-mode", f"the rerun engine {_NYI}"),
    "error_injection_rate": (_above(0), "--error-injection-rate", f"the rerun engine {_NYI}"),
    "profile": (_on, "--profile", f"nsys profiling hooks {_NYI}"),
    "use_pytorch_profiler": (_on, "--use-pytorch-profiler", f"the PyTorch profiler {_NYI}"),
    "record_memory_history": (_on, "--record-memory-history", f"memory history {_NYI}"),
    "dataloader_type": (
        _one_of("external"),
        "--dataloader-type",
        "use --dataloader-type single or cyclic",
    ),
    "test_mode": (_on, "--test-mode", f"real-time tests {_NYI}"),
    "adlr_autoresume": (_on, "--adlr-autoresume", f"ADLR autoresume {_NYI}"),
    "enable_ft_package": (_on, "--enable-ft-package", f"the fault-tolerance package {_NYI}"),
    "enable_experimental": (_on, "--enable-experimental", f"experimental features {_NYI}"),
    "yaml_cfg": (_given, "--yaml-cfg", f"YAML configuration {_NYI}; pass flags"),
    # Data and tokenizers.
    "full_validation": (_on, "--full-validation", f"full validation {_NYI}"),
    "multiple_validation_sets": (
        _on,
        "--multiple-validation-sets",
        f"multiple validation sets {_NYI}",
    ),
    "validation_set_names": (_given, "--validation-set-names", f"multiple validation sets {_NYI}"),
    "dataloader_fast_cache_load": (
        _on,
        "--dataloader-fast-cache-load",
        f"fast index-cache loading {_NYI}",
    ),
    "object_storage_cache_path": (
        _given,
        "--object-storage-cache-path",
        f"object-storage datasets {_NYI}",
    ),
    "fim_data": (_on, "--fim-data", f"fill-in-the-middle data {_NYI}"),
    "sft": (_on, "--sft", f"SFT training {_NYI}"),
    "tokenizer_type": (
        _one_of("TikTokenizer", "MultimodalTokenizer", "NullMultimodalTokenizer", "SFTTokenizer"),
        "--tokenizer-type",
        f"this tokenizer {_NYI}",
    ),
    "tokenizer_special_tokens": (
        _given,
        "--tokenizer-special-tokens",
        f"extra special tokens {_NYI}",
    ),
    "tokenizer_metadata": (_given, "--tokenizer-metadata", f"tokenizer metadata {_NYI}"),
    # Logging.
    "log_progress": (_on, "--log-progress", f"progress.txt {_NYI}"),
    "log_memory_interval": (_given, "--log-memory-interval", f"periodic memory reports {_NYI}"),
    "logging_level": (_given, "--logging-level", f"setting the logging level {_NYI}"),
    "log_straggler": (_on, "--log-straggler", f"straggler detection {_NYI}"),
}


def _shown(flag, value):
    if value is None or isinstance(value, bool):
        return flag
    if isinstance(value, (list, tuple)):
        return f"{flag} {' '.join(str(v) for v in value)}"
    return f"{flag} {value}"


def _reject_not_supported_yet(args):
    problems = [
        f"{_shown(flag, getattr(args, dest))} ({reason})"
        for dest, (is_unsupported, flag, reason) in NOT_SUPPORTED_YET.items()
        if hasattr(args, dest) and is_unsupported(getattr(args, dest), args)
    ]
    if problems:
        raise ArgumentValidationError("not supported yet: " + "; ".join(problems))


# --------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------
_GROUP_FUNCTIONS = (
    _add_network_size_args,
    _add_regularization_args,
    _add_training_args,
    _add_initialization_args,
    _add_learning_rate_args,
    _add_checkpointing_args,
    _add_mixed_precision_args,
    _add_distributed_args,
    _add_validation_args,
    _add_data_args,
    _add_tokenizer_args,
    _add_autoresume_args,
    _add_vision_args,
    _add_moe_args,
    _add_mla_args,
    _add_logging_args,
    _add_straggler_detector_args,
    _add_inference_args,
    _add_transformer_engine_args,
    _add_experimental_args,
    _add_ft_package_args,
    _add_rerun_machine_args,
    _add_sft_args,
)


def add_megatron_arguments(parser):
    """Add every Megatron argument group to `parser`; returns it."""
    for add_group in _GROUP_FUNCTIONS:
        parser = add_group(parser)
    return parser


def parse_args(extra_args_provider=None, ignore_unknown_args=False, argv=None):
    """Parse `argv` (default sys.argv[1:]). Unknown flags exit with status 2 unless
    `ignore_unknown_args`. `extra_args_provider(parser) -> parser` adds script flags."""
    parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    parser = add_megatron_arguments(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    if ignore_unknown_args:
        args, _ = parser.parse_known_args(argv)
    else:
        args = parser.parse_args(argv)
    args.rank = int(os.getenv("RANK", "0"))
    args.world_size = int(os.getenv("WORLD_SIZE", "1"))
    return args


def print_args(title, args):
    """Print every argument on rank 0 in Megatron's format (48-column dots, sorted)."""
    if args.rank != 0:
        return
    print(f"------------------------ {title} ------------------------", flush=True)
    lines = [f"  {name} {'.' * (48 - len(name))} {value}" for name, value in vars(args).items()]
    for line in sorted(lines, key=lambda text: text.lower()):
        print(line, flush=True)
    print(f"-------------------- end of {title} ---------------------", flush=True)


def parse_and_validate_args(
    extra_args_provider=None, args_defaults=None, ignore_unknown_args=False, argv=None
):
    """parse_args + validate_args; a validation error prints one line and exits with 2."""
    args = parse_args(extra_args_provider, ignore_unknown_args, argv)
    try:
        if args.use_checkpoint_args or (args_defaults or {}).get("use_checkpoint_args", False):
            # Megatron reads the model flags from the checkpoint before validating them.
            from megatron.training.checkpointing import CheckpointError, load_args_from_checkpoint

            try:
                load_args_from_checkpoint(args)
            except CheckpointError as exc:
                raise ArgumentValidationError(f"--use-checkpoint-args: {exc}") from None
        return validate_args(args, args_defaults)
    except ArgumentValidationError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)


# --------------------------------------------------------------------------------------
# Validation (the rules themselves are in argument_groups/validation.py)
# --------------------------------------------------------------------------------------
def validate_args(args, defaults=None):
    """Apply `defaults` (only where the arg is None), check every cross-flag rule, fill in
    the derived values and reject not-yet-implemented features. Raises
    ArgumentValidationError naming the flags and values at fault. Unlike Megatron it does
    not print the arguments: the caller does (initialize_megatron calls print_args)."""
    _apply_defaults(args, defaults or {})
    rules.translate_deprecated(args)
    rules.validate_parallel_sizes(args)
    rules.validate_model_shape(args)
    rules.validate_batch_size(args)
    rules.validate_pipeline(args)
    rules.validate_data_parallel_strategy(args)
    rules.validate_precision(args)
    rules.validate_checkpointing(args)
    rules.validate_schedule(args)
    rules.validate_recompute(args)
    rules.validate_data(args)
    rules.validate_logging(args)
    rules.validate_misc(args)
    _reject_not_supported_yet(args)
    # Transformer Engine is never used: the local implementation runs whatever was asked.
    requested = args.transformer_impl
    if requested != "local":
        args.transformer_impl_note = (
            f"--transformer-impl {requested} was requested; this code base runs its local "
            "PyTorch implementation (Transformer Engine is not used)"
        )
    elif not hasattr(args, "transformer_impl_note"):
        args.transformer_impl_note = None
    args.transformer_impl = "local"
    return args


def _apply_defaults(args, defaults):
    for key, value in defaults.items():
        current = getattr(args, key, None)
        if current is None:
            setattr(args, key, value)
        elif current != value:
            rules.warn(args, f"overriding default arguments for {key}:{value} with {key}:{current}")
