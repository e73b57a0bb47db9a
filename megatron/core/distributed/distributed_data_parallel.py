"""Data-parallel wrapper with contiguous gradient buffers (Megatron-style DDP).

Every trainable parameter gets ``param.main_grad``, a view into one flat buffer per
(param dtype, grad dtype) pair, laid out in reverse registration order (the order in which
backward produces gradients). After all micro-batches, :meth:`finish_grad_sync` reduces each
buffer across the data-parallel group in a single collective.

When the grad dtype equals the param dtype, ``param.grad`` *is* the ``main_grad`` view: autograd
accumulates into an existing ``.grad`` in place, so no copy and no hook are needed. Otherwise
(e.g. bf16 params with fp32 gradient accumulation) a post-accumulate hook adds ``param.grad``
into ``main_grad`` and frees it.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist


@dataclass
class DistributedDataParallelConfig:
    """Options of the data-parallel gradient reduction."""

    grad_reduce_in_fp32: bool = False
    """Keep and reduce gradients in fp32 even when params are fp16/bf16
    (``--accumulate-allreduce-grads-in-fp32``)."""
    average_in_collective: bool = False
    """Average inside the collective instead of pre-scaling by 1/DP (``--ddp-average-in-collective``)."""
    overlap_grad_reduce: bool = False
    """Launch bucket reductions during backward (``--overlap-grad-reduce``); not implemented yet."""
    use_distributed_optimizer: bool = False
    """Reduce-scatter for the distributed optimizer; not implemented yet."""
    bucket_size: Optional[int] = None
    """Elements per bucket (``--ddp-bucket-size``); one bucket per buffer when None."""
    check_for_nan_in_grad: bool = False
    """Raise if a reduced gradient holds NaN/Inf."""

    def __post_init__(self):
        if self.overlap_grad_reduce or self.use_distributed_optimizer:
            raise ValueError("not supported yet: --overlap-grad-reduce / --use-distributed-optimizer")


class GradBuffer:
    """One contiguous gradient buffer for parameters of one dtype."""

    def __init__(self, params: List[torch.nn.Parameter], grad_dtype: torch.dtype):
        self.params = params
        self.grad_dtype = grad_dtype
        numel = sum(p.numel() for p in params)
        device = params[0].device
        self.data = torch.zeros(numel, dtype=grad_dtype, device=device)
        self.aliased = all(p.dtype == grad_dtype for p in params)
        offset = 0
        for p in params:
            p.main_grad = self.data[offset:offset + p.numel()].view_as(p)
            offset += p.numel()

    def attach(self):
        """Point ``param.grad`` at the buffer (aliased case) so autograd accumulates in place."""
        if self.aliased:
            for p in self.params:
                p.grad = p.main_grad

    def zero(self):
        self.data.zero_()
        self.attach()


class DistributedDataParallel(torch.nn.Module):
    """Wraps a model chunk; reduces its gradients over ``data_parallel_group``.

    ``module`` is the wrapped model. Parameters marked ``allreduce = False`` (expert params) are
    left out of the dense buffers (none exist until MoE lands).
    """

    def __init__(self, config: DistributedDataParallelConfig, module: torch.nn.Module,
                 data_parallel_group: Optional[dist.ProcessGroup] = None):
        super().__init__()
        self.config = config
        self.module = module
        self.data_parallel_group = data_parallel_group
        self.dp_size = dist.get_world_size(data_parallel_group) if dist.is_initialized() else 1
        by_dtype: Dict[Tuple[torch.dtype, torch.dtype], List[torch.nn.Parameter]] = {}
        seen = set()
        for param in reversed(list(module.parameters())):
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            grad_dtype = torch.float32 if config.grad_reduce_in_fp32 else param.dtype
            by_dtype.setdefault((param.dtype, grad_dtype), []).append(param)
        self.buffers = [GradBuffer(params, grad_dtype) for (_, grad_dtype), params in by_dtype.items()]
        self._hooks = []
        for buffer in self.buffers:
            if not buffer.aliased:
                for p in buffer.params:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._accumulate_into_main_grad))
            buffer.attach()

    @staticmethod
    def _accumulate_into_main_grad(param: torch.nn.Parameter):
        param.main_grad.add_(param.grad)
        param.grad = None

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        """Gradients are only reduced by :meth:`finish_grad_sync`; nothing to switch off."""
        yield

    def zero_grad_buffer(self):
        """Zero every gradient buffer before a new iteration."""
        for buffer in self.buffers:
            buffer.zero()

    def start_grad_sync(self):
        """Without overlap the reduction happens in :meth:`finish_grad_sync`."""

    def finish_grad_sync(self):
        """Average gradients across the data-parallel group (one collective per buffer)."""
        if self.dp_size > 1:
            for buffer in self.buffers:
                if self.config.average_in_collective and dist.get_backend(self.data_parallel_group) == "nccl":
                    dist.all_reduce(buffer.data, op=dist.ReduceOp.AVG, group=self.data_parallel_group)
                else:
                    # gloo has no AVG: pre-scale then sum (same result up to rounding).
                    buffer.data.mul_(1.0 / self.dp_size)
                    dist.all_reduce(buffer.data, group=self.data_parallel_group)
        if self.config.check_for_nan_in_grad:
            for buffer in self.buffers:
                if not torch.isfinite(buffer.data).all():
                    raise RuntimeError("NaN or Inf found in the reduced gradients")

    def broadcast_params(self):
        """Make every DP replica start from the same weights (those of DP rank 0)."""
        if self.dp_size > 1:
            src = dist.get_global_rank(self.data_parallel_group, 0)
            for param in self.module.parameters():
                dist.broadcast(param.data, src=src, group=self.data_parallel_group)

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True):
        return self.module.load_state_dict(state_dict, strict=strict)

    def sharded_state_dict(self, *args, **kwargs):
        return self.module.sharded_state_dict(*args, **kwargs)
