"""The converters' tensor-parallel split rules (megatron.checkpointing.tp_shards, by name) against
the trainer's (megatron.core.dist_checkpointing.model_state, from the layers' partition
attributes), so that the two cannot drift apart.

Tiny GPT (SwiGLU with biases, q/k layernorm, untied output), MoE (SwiGLU experts over expert TP),
multi-latent attention (with and without the low-rank query), hybrid Mamba (a Mamba-2 mixer, whose
in_proj and conv1d split part by part, attention, a squared-ReLU MLP and an MoE layer with a shared
expert and the router's expert bias), BERT and T5 models are built at TP=2
in a 2-process gloo world. For every tensor, the global tensor the runtime's chunks assemble from
both ranks must be what ``merge_shards`` makes of the two local tensors, and ``split_full`` of it
must give each rank's local tensor back. The tensors the converters refuse are exactly T5's cross-
attention ones (T5 checkpoints are not converted).
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.checkpointing.errors import ConversionError
from megatron.checkpointing.tp_shards import (
    COLUMN,
    GATED_COLUMN,
    PARTED,
    REPLICATED,
    ROW,
    mamba_part_sizes,
    merge_shards,
    split_full,
    tp_split,
)
from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
from megatron.core.models.T5.t5_spec import (
    get_t5_decoder_layer_local_spec,
    get_t5_encoder_layer_local_spec,
)
from tests.unit_tests.dist_utils import run_distributed

TP = 2
MAMBA = dict(mamba_state_dim=4, mamba_head_dim=4, mamba_num_groups=2, mamba_num_heads=4)
# The Mamba sizes the converters take from a checkpoint's args.
PARTS = {"mamba": mamba_part_sizes(argparse.Namespace(hidden_size=32, **MAMBA))}


def _config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    settings = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=TP,
        use_cpu_initialization=True,
    )
    settings.update(overrides)
    return TransformerConfig(**settings)


def _mla_config(**overrides):
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    settings = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=TP,
        kv_lora_rank=12,
        qk_head_dim=4,
        qk_pos_emb_head_dim=4,
        v_head_dim=6,
        qk_layernorm=True,
    )
    settings.update(overrides)
    return MLATransformerConfig(**settings)


def _models(state):
    """{family: (builder, whether fc1 is SwiGLU's [gate; up])}."""
    from megatron.core.models.bert.bert_model import BertModel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.mamba import MambaModel
    from megatron.core.models.T5.t5_model import T5Model
    from megatron.core.transformer.utils import squared_relu

    swiglu = dict(gated_linear_unit=True, activation_func=F.silu)
    return {
        "gpt": (
            lambda: GPTModel(
                _config(**swiglu, add_bias_linear=True, qk_layernorm=True),
                get_gpt_layer_local_spec(),
                vocab_size=64,
                max_sequence_length=16,
                share_embeddings_and_output_weights=False,
                pg_collection=state,
            ),
            True,
        ),
        "moe": (
            lambda: GPTModel(
                _config(
                    **swiglu,
                    num_moe_experts=4,
                    moe_router_topk=2,
                    add_bias_linear=False,
                    sequence_parallel=True,
                    # DeepSeek's: a shared expert and the sigmoid router's expert bias.
                    moe_shared_expert_intermediate_size=32,
                    moe_router_score_function="sigmoid",
                    moe_router_enable_expert_bias=True,
                    mtp_num_layers=1,  # an MTP depth: eh_proj and an MoE layer of its own
                ),
                get_gpt_layer_local_spec(num_experts=4),
                vocab_size=64,
                max_sequence_length=16,
                position_embedding_type="rope",
                pg_collection=state,
                mtp_block_spec=get_gpt_layer_local_spec(num_experts=4),
            ),
            True,
        ),
        "mla": (
            lambda: GPTModel(
                _mla_config(**swiglu, q_lora_rank=8, sequence_parallel=True),
                get_gpt_layer_local_spec(multi_latent_attention=True),
                vocab_size=64,
                max_sequence_length=16,
                position_embedding_type="rope",
                pg_collection=state,
            ),
            True,
        ),
        "mla-full-q": (
            lambda: GPTModel(
                _mla_config(**swiglu, q_lora_rank=None),
                get_gpt_layer_local_spec(multi_latent_attention=True),
                vocab_size=64,
                max_sequence_length=16,
                position_embedding_type="rope",
                pg_collection=state,
            ),
            True,
        ),
        "mamba": (
            lambda: MambaModel(
                _config(
                    **MAMBA,
                    activation_func=squared_relu,
                    add_bias_linear=False,
                    num_moe_experts=4,
                    moe_router_topk=2,
                    moe_shared_expert_intermediate_size=32,
                    moe_router_score_function="sigmoid",
                    moe_router_enable_expert_bias=True,
                    sequence_parallel=True,
                    num_layers=4,
                ),
                vocab_size=64,
                max_sequence_length=16,
                hybrid_override_pattern="M*-E",
                pg_collection=state,
            ),
            False,
        ),
        "bert": (
            lambda: BertModel(
                _config(),
                2,
                bert_layer_local_spec,
                64,
                16,
                share_embeddings_and_output_weights=True,
                pg_collection=state,
            ),
            False,
        ),
        "t5": (
            lambda: T5Model(
                _config(),
                _config(),
                get_t5_encoder_layer_local_spec(),
                get_t5_decoder_layer_local_spec(),
                64,
                16,
                share_embeddings_and_output_weights=True,
                pg_collection=state,
            ),
            False,
        ),
    }


def _assemble(key, parts):
    """The global tensor from every rank's (local tensor, chunks, global shape) of ``key``."""
    shape = parts[0][2]
    full = torch.full(shape, float("nan"))
    for local, chunks, _ in parts:
        for chunk in chunks:
            target, source = full, local
            for dim, (g, l_, size) in enumerate(
                zip(chunk.global_offset, chunk.local_offset, chunk.shape)
            ):
                target = target.narrow(dim, g, size)
                source = source.narrow(dim, l_, size)
            target.copy_(source)
    assert not torch.isnan(full).any(), f"{key}: the ranks' chunks do not cover the tensor"
    return full


def _compare(rank, world_size):
    from megatron.core import dist_checkpointing as dc
    from megatron.core.parallel_state import initialize_model_parallel

    state = initialize_model_parallel(tensor_model_parallel_size=TP, expert_tensor_parallel_size=TP)
    refused, kinds = {}, {}
    for family, (build, swiglu) in _models(state).items():
        torch.manual_seed(7)  # the same draws on both ranks: replicated tensors are equal
        model = build()
        entries, _ = dc.model_sharded_state_dict(
            [model],
            state.get_tensor_model_parallel_rank(),
            TP,
            state.get_expert_tensor_parallel_rank(),
            state.get_expert_tensor_parallel_world_size(),
            megatron_layout=False,
        )
        mine = {k: (e.data, e.chunks, e.global_shape) for k, e in entries.items()}
        both = [None] * world_size
        dist.all_gather_object(both, mine)
        refused[family], kinds[family] = set(), set()
        for key in both[0]:
            parts = [both[r][key] for r in range(world_size)]
            try:
                split = tp_split(key, swiglu)
            except ConversionError:
                refused[family].add(key)
                continue
            kinds[family].add(split)
            full = _assemble(key, parts)
            locals_ = [p[0] for p in parts]
            merged = merge_shards(key, locals_, swiglu, PARTS.get(family))
            assert merged.shape == full.shape and torch.equal(merged, full), (
                f"{family} {key}: the converters merge the TP shards as {split}, which is not "
                f"the tensor the trainer's sharding describes"
            )
            for r, shard in enumerate(split_full(key, full, TP, swiglu, PARTS.get(family))):
                assert shard.shape == locals_[r].shape and torch.equal(shard, locals_[r]), (
                    f"{family} {key}: the converters' TP rank {r} shard ({split}) is not the "
                    "trainer's"
                )
    cross = ("linear_q.weight", "linear_q.bias", "linear_kv.weight", "linear_kv.bias")
    t5_refused = {
        f"decoder.layers.{i}.cross_attention.{name}"
        for i in range(2)
        for name in cross + ("linear_proj.weight",)
    }
    assert refused == {
        "gpt": set(),
        "moe": set(),
        "mla": set(),
        "mla-full-q": set(),
        "mamba": set(),
        "bert": set(),
        "t5": t5_refused,
    }, refused
    # Every kind of split was met (the comparison above did check something).
    assert kinds["gpt"] == {COLUMN, ROW, GATED_COLUMN, REPLICATED}, kinds
    assert kinds["moe"] == {COLUMN, ROW, GATED_COLUMN, REPLICATED}, kinds
    assert kinds["mla"] == kinds["mla-full-q"] == {COLUMN, ROW, GATED_COLUMN, REPLICATED}, kinds
    assert kinds["mamba"] == {COLUMN, ROW, PARTED, REPLICATED}, kinds
    assert kinds["bert"] == kinds["t5"] == {COLUMN, ROW, REPLICATED}, kinds


def test_converter_tp_splits_agree_with_the_trainers_sharding():
    run_distributed(_compare, TP)
