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
