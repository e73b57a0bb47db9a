"""The rank grid of every parallelism, as pure arithmetic: which global ranks form each
tensor-, pipeline-, context-, expert- and data-parallel group for given sizes and an order string
such as ``tp-cp-ep-dp-pp`` (the first dimension varies fastest). No processes and no
torch.distributed: parallel_state.py turns these lists into process groups."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Dict, List, Optional

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
    num_distributed_optimizer_instances: int = 1
    """Distributed-optimizer instances: the DP x CP ranks (and the expert-DP ranks) split into
    this many contiguous blocks; the optimizer state is sharded within a block and replicated
    across blocks."""

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
        instances = self.num_distributed_optimizer_instances
        if instances < 1:
            raise ValueError(f"num_distributed_optimizer_instances ({instances}) must be >= 1")
        dp_cp = self.data_parallel_size * self.context_parallel_size
        for what, size in (
            ("data-parallel x context-parallel size", dp_cp),
            ("expert-data-parallel size", self.expert_data_parallel_size),
        ):
            if size % instances != 0:
                raise ValueError(
                    f"{what} ({size}) is not divisible by num_distributed_optimizer_instances "
                    f"({instances})"
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
        if self.num_distributed_optimizer_instances > 1:
            groups.update(self._distributed_optimizer_instance_ranks(groups))
        # The expert grid must agree with the dense one on pipeline groups.
        if sorted(map(sorted, expert.get_ranks("pp"))) != sorted(map(sorted, groups["pp"])):
            raise ValueError(
                "expert and dense grids disagree on pipeline groups; check the parallel sizes"
            )
        return groups

    def _distributed_optimizer_instance_ranks(self, groups) -> Dict[str, List[List[int]]]:
        """Megatron's partial distributed-optimizer groups: each DP x CP group (and each
        expert-DP group) cut into N contiguous blocks ("intra-dp-cp", "intra-expert-dp"); the
        ranks at the same place of every block ("inter-dist-opt", "inter-expert-dp"; Megatron
        uses the expert one for both, the same ranks whenever both exist); and every rank of one
        block of the whole grid ("intra-dist-opt")."""
        n = self.num_distributed_optimizer_instances

        def blocks(rank_lists):
            size = len(rank_lists[0]) // n
            intra = [ranks[i * size : (i + 1) * size] for ranks in rank_lists for i in range(n)]
            inter = [ranks[j::size] for ranks in rank_lists for j in range(size)]
            return intra, inter

        intra_dp_cp, inter_dense = blocks(groups["dp-cp"])
        intra_expert_dp, inter_expert = blocks(groups["expert-dp"])
        instance_of = {}
        for ranks in groups["expert-dp"]:
            size = len(ranks) // n
            for position, rank in enumerate(ranks):
                instance_of[rank] = position // size
        intra_dist_opt = [
            [r for r in range(self.world_size) if instance_of[r] == i] for i in range(n)
        ]
        return {
            "intra-dp-cp": intra_dp_cp,
            "inter-dist-opt": inter_dense,
            "intra-expert-dp": intra_expert_dp,
            "inter-expert-dp": inter_expert,
            "intra-dist-opt": intra_dist_opt,
        }


def hierarchical_cp_ranks(cp_ranks: List[int], sizes: List[int]) -> List[List[List[int]]]:
    """Megatron's hierarchical context-parallel groups of one CP group: for each level, the
    groups of ``sizes[level]`` ranks whose position in ``cp_ranks`` differs only in that level's
    digit (level 0 varies fastest: consecutive ranks; level 1 by strides of ``sizes[0]``; ...).
    The product of ``sizes`` must be the CP size."""
    total = 1
    for size in sizes:
        total *= size
    if total != len(cp_ranks):
        raise ValueError(
            f"hierarchical_context_parallel_sizes {sizes} multiply to {total}, not the "
            f"context-parallel size {len(cp_ranks)}"
        )
    levels, inner = [], 1
    for size in sizes:
        outer = inner * size
        levels.append(
            [
                [cp_ranks[start + j + i * inner] for i in range(size)]
                for start in range(0, len(cp_ranks), outer)
                for j in range(inner)
            ]
        )
        inner = outer
    return levels
