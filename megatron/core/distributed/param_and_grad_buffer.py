"""Contiguous parameter and gradient buffers, split into buckets that are reduced as one unit.

One buffer holds the params of one (param dtype, grad dtype) pair in *reverse* registration
order, the order in which backward produces their gradients, so that a bucket's gradients are
complete early and its reduction can start while backward still runs.

Layout with the distributed optimizer (Megatron's padding, kept so that shard boundaries match
Megatron's): every param starts at a multiple of 64 elements and every bucket ends at a multiple
of lcm(DP, 128), so each of the DP ranks owns an equal, contiguous 1/DP slice of every bucket.
Without the distributed optimizer nothing is padded.

Each bucket reduces its gradient slice with one collective over the buffer's group: an
all-reduce (plain DDP) or a reduce-scatter into this rank's slice (distributed optimizer).
Gradients are pre-scaled by the buffer's ``gradient_scaling_factor`` (1/DP for dense params) and
summed, or, with ``average_in_collective``, averaged by the collective itself (the backend's AVG
when it has one; otherwise summed, then divided by the group size).

Sharded gradients (``shard_grads``: Megatron-FSDP's ``optim_grads`` strategy, ZeRO-2): the buffer
keeps only this rank's slice of every bucket's gradient (``grad_data`` is 1/DP of the layout,
fp32 when the gradients are). A bucket's full-size gradient storage is allocated when backward
first adds into it (``Bucket.main_grad_storage``; the fused linear layers ask for it through
``param.get_main_grad``, as with Megatron-FSDP), reduce-scattered into a scratch slice as soon as
every param of the bucket has its gradient, on every micro-batch, added into the kept slice and
dropped. A bucket still allocated when the iteration's reduction is finished (a param whose
gradient came late, or never) is reduced then. Between reductions each ``param.main_grad`` is
the part of the param this rank owns (a 1-D view of the kept slice, empty when none): what the
reductions after DP (the tied-embedding and sequence-parallel all-reduces) and the optimizer
read.

With several distributed-optimizer instances (``inter_group``) the buffer's group is the DP
ranks of one instance: the reduce-scattered slice is then all-reduced over the ranks holding the
same slice in the other instances (with one rank per instance, the whole bucket is), so that it
sums the gradients of every DP rank.

With the distributed optimizer each bucket also all-gathers the updated param slices after the
optimizer step; with ``--overlap-param-gather`` those gathers are launched asynchronously and
the DDP wrapper waits for a bucket in a forward pre-hook of the first module using its params.
"""

from __future__ import annotations

import math
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel import collectives

PARAM_START_ALIGNMENT = 64
"""With the distributed optimizer each param starts at a multiple of this many elements."""
BUCKET_END_ALIGNMENT = 128
"""With the distributed optimizer each bucket ends at a multiple of lcm(DP, this)."""


def _pad(value: int, multiple: int) -> int:
    return int(math.ceil(value / multiple)) * multiple


def bucket_end_multiple(dp_size: int) -> int:
    """Each bucket's padded size is a multiple of this (distributed optimizer only)."""
    return math.lcm(dp_size, BUCKET_END_ALIGNMENT)


def _requires_own_bucket(param: torch.nn.Parameter, use_distributed_optimizer: bool) -> bool:
    # The tied embedding exists on the first and the last pipeline stage; its gradient is summed
    # over both after the DP reduction. With reduce-scatter only the owned slice is reduced, so
    # both copies must be sharded identically: alone in a bucket that starts at offset 0.
    return use_distributed_optimizer and bool(getattr(param, "shared_embedding", False))


def buffer_layout(
    params: List[torch.Tensor],
    bucket_size: Optional[int],
    use_distributed_optimizer: bool,
    dp_size: int,
):
    """Where ``params`` (in buffer order) lie in their buffer: (each param's start, and per
    bucket (first param index, last + 1, start, unpadded end, padded end))."""
    starts, bucket_bounds = [], []
    offset = 0
    bucket_start, bucket_first = 0, 0

    def close_bucket(last_exclusive: int, end: int):
        nonlocal offset, bucket_start, bucket_first
        padded_end = end
        if use_distributed_optimizer:
            padded_end = bucket_start + _pad(end - bucket_start, bucket_end_multiple(dp_size))
        bucket_bounds.append((bucket_first, last_exclusive, bucket_start, end, padded_end))
        offset = padded_end
        bucket_start, bucket_first = padded_end, last_exclusive

    for i, param in enumerate(params):
        own = _requires_own_bucket(param, use_distributed_optimizer)
        if own and i > bucket_first:
            close_bucket(i, offset)
        start = _pad(offset, PARAM_START_ALIGNMENT) if use_distributed_optimizer else offset
        end = start + param.numel()
        starts.append(start)
        offset = end
        if own or (bucket_size is not None and end - bucket_start >= bucket_size):
            close_bucket(i + 1, end)
    if bucket_first < len(params):
        close_bucket(len(params), offset)
    return starts, bucket_bounds


class Bucket:
    """A contiguous range of one buffer whose gradients are reduced by one collective."""

    def __init__(
        self,
        buffer: "ParamAndGradBuffer",
        index: int,
        params: List[torch.nn.Parameter],
        offset: int,
        numel: int,
        numel_unpadded: int,
    ):
        self.buffer = buffer
        self.index = index
        self.params = params
        self.offset = offset
        """Start of the bucket in the buffer."""
        self.numel = numel
        """Size including the end padding (a multiple of DP with the distributed optimizer)."""
        self.numel_unpadded = numel_unpadded
        """Size up to the end of the last param (before the end padding)."""
        self.grad_data: Optional[torch.Tensor] = None
        """The bucket's full-size gradient; with sharded gradients only while allocated."""
        self.grad_shard: Optional[torch.Tensor] = None
        """With sharded gradients: this rank's kept slice (a view of ``buffer.grad_data``)."""
        if buffer.grads_sharded:
            start = offset // buffer.dp_size
            self.grad_shard = buffer.grad_data[start : start + numel // buffer.dp_size]
        else:
            self.grad_data = buffer.grad_data[offset : offset + numel]
        self.param_data = (
            None if buffer.param_data is None else buffer.param_data[offset : offset + numel]
        )
        self.params_with_grad = set()
        self.work = None
        self.launched = False
        self.finished = False
        self._scratch: Optional[torch.Tensor] = None
        self._reducing: Optional[torch.Tensor] = None
        """With sharded gradients: the full-size storage being reduce-scattered (kept alive until
        the collective is done)."""
        self.param_gather_work = None
        """The pending asynchronous all-gather of the updated params (--overlap-param-gather)."""
        self._gather_input: Optional[torch.Tensor] = None

    # ---------------------------------------------------------------- shards
    @property
    def shard_size(self) -> int:
        return self.numel // self.buffer.dp_size

    def shard_range(self, dp_rank: int):
        """[start, end) of ``dp_rank``'s slice, relative to the bucket start."""
        return dp_rank * self.shard_size, (dp_rank + 1) * self.shard_size

    def local_grad_shard(self) -> torch.Tensor:
        if self.grad_shard is not None:
            return self.grad_shard
        start, end = self.shard_range(self.buffer.dp_rank)
        return self.grad_data[start:end]

    # ---------------------------------------------------------------- sharded gradients
    def main_grad_storage(self) -> torch.Tensor:
        """The bucket's full-size gradient, allocated (zeros) if backward has not added into it
        since its last reduction; every param's ``main_grad`` then views it."""
        if self.grad_data is None:
            buf = self.buffer
            self.grad_data = torch.zeros(
                self.numel, dtype=buf.grad_dtype, device=buf.grad_data.device
            )
            for param in self.params:
                start = buf.param_index_map[param][0] - self.offset
                param.main_grad = self.grad_data[start : start + param.numel()].view(param.shape)
        return self.grad_data

    def expose_owned_grads(self):
        """Point each param's ``main_grad`` at the part of it this rank owns in the kept slice."""
        buf = self.buffer
        own_start, own_end = self.shard_range(buf.dp_rank)
        for param in self.params:
            start, end, _ = buf.param_index_map[param]
            lo = max(start - self.offset, own_start)
            hi = max(lo, min(end - self.offset, own_end))
            param.main_grad = self.grad_shard[lo - own_start : hi - own_start]

    def _start_sharded_reduction(self):
        """Reduce-scatter what the bucket's storage holds into a scratch slice and let the
        storage go (sharded gradients); a no-op when nothing was added since the last one."""
        self._finish_sharded_reduction()
        if self.grad_data is None:
            return
        buf = self.buffer
        if buf.check_local_grads is not None:
            buf.check_local_grads(self.index, self.grad_data)
        if buf.gradient_scaling_factor != 1.0:
            self.grad_data.mul_(buf.gradient_scaling_factor)
        self._reducing, self.grad_data = self.grad_data, None
        self.expose_owned_grads()
        self._scratch = torch.empty(
            self.shard_size, dtype=self._reducing.dtype, device=self._reducing.device
        )
        self.work = collectives.reduce_scatter_tensor(
            self._scratch, self._reducing, buf.dp_group, async_op=True, op=buf.reduce_op()
        )
        if not buf.overlap:
            self._finish_sharded_reduction()

    def _finish_sharded_reduction(self):
        """Wait for a pending reduce-scatter and add its slice into the kept one."""
        if self._scratch is None:
            return
        if self.work is not None:
            self.work.wait()
            self.work = None
        buf = self.buffer
        scratch, self._scratch, self._reducing = self._scratch, None, None
        if buf.inter_size > 1:
            collectives.all_reduce(scratch, buf.inter_group, op=buf.reduce_op())
        if buf.average_in_collective and not buf.native_avg:
            scratch.mul_(1.0 / (buf.dp_size * buf.inter_size))
        self.grad_shard.add_(scratch)

    def local_param_shard(self) -> torch.Tensor:
        start, end = self.shard_range(self.buffer.dp_rank)
        return self.param_data[start:end]

    # ---------------------------------------------------------------- reduction
    def reset(self):
        self.params_with_grad = set()
        self.work = None
        self.launched = False
        self.finished = False
        self._scratch = None
        if self.buffer.grads_sharded:
            self.grad_data = self._reducing = None
            self.expose_owned_grads()

    def start_grad_sync(self):
        """Launch this bucket's reduction (asynchronously when the DDP overlaps it with
        backward)."""
        if self.buffer.grads_sharded:
            self._start_sharded_reduction()
            return
        if self.launched:
            raise RuntimeError(
                f"gradient reduction of bucket {self.index} was started twice in one iteration; "
                "call zero_grad_buffer() before the next iteration"
            )
        self.launched = True
        buf = self.buffer
        if buf.check_local_grads is not None:
            buf.check_local_grads(self.index, self.grad_data)
        if buf.gradient_scaling_factor != 1.0:
            self.grad_data.mul_(buf.gradient_scaling_factor)
        if buf.dp_size * buf.inter_size == 1:
            self.finished = True
            return
        op = buf.reduce_op()
        async_op = buf.overlap
        if buf.dp_size == 1:  # one rank per instance: the instances reduce the whole bucket
            self.work = collectives.all_reduce(
                self.grad_data, buf.inter_group, op=op, async_op=True
            )
        elif buf.use_distributed_optimizer:
            # The output is a separate tensor: not every backend accepts an output that aliases
            # the input; it is copied into this rank's slice when the collective is done.
            self._scratch = torch.empty(
                self.shard_size, dtype=self.grad_data.dtype, device=self.grad_data.device
            )
            self.work = collectives.reduce_scatter_tensor(
                self._scratch, self.grad_data, buf.dp_group, async_op=True, op=op
            )
        else:
            self.work = collectives.all_reduce(self.grad_data, buf.dp_group, op=op, async_op=True)
        if not async_op:
            self.finish_grad_sync()

    def finish_grad_sync(self):
        """Wait for the reduction (launching it first if backward never did)."""
        if self.buffer.grads_sharded:
            self._start_sharded_reduction()  # what backward left in the storage, if anything
            self._finish_sharded_reduction()
            return
        if self.finished:
            return
        if not self.launched:
            self.start_grad_sync()
            if self.finished:
                return
        self.finished = True
        if self.work is not None:
            self.work.wait()
            self.work = None
        buf = self.buffer
        target = self.local_grad_shard() if buf.use_distributed_optimizer else self.grad_data
        if self._scratch is not None:
            target.copy_(self._scratch)
            self._scratch = None
            if buf.inter_size > 1:
                collectives.all_reduce(target, buf.inter_group, op=buf.reduce_op())
        if buf.average_in_collective and not buf.native_avg:
            target.mul_(1.0 / (buf.dp_size * buf.inter_size))

    # ---------------------------------------------------------------- param all-gather
    @torch.no_grad()
    def start_param_gather(self, async_op: bool):
        """All-gather every rank's updated slice into ``param_data`` (distributed optimizer).

        The input is a copy of this rank's slice: the output buffer contains that slice, and an
        input aliasing the output is not accepted by every backend. With ``async_op`` the gather
        stays pending until :meth:`finish_param_gather`.
        """
        self.finish_param_gather()
        shard = self.local_param_shard().clone()
        work = collectives.all_gather_into_tensor(
            self.param_data, shard, self.buffer.dp_group, async_op=async_op
        )
        if async_op and work is not None:
            self.param_gather_work = work
            self._gather_input = shard

    def finish_param_gather(self):
        """Wait for a pending param all-gather (nothing to do when none is pending)."""
        if self.param_gather_work is not None:
            self.param_gather_work.wait()
            self.param_gather_work = None
            self._gather_input = None

    def register_grad_ready(self, param: torch.nn.Parameter):
        """Called by the backward hook on the last micro-batch (with sharded gradients, on every
        micro-batch): launch once every param has its grad."""
        if self.buffer.grads_sharded:
            # Every micro-batch reduces; a param seen twice before the bucket is complete (a
            # weight used twice) changes nothing, one whose gradient comes after the reduction
            # re-allocates the storage, which the iteration's finish_grad_sync reduces.
            self.params_with_grad.add(param)
            if len(self.params_with_grad) == len(self.params):
                self.params_with_grad = set()
                self._start_sharded_reduction()
            return
        if param in self.params_with_grad:
            raise RuntimeError(
                "a parameter received its gradient twice in the last micro-batch while "
                "--overlap-grad-reduce is on (its bucket may already be reducing)"
            )
        self.params_with_grad.add(param)
        if len(self.params_with_grad) == len(self.params):
            self.start_grad_sync()


class ParamAndGradBuffer:
    """Flat gradient buffer (and, for the distributed optimizer, flat param buffer) of one dtype
    pair.

    ``params`` are given in buffer order (reverse registration order). After construction:
    ``param.main_grad`` is a view of ``grad_data``; with ``use_distributed_optimizer`` the param's
    storage (``param.data``) is a view of ``param_data``, so that the updated shards can be
    all-gathered in place.

    ``gradient_scaling_factor`` multiplies the gradients before the collective; None means
    1/DP (``dp_group``'s size times ``inter_group``'s), or 1 with ``average_in_collective``.
    ``inter_group``: with several distributed-optimizer instances, the ranks holding this rank's
    slice in the other instances (``dp_group`` is then the DP ranks of one instance).
    ``shard_grads``: keep only this rank's slice of the gradients (see the module docstring); with
    the distributed optimizer over more than one rank only, otherwise ignored.
    """

    def __init__(
        self,
        params: List[torch.nn.Parameter],
        param_dtype: torch.dtype,
        grad_dtype: torch.dtype,
        dp_group,
        bucket_size: Optional[int],
        use_distributed_optimizer: bool,
        average_in_collective: bool,
        overlap: bool,
        gradient_scaling_factor: Optional[float] = None,
        inter_group=None,
        shard_grads: bool = False,
    ):
        self.params = params
        self.param_dtype = param_dtype
        self.grad_dtype = grad_dtype
        self.dp_group = dp_group
        self.dp_size = collectives.group_size(dp_group)
        self.dp_rank = collectives.group_rank(dp_group)
        self.use_distributed_optimizer = use_distributed_optimizer
        self.average_in_collective = average_in_collective
        self.inter_group = inter_group
        self.inter_size = collectives.group_size(inter_group)
        if self.inter_size > 1 and not use_distributed_optimizer:
            raise ValueError("distributed-optimizer instances need the distributed optimizer")
        self.native_avg = collectives.has_avg_op(dp_group) and (
            self.inter_size == 1 or collectives.has_avg_op(inter_group)
        )
        self.grads_sharded = bool(shard_grads and use_distributed_optimizer and self.dp_size > 1)
        self.check_local_grads: Optional[Callable[[int, torch.Tensor], None]] = None
        """Called with (bucket index, bucket gradients) before each bucket's reduction: the
        DDP's result validation (NaN/Inf and large gradients, through the rerun machine)."""
        if gradient_scaling_factor is None:
            gradient_scaling_factor = (
                1.0 if average_in_collective else 1.0 / (self.dp_size * self.inter_size)
            )
        self.gradient_scaling_factor = gradient_scaling_factor
        self.overlap = overlap
        self.param_index_map = {}
        """param -> (start, end, bucket index) in the buffer."""

        self.bucket_size = bucket_size
        """The bucket size the layout was made with (None: one bucket)."""
        starts, bucket_bounds = buffer_layout(
            params, bucket_size, use_distributed_optimizer, self.dp_size
        )
        offset = bucket_bounds[-1][4] if bucket_bounds else 0
        self.numel = offset
        self.numel_unpadded = bucket_bounds[-1][3] if bucket_bounds else 0

        device = params[0].device
        kept = self.numel // self.dp_size if self.grads_sharded else self.numel
        self.grad_data = torch.zeros(kept, dtype=grad_dtype, device=device)
        """The gradients this rank keeps: the whole layout, or with sharded gradients the
        concatenation of this rank's slice of each bucket."""
        self.param_data = None
        if use_distributed_optimizer:
            self.param_data = torch.zeros(self.numel, dtype=param_dtype, device=device)
        # Sharded: autograd's .grad is added into the bucket's storage by the DDP hook, which
        # allocates it (there is no persistent full-size view for .grad to alias).
        self.aliased = not self.grads_sharded and all(p.dtype == grad_dtype for p in params)

        self.buckets: List[Bucket] = []
        for b, (first, last, b_start, b_unpadded_end, b_end) in enumerate(bucket_bounds):
            for i in range(first, last):
                self.param_index_map[params[i]] = (starts[i], starts[i] + params[i].numel(), b)
        if self.param_data is not None:
            with torch.no_grad():
                for param in params:
                    start, end, _ = self.param_index_map[param]
                    self.param_data[start:end].copy_(param.data.view(-1))
                    param.data = self.param_data[start:end].view(param.shape)
        if not self.grads_sharded:
            for param in params:
                start, end, _ = self.param_index_map[param]
                param.main_grad = self.grad_data[start:end].view(param.shape)
        for b, (first, last, b_start, b_unpadded_end, b_end) in enumerate(bucket_bounds):
            self.buckets.append(
                Bucket(
                    self, b, params[first:last], b_start, b_end - b_start, b_unpadded_end - b_start
                )
            )
        self.param_to_bucket = {p: self.buckets[self.param_index_map[p][2]] for p in params}
        if self.grads_sharded:
            for bucket in self.buckets:
                bucket.expose_owned_grads()

    def main_grad_of(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The full-size ``main_grad`` that backward adds ``param``'s gradient into (with sharded
        gradients its bucket's storage is allocated first)."""
        if self.grads_sharded:
            self.param_to_bucket[param].main_grad_storage()
        return param.main_grad

    def reduce_op(self):
        """SUM, or AVG when the collectives average and the backend has it."""
        if self.average_in_collective and self.native_avg:
            return dist.ReduceOp.AVG
        return dist.ReduceOp.SUM

    @property
    def data(self) -> torch.Tensor:
        """The flat gradient buffer (name kept for callers that scale all gradients)."""
        return self.grad_data

    def attach(self):
        """Point ``param.grad`` at the buffer (aliased case) so autograd accumulates in place."""
        if self.aliased:
            for p in self.params:
                p.grad = p.main_grad

    def zero(self):
        self.grad_data.zero_()
        for bucket in self.buckets:
            bucket.reset()
        self.attach()

    def start_grad_sync(self):
        for bucket in self.buckets:
            if not bucket.launched:
                bucket.start_grad_sync()

    def finish_grad_sync(self):
        for bucket in self.buckets:
            bucket.finish_grad_sync()

    def start_param_gather(self, async_op: bool):
        # Reverse bucket order is forward order: the first layers' params arrive first.
        for bucket in reversed(self.buckets):
            bucket.start_param_gather(async_op)

    def finish_param_gather(self):
        for bucket in self.buckets:
            bucket.finish_param_gather()
