"""Building blocks: RoPE, norms, attention, MLP, layer and block in [s, b, h]."""

import math

import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.common.embeddings import LanguageModelEmbedding, RotaryEmbedding
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.norms import LayerNorm, RMSNorm, build_norm
from megatron.core.transformer.rotary_pos_embedding import (
    apply_rotary_pos_emb,
    llama3_scale_inv_freq,
)
from megatron.core.transformer.transformer_block import TransformerBlock
from tests.unit_tests.tiny_configs import tiny_transformer_config

pytestmark = pytest.mark.usefixtures("single_thread")


def cfg(**overrides):
    """The tiny config in float64: modules are compared with formulas to 1e-12."""
    return tiny_transformer_config(**{"params_dtype": torch.float64, **overrides})


# ----------------------------------------------------------------------------- RoPE


def test_rope_position_zero_is_identity_and_rotation_preserves_pair_norms():
    rope = RotaryEmbedding(kv_channels=8)
    t = torch.randn(5, 2, 3, 8, dtype=torch.float64)
    out = apply_rotary_pos_emb(t, rope.get_cos_sin(5, torch.float64, "cpu"))
    torch.testing.assert_close(out[0], t[0])
    pair_norm = lambda x: x[..., :4] ** 2 + x[..., 4:] ** 2  # noqa: E731
    torch.testing.assert_close(pair_norm(out), pair_norm(t))
    assert not torch.allclose(out[1:], t[1:])


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_scores_depend_only_on_relative_position(interleaved):
    rope = RotaryEmbedding(kv_channels=8, rotary_interleaved=interleaved)
    tables = rope.get_cos_sin(10, torch.float64, "cpu")
    q = torch.randn(1, 1, 1, 8, dtype=torch.float64).expand(10, 1, 1, 8)
    k = torch.randn(1, 1, 1, 8, dtype=torch.float64).expand(10, 1, 1, 8)
    rq = apply_rotary_pos_emb(q, tables, interleaved)[:, 0, 0]
    rk = apply_rotary_pos_emb(k, tables, interleaved)[:, 0, 0]
    torch.testing.assert_close(rq[3] @ rk[1], rq[8] @ rk[6])
    torch.testing.assert_close(rq[5] @ rk[5], q[0, 0, 0] @ k[0, 0, 0])


def test_rope_megatron_angle_table_gives_same_result_and_partial_dims_pass_through():
    for interleaved in (False, True):
        rope = RotaryEmbedding(kv_channels=12, rotary_percent=0.5, rotary_interleaved=interleaved)
        assert rope.dim == 6
        emb = rope(7)
        assert emb.shape == (7, 1, 1, 6)
        t = torch.randn(7, 2, 3, 12, dtype=torch.float32)
        a = apply_rotary_pos_emb(t, emb, interleaved)
        b = apply_rotary_pos_emb(t, rope.get_cos_sin(7, torch.float32, "cpu"), interleaved)
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(a[..., 6:], t[..., 6:], rtol=0, atol=0)


def test_rope_seq_len_interpolation_and_llama3_scaling():
    plain = RotaryEmbedding(kv_channels=8)
    interp = RotaryEmbedding(kv_channels=8, seq_len_interpolation_factor=2.0)
    torch.testing.assert_close(interp(8)[4], plain(8)[2])
    inv = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128))
    scaled = llama3_scale_inv_freq(inv, factor=8.0)
    wavelen = 2 * math.pi / inv
    high = wavelen < 8192 / 4
    low = wavelen > 8192
    torch.testing.assert_close(scaled[high], inv[high])
    torch.testing.assert_close(scaled[low], inv[low] / 8)
    mid = ~(high | low)
    assert mid.any() and torch.all(scaled[mid] < inv[mid]) and torch.all(scaled[mid] > inv[mid] / 8)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            dict(rotary_percent=0.0),
            r"rotary_percent must be in \(0, 1\] \(--rotary-percent\), got 0",
        ),
        (dict(rotary_percent=1.5), r"rotary_percent must be in \(0, 1\] .*got 1.5"),
        (dict(kv_channels=6, rotary_percent=0.5), r"= 3 must be a positive even number"),
    ],
)
def test_rope_rejects_bad_settings(kwargs, match):
    kwargs.setdefault("kv_channels", 8)
    with pytest.raises(ValueError, match=match):
        RotaryEmbedding(**kwargs)


# ----------------------------------------------------------------------------- norms


def test_layernorm_and_rmsnorm_math():
    x = torch.randn(4, 3, 16, dtype=torch.float64)
    ln = LayerNorm(cfg(), 16, eps=1e-5)
    with torch.no_grad():
        ln.weight.uniform_(0.5, 1.5)
        ln.bias.uniform_(-1, 1)
    torch.testing.assert_close(ln(x), F.layer_norm(x, (16,), ln.weight, ln.bias, 1e-5))
    rms = RMSNorm(cfg(), 16, eps=1e-6)
    with torch.no_grad():
        rms.weight.uniform_(0.5, 1.5)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * rms.weight
    torch.testing.assert_close(rms(x), expected)
    assert [n for n, _ in rms.named_parameters()] == ["weight"]


def test_zero_centered_gamma_uses_one_plus_weight():
    c = cfg(layernorm_zero_centered_gamma=True, normalization="RMSNorm")
    norm = build_norm(c, 16)
    assert isinstance(norm, RMSNorm) and torch.all(norm.weight == 0)
    x = torch.randn(3, 16, dtype=torch.float64)
    plain = RMSNorm(cfg(), 16, eps=c.layernorm_epsilon)
    torch.testing.assert_close(norm(x), plain(x))
    with torch.no_grad():
        norm.weight.fill_(0.5)
    torch.testing.assert_close(norm(x), plain(x) * 1.5)


def test_norm_with_fp32_input_and_bf16_params_returns_param_dtype():
    norm = LayerNorm(cfg(params_dtype=torch.bfloat16, bf16=True), 16)
    x = torch.randn(3, 16)
    out = norm(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), F.layer_norm(x, (16,)), rtol=1e-2, atol=1e-2)


# ----------------------------------------------------------------------------- attention / MLP


def test_gqa_attention_equals_mha_with_repeated_kv_heads():
    torch.manual_seed(0)
    gqa_cfg = cfg(num_query_groups=2, add_bias_linear=False)
    mha_cfg = cfg(add_bias_linear=False)
    gqa, mha = SelfAttention(gqa_cfg), SelfAttention(mha_cfg)
    d, npg = 8, 2
    w = gqa.linear_qkv.weight.detach().view(2, npg + 2, d, 32)
    rows = []
    for head in range(4):  # MHA layout: per head [q, k, v]; head h uses group h // npg
        g, j = divmod(head, npg)
        rows += [w[g, j], w[g, npg], w[g, npg + 1]]
    with torch.no_grad():
        mha.linear_qkv.weight.copy_(torch.cat(rows))
        mha.linear_proj.weight.copy_(gqa.linear_proj.weight)
    x = torch.randn(6, 2, 32, dtype=torch.float64)
    tables = RotaryEmbedding(8).get_cos_sin(6, torch.float64, "cpu")
    out_gqa, bias = gqa(x, None, rotary_pos_emb=tables)
    out_mha, _ = mha(x, None, rotary_pos_emb=tables)
    assert out_gqa.shape == (6, 2, 32) and bias is None
    torch.testing.assert_close(out_gqa, out_mha, rtol=0, atol=1e-12)


def test_swiglu_mlp_uses_gate_then_up_halves():
    mlp = MLP(
        cfg(
            gated_linear_unit=True,
            activation_func=F.silu,
            ffn_hidden_size=24,
            add_bias_linear=False,
        )
    )
    assert mlp.linear_fc1.weight.shape == (48, 32)
    x = torch.randn(5, 2, 32, dtype=torch.float64)
    gate = x @ mlp.linear_fc1.weight[:24].T
    up = x @ mlp.linear_fc1.weight[24:].T
    out, bias = mlp(x)
    torch.testing.assert_close(out, (F.silu(gate) * up) @ mlp.linear_fc2.weight.T)
    assert bias is None


# ----------------------------------------------------------------------------- block / embedding


def test_block_layer_numbers_final_norm_and_input_tensor():
    block = TransformerBlock(
        cfg(num_layers=8),
        num_layers=3,
        layer_number_offset=4,
        pre_process=False,
        post_process=False,
    )
    assert [layer.layer_number for layer in block.layers] == [5, 6, 7]
    assert [layer.self_attention.core_attention.layer_number for layer in block.layers] == [5, 6, 7]
    assert block.final_layernorm is None
    assert not any(n.startswith("final_layernorm") for n in block.state_dict())
    with pytest.raises(ValueError, match="set_input_tensor"):
        block(None)
    x = torch.randn(4, 2, 32, dtype=torch.float64)
    block.set_input_tensor(x)
    # The received tensor goes through the same layers as an input would on a first stage.
    first_stage = TransformerBlock(
        cfg(num_layers=8), num_layers=3, layer_number_offset=4, post_process=False
    )
    first_stage.load_state_dict(block.state_dict())
    out = block(None)
    torch.testing.assert_close(out, first_stage(x), rtol=0, atol=0)
    assert not torch.allclose(out, x)
    # A last stage ends with the final norm.
    last_stage = TransformerBlock(
        cfg(num_layers=8), num_layers=3, layer_number_offset=4, pre_process=False
    )
    assert last_stage.final_layernorm is not None
    last_stage.load_state_dict(block.state_dict(), strict=False)
    last_stage.set_input_tensor(x)
    torch.testing.assert_close(last_stage(None), last_stage.final_layernorm(out), rtol=0, atol=0)


def test_embedding_output_is_sequence_first():
    emb = LanguageModelEmbedding(cfg(), vocab_size=50, max_sequence_length=16)
    ids = torch.randint(0, 50, (3, 7))
    pos = torch.arange(7).expand(3, 7)
    out = emb(ids, pos)
    assert out.shape == (7, 3, 32)
    expected = emb.word_embeddings.weight[ids] + emb.position_embeddings.weight[pos]
    torch.testing.assert_close(out, expected.transpose(0, 1))
    with pytest.raises(ValueError, match="max-position-embeddings"):
        emb(torch.zeros(1, 20, dtype=torch.long), torch.arange(20).unsqueeze(0))
