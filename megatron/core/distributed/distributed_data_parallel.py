"""Data-parallel wrapper with contiguous, bucketed gradient buffers (Megatron-style DDP).

Every trainable parameter gets ``param.main_grad``, a view into one flat buffer per
(param dtype, grad dtype) pair, laid out in reverse registration order (the order in which
backward produces gradients) and split into buckets (``param_and_grad_buffer``).

When the grad dtype equals the param dtype, ``param.grad`` *is* the ``main_grad`` view: autograd
accumulates into an existing ``.grad`` in place. Otherwise (e.g. bf16 params with fp32 gradient
accumulation) a post-accumulate hook adds ``param.grad`` into ``main_grad`` and frees it.

Without ``overlap_grad_reduce`` every bucket is reduced in :meth:`finish_grad_sync`. With it, the
same post-accumulate hook, on the last micro-batch (outside :meth:`no_sync`), marks the param
ready and launches its bucket's asynchronous collective as soon as every param of the bucket has
its gradient, while backward continues; :meth:`finish_grad_sync` waits for them.

Gradient accumulation fusion (``config.gradient_accumulation_fusion``, see
``tensor_parallel.layers.LinearWithGradAccumulation``): the linear layers add their weight
gradients into ``main_grad`` themselves and give autograd no ``.grad``, so the hook above is never
called for those weights. Their readiness is marked by the layer's backward, which calls
``param.mark_main_grad_ready`` (set here on every param with ``overlap_grad_reduce``) right after
its add: no extra autograd node or hook per weight, one Python call per fused weight per
micro-batch only when overlapping, none otherwise. The hook stays registered on those weights for
any use of them outside the fused layer (it then accumulates as before).

With ``use_distributed_optimizer`` the buckets are padded for sharding, gradients are
reduce-scattered (each DP rank gets the reduced gradient of its slice only) and the params live
in a flat param buffer so that the distributed optimizer can all-gather the updated slices
(:meth:`start_param_sync`). With ``data_parallel_sharding_strategy="optim_grads"`` (ZeRO-2) the
buffers keep only this rank's slice of the gradients: every micro-batch reduce-scatters each
bucket as soon as it is complete and drops its full-size storage (``param_and_grad_buffer``); the
fused linear layers get that storage from ``param.get_main_grad()``. With ``overlap_param_gather``
those all-gathers are only launched after the optimizer step; a forward pre-hook on every module
that owns params waits for the buckets of its params, so the next forward overlaps with the
gathers of later layers.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.rerun_state_machine import RerunMode, RerunStateMachine
from megatron.core.tensor_parallel import collectives
from megatron.core.tensor_parallel.process_groups import ProcessGroupCollection
from megatron.core.utils import NonFiniteValueError

from .param_and_grad_buffer import ParamAndGradBuffer

LARGE_GRADS_FACTOR = 10.0
"""``--check-for-large-grads``: a gradient norm this many times the largest seen is flagged."""
DEFAULT_BUCKET_SIZE = 40_000_000
"""Elements per bucket with --overlap-grad-reduce when --ddp-bucket-size is not given (or 1M x
DP)."""


@dataclass
class DistributedDataParallelConfig:
    """Options of the data-parallel gradient reduction."""

    grad_reduce_in_fp32: bool = False
    """Keep and reduce gradients in fp32 even when params are fp16/bf16
    (``--accumulate-allreduce-grads-in-fp32``; off with ``--grad-reduce-in-bf16``)."""
    overlap_grad_reduce: bool = False
    """Launch each bucket's reduction from backward hooks on the last micro-batch
    (``--overlap-grad-reduce``)."""
    overlap_param_gather: bool = False
    """Launch the distributed optimizer's param all-gathers asynchronously after its step and
    wait for each bucket in a forward pre-hook of the first module using it
    (``--overlap-param-gather``; only meaningful with ``use_distributed_optimizer``)."""
    use_distributed_optimizer: bool = False
    """Pad and shard the buckets for the distributed optimizer; gradients are reduce-scattered
    (``--use-distributed-optimizer``)."""
    bucket_size: Optional[int] = None
    """Elements per bucket (``--ddp-bucket-size``). With overlap, None means
    max(40M, 1M x DP); without overlap each buffer is one bucket whatever this says."""
    average_in_collective: bool = False
    """Average inside the collective instead of pre-scaling by 1/DP
    (``--ddp-average-in-collective``)."""
    check_for_nan_in_grad: bool = False
    """Check the gradients for NaN/Inf (``--check-for-nan-in-loss-and-grad``): each bucket's
    local gradient norm before its reduction, through the rerun state machine when one is set
    (:meth:`DistributedDataParallel.set_rerun_state_machine`); otherwise raise if a reduced
    gradient holds NaN/Inf."""
    num_distributed_optimizer_instances: int = 1
    """Split the DP ranks into this many contiguous instances of the distributed optimizer:
    gradients are reduce-scattered within an instance and the slices all-reduced across
    instances (``--num-distributed-optimizer-instances``)."""
    data_parallel_sharding_strategy: str = "no_shard"
    """Megatron-FSDP's strategy (``--data-parallel-sharding-strategy`` with
    ``--use-megatron-fsdp``): ``optim_grads`` with the distributed optimizer keeps only this rank's
    slice of the gradients (ZeRO-2, see ``param_and_grad_buffer``); ``no_shard`` and ``optim``
    change nothing here (``optim_grads_params`` runs on FSDP2, not this wrapper)."""
    check_for_large_grads: bool = False
    """Flag a bucket whose local gradient norm is >= 10x the largest of its first 100 norms, as a
    non-fatal result for the rerun state machine (``--check-for-large-grads``)."""

    def __post_init__(self):
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ValueError(
                "--overlap-param-gather needs --use-distributed-optimizer (only sharded params "
                "are all-gathered)"
            )
        if self.num_distributed_optimizer_instances > 1 and not self.use_distributed_optimizer:
            raise ValueError(
                "--num-distributed-optimizer-instances > 1 needs --use-distributed-optimizer"
            )
        if self.data_parallel_sharding_strategy not in ("no_shard", "optim", "optim_grads"):
            raise ValueError(
                f"--data-parallel-sharding-strategy {self.data_parallel_sharding_strategy} is not "
                "run by DistributedDataParallel (optim_grads_params runs on FSDP2)"
            )
        if (
            self.data_parallel_sharding_strategy == "optim_grads"
            and not self.use_distributed_optimizer
        ):
            raise ValueError(
                "--data-parallel-sharding-strategy optim_grads needs --use-distributed-optimizer"
            )
        if self.bucket_size is not None and self.bucket_size <= 0:
            raise ValueError(f"--ddp-bucket-size must be positive, got {self.bucket_size}")

    @property
    def shard_grads(self) -> bool:
        """Gradients sharded over DP (ZeRO-2): ``optim_grads`` with the distributed optimizer."""
        return self.use_distributed_optimizer and self.data_parallel_sharding_strategy == (
            "optim_grads"
        )


def bucket_size_for_num_buckets(model_chunks: Sequence[torch.nn.Module], num_buckets: int) -> int:
    """The bucket size that splits the params of ``model_chunks`` into about ``num_buckets``
    buckets (``--ddp-num-buckets``)."""
    if num_buckets <= 0:
        raise ValueError(f"--ddp-num-buckets must be positive, got {num_buckets}")
    total = sum(p.numel() for chunk in model_chunks for p in chunk.parameters() if p.requires_grad)
    return max(total // num_buckets, 1)


class DistributedDataParallel(torch.nn.Module):
    """Wraps a model chunk; reduces its gradients over ``data_parallel_group``.

    ``module`` is the wrapped model. Parameters marked ``allreduce = False`` (the experts of an
    MoE layer, each held by one expert-parallel rank) live in buffers of their own, kept in
    ``expert_parallel_buffers``: their gradients are summed over ``expert_data_parallel_group``
    (the ranks holding the same experts) after the same 1/DP pre-scaling as the dense ones, since
    an expert's gradient already gathers the tokens that every rank of its expert-parallel group
    routed to it. Megatron's scaling: with ``average_in_collective`` the expert gradients are
    pre-scaled by expert-DP/DP and averaged over expert DP.
    """

    def __init__(
        self,
        config,
        ddp_config: DistributedDataParallelConfig,
        module: torch.nn.Module,
        disable_bucketing: bool = False,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        """Megatron-core's signature. ``config`` is the model's TransformerConfig (kept as
        ``self.config``; None for a module without one), ``ddp_config`` the reduction's options.
        ``pg_collection``: its ``dp_cp`` group reduces the dense gradients and its ``expt_dp`` group
        the expert ones; None takes both from the current ``parallel_state``, or, without one,
        the default group. ``disable_bucketing``: one bucket per buffer."""
        super().__init__()
        self.config = config
        self.ddp_config = ddp_config
        self.module = module
        state = parallel_state.current_parallel_state()
        if pg_collection is not None:
            data_parallel_group = pg_collection.dp_cp
            expert_data_parallel_group = pg_collection.expt_dp
        elif state is not None:
            data_parallel_group = state.get_data_parallel_group(with_context_parallel=True)
            expert_data_parallel_group = state.get_expert_data_parallel_group()
        else:
            data_parallel_group = dist.group.WORLD if dist.is_initialized() else None
            expert_data_parallel_group = None
        self.intra_dp_cp_group, self.inter_dist_opt_group = data_parallel_group, None
        self.intra_expt_dp_group, self.inter_expt_dist_opt_group = expert_data_parallel_group, None
        if ddp_config.num_distributed_optimizer_instances > 1:
            self._set_instance_groups(pg_collection, state)
        self.data_parallel_group = data_parallel_group
        self.dp_size = collectives.group_size(data_parallel_group)
        self.dp_rank = collectives.group_rank(data_parallel_group)
        self.expert_data_parallel_group = expert_data_parallel_group
        config = ddp_config
        if config.overlap_grad_reduce and not disable_bucketing:
            self.bucket_size = config.bucket_size or max(
                DEFAULT_BUCKET_SIZE, 1_000_000 * self.dp_size
            )
        else:
            self.bucket_size = (
                None  # one bucket per buffer (Megatron ignores --ddp-bucket-size here)
            )
        self.is_last_microbatch = True
        self._nan_checked_before_reduction = False

        dense, expert = {}, {}
        seen = set()
        for param in reversed(list(module.parameters())):
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            grad_dtype = torch.float32 if config.grad_reduce_in_fp32 else param.dtype
            by_dtype = dense if getattr(param, "allreduce", True) else expert
            by_dtype.setdefault((param.dtype, grad_dtype), []).append(param)
        self.buffers = self._make_buffers(
            dense, self.intra_dp_cp_group, None, self.inter_dist_opt_group
        )
        """Buffers of the dense parameters, reduced over ``data_parallel_group``."""
        self.expert_parallel_buffers = []
        """Buffers of the expert parameters (``allreduce = False``), reduced over
        ``expert_data_parallel_group``."""
        if expert:
            if expert_data_parallel_group is None and self.dp_size > 1:
                raise ValueError(
                    "the model has expert parameters (allreduce=False): pass "
                    "expert_data_parallel_group as pg_collection.expt_dp "
                    "(ParallelState.get_expert_data_parallel_group())"
                )
            expert_dp_size = collectives.group_size(expert_data_parallel_group)
            if config.average_in_collective:
                expert_scaling = expert_dp_size / self.dp_size
            else:
                expert_scaling = 1.0 / self.dp_size
            self.expert_parallel_buffers = self._make_buffers(
                expert, self.intra_expt_dp_group, expert_scaling, self.inter_expt_dist_opt_group
            )
        self._hooks = []
        for buffer in self.all_buffers:
            if not buffer.aliased or config.overlap_grad_reduce:
                for p in buffer.params:
                    self._hooks.append(
                        p.register_post_accumulate_grad_hook(self._make_grad_hook(buffer))
                    )
            if config.overlap_grad_reduce or buffer.grads_sharded:
                for p in buffer.params:
                    p.mark_main_grad_ready = self._make_mark_ready(buffer)
            if buffer.grads_sharded:
                for p in buffer.params:
                    p.get_main_grad = self._make_get_main_grad(buffer, p)
            buffer.attach()
        self._param_gather_hooks = []
        if config.overlap_param_gather and any(b.dp_size > 1 for b in self.all_buffers):
            self._register_param_gather_hooks()
            # Checkpoint code reads the inner module's state dict: finish pending gathers first.
            self._param_gather_hooks.append(
                module.register_state_dict_pre_hook(lambda *unused: self.finish_param_sync())
            )

    def set_rerun_state_machine(self, machine: RerunStateMachine) -> None:
        """Validate each bucket's local gradient norm before its reduction through ``machine``:
        NaN and Inf (fatal; not with ``--rerun-mode disabled``, where the reduced gradients are
        checked instead, on every rank alike) and unexpectedly large norms (non-fatal)."""
        config = self.ddp_config
        check_nan = config.check_for_nan_in_grad and machine.mode != RerunMode.DISABLED
        if not (check_nan or config.check_for_large_grads):
            return
        self._nan_checked_before_reduction = check_nan

        def check(index: int, grads: torch.Tensor) -> None:
            norm = grads.norm(p=2)
            where = f"for bucket #{index} in backward pass before data-parallel communication "
            where += "collective"
            # 0.1 %: gradient reductions need not be bitwise deterministic on every device.
            if check_nan:
                machine.validate_result(
                    norm, torch.isnan, f"found NaN in local grad norm {where}", tolerance=0.001
                )
                machine.validate_result(
                    norm, torch.isinf, f"found Inf in local grad norm {where}", tolerance=0.001
                )
            if config.check_for_large_grads:
                machine.validate_result(
                    norm,
                    partial(
                        machine.is_unexpectedly_large, threshold=LARGE_GRADS_FACTOR, context="grads"
                    ),
                    f"found unexpected large grads in bucket #{index} in backward pass before "
                    "data-parallel communication collective",
                    tolerance=0.001,
                    fatal=False,
                )

        for buffer in self.all_buffers:
            buffer.check_local_grads = check

    def _set_instance_groups(self, pg_collection, state) -> None:
        """Several distributed-optimizer instances: the buffers shard over the DP ranks of this
        rank's instance and all-reduce their slices across instances (Megatron's partial
        distributed optimizer)."""
        source = pg_collection
        if source is None or source.intra_dp_cp is None:
            if state is None or state.num_distributed_optimizer_instances == 1:
                raise ValueError(
                    "num_distributed_optimizer_instances > 1 needs its groups: pass "
                    "pg_collection with intra_dp_cp, intra_expt_dp and inter_dist_opt, or "
                    "initialize_model_parallel(num_distributed_optimizer_instances=...)"
                )
            source = ProcessGroupCollection.from_parallel_state(state)
        self.intra_dp_cp_group = source.intra_dp_cp
        self.inter_dist_opt_group = source.inter_dist_opt
        self.intra_expt_dp_group = source.intra_expt_dp
        self.inter_expt_dist_opt_group = source.inter_expt_dist_opt or source.inter_dist_opt

    def _make_buffers(self, params_by_dtype, group, gradient_scaling_factor, inter_group=None):
        config = self.ddp_config
        return [
            ParamAndGradBuffer(
                params,
                param_dtype,
                grad_dtype,
                group,
                self.bucket_size,
                config.use_distributed_optimizer,
                config.average_in_collective,
                config.overlap_grad_reduce,
                gradient_scaling_factor=gradient_scaling_factor,
                inter_group=inter_group,
                shard_grads=config.shard_grads,
            )
            for (param_dtype, grad_dtype), params in params_by_dtype.items()
        ]

    @property
    def all_buffers(self) -> List[ParamAndGradBuffer]:
        """The dense buffers, then the expert buffers."""
        return self.buffers + self.expert_parallel_buffers

    def _register_param_gather_hooks(self):
        """Before a module's forward, wait for the all-gathers of the buckets holding its own
        params."""
        bucket_of = {}
        for buffer in self.all_buffers:
            bucket_of.update(buffer.param_to_bucket)
        for submodule in self.module.modules():
            buckets = []
            for param in submodule.parameters(recurse=False):
                bucket = bucket_of.get(param)
                if bucket is not None and all(bucket is not b for b in buckets):
                    buckets.append(bucket)
            if buckets:

                def wait(_module, _inputs, buckets=tuple(buckets)):
                    for bucket in buckets:
                        bucket.finish_param_gather()

                self._param_gather_hooks.append(submodule.register_forward_pre_hook(wait))

    def _make_grad_hook(self, buffer: ParamAndGradBuffer):
        overlap = self.ddp_config.overlap_grad_reduce
        # The hook is kept by the param's C++ grad accumulator, where the garbage collector cannot
        # see it: strong references back to this DDP would close an uncollectable cycle
        # (param -> hook -> DDP -> buffer -> param) that keeps the model, its gradient buffers and
        # its process groups alive until the interpreter shuts down.
        ddp_ref, buffer_ref = weakref.ref(self), weakref.ref(buffer)

        def hook(param: torch.nn.Parameter):
            ddp, buf = ddp_ref(), buffer_ref()
            if ddp is None or buf is None:  # the DDP wrapper is gone: plain autograd accumulation
                return
            if not buf.aliased and param.grad is not None:
                buf.main_grad_of(param).add_(param.grad)
                param.grad = None
            if buf.grads_sharded or (overlap and ddp.is_last_microbatch):
                buf.param_to_bucket[param].register_grad_ready(param)

        return hook

    def _make_mark_ready(self, buffer: ParamAndGradBuffer):
        """Readiness only, for weights whose layer accumulated into ``main_grad`` itself (weak
        references for the reason given in :meth:`_make_grad_hook`)."""
        ddp_ref, buffer_ref = weakref.ref(self), weakref.ref(buffer)

        def mark_ready(param: torch.nn.Parameter):
            ddp, buf = ddp_ref(), buffer_ref()
            if ddp is None or buf is None:
                return
            if buf.grads_sharded or ddp.is_last_microbatch:
                buf.param_to_bucket[param].register_grad_ready(param)

        return mark_ready

    @staticmethod
    def _make_get_main_grad(buffer: ParamAndGradBuffer, param: torch.nn.Parameter):
        """``param.get_main_grad()`` (sharded gradients): the full-size ``main_grad`` a fused
        linear layer adds into, its bucket's storage allocated on demand (weak references: the
        function is kept by the param itself)."""
        buffer_ref, param_ref = weakref.ref(buffer), weakref.ref(param)

        def get_main_grad() -> torch.Tensor:
            return buffer_ref().main_grad_of(param_ref())

        return get_main_grad

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        """Micro-batches run inside accumulate gradients without launching any reduction."""
        self.is_last_microbatch = False
        try:
            yield
        finally:
            self.is_last_microbatch = True

    def zero_grad_buffer(self):
        """Zero every gradient buffer (and forget last iteration's bucket state) before a new
        iteration."""
        for buffer in self.all_buffers:
            buffer.zero()

    def start_grad_sync(self, *unused):
        """Launch every bucket reduction that backward has not launched yet (the pipeline schedules'
        ``grad_sync_func``); without overlap this reduces synchronously."""
        for buffer in self.all_buffers:
            buffer.start_grad_sync()

    def finish_grad_sync(self):
        """Complete the reduction of every bucket: an average over the data-parallel group
        (all-reduce), or, with the distributed optimizer, this rank's reduced slice of each bucket;
        expert buffers over the expert-data-parallel group."""
        for buffer in self.all_buffers:
            buffer.finish_grad_sync()
        if self.ddp_config.check_for_nan_in_grad and not self._nan_checked_before_reduction:
            for buffer in self.all_buffers:
                if not torch.isfinite(buffer.grad_data).all():
                    raise NonFiniteValueError(
                        "found NaN or Inf in the reduced gradients "
                        "(--check-for-nan-in-loss-and-grad)"
                    )

    @torch.no_grad()
    def start_param_sync(self, *unused, force_sync: bool = False):
        """All-gather the param slices that each DP rank updated (distributed optimizer).

        With ``overlap_param_gather`` (and not ``force_sync``) the gathers are only launched;
        each bucket is waited for by the forward pre-hook of the first module using it, or by
        :meth:`finish_param_sync` (also called before anything reads the params: ``parameters()``,
        ``state_dict()``).
        """
        if not self.ddp_config.use_distributed_optimizer:
            return
        overlap = self.ddp_config.overlap_param_gather and not force_sync
        for buffer in self.all_buffers:
            # Expert buffers are sharded over expert DP, which may be larger or smaller than DP.
            if buffer.dp_size > 1:
                buffer.start_param_gather(async_op=overlap)

    def finish_param_sync(self):
        """Wait for every pending param all-gather."""
        for buffer in self.all_buffers:
            buffer.finish_param_gather()

    def scale_gradients(self, scaling_factor: float) -> None:
        """Multiply every gradient (dense and expert buffers) by ``scaling_factor``."""
        for buffer in self.all_buffers:
            buffer.grad_data.mul_(scaling_factor)

    def named_parameters(self, *args, **kwargs):
        self.finish_param_sync()
        return super().named_parameters(*args, **kwargs)

    def broadcast_params(self):
        """Make every DP replica start from the same weights (those of DP rank 0; for expert
        parameters, those of expert-DP rank 0)."""
        for param in self.module.parameters():
            expert = not getattr(param, "allreduce", True)
            group = self.expert_data_parallel_group if expert else self.data_parallel_group
            if collectives.group_size(group) > 1:
                src = dist.get_global_rank(group, 0)
                dist.broadcast(param.data, src=src, group=group)

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True):
        return self.module.load_state_dict(state_dict, strict=strict)

    def sharded_state_dict(self, *args, **kwargs):
        return self.module.sharded_state_dict(*args, **kwargs)
