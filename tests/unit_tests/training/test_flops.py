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


def _tiny_deepseek_args(tmp_path):
    """The validated flags of examples/deepseek_v3/tiny_cpu.sh (its DRY_RUN=1 command line,
    recorded by a stub interpreter), with a padded vocabulary."""
    import contextlib
    import io
    import os
    import subprocess

    from megatron.training.tokenizer import build_tokenizer
    from tests.harness import REPO
    from tests.unit_tests.tiny_configs import validated_args

    stub, capture = tmp_path / "record_argv.sh", tmp_path / "argv"
    stub.write_text('#!/bin/bash\nprintf "%s\\0" "$@" > "$CAPTURE_FILE"\n')
    stub.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("LAYOUT", "SEQ", "MBS", "GBS")}
    env.update(DRY_RUN="1", PYTHON=str(stub), CAPTURE_FILE=str(capture))
    subprocess.run(
        ["bash", str(REPO / "examples/deepseek_v3/tiny_cpu.sh"), "--attention-backend", "unfused"],
        cwd=REPO,
        env=env,
        check=True,
        timeout=60,
    )
    module_flag, module, *argv = capture.read_text().split("\0")[:-1]
    assert (module_flag, module) == ("-m", "megatron.training.dry_run")
    args = validated_args(argv)
    with contextlib.redirect_stdout(io.StringIO()):
        build_tokenizer(args)
    return args


def _build_gpt(args):
    import torch

    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.multi_token_prediction import mtp_layer_spec
    from megatron.training.configs import core_transformer_config_from_args

    config = core_transformer_config_from_args(args)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    torch.manual_seed(0)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base,
        mtp_block_spec=mtp_layer_spec(spec),
    )


def test_tiny_deepseek_v3_flops_and_parameters_equal_the_built_model(tmp_path):
    """The tiny DeepSeek-V3 of examples/deepseek_v3/tiny_cpu.sh (multi-latent attention with q
    LoRA, a dense first layer, 16 routed experts top-4 and a shared expert behind the sigmoid
    router with group-limited top-k, one MTP layer), built as pretrain_gpt.py builds it:
    count_parameters equals its parameters (the MTP part, the routed experts too), and one
    forward + backward of a micro-batch through the model and the MTP loss costs, as counted by
    torch.utils.flop_counter.FlopCounterMode on every matmul, the FLOPs of --log-throughput
    plus what Megatron's formula leaves out on purpose: the router GEMM [h -> E] of each MoE
    layer (MTP's included) and minus the MTP norms' 3h per token it adds."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from megatron.training.theoretical_memory import count_parameters

    args = _tiny_deepseek_args(tmp_path)
    model = _build_gpt(args)
    count = count_parameters(args, args.padded_vocab_size)
    params = dict(model.named_parameters())
    assert count.total == sum(p.numel() for p in params.values())
    assert count.mtp_total == sum(p.numel() for n, p in params.items() if n.startswith("mtp."))
    routed = sum(p.numel() for n, p in params.items() if ".experts." in n)
    assert count.num_moe_layers * count.moe_experts + count.mtp_experts == routed
    assert count.mtp_is_moe and count.num_moe_layers == 3 and count.mtp_layers == 1

    b, s = args.micro_batch_size, args.seq_length
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.padded_vocab_size, (b, s), generator=g)
    labels = torch.randint(0, args.padded_vocab_size, (b, s), generator=g)
    position_ids = torch.arange(s).unsqueeze(0).expand(b, s)
    with FlopCounterMode(display=False) as counter:
        loss = model(tokens, position_ids, None, labels=labels)
        loss.float().sum().backward()
    measured = counter.get_total_flops()
    assert all(p.grad is not None for n, p in params.items() if "mtp." in n)

    h, experts = args.hidden_size, args.num_experts
    router = 6 * b * s * h * experts * (count.num_moe_layers + count.mtp_layers)
    mtp_norms = 6 * b * s * args.mtp_num_layers * 3 * h
    expected = num_floating_point_operations(args, b) + router - mtp_norms
    assert measured == expected, (measured, expected)


def test_gated_delta_net_layers_and_attention_output_gate():
    """Layers 1-3 of 4 are gated delta nets (--linear-attention-freq 4), counted matmul by matmul
    as Megatron does; layer 4 is softmax attention with the output gate (one more h x (a d)
    projection)."""
    B, s, L, h, a, f, V = 16, 512, 4, 256, 8, 704, 8192
    nk, nv, dk, dv, kernel = 2, 4, 32, 48, 4
    args = argparse.Namespace(
        num_layers=L,
        hidden_size=h,
        num_attention_heads=a,
        num_query_groups=a,
        group_query_attention=False,
        kv_channels=None,
        seq_length=s,
        ffn_hidden_size=f,
        swiglu=False,
        padded_vocab_size=V,
        num_experts=None,
        attention_output_gate=True,
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=4,
        linear_num_key_heads=nk,
        linear_num_value_heads=nv,
        linear_key_head_dim=dk,
        linear_value_head_dim=dv,
        linear_conv_kernel_dim=kernel,
    )
    gdn_per_token = 2 * (
        h * (2 * nk * dk + 2 * nv * dv + 2 * nv)  # in_proj [q k v z beta alpha]
        + kernel * (2 * nk * dk + nv * dv)  # conv1d
        + 4 * nv * dv * dv  # the delta rule
        + nv * dv * h  # out_proj
    )
    dense = flops_by_hand(B, s, L, h, a, a, f, V, False)
    d = h // a
    softmax_per_token = 2 * h * a * d * 4 + 2 * s * a * d * 2  # Q K V O, scores and context
    gate_per_token = 2 * h * a * d
    expected = dense + 3 * B * s * (3 * (gdn_per_token - softmax_per_token) + gate_per_token)
    assert num_floating_point_operations(args, B) == pytest.approx(expected, rel=1e-12)
