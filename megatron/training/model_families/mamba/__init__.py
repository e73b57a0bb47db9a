"""Hybrid Mamba / attention models (Nemotron-H style): ``pretrain_mamba.py``.

The layers are given by ``--hybrid-override-pattern`` (or its newer name
``--hybrid-layer-pattern``): ``M`` Mamba-2, ``*`` self-attention, ``-`` MLP, ``E`` mixture of
experts, one symbol per layer; ``|`` marks pipeline-stage boundaries, which must fall where the
pipeline split puts them. Data, batches and loss are GPT's."""

from megatron.core.enums import ModelType
from megatron.core.ssm.mamba_context_parallel import mamba_context_parallel_error
from megatron.core.ssm.mamba_hybrid_layer_allocation import layer_symbols, stage_layer_counts
from megatron.training.flag_errors import ArgumentValidationError
from megatron.training.model_families import TrainSpec
from megatron.training.model_families.gpt import SPEC as GPT
from megatron.training.theoretical_memory import activation_components

from .cost import count_parameters, mamba_sizes, num_floating_point_operations
from .model import model_provider


def check_args(args) -> None:
    """Megatron's checks of a hybrid model's flags, one line each."""
    old, new = args.hybrid_override_pattern, args.hybrid_layer_pattern
    if old and new and old != new:
        raise ArgumentValidationError(
            "--hybrid-override-pattern and --hybrid-layer-pattern differ; give one"
        )
    pattern = new or old
    if not pattern:
        raise ArgumentValidationError(
            "pretrain_mamba.py needs --hybrid-override-pattern (e.g. M*M-: M mamba, * attention, "
            "- MLP, E MoE)"
        )
    try:
        symbols = layer_symbols(pattern)
    except ValueError as exc:
        raise ArgumentValidationError(str(exc)) from None
    if len(symbols) != args.num_layers:
        raise ArgumentValidationError(
            f"--hybrid-override-pattern {pattern!r} has {len(symbols)} layers but --num-layers is "
            f"{args.num_layers}"
        )
    if "|" in pattern:
        stages = stage_layer_counts(pattern)
        pp = args.pipeline_model_parallel_size
        even = [args.num_layers // pp] * pp if args.num_layers % pp == 0 else None
        if len(stages) != pp or stages != even:
            raise ArgumentValidationError(
                f"--hybrid-override-pattern {pattern!r}: stage boundaries {stages} must split the "
                f"layers evenly over --pipeline-model-parallel-size {pp} here"
            )
    if "E" in symbols and not args.num_experts:
        raise ArgumentValidationError("--hybrid-override-pattern has E (MoE) but no --num-experts")
    if "M" not in symbols:
        return
    d_in, heads, _ = mamba_sizes(args)
    tp = args.tensor_model_parallel_size
    if args.mamba_num_heads is None and (2 * args.hidden_size) % args.mamba_head_dim:
        raise ArgumentValidationError(
            f"--mamba-head-dim {args.mamba_head_dim} must divide 2 x --hidden-size "
            f"({2 * args.hidden_size}) unless --mamba-num-heads is given"
        )
    if heads % args.mamba_num_groups:
        raise ArgumentValidationError(
            f"the Mamba heads ({heads}) must be divisible by --mamba-num-groups "
            f"({args.mamba_num_groups})"
        )
    if heads % tp or args.mamba_num_groups % tp:
        raise ArgumentValidationError(
            f"the Mamba heads ({heads}) and --mamba-num-groups ({args.mamba_num_groups}) must be "
            f"divisible by --tensor-model-parallel-size ({tp})"
        )
    error = mamba_context_parallel_error(
        heads, args.mamba_num_groups, tp, args.context_parallel_size
    )
    if error is not None:
        raise ArgumentValidationError(error)


SPEC = TrainSpec(
    name="mamba",
    model_type=ModelType.encoder_or_decoder,
    args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
    model_provider=model_provider,
    forward_step=GPT.forward_step,
    train_valid_test_datasets_provider=GPT.train_valid_test_datasets_provider,
    num_floating_point_operations=num_floating_point_operations,
    count_parameters=count_parameters,
    activation_components=activation_components,
    checkpoint_model_args=GPT.checkpoint_model_args
    + (
        "hybrid_override_pattern",
        "hybrid_layer_pattern",
        "mamba_state_dim",
        "mamba_head_dim",
        "mamba_num_groups",
        "mamba_num_heads",
    ),
    reads_flags=(
        "hybrid_override_pattern",
        "hybrid_layer_pattern",
        "is_hybrid_model",
        "mamba_state_dim",
        "mamba_head_dim",
        "mamba_num_groups",
        "mamba_num_heads",
    ),
    check_own_args=check_args,
    checkpoint_converter="plugins",  # tools/checkpoint: --model-type MAMBA, protocol_hybrid.py
)
