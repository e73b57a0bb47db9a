"""Token (+ learned absolute position) (+ token type) embedding, output in [s, b, h]."""

from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel.layers import VocabParallelEmbedding
from megatron.core.tensor_parallel.mappings import scatter_to_sequence_parallel_region
from megatron.core.tensor_parallel.parameters import new_weight
from megatron.core.tensor_parallel.process_groups import resolve_pg_collection
from megatron.core.transformer.module import MegatronModule

_POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "none")


class LanguageModelEmbedding(MegatronModule):
    """``word_embeddings`` [V, h], ``position_embeddings`` [max_sequence_length, h] when
    ``position_embedding_type == 'learned_absolute'``, ``tokentype_embeddings`` when
    ``num_tokentypes > 0``, all drawn with ``config.embedding_init_method``; the sum (times
    ``mup_embedding_mult`` under muP) goes through dropout (``hidden_dropout``).

    Lookups index with the transposed ids, so the [s, b, h] output needs no transpose copy.
    """

    def __init__(
        self,
        config,
        vocab_size: int,
        max_sequence_length: int,
        position_embedding_type: str = "learned_absolute",
        num_tokentypes: int = 0,
        scatter_to_sequence_parallel: bool = True,
        pg_collection=None,
    ):
        super().__init__(config)
        pgs = resolve_pg_collection(config, pg_collection)
        self.tp_group = pgs.tp
        if position_embedding_type not in _POSITION_EMBEDDING_TYPES:
            raise ValueError(
                f"position_embedding_type {position_embedding_type!r} is not supported "
                f"(--position-embedding-type); choose one of {_POSITION_EMBEDDING_TYPES}"
            )
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        self.position_embedding_type = position_embedding_type
        self.add_position_embedding = position_embedding_type == "learned_absolute"
        self.num_tokentypes = num_tokentypes
        self.sequence_parallel = (
            bool(config.sequence_parallel) and pgs.tp_size > 1 and scatter_to_sequence_parallel
        )
        self.reduce_scatter_embeddings = (
            self.sequence_parallel and not self.add_position_embedding and num_tokentypes <= 0
        )
        self.word_embeddings = VocabParallelEmbedding(
            vocab_size,
            config.hidden_size,
            init_method=config.embedding_init_method,
            config=config,
            reduce_scatter_embeddings=self.reduce_scatter_embeddings,
            tp_group=self.tp_group,
        )
        if self.add_position_embedding:
            if max_sequence_length <= 0:
                raise ValueError(
                    f"max_sequence_length must be positive (--max-position-embeddings), "
                    f"got {max_sequence_length}"
                )
            self.position_embeddings = _Embedding(
                max_sequence_length, config, config.embedding_init_method
            )
        if num_tokentypes > 0:
            self.tokentype_embeddings = _Embedding(
                num_tokentypes, config, config.embedding_init_method
            )
        else:
            self.tokentype_embeddings = None
        self.embedding_dropout = config.hidden_dropout
        self.fp32_residual = config.fp32_residual_connection
        self.mup_embedding_mult = config.mup_embedding_mult if config.use_mup else 1.0

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: Optional[torch.Tensor] = None,
        tokentype_ids: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """input_ids [b, s] (position_ids [b, s], tokentype_ids [b, s]) -> [s, b, h]."""
        embeddings = self.word_embeddings(input_ids.t())
        if self.add_position_embedding:
            if position_ids is None:
                s = input_ids.shape[1]
                position_ids = torch.arange(s, device=input_ids.device).unsqueeze(0)
            if (
                position_ids.shape[-1] > self.max_sequence_length
                and position_ids.max() >= self.max_sequence_length
            ):
                raise ValueError(
                    f"sequence of length {position_ids.shape[-1]} exceeds max_sequence_length "
                    f"{self.max_sequence_length} (--max-position-embeddings)"
                )
            embeddings = embeddings + self.position_embeddings(position_ids.t())
        if self.tokentype_embeddings is not None:
            if tokentype_ids is None:
                raise ValueError("tokentype_ids are required when num_tokentypes > 0")
            embeddings = embeddings + self.tokentype_embeddings(tokentype_ids.t())
        if self.mup_embedding_mult != 1.0:
            embeddings = embeddings * self.mup_embedding_mult
        if self.sequence_parallel and not self.reduce_scatter_embeddings:
            embeddings = scatter_to_sequence_parallel_region(embeddings, self.tp_group)
        if self.fp32_residual:
            embeddings = embeddings.float()
        if self.training and self.embedding_dropout > 0.0:
            embeddings = F.dropout(embeddings, p=self.embedding_dropout, training=True)
        return embeddings


class _Embedding(torch.nn.Module):
    """A plain (unsplit) embedding table with a ``weight`` like torch.nn.Embedding's."""

    def __init__(self, num_embeddings: int, config, init_method):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.weight = new_weight((num_embeddings, config.hidden_size), config, init_method)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.weight.shape[1]}"
