"""Linear and embedding layers used by the transformer (kept here for existing imports).

They are ``megatron.core.tensor_parallel.layers``' ``ColumnParallelLinear``, ``RowParallelLinear``
and ``VocabParallelEmbedding``: built without a ``tp_group`` they are the plain TP=1 layers and
reject a config with tensor_model_parallel_size > 1.
"""

from megatron.core.tensor_parallel.layers import (  # noqa: F401
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding"]
