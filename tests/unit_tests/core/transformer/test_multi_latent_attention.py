"""Multi-latent attention against transformers' ``DeepseekV3ForCausalLM`` (an independent
implementation) on the same weights, the Hugging Face <-> Megatron weight mapping's round trip,
and generation with the KV cache (keys/values or, with ``cache_mla_latents``, the latents)
against full recompute (at TP=2 in tests/functional_tests/test_mla_layouts.py's world)."""

import sys
from pathlib import Path

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer.transformer_config import MLATransformerConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "tools" / "checkpoint"))
import hf_deepseek_v3  # noqa: E402

VOCAB = 96
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 8,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 0.8,
    "mscale_all_dim": 0.6,
}


MOE = dict(
    num_hidden_layers=3,
    first_k_dense_replace=1,
    n_routed_experts=8,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    n_shared_experts=2,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
)


def _hf_model(q_lora_rank, rope_parameters, rope_interleave=True, **moe):
    torch.manual_seed(0)
    settings = dict(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=24,
        qk_nope_head_dim=8,
        qk_rope_head_dim=6,
        v_head_dim=10,
        first_k_dense_replace=2,
        n_routed_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        rope_parameters=rope_parameters,
        rope_interleave=rope_interleave,
        tie_word_embeddings=False,
        attention_dropout=0.0,
    )
    settings.update(moe)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**settings)).eval()
    with torch.no_grad():  # norms away from 1 so that a missing or misplaced norm shows
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            if name.endswith("gate.weight"):  # routers start at zero: give them preferences
                param.normal_(0.0, 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.uniform_(0.0, 0.1)
    return model


def _megatron_model(hf_config: dict, pg_collection=None, **extra):
    kwargs = hf_deepseek_v3.megatron_config_kwargs(hf_config)
    config = MLATransformerConfig(
        **kwargs,
        moe_token_dispatcher_type="alltoall",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        init_seed=1,
        activation_func=torch.nn.functional.silu,
        **extra,
    )
    return GPTModel(
        config,
        get_gpt_decoder_block_spec(config, use_transformer_engine=False),
        vocab_size=VOCAB,
        max_sequence_length=64,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
        pg_collection=pg_collection,
    ).eval()


@pytest.mark.parametrize(
    "q_lora_rank,rope,interleave,moe",
    [
        (16, YARN, True, {}),
        (None, YARN, True, {}),
        (16, {"rope_type": "default", "rope_theta": 500.0}, False, {}),
        (16, YARN, True, MOE),
    ],
    ids=["q_lora_yarn", "full_q_yarn", "q_lora_rope_not_interleaved", "moe_dense_first"],
)
def test_logits_match_transformers_and_round_trip_is_exact(q_lora_rank, rope, interleave, moe):
    """MoE: a dense first layer, then sigmoid routing with expert bias, group-limited top-k
    (4 groups, 2 chosen), scaling 2.5 and two shared experts."""
    hf = _hf_model(q_lora_rank, rope, interleave, **moe)
    hf_config = hf.config.to_dict()
    hf_state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    state = hf_deepseek_v3.hf_to_megatron(hf_state, hf_config)
    model = _megatron_model(hf_config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    tokens = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = model(tokens, None, None)
        theirs = hf(tokens).logits
    assert (ours - theirs).abs().max().item() < 1e-4
    back = hf_deepseek_v3.megatron_to_hf(state, hf_config)
    assert back.keys() == hf_state.keys()
    for key, value in hf_state.items():
        assert torch.equal(back[key], value), key


@pytest.mark.parametrize("cache_latents", [False, True], ids=["kv_cache", "latent_cache"])
def test_generation_with_the_cache_equals_full_recompute(cache_latents):
    hf = _hf_model(16, YARN)
    model = _megatron_model(hf.config.to_dict(), cache_mla_latents=cache_latents)
    prompt = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(5))
    context = StaticInferenceContext(max_batch_size=2, max_sequence_length=16)
    tokens = prompt
    with torch.no_grad():
        logits = model(prompt, None, None, inference_context=context)
        context.advance(prompt.shape[1])
        for _ in range(5):
            full = model(tokens, None, None)
            assert (full[:, -1] - logits[:, -1]).abs().max().item() < 1e-5
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, nxt], dim=1)
            logits = model(nxt, None, None, inference_context=context)
            context.advance(1)
    cached = context.key_value_memory_dict[1][0]
    # the normalized latents [s, b, kv_lora_rank], or per-head keys [s, b, heads, 8 + 6]
    assert tuple(cached.shape[2:]) == ((24,) if cache_latents else (4, 14))


def test_mla_config_refuses_bad_dims():
    with pytest.raises(ValueError, match="qk_pos_emb_head_dim"):
        MLATransformerConfig(
            num_layers=1, hidden_size=8, num_attention_heads=2, qk_pos_emb_head_dim=3
        )


@pytest.mark.parametrize("q_lora_rank", [16, None], ids=["q_lora", "full_q"])
def test_flops_formula_counts_what_the_layer_runs(q_lora_rank):
    """--log-throughput's MLA term against torch's FlopCounterMode over one layer's forward
    (the norms and RoPE, which the formula leaves out, are not matmuls and not counted there)."""
    import argparse

    from torch.utils.flop_counter import FlopCounterMode

    from megatron.training.flops import mla_attention_macs, num_floating_point_operations

    hf = _hf_model(q_lora_rank, YARN)
    model = _megatron_model(hf.config.to_dict())
    attention = model.decoder.layers[0].self_attention
    s, b = 20, 3
    hidden = torch.randn(s, b, 48)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        attention(hidden)
    args = argparse.Namespace(
        hidden_size=48,
        num_attention_heads=4,
        seq_length=s,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=24,
        qk_head_dim=8,
        qk_pos_emb_head_dim=6,
        v_head_dim=10,
        multi_latent_attention=True,
        num_layers=2,
        ffn_hidden_size=64,
        swiglu=True,
        padded_vocab_size=VOCAB,
        num_experts=None,
        kv_channels=None,
    )
    assert counter.get_total_flops() == 2 * s * b * mla_attention_macs(args)
    # One training step: 3x the forward of every layer's attention and MLP, and the logits.
    per_token = 2 * (2 * mla_attention_macs(args) + 2 * 3 * 48 * 64) + 2 * 48 * VOCAB
    assert num_floating_point_operations(args, b) == pytest.approx(3 * b * s * per_token, rel=1e-12)


@pytest.mark.parametrize("q_lora_rank", [16, None], ids=["q_lora", "full_q"])
def test_parameter_count_of_the_memory_report_is_the_models(q_lora_rank):
    import argparse

    from megatron.training.theoretical_memory import count_parameters

    hf = _hf_model(q_lora_rank, YARN)
    model = _megatron_model(hf.config.to_dict())
    args = argparse.Namespace(
        hidden_size=48,
        ffn_hidden_size=64,
        num_attention_heads=4,
        kv_channels=12,
        num_query_groups=4,
        add_bias_linear=False,
        add_qkv_bias=False,
        swiglu=True,
        normalization="RMSNorm",
        qk_layernorm=True,
        position_embedding_type="rope",
        max_position_embeddings=64,
        untie_embeddings_and_output_weights=True,
        num_layers=2,
        num_experts=None,
        multi_latent_attention=True,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=24,
        qk_head_dim=8,
        qk_pos_emb_head_dim=6,
        v_head_dim=10,
    )
    count = count_parameters(args, VOCAB)
    assert count.total == sum(p.numel() for p in model.parameters())


def _generate(model, prompt, steps):
    """Greedy generation with the KV cache: the logits of the prompt's last token and of each
    new token."""
    context = StaticInferenceContext(max_batch_size=prompt.shape[0], max_sequence_length=16)
    out = []
    with torch.no_grad():
        logits = model(prompt, None, None, inference_context=context)
        context.advance(prompt.shape[1])
        for _ in range(steps):
            out.append(logits[:, -1])
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            logits = model(nxt, None, None, inference_context=context)
            context.advance(1)
    return torch.stack(out)


def tp2_generation(rank, world_size, path):
    """Generation at TP=2 with the key/value cache and with the latent cache, saved by rank 0."""
    from megatron.core.parallel_state import initialize_model_parallel
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    state = initialize_model_parallel(tensor_model_parallel_size=2)
    hf = _hf_model(16, YARN)
    prompt = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(5))
    results = {}
    for latents in (False, True):
        model = _megatron_model(
            hf.config.to_dict(),
            cache_mla_latents=latents,
            tensor_model_parallel_size=2,
            pg_collection=state,
        )

        class Gathered(torch.nn.Module):  # the vocab-parallel logits, whole on every rank
            def forward(self, *args, **kwargs):
                return gather_from_tensor_model_parallel_region(
                    model(*args, **kwargs), state.get_tensor_model_parallel_group()
                )

        results[latents] = _generate(Gathered(), prompt, 4)
    if rank == 0:
        torch.save(results, path)


def tensor_parallel_generation_reference():
    """What ``_tp2_generation`` must give: the one-process model's generation logits (the TP=2
    model holds the same weights: initialization does not depend on the layout). Run in
    tests/functional_tests/test_mla_layouts.py's 2-process world, which the TP2 check joins."""
    hf = _hf_model(16, YARN)
    prompt = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(5))
    return _generate(_megatron_model(hf.config.to_dict()), prompt, 4)
