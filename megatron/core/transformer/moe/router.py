"""The top-k router of an MoE layer (Megatron Core's ``TopKRouter``; parameter ``weight`` [E, h]
and, with aux-loss-free balancing, the buffer ``expert_bias`` [E])."""

from typing import Dict, List, Union

import torch

from megatron.core.tensor_parallel import collectives as C
from megatron.core.tensor_parallel.parameters import new_weight, param_device
from megatron.core.transformer.moe import moe_utils as U

_DTYPES = {None: None, "fp32": torch.float32, "fp64": torch.float64}
# Names of the tracked losses: the names Megatron's log line and TensorBoard show.
LOSS_NAMES = {
    "aux_loss": "load_balancing_loss",
    "seq_aux_loss": "seq_load_balancing_loss",
    "global_aux_loss": "global_load_balancing_loss",
    "sinkhorn": None,
    "none": None,
}


def _as_list(value) -> List:
    return list(value) if isinstance(value, (list, tuple)) else [value]


class TopKRouter(torch.nn.Module):
    """Scores the tokens [T, h] against the experts and picks k per token.

    ``tp_cp_group`` is the group over which one sequence's tokens are split (sequence and context
    parallelism): the balancing losses count the tokens of all its ranks. ``tp_dp_cp_group`` (the
    ranks holding different tokens of the step) is where ``global_aux_loss`` counts them; its
    counts add up over the micro-batches of a step until :meth:`reset_global_counts`.

    In training the router attaches its auxiliary losses to the returned probabilities (so they
    join backward with the gradient ``aux_loss_scale``, which the schedule sets through the
    model's ``set_moe_aux_loss_scale``) and adds their detached values to ``tracked`` (name ->
    sum over the micro-batches of the step, this rank's part; the trainer reads it through the
    model's ``moe_metrics``, reduces it and clears it).
    """

    def __init__(self, config, tp_cp_group=None, tp_dp_cp_group=None):
        super().__init__()
        self.config = config
        self.num_experts = config.num_moe_experts
        self.topk = config.moe_router_topk
        self.tp_cp_group = tp_cp_group
        self.tp_dp_cp_group = tp_dp_cp_group
        self.weight = new_weight((self.num_experts, config.hidden_size), config, config.init_method)
        # Replicated over TP but fed this rank's part of the sequence: its gradient is summed
        # over TP like the norms' (allreduce_sequence_parallel_grads).
        self.weight.sequence_parallel = bool(config.sequence_parallel)
        self.types = _as_list(config.moe_router_load_balancing_type)
        self.coeffs = _as_list(config.moe_aux_loss_coeff)
        if config.moe_router_enable_expert_bias:
            # Buffers are made where the parameters are and move with the model.
            device = param_device(config)
            self.register_buffer("expert_bias", torch.zeros(self.num_experts, device=device))
            self.register_buffer(
                "local_tokens_per_expert",
                torch.zeros(self.num_experts, device=device),
                persistent=False,
            )
        else:
            self.expert_bias = None
        if "global_aux_loss" in self.types:
            # Tokens per expert over the global batch, summed over the step's micro-batches so
            # far, and how many micro-batches that is.
            self.register_buffer(
                "global_tokens_per_expert",
                torch.zeros(self.num_experts, dtype=torch.float64, device=param_device(config)),
                persistent=False,
            )
            self.global_microbatches = 0
        self.tracked: Dict[str, torch.Tensor] = {}
        # The factor the schedule applies to this micro-batch's main loss (1 / micro-batches,
        # times the context-parallel size and, with fp16, the loss scale: then a device tensor).
        self.aux_loss_scale: Union[float, torch.Tensor] = 1.0

    def _logits(self, tokens: torch.Tensor) -> torch.Tensor:
        dtype = _DTYPES[self.config.moe_router_dtype]
        weight = self.weight
        if dtype is not None:
            tokens, weight = tokens.to(dtype), weight.to(dtype)
        eps = self.config.moe_input_jitter_eps
        if self.training and eps:
            noise = torch.empty_like(tokens).uniform_(1.0 - eps, 1.0 + eps)
            tokens = tokens * noise
        return torch.nn.functional.linear(tokens, weight)

    def _track(self, name: str, value: torch.Tensor) -> None:
        if name is not None:
            value = value.detach().float()
            self.tracked[name] = self.tracked.get(name, 0.0) + value

    def _route(self, logits: torch.Tensor):
        cfg = self.config
        if "sinkhorn" in self.types and self.training:
            with torch.no_grad():
                indices = torch.topk(U.sinkhorn(logits.detach().float()), self.topk, dim=-1)
                indices = indices.indices
            scores = torch.softmax(logits, dim=-1) if self.topk > 1 else torch.sigmoid(logits)
            weights = torch.gather(scores, 1, indices)
            probs = torch.zeros_like(logits).scatter(1, indices, weights)
            routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
            return probs, routing_map
        return U.route_topk(
            logits,
            self.topk,
            cfg.moe_router_score_function,
            cfg.moe_router_pre_softmax,
            cfg.moe_router_num_groups,
            cfg.moe_router_group_topk,
            cfg.moe_router_topk_scaling_factor,
            self.expert_bias,
        )

    def forward(self, tokens: torch.Tensor, seq_length: int):
        """tokens [T, h] (sequence-major, T = seq_length * batch) -> (probs [T, E], routing_map
        [T, E] bool)."""
        cfg = self.config
        logits = self._logits(tokens)
        probs, routing_map = self._route(logits)
        if cfg.moe_expert_capacity_factor is not None:
            capacity = U.expert_capacity(
                tokens.shape[0], self.num_experts, self.topk, cfg.moe_expert_capacity_factor
            )
            probs, routing_map = U.apply_capacity(
                probs,
                routing_map,
                capacity,
                cfg.moe_token_drop_policy,
                cfg.moe_pad_expert_input_to_capacity,
            )
        # Losses and counts are recorded in the forward that builds the graph: with activation
        # recompute that is the recomputation in backward (the first pass runs without grad).
        recording = self.training and torch.is_grad_enabled()
        if recording:
            probs = self._attach_losses(logits, probs, routing_map, seq_length)
        if recording and self.expert_bias is not None:
            self.local_tokens_per_expert += routing_map.sum(dim=0).to(
                self.local_tokens_per_expert.dtype
            )
        return probs.to(tokens.dtype), routing_map

    def _attach_losses(self, logits, probs, routing_map, seq_length):
        cfg = self.config
        scale = self.aux_loss_scale
        parts = C.group_size(self.tp_cp_group)
        if getattr(cfg, "calculate_per_token_loss", False):
            # Megatron's scaling: the finalization divides every gradient by the step's token
            # count, so each loss is multiplied by the micro-batch's tokens and its gradient
            # stays the mean over micro-batches and data-parallel ranks. The tokens are those of
            # the whole sequences (every TP x CP part's): the parts' losses add up to the
            # sequences' loss, so the gradient does not depend on the layout.
            scale = scale * routing_map.shape[0] * parts
        for kind, coeff in zip(self.types, self.coeffs):
            if kind not in ("aux_loss", "seq_aux_loss", "global_aux_loss") or coeff == 0:
                continue
            scores = U.scores_for_aux_loss(logits, cfg.moe_router_score_function)
            if kind == "aux_loss":
                counts = routing_map.sum(dim=0)
                total = routing_map.shape[0] * parts
                per_part = scores
            elif kind == "seq_aux_loss":  # per sequence: [s, b * E], a column per (seq, expert)
                counts = routing_map.reshape(seq_length, -1).sum(dim=0)
                total = seq_length * parts
                per_part = scores.reshape(seq_length, -1)
            else:
                counts, total = self._global_counts(routing_map)
                per_part = scores
            if kind != "global_aux_loss":
                counts = C.all_reduce(counts.clone(), self.tp_cp_group)
            loss = U.switch_load_balancing_loss(
                per_part, counts, total, self.topk, self.num_experts, coeff
            )
            if kind == "seq_aux_loss":
                loss = loss / (routing_map.shape[0] // seq_length)
            probs = U.MoEAuxLossAutoScaler.apply(probs, loss, scale)
            self._track(LOSS_NAMES[kind], loss / coeff)
        if cfg.moe_z_loss_coeff:
            # Each part's mean over its tokens, divided by the parts: they add up to the mean.
            loss = U.z_loss(logits, cfg.moe_z_loss_coeff / parts)
            probs = U.MoEAuxLossAutoScaler.apply(probs, loss, scale)
            self._track("z_loss", loss / cfg.moe_z_loss_coeff)
        return probs

    @torch.no_grad()
    def _global_counts(self, routing_map):
        """(this step's running mean of the tokens per expert over the global batch, the tokens
        of one micro-batch over TP x DP x CP)."""
        counts = routing_map.sum(dim=0).to(self.global_tokens_per_expert.dtype)
        self.global_tokens_per_expert += C.all_reduce(counts, self.tp_dp_cp_group)
        self.global_microbatches += 1
        total = routing_map.shape[0] * C.group_size(self.tp_dp_cp_group)
        return self.global_tokens_per_expert / self.global_microbatches, total

    def reset_global_counts(self) -> None:
        """Start the next step's global_aux_loss counts (called once per step)."""
        if hasattr(self, "global_tokens_per_expert"):
            self.global_tokens_per_expert.zero_()
            self.global_microbatches = 0

    @torch.no_grad()
    def update_expert_bias(self, group=None) -> None:
        """Aux-loss-free balancing: move each expert's bias by the update rate towards the mean
        load (up when under-loaded), from this step's counts summed over ``group`` (the ranks
        holding different tokens of the step: TP x DP x CP); then clear the counts."""
        if self.expert_bias is None:
            return
        counts = C.all_reduce(self.local_tokens_per_expert.clone(), group)
        offset = counts.mean() - counts
        self.expert_bias += torch.sign(offset) * self.config.moe_router_bias_update_rate
        self.local_tokens_per_expert.zero_()
