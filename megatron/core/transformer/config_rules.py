"""Rules of a transformer's configuration that both the command line and the core configs enforce.

Core configs are built without the command line (megatron-core users, tests, tools), so
``TransformerConfig.__post_init__`` and ``validate_moe_config`` check these rules; the command
line's ``validate_args`` (megatron/training/flags/rules) checks them too, before any process group
exists, and names the flags. Each rule is one predicate here; each caller words its error in its
own names (flags on the command line, field names in core). Nothing here imports torch.
"""

import math
from typing import Optional, Sequence

CP_COMM_TYPES = ("p2p", "a2a", "allgather", "a2a+p2p")
"""The context-parallel exchanges of ``--cp-comm-type`` / ``cp_comm_type``."""

MUP_DEFAULTS = (
    ("mup_width_mult", 1.0),
    ("mup_base_hidden_size", None),
    ("mup_embedding_mult", 1.0),
    ("mup_output_mult", 1.0),
    ("mup_base_head_dim", None),
    ("mup_attn_scale_power", 1.0),
)
"""The muP settings and their defaults: one away from its default needs ``use_mup``."""


def heads_split_over_tp(num_attention_heads: int, tensor_model_parallel_size: int) -> bool:
    """Each tensor-parallel rank computes whole attention heads."""
    return num_attention_heads % tensor_model_parallel_size == 0


def heads_split_into_query_groups(num_attention_heads: int, num_query_groups: int) -> bool:
    """Grouped-query attention: every key/value group serves the same number of query heads."""
    return num_query_groups > 0 and num_attention_heads % num_query_groups == 0


def query_groups_split_over_tp(num_query_groups: int, tensor_model_parallel_size: int) -> bool:
    """Each tensor-parallel rank holds whole key/value groups (Megatron's rule: a divisor of TP
    would need the groups replicated across ranks, which no layer builds)."""
    return num_query_groups % tensor_model_parallel_size == 0


def hidden_splits_into_heads(hidden_size: int, num_attention_heads: int) -> bool:
    """Without an explicit head size (kv_channels) a head is hidden_size / num_attention_heads."""
    return hidden_size % num_attention_heads == 0


def cp_comm_types_fit(count: int, num_layers: int) -> bool:
    """One context-parallel exchange for every layer, or one per layer."""
    return count in (1, num_layers)


def expert_parallelism_has_experts(num_experts: Optional[int], expert_parallel_size: int) -> bool:
    """Expert parallelism splits the experts of MoE layers: a dense model has none to split."""
    return num_experts is not None or expert_parallel_size == 1


def experts_split_over_ep(num_experts: int, expert_parallel_size: int) -> bool:
    """Each expert-parallel rank holds the same number of whole experts."""
    return num_experts % expert_parallel_size == 0


def router_topk_in_range(moe_router_topk: int, num_experts: int) -> bool:
    """The router sends each token to at least one and at most all of the experts."""
    return 1 <= moe_router_topk <= num_experts


def moe_tokens_split_over_tp(tensor_model_parallel_size: int, sequence_parallel: bool) -> bool:
    """The MoE layer's token exchange assumes every rank of the tensor-parallel group holds other
    tokens, which with TP > 1 only sequence parallelism gives (Megatron refuses it too)."""
    return tensor_model_parallel_size <= 1 or bool(sequence_parallel)


def aux_loss_coeffs_match_types(types: Sequence, coeffs: Sequence) -> bool:
    """One auxiliary-loss coefficient per router load-balancing type."""
    return len(coeffs) == len(types)


def moe_layer_pattern_covers_layers(pattern: Sequence, num_layers: int) -> bool:
    """A list ``moe_layer_freq`` holds one entry per layer."""
    return len(pattern) == num_layers


def capacity_padding_has_capacity(
    moe_pad_expert_input_to_capacity: bool, moe_expert_capacity_factor: Optional[float]
) -> bool:
    """Padding each expert's input to its capacity needs a capacity (a capacity factor)."""
    return not moe_pad_expert_input_to_capacity or moe_expert_capacity_factor is not None


def mup_settings_given(settings) -> list:
    """The names of MUP_DEFAULTS whose value on ``settings`` (the args, a config) is not the
    default, in MUP_DEFAULTS' order."""
    return [name for name, default in MUP_DEFAULTS if getattr(settings, name) != default]


def mup_width_mult_matches(
    mup_width_mult: float, hidden_size: int, mup_base_hidden_size: Optional[int]
) -> bool:
    """A width multiplier given besides the base hidden size must be the ratio they make."""
    derived = hidden_size / (mup_base_hidden_size or hidden_size)
    return mup_width_mult == 1.0 or math.isclose(mup_width_mult, derived)


def compiled_layers_without_recompute(compiled: bool, recompute_granularity: Optional[str]) -> bool:
    """Compiled layers recompute nothing: the recompute paths (checkpointed layers, discarded
    norm outputs) hand tensors between autograd and hooks that torch.compile does not trace."""
    return not compiled or recompute_granularity is None


def compiled_layers_dropout_fits(
    compiled: bool, tensor_model_parallel_size: int, hidden_dropout: float, attention_dropout: float
) -> bool:
    """In a compiled layer the compiler draws the dropout masks with its own generator, which is
    not proven to follow the RNG tracker's per-TP-rank streams: no dropout under TP."""
    return (
        not compiled
        or tensor_model_parallel_size == 1
        or (hidden_dropout == 0.0 and attention_dropout == 0.0)
    )


LINEAR_ATTENTION_VARIANTS = ("gated_delta_net",)
"""The ``--experimental-attention-variant`` values implemented here (linear attentions)."""


def linear_attention_pattern(linear_attention_freq, num_layers: int) -> list:
    """Megatron's per-layer pattern of ``--linear-attention-freq`` (1: linear attention, 0:
    softmax attention): an int N makes every N-th layer softmax attention ([1, 1, 1, 0, ...] for
    4), a list is the pattern itself and must have one 0/1 entry per layer. ValueError names
    what is wrong."""
    if isinstance(linear_attention_freq, bool) or linear_attention_freq is None:
        raise ValueError(f"needs an int or a list, got {linear_attention_freq!r}")
    if isinstance(linear_attention_freq, int):
        if linear_attention_freq <= 0:
            raise ValueError(f"must be positive, got {linear_attention_freq}")
        return [0 if (i + 1) % linear_attention_freq == 0 else 1 for i in range(num_layers)]
    pattern = list(linear_attention_freq)
    if len(pattern) != num_layers:
        raise ValueError(f"has {len(pattern)} entries for {num_layers} layers (--num-layers)")
    if any(entry not in (0, 1) for entry in pattern):
        raise ValueError(f"entries must be 0 or 1, got {pattern}")
    return [int(entry) for entry in pattern]
