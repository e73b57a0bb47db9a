"""FSDP2 (``torch.distributed.fsdp.fully_shard``) behind the interface of our DDP wrapper
(``--use-torch-fsdp2``; also ``--use-megatron-fsdp --data-parallel-sharding-strategy
optim_grads_params``).

Every transformer layer of the chunk is ``fully_shard``-ed on the data-parallel (x context-
parallel) mesh, then the chunk itself (embedding, final norm, output layer). Each DP rank keeps
1/DP of every parameter (a DTensor sharded on dim 0); FSDP all-gathers a layer's parameters for
its forward and backward and reduce-scatters (averages) its gradients, so each rank ends the
backward with the averaged gradient of its shard only. On CPU this runs on gloo (torch 2.13 gloo
has the all-gather-into-tensor and reduce-scatter-tensor collectives FSDP2 calls), on GPUs on
NCCL.

The optimizer sees :meth:`local_shards`: one plain tensor per parameter that aliases the storage
of this rank's shard (so an in-place optimizer update is what FSDP gathers next), whose
``main_grad`` is this rank's shard of the reduced gradient. The usual Megatron optimizers then
clip, step and count zeros on shards; their norm / inf / zero reductions must run over the whole
TP x DP x CP group (the shards of one parameter live on different DP ranks), which is what the
trainer passes as their model-parallel group.

Expert parallelism (``--use-megatron-fsdp`` only, as in Megatron-LM): the experts of each MoE
layer (the modules whose parameters all carry ``allreduce = False``) are ``fully_shard``-ed first,
on the expert data-parallel mesh, so each expert parameter is split over the ranks that hold the
same experts; the enclosing layer then shards the rest on the DP x CP mesh. FSDP averages the
expert gradients over expert-DP; Megatron's DDP sums them there and divides by the DP x CP size
(each EP rank's experts saw the tokens of all EP ranks), so :meth:`finish_grad_sync` rescales
them by ``expert_dp / dp``.

Gradient accumulation: inside :meth:`no_sync` FSDP keeps unsharded gradients and reduces once,
in the backward of the last micro-batch.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Iterable, Iterator, List, Optional, Tuple, Type

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel import collectives
from megatron.core.utils import NonFiniteValueError

from .distributed_data_parallel import DistributedDataParallelConfig


def _fsdp2():
    # Imported on use: the FSDP2 API moved between torch releases and is not needed otherwise.
    try:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError as exc:  # pragma: no cover - depends on the torch build
        raise ValueError(
            f"--use-torch-fsdp2 needs torch.distributed.fsdp.fully_shard (FSDP2), which this "
            f"torch {torch.__version__} does not provide: {exc}"
        ) from exc
    return DeviceMesh, MixedPrecisionPolicy, fully_shard


def _default_sub_modules_to_wrap() -> Tuple[Type[torch.nn.Module], ...]:
    from megatron.core.transformer.transformer_layer import TransformerLayer

    return (TransformerLayer,)


def _is_expert(param) -> bool:
    return not getattr(param, "allreduce", True)


def _expert_units(module: torch.nn.Module) -> List[torch.nn.Module]:
    """The outermost sub-modules all of whose (one or more) parameters are expert parameters."""
    units: List[torch.nn.Module] = []

    def visit(sub):
        params = list(sub.parameters())
        if params and all(_is_expert(p) for p in params):
            units.append(sub)
            return
        for child in sub.children():
            visit(child)

    for child in module.children():
        visit(child)
    return units


class LocalShards:
    """What the optimizer sees of an FSDP2 chunk: ``named_parameters()`` yields, under the model's
    parameter names, plain tensors aliasing this rank's shards (with the model params' attributes,
    e.g. ``tensor_model_parallel``, so norms count TP-replicated params once)."""

    def __init__(self, named: List[Tuple[str, torch.nn.Parameter]]):
        self._named = named

    def named_parameters(self, *unused, **unused_kw) -> Iterator[Tuple[str, torch.nn.Parameter]]:
        return iter(self._named)

    def parameters(self, *unused, **unused_kw) -> Iterator[torch.nn.Parameter]:
        return (p for _, p in self._named)


@torch.no_grad()
def broadcast_module_params(module: torch.nn.Module, group) -> None:
    """Make every member of ``group`` hold the weights of its first member (before sharding)."""
    if collectives.group_size(group) > 1:
        for param in module.parameters():
            collectives.broadcast(param.data, 0, group)


class TorchFullyShardedDataParallel(torch.nn.Module):
    """A model chunk sharded with FSDP2, with the DDP wrapper's methods (``no_sync``,
    ``zero_grad_buffer``, ``finish_grad_sync``, ``start_param_sync``, ...).

    ``config``: the DDP config (``grad_reduce_in_fp32`` reduces gradients in fp32;
    ``check_for_nan_in_grad``). ``data_parallel_group``: the FSDP mesh (Megatron: DP x CP).
    ``sub_modules_to_wrap``: module classes sharded as their own FSDP unit (default: the
    transformer layer). ``expert_data_parallel_group``: the mesh of the expert parameters
    (required when the chunk has any). ``reshard_after_forward``: free the gathered params after
    each forward (ZeRO-3; False keeps them until backward,
    ``--torch-fsdp2-no-reshard-after-forward``).
    """

    def __init__(
        self,
        config: DistributedDataParallelConfig,
        module: torch.nn.Module,
        data_parallel_group=None,
        sub_modules_to_wrap: Optional[Iterable[Type[torch.nn.Module]]] = None,
        reshard_after_forward: bool = True,
        expert_data_parallel_group=None,
    ):
        super().__init__()
        if config.use_distributed_optimizer:
            raise ValueError(
                "--use-torch-fsdp2 shards the optimizer state by itself; "
                "it cannot be combined with --use-distributed-optimizer"
            )
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                "--use-torch-fsdp2 needs torch.distributed to be initialized "
                "(launch with torchrun, also for one process)"
            )
        DeviceMesh, MixedPrecisionPolicy, fully_shard = _fsdp2()
        self.config = config
        self.data_parallel_group = (
            data_parallel_group if data_parallel_group is not None else dist.group.WORLD
        )
        self.dp_size = collectives.group_size(self.data_parallel_group)
        self.dp_rank = collectives.group_rank(self.data_parallel_group)

        # fully_shard replaces every parameter by a new DTensor parameter; carry the attributes
        # the rest of the code base reads (tensor_model_parallel, sequence_parallel, shared, ...).
        attributes = {name: dict(vars(param)) for name, param in module.named_parameters()}
        first = next(module.parameters(), None)
        if first is None:
            raise ValueError("--use-torch-fsdp2: the model chunk has no parameters")
        self.mesh = DeviceMesh.from_group(self.data_parallel_group, first.device.type)
        reduce_dtype = torch.float32 if config.grad_reduce_in_fp32 else None
        kwargs = dict(
            mesh=self.mesh,
            reshard_after_forward=reshard_after_forward,
            mp_policy=MixedPrecisionPolicy(reduce_dtype=reduce_dtype),
        )
        wrap = (
            tuple(sub_modules_to_wrap)
            if sub_modules_to_wrap is not None
            else _default_sub_modules_to_wrap()
        )
        expert_units = _expert_units(module)
        self.expert_scale = 1.0
        if expert_units:
            if expert_data_parallel_group is None:
                raise ValueError(
                    "FSDP2: the model has expert parameters (allreduce=False); pass "
                    "expert_data_parallel_group"
                )
            expert_kwargs = dict(
                kwargs, mesh=DeviceMesh.from_group(expert_data_parallel_group, first.device.type)
            )
            for sub in expert_units:
                fully_shard(sub, **expert_kwargs)
            self.expert_scale = collectives.group_size(expert_data_parallel_group) / self.dp_size
        self.sharded_units = expert_units + [
            sub for sub in module.modules() if sub is not module and isinstance(sub, wrap)
        ]
        for sub in self.sharded_units[len(expert_units) :]:
            fully_shard(sub, **kwargs)
        fully_shard(module, **kwargs)
        self.module = module
        # GPTModel returns its per-token losses as a transposed view; FSDP2 warns that an in-place
        # op on it would skip a hook. The schedules and loss functions only read model outputs.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")

        named = []
        with torch.no_grad():
            for name, param in module.named_parameters():
                for key, value in attributes.get(name, {}).items():
                    setattr(param, key, value)
                if not param.requires_grad:
                    continue
                local = torch.nn.Parameter(param.to_local().detach())
                for key, value in attributes.get(name, {}).items():
                    setattr(local, key, value)
                local.main_grad = None
                named.append((name, param, local))
        self._shards = named
        self.is_last_microbatch = True

    # ------------------------------------------------------------------ the DDP wrapper interface
    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def local_shards(self) -> LocalShards:
        """The tensors the optimizer updates (see the module docstring)."""
        return LocalShards([(name, local) for name, _, local in self._shards])

    def shard_aliases(self) -> List[Tuple[torch.nn.Parameter, torch.nn.Parameter]]:
        """(DTensor parameter, the local tensor the optimizer steps for it) pairs: checkpoints
        key the optimizer state of the second by the first."""
        return [(param, local) for _, param, local in self._shards]

    @contextmanager
    def no_sync(self):
        """Micro-batches run inside keep unsharded gradients; the last one reduces them all."""
        self.module.set_requires_gradient_sync(False)
        self.is_last_microbatch = False
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)
            self.is_last_microbatch = True

    def zero_grad_buffer(self):
        """Drop last iteration's gradients (FSDP creates fresh sharded ones in the next
        backward)."""
        for _, param, local in self._shards:
            param.grad = None
            param.main_grad = None
            local.main_grad = None
            local.grad = None

    def start_grad_sync(self, *unused):
        """FSDP reduce-scatters each unit's gradients during backward: nothing to launch."""

    def finish_grad_sync(self):
        """Expose this rank's shard of each reduced gradient as ``main_grad`` (of the local tensor
        the optimizer steps, and of the DTensor parameter for the sequence-parallel reduction)."""
        for _, param, local in self._shards:
            grad = param.grad
            shard = None if grad is None else grad.to_local()
            if shard is not None and self.expert_scale != 1.0 and _is_expert(param):
                shard.mul_(self.expert_scale)
            param.main_grad = shard
            local.main_grad = shard
        if self.config.check_for_nan_in_grad:
            for _, _, local in self._shards:
                if local.main_grad is not None and not torch.isfinite(local.main_grad).all():
                    raise NonFiniteValueError(
                        "found NaN or Inf in the reduced gradients "
                        "(--check-for-nan-in-loss-and-grad)"
                    )

    def scale_gradients(self, factor: float) -> None:
        """Multiply every reduced gradient shard by ``factor`` (per-token loss normalisation)."""
        for _, _, local in self._shards:
            if local.main_grad is not None:
                local.main_grad.mul_(factor)

    def start_param_sync(self, *unused, force_sync: bool = False):
        """FSDP gathers parameters on demand in each unit's forward (and prefetches the next
        unit's, which is what --overlap-param-gather asks for): nothing to do."""

    def finish_param_sync(self):
        """Nothing is ever pending between iterations."""

    def broadcast_params(self):
        raise ValueError(
            "FSDP2 shards were built from each rank's own weights; broadcast the module "
            "before wrapping it (broadcast_module_params)"
        )

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True):
        return self.module.load_state_dict(state_dict, strict=strict)
