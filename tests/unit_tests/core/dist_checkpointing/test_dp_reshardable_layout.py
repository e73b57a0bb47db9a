"""megatron-core's grad-buffer layout (dp_reshardable checkpoints), against hand-worked examples.
The same function is checked against megatron-core's own buffers in
tests/interop/test_megatron_core_dp_reshardable.py."""

import pytest

from megatron.core.dist_checkpointing.dp_reshardable import (
    BucketLayout,
    ParamSlot,
    UnmappableLayout,
    bucket_key,
    buffer_layout,
    registration_order,
)

# Registration order a, b, c: the buffer holds c, b, a; each starts at a multiple of 64.
PARAMS = [("a", 10), ("b", 100), ("c", 5)]


def test_one_bucket_reverse_order_start_padding_and_end_padding_to_the_dp_multiple():
    # c: 0..5; b: 64..164; a: 192..202; the end is padded to lcm(dp, 128).
    slots = (ParamSlot("c", 0, 5), ParamSlot("b", 64, 100), ParamSlot("a", 192, 10))
    assert buffer_layout(PARAMS, dp_size=1) == [BucketLayout(slots, 202, 256)]
    assert buffer_layout(PARAMS, dp_size=3) == [BucketLayout(slots, 202, 384)]  # lcm(3,128)


def test_a_bucket_closes_once_it_holds_bucket_size_elements():
    # c and b reach 164 >= 150: that bucket ends at 164, padded to 256; a starts the next one.
    assert buffer_layout(PARAMS, dp_size=1, bucket_size=150) == [
        BucketLayout((ParamSlot("c", 0, 5), ParamSlot("b", 64, 100)), 164, 256),
        BucketLayout((ParamSlot("a", 0, 10),), 10, 128),
    ]


def test_a_shared_embedding_gets_a_bucket_of_its_own():
    # out 0..40, x 64..94; emb would start at 128: the open bucket closes there (its unpadded
    # size counts emb's start padding, as megatron-core's does), emb fills the next one alone.
    params = [("emb", 20), ("x", 30), ("out", 40)]
    assert buffer_layout(params, dp_size=2, own_bucket=("emb",)) == [
        BucketLayout((ParamSlot("out", 0, 40), ParamSlot("x", 64, 30)), 128, 128),
        BucketLayout((ParamSlot("emb", 0, 20),), 20, 128),
    ]


def test_registration_order_puts_linear_proj_before_linear_qkv_and_numbers_layers():
    names = [
        "output_layer.weight",
        "decoder.layers.10.self_attention.linear_qkv.weight",
        "decoder.layers.2.mlp.linear_fc2.bias",
        "decoder.layers.2.self_attention.linear_qkv.weight",
        "decoder.layers.2.self_attention.linear_proj.bias",
        "decoder.layers.2.self_attention.linear_proj.weight",
        "decoder.layers.2.input_layernorm.weight",
        "decoder.final_layernorm.bias",
        "embedding.position_embeddings.weight",
        "embedding.word_embeddings.weight",
    ]
    assert registration_order(names) == [
        "embedding.word_embeddings.weight",
        "embedding.position_embeddings.weight",
        "decoder.layers.2.input_layernorm.weight",
        "decoder.layers.2.self_attention.linear_proj.weight",
        "decoder.layers.2.self_attention.linear_proj.bias",
        "decoder.layers.2.self_attention.linear_qkv.weight",
        "decoder.layers.2.mlp.linear_fc2.bias",
        "decoder.layers.10.self_attention.linear_qkv.weight",
        "decoder.final_layernorm.bias",
        "output_layer.weight",
    ]


def test_te_spec_fused_layer_norm_names_come_before_their_linear_weight_and_bias():
    # One TE-spec layer without linear biases, LayerNorm (h=4, ffn=8, 2 heads): registration is
    # linear_proj.weight, then linear_qkv's layer_norm_weight, layer_norm_bias, weight, then
    # linear_fc1's the same, then linear_fc2.weight (TE's LayerNormLinear order).
    sizes = {
        "decoder.layers.0.self_attention.linear_proj.weight": 16,
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": 4,
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_bias": 4,
        "decoder.layers.0.self_attention.linear_qkv.weight": 48,
        "decoder.layers.0.mlp.linear_fc1.layer_norm_weight": 4,
        "decoder.layers.0.mlp.linear_fc1.layer_norm_bias": 4,
        "decoder.layers.0.mlp.linear_fc1.weight": 32,
        "decoder.layers.0.mlp.linear_fc2.weight": 32,
    }
    expected = list(sizes)
    order = registration_order(list(reversed(expected)))
    assert order == expected
    # Reversed in the buffer, each start rounded up to 64:
    # fc2.w 0..32, fc1.w 64..96, fc1.ln_b 128..132, fc1.ln_w 192..196, qkv.w 256..304,
    # qkv.ln_b 320..324, qkv.ln_w 384..388, proj.w 448..464; end padded to 512 at DP=2.
    starts = [448, 384, 320, 256, 192, 128, 64, 0]
    (bucket,) = buffer_layout([(n, sizes[n]) for n in order], dp_size=2)
    assert bucket == BucketLayout(
        tuple(ParamSlot(n, s, sizes[n]) for n, s in reversed(list(zip(order, starts)))),
        464,
        512,
    )


def test_an_unknown_parameter_is_refused_by_name():
    with pytest.raises(UnmappableLayout, match=r"decoder\.layers\.0\.mlp\.router\.weight"):
        registration_order(["decoder.layers.0.mlp.router.weight"])


def test_bucket_key_is_megatron_cores():
    import torch

    key = bucket_key(3, 1, (torch.float32, torch.float32), 2, "exp_avg")
    assert key == (
        "optimizer.distributed.dp_group_idx_3.gbuf_idx_1."
        "dtype_(torch.float32, torch.float32).bucket_idx_2.exp_avg"
    )
