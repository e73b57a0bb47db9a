"""The attention mask of an encoder from its inputs' padding mask."""

import torch


def key_padding_mask(padding_mask: torch.Tensor) -> torch.Tensor:
    """[b, s] padding mask (1 = real token, 0 = pad) -> bool [b, 1, 1, s], True = masked key.

    Megatron masks the [s, s] outer product of the padding mask; queries at pad positions then see
    no key at all. Masking keys only gives the same outputs at every real token (a pad never
    serves as a key either way) and keeps the pad rows finite, which SDPA's all-masked rows
    (NaN) would not."""
    if padding_mask.dim() != 2:
        # Worded for BERT, T5's encoder mask included: the message is kept as it was written.
        raise ValueError(
            f"BERT's attention_mask is the [b, s] padding mask, got shape "
            f"{tuple(padding_mask.shape)}"
        )
    return (padding_mask < 0.5).unsqueeze(1).unsqueeze(1)
