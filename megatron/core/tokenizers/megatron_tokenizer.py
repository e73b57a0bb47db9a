"""``MegatronTokenizer.from_pretrained``: Megatron Core's way to restore a tokenizer from a
metadata dict (or its JSON file) naming the library.

As in Megatron Core, :class:`MegatronTokenizer` is not instantiated; ``from_pretrained`` returns a
tokenizer of this framework (a :class:`MegatronTokenizerBase`). Every tokenizer is also an
instance of :class:`MegatronTokenizer` (a registered virtual base class), so code that checks
``isinstance(tok, MegatronTokenizer)`` keeps working.

Libraries:

* ``"null-text"`` (Megatron-LM's name) or ``"null"`` (megatron-core 0.16's): the null tokenizer,
  ``vocab_size=N`` keyword; ``N + 1`` ids, EOD ``N``.
* ``"huggingface"``: ``tokenizer_path`` is the tokenizer directory; keywords ``use_fast``,
  ``trust_remote_code``, ``include_special_tokens``.
* ``"sentencepiece"``: ``tokenizer_path`` is the ``.model`` file (Megatron's
  ``SentencePieceTokenizer`` flavour); keyword ``vocab_extra_ids``.
* ``"megatron"``: ``tokenizer_path`` names the type (``GPT2BPETokenizer``,
  ``BertWordPieceLowerCase``, ``BertWordPieceCase``); keywords ``vocab_file``, ``merges_file``.

Any other library, or a keyword a library does not take, is one ValueError naming it.
"""

import json
import os
from abc import ABC
from typing import Any, Dict, Optional, Union

from .base import MegatronTokenizerBase
from .factory import build_tokenizer_from_options

SUPPORTED_LIBRARIES = ("null-text", "null", "huggingface", "sentencepiece", "megatron")
_MEGATRON_TYPES = ("GPT2BPETokenizer", "BertWordPieceLowerCase", "BertWordPieceCase")
_KEYWORDS = {
    "null": ("vocab_size",),
    "huggingface": ("use_fast", "trust_remote_code", "include_special_tokens"),
    "sentencepiece": ("vocab_extra_ids",),
    "megatron": ("vocab_file", "merges_file"),
}


class MegatronTokenizer(ABC):
    """Restores a tokenizer: use :meth:`from_pretrained`."""

    def __init__(self) -> None:
        raise TypeError("MegatronTokenizer is built with MegatronTokenizer.from_pretrained(...)")

    @staticmethod
    def from_pretrained(
        tokenizer_path: Optional[str] = None,
        metadata_path: Optional[Union[str, Dict[str, Any]]] = None,
        **kwargs: Any,
    ) -> MegatronTokenizerBase:
        """The tokenizer that ``metadata_path`` (a dict, or a JSON file holding one) describes.

        Without ``metadata_path`` the metadata is ``<tokenizer dir>/tokenizer_metadata.json``.
        ``metdata_path`` is taken for ``metadata_path``: Megatron Core's own quickstart
        (examples/run_simple_mcore_train_loop.py) spells it so, and it should run here as written.
        """
        if "metdata_path" in kwargs:
            if metadata_path is not None:
                raise ValueError("from_pretrained: give metadata_path or metdata_path, not both")
            metadata_path = kwargs.pop("metdata_path")
        metadata = _read_metadata(tokenizer_path, metadata_path)
        library = metadata.get("library")
        if library not in SUPPORTED_LIBRARIES:
            raise ValueError(
                f"from_pretrained: tokenizer library {library!r} is not supported here "
                f"(supported: {', '.join(SUPPORTED_LIBRARIES)})"
            )
        family = "null" if library in ("null-text", "null") else library
        unknown = sorted(set(kwargs) - set(_KEYWORDS[family]))
        if unknown:
            raise ValueError(
                f"from_pretrained: library {library!r} takes no keyword {', '.join(unknown)} "
                f"(it takes: {', '.join(_KEYWORDS[family])})"
            )
        if family == "null":
            if kwargs.get("vocab_size") is None:
                raise ValueError(f"from_pretrained: library {library!r} needs vocab_size=")
            return build_tokenizer_from_options("NullTokenizer", vocab_size=kwargs["vocab_size"])
        if not tokenizer_path:
            raise ValueError(f"from_pretrained: library {library!r} needs tokenizer_path")
        if family == "huggingface":
            return build_tokenizer_from_options(
                "HuggingFaceTokenizer",
                tokenizer_model=tokenizer_path,
                tokenizer_hf_no_use_fast=not kwargs.get("use_fast", True),
                trust_remote_code=kwargs.get("trust_remote_code", False),
                tokenizer_hf_include_special_tokens=kwargs.get("include_special_tokens", True),
            )
        if family == "sentencepiece":
            return build_tokenizer_from_options(
                "SentencePieceTokenizer",
                tokenizer_model=tokenizer_path,
                vocab_extra_ids=kwargs.get("vocab_extra_ids", 0),
            )
        if tokenizer_path not in _MEGATRON_TYPES:
            raise ValueError(
                f"from_pretrained: library 'megatron' needs tokenizer_path to name one of "
                f"{', '.join(_MEGATRON_TYPES)}, got {tokenizer_path!r}"
            )
        return build_tokenizer_from_options(
            tokenizer_path,
            vocab_file=kwargs.get("vocab_file"),
            merge_file=kwargs.get("merges_file"),
        )


MegatronTokenizer.register(MegatronTokenizerBase)


def _read_metadata(
    tokenizer_path: Optional[str], metadata_path: Optional[Union[str, Dict[str, Any]]]
) -> Dict[str, Any]:
    if isinstance(metadata_path, dict):
        return metadata_path
    if metadata_path is None:
        if not tokenizer_path:
            raise ValueError("from_pretrained: give tokenizer_path or metadata_path")
        directory = (
            os.path.dirname(tokenizer_path) if os.path.isfile(tokenizer_path) else tokenizer_path
        )
        metadata_path = os.path.join(directory, "tokenizer_metadata.json")
    if not isinstance(metadata_path, str):
        raise ValueError(
            f"from_pretrained: metadata_path must be a dict or a file path, got "
            f"{type(metadata_path).__name__}"
        )
    try:
        with open(metadata_path) as stream:
            metadata = json.load(stream)
    except OSError as err:
        raise ValueError(f"tokenizer metadata {metadata_path}: {err.strerror}") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{metadata_path}:{err.lineno}: invalid JSON ({err.msg})") from None
    if not isinstance(metadata, dict):
        raise ValueError(f"{metadata_path}: expected a JSON object with a 'library' key")
    return metadata
