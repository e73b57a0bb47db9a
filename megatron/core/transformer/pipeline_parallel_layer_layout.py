"""megatron-core's import path of the pipeline layer layout (parsed in
megatron/core/pipeline_parallel/layer_layout.py, below the transformer layers)."""

from megatron.core.pipeline_parallel.layer_layout import (  # noqa: F401
    PipelineParallelLayerLayout,
    parse_layout_string,
)
