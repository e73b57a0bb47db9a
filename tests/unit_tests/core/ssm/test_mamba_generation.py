"""Generation with a hybrid model (Mamba, attention, MLP layers): the conv and SSM states kept
per Mamba layer, used together with the attention layers' KV cache, give the tokens and
log-probs of full recompute (greedy, prompts of different lengths), and the states the prompt
leaves equal the recurrence's."""

import torch

from megatron.core.inference import InferenceModelForward, SamplingParams, SpecialTokens, generate
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.models.mamba import MambaModel
from megatron.core.transformer.transformer_config import TransformerConfig

VOCAB, MAX_LEN = 50, 32
PROMPTS = [[3, 17, 5, 9, 21, 2], [8, 1], [30, 4, 4, 12]]


def tiny_hybrid():
    config = TransformerConfig(
        num_layers=4,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        mamba_state_dim=8,
        mamba_head_dim=8,
        mamba_num_groups=2,
        normalization="RMSNorm",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.3,  # logits far from uniform: no argmax ties
        init_seed=5,
    )
    model = MambaModel(
        config,
        vocab_size=VOCAB + 14,
        max_sequence_length=MAX_LEN,
        hybrid_override_pattern="M*-M",
        position_embedding_type="rope",
    )
    return model.eval()


def test_state_cache_generation_equals_full_recompute():
    model = tiny_hybrid()
    step = InferenceModelForward(model, VOCAB, model.config.hidden_size, torch.float32)
    params = SamplingParams(num_tokens_to_generate=8, top_k=1, return_log_probs=True)
    cached = generate(step, PROMPTS, params, SpecialTokens(), MAX_LEN)
    uncached = generate(step, PROMPTS, params, SpecialTokens(), MAX_LEN, use_kv_cache=False)
    assert torch.equal(cached.tokens, uncached.tokens)
    torch.testing.assert_close(cached.log_probs, uncached.log_probs, rtol=0, atol=1e-5)
    assert len(set(cached.tokens[0, 6:].tolist())) > 1  # not one token repeated


def test_prompt_then_steps_equal_one_pass():
    """Logits of a prompt run at once equal those of its first half then one token at a time
    (Mamba states and KV cache both carried)."""
    model = tiny_hybrid()
    tokens = torch.tensor([PROMPTS[0] + [7, 11]])
    positions = torch.arange(tokens.shape[1])[None]
    with torch.no_grad():
        full = model(tokens, positions, None)
        context = StaticInferenceContext(1, MAX_LEN)
        pieces = [model(tokens[:, :3], positions[:, :3], None, inference_context=context)]
        context.advance(3)
        for t in range(3, tokens.shape[1]):
            ids, pos = tokens[:, t : t + 1], positions[:, t : t + 1]
            pieces.append(model(ids, pos, None, inference_context=context))
            context.advance(1)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=0, atol=1e-5)
    assert set(context.ssm_states) == {1, 4}  # the two Mamba layers
    context.reset()
    assert not context.ssm_states
