"""Hybrid Mamba models and transformers' ``NemotronHForCausalLM``: the same weights (converted
by tools/checkpoint/hf_nemotron_h.py) give logits within 1e-4 (float32; Mamba, attention with
grouped queries, a squared-ReLU MLP and an MoE layer with NemotronH's sigmoid router (expert bias,
two expert groups, a scaling factor, a shared expert), a sequence longer than transformers' scan
chunk), and the conversion both ways returns every tensor bit for bit."""

import os
import sys

import torch
from transformers import NemotronHConfig, NemotronHForCausalLM

from megatron.core.models.mamba import MambaModel
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import squared_relu

_REPO = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
)
sys.path.insert(0, os.path.join(_REPO, "tools", "checkpoint"))

from hf_nemotron_h import Shape, hf_from_megatron, megatron_from_hf  # noqa: E402

PATTERN, VOCAB = "M*EM-E", 64  # each half (a PP2 stage) has M and E
EXPERTS = 4
HEADS, GROUPS, HEAD_DIM = 4, 2, 8


def hf_model():
    torch.manual_seed(0)
    config = NemotronHConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        hybrid_override_pattern=PATTERN,
        num_attention_heads=HEADS,
        num_key_value_heads=GROUPS,
        head_dim=HEAD_DIM,
        intermediate_size=64,
        ssm_state_size=8,
        mamba_num_heads=8,
        mamba_head_dim=8,
        n_groups=2,
        chunk_size=4,
        tie_word_embeddings=False,
        layer_norm_epsilon=1e-5,
        n_routed_experts=EXPERTS,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        moe_shared_expert_intermediate_size=40,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
    )
    model = NemotronHForCausalLM(config).eval()
    with torch.no_grad():  # move the norms and D away from their ones so they are tested
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "norm_f.weight", ".D")):
                param.add_(0.3 * torch.randn_like(param))
        for i, symbol in enumerate(PATTERN):  # routers that pick by more than their init
            if symbol == "E":
                gate = model.model.layers[i].mixer.gate
                gate.weight.normal_(0, 0.5)
                gate.e_score_correction_bias.normal_(0, 0.2)
    return model


def our_model():
    config = TransformerConfig(
        num_layers=len(PATTERN),
        hidden_size=32,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        kv_channels=HEAD_DIM,
        ffn_hidden_size=64,
        mamba_state_dim=8,
        mamba_head_dim=8,
        mamba_num_groups=2,
        mamba_num_heads=8,
        normalization="RMSNorm",
        layernorm_epsilon=1e-5,
        activation_func=squared_relu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        num_moe_experts=EXPERTS,
        moe_router_topk=2,
        moe_ffn_hidden_size=24,
        moe_shared_expert_intermediate_size=40,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_num_groups=2,
        moe_router_group_topk=1,
        moe_router_topk_scaling_factor=2.5,
    )
    return MambaModel(
        config, vocab_size=VOCAB, max_sequence_length=64, hybrid_override_pattern=PATTERN
    ).eval()


SHAPE = Shape(PATTERN, HEADS, GROUPS, HEAD_DIM, EXPERTS)


def test_logits_match_transformers_nemotron_h():
    hf = hf_model()
    ours = our_model()
    ours.load_state_dict(megatron_from_hf(hf.state_dict(), SHAPE), strict=True)
    tokens = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = hf(tokens).logits
        got = ours(tokens, None, None)
    difference = (got - want).abs().max().item()
    assert difference < 1e-4, difference
    assert want.std() > 0.1  # not a vacuous comparison


def test_conversion_round_trips_bit_for_bit():
    hf_state = hf_model().state_dict()
    back = hf_from_megatron(megatron_from_hf(hf_state, SHAPE), SHAPE)
    assert sorted(back) == sorted(hf_state)
    for name, tensor in hf_state.items():
        assert torch.equal(back[name], tensor), name
    ours = our_model().state_dict()
    again = megatron_from_hf(hf_from_megatron(ours, SHAPE), SHAPE)
    assert sorted(again) == sorted(ours)
    for name, tensor in ours.items():
        assert torch.equal(again[name], tensor), name
