"""Tokenizers behind one interface (:class:`MegatronTokenizerBase`): GPT-2 BPE, SentencePiece (three
Megatron flavours), Hugging Face, BERT WordPiece and the null tokenizer.

Build one as Megatron Core does with ``MegatronTokenizer.from_pretrained(...)``, from flag values
with :func:`build_tokenizer_from_options`, or from parsed args with
``megatron.training.tokenizer.build_tokenizer(args)`` (which also pads the vocab size).
Families are imported lazily: ``transformers`` and ``sentencepiece`` load only when used.
"""

from .base import MegatronTokenizerBase
from .factory import TOKENIZER_TYPES, build_tokenizer_from_options
from .megatron_tokenizer import MegatronTokenizer

_LAZY = {
    "GPT2BPETokenizer": ".gpt2_bpe",
    "SentencePieceTokenizer": ".sentencepiece_tokenizers",
    "GPTSentencePieceTokenizer": ".sentencepiece_tokenizers",
    "Llama2Tokenizer": ".sentencepiece_tokenizers",
    "HuggingFaceTokenizer": ".huggingface",
    "BertWordPieceLowerCase": ".bert_wordpiece",
    "BertWordPieceCase": ".bert_wordpiece",
    "NullTokenizer": ".null_tokenizer",
}

__all__ = [
    "MegatronTokenizer",
    "MegatronTokenizerBase",
    "TOKENIZER_TYPES",
    "build_tokenizer_from_options",
    *_LAZY,
]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
