"""The request fields of the text generation server (megatron/inference/api_request.py): the
defaults a request gets and the refusals the HTTP test does not reach."""

import pytest

from megatron.core.inference import StaticInferenceContext
from megatron.inference.api_request import RequestDefaults, RequestError, parse_request

DEFAULTS = RequestDefaults(temperature=0.7, top_k=1, top_p=0.0)


def parse(**body):
    return parse_request(body, DEFAULTS, vocab_size=500)


def test_defaults_come_from_the_server_flags_and_megatron():
    request = parse(prompts=["a", "b"])
    p = request.params
    assert (p.temperature, p.top_k, p.top_p, p.num_tokens_to_generate) == (0.7, 1, 0.0, 64)
    assert not p.return_log_probs and p.random_seed is None and p.stop_token is None
    assert request.prompts == ["a", "b"] and not request.add_bos and not request.no_log
    # Asking for top_p drops the server's default top_k (they cannot both be set).
    p = parse(prompts=["a"], top_p=0.5, top_p_decay=0.9, top_p_bound=0.1).params
    assert (p.top_k, p.top_p, p.top_p_decay, p.top_p_bound) == (0, 0.5, 0.9, 0.1)
    request = parse(prompts=[""], add_BOS=True, no_log=True, random_seed=5, stop_token=7)
    assert request.add_bos and request.no_log
    assert (request.params.random_seed, request.params.stop_token) == (5, 7)


@pytest.mark.parametrize(
    "body, message",
    [
        (dict(sentences=["a"]), "sentences is no longer used"),
        (dict(prompts=["a"], beam_width=2), "beam_width: beam search is not supported"),
        (dict(prompts=["a", 3]), "prompts is not a list of strings"),
        (dict(prompts=["a"], top_p_decay=0.5), "top_p_decay cannot be set without top_p"),
        (dict(prompts=["a"], top_p=0.3, top_p_decay=0.5, top_p_bound=0.4), "top_p_bound"),
        (dict(prompts=["a"], top_p=0.3, top_p_bound=0.1), "with top_p_decay set"),
        (dict(prompts=["a"], top_k=501), "less than or equal to 500"),
        (dict(prompts=["a"], top_k=True), "top_k must be an integer"),
        (dict(prompts=["a"], temperature=float("nan")), "temperature must be a positive"),
        (dict(prompts=["a"], temperature=101), "temperature must be a positive"),
        (dict(prompts=["a"], add_BOS=1), "add_BOS must be a boolean value"),
        (dict(prompts=["a"], stop_on_eol="true"), "stop_on_eol must be a boolean value"),
        (dict(prompts=["a"], random_seed=2**63), "random_seed must be below 2\\*\\*63"),
        (dict(prompts=["a"] * 129), "Maximum number of prompts is 128"),
    ],
)
def test_refusals_name_the_field(body, message):
    with pytest.raises(RequestError, match=message):
        parse(**body)


def test_cross_attention_slot_computes_once():
    context = StaticInferenceContext(max_batch_size=1, max_sequence_length=4)
    calls = []

    def compute():
        calls.append(1)
        return ("k", "v")

    assert context.cross_key_value(3, compute) == ("k", "v")
    assert context.cross_key_value(3, compute) == ("k", "v")
    assert len(calls) == 1
    context.reset()
    context.cross_key_value(3, compute)
    assert len(calls) == 2
