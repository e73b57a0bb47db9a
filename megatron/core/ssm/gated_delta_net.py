"""Megatron's ``GatedDeltaNet`` (``--experimental-attention-variant gated_delta_net``, the linear
attention of Qwen3-Next) in plain PyTorch, with its parameter names.

    in_proj  -> [q, k, v, z, beta, alpha]             (z: the output gate)
    conv1d   -> act(depthwise causal conv of [q, k, v])
    q, k     -> L2-normalized per head; key heads repeated to the value heads; q scaled by dk^-0.5
    g        =  -exp(A_log) * softplus(alpha + dt_bias)        (the decay, log space)
    scan     -> the gated delta rule (:mod:`.gated_delta_rule`, chunked) with beta = sigmoid(beta)
    out_norm -> norm(o) * act(z) per value head (the config's norm over the value head size)
    out_proj

``act`` is the config's activation (SiLU in Megatron's and Qwen3-Next's configurations). The
input norm is the layer's ``input_layernorm`` (Megatron's Transformer Engine spec fuses it into
``in_proj`` as ``in_proj.layer_norm_weight``).

Tensor parallelism as Megatron shards it: key and value heads are split over the TP ranks, each
rank running whole heads (its value heads' key heads are its own, since both are split in
contiguous blocks). ``in_proj`` is column-parallel over six parts, each split over TP, so rank r
holds [q_r; k_r; v_r; z_r; beta_r; alpha_r] (``partition_sizes`` tells the checkpoint code);
``conv1d`` likewise holds [q_r; k_r; v_r]; ``dt_bias`` and ``A_log`` are split in one piece;
``out_norm`` is replicated (its gradients are summed over TP, each rank having normed its own
heads); ``out_proj`` is row-parallel. With sequence parallelism ``in_proj`` gathers the sequence
and ``out_proj`` reduce-scatters it, as attention does. Every rank draws the full (TP=1)
parameters on the host and keeps its shard, so any TP layout starts from the one-process
weights.

Generation: the conv history (the last ``kernel - 1`` inputs of the convolution) and the
recurrent state [b, heads, dk, dv] of each layer are kept in the inference context's
``ssm_states[layer_number]``; a prompt fills them, each later token continues them (the
recurrence for a single token, the chunked scan from the state otherwise).
"""

import math
from typing import List, Optional

import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.parameters import (
    param_device,
    set_default_tensor_parallel_attributes,
)
from megatron.core.tensor_parallel.process_groups import resolve_pg_collection
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.norms import build_norm

from .gated_delta_rule import gated_delta_rule_chunked, gated_delta_rule_recurrent
from .mamba_mixer import MambaConv1d, shard_parts
from .ssd import causal_depthwise_conv1d


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (FLA's and Qwen3-Next's ``l2norm``)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def _sharded_param(shape, config, draw, tp_rank: int, tp_size: int, parts: List[int]):
    """This rank's shard (dim 0) of a parameter made of ``parts`` each split over TP, whose full
    value ``draw(tensor)`` fills on the host (so every TP layout draws the same numbers)."""
    local_shape = (shape[0] // tp_size, *shape[1:])
    device = param_device(config)
    if device.type == "meta":
        local = torch.empty(local_shape, dtype=config.params_dtype, device=device)
    else:
        master_dtype = torch.float64 if config.params_dtype == torch.float64 else torch.float32
        master = torch.empty(tuple(shape), dtype=master_dtype, device="cpu")  # host: CPU RNG
        with torch.no_grad():
            draw(master)
        local = shard_parts(master, 0, parts, tp_rank, tp_size).to(config.params_dtype)
    param = torch.nn.Parameter(local)
    set_default_tensor_parallel_attributes(param)
    if tp_size > 1:
        param.tensor_model_parallel = True
        param.partition_dim = 0
        if len(parts) > 1:
            param.partition_sizes = [p // tp_size for p in parts]
    param.allreduce = True
    return param


class GatedDeltaNet(MegatronModule):
    """One gated delta net on [s, b, h] (s/TP under sequence parallelism); returns
    ``(output, bias or None)`` like the attention modules. Sizes from the config:
    ``linear_key_head_dim``, ``linear_value_head_dim``, ``linear_num_key_heads``,
    ``linear_num_value_heads``, ``linear_conv_kernel_dim``. ``chunk_size`` is the scan's chunk
    (64, Megatron's and FLA's)."""

    def __init__(
        self,
        config,
        submodules=None,
        layer_number: int = 1,
        pg_collection=None,
        attn_mask_type=None,
        conv_init: Optional[float] = None,
        A_init_range=(1, 16),
        chunk_size: int = 64,
    ):
        super().__init__(config)
        del submodules, attn_mask_type  # causal by construction; the projections are fixed
        pgs = resolve_pg_collection(config, pg_collection)
        if pgs.cp_size > 1:
            raise ValueError(
                "gated delta net layers do not support context parallelism "
                "(--context-parallel-size > 1 with --experimental-attention-variant "
                "gated_delta_net)"
            )
        tp_size, tp_rank = pgs.tp_size, pgs.tp_rank
        self.layer_number = layer_number
        self.chunk_size = chunk_size
        self.act = config.activation_func
        self.dk = config.linear_key_head_dim
        self.dv = config.linear_value_head_dim
        self.nk = config.linear_num_key_heads
        self.nv = config.linear_num_value_heads
        self.kernel = config.linear_conv_kernel_dim
        if self.nv % self.nk:
            raise ValueError(
                f"--linear-num-value-heads ({self.nv}) must be a multiple of "
                f"--linear-num-key-heads ({self.nk})"
            )
        for flag, count in (
            ("--linear-num-key-heads", self.nk),
            ("--linear-num-value-heads", self.nv),
        ):
            if count % tp_size:
                raise ValueError(
                    f"{flag} ({count}) must be divisible by --tensor-model-parallel-size "
                    f"({tp_size})"
                )
        qk_dim, v_dim = self.nk * self.dk, self.nv * self.dv
        self.nk_local, self.nv_local = self.nk // tp_size, self.nv // tp_size
        self.qk_local, self.v_local = qk_dim // tp_size, v_dim // tp_size

        # Built in Megatron's order: in_proj, conv1d, dt_bias, A_log, out_norm, out_proj.
        in_parts = [qk_dim, qk_dim, v_dim, v_dim, self.nv, self.nv]  # q k v z beta alpha
        self.in_proj = ColumnParallelLinear(
            config.hidden_size,
            sum(in_parts),
            config=config,
            init_method=config.init_method,
            bias=False,
            gather_output=False,
            skip_weight_param_allocation=True,
            tp_group=pgs.tp,
        )
        self.in_proj.weight = _sharded_param(
            (sum(in_parts), config.hidden_size),
            config,
            config.init_method,
            tp_rank,
            tp_size,
            in_parts,
        )

        def conv_weight(w):  # nn.Conv1d's default initialization, or Megatron's conv_init
            if conv_init is not None:
                torch.nn.init.uniform_(w, -conv_init, conv_init)
            else:
                torch.nn.init.kaiming_uniform_(w, a=math.sqrt(5))

        conv_parts = [qk_dim, qk_dim, v_dim]
        self.conv1d = MambaConv1d(
            _sharded_param(
                (sum(conv_parts), 1, self.kernel), config, conv_weight, tp_rank, tp_size, conv_parts
            ),
            None,  # Megatron's conv_bias=False
        )
        self.dt_bias = _sharded_param(
            (self.nv,), config, torch.nn.init.ones_, tp_rank, tp_size, [self.nv]
        )
        self.A_log = _sharded_param(
            (self.nv,),
            config,
            lambda t: t.copy_(torch.log(torch.empty_like(t).uniform_(*A_init_range))),
            tp_rank,
            tp_size,
            [self.nv],
        )
        self.out_norm = build_norm(config, self.dv)
        for param in self.out_norm.parameters():
            # Replicated, applied to this rank's heads only: the gradients are summed over TP
            # (as for the QK layernorms).
            param.sequence_parallel = tp_size > 1
        self.out_proj = RowParallelLinear(
            v_dim,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=False,
            input_is_parallel=True,
            skip_bias_add=True,
            tp_group=pgs.tp,
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask=None,
        rotary_pos_emb=None,
        inference_context=None,
        **kwargs,
    ):
        """[s, b, h] -> (out [s, b, h], None). The mask and rotary embedding are not used: the
        scan is causal and position comes from the convolution and the decay."""
        projected, _ = self.in_proj(hidden_states)
        projected = projected.transpose(0, 1)  # [b, L, local parts]
        b, length, _ = projected.shape
        qkv, z, beta, alpha = torch.split(
            projected,
            [2 * self.qk_local + self.v_local, self.v_local, self.nv_local, self.nv_local],
            dim=-1,
        )
        conv_history, state = self._cached_states(inference_context, b)
        qkv_t = qkv.transpose(1, 2)  # [b, conv channels, L]
        conv = causal_depthwise_conv1d(qkv_t, self.conv1d.weight, None, history=conv_history)
        qkv = self.act(conv).transpose(1, 2)
        q, k, v = torch.split(qkv, [self.qk_local, self.qk_local, self.v_local], dim=-1)
        # The scan runs in float32 at least (FLA's and transformers' kernels do).
        scan_dtype = torch.promote_types(qkv.dtype, torch.float32)
        q = l2_normalize(q.reshape(b, length, self.nk_local, self.dk).to(scan_dtype))
        k = l2_normalize(k.reshape(b, length, self.nk_local, self.dk).to(scan_dtype))
        v = v.reshape(b, length, self.nv_local, self.dv).to(scan_dtype)
        if self.nv != self.nk:
            q = q.repeat_interleave(self.nv // self.nk, dim=2)
            k = k.repeat_interleave(self.nv // self.nk, dim=2)
        q = q * self.dk**-0.5
        g = -self.A_log.to(scan_dtype).exp() * F.softplus(
            alpha.to(scan_dtype) + self.dt_bias.to(scan_dtype)
        )
        beta = torch.sigmoid(beta.to(scan_dtype))
        if state is not None and length == 1:
            out, final_state = gated_delta_rule_recurrent(q, k, v, g, beta, initial_state=state)
        else:
            out, final_state = gated_delta_rule_chunked(
                q, k, v, g, beta, self.chunk_size, initial_state=state
            )
        if inference_context is not None:
            self._store_states(inference_context, qkv_t, conv_history, final_state)
        normed = self.out_norm(out.to(qkv.dtype))
        gate = self.act(z.reshape(b, length, self.nv_local, self.dv).to(scan_dtype))
        out = (normed.to(scan_dtype) * gate).to(qkv.dtype).reshape(b, length, self.v_local)
        return self.out_proj(out.transpose(0, 1))

    # ------------------------------------------------------------------ generation state
    def _cached_states(self, inference_context, batch: int):
        """(conv history [b, channels, kernel - 1], recurrent state [b, heads, dk, dv]) kept for
        this layer, or (None, None) at the start of a sequence."""
        if inference_context is None or inference_context.sequence_len_offset == 0:
            return None, None
        states = inference_context.ssm_states.get(self.layer_number)
        if states is None:
            raise ValueError(
                f"gated delta net layer {self.layer_number}: no cached state at sequence offset "
                f"{inference_context.sequence_len_offset}; the prompt must run through the model "
                "with this inference context first"
            )
        conv_history, state = states
        if conv_history.shape[0] != batch:
            raise ValueError(
                f"gated delta net layer {self.layer_number}: cached state for batch "
                f"{conv_history.shape[0]}, got batch {batch}"
            )
        return conv_history, state

    def _store_states(self, inference_context, qkv_t, conv_history, final_state) -> None:
        keep = self.kernel - 1
        if conv_history is None:
            conv_history = qkv_t.new_zeros(qkv_t.shape[0], qkv_t.shape[1], keep)
        window = torch.cat([conv_history.to(qkv_t.dtype), qkv_t], dim=-1)[..., -keep:]
        inference_context.ssm_states[self.layer_number] = (window.detach(), final_state.detach())
