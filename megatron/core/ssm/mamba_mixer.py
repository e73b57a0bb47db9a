"""Megatron's ``MambaMixer`` (a Mamba-2 block) in plain PyTorch, with its parameter names.

    in_proj  -> [z, x, B, C, dt]
    conv1d   -> silu(depthwise causal conv of [x, B, C])
    SSD scan -> y = SSM(x, softplus(dt + dt_bias), A = -exp(A_log), B, C) + D * x
    norm     -> RMSNorm(y * silu(z)) per group
    out_proj

Tensor parallelism as Megatron shards it: heads and groups are split over the TP ranks, so each
rank runs whole heads with their groups' B and C and needs no communication inside the block.
``in_proj`` is column-parallel: its output is five parts of different sizes, each split over
TP, so rank r holds [z_r; x_r; B_r; C_r; dt_r] (the ``partition_sizes`` attribute tells the
checkpoint code those blocks); ``conv1d`` likewise holds [x_r; B_r; C_r]; ``dt_bias``, ``A_log``,
``D`` and the norm's weight are split in one piece; ``out_proj`` is row-parallel. With sequence
parallelism ``in_proj`` gathers the sequence and ``out_proj`` reduce-scatters it, as attention
does. Context parallelism: :mod:`.mamba_context_parallel` (an all-to-all over the CP group
around the convolution and the scan, as Megatron's). Every rank draws the full (TP=1)
parameters from the layer's generator and keeps its shard, so any TP layout starts from the
one-process weights.

The scan and the convolution use the ``mamba_ssm`` / ``causal_conv1d`` kernels when those are
installed and the tensors are on CUDA, and :mod:`.ssd`'s PyTorch code otherwise (see
:mod:`.optional_kernels`); single-token decode steps use the recurrence.
"""

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.parameters import (
    param_device,
    set_default_tensor_parallel_attributes,
)
from megatron.core.tensor_parallel.process_groups import resolve_pg_collection
from megatron.core.transformer.module import MegatronModule

from .mamba_context_parallel import MambaContextParallel
from .optional_kernels import causal_conv1d_silu, chunk_scan
from .ssd import gated_rms_norm, ssd_recurrent


@dataclass
class MambaMixerSubmodules:
    """The input and output projections (megatron-core's spec fields)."""

    in_proj: type = ColumnParallelLinear
    out_proj: type = RowParallelLinear


def shard_parts(
    full: torch.Tensor, dim: int, sizes: Sequence[int], rank: int, size: int
) -> torch.Tensor:
    """Rank ``rank``'s shard of a tensor made of parts of ``sizes`` along ``dim``, each part split
    over ``size`` ranks: the rank's piece of every part, in part order."""
    pieces = []
    for part in torch.split(full, list(sizes), dim=dim):
        pieces.append(torch.chunk(part, size, dim=dim)[rank])
    return torch.cat(pieces, dim=dim).contiguous()


def _tp_param(
    shape,
    config,
    draw,
    tp_rank: int,
    tp_size: int,
    parts: Optional[List[int]] = None,
    dim: int = 0,
) -> torch.nn.Parameter:
    """This rank's shard of a parameter whose full value ``draw(tensor)`` fills (drawn whole on
    the CPU, so that every TP layout draws the same numbers); ``parts``: the sizes of the parts
    each split over TP (one part if None)."""
    parts = list(parts or [shape[dim]])
    if any(p % tp_size for p in parts):
        raise ValueError(
            f"Mamba parameter parts {parts} are not divisible by the tensor-parallel size "
            f"{tp_size} (--tensor-model-parallel-size)"
        )
    local_shape = list(shape)
    local_shape[dim] = shape[dim] // tp_size
    device = param_device(config)
    if device.type == "meta":
        local = torch.empty(local_shape, dtype=config.params_dtype, device=device)
    else:
        master_dtype = torch.float64 if config.params_dtype == torch.float64 else torch.float32
        master = torch.empty(
            tuple(shape),
            dtype=master_dtype,
            device="cpu",  # host: drawn by the CPU generator
        )
        with torch.no_grad():
            draw(master)
        local = shard_parts(master, dim, parts, tp_rank, tp_size).to(config.params_dtype)
    param = torch.nn.Parameter(local)
    set_default_tensor_parallel_attributes(param)
    if tp_size > 1:
        param.tensor_model_parallel = True
        param.partition_dim = dim
        if len(parts) > 1:
            param.partition_sizes = [p // tp_size for p in parts]
    param.allreduce = True
    return param


class MambaConv1d(torch.nn.Module):
    """The depthwise causal convolution's parameters (``conv1d.weight`` [d, 1, k] and
    ``conv1d.bias`` [d], as ``nn.Conv1d`` names them)."""

    def __init__(self, weight: torch.nn.Parameter, bias: torch.nn.Parameter):
        super().__init__()
        self.weight = weight
        self.bias = bias


class GatedRMSNorm(torch.nn.Module):
    """``norm.weight`` [d_inner / TP]: RMSNorm(y * silu(z)) over groups of ``group_size``."""

    def __init__(self, weight: torch.nn.Parameter, group_size: int, eps: float = 1e-5):
        super().__init__()
        self.weight = weight
        self.group_size = group_size
        self.eps = eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(y, z, self.weight, self.group_size, self.eps)


class MambaMixer(MegatronModule):
    """One Mamba-2 mixer on [s, b, h] (s/TP under sequence parallelism); returns
    ``(output, bias or None)`` like the attention modules. Sizes come from the config
    (``mamba_state_dim``, ``mamba_head_dim``, ``mamba_num_groups``, ``mamba_num_heads``, else
    ``expand * hidden_size / mamba_head_dim`` heads); Megatron's constructor defaults otherwise.

    Generation (``inference_context``): the conv state (the last ``d_conv - 1`` inputs of the
    convolution) and the SSM state of each layer are kept in the context's
    ``ssm_states[layer_number]``; a prompt fills them, each later token updates them with one
    step of the recurrence.
    """

    def __init__(
        self,
        config,
        submodules: Optional[MambaMixerSubmodules] = None,
        d_model: Optional[int] = None,
        d_conv: int = 4,
        conv_init: Optional[float] = None,
        expand: int = 2,
        A_init_range=(1, 16),
        dt_min: float = 0.001,
        dt_max: float = 0.1,
        dt_init_floor: float = 1e-4,
        chunk_size: int = 128,
        layer_number: Optional[int] = None,
        pg_collection=None,
    ):
        super().__init__(config)
        submodules = submodules or MambaMixerSubmodules()
        pgs = resolve_pg_collection(config, pg_collection)
        self.d_model = d_model if d_model is not None else config.hidden_size
        self.d_conv = d_conv
        self.d_state = config.mamba_state_dim
        self.headdim = config.mamba_head_dim
        self.ngroups = config.mamba_num_groups
        if config.mamba_num_heads is not None:
            self.nheads = config.mamba_num_heads
            self.d_inner = self.nheads * self.headdim
        else:
            self.d_inner = expand * self.d_model
            if self.d_inner % self.headdim:
                raise ValueError(
                    f"Mamba inner size {self.d_inner} (2 x --hidden-size) is not divisible by "
                    f"--mamba-head-dim {self.headdim}"
                )
            self.nheads = self.d_inner // self.headdim
        if self.nheads % self.ngroups:
            raise ValueError(
                f"Mamba heads ({self.nheads}) must be divisible by --mamba-num-groups "
                f"({self.ngroups})"
            )
        tp_size, tp_rank = pgs.tp_size, pgs.tp_rank
        for what, count in (("heads", self.nheads), ("groups (--mamba-num-groups)", self.ngroups)):
            if count % tp_size:
                raise ValueError(
                    f"Mamba {what} ({count}) must be divisible by --tensor-model-parallel-size "
                    f"({tp_size})"
                )
        self.layer_number = layer_number
        self.chunk_size = chunk_size
        self.nheads_local = self.nheads // tp_size
        self.ngroups_local = self.ngroups // tp_size
        self.d_inner_local = self.d_inner // tp_size
        self.cp = MambaContextParallel(
            pgs.cp, self.nheads_local, self.ngroups_local, self.headdim, self.d_state, tp_size
        )
        gn = self.ngroups * self.d_state

        # Built in Megatron's order (the order of the draws from the layer's generator).
        in_parts = [self.d_inner, self.d_inner, gn, gn, self.nheads]  # z x B C dt
        self.in_proj = submodules.in_proj(
            self.d_model,
            sum(in_parts),
            config=config,
            init_method=config.init_method,
            bias=False,
            gather_output=False,
            skip_weight_param_allocation=True,
            tp_group=pgs.tp,
        )
        self.in_proj.weight = _tp_param(
            (sum(in_parts), self.d_model), config, config.init_method, tp_rank, tp_size, in_parts
        )
        conv_parts = [self.d_inner, gn, gn]  # x B C
        conv_dim = sum(conv_parts)

        def conv_weight(w):
            torch.nn.init.kaiming_uniform_(w, a=math.sqrt(5))
            if conv_init is not None:
                torch.nn.init.uniform_(w, -conv_init, conv_init)

        bound = 1 / math.sqrt(d_conv)
        self.conv1d = MambaConv1d(
            _tp_param((conv_dim, 1, d_conv), config, conv_weight, tp_rank, tp_size, conv_parts),
            _tp_param(
                (conv_dim,),
                config,
                lambda b: torch.nn.init.uniform_(b, -bound, bound),
                tp_rank,
                tp_size,
                conv_parts,
            ),
        )

        def dt_bias(t):
            dt = torch.exp(
                torch.rand(t.shape, dtype=t.dtype, device=t.device)
                * (math.log(dt_max) - math.log(dt_min))
                + math.log(dt_min)
            ).clamp(min=dt_init_floor)
            t.copy_(dt + torch.log(-torch.expm1(-dt)))  # the inverse of softplus

        self.dt_bias = _tp_param((self.nheads,), config, dt_bias, tp_rank, tp_size)
        self.A_log = _tp_param(
            (self.nheads,),
            config,
            lambda t: t.copy_(torch.log(torch.empty_like(t).uniform_(*A_init_range))),
            tp_rank,
            tp_size,
        )
        self.D = _tp_param((self.nheads,), config, torch.nn.init.ones_, tp_rank, tp_size)
        self.norm = GatedRMSNorm(
            _tp_param((self.d_inner,), config, torch.nn.init.ones_, tp_rank, tp_size),
            group_size=self.d_inner // self.ngroups,
        )
        self.out_proj = submodules.out_proj(
            self.d_inner,
            self.d_model,
            config=config,
            init_method=config.output_layer_init_method,
            bias=False,
            input_is_parallel=True,
            skip_bias_add=True,
            tp_group=pgs.tp,
        )

    def forward(self, hidden_states: torch.Tensor, inference_context=None, **kwargs):
        """[s, b, h] -> (out [s, b, h], None)."""
        zxbcdt, _ = self.in_proj(hidden_states)  # [L, b, local parts]
        gn = self.ngroups_local * self.d_state
        z, xbc, dt = torch.split(
            zxbcdt, [self.d_inner_local, self.d_inner_local + 2 * gn, self.nheads_local], dim=-1
        )
        cp = self.cp
        if cp.size > 1 and inference_context is not None:
            raise ValueError(
                "Mamba layers generate at --context-parallel-size 1 only (the state caches "
                "hold whole sequences)"
            )
        # With CP: the whole sequence of this CP rank's heads (x, B, C and dt only; see
        # mamba_context_parallel for why z stays).
        xbc, dt = cp.to_head_sharded(xbc, dt)
        xbc, dt = xbc.transpose(0, 1), dt.transpose(0, 1)  # [b, L, ...]
        b, length, _ = xbc.shape
        gn = cp.ngroups * self.d_state
        conv_history, ssm_state = self._cached_states(inference_context, b)

        xbc_t = xbc.transpose(1, 2)  # [b, conv_dim, L]
        xbc = causal_conv1d_silu(
            xbc_t,
            cp.conv_slice(self.conv1d.weight),
            cp.conv_slice(self.conv1d.bias),
            history=conv_history,
        ).transpose(1, 2)
        x, B, C = torch.split(xbc, [cp.d_inner, gn, gn], dim=-1)
        x = x.reshape(b, length, cp.nheads, self.headdim)
        B = B.reshape(b, length, cp.ngroups, self.d_state)
        C = C.reshape(b, length, cp.ngroups, self.d_state)
        dt = F.softplus(dt.float() + cp.head_slice(self.dt_bias).float())
        A = -torch.exp(cp.head_slice(self.A_log).float())
        D = cp.head_slice(self.D)
        if ssm_state is not None and length == 1:
            y, final_state = ssd_recurrent(x, dt, A, B, C, D, initial_state=ssm_state)
        else:
            y, final_state = chunk_scan(x, dt, A, B, C, self.chunk_size, D, initial_state=ssm_state)
        if inference_context is not None:
            self._store_states(inference_context, xbc_t, conv_history, final_state)
        y = cp.to_sequence_sharded(y.reshape(b, length, cp.d_inner).transpose(0, 1))
        y = self.norm(y, z)  # [L / CP, b, local channels]
        return self.out_proj(y)

    # ------------------------------------------------------------------ generation state
    def _cached_states(self, inference_context, batch: int):
        """(conv history [b, conv_dim, d_conv - 1], ssm state [b, h, p, n]) kept for this layer,
        or (None, None) at the start of a sequence."""
        if inference_context is None or inference_context.sequence_len_offset == 0:
            return None, None
        states = inference_context.ssm_states.get(self.layer_number)
        if states is None:
            raise ValueError(
                f"Mamba layer {self.layer_number}: no cached state at sequence offset "
                f"{inference_context.sequence_len_offset}; the prompt must run through the model "
                "with this inference context first"
            )
        conv_history, ssm_state = states
        if conv_history.shape[0] != batch:
            raise ValueError(
                f"Mamba layer {self.layer_number}: cached state for batch {conv_history.shape[0]}"
                f", got batch {batch}"
            )
        return conv_history, ssm_state

    def _store_states(self, inference_context, xbc_t, conv_history, final_state) -> None:
        keep = self.d_conv - 1
        if conv_history is None:
            conv_history = xbc_t.new_zeros(xbc_t.shape[0], xbc_t.shape[1], keep)
        window = torch.cat([conv_history.to(xbc_t.dtype), xbc_t], dim=-1)[..., -keep:]
        inference_context.ssm_states[self.layer_number] = (
            window.detach(),
            final_state.detach(),
        )
