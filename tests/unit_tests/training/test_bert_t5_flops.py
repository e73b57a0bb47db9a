"""--log-throughput FLOPs of BERT and T5 (their model families) against torch's FlopCounterMode on
the built models: every matmul of one forward pass, counted by torch, times 3 (the backward costs
twice the forward, the convention of Megatron's formula). torch does not count its fused CPU
attention kernel; it is registered here as 4 * b * heads * sq * sk * d (scores and context)."""

import argparse
import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megatron.core.models.bert import BertModel
from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
from megatron.core.models.T5 import T5Model
from megatron.core.models.T5.t5_spec import (
    get_t5_decoder_layer_local_spec,
    get_t5_encoder_layer_local_spec,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.model_families import get_model_family

H, HEADS, LAYERS, VOCAB, SEQ, BATCH = 64, 4, 3, 128, 16, 2


def _cpu_sdpa(query, key, value, *args, out_shape=None, **kwargs):
    b, heads, sq, d = query
    return 4 * b * heads * sq * key[2] * d


def _measured(model, *inputs):
    mapping = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa}
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        model(*inputs)
    return 3 * counter.get_total_flops()


def _config(**overrides):
    return TransformerConfig(
        num_layers=LAYERS,
        hidden_size=H,
        num_attention_heads=HEADS,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_seed=1,
        **overrides,
    )


def _args(**extra):
    return argparse.Namespace(
        num_layers=LAYERS,
        hidden_size=H,
        num_attention_heads=HEADS,
        num_query_groups=HEADS,
        group_query_attention=False,
        kv_channels=None,
        seq_length=SEQ,
        ffn_hidden_size=4 * H,
        swiglu=False,
        padded_vocab_size=VOCAB,
        num_experts=None,
        **extra,
    )


@pytest.mark.parametrize("binary_head", [True, False])
def test_bert_flops_match_torch_count(binary_head):
    model = BertModel(
        _config(),
        2 if binary_head else 0,
        bert_layer_local_spec,
        VOCAB,
        SEQ,
        share_embeddings_and_output_weights=True,
        add_binary_head=binary_head,
    ).eval()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    types = torch.zeros_like(ids) if binary_head else None
    measured = _measured(model, ids, torch.ones(BATCH, SEQ), types)
    formula = get_model_family("bert").num_floating_point_operations(
        _args(bert_binary_head=binary_head), BATCH
    )
    assert formula == measured


def test_t5_flops_match_torch_count():
    config = _config()
    model = T5Model(
        dataclasses.replace(config, num_layers=2),
        config,
        get_t5_encoder_layer_local_spec(),
        get_t5_decoder_layer_local_spec(),
        VOCAB,
        SEQ,
        share_embeddings_and_output_weights=True,
    ).eval()
    enc = torch.randint(0, VOCAB, (BATCH, SEQ))
    dec = torch.randint(0, VOCAB, (BATCH, 8))
    measured = _measured(model, enc, dec, torch.ones(BATCH, SEQ))
    args = _args(encoder_num_layers=LAYERS, decoder_num_layers=2)
    args.encoder_seq_length, args.decoder_seq_length = SEQ, 8
    assert get_model_family("t5").num_floating_point_operations(args, BATCH) == measured
