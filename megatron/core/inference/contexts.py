"""Key/value cache of a static batch (Megatron's ``StaticInferenceContext``).

Generation runs the prompts once (prefill), then one token per step. Each attention layer keeps
the keys and values of the tokens seen so far in :attr:`key_value_memory_dict`, keyed by its
global ``layer_number``; a step appends the new tokens' keys and values at
:attr:`sequence_len_offset` and attends over everything up to there. The caller advances the
offset after each model forward (:meth:`advance`).

Cross-attention (encoder-decoder models) keeps its keys and values of the encoder output under
``("cross", layer_number)``: they are computed at the first step and reused unchanged (the slot
is :meth:`cross_key_value`).
"""

from typing import Callable, Dict, Hashable, Optional, Tuple

import torch


class StaticInferenceContext:
    """The KV cache of one batch of at most ``max_batch_size`` sequences of at most
    ``max_sequence_length`` tokens."""

    def __init__(self, max_batch_size: int, max_sequence_length: int):
        if max_batch_size < 1 or max_sequence_length < 1:
            raise ValueError(
                f"max_batch_size ({max_batch_size}) and max_sequence_length "
                f"({max_sequence_length}) must be positive"
            )
        self.max_batch_size = max_batch_size
        self.max_sequence_length = max_sequence_length
        self.sequence_len_offset = 0
        self.key_value_memory_dict: Dict[Hashable, Tuple[torch.Tensor, torch.Tensor]] = {}
        # Mamba layers: layer number -> (conv state [b, conv channels, d_conv - 1], SSM state
        # [b, heads, head dim, state dim]) after the tokens consumed so far.
        self.ssm_states: Dict[Hashable, Tuple[torch.Tensor, torch.Tensor]] = {}
        self._masks: Dict[Tuple[int, int, torch.device], torch.Tensor] = {}

    def reset(self) -> None:
        """Forget every cached key and value (a new batch starts)."""
        self.sequence_len_offset = 0
        self.key_value_memory_dict.clear()
        self.ssm_states.clear()

    def advance(self, num_tokens: int) -> None:
        """The model has consumed ``num_tokens`` more tokens of every sequence."""
        self.sequence_len_offset += num_tokens

    def append_key_value(
        self, layer_number: int, key: torch.Tensor, value: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens' ``key``/``value`` [s, b, groups, d] at the current offset and
        return the keys and values of all tokens so far, [offset + s, b, groups, d] (views)."""
        s, b = key.shape[0], key.shape[1]
        start = self.sequence_len_offset
        end = start + s
        if end > self.max_sequence_length:
            raise ValueError(
                f"the KV cache holds {self.max_sequence_length} tokens per sequence; "
                f"this step needs {end}"
            )
        if b > self.max_batch_size:
            raise ValueError(f"the KV cache holds {self.max_batch_size} sequences, got {b}")
        cache = self.key_value_memory_dict.get(layer_number)
        if cache is None or cache[0].shape[1] != b:
            if start != 0:
                raise ValueError(
                    f"layer {layer_number} has no KV cache for this batch at offset {start}"
                )
            # Keys and values may differ in width (multi-latent attention).
            rows = (self.max_sequence_length, b)
            cache = (
                torch.empty(rows + tuple(key.shape[2:]), dtype=key.dtype, device=key.device),
                torch.empty(rows + tuple(value.shape[2:]), dtype=value.dtype, device=value.device),
            )
            self.key_value_memory_dict[layer_number] = cache
        keys, values = cache
        keys[start:end] = key
        values[start:end] = value
        return keys[:end], values[:end]

    def cross_key_value(
        self, layer_number: int, compute: Callable[[], Tuple[torch.Tensor, torch.Tensor]]
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """The cross-attention keys and values of ``layer_number``: ``compute()`` at the first
        step, the cached ones afterwards (the encoder output does not change while decoding)."""
        slot = ("cross", layer_number)
        cached = self.key_value_memory_dict.get(slot)
        if cached is None:
            cached = compute()
            self.key_value_memory_dict[slot] = cached
        return cached

    def attention_mask(self, num_queries: int, device) -> Optional[torch.Tensor]:
        """The mask (True = masked) of ``num_queries`` new tokens over all tokens so far, or
        None where attention needs none: the first step is plain causal attention, and a single
        new token may attend to every cached one."""
        offset = self.sequence_len_offset
        if offset == 0 or num_queries == 1:
            return None
        key = (num_queries, offset, torch.device(device))
        mask = self._masks.get(key)
        if mask is None:
            query_pos = torch.arange(offset, offset + num_queries, device=device)
            key_pos = torch.arange(offset + num_queries, device=device)
            mask = (key_pos[None, :] > query_pos[:, None])[None, None]  # [1, 1, sq, sk]
            if len(self._masks) >= 8:
                self._masks.clear()
            self._masks[key] = mask
        return mask
