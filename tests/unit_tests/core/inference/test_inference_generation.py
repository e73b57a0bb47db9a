"""Text generation in megatron.core.inference on one process: the KV cache against full
recompute, batching of prompts of different lengths, sampling filters, seeds and stop rules.

The references are written here independently of ``generate``: a plain loop that runs the whole
prefix through the model at every step (no cache) and takes the argmax, and filters computed by
hand for tiny distributions.
"""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.inference import (
    InferenceModelForward,
    SamplingParams,
    SpecialTokens,
    StaticInferenceContext,
    generate,
)
from megatron.core.inference.sampling import filter_top_k, filter_top_p, sample
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig

VOCAB = 50
MAX_LEN = 32


def tiny_model(kind: str) -> GPTModel:
    common = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.3,  # large weights: logits far from uniform, argmax ties impossible
    )
    if kind == "gpt":
        config = TransformerConfig(**common)
        position = "learned_absolute"
    else:  # Llama-like: RoPE, grouped-query attention, RMSNorm, SwiGLU, no biases
        config = TransformerConfig(
            **common,
            num_query_groups=2,
            normalization="RMSNorm",
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
        )
        position = "rope"
    torch.manual_seed(0)
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(),
        vocab_size=VOCAB + 14,  # padded embedding rows past the tokenizer's vocab
        max_sequence_length=MAX_LEN,
        position_embedding_type=position,
    )
    return model.eval()


def step_of(model):
    return InferenceModelForward(model, VOCAB, model.config.hidden_size, torch.float32)


def reference_greedy(model, prompt, num_tokens):
    """Argmax of the full-prefix logits at every step (no cache), with the log-probs of every
    token given its prefix from one final forward."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(num_tokens):
            ids = torch.tensor([tokens])
            logits = model(ids, torch.arange(len(tokens))[None], None)[0, -1, :VOCAB]
            tokens.append(int(logits.argmax()))
        ids = torch.tensor([tokens])
        logits = model(ids, torch.arange(len(tokens))[None], None)[0, :-1, :VOCAB]
        log_probs = logits.double().log_softmax(-1).gather(1, ids[0, 1:, None]).squeeze(1)
    return tokens, log_probs


PROMPTS = [[3, 14, 15, 9, 2, 6], [5, 35], [8, 9, 7, 9]]


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_kv_cache_greedy_equals_full_recompute(kind):
    model = tiny_model(kind)
    params = SamplingParams(num_tokens_to_generate=7, top_k=1, return_log_probs=True)
    cached = generate(step_of(model), PROMPTS, params, SpecialTokens(), MAX_LEN)
    uncached = generate(
        step_of(model), PROMPTS, params, SpecialTokens(), MAX_LEN, use_kv_cache=False
    )
    assert torch.equal(cached.tokens, uncached.tokens)
    torch.testing.assert_close(cached.log_probs, uncached.log_probs, rtol=0, atol=1e-5)
    total = max(map(len, PROMPTS)) + 7  # Megatron: every row up to the longest prompt + n
    assert cached.lengths == [total] * 3
    for i, prompt in enumerate(PROMPTS):
        want, want_log_probs = reference_greedy(model, prompt, total - len(prompt))
        assert cached.tokens[i].tolist() == want
        torch.testing.assert_close(cached.log_probs[i].double(), want_log_probs, rtol=0, atol=1e-5)
    # Not vacuous: the model does not just repeat one token.
    assert len(set(cached.tokens[0, 6:].tolist())) > 1


def test_kv_cache_appends_and_masks():
    ctx = StaticInferenceContext(max_batch_size=2, max_sequence_length=5)
    k = torch.randn(3, 2, 1, 4)
    keys, values = ctx.append_key_value(1, k, -k)
    assert ctx.attention_mask(3, "cpu") is None  # first step: plain causal
    ctx.advance(3)
    k2 = torch.randn(2, 2, 1, 4)
    mask = ctx.attention_mask(2, "cpu")
    keys, values = ctx.append_key_value(1, k2, -k2)
    assert torch.equal(keys, torch.cat([k, k2])) and torch.equal(values, -keys)
    # Query 3 sees keys 0..3, query 4 sees 0..4.
    assert mask[0, 0].tolist() == [[False] * 4 + [True], [False] * 5]
    ctx.advance(2)
    with pytest.raises(ValueError, match="holds 5 tokens per sequence; this step needs 6"):
        ctx.append_key_value(1, k2[:1], k2[:1])


def test_filters_by_hand():
    logits = torch.log(torch.tensor([[0.5, 0.1, 0.25, 0.15]]))
    assert torch.isinf(filter_top_k(logits, 2)).tolist() == [[False, True, False, True]]
    # Sorted 0.5, 0.25, 0.15, 0.1: cumulative 0.5, 0.75, 0.9, 1.0. top_p 0.6 keeps 0.5 and the
    # crossing 0.25; top_p 0.8 also keeps 0.15; top_p 0.3 keeps the top token only.
    assert torch.isinf(filter_top_p(logits, 0.6)).tolist() == [[False, True, False, True]]
    assert torch.isinf(filter_top_p(logits, 0.8)).tolist() == [[False, True, False, False]]
    assert torch.isinf(filter_top_p(logits, 0.3)).tolist() == [[False, True, True, True]]


def test_sampling_frequencies_follow_temperature():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]])).expand(20000, 3)
    g = torch.Generator().manual_seed(0)
    draws = sample(logits, temperature=1.0, generator=g)
    freq = torch.bincount(draws, minlength=3).double() / draws.numel()
    torch.testing.assert_close(
        freq, torch.tensor([0.7, 0.2, 0.1], dtype=torch.double), atol=0.015, rtol=0
    )
    # temperature 0.5 squares the probabilities before renormalizing.
    hot = torch.tensor([0.49, 0.04, 0.01], dtype=torch.double)
    draws = sample(logits, temperature=0.5, generator=g)
    freq = torch.bincount(draws, minlength=3).double() / draws.numel()
    torch.testing.assert_close(freq, hot / hot.sum(), atol=0.015, rtol=0)
    draws = sample(logits, top_k=2, generator=g)
    assert set(draws.tolist()) == {0, 1}


def test_seeded_sampling_is_reproducible_and_batch_rows_independent():
    model = tiny_model("llama")
    params = SamplingParams(num_tokens_to_generate=8, top_k=0, temperature=1.5, random_seed=7)
    a = generate(step_of(model), PROMPTS, params, SpecialTokens(), MAX_LEN)
    b = generate(step_of(model), PROMPTS, params, SpecialTokens(), MAX_LEN)
    assert torch.equal(a.tokens, b.tokens)
    params.random_seed = 8
    c = generate(step_of(model), PROMPTS, params, SpecialTokens(), MAX_LEN)
    assert not torch.equal(a.tokens, c.tokens)
    # Prompt tokens are kept where a row's prompt is longer than the shortest one.
    for i, prompt in enumerate(PROMPTS):
        assert a.tokens[i, : len(prompt)].tolist() == prompt


def test_stop_token_ends_a_sequence_and_pads_after_it():
    model = tiny_model("gpt")
    greedy = SamplingParams(num_tokens_to_generate=6, top_k=1)
    free = generate(step_of(model), [PROMPTS[0]], greedy, SpecialTokens(), MAX_LEN)
    stop = int(free.tokens[0, 8])  # the third generated token
    first = free.tokens[0, 6:].tolist().index(stop) + 6
    greedy.stop_token = stop
    stopped = generate(step_of(model), [PROMPTS[0]], greedy, SpecialTokens(eod=0), MAX_LEN)
    assert stopped.lengths == [first + 1]
    assert stopped.tokens[0, : first + 1].tolist() == free.tokens[0, : first + 1].tolist()
    assert (stopped.tokens[0, first + 1 :] == 0).all()
    # stop_on_eol stops on the newline token instead.
    eol = SamplingParams(num_tokens_to_generate=6, top_k=1, stop_on_eol=True)
    stopped = generate(step_of(model), [PROMPTS[0]], eol, SpecialTokens(newline=stop), MAX_LEN)
    assert stopped.lengths == [first + 1]
    # prevent_newline_after_colon: with the "colon" being the last prompt token, the newline
    # (the greedy first token) is never chosen there.
    colon = SamplingParams(num_tokens_to_generate=1, top_k=1, prevent_newline_after_colon=True)
    newline = int(free.tokens[0, 6])
    out = generate(
        step_of(model), [PROMPTS[0]], colon, SpecialTokens(newline=newline, colon=6), MAX_LEN
    )
    assert int(out.tokens[0, 6]) != newline


def test_bad_requests_are_refused():
    model = tiny_model("gpt")
    step = step_of(model)
    with pytest.raises(ValueError, match="more than the model's 32 positions"):
        generate(step, [[1] * 30], SamplingParams(num_tokens_to_generate=3), SpecialTokens(), 32)
    with pytest.raises(ValueError, match="top_k and top_p cannot both be set"):
        generate(step, [[1]], SamplingParams(top_k=2, top_p=0.5), SpecialTokens(), 32)
    with pytest.raises(ValueError, match="no empty prompt"):
        generate(step, [[1], []], SamplingParams(), SpecialTokens(), 32)


def test_scoring_only_with_zero_tokens_to_generate():
    model = tiny_model("gpt")
    params = SamplingParams(num_tokens_to_generate=0, return_log_probs=True)
    out = generate(step_of(model), [PROMPTS[0]], params, SpecialTokens(), MAX_LEN)
    _, want = reference_greedy(model, PROMPTS[0], 0)
    torch.testing.assert_close(out.log_probs[0].double(), want, rtol=0, atol=1e-5)


class ScriptedStep:
    """A stand-in model whose greedy next token after position p is ``script[p + 1]``."""

    vocab_size = VOCAB
    pp_group = None
    pp_size = 1

    def __init__(self, script):
        self.script = script

    def __call__(self, tokens, position_ids, context):
        logits = torch.zeros(tokens.shape + (VOCAB,))
        nxt = torch.tensor(self.script)[(position_ids + 1).clamp(max=len(self.script) - 1)]
        return logits.scatter(2, nxt.unsqueeze(2), 10.0)


NL, NLNL, EOD = 11, 12, 13


@pytest.mark.parametrize(
    "script, options, length",
    [
        ([1, 2, 5, NL, 6, NL, NL, 7], dict(stop_on_double_eol=True), 7),  # two newlines in a row
        ([1, 2, 5, NLNL, 6, 7, 8, 9], dict(stop_on_double_eol=True), 4),
        ([1, 2, 5, NL, 6, 7, 8, 9], dict(stop_on_eol=True), 4),
        ([1, 2, 5, NL, EOD, 7, 8, 9], {}, 5),  # the default stop token is end of document
        ([1, 2, 5, NL, EOD, 7, 8, 9], dict(stop_token=7), 6),
        ([1, 2, 5, NL, EOD, 7, 8, 9], dict(stop_on_eol=True, stop_token=5), 4),
    ],
)
def test_stop_rules_on_a_scripted_model(script, options, length):
    special = SpecialTokens(eod=EOD, newline=NL, double_newline=NLNL)
    params = SamplingParams(num_tokens_to_generate=6, top_k=1, **options)
    out = generate(ScriptedStep(script), [script[:2]], params, special, MAX_LEN)
    assert out.lengths == [length]
    assert out.tokens[0, :length].tolist() == script[:length]


def test_top_p_decays_to_its_bound(monkeypatch):
    import megatron.core.inference.generation as generation

    seen = []

    def recording_sample(logits, top_k, top_p, temperature, generator):
        seen.append(top_p)
        return sample(logits, top_k, top_p, temperature, generator)

    monkeypatch.setattr(generation, "sample", recording_sample)
    params = SamplingParams(
        num_tokens_to_generate=4, top_p=0.9, top_p_decay=0.5, top_p_bound=0.2, random_seed=1
    )
    generate(ScriptedStep(list(range(10))), [[0, 1]], params, SpecialTokens(), MAX_LEN)
    assert seen == pytest.approx([0.9, 0.45, 0.225, 0.2])
