"""Build the tokenizer from the parsed args and pad the vocab size (Megatron's ``build_tokenizer``).

Contract of :func:`build_tokenizer`:

* reads ``args.tokenizer_type``, ``vocab_file``, ``merge_file``, ``tokenizer_model``,
  ``vocab_size``, ``vocab_extra_ids``, ``tokenizer_hf_no_use_fast``,
  ``tokenizer_hf_no_include_special_tokens``, ``trust_remote_code``, ``null_tokenizer_eod_id``,
  ``null_tokenizer_pad_id``, ``padded_vocab_size``, ``pad_vocab_size`` (False with
  ``--no-pad-vocab-size``; or ``no_pad_vocab_size``), ``make_vocab_size_divisible_by``,
  ``tensor_model_parallel_size`` and ``rank``; missing attributes take the flag defaults, so
  tools with a partial namespace work;
* sets ``args.padded_vocab_size``: ``--padded-vocab-size`` when given (it must not be smaller
  than the tokenizer's vocab), the vocab size itself with ``--no-pad-vocab-size``, otherwise the
  vocab size rounded up to a multiple of
  ``make_vocab_size_divisible_by * tensor_model_parallel_size``;
* prints ``> building {type} tokenizer ...`` and `` > padded vocab (size: V) with K dummy tokens
  (new size: P)`` when ``args.rank == 0``;
* returns the :class:`megatron.core.tokenizers.MegatronTokenizer`.
"""

import math

from megatron.core.tokenizers import MegatronTokenizer, build_tokenizer_from_options


def _vocab_size_with_padding(orig_vocab_size: int, args, logging_enabled: bool = True) -> int:
    """Round the vocab up so the embedding splits evenly over tensor-parallel ranks in aligned
    rows."""
    multiple = getattr(args, "make_vocab_size_divisible_by", 128) * getattr(
        args, "tensor_model_parallel_size", 1
    )
    if multiple < 1:
        raise ValueError(
            f"--make-vocab-size-divisible-by times --tensor-model-parallel-size must be positive, "
            f"got {multiple}"
        )
    after = int(math.ceil(orig_vocab_size / multiple) * multiple)
    if logging_enabled and getattr(args, "rank", 0) == 0:
        print(
            f" > padded vocab (size: {orig_vocab_size}) "
            f"with {after - orig_vocab_size} dummy tokens "
            f"(new size: {after})",
            flush=True,
        )
    return after


def build_tokenizer(args) -> MegatronTokenizer:
    """Build ``args.tokenizer_type`` and set ``args.padded_vocab_size`` (see the module
    docstring)."""
    if getattr(args, "rank", 0) == 0:
        print(f"> building {args.tokenizer_type} tokenizer ...", flush=True)
    tokenizer = build_tokenizer_from_options(
        args.tokenizer_type,
        vocab_file=getattr(args, "vocab_file", None),
        merge_file=getattr(args, "merge_file", None),
        tokenizer_model=getattr(args, "tokenizer_model", None),
        vocab_size=getattr(args, "vocab_size", None),
        vocab_extra_ids=getattr(args, "vocab_extra_ids", 0),
        tokenizer_hf_no_use_fast=getattr(args, "tokenizer_hf_no_use_fast", False),
        tokenizer_hf_include_special_tokens=not getattr(
            args, "tokenizer_hf_no_include_special_tokens", False
        ),
        trust_remote_code=getattr(args, "trust_remote_code", False),
        null_tokenizer_eod_id=getattr(args, "null_tokenizer_eod_id", None),
        null_tokenizer_pad_id=getattr(args, "null_tokenizer_pad_id", -1),
    )
    vocab_size = tokenizer.vocab_size
    padded = getattr(args, "padded_vocab_size", None)
    if padded is not None:
        if padded < vocab_size:
            raise ValueError(
                f"--padded-vocab-size {padded} is smaller than "
                f"the tokenizer's vocab size {vocab_size}"
            )
    elif (
        getattr(args, "no_pad_vocab_size", False) or getattr(args, "pad_vocab_size", True) is False
    ):
        padded = vocab_size
    else:
        padded = _vocab_size_with_padding(vocab_size, args)
    args.padded_vocab_size = padded
    return tokenizer
