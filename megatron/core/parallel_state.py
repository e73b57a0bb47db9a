"""Process groups for every parallelism, built from one rank grid.

The grid is described by an order string such as ``tp-cp-ep-dp-pp``: the first dimension varies
fastest, so with the default order ``global_rank = tp + cp*TP + dp*TP*CP + pp*TP*CP*DP`` (the dense
grid has ep = 1). Experts use a second grid over (etp, ep, expert-dp, pp) that shares the pipeline
groups of the dense grid.

Rank arithmetic (:class:`RankGenerator`) is pure and unit-tested without processes.
:func:`initialize_model_parallel` turns it into torch.distributed groups and returns a
:class:`ParallelState` object; nothing here is module-level state, the caller owns the object.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Dict, List, Optional

import torch.distributed as dist

DEFAULT_ORDER = "tp-cp-ep-dp-pp"
TP_PP_DP_ORDER = "tp-cp-ep-pp-dp"


class RankGenerator:
    """Enumerates the rank lists of every group type for one grid.

    ``sizes`` maps each dimension named in ``order`` to its size. A group "type" is a subset of
    the dimensions joined with '-', e.g. ``"tp-cp"``: each group varies exactly those dimensions
    while every other dimension is held fixed.
    """

    def __init__(self, tp: int, ep: int, dp: int, pp: int, cp: int, order: str):
        self.sizes = {"tp": tp, "ep": ep, "dp": dp, "pp": pp, "cp": cp}
        self.order = order.lower().split("-")
        for name, size in self.sizes.items():
            if size < 1:
                raise ValueError(f"parallel size {name}={size} must be >= 1")
            if name not in self.order and size != 1:
                raise ValueError(f"order '{order}' lacks '{name}' although its size is {size}")
        unknown = [d for d in self.order if d not in self.sizes]
        if unknown:
            raise ValueError(f"unknown dimensions {unknown} in order '{order}'")
        # Dimensions of size 1 that are missing from the order behave as if appended.
        for name in self.sizes:
            if name not in self.order:
                self.order.append(name)
        self.world_size = 1
        for size in self.sizes.values():
            self.world_size *= size

    def _strides(self) -> Dict[str, int]:
        strides, stride = {}, 1
        for name in self.order:
            strides[name] = stride
            stride *= self.sizes[name]
        return strides

    def get_ranks(self, token: str) -> List[List[int]]:
        """All groups of type ``token`` (e.g. ``"dp"`` or ``"tp-pp"``), each a sorted-by-grid
        list."""
        varied = token.lower().split("-")
        for name in varied:
            if name not in self.sizes:
                raise ValueError(f"unknown group dimension '{name}' in '{token}'")
        strides = self._strides()
        varied_in_order = [d for d in self.order if d in varied]
        fixed_in_order = [d for d in self.order if d not in varied]
        groups = []
        # Outer loop over the fixed coordinates (first fixed dimension fastest), inner over the
        # varied ones (first varied dimension fastest), so groups and members come out in grid
        # order.
        fixed_ranges = [range(self.sizes[d]) for d in reversed(fixed_in_order)]
        varied_ranges = [range(self.sizes[d]) for d in reversed(varied_in_order)]
        for fixed_coords in itertools.product(*fixed_ranges):
            base = sum(c * strides[d] for c, d in zip(fixed_coords, reversed(fixed_in_order)))
            group = []
            for varied_coords in itertools.product(*varied_ranges):
                group.append(
                    base
                    + sum(c * strides[d] for c, d in zip(varied_coords, reversed(varied_in_order)))
                )
            groups.append(group)
        return groups

    def coordinates(self, rank: int) -> Dict[str, int]:
        """The grid coordinates of ``rank``."""
        coords, rest = {}, rank
        for name in self.order:
            coords[name] = rest % self.sizes[name]
            rest //= self.sizes[name]
        return coords


@dataclass
class ParallelLayout:
    """The sizes of every parallel dimension for a given world size."""

    world_size: int
    """Total number of processes."""
    tensor_model_parallel_size: int = 1
    """TP: ranks sharing each layer's matrices."""
    pipeline_model_parallel_size: int = 1
    """PP: stages the layer stack is split into."""
    context_parallel_size: int = 1
    """CP: ranks sharing each sequence."""
    expert_model_parallel_size: int = 1
    """EP: ranks sharing the experts of an MoE layer."""
    expert_tensor_parallel_size: Optional[int] = None
    """ETP: TP size inside experts; defaults to the dense TP size."""
    virtual_pipeline_model_parallel_size: Optional[int] = None
    """Model chunks per pipeline rank (interleaved schedule), or None."""
    use_tp_pp_dp_mapping: bool = False
    """Use the order tp-cp-ep-pp-dp instead of tp-cp-ep-dp-pp."""

    def __post_init__(self):
        if self.expert_tensor_parallel_size is None:
            self.expert_tensor_parallel_size = self.tensor_model_parallel_size
        model_size = (
            self.tensor_model_parallel_size
            * self.pipeline_model_parallel_size
            * self.context_parallel_size
        )
        if self.world_size % model_size != 0:
            raise ValueError(
                f"world size ({self.world_size}) is not divisible by tensor-model-parallel size "
                f"({self.tensor_model_parallel_size}) x pipeline-model-parallel size "
                f"({self.pipeline_model_parallel_size}) x context-parallel size "
                f"({self.context_parallel_size})"
            )
        expert_model = (
            self.expert_tensor_parallel_size
            * self.expert_model_parallel_size
            * self.pipeline_model_parallel_size
        )
        if self.world_size % expert_model != 0:
            raise ValueError(
                f"world size ({self.world_size}) is not divisible by expert-tensor-parallel size "
                f"({self.expert_tensor_parallel_size}) x expert-model-parallel size "
                f"({self.expert_model_parallel_size}) x pipeline-model-parallel size "
                f"({self.pipeline_model_parallel_size})"
            )

    @property
    def order(self) -> str:
        return TP_PP_DP_ORDER if self.use_tp_pp_dp_mapping else DEFAULT_ORDER

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // (
            self.tensor_model_parallel_size
            * self.pipeline_model_parallel_size
            * self.context_parallel_size
        )

    @property
    def expert_data_parallel_size(self) -> int:
        return self.world_size // (
            self.expert_tensor_parallel_size
            * self.expert_model_parallel_size
            * self.pipeline_model_parallel_size
        )

    def dense_grid(self) -> RankGenerator:
        return RankGenerator(
            tp=self.tensor_model_parallel_size,
            ep=1,
            dp=self.data_parallel_size,
            pp=self.pipeline_model_parallel_size,
            cp=self.context_parallel_size,
            order=self.order,
        )

    def expert_grid(self) -> RankGenerator:
        return RankGenerator(
            tp=self.expert_tensor_parallel_size,
            ep=self.expert_model_parallel_size,
            dp=self.expert_data_parallel_size,
            pp=self.pipeline_model_parallel_size,
            cp=1,
            order=self.order,
        )

    def all_group_ranks(self) -> Dict[str, List[List[int]]]:
        """Rank lists of every group, keyed by Megatron's group names. Pure arithmetic."""
        dense, expert = self.dense_grid(), self.expert_grid()
        groups = {
            "tp": dense.get_ranks("tp"),
            "pp": dense.get_ranks("pp"),
            "dp": dense.get_ranks("dp"),
            "cp": dense.get_ranks("cp"),
            "dp-cp": dense.get_ranks("dp-cp"),
            "tp-cp": dense.get_ranks("tp-cp"),
            "tp-dp": dense.get_ranks("tp-dp"),
            "tp-dp-cp": dense.get_ranks("tp-dp-cp"),
            "mp": dense.get_ranks("tp-pp"),
            "ep": expert.get_ranks("ep"),
            "etp": expert.get_ranks("tp"),
            "tp-ep": expert.get_ranks("tp-ep"),
            "expert-dp": expert.get_ranks("dp"),
            "tp-ep-pp": expert.get_ranks("tp-ep-pp"),
        }
        embedding, position_embedding = [], []
        for pp_ranks in groups["pp"]:
            ends = [pp_ranks[0], pp_ranks[-1]] if len(pp_ranks) > 1 else [pp_ranks[0]]
            embedding.append(ends)
            position_embedding.append([pp_ranks[0]])
        groups["embedding"] = embedding
        groups["position-embedding"] = position_embedding
        # The expert grid must agree with the dense one on pipeline groups.
        if sorted(map(sorted, expert.get_ranks("pp"))) != sorted(map(sorted, groups["pp"])):
            raise ValueError(
                "expert and dense grids disagree on pipeline groups; check the parallel sizes"
            )
        return groups


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


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: Optional[int] = None,
    use_tp_pp_dp_mapping: bool = False,
    backend: Optional[str] = None,
    timeout: Optional[timedelta] = None,
) -> ParallelState:
    """Create every process group and return this rank's :class:`ParallelState`.

    Every rank creates every group in the same order (torch.distributed requires it). Without an
    initialized default group this builds a single-process state with no torch groups.
    """
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
        use_tp_pp_dp_mapping=use_tp_pp_dp_mapping,
    )
    state = ParallelState(layout=layout, rank=rank)
    kwargs = {}
    if backend is not None:
        kwargs["backend"] = backend
    if timeout is not None:
        kwargs["timeout"] = timeout
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


def destroy_model_parallel(state: Optional[ParallelState]) -> None:
    """Destroy the non-default groups of ``state``."""
    if state is None or not (dist.is_available() and dist.is_initialized()):
        return
    for group in set(
        g for g in state.groups.values() if g is not None and g is not dist.group.WORLD
    ):
        try:
            dist.destroy_process_group(group)
        except (ValueError, RuntimeError):
            pass
    state.groups.clear()


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
