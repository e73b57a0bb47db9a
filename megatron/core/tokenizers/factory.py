"""Build a tokenizer from the values of Megatron's tokenizer flags (``--tokenizer-type`` and
friends).

Takes plain keyword arguments (no global args) so core code and tools can call it; the training
side's ``megatron.training.tokenizer.build_tokenizer(args)`` maps the parsed args onto it. Errors
name the flag and the path that is missing or wrong.
"""

import os
from typing import Optional

from .base import MegatronTokenizerBase

TOKENIZER_TYPES = (
    "BertWordPieceLowerCase",
    "BertWordPieceCase",
    "GPT2BPETokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
    "HuggingFaceTokenizer",
    "NullTokenizer",
)
# Accepted by Megatron's --tokenizer-type but not implemented here; named so the error is clear.
UNSUPPORTED_TOKENIZER_TYPES = (
    "TikTokenizer",
    "MultimodalTokenizer",
    "NullMultimodalTokenizer",
    "SFTTokenizer",
)
REMOVED_TOKENIZER_TYPES = {
    "Llama3Tokenizer": "HuggingFaceTokenizer",
    "MistralTokenizer": "HuggingFaceTokenizer",
    "HFTokenizer": "HuggingFaceTokenizer",
}


def _require_file(tokenizer_type: str, flag: str, path: Optional[str]) -> str:
    if path is None:
        raise ValueError(f"--tokenizer-type {tokenizer_type} needs {flag}")
    if not os.path.isfile(path):
        raise ValueError(
            f"{flag} {path}: no such file" + (" (it is a directory)" if os.path.isdir(path) else "")
        )
    return path


def build_tokenizer_from_options(
    tokenizer_type: Optional[str],
    *,
    vocab_file: Optional[str] = None,
    merge_file: Optional[str] = None,
    tokenizer_model: Optional[str] = None,
    vocab_size: Optional[int] = None,
    vocab_extra_ids: int = 0,
    tokenizer_hf_no_use_fast: bool = False,
    tokenizer_hf_include_special_tokens: bool = True,
    trust_remote_code: bool = False,
    null_tokenizer_eod_id: Optional[int] = None,
    null_tokenizer_pad_id: int = -1,
) -> MegatronTokenizerBase:
    """The tokenizer ``--tokenizer-type`` names, built from the files the other flags give.

    ``BertWordPieceCase`` adds 100 ``<extra_id_i>`` sentinels unless ``--vocab-extra-ids`` asks for
    another (non-zero) number; the other families add ``vocab_extra_ids`` (default 0) where they
    support sentinels.
    """
    vocab_extra_ids = int(vocab_extra_ids or 0)
    if tokenizer_type is None:
        raise ValueError(
            "--tokenizer-type is required (one of: " + ", ".join(TOKENIZER_TYPES) + ")"
        )
    if tokenizer_type in REMOVED_TOKENIZER_TYPES:
        raise ValueError(
            f"--tokenizer-type {tokenizer_type} was removed from Megatron; use "
            f"--tokenizer-type {REMOVED_TOKENIZER_TYPES[tokenizer_type]} --tokenizer-model <dir>"
        )
    if tokenizer_type in UNSUPPORTED_TOKENIZER_TYPES:
        raise ValueError(
            f"--tokenizer-type {tokenizer_type} is not supported by this framework "
            f"(supported: {', '.join(TOKENIZER_TYPES)})"
        )

    if tokenizer_type in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        from .bert_wordpiece import BertWordPieceCase, BertWordPieceLowerCase

        vocab_file = _require_file(tokenizer_type, "--vocab-file", vocab_file)
        if tokenizer_type == "BertWordPieceLowerCase":
            return BertWordPieceLowerCase(vocab_file, vocab_extra_ids=vocab_extra_ids)
        return BertWordPieceCase(vocab_file, vocab_extra_ids=vocab_extra_ids or 100)
    if tokenizer_type == "GPT2BPETokenizer":
        from .gpt2_bpe import GPT2BPETokenizer

        vocab_file = _require_file(tokenizer_type, "--vocab-file", vocab_file)
        merge_file = _require_file(tokenizer_type, "--merge-file", merge_file)
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        from . import sentencepiece_tokenizers as spt

        model = _require_file(tokenizer_type, "--tokenizer-model", tokenizer_model)
        if tokenizer_type == "SentencePieceTokenizer":
            return spt.SentencePieceTokenizer(model, vocab_extra_ids=vocab_extra_ids)
        return getattr(spt, tokenizer_type)(model)
    if tokenizer_type == "HuggingFaceTokenizer":
        from .huggingface import HuggingFaceTokenizer

        if tokenizer_model is None:
            raise ValueError(
                "--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model "
                "(a tokenizer directory)"
            )
        return HuggingFaceTokenizer(
            tokenizer_model,
            use_fast=not tokenizer_hf_no_use_fast,
            trust_remote_code=trust_remote_code,
            include_special_tokens=tokenizer_hf_include_special_tokens,
        )
    if tokenizer_type == "NullTokenizer":
        from .null_tokenizer import NullTokenizer

        if vocab_size is None:
            raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size")
        return NullTokenizer(
            vocab_size,
            eod_id=null_tokenizer_eod_id,
            pad_id=-1 if null_tokenizer_pad_id is None else null_tokenizer_pad_id,
        )
    raise ValueError(
        f"--tokenizer-type {tokenizer_type}: unknown (choose one of: {', '.join(TOKENIZER_TYPES)})"
    )
