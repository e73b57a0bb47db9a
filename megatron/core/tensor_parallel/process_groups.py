"""The process groups a model needs, passed explicitly; ``use_mpu_process_groups()``
(megatron-core's name) collects those of the current ``parallel_state`` for a library caller."""

from dataclasses import dataclass
from typing import Any, Optional

from megatron.core import parallel_state
from megatron.core.tensor_parallel.collectives import check_group_size, group_rank, group_size


@dataclass
class ProcessGroupCollection:
    """Groups used inside a model chunk. None means that dimension is not split (size 1)."""

    tp: Any = None
    """Tensor-parallel group: ranks that hold shards of the same layers."""

    cp: Any = None
    """Context-parallel group: ranks that hold chunks of the same sequences."""

    pp: Any = None
    """Pipeline-parallel group: its rank is the stage a model chunk belongs to."""

    ep: Any = None
    """Expert-parallel group: ranks that hold different experts of the same MoE layers."""

    expt_tp: Any = None
    """Expert-tensor-parallel group: ranks that hold shards of the same experts."""

    tp_ep: Any = None
    """Expert-tensor x expert-parallel group: the ranks an MoE layer exchanges tokens with."""

    tp_cp: Any = None
    """Tensor x context-parallel group: the ranks holding parts of the same sequences (MoE
    balancing losses count tokens over it)."""

    tp_dp_cp: Any = None
    """Tensor x data x context-parallel group: the ranks holding different tokens of a step
    (the MoE global_aux_loss counts tokens over it)."""

    dp: Any = None
    """Data-parallel group (without context parallelism)."""

    dp_cp: Any = None
    """Data x context-parallel group: the ranks whose dense gradients are averaged together."""

    expt_dp: Any = None
    """Expert-data-parallel group: the ranks holding the same experts (their gradients are
    summed over it)."""

    intra_dp_cp: Any = None
    """With several distributed-optimizer instances: the DP x CP ranks of this rank's instance,
    over which the distributed optimizer shards."""

    intra_expt_dp: Any = None
    """The same for the expert-data-parallel ranks."""

    inter_dist_opt: Any = None
    """The ranks at this rank's place in the other distributed-optimizer instances."""

    inter_expt_dist_opt: Any = None
    """The same for the expert buffers (Megatron uses one group for both: the same ranks)."""

    embd: Any = None
    """Embedding group: the first and last pipeline stages, which hold the two copies of a tied
    word embedding (a model built with it copies the first into the second, as megatron-core's)."""

    @classmethod
    def from_parallel_state(cls, state) -> "ProcessGroupCollection":
        """From a :class:`megatron.core.parallel_state.ParallelState` (its tp, cp, pp groups)."""
        return cls(
            tp=state.get_tensor_model_parallel_group(),
            cp=state.get_context_parallel_group(),
            pp=state.get_pipeline_model_parallel_group(),
            ep=state.get_expert_model_parallel_group(),
            expt_tp=state.get_expert_tensor_parallel_group(),
            tp_ep=state.group("tp-ep"),
            tp_cp=state.group("tp-cp"),
            tp_dp_cp=state.group("tp-dp-cp"),
            dp=state.get_data_parallel_group(),
            dp_cp=state.get_data_parallel_group(with_context_parallel=True),
            expt_dp=state.get_expert_data_parallel_group(),
            embd=state.get_embedding_group(),
            intra_dp_cp=state.get_intra_partial_data_parallel_group(),
            intra_expt_dp=state.get_intra_partial_expert_data_parallel_group(),
            inter_dist_opt=state.get_inter_distributed_optimizer_instance_group(),
            inter_expt_dist_opt=state.get_inter_expert_distributed_optimizer_instance_group(),
        )

    @classmethod
    def use_mpu_process_groups(cls) -> "ProcessGroupCollection":
        """Megatron-core's name: the groups of the current ``parallel_state`` (all None without
        one)."""
        state = parallel_state.current_parallel_state()
        return cls.from_parallel_state(state) if state is not None else cls()

    @property
    def tp_size(self) -> int:
        return group_size(self.tp)

    @property
    def tp_rank(self) -> int:
        return group_rank(self.tp)

    @property
    def cp_size(self) -> int:
        return group_size(self.cp)

    @property
    def cp_rank(self) -> int:
        return group_rank(self.cp)

    @property
    def ep_size(self) -> int:
        return group_size(self.ep)

    @property
    def ep_rank(self) -> int:
        return group_rank(self.ep)

    @property
    def expt_tp_size(self) -> int:
        return group_size(self.expt_tp)

    @property
    def expt_tp_rank(self) -> int:
        return group_rank(self.expt_tp)

    @property
    def pp_size(self) -> int:
        return group_size(self.pp)

    @property
    def pp_rank(self) -> int:
        return group_rank(self.pp)


def resolve_pg_collection(config, pg_collection: Optional[Any] = None) -> ProcessGroupCollection:
    """Normalize what a model was given (None, a ProcessGroupCollection or a ParallelState) and
    check it against the config's parallel sizes, so a TP=2 config never silently runs unsplit."""
    if pg_collection is None:
        pgs = ProcessGroupCollection()
    elif isinstance(pg_collection, ProcessGroupCollection):
        pgs = pg_collection
    elif hasattr(pg_collection, "get_tensor_model_parallel_group"):
        pgs = ProcessGroupCollection.from_parallel_state(pg_collection)
    else:
        raise ValueError(
            f"pg_collection must be a ProcessGroupCollection or a ParallelState, "
            f"got {type(pg_collection).__name__}"
        )
    if config is not None:
        check_group_size(
            config.tensor_model_parallel_size,
            pgs.tp,
            "tensor_model_parallel_size",
            "--tensor-model-parallel-size",
        )
        check_group_size(
            config.context_parallel_size, pgs.cp, "context_parallel_size", "--context-parallel-size"
        )
        if getattr(config, "num_moe_experts", None) is not None:
            check_group_size(
                config.expert_model_parallel_size,
                pgs.ep,
                "expert_model_parallel_size",
                "--expert-model-parallel-size",
            )
            check_group_size(
                config.expert_tensor_parallel_size,
                pgs.expt_tp,
                "expert_tensor_parallel_size",
                "--expert-tensor-parallel-size",
            )
    return pgs
