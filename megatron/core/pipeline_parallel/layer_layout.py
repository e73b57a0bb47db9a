"""``--pipeline-model-parallel-layout``: which layers each pipeline stage (and virtual stage)
holds, written as megatron-core's layout string, e.g. ``"Et*3|(tt|)*6mL"``.

Grammar (megatron-core's): stages are separated by ``|``; ``E`` is the embedding, ``t`` a
transformer (decoder) layer, ``m`` a multi-token-prediction layer, ``L`` the loss (output
layer); ``x*n`` repeats one character and ``(...)*n`` a group n times; commas are cosmetic.
The stages are listed in model order, virtual stage ``v`` being held by pipeline rank
``v % PP`` as its model chunk ``v // PP`` (so the stage count is PP x the virtual pipeline size).

Validation (megatron-core's rules): the embedding comes first and the loss last, each exactly
once; the ``t`` count equals ``--num-layers`` and the ``m`` count ``--mtp-num-layers``; MTP
layers follow every decoder layer, all in one stage, the last model chunk of a rank that is not
the first. Every error is a ``ValueError`` whose message names the flag. Pure Python: argument
validation parses the layout before any process group exists.
"""

from __future__ import annotations

import re
from typing import List, Optional, Tuple

FLAG = "--pipeline-model-parallel-layout"
EMBEDDING, DECODER, MTP, LOSS = "embedding", "decoder", "mtp", "loss"
_LAYER_OF_CHAR = {"E": EMBEDDING, "t": DECODER, "m": MTP, "L": LOSS}


def parse_layout_string(layout: str) -> List[List[str]]:
    """The stages of a layout string, in model order, each a list of layer kinds."""
    if not isinstance(layout, str) or not layout.strip():
        raise ValueError(f"{FLAG} must be a non-empty layout string such as 'Et|(tt|)*3,m|L'")
    text = layout.replace(",", "").replace(" ", "")
    # Unroll '(group)*n' first, then 'x*n' (megatron-core's order).
    text = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    text = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    stages = []
    for stage in text.split("|"):
        kinds = []
        for char in stage:
            if char not in _LAYER_OF_CHAR:
                raise ValueError(
                    f"{FLAG} {layout!r}: unknown layer character {char!r} in stage {stage!r} "
                    "(E embedding, t transformer layer, m MTP layer, L loss; '|' separates "
                    "stages, 'x*n' and '(...)*n' repeat)"
                )
            kinds.append(_LAYER_OF_CHAR[char])
        stages.append(kinds)
    return stages


class PipelineParallelLayerLayout:
    """A parsed layout: ``layout[pp_rank][vp_stage]`` lists the layer kinds of that model
    chunk (megatron-core's class of the same name)."""

    def __init__(self, layout: str, pipeline_model_parallel_size: int):
        self.input_data = layout
        stages = parse_layout_string(layout)
        pp = pipeline_model_parallel_size
        if len(stages) % pp != 0:
            raise ValueError(
                f"{FLAG} {layout!r} has {len(stages)} stages, not a multiple of "
                f"--pipeline-model-parallel-size ({pp})"
            )
        vp = len(stages) // pp
        self.pipeline_model_parallel_size = pp
        self.virtual_pipeline_model_parallel_size = vp
        self.layout = [[stages[v * pp + rank] for v in range(vp)] for rank in range(pp)]
        self.flatten_layout = [kind for stage in stages for kind in stage]

    def __repr__(self) -> str:
        return self.input_data

    def validate_layer_layout(self, num_layers: int, mtp_num_layers: Optional[int]) -> bool:
        """Check the layout against the model; returns whether the MTP layers sit on a rank
        other than the last (megatron-core's 'standalone' MTP stage)."""
        flat, name = self.flatten_layout, f"{FLAG} {self.input_data!r}"
        if not flat or flat[0] != EMBEDDING:
            raise ValueError(f"{name}: the first layer must be the embedding E")
        if flat[-1] != LOSS:
            raise ValueError(f"{name}: the last layer must be the loss L")
        if flat.count(EMBEDDING) != 1 or flat.count(LOSS) != 1:
            raise ValueError(f"{name}: E and L must each appear exactly once")
        if flat.count(DECODER) != num_layers:
            raise ValueError(
                f"{name} holds {flat.count(DECODER)} transformer layers (t), --num-layers is "
                f"{num_layers}"
            )
        if flat.count(MTP) != (mtp_num_layers or 0):
            raise ValueError(
                f"{name} holds {flat.count(MTP)} MTP layers (m), --mtp-num-layers is "
                f"{mtp_num_layers or 0}"
            )
        if MTP in flat and DECODER in flat[flat.index(MTP) :]:
            raise ValueError(f"{name}: the MTP layers (m) must follow every transformer layer (t)")
        standalone = False
        for rank, chunks in enumerate(self.layout):
            if any(MTP in chunk for chunk in chunks[:-1]):
                raise ValueError(
                    f"{name}: the MTP layers must be in the last virtual stage of their "
                    "pipeline rank"
                )
            if MTP in chunks[-1]:
                if chunks[-1].count(MTP) != mtp_num_layers:
                    raise ValueError(f"{name}: all MTP layers must be in one stage")
                standalone = standalone or rank != self.pipeline_model_parallel_size - 1
        return standalone

    def decoder_counts(self) -> Tuple[Tuple[int, ...], ...]:
        """counts[pp_rank][vp_stage]: transformer layers of each model chunk."""
        return tuple(tuple(chunk.count(DECODER) for chunk in chunks) for chunks in self.layout)

    def get_num_layers_to_build(self, layer_type: str = DECODER, vp_stage=None, pp_rank=None):
        """Layers of ``layer_type`` in that model chunk."""
        return self.layout[pp_rank or 0][vp_stage or 0].count(layer_type)

    @staticmethod
    def get_num_stages_from_str(layout: str) -> int:
        """PP x the virtual pipeline size a layout string describes."""
        return len(parse_layout_string(layout))
