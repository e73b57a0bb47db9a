"""Batched autoregressive generation with a KV cache (the loop of Megatron's static text
generation).

The prompts are right-padded into one [b, max_prompt + tokens_to_generate] tensor. The first
step runs every position up to the shortest prompt (prefill); each later step feeds one token
per sequence and reads its keys and values from the cache. A sequence whose prompt is longer
than the current position keeps its own prompt token there (the sampled one is discarded), so
padding is never attended to and positions are plain 0, 1, 2, ... (no padding masks). As in
Megatron, every sequence is generated up to the common length ``max_prompt +
tokens_to_generate`` unless it stops earlier.

Stopping: a sequence is done when it produces ``stop_token`` (or, with ``stop_on_eol``, a
newline / double newline; with ``stop_on_double_eol``, a double newline or two newlines in a
row, Megatron's rules); its length then includes that token. Generation ends when every
sequence is done or the length is reached.

Log-probs: ``log_probs[i, t]`` is the model's log-probability (the raw logits' log-softmax,
before temperature and filtering) of token ``t + 1`` of sequence ``i`` given the tokens before
it, for prompt and generated tokens alike.

Parallelism: every rank calls :func:`generate` with the same prompts and options. Only the last
pipeline stage samples; it broadcasts the new tokens and the stop flags over the pipeline group
each step, and the log-probs at the end, so every rank returns the same result. Tensor-parallel
ranks hold the same gathered logits and draw with equally seeded generators.
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.inference.model_forward import InferenceModelForward
from megatron.core.inference.sampling import check_sampling_options, sample


@dataclass
class SamplingParams:
    """How to generate (the request fields of Megatron's text generation server)."""

    num_tokens_to_generate: int = 30
    """Tokens to generate after the longest prompt."""
    temperature: float = 1.0
    """Divides the logits before sampling (> 0)."""
    top_k: int = 0
    """1: greedy; > 1: sample among the k most likely tokens; 0: no top-k filter."""
    top_p: float = 0.0
    """> 0: sample among the most likely tokens whose probability reaches top_p."""
    top_p_decay: float = 0.0
    """> 0: top_p is multiplied by this after every step (Megatron's top_p_decay)."""
    top_p_bound: float = 0.0
    """> 0: the decayed top_p never falls below this."""
    return_log_probs: bool = False
    """Also return the per-token log-probs of the prompt and generated tokens."""
    stop_token: Optional[int] = None
    """A sequence stops after producing this token (None: the tokenizer's end of document)."""
    stop_on_eol: bool = False
    """Stop a sequence at a newline or double-newline token (instead of ``stop_token``)."""
    stop_on_double_eol: bool = False
    """Stop a sequence at a double-newline token or two newline tokens in a row."""
    prevent_newline_after_colon: bool = False
    """Never sample a newline right after a token that is a colon."""
    random_seed: Optional[int] = None
    """Seed of the sampling generator (None: a seed drawn from torch's global generator)."""


@dataclass
class SpecialTokens:
    """Token ids the stopping rules need (from the tokenizer); None where the tokenizer has no
    single token for them."""

    eod: Optional[int] = None
    """End of document: the default stop token."""
    newline: Optional[int] = None
    """The token of "\\n"."""
    double_newline: Optional[int] = None
    """The token of "\\n\\n"."""
    colon: Optional[int] = None
    """The token of ":"."""


@dataclass
class GenerationResult:
    """What :func:`generate` returns (on every rank)."""

    tokens: torch.Tensor
    """[b, L] prompt + generated tokens (positions at or past ``lengths`` are padding)."""
    lengths: List[int]
    """Number of valid tokens of each sequence."""
    log_probs: Optional[torch.Tensor]
    """[b, L - 1] fp32 log-prob of token t + 1 given tokens <= t (only with return_log_probs)."""


def _broadcast_from_last_stage(tensor: torch.Tensor, step: InferenceModelForward) -> None:
    if step.pp_group is not None and step.pp_size > 1:
        dist.broadcast(tensor, src=step.last_stage_rank, group=step.pp_group)


@torch.no_grad()
def generate(
    step: InferenceModelForward,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    special: SpecialTokens,
    max_sequence_length: int,
    pad_id: int = 0,
    device=None,
    use_kv_cache: bool = True,
) -> GenerationResult:
    """Generate continuations of the token-id ``prompts`` (see the module doc).

    ``max_sequence_length`` bounds prompt + generated tokens (the model's position count);
    ``use_kv_cache=False`` recomputes the whole prefix at every step (the reference the cache is
    tested against).
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generation needs at least one prompt and no empty prompt")
    check_sampling_options(params.top_k, params.top_p, params.temperature, step.vocab_size)
    if params.num_tokens_to_generate < 0:
        raise ValueError(
            f"num_tokens_to_generate must be >= 0, got {params.num_tokens_to_generate}"
        )
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=device)
    total = int(lengths.max()) + params.num_tokens_to_generate
    if total > max_sequence_length:
        raise ValueError(
            f"the longest prompt ({int(lengths.max())} tokens) plus tokens_to_generate "
            f"({params.num_tokens_to_generate}) is {total}, more than the model's "
            f"{max_sequence_length} positions"
        )
    batch = len(prompts)
    tokens = torch.full((batch, total), pad_id, dtype=torch.long, device=device)
    for i, prompt in enumerate(prompts):
        tokens[i, : len(prompt)] = torch.tensor(list(prompt), dtype=torch.long, device=device)

    stop_token = special.eod if params.stop_token is None else params.stop_token
    seed = params.random_seed
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,), device="cpu").item())  # host: a seed, no data
    generator = torch.Generator(device=tokens.device)
    generator.manual_seed(seed)

    context = StaticInferenceContext(batch, total) if use_kv_cache else None
    log_probs = (
        torch.zeros(batch, max(total - 1, 0), dtype=torch.float32, device=device)
        if params.return_log_probs
        else None
    )
    out_lengths = torch.full((batch,), total, dtype=torch.long, device=device)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    top_p = params.top_p
    start = 0
    min_length = int(lengths.min())
    if min_length == total and log_probs is not None:  # nothing to generate: score the prompts
        logits = step(tokens, torch.arange(total, device=tokens.device).expand(batch, -1), context)
        _record_log_probs(log_probs, logits, tokens, 0, total - 1)
    for position in range(min_length, total):
        # The model sees tokens [start, position) (all of them without a cache) and predicts
        # the token at `position`.
        if context is None:
            start = 0
        ids = tokens[:, start:position]
        positions = torch.arange(start, position, device=tokens.device).expand(batch, -1)
        logits = step(ids, positions, context)
        if context is not None:
            context.advance(position - start)
        new_tokens = torch.zeros(batch, dtype=torch.long, device=tokens.device)
        if logits is not None:
            last = logits[:, -1, :]
            if (
                params.prevent_newline_after_colon
                and special.newline is not None
                and special.colon is not None
            ):
                after_colon = tokens[:, position - 1] == special.colon
                last = last.clone()
                last[after_colon, special.newline] = float("-inf")
            new_tokens = sample(last, params.top_k, top_p, params.temperature, generator)
        _broadcast_from_last_stage(new_tokens, step)
        started = lengths <= position
        tokens[:, position] = torch.where(started & ~done, new_tokens, tokens[:, position])
        if logits is not None and log_probs is not None:
            _record_log_probs(log_probs, logits, tokens, start, position)
        hit = _stop_hits(new_tokens, tokens[:, position - 1], params, special, stop_token)
        finished = hit & started & ~done
        out_lengths[finished] = position + 1
        done |= finished
        if params.top_p_decay > 0.0 and top_p > 0.0:
            top_p = top_p * params.top_p_decay
            if params.top_p_bound > 0.0:
                top_p = max(top_p, params.top_p_bound)
        start = position
        if bool(done.all()):
            break
    if log_probs is not None:
        _broadcast_from_last_stage(log_probs, step)
    # Positions of a finished sequence past its stop token hold padding.
    past_end = torch.arange(total, device=tokens.device)[None, :] >= out_lengths[:, None]
    tokens = tokens.masked_fill(past_end, pad_id)
    return GenerationResult(tokens=tokens, lengths=out_lengths.tolist(), log_probs=log_probs)


def _record_log_probs(log_probs, logits, tokens, start: int, position: int) -> None:
    """log_probs[:, start:position] from the logits of tokens [start, position) and the tokens
    that follow them, tokens [start + 1, position + 1)."""
    if logits is None:
        return
    targets = tokens[:, start + 1 : position + 1]
    scores = torch.log_softmax(logits[:, : targets.shape[1]].float(), dim=-1)
    log_probs[:, start:position] = scores.gather(2, targets.unsqueeze(2)).squeeze(2)


def _stop_hits(new, previous, params: SamplingParams, special: SpecialTokens, stop_token):
    """Which sequences the new tokens stop (Megatron's rules; see the module doc)."""

    def equals(ids, token):
        if token is None:
            return torch.zeros_like(ids, dtype=torch.bool)
        return ids == token

    if params.stop_on_double_eol:
        return equals(new, special.double_newline) | (
            equals(new, special.newline) & equals(previous, special.newline)
        )
    if params.stop_on_eol:
        return equals(new, special.double_newline) | equals(new, special.newline)
    return equals(new, stop_token)
