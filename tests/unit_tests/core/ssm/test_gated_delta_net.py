"""Gated delta net attention (``--experimental-attention-variant gated_delta_net``) in a GPT
model, against transformers' ``Qwen3NextForCausalLM``.

* Logits within 1e-4 of ``Qwen3NextForCausalLM`` on the same weights (float32; three layers:
  gated delta net, gated softmax attention with QK norms and partial RoPE, gated delta net;
  dense SwiGLU MLPs (``num_experts=0`` gives Qwen3-Next dense MLPs in every layer), or its
  mixture of experts with a gated shared expert in every layer; our scan in chunks of 4 over 11
  tokens, transformers' in one chunk of 64). The weights are converted by
  tools/checkpoint/hf_qwen3_next.py, whose round trip returns every tensor bit for bit.
* Generation with the conv and recurrent states (and the attention layer's KV cache) equals full
  recompute, token for token; a prompt then single tokens equals one pass.
* Megatron's rules for the layer pattern and the head counts, and the layer-spec selection.
"""

import os
import sys

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

from megatron.core.inference import InferenceModelForward, SamplingParams, SpecialTokens, generate
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
    get_linear_attention_pattern,
    get_transformer_block_with_experimental_attention_variant_spec,
)
from megatron.core.ssm.gated_delta_net import GatedDeltaNet
from megatron.core.transformer.transformer_config import TransformerConfig

_REPO = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
)
sys.path.insert(0, os.path.join(_REPO, "tools", "checkpoint"))

from hf_qwen3_next import Shape, hf_from_megatron, megatron_from_hf  # noqa: E402

VOCAB, HIDDEN, HEADS, GROUPS, HEAD_DIM = 64, 32, 4, 2, 8
PATTERN = [1, 0, 1]  # gated delta net, softmax attention, gated delta net
LINEAR = dict(
    linear_conv_kernel_dim=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)
SHAPE = Shape(PATTERN, HEADS, GROUPS, HEAD_DIM, 2, 4, 8, 8)


HF_MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=24,
    norm_topk_prob=True,
)
OUR_MOE = dict(
    num_moe_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=16,
    moe_shared_expert_intermediate_size=24,
    moe_shared_expert_gate=True,
    moe_router_load_balancing_type="none",
)


def hf_model(moe=False):
    torch.manual_seed(0)
    mlp = HF_MOE if moe else dict(num_experts=0)  # num_experts=0: a dense MLP in every layer
    config = Qwen3NextConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=len(PATTERN),
        num_attention_heads=HEADS,
        num_key_value_heads=GROUPS,
        head_dim=HEAD_DIM,
        layer_types=["linear_attention" if p else "full_attention" for p in PATTERN],
        **mlp,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
        },
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        **LINEAR,
    )
    model = Qwen3NextForCausalLM(config).eval()
    with torch.no_grad():  # move the norms, dt_bias and A_log off their initial values
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "dt_bias", "A_log", "mlp.gate.weight")):
                param.add_(0.3 * torch.randn_like(param))
    return model


def our_config(**overrides):
    settings = dict(
        num_layers=len(PATTERN),
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        kv_channels=HEAD_DIM,
        ffn_hidden_size=64,
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        layernorm_zero_centered_gamma=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        qk_layernorm=True,
        attention_output_gate=True,
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=PATTERN,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **LINEAR,
    )
    settings.update(overrides)
    return TransformerConfig(**settings)


def our_model(chunk_size=4, **overrides):
    config = our_config(**overrides)
    model = GPTModel(
        config,
        get_transformer_block_with_experimental_attention_variant_spec(config),
        vocab_size=VOCAB,
        max_sequence_length=64,
        position_embedding_type="rope",
        rotary_percent=0.5,
        rotary_base=10000,
        share_embeddings_and_output_weights=False,
    ).eval()
    for module in model.modules():
        if isinstance(module, GatedDeltaNet):
            module.chunk_size = chunk_size
    return model


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_logits_match_transformers_qwen3_next(moe):
    hf = hf_model(moe)
    ours = our_model(**(OUR_MOE if moe else {}))
    ours.load_state_dict(megatron_from_hf(hf.state_dict(), SHAPE), strict=True)
    tokens = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = hf(tokens).logits
        got = ours(tokens, None, None)
    difference = (got - want).abs().max().item()
    assert difference < 1e-4, difference
    assert want.std() > 0.1  # not a vacuous comparison


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_conversion_round_trips_bit_for_bit(moe):
    hf_state = hf_model(moe).state_dict()
    back = hf_from_megatron(megatron_from_hf(hf_state, SHAPE), SHAPE)
    assert sorted(back) == sorted(hf_state)
    for name, tensor in hf_state.items():
        assert torch.equal(back[name], tensor), name
    ours = our_model(**(OUR_MOE if moe else {})).state_dict()
    with torch.no_grad():  # out_norm weights (multiples of 1/8) that survive (w + 1) - 1 exactly
        for name, tensor in ours.items():
            if name.endswith("out_norm.weight"):
                tensor.copy_((torch.arange(tensor.numel()) - 3) / 8)
    again = megatron_from_hf(hf_from_megatron(ours, SHAPE), SHAPE)
    assert sorted(again) == sorted(ours)
    for name, tensor in ours.items():
        assert torch.equal(again[name], tensor), name


PROMPTS = [[3, 17, 5, 9, 21, 2], [8, 1], [30, 4, 4, 12]]


def _generation_model(dtype=torch.float32):
    # init_method_std 0.3: logits far from uniform, no argmax ties.
    return our_model(chunk_size=4, init_method_std=0.3, init_seed=5, params_dtype=dtype)


def test_state_cache_generation_equals_full_recompute():
    """In float64, so that the log-probs can be compared tightly (in float32 the chunked scan
    and the recurrence differ by up to 8e-5 in log-probs of magnitude 8 on this model; the tokens
    are the same)."""
    model = _generation_model(torch.float64)
    step = InferenceModelForward(model, VOCAB - 14, HIDDEN, torch.float64)
    params = SamplingParams(num_tokens_to_generate=8, top_k=1, return_log_probs=True)
    cached = generate(step, PROMPTS, params, SpecialTokens(), 32)
    uncached = generate(step, PROMPTS, params, SpecialTokens(), 32, use_kv_cache=False)
    assert torch.equal(cached.tokens, uncached.tokens)
    torch.testing.assert_close(cached.log_probs, uncached.log_probs, rtol=0, atol=1e-10)
    assert len(set(cached.tokens[0, 6:].tolist())) > 1  # not one token repeated


def test_prompt_then_steps_equal_one_pass():
    """A prompt's first 5 tokens (two scan chunks of 4), then single tokens (the recurrence),
    give the logits of one pass; the states are kept for the two gated delta net layers."""
    model = _generation_model()
    tokens = torch.tensor([PROMPTS[0] + [7, 11, 19]])
    positions = torch.arange(tokens.shape[1])[None]
    with torch.no_grad():
        full = model(tokens, positions, None)
        context = StaticInferenceContext(1, 32)
        pieces = [model(tokens[:, :5], positions[:, :5], None, inference_context=context)]
        context.advance(5)
        for t in range(5, tokens.shape[1]):
            ids, pos = tokens[:, t : t + 1], positions[:, t : t + 1]
            pieces.append(model(ids, pos, None, inference_context=context))
            context.advance(1)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=0, atol=1e-5)
    assert set(context.ssm_states) == {1, 3}


def test_layer_pattern_and_spec_selection():
    assert get_linear_attention_pattern(our_config(num_layers=8, linear_attention_freq=4)) == [
        1, 1, 1, 0, 1, 1, 1, 0,
    ]  # fmt: skip
    model = our_model()
    kinds = [type(layer.self_attention).__name__ for layer in model.decoder.layers]
    assert kinds == ["GatedDeltaNet", "SelfAttention", "GatedDeltaNet"]


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(linear_attention_freq=None), "linear_attention_freq .* must be set"),
        (dict(linear_attention_freq=[1, 0]), "has 2 entries for 3 layers"),
        (dict(linear_attention_freq=[1, 2, 0]), "entries must be 0 or 1"),
        (dict(linear_num_value_heads=3), "must be a multiple of linear_num_key_heads"),
        (dict(experimental_attention_variant="dsa"), "experimental_attention_variant='dsa'"),
        (dict(multi_latent_attention=True), "attention_output_gate .* multi-latent attention"),
        (
            dict(experimental_attention_variant=None),
            "linear_attention_freq .* needs experimental_attention_variant",
        ),
    ],
)
def test_config_rules(overrides, match):
    with pytest.raises(ValueError, match=match):
        our_config(**overrides)
