"""The mixture-of-experts fields of ``TransformerConfig`` (Megatron Core's names) and their rules.

Kept apart from transformer_config.py so that file stays about the dense stack; TransformerConfig
inherits these fields and calls :func:`validate_moe_config` from its ``__post_init__``.
"""

from dataclasses import dataclass
from typing import List, Optional, Union

from megatron.core.transformer.config_rules import (
    aux_loss_coeffs_match_types,
    capacity_padding_has_capacity,
    expert_parallelism_has_experts,
    experts_split_over_ep,
    moe_layer_pattern_covers_layers,
    moe_tokens_split_over_tp,
    router_topk_in_range,
)

LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")
DISPATCHERS = ("allgather", "alltoall", "flex")
DROP_POLICIES = ("probs", "position")


@dataclass
class MoEConfig:
    """Mixture-of-experts settings; every field is inert while ``num_moe_experts`` is None."""

    num_moe_experts: Optional[int] = None
    """Experts per MoE layer (``--num-experts``); None means dense MLPs."""

    moe_layer_freq: Union[int, List[int]] = 1
    """Which layers are MoE (``--moe-layer-freq``): an int N makes every Nth layer (0, N, 2N...)
    an MoE layer; a list holds one 0/1 per layer."""

    moe_ffn_hidden_size: Optional[int] = None
    """Hidden size of each expert (``--moe-ffn-hidden-size``); None means ffn_hidden_size."""

    moe_router_topk: int = 2
    """Experts each token is routed to (``--moe-router-topk``)."""

    moe_router_load_balancing_type: Union[str, List[str]] = "aux_loss"
    """'aux_loss', 'seq_aux_loss', 'global_aux_loss', 'sinkhorn' or 'none', or a list of several
    (``--moe-router-load-balancing-type``); each list entry pairs with an aux-loss coefficient."""

    moe_aux_loss_coeff: Union[float, List[float]] = 0.0
    """Coefficient of the load-balancing loss(es) (``--moe-aux-loss-coeff``)."""

    moe_z_loss_coeff: Optional[float] = None
    """Coefficient of the router z-loss (``--moe-z-loss-coeff``); None: no z-loss."""

    moe_input_jitter_eps: Optional[float] = None
    """Router inputs are multiplied by U(1 - eps, 1 + eps) in training
    (``--moe-input-jitter-eps``); None: no jitter."""

    moe_router_score_function: str = "softmax"
    """'softmax', 'sigmoid' or 'sqrtsoftplus' (sqrt(softplus(logit)), DeepSeek-V4's; routed like
    sigmoid) (``--moe-router-score-function``)."""

    moe_router_pre_softmax: bool = False
    """Softmax over all experts before the top-k instead of over the k selected
    (``--moe-router-pre-softmax``)."""

    moe_router_num_groups: Optional[int] = None
    """Expert groups of group-limited routing (``--moe-router-num-groups``)."""

    moe_router_group_topk: Optional[int] = None
    """Groups each token may choose experts from (``--moe-router-group-topk``)."""

    moe_router_topk_scaling_factor: Optional[float] = None
    """Multiplier of the selected experts' weights (``--moe-router-topk-scaling-factor``)."""

    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free balancing: a per-expert bias added to the scores for the selection only,
    moved by the bias update rate towards balance after each step
    (``--moe-router-enable-expert-bias``)."""

    moe_router_bias_update_rate: float = 1e-3
    """Step of the expert-bias update (``--moe-router-bias-update-rate``)."""

    moe_router_dtype: Optional[str] = None
    """Dtype of the routing computation: None (the model's), 'fp32' or 'fp64'
    (``--moe-router-dtype``)."""

    moe_token_dispatcher_type: str = "allgather"
    """'allgather' or 'alltoall'; 'flex' (DeepEP) runs as 'alltoall' here
    (``--moe-token-dispatcher-type``)."""

    moe_expert_capacity_factor: Optional[float] = None
    """Capacity of each expert as a multiple of its even share of the tokens
    (``--moe-expert-capacity-factor``); None: dropless."""

    moe_pad_expert_input_to_capacity: bool = False
    """Pad each expert's input to its capacity (``--moe-pad-expert-input-to-capacity``)."""

    moe_token_drop_policy: str = "probs"
    """Which tokens an over-full expert drops: 'probs' (lowest weights) or 'position' (latest
    in the batch) (``--moe-token-drop-policy``)."""

    moe_grouped_gemm: bool = False
    """Run the local experts as one grouped GEMM (``--moe-grouped-gemm``)."""

    moe_shared_expert_intermediate_size: Optional[int] = None
    """Hidden size of the shared expert run on every token
    (``--moe-shared-expert-intermediate-size``); None: no shared expert."""

    moe_shared_expert_gate: bool = False
    """Scale the shared expert's output by sigmoid(x . w_gate) (``--moe-shared-expert-gate``)."""

    moe_shared_expert_overlap: bool = False
    """Overlap the shared expert with token dispatch (``--moe-shared-expert-overlap``); a
    scheduling choice only: the result is the same."""

    moe_layer_recompute: bool = False
    """Recompute the MoE layers in backward (``--moe-layer-recompute``)."""

    moe_per_layer_logging: bool = False
    """Log the auxiliary losses of each MoE layer too (``--moe-per-layer-logging``)."""


def _as_list(value):
    return list(value) if isinstance(value, (list, tuple)) else [value]


def validate_moe_config(config) -> None:
    """Cross-field rules of the MoE fields (ValueError naming the flags)."""
    if not expert_parallelism_has_experts(
        config.num_moe_experts, config.expert_model_parallel_size
    ):
        raise ValueError(
            f"--expert-model-parallel-size {config.expert_model_parallel_size} needs --num-experts"
        )
    if config.num_moe_experts is None:
        return
    experts = config.num_moe_experts
    if experts <= 0:
        raise ValueError(f"--num-experts must be positive, got {experts}")
    if not experts_split_over_ep(experts, config.expert_model_parallel_size):
        raise ValueError(
            f"--num-experts ({experts}) must be divisible by --expert-model-parallel-size "
            f"({config.expert_model_parallel_size})"
        )
    if not router_topk_in_range(config.moe_router_topk, experts):
        raise ValueError(
            f"--moe-router-topk ({config.moe_router_topk}) must be in [1, --num-experts={experts}]"
        )
    if config.moe_ffn_hidden_size is None:
        config.moe_ffn_hidden_size = config.ffn_hidden_size
    if config.moe_router_score_function not in SCORE_FUNCTIONS:
        raise ValueError(
            f"--moe-router-score-function {config.moe_router_score_function!r} is not one of "
            f"{SCORE_FUNCTIONS}"
        )
    if config.moe_token_dispatcher_type not in DISPATCHERS:
        raise ValueError(
            f"--moe-token-dispatcher-type {config.moe_token_dispatcher_type!r} is not one of "
            f"{DISPATCHERS}"
        )
    if config.moe_token_drop_policy not in DROP_POLICIES:
        raise ValueError(
            f"--moe-token-drop-policy {config.moe_token_drop_policy!r} is not one of "
            f"{DROP_POLICIES}"
        )
    if config.moe_router_dtype not in (None, "fp32", "fp64"):
        raise ValueError(f"--moe-router-dtype {config.moe_router_dtype!r} is not fp32 or fp64")
    types = _as_list(config.moe_router_load_balancing_type)
    unknown = [t for t in types if t not in LOAD_BALANCING_TYPES]
    if unknown:
        raise ValueError(
            f"--moe-router-load-balancing-type {unknown} not supported; "
            f"choose from {LOAD_BALANCING_TYPES}"
        )
    coeffs = _as_list(config.moe_aux_loss_coeff)
    if not aux_loss_coeffs_match_types(types, coeffs):
        if len(types) > 1:
            raise ValueError(
                f"--moe-aux-loss-coeff takes one value per --moe-router-load-balancing-type "
                f"({len(types)}), got {len(coeffs)}"
            )
        if len(types) == 1:
            raise ValueError(
                f"--moe-aux-loss-coeff has {len(coeffs)} values for one load-balancing type"
            )
    if "sinkhorn" in types and config.moe_router_score_function != "softmax":
        raise ValueError("--moe-router-load-balancing-type sinkhorn needs the softmax score")
    groups, group_topk = config.moe_router_num_groups, config.moe_router_group_topk
    if (groups is None) != (group_topk is None):
        raise ValueError("--moe-router-num-groups and --moe-router-group-topk go together")
    if groups is not None:
        if experts % groups != 0:
            raise ValueError(
                f"--num-experts ({experts}) must be divisible by --moe-router-num-groups ({groups})"
            )
        if not 1 <= group_topk <= groups:
            raise ValueError(f"--moe-router-group-topk ({group_topk}) must be in [1, {groups}]")
        if config.moe_router_topk > group_topk * (experts // groups):
            raise ValueError(
                f"--moe-router-topk ({config.moe_router_topk}) exceeds the experts of "
                f"--moe-router-group-topk ({group_topk}) groups"
            )
    if config.moe_expert_capacity_factor is not None and config.moe_expert_capacity_factor <= 0:
        raise ValueError(
            "--moe-expert-capacity-factor must be positive, got "
            f"{config.moe_expert_capacity_factor}"
        )
    if not capacity_padding_has_capacity(
        config.moe_pad_expert_input_to_capacity, config.moe_expert_capacity_factor
    ):
        raise ValueError("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
    if config.moe_shared_expert_gate and config.moe_shared_expert_intermediate_size is None:
        raise ValueError("--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size")
    if config.moe_shared_expert_overlap and config.moe_shared_expert_intermediate_size is None:
        raise ValueError("--moe-shared-expert-overlap needs --moe-shared-expert-intermediate-size")
    if not moe_tokens_split_over_tp(config.tensor_model_parallel_size, config.sequence_parallel):
        raise ValueError("MoE with --tensor-model-parallel-size > 1 needs --sequence-parallel")
    freq = config.moe_layer_freq
    if isinstance(freq, (list, tuple)):
        if not moe_layer_pattern_covers_layers(freq, config.num_layers) or any(
            v not in (0, 1) for v in freq
        ):
            raise ValueError(
                f"--moe-layer-freq list must hold one 0/1 per layer ({config.num_layers}), "
                f"got {list(freq)}"
            )
    elif not isinstance(freq, int) or freq <= 0:
        raise ValueError(f"--moe-layer-freq must be a positive int or a list, got {freq!r}")


def is_moe_layer(config, layer_index: int) -> bool:
    """Whether the layer with 0-based global index ``layer_index`` is an MoE layer."""
    if config.num_moe_experts is None:
        return False
    freq = config.moe_layer_freq
    if isinstance(freq, (list, tuple)):
        return bool(freq[layer_index])
    return layer_index % freq == 0
