"""Running one request on every rank: the serving rank broadcasts a command, all ranks generate
in step, the serving rank builds Megatron's response.

Commands go over the world group as a long tensor [code, payload bytes] followed by the payload
(UTF-8 JSON of the token ids and sampling options): GENERATE runs :func:`generate` on every rank,
EXIT ends the followers' loop. Everything a request can get wrong is checked on the serving rank
before the broadcast, so no rank can fail alone (which would leave the others waiting).
"""

import dataclasses
import json
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron.core.inference.generation import SamplingParams, SpecialTokens, generate
from megatron.core.inference.model_forward import InferenceModelForward
from megatron.inference.api_request import GenerateRequest, RequestError

GENERATE, EXIT = 0, 1


def special_tokens_of(tokenizer) -> SpecialTokens:
    """The ids of end of document, "\\n", "\\n\\n" and ":" (None where not one token)."""

    def single(text):
        try:
            ids = tokenizer.tokenize(text)
        except Exception:  # a tokenizer without text (e.g. the null tokenizer)
            return None
        return ids[0] if len(ids) == 1 else None

    try:
        eod = tokenizer.eod
    except Exception:
        eod = None
    return SpecialTokens(
        eod=eod, newline=single("\n"), double_newline=single("\n\n"), colon=single(":")
    )


class TextGenerationEngine:
    """Tokenizes, checks lengths, generates on every rank and detokenizes.

    ``max_sequence_length``: prompt + generated tokens per sequence (the smaller of the model's
    positions and --inference-max-seq-length); ``max_tokens``: prompts x that length per request
    (--max-tokens-to-oom); ``max_batch_size``: prompts generated together
    (--inference-max-requests): a request with more runs in consecutive batches, each padded to
    its own longest prompt.
    """

    def __init__(
        self,
        step: InferenceModelForward,
        tokenizer,
        max_sequence_length: int,
        max_tokens: int,
        device,
        max_batch_size: int = 8,
    ):
        self.step = step
        self.tokenizer = tokenizer
        self.special = special_tokens_of(tokenizer)
        self.max_sequence_length = max_sequence_length
        self.max_tokens = max_tokens
        self.max_batch_size = max_batch_size
        self.device = device
        distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size() if distributed else 1

    # ------------------------------------------------------------------ serving rank
    def handle(self, request: GenerateRequest) -> Dict:
        """Generate for a checked request; raises RequestError for prompts that do not fit."""
        prompts = [self.tokenizer.tokenize(p) for p in request.prompts]
        if request.add_bos:
            if self.special.eod is None:
                raise RequestError("add_BOS: the tokenizer has no end-of-document token")
            prompts = [[self.special.eod] + p for p in prompts]
        if any(len(p) == 0 for p in prompts):
            raise RequestError("prompts: a prompt tokenizes to no tokens; set add_BOS=true")
        params = request.params
        if params.random_seed is None:
            # One seed for every rank, so tensor-parallel ranks draw the same tokens.
            seed = int(torch.randint(0, 2**62, (1,), device="cpu").item())  # host: a seed
            params = dataclasses.replace(params, random_seed=seed)
        length = max(map(len, prompts)) + params.num_tokens_to_generate
        if length > self.max_sequence_length:
            raise RequestError(
                f"tokens_to_generate: the longest prompt ({max(map(len, prompts))} tokens) plus "
                f"tokens_to_generate ({params.num_tokens_to_generate}) is {length} tokens, more "
                f"than the server's maximum of {self.max_sequence_length}"
            )
        if length * len(prompts) > self.max_tokens:
            raise RequestError(
                f"Too many tokens.  {length * len(prompts)} is greater than {self.max_tokens} "
                "(--max-tokens-to-oom)"
            )
        response = {"text": [], "segments": [], "tokens": [], "logprobs": None}
        if params.return_log_probs:
            response["logprobs"] = []
        for start in range(0, len(prompts), self.max_batch_size):
            batch = prompts[start : start + self.max_batch_size]
            self._broadcast_command(
                GENERATE, {"prompts": batch, "params": dataclasses.asdict(params)}
            )
            self._add_to_response(response, self._generate(batch, params))
        return response

    def stop_followers(self) -> None:
        """Tell every other rank to leave :meth:`follow`."""
        self._broadcast_command(EXIT, {})

    def _add_to_response(self, response: Dict, result) -> None:
        """Megatron's response fields for each sequence of ``result``."""
        for i, length in enumerate(result.lengths):
            ids = result.tokens[i, :length].tolist()
            response["tokens"].append(ids)
            response["text"].append(self.tokenizer.detokenize(ids))
            response["segments"].append([self.tokenizer.detokenize([t]) for t in ids])
            if response["logprobs"] is not None:
                response["logprobs"].append(result.log_probs[i, : length - 1].tolist())

    # ------------------------------------------------------------------ every rank
    def _generate(self, prompts: List[List[int]], params: SamplingParams):
        pad = self.special.eod if self.special.eod is not None else 0
        return generate(
            self.step,
            prompts,
            params,
            self.special,
            self.max_sequence_length,
            pad_id=pad,
            device=self.device,
        )

    def follow(self) -> None:
        """The loop of the ranks that do not serve: run each broadcast command until EXIT."""
        while True:
            code, payload = self._receive_command()
            if code == EXIT:
                return
            self._generate(payload["prompts"], SamplingParams(**payload["params"]))

    def _broadcast_command(self, code: int, payload: Dict) -> None:
        if self.world_size == 1:
            return
        data = json.dumps(payload).encode()
        header = torch.tensor([code, len(data)], dtype=torch.long, device=self.device)
        dist.broadcast(header, src=0)
        if data:
            body = torch.tensor(list(data), dtype=torch.uint8, device=self.device)
            dist.broadcast(body, src=0)

    def _receive_command(self):
        header = torch.empty(2, dtype=torch.long, device=self.device)
        dist.broadcast(header, src=0)
        code, size = int(header[0]), int(header[1])
        payload: Optional[Dict] = {}
        if size:
            body = torch.empty(size, dtype=torch.uint8, device=self.device)
            dist.broadcast(body, src=0)
            payload = json.loads(bytes(body.tolist()).decode())
        return code, payload
