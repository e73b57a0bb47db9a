"""The fields of a ``PUT /api`` request of Megatron's text generation server, checked one by one.

Every problem raises :class:`RequestError` with one message naming the field (the server answers
it with HTTP 400). Megatron's own messages are kept where it has them. Unknown fields are
refused rather than ignored.
"""

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from megatron.core.inference.generation import SamplingParams

MAX_PROMPTS = 128  # Megatron's limit per request

_FIELDS = {
    "prompts",
    "tokens_to_generate",
    "logprobs",
    "temperature",
    "top_k",
    "top_p",
    "top_p_decay",
    "top_p_bound",
    "add_BOS",
    "stop_on_double_eol",
    "stop_on_eol",
    "prevent_newline_after_colon",
    "random_seed",
    "stop_token",
    "length_penalty",
    "no_log",
}


class RequestError(ValueError):
    """A request the server answers with 400 and this message."""


@dataclass
class RequestDefaults:
    """What a request gets for the sampling fields it leaves out (the server's flags)."""

    temperature: float = 1.0
    """--temperature."""
    top_k: int = 0
    """--top_k."""
    top_p: float = 0.0
    """--top_p."""
    tokens_to_generate: int = 64
    """Megatron's default for ``tokens_to_generate``."""


@dataclass
class GenerateRequest:
    """A checked request."""

    prompts: List[str]
    """The prompt texts."""
    add_bos: bool
    """Prepend the end-of-document token to every prompt (``add_BOS``)."""
    params: SamplingParams
    """How to generate."""
    no_log: bool
    """Do not print the request on the server's console."""


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _bool(body: Dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be a boolean value")
    return value


def parse_request(
    body: Any, defaults: RequestDefaults, vocab_size: int, max_prompts: int = MAX_PROMPTS
) -> GenerateRequest:
    """Check a decoded JSON body; ``vocab_size`` bounds ``stop_token`` and ``top_k``."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    if "max_len" in body:
        raise RequestError("max_len is no longer used.  Replace with tokens_to_generate")
    if "sentences" in body:
        raise RequestError("sentences is no longer used.  Replace with prompts")
    if "beam_width" in body:
        raise RequestError("beam_width: beam search is not supported by this server")
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise RequestError(f"unknown field(s) {', '.join(unknown)}")
    if "prompts" not in body:
        raise RequestError("prompts argument required")
    prompts = body["prompts"]
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise RequestError("prompts is not a list of strings")
    if not prompts:
        raise RequestError("prompts is empty")
    if len(prompts) > max_prompts:
        raise RequestError(f"Maximum number of prompts is {max_prompts}")

    tokens_to_generate = body.get("tokens_to_generate", defaults.tokens_to_generate)
    if not _is_int(tokens_to_generate) or tokens_to_generate < 0:
        raise RequestError("tokens_to_generate must be an integer greater than or equal to 0")
    logprobs = _bool(body, "logprobs")
    if tokens_to_generate == 0 and not logprobs:
        raise RequestError("tokens_to_generate=0 implies logprobs should be True")

    temperature = body.get("temperature", defaults.temperature)
    if not _is_number(temperature) or not 0.0 < temperature <= 100.0:
        raise RequestError("temperature must be a positive number less than or equal to 100.0")
    top_k = body.get("top_k", defaults.top_k if "top_p" not in body else 0)
    if not _is_int(top_k) or not 0 <= top_k <= min(1000, vocab_size):
        raise RequestError(
            f"top_k must be an integer equal to or greater than 0 and less than or equal to "
            f"{min(1000, vocab_size)}"
        )
    top_p = body.get("top_p", defaults.top_p if "top_k" not in body else 0.0)
    if not _is_number(top_p) or not 0.0 <= top_p <= 1.0:
        raise RequestError("top_p must be a number within [0, 1]")
    if top_k > 0 and top_p > 0.0:
        raise RequestError("cannot set both top-k and top-p samplings.")
    top_p_decay = body.get("top_p_decay", 0.0)
    if not _is_number(top_p_decay) or not 0.0 <= top_p_decay <= 1.0:
        raise RequestError("top_p_decay must be a number within [0, 1]")
    if top_p_decay > 0.0 and top_p == 0.0:
        raise RequestError("top_p_decay cannot be set without top_p")
    top_p_bound = body.get("top_p_bound", 0.0)
    if not _is_number(top_p_bound) or top_p_bound < 0.0:
        raise RequestError("top_p_bound must be a number >= 0")
    if top_p_bound > 0.0 and not (top_p_decay > 0.0 and top_p_bound <= top_p):
        raise RequestError(
            "top_p_bound should be greater than 0 and less than top_p, with top_p_decay set"
        )

    add_bos = _bool(body, "add_BOS")
    if any(len(p) == 0 for p in prompts) and not add_bos:
        raise RequestError("Empty prompts require add_BOS=true")
    stop_on_double_eol = _bool(body, "stop_on_double_eol")
    stop_on_eol = _bool(body, "stop_on_eol")
    prevent_newline_after_colon = _bool(body, "prevent_newline_after_colon")
    no_log = _bool(body, "no_log")

    random_seed: Optional[int] = body.get("random_seed", None)
    if random_seed is not None and (not _is_int(random_seed) or random_seed < 0):
        raise RequestError("random_seed must be a non-negative integer")
    if random_seed is not None and random_seed >= 2**63:
        raise RequestError("random_seed must be below 2**63")
    stop_token = body.get("stop_token", None)
    if stop_token is not None and (not _is_int(stop_token) or not 0 <= stop_token < vocab_size):
        raise RequestError(f"stop_token must be a token id in [0, {vocab_size})")
    length_penalty = body.get("length_penalty", 1)
    if not _is_number(length_penalty):
        raise RequestError("length_penalty must be a number")
    if length_penalty != 1:
        raise RequestError(
            "length_penalty applies to beam search only (Megatron's beam_width), which this "
            "server does not support; leave it at 1"
        )
    params = SamplingParams(
        num_tokens_to_generate=tokens_to_generate,
        temperature=float(temperature),
        top_k=top_k,
        top_p=float(top_p),
        top_p_decay=float(top_p_decay),
        top_p_bound=float(top_p_bound),
        return_log_probs=logprobs,
        stop_token=stop_token,
        stop_on_eol=stop_on_eol,
        stop_on_double_eol=stop_on_double_eol,
        prevent_newline_after_colon=prevent_newline_after_colon,
        random_seed=random_seed,
    )
    return GenerateRequest(prompts=prompts, add_bos=add_bos, params=params, no_log=no_log)
