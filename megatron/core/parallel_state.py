"""Process groups for every parallelism, built from one rank grid.

The grid is described by an order string such as ``tp-cp-ep-dp-pp``: the first dimension varies
fastest, so with the default order ``global_rank = tp + cp*TP + dp*TP*CP + pp*TP*CP*DP`` (the dense
grid has ep = 1). Experts use a second grid over (etp, ep, expert-dp, pp) that shares the pipeline
groups of the dense grid.

Rank arithmetic (:class:`RankGenerator`, :class:`ParallelLayout`, in parallel_layout.py) is pure
and unit-tested without processes.
:func:`initialize_model_parallel` turns it into torch.distributed groups held in a
:class:`ParallelState` object, which becomes the current one: megatron-core's module-level getters
(``get_tensor_model_parallel_group()`` ...) read it. That object is the only module-level state of
megatron/core's process groups (see the section "Megatron Core's module-level interface").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Dict, List, Optional

import torch.distributed as dist

from megatron.core.parallel_layout import (  # noqa: F401 (megatron-core names them here)
    DEFAULT_ORDER,
    TP_PP_DP_ORDER,
    ParallelLayout,
    RankGenerator,
    hierarchical_cp_ranks,
)


@dataclass
class ParallelState:
    """This rank's view of the process groups: its groups, sizes and ranks.

    Built by :func:`initialize_model_parallel`. ``groups[name]`` is the torch group containing this
    rank (None when torch.distributed is not initialized, for single-process use); ``ranks[name]``
    is its member list.
    """

    layout: ParallelLayout
    """The sizes this state was built for."""
    rank: int = 0
    """This process's global rank."""
    groups: Dict[str, Optional[dist.ProcessGroup]] = field(default_factory=dict)
    """Group name -> torch process group holding this rank."""
    ranks: Dict[str, List[int]] = field(default_factory=dict)
    """Group name -> global ranks of the group holding this rank."""
    virtual_pipeline_model_parallel_rank: Optional[int] = None
    """The model chunk currently being run (interleaved schedule)."""

    def group(self, name: str):
        return self.groups.get(name)

    def size(self, name: str) -> int:
        return len(self.ranks[name])

    def group_rank(self, name: str) -> int:
        return self.ranks[name].index(self.rank)

    # Megatron-style getters -------------------------------------------------------------------
    def get_tensor_model_parallel_group(self):
        return self.group("tp")

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.size("tp")

    def get_tensor_model_parallel_rank(self) -> int:
        return self.group_rank("tp")

    def get_pipeline_model_parallel_group(self):
        return self.group("pp")

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.size("pp")

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.group_rank("pp")

    def is_pipeline_first_stage(self) -> bool:
        return self.get_pipeline_model_parallel_rank() == 0

    def is_pipeline_last_stage(self) -> bool:
        return (
            self.get_pipeline_model_parallel_rank()
            == self.get_pipeline_model_parallel_world_size() - 1
        )

    def get_context_parallel_group(self):
        return self.group("cp")

    def get_context_parallel_world_size(self) -> int:
        return self.size("cp")

    def get_context_parallel_rank(self) -> int:
        return self.group_rank("cp")

    def get_data_parallel_group(self, with_context_parallel: bool = False):
        return self.group("dp-cp" if with_context_parallel else "dp")

    def get_data_parallel_world_size(self, with_context_parallel: bool = False) -> int:
        return self.size("dp-cp" if with_context_parallel else "dp")

    def get_data_parallel_rank(self, with_context_parallel: bool = False) -> int:
        return self.group_rank("dp-cp" if with_context_parallel else "dp")

    def get_model_parallel_group(self):
        return self.group("mp")

    @property
    def num_distributed_optimizer_instances(self) -> int:
        return self.layout.num_distributed_optimizer_instances

    def _partial(self, name: str, whole: str) -> str:
        return name if self.num_distributed_optimizer_instances > 1 else whole

    def get_intra_partial_data_parallel_group(self):
        """The DP x CP ranks of this rank's distributed-optimizer instance (the whole DP x CP
        group with one instance)."""
        return self.group(self._partial("intra-dp-cp", "dp-cp"))

    def get_intra_partial_expert_data_parallel_group(self):
        return self.group(self._partial("intra-expert-dp", "expert-dp"))

    def get_inter_distributed_optimizer_instance_group(self):
        """The ranks holding this rank's shard in the other instances (None with one)."""
        if self.num_distributed_optimizer_instances == 1:
            return None
        return self.group("inter-dist-opt")

    def get_inter_expert_distributed_optimizer_instance_group(self):
        if self.num_distributed_optimizer_instances == 1:
            return None
        return self.group("inter-expert-dp")

    def get_embedding_group(self):
        return self.group("embedding")

    def get_position_embedding_group(self):
        return self.group("position-embedding")

    def get_expert_model_parallel_group(self):
        return self.group("ep")

    def get_expert_model_parallel_world_size(self) -> int:
        return self.size("ep")

    def get_expert_model_parallel_rank(self) -> int:
        return self.group_rank("ep")

    def get_expert_tensor_parallel_group(self):
        return self.group("etp")

    def get_expert_tensor_parallel_world_size(self) -> int:
        return self.size("etp")

    def get_expert_tensor_parallel_rank(self) -> int:
        return self.group_rank("etp")

    def get_expert_data_parallel_group(self):
        return self.group("expert-dp")

    def get_expert_data_parallel_world_size(self) -> int:
        return self.size("expert-dp")

    def get_expert_data_parallel_rank(self) -> int:
        return self.group_rank("expert-dp")


def _new_parallel_state(
    tensor_model_parallel_size: int,
    pipeline_model_parallel_size: int,
    virtual_pipeline_model_parallel_size: Optional[int],
    context_parallel_size: int,
    expert_model_parallel_size: int,
    expert_tensor_parallel_size: Optional[int],
    order: str,
    timeout: Optional[timedelta],
    num_distributed_optimizer_instances: int = 1,
) -> ParallelState:
    """Create every process group of one layout; every rank creates every group in the same order
    (torch.distributed requires it). Without an initialized default group: a single-process state
    with no torch groups."""
    if order not in (DEFAULT_ORDER, TP_PP_DP_ORDER):
        raise ValueError(
            f"initialize_model_parallel: order {order!r} is not supported "
            f"(use {DEFAULT_ORDER!r} or {TP_PP_DP_ORDER!r})"
        )
    initialized = dist.is_available() and dist.is_initialized()
    world_size = dist.get_world_size() if initialized else 1
    rank = dist.get_rank() if initialized else 0
    layout = ParallelLayout(
        world_size=world_size,
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        context_parallel_size=context_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        use_tp_pp_dp_mapping=order == TP_PP_DP_ORDER,
        num_distributed_optimizer_instances=num_distributed_optimizer_instances,
    )
    state = ParallelState(layout=layout, rank=rank)
    if virtual_pipeline_model_parallel_size is not None:
        state.virtual_pipeline_model_parallel_rank = 0
    kwargs = {} if timeout is None else {"timeout": timeout}
    for name, rank_lists in layout.all_group_ranks().items():
        for ranks in rank_lists:
            group = None
            if initialized:
                group = (
                    dist.group.WORLD
                    if len(ranks) == world_size and ranks == list(range(world_size))
                    else dist.new_group(ranks=ranks, **kwargs)
                )
            if rank in ranks:
                state.groups[name] = group
                state.ranks[name] = ranks
    return state


def _destroy_groups(state: ParallelState) -> None:
    if dist.is_available() and dist.is_initialized():
        for group in set(
            g for g in state.groups.values() if g is not None and g is not dist.group.WORLD
        ):
            try:
                dist.destroy_process_group(group)
            except (ValueError, RuntimeError):
                pass
    state.groups.clear()


# ---------------------------------------------------------------------------------------------
# Megatron Core's module-level interface. The one piece of module-level state in megatron/core
# for process groups: the ParallelState of the last initialize_model_parallel(). Library code
# written against megatron-core reads it through the functions below; the training side reads
# the same object (megatron.training.global_vars.get_parallel_state()). The rest of megatron/core
# never reads it: models, layers and collectives take their groups explicitly. Only the public
# entry points that megatron-core lets a caller use without groups (DistributedDataParallel,
# get_forward_backward_func and the schedules, finalize_model_grads, get_megatron_optimizer,
# model_parallel_cuda_manual_seed, a model built with pg_collection=None) fall back to it.
# ---------------------------------------------------------------------------------------------

_CURRENT: Optional[ParallelState] = None


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    pipeline_model_parallel_comm_backend: Optional[str] = None,
    use_sharp: bool = False,
    context_parallel_size: int = 1,
    hierarchical_context_parallel_sizes: Optional[List[int]] = None,
    hybrid_context_parallel: bool = False,
    expert_model_parallel_size: int = 1,
    num_distributed_optimizer_instances: int = 1,
    expert_tensor_parallel_size: Optional[int] = None,
    nccl_communicator_config_path: Optional[str] = None,
    distributed_timeout_minutes: Optional[int] = None,
    order: str = DEFAULT_ORDER,
    get_embedding_ranks: Optional[Callable] = None,
    get_position_embedding_ranks: Optional[Callable] = None,
    create_gloo_process_groups: bool = True,
    high_priority_stream_groups: Optional[List[str]] = None,
    sharp_enabled_group: Optional[str] = None,
    create_all_gather_group: Optional[bool] = False,
) -> ParallelState:
    """Create every process group and make them the current ones (megatron-core's signature).

    Returns this rank's :class:`ParallelState` (megatron-core returns None); the module-level
    getters read the same object. A second call replaces the current state without destroying its
    groups (call :func:`destroy_model_parallel` first to free them). The NCCL tuning knobs
    (``pipeline_model_parallel_comm_backend``, ``use_sharp``, ``nccl_communicator_config_path``,
    ``create_gloo_process_groups``, ``high_priority_stream_groups``, ``sharp_enabled_group``,
    ``create_all_gather_group``) change no result and are accepted without effect.
    ``distributed_timeout_minutes``: the groups' timeout (None: torch's default, megatron-core's
    default is 30).
    """
    global _CURRENT
    unsupported = {
        "hybrid_context_parallel": bool(hybrid_context_parallel),
        "get_embedding_ranks": get_embedding_ranks is not None,
        "get_position_embedding_ranks": get_position_embedding_ranks is not None,
    }
    for name, given in unsupported.items():
        if given:
            raise ValueError(f"initialize_model_parallel: {name} is not supported here")
    timeout = None
    if distributed_timeout_minutes is not None:
        timeout = timedelta(minutes=distributed_timeout_minutes)
    _CURRENT = _new_parallel_state(
        tensor_model_parallel_size,
        pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size,
        context_parallel_size,
        expert_model_parallel_size,
        expert_tensor_parallel_size,
        order,
        timeout,
        num_distributed_optimizer_instances,
    )
    if hierarchical_context_parallel_sizes:
        _add_hierarchical_cp_groups(_CURRENT, list(hierarchical_context_parallel_sizes), timeout)
    return _CURRENT


def _add_hierarchical_cp_groups(state: ParallelState, sizes: List[int], timeout) -> None:
    """Groups ``hcp0``, ``hcp1``... of :func:`hierarchical_cp_ranks`, every CP group's in turn (all
    ranks create all groups in one order)."""
    initialized = dist.is_available() and dist.is_initialized()
    kwargs = {} if timeout is None else {"timeout": timeout}
    for cp_ranks in state.layout.all_group_ranks()["cp"]:
        for level, groups in enumerate(hierarchical_cp_ranks(cp_ranks, sizes)):
            for ranks in groups:
                group = dist.new_group(ranks=ranks, **kwargs) if initialized else None
                if state.rank in ranks:
                    state.groups[f"hcp{level}"] = group
                    state.ranks[f"hcp{level}"] = ranks


def destroy_model_parallel() -> None:
    """Destroy the current groups (all but the default one) and forget the current state."""
    global _CURRENT
    state, _CURRENT = _CURRENT, None
    if state is not None:
        _destroy_groups(state)


def forget_model_parallel() -> None:
    """Forget the current state without destroying its groups (the trainer's teardown destroys
    every group itself; tests that reset the process's globals)."""
    global _CURRENT
    _CURRENT = None


def current_parallel_state() -> Optional[ParallelState]:
    """The state of the last :func:`initialize_model_parallel`, or None."""
    return _CURRENT


def model_parallel_is_initialized() -> bool:
    return _CURRENT is not None


is_initialized = model_parallel_is_initialized


def is_unitialized() -> bool:  # megatron-core's spelling
    return _CURRENT is None


def _state() -> ParallelState:
    if _CURRENT is None:
        raise RuntimeError(
            "model parallel groups are not initialized: call "
            "megatron.core.parallel_state.initialize_model_parallel(...) first"
        )
    return _CURRENT


# Tensor parallel
def get_tensor_model_parallel_group(check_initialized: bool = True):
    return _state().group("tp")


def get_tensor_model_parallel_world_size() -> int:
    return _state().size("tp")


def get_tensor_model_parallel_rank() -> int:
    return _state().group_rank("tp")


def get_tensor_model_parallel_src_rank() -> int:
    return _state().ranks["tp"][0]


# Pipeline parallel
def get_pipeline_model_parallel_group(check_initialized: bool = True):
    return _state().group("pp")


def get_pipeline_model_parallel_world_size() -> int:
    return _state().size("pp")


def get_pipeline_model_parallel_rank() -> int:
    return _state().group_rank("pp")


def get_pipeline_model_parallel_first_rank() -> int:
    return _state().ranks["pp"][0]


def get_pipeline_model_parallel_last_rank() -> int:
    return _state().ranks["pp"][-1]


def get_pipeline_model_parallel_next_rank() -> int:
    ranks = _state().ranks["pp"]
    return ranks[(get_pipeline_model_parallel_rank() + 1) % len(ranks)]


def get_pipeline_model_parallel_prev_rank() -> int:
    ranks = _state().ranks["pp"]
    return ranks[(get_pipeline_model_parallel_rank() - 1) % len(ranks)]


def _is_virtual_stage(vp_stage: Optional[int], ignore_virtual: bool, last: bool) -> bool:
    vp_size = get_virtual_pipeline_model_parallel_world_size()
    if ignore_virtual or vp_size is None:
        return True
    if vp_stage is None:
        raise ValueError("vp_stage must be passed when virtual pipeline stages are used")
    return vp_stage == (vp_size - 1 if last else 0)


def is_pipeline_first_stage(ignore_virtual: bool = True, vp_stage: Optional[int] = None) -> bool:
    return _is_virtual_stage(vp_stage, ignore_virtual, False) and _state().is_pipeline_first_stage()


def is_pipeline_last_stage(ignore_virtual: bool = True, vp_stage: Optional[int] = None) -> bool:
    return _is_virtual_stage(vp_stage, ignore_virtual, True) and _state().is_pipeline_last_stage()


def get_virtual_pipeline_model_parallel_rank() -> Optional[int]:
    return _state().virtual_pipeline_model_parallel_rank


def set_virtual_pipeline_model_parallel_rank(rank: Optional[int]) -> None:
    _state().virtual_pipeline_model_parallel_rank = rank


def get_virtual_pipeline_model_parallel_world_size() -> Optional[int]:
    return _state().layout.virtual_pipeline_model_parallel_size


def set_virtual_pipeline_model_parallel_world_size(world_size: Optional[int]) -> None:
    _state().layout.virtual_pipeline_model_parallel_size = world_size


# Data and context parallel
def _dp_name(with_context_parallel: bool) -> str:
    return "dp-cp" if with_context_parallel else "dp"


def _dp_group_name(with_context_parallel: bool, partial_data_parallel: bool) -> str:
    if partial_data_parallel:
        if not with_context_parallel:
            raise ValueError("the partial data-parallel group includes context parallelism")
        return _state()._partial("intra-dp-cp", "dp-cp")
    return _dp_name(with_context_parallel)


def get_data_parallel_group(
    with_context_parallel: bool = False,
    partial_data_parallel: bool = False,
    independent_all_gather: bool = False,
):
    """``partial_data_parallel``: the DP x CP ranks of this distributed-optimizer instance."""
    return _state().group(_dp_group_name(with_context_parallel, partial_data_parallel))


def get_data_parallel_world_size(
    with_context_parallel: bool = False, partial_data_parallel: bool = False
) -> int:
    return _state().size(_dp_group_name(with_context_parallel, partial_data_parallel))


def get_data_parallel_rank(
    with_context_parallel: bool = False, partial_data_parallel: bool = False
) -> int:
    return _state().group_rank(_dp_group_name(with_context_parallel, partial_data_parallel))


def get_intra_distributed_optimizer_instance_group(check_initialized: bool = True):
    """Every rank of this rank's distributed-optimizer instance (the world with one)."""
    state = _state()
    if state.num_distributed_optimizer_instances == 1:
        return dist.group.WORLD if dist.is_initialized() else None
    return state.group("intra-dist-opt")


def get_inter_distributed_optimizer_instance_group(check_initialized: bool = True):
    """The ranks at this rank's place in the other distributed-optimizer instances."""
    group = _state().get_inter_expert_distributed_optimizer_instance_group()
    if group is None and check_initialized:
        raise RuntimeError(
            "the inter distributed-optimizer instance group exists only with "
            "num_distributed_optimizer_instances > 1"
        )
    return group


def get_data_parallel_src_rank(with_context_parallel: bool = False) -> int:
    return _state().ranks[_dp_name(with_context_parallel)][0]


def get_context_parallel_group(check_initialized: bool = True):
    return _state().group("cp")


def get_context_parallel_world_size() -> int:
    return _state().size("cp")


def get_context_parallel_rank() -> int:
    return _state().group_rank("cp")


def get_context_parallel_global_ranks(check_initialized: bool = True) -> List[int]:
    return list(_state().ranks["cp"])


def get_hierarchical_context_parallel_groups(check_initialized: bool = True) -> list:
    """The groups of the levels of ``hierarchical_context_parallel_sizes`` holding this rank,
    innermost first (empty without hierarchical sizes)."""
    state = _state()
    return [state.group(f"hcp{level}") for level in range(_hcp_levels(state))]


def _hcp_levels(state: ParallelState) -> int:
    level = 0
    while f"hcp{level}" in state.ranks:
        level += 1
    return level


def get_tensor_and_context_parallel_group(check_initialized: bool = True):
    return _state().group("tp-cp")


def get_tensor_and_context_parallel_world_size() -> int:
    return _state().size("tp-cp")


def get_tensor_and_context_parallel_rank() -> int:
    return _state().group_rank("tp-cp")


def get_tensor_and_data_parallel_group(
    check_initialized: bool = True, with_context_parallel: bool = False
):
    return _state().group("tp-dp-cp" if with_context_parallel else "tp-dp")


# Model parallel and embeddings
def get_model_parallel_group(check_initialized: bool = True):
    return _state().group("mp")


def get_model_parallel_src_rank() -> int:
    return _state().ranks["mp"][0]


def get_embedding_group(check_initialized: bool = True):
    return _state().group("embedding")


def get_position_embedding_group(check_initialized: bool = True):
    return _state().group("position-embedding")


def is_rank_in_embedding_group(ignore_virtual: bool = True, vp_stage: Optional[int] = None) -> bool:
    state = _state()
    if state.rank not in state.ranks["embedding"]:
        return False
    if state.is_pipeline_first_stage():
        return is_pipeline_first_stage(ignore_virtual, vp_stage)
    if state.is_pipeline_last_stage():
        return is_pipeline_last_stage(ignore_virtual, vp_stage)
    return True


def is_rank_in_position_embedding_group() -> bool:
    state = _state()
    return state.rank in state.ranks["position-embedding"]


# Experts
def get_expert_model_parallel_group(check_initialized: bool = True):
    return _state().group("ep")


def get_expert_model_parallel_world_size() -> int:
    return _state().size("ep")


def get_expert_model_parallel_rank() -> int:
    return _state().group_rank("ep")


def get_expert_model_parallel_src_rank() -> int:
    return _state().ranks["ep"][0]


def get_expert_tensor_parallel_group(check_initialized: bool = True):
    return _state().group("etp")


def get_expert_tensor_parallel_world_size() -> int:
    return _state().size("etp")


def get_expert_tensor_parallel_rank() -> int:
    return _state().group_rank("etp")


def get_expert_tensor_and_model_parallel_group(check_initialized: bool = True):
    return _state().group("tp-ep")


def get_expert_tensor_and_model_parallel_world_size() -> int:
    return _state().size("tp-ep")


def get_expert_tensor_and_model_parallel_rank() -> int:
    return _state().group_rank("tp-ep")


def get_expert_tensor_model_pipeline_parallel_group(check_initialized: bool = True):
    return _state().group("tp-ep-pp")


def _expert_dp_name(partial_expert_data_parallel: bool) -> str:
    if partial_expert_data_parallel:
        return _state()._partial("intra-expert-dp", "expert-dp")
    return "expert-dp"


def get_expert_data_parallel_group(
    check_initialized: bool = True, partial_expert_data_parallel: bool = False
):
    return _state().group(_expert_dp_name(partial_expert_data_parallel))


def get_expert_data_parallel_world_size(partial_expert_data_parallel: bool = False) -> int:
    return _state().size(_expert_dp_name(partial_expert_data_parallel))


def get_expert_data_parallel_rank(partial_expert_data_parallel: bool = False) -> int:
    return _state().group_rank(_expert_dp_name(partial_expert_data_parallel))


def live_gloo_worker_threads() -> int:
    """How many gloo worker threads (named ``pt_gloo_runloop``) this process still runs.

    After every process group is destroyed and unreferenced this is 0. A gloo group that is still
    referenced at interpreter shutdown keeps its workers running, and a worker that drops the last
    reference to a finished collective then needs the GIL the shutdown no longer hands out: the
    process aborts with "terminate called without an active exception". Linux only (0 elsewhere).
    """
    import os

    task_dir = "/proc/self/task"
    if not os.path.isdir(task_dir):
        return 0
    count = 0
    for tid in os.listdir(task_dir):
        try:
            with open(os.path.join(task_dir, tid, "comm")) as comm:
                count += comm.read().strip() == "pt_gloo_runloop"
        except OSError:  # the thread ended while we looked
            pass
    return count
