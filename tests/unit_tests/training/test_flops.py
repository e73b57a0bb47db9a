"""FLOP count of --log-throughput against a per-matmul count written out by hand."""

import argparse

import pytest

from megatron.training.flops import num_floating_point_operations


def flops_by_hand(B, s, L, h, a, g, f, V, swiglu):
    """FLOPs of one training step (forward + backward) counted matmul by matmul."""
    d = h // a
    per_token_per_layer = (
        2 * h * (a * d)  # Q projection
        + 2 * 2 * h * (g * d)  # K and V projections
        + 2 * (a * d) * h  # output projection
        + 2 * s * a * d * 2  # scores and context (no causal discount)
        + 2 * h * f * (3 if swiglu else 2)
    )  # fc1 (x2 when gated) and fc2
    forward = B * s * (L * per_token_per_layer + 2 * h * V)
    return 3 * forward  # backward costs twice the forward


@pytest.mark.parametrize("gqa, swiglu", [(False, False), (True, True)])
def test_matches_hand_count(gqa, swiglu):
    args = argparse.Namespace(
        num_layers=4,
        hidden_size=256,
        num_attention_heads=8,
        num_query_groups=2,
        group_query_attention=gqa,
        kv_channels=None,
        seq_length=512,
        ffn_hidden_size=704,
        swiglu=swiglu,
        padded_vocab_size=8192,
        num_experts=None,
    )
    expected = flops_by_hand(16, 512, 4, 256, 8, 2 if gqa else 8, 704, 8192, swiglu)
    assert num_floating_point_operations(args, 16) == pytest.approx(expected, rel=1e-12)


def test_moe_layers_count_the_routed_and_shared_experts():
    # Layers 0 and 2 of 4 are MoE (--moe-layer-freq 2): top-2 experts of width 96 and a shared
    # expert of width 64 per token; layers 1 and 3 are dense MLPs of width 704.
    common = dict(
        num_layers=4,
        hidden_size=256,
        num_attention_heads=8,
        num_query_groups=8,
        group_query_attention=False,
        kv_channels=None,
        seq_length=512,
        ffn_hidden_size=704,
        swiglu=True,
        padded_vocab_size=8192,
    )
    args = argparse.Namespace(
        **common,
        num_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=96,
        moe_shared_expert_intermediate_size=64,
        moe_layer_freq=2,
    )
    dense = flops_by_hand(16, 512, 4, 256, 8, 8, 704, 8192, True)
    # Two of the four layers trade an MLP of width 704 for MLPs of total width 2 * 96 + 64.
    mlp_per_width = 3 * 16 * 512 * 2 * 256 * 3  # fwd+bwd, per unit of SwiGLU MLP width
    expected = dense - 2 * mlp_per_width * (704 - (2 * 96 + 64))
    assert num_floating_point_operations(args, 16) == pytest.approx(expected, rel=1e-12)


def test_mtp_depths_are_layers_like_the_last_one():
    """Megatron's count: each MTP depth adds a layer of the last layer's kind (dense or MoE), an
    eh_proj [2h -> h] with its three norms, and an output layer."""
    common = dict(
        num_layers=4,
        hidden_size=256,
        num_attention_heads=8,
        num_query_groups=8,
        group_query_attention=False,
        kv_channels=None,
        seq_length=512,
        ffn_hidden_size=704,
        swiglu=False,
        padded_vocab_size=8192,
        num_experts=None,
    )
    B, s, h, V = 16, 512, 256, 8192
    base = num_floating_point_operations(argparse.Namespace(**common, mtp_num_layers=None), B)
    one_layer = flops_by_hand(B, s, 1, h, 8, 8, 704, V, False) - 3 * B * s * 2 * h * V
    extra = one_layer + 3 * B * s * 2 * h * V + 6 * B * s * (3 * h + 2 * h * h)
    mtp2 = num_floating_point_operations(argparse.Namespace(**common, mtp_num_layers=2), B)
    assert mtp2 - base == pytest.approx(2 * extra, rel=1e-12)
    moe = dict(common, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=96)
    for freq, last_is_moe in ((2, False), ([1, 0, 0, 1], True)):
        moe["moe_layer_freq"] = freq
        without = num_floating_point_operations(argparse.Namespace(**moe, mtp_num_layers=None), B)
        got = num_floating_point_operations(argparse.Namespace(**moe, mtp_num_layers=1), B)
        mlp_change = 3 * B * s * 2 * h * 2 * (2 * 96 - 704) if last_is_moe else 0
        assert got - without == pytest.approx(extra + mlp_change, rel=1e-12), freq
