"""Choosing the next token from the last position's logits, as Megatron's text generation does.

* ``top_k == 1``: greedy (argmax);
* otherwise the logits are divided by ``temperature``, then filtered to the ``top_k`` largest
  (``top_k > 1``) or to the smallest set of tokens whose probabilities reach ``top_p``
  (``top_p > 0``; the token that crosses the threshold is kept), and a token is drawn from the
  softmax; ``top_k == 0`` and ``top_p == 0`` draw from the whole distribution.

The draw uses the given ``torch.Generator``, so a seed reproduces it and every rank that holds
the same logits draws the same token.
"""

from typing import Optional

import torch


def check_sampling_options(top_k: int, top_p: float, temperature: float, vocab_size: int):
    """Raise ValueError naming the option when the combination cannot be sampled."""
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    if top_k > vocab_size:
        raise ValueError(f"top_k ({top_k}) is larger than the vocabulary ({vocab_size})")
    if not 0.0 <= top_p <= 1.0:
        raise ValueError(f"top_p must be within [0, 1], got {top_p}")
    if top_k > 0 and top_p > 0.0:
        raise ValueError("top_k and top_p cannot both be set")
    if not temperature > 0.0:
        raise ValueError(f"temperature must be positive, got {temperature}")


def filter_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Logits [b, V] with every entry below the k-th largest of its row set to -inf."""
    kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def filter_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Logits [b, V] keeping, per row, the most likely tokens until their probability reaches
    ``top_p`` (including the token that crosses it)."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative > top_p
    # Shift right: the first token past the threshold stays, and the top token always does.
    drop[:, 1:] = drop[:, :-1].clone()
    drop[:, 0] = False
    drop = drop.scatter(1, order, drop)
    return logits.masked_fill(drop, float("-inf"))


def sample(
    logits: torch.Tensor,
    top_k: int = 0,
    top_p: float = 0.0,
    temperature: float = 1.0,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Next tokens [b] (int64) from the last position's logits [b, V] (see the module doc)."""
    if top_k == 1:
        return logits.argmax(dim=-1)
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    if top_k > 1:
        logits = filter_top_k(logits, top_k)
    elif top_p > 0.0:
        logits = filter_top_p(logits, top_p)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)
