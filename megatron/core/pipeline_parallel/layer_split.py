"""How the decoder layers are split over pipeline stages and virtual stages (model chunks).

Virtual stage ``v = chunk * PP + pp_rank`` holds a contiguous run of layers; virtual stages are
laid end to end in order of ``v``, so chunk 0 of every rank comes first, then chunk 1, and so on
(Megatron's interleaving). Without virtual stages there is one chunk per rank and ``v = pp_rank``.

Split rules (Megatron's, flag names in the messages):

* even split: ``num_layers`` (+1 with ``--account-for-embedding-in-pipeline-split``, +1 with
  ``--account-for-loss-in-pipeline-split``) divided evenly over PP ranks, then over the chunks of
  each rank; the embedding / loss then take the place of one layer on the first / last virtual
  stage;
* uneven split: ``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``
  fix the first / last rank's layer count; the rest is divided evenly over the other ranks; each
  rank's count is divided evenly over its chunks.

Everything is pure arithmetic and raises ``ValueError`` naming the flags on bad input, so the
argument validation can call it before any process group exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple


@dataclass(frozen=True)
class PipelineLayerSplit:
    """Layer counts of every (pipeline rank, chunk)."""

    num_layers: int
    """Total decoder layers (``--num-layers``)."""
    pipeline_model_parallel_size: int
    """PP (``--pipeline-model-parallel-size``)."""
    virtual_pipeline_model_parallel_size: Optional[int]
    """Chunks per rank, or None without interleaving."""
    counts: Tuple[Tuple[int, ...], ...]
    """counts[pp_rank][chunk]: layers built by that model chunk."""

    @property
    def num_chunks(self) -> int:
        return self.virtual_pipeline_model_parallel_size or 1

    def num_layers_for(self, pp_rank: int, chunk: int = 0) -> int:
        """Layers of model chunk ``chunk`` on pipeline rank ``pp_rank``."""
        return self.counts[pp_rank][chunk]

    def offset_for(self, pp_rank: int, chunk: int = 0) -> int:
        """Global index of the first layer of that chunk (``layer_number_offset``)."""
        pp = self.pipeline_model_parallel_size
        target = chunk * pp + pp_rank
        return sum(self.counts[v % pp][v // pp] for v in range(target))

    def chunk_args(self, pp_rank: int, chunk: int = 0) -> dict:
        """Keyword arguments for a model provider: pre/post_process, num_layers,
        layer_number_offset."""
        pp, vp = self.pipeline_model_parallel_size, self.num_chunks
        return dict(
            pre_process=(pp_rank == 0 and chunk == 0),
            post_process=(pp_rank == pp - 1 and chunk == vp - 1),
            num_layers=self.num_layers_for(pp_rank, chunk),
            layer_number_offset=self.offset_for(pp_rank, chunk),
        )


def layer_split_from_config(config) -> PipelineLayerSplit:
    """The split of ``config.num_layers`` that a (Transformer)config's pipeline fields describe."""
    return compute_layer_split(
        config.num_layers,
        config.pipeline_model_parallel_size,
        config.virtual_pipeline_model_parallel_size,
        config.num_layers_in_first_pipeline_stage,
        config.num_layers_in_last_pipeline_stage,
        config.account_for_embedding_in_pipeline_split,
        config.account_for_loss_in_pipeline_split,
        config.pipeline_model_parallel_layout,
    )


def _stage_of(config, vp_stage: Optional[int], pp_rank: Optional[int]) -> Tuple[int, int]:
    pp = config.pipeline_model_parallel_size
    vp = config.virtual_pipeline_model_parallel_size or 1
    if pp_rank is None:
        if pp > 1:
            raise ValueError(
                f"with pipeline_model_parallel_size {pp} the pipeline rank of the model chunk is "
                "needed (a pg_collection holding the pipeline group)"
            )
        pp_rank = 0
    if vp_stage is None:
        if vp > 1:
            raise ValueError(
                f"with {vp} virtual pipeline stages per rank the model chunk's vp_stage is needed"
            )
        vp_stage = 0
    if not (0 <= pp_rank < pp and 0 <= vp_stage < vp):
        raise ValueError(
            f"pipeline rank {pp_rank} / virtual stage {vp_stage} out of range for "
            f"pipeline_model_parallel_size {pp} x {vp} virtual stages"
        )
    return pp_rank, vp_stage


def get_num_layers_to_build(
    config, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None
) -> int:
    """Layers of the model chunk of pipeline rank ``pp_rank``, virtual stage ``vp_stage``
    (Megatron Core's function; None means 0 where the config has no pipeline / no virtual
    stages)."""
    pp_rank, vp_stage = _stage_of(config, vp_stage, pp_rank)
    return layer_split_from_config(config).num_layers_for(pp_rank, vp_stage)


def get_transformer_layer_offset(
    config, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None
) -> int:
    """How many layers precede that model chunk (the 0-based global index of its first layer)."""
    pp_rank, vp_stage = _stage_of(config, vp_stage, pp_rank)
    return layer_split_from_config(config).offset_for(pp_rank, vp_stage)


def resolve_virtual_pipeline_size(
    num_layers: int,
    pipeline_model_parallel_size: int,
    num_layers_per_virtual_pipeline_stage: Optional[int] = None,
    num_virtual_stages_per_pipeline_rank: Optional[int] = None,
    decoder_first_pipeline_num_layers: Optional[int] = None,
    decoder_last_pipeline_num_layers: Optional[int] = None,
) -> Optional[int]:
    """Model chunks per pipeline rank from the two virtual-stage flags; None means no interleaving
    (a computed size of 1 is also None: Megatron's validate_args sets a virtual pipeline size of
    1 to None)."""
    pp = pipeline_model_parallel_size
    if (
        num_layers_per_virtual_pipeline_stage is not None
        and num_virtual_stages_per_pipeline_rank is not None
    ):
        raise ValueError(
            "--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank "
            "are mutually exclusive; give one of them"
        )
    if (
        num_layers_per_virtual_pipeline_stage is None
        and num_virtual_stages_per_pipeline_rank is None
    ):
        return None
    if pp <= 1:
        raise ValueError(
            "virtual pipeline stages (--num-layers-per-virtual-pipeline-stage / "
            "--num-virtual-stages-per-pipeline-rank) need --pipeline-model-parallel-size > 1, "
            f"got {pp}"
        )
    if num_virtual_stages_per_pipeline_rank is not None:
        vp = num_virtual_stages_per_pipeline_rank
        if vp < 1:
            raise ValueError(f"--num-virtual-stages-per-pipeline-rank must be >= 1, got {vp}")
        return vp if vp > 1 else None
    per_stage = num_layers_per_virtual_pipeline_stage
    if per_stage < 1:
        raise ValueError(f"--num-layers-per-virtual-pipeline-stage must be >= 1, got {per_stage}")
    if (
        decoder_first_pipeline_num_layers is not None
        or decoder_last_pipeline_num_layers is not None
    ):
        raise ValueError(
            "with --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers use "
            "--num-virtual-stages-per-pipeline-rank instead of "
            "--num-layers-per-virtual-pipeline-stage"
        )
    if num_layers % pp != 0:
        raise ValueError(
            f"--num-layers ({num_layers}) must be divisible by "
            f"--pipeline-model-parallel-size ({pp}) "
            "to use --num-layers-per-virtual-pipeline-stage"
        )
    per_rank = num_layers // pp
    if per_rank % per_stage != 0:
        raise ValueError(
            f"layers per pipeline rank ({num_layers} / {pp} = {per_rank}) must be divisible by "
            f"--num-layers-per-virtual-pipeline-stage ({per_stage})"
        )
    vp = per_rank // per_stage
    return vp if vp > 1 else None


def compute_layer_split(
    num_layers: int,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    decoder_first_pipeline_num_layers: Optional[int] = None,
    decoder_last_pipeline_num_layers: Optional[int] = None,
    account_for_embedding_in_pipeline_split: bool = False,
    account_for_loss_in_pipeline_split: bool = False,
    pipeline_model_parallel_layout: Optional[str] = None,
) -> PipelineLayerSplit:
    """Layer counts for every (rank, chunk); raises ValueError naming the flags when impossible."""
    if pipeline_model_parallel_layout is not None:
        return _split_of_layout(
            pipeline_model_parallel_layout,
            num_layers,
            pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size,
            decoder_first_pipeline_num_layers is not None
            or decoder_last_pipeline_num_layers is not None
            or account_for_embedding_in_pipeline_split
            or account_for_loss_in_pipeline_split,
        )
    pp = pipeline_model_parallel_size
    vp = virtual_pipeline_model_parallel_size or 1
    first, last = decoder_first_pipeline_num_layers, decoder_last_pipeline_num_layers
    if num_layers < 1:
        raise ValueError(f"--num-layers must be >= 1, got {num_layers}")
    if pp < 1:
        raise ValueError(f"--pipeline-model-parallel-size must be >= 1, got {pp}")
    if vp > 1 and pp == 1:
        raise ValueError("virtual pipeline stages need --pipeline-model-parallel-size > 1")
    uneven = first is not None or last is not None
    accounting = account_for_embedding_in_pipeline_split or account_for_loss_in_pipeline_split
    if uneven and accounting:
        raise ValueError(
            "--decoder-first/last-pipeline-num-layers cannot be combined with "
            "--account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split"
        )
    if pp == 1 and (uneven or accounting):
        raise ValueError(
            "--decoder-first/last-pipeline-num-layers and --account-for-*-in-pipeline-split "
            "need --pipeline-model-parallel-size > 1"
        )

    if uneven:
        per_rank = _uneven_per_rank(num_layers, pp, first, last)
        for rank, n in enumerate(per_rank):
            if n % vp != 0:
                which = (
                    "--decoder-first-pipeline-num-layers"
                    if rank == 0 and first is not None
                    else "--decoder-last-pipeline-num-layers"
                    if rank == pp - 1 and last is not None
                    else "the layers of a middle pipeline stage"
                )
                raise ValueError(
                    f"{which} ({n}) must be divisible by the virtual pipeline size ({vp})"
                )
        counts = [[n // vp] * vp for n in per_rank]
    else:
        extra = int(account_for_embedding_in_pipeline_split) + int(
            account_for_loss_in_pipeline_split
        )
        total = num_layers + extra
        if total % pp != 0:
            what = f"--num-layers ({num_layers})" + (
                f" + {extra} (--account-for-*-in-pipeline-split)" if extra else ""
            )
            raise ValueError(
                f"{what} must be divisible by --pipeline-model-parallel-size ({pp}); use "
                "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers "
                "for an uneven split"
            )
        per_rank = total // pp
        if per_rank % vp != 0:
            raise ValueError(
                f"layers per pipeline rank ({per_rank}) must be divisible by the number of virtual "
                f"stages per rank ({vp})"
            )
        counts = [[per_rank // vp] * vp for _ in range(pp)]
        if account_for_embedding_in_pipeline_split:
            counts[0][0] -= 1
        if account_for_loss_in_pipeline_split:
            counts[pp - 1][vp - 1] -= 1
        if counts[0][0] < 0 or counts[pp - 1][vp - 1] < 0:
            raise ValueError(
                "--account-for-*-in-pipeline-split leaves a virtual stage with fewer than "
                "zero layers; "
                "use fewer pipeline stages"
            )
    return PipelineLayerSplit(
        num_layers=num_layers,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        counts=tuple(tuple(c) for c in counts),
    )


def _split_of_layout(layout, num_layers, pp, vp, other_split_flags) -> PipelineLayerSplit:
    """The split an explicit ``--pipeline-model-parallel-layout`` gives (its MTP placement is
    checked with the arguments, which know --mtp-num-layers)."""
    from megatron.core.pipeline_parallel.layer_layout import (
        FLAG,
        PipelineParallelLayerLayout,
    )

    if other_split_flags:
        raise ValueError(
            f"{FLAG} cannot be combined with --decoder-first/last-pipeline-num-layers or "
            "--account-for-*-in-pipeline-split"
        )
    parsed = PipelineParallelLayerLayout(layout, pp)
    if parsed.virtual_pipeline_model_parallel_size != (vp or 1):
        raise ValueError(
            f"{FLAG} {layout!r} describes {parsed.virtual_pipeline_model_parallel_size} virtual "
            f"stages per pipeline rank, the configuration {vp or 1}"
        )
    counts = parsed.decoder_counts()
    if sum(map(sum, counts)) != num_layers:
        raise ValueError(
            f"{FLAG} {layout!r} holds {sum(map(sum, counts))} transformer layers (t), "
            f"--num-layers is {num_layers}"
        )
    return PipelineLayerSplit(num_layers, pp, vp, counts)


def _uneven_per_rank(
    num_layers: int, pp: int, first: Optional[int], last: Optional[int]
) -> List[int]:
    for flag, value in (
        ("--decoder-first-pipeline-num-layers", first),
        ("--decoder-last-pipeline-num-layers", last),
    ):
        if value is not None and value < 0:
            raise ValueError(f"{flag} must be >= 0, got {value}")
    fixed = (first or 0) + (last or 0)
    if fixed > num_layers:
        raise ValueError(
            f"--decoder-first-pipeline-num-layers ({first}) + --decoder-last-pipeline-num-layers "
            f"({last}) exceed --num-layers ({num_layers})"
        )
    middle_stages = pp - int(first is not None) - int(last is not None)
    rest = num_layers - fixed
    if middle_stages == 0:
        if rest != 0:
            raise ValueError(
                f"--decoder-first-pipeline-num-layers ({first}) + "
                "--decoder-last-pipeline-num-layers "
                f"({last}) must equal --num-layers ({num_layers}) with "
                f"--pipeline-model-parallel-size {pp}"
            )
        middle = 0
    else:
        if rest % middle_stages != 0:
            raise ValueError(
                f"the {rest} layers left after --decoder-first/last-pipeline-num-layers must be "
                f"divisible by the {middle_stages} remaining pipeline stages "
                f"(--num-layers {num_layers}, --pipeline-model-parallel-size {pp})"
            )
        middle = rest // middle_stages
    per_rank = [middle] * pp
    if first is not None:
        per_rank[0] = first
    if last is not None:
        per_rank[pp - 1] = last
    return per_rank


def check_interleaved_microbatches(
    num_microbatches: int,
    pipeline_model_parallel_size: int,
    microbatch_group_size_per_vp_stage: Optional[int] = None,
) -> int:
    """Megatron's micro-batch rules for the interleaved schedule; returns the group size G.

    G (``--microbatch-group-size-per-virtual-pipeline-stage``, default PP) consecutive micro-batches
    run on one model chunk before the next chunk; PP <= G <= M, and the last, partial group
    (M mod G micro-batches) must be empty or hold at least PP micro-batches, otherwise stages would
    wait on each other in the middle of the pipeline.
    """
    pp, m = pipeline_model_parallel_size, num_microbatches
    g = pp if microbatch_group_size_per_vp_stage is None else microbatch_group_size_per_vp_stage
    if m < 1:
        raise ValueError(f"number of micro-batches must be >= 1, got {m}")
    if not pp <= g <= m:
        raise ValueError(
            f"interleaved pipeline schedule: the micro-batch group size per virtual stage "
            f"(--microbatch-group-size-per-virtual-pipeline-stage, "
            f"default = --pipeline-model-parallel-size) "
            f"is {g} but must lie in [PP={pp}, number of micro-batches={m}]; "
            f"the number of micro-batches is "
            f"--global-batch-size / (--micro-batch-size x data-parallel size)"
        )
    rest = m % g
    if 0 < rest < pp:
        raise ValueError(
            f"interleaved pipeline schedule: number of micro-batches ({m}) mod "
            f"the micro-batch group size ({g}) "
            f"is {rest}; it must be 0 or >= --pipeline-model-parallel-size ({pp}). Choose "
            f"--global-batch-size so that the number of micro-batches is a multiple of {g}"
        )
    return g
