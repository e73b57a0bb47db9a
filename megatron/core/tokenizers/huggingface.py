"""Hugging Face tokenizers (``--tokenizer-type HuggingFaceTokenizer --tokenizer-model <dir>``).

Loaded with ``transformers.AutoTokenizer`` **offline** (``local_files_only=True``): a local
directory, or a model already in the Hugging Face cache. Nothing is downloaded unless the
environment says ``HF_HUB_OFFLINE=0`` explicitly.

``tokenize`` returns ``tokenizer(text).input_ids``, as Megatron's Hugging Face tokenizer's
``tokenize`` does: the tokenizer's own special
tokens (e.g. Llama's BOS) are included unless ``include_special_tokens=False``
(``--tokenizer-hf-no-include-special-tokens``); ``vocab_size`` is ``len(tokenizer)`` (added tokens
included); eod = eos.
"""

import os
from typing import Dict, Iterable, List, Optional

from .base import MegatronTokenizer


def _downloads_allowed() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("0", "false", "no", "off")


class HuggingFaceTokenizer(MegatronTokenizer):
    """``AutoTokenizer.from_pretrained(path)`` behind the Megatron interface.

    Args:
        pretrained_model_name_or_path: a local tokenizer directory (or a cached hub name).
        use_fast: ask for the Rust-backed tokenizer (``--tokenizer-hf-no-use-fast`` turns it off).
        trust_remote_code: allow a tokenizer class defined in the directory's own Python files.
        include_special_tokens: let ``tokenize`` add the tokenizer's special tokens (BOS, ...).
    """

    def __init__(
        self,
        pretrained_model_name_or_path: str,
        use_fast: bool = True,
        trust_remote_code: bool = False,
        include_special_tokens: bool = True,
        **kwargs,
    ):
        super().__init__(
            pretrained_model_name_or_path,
            use_fast=use_fast,
            trust_remote_code=trust_remote_code,
            include_special_tokens=include_special_tokens,
            **kwargs,
        )
        self._add_special_tokens = bool(include_special_tokens)
        import transformers

        local_only = not _downloads_allowed()
        try:
            self._tokenizer = transformers.AutoTokenizer.from_pretrained(
                pretrained_model_name_or_path,
                use_fast=use_fast,
                trust_remote_code=trust_remote_code,
                local_files_only=local_only,
                **kwargs,
            )
        except (OSError, ValueError) as e:
            if local_only and not os.path.isdir(pretrained_model_name_or_path):
                where = (
                    "it is not a local directory and not in the Hugging Face cache "
                    "(downloads are off; "
                    "set HF_HUB_OFFLINE=0 to allow them)"
                )
            else:
                where = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ValueError(
                f"--tokenizer-model {pretrained_model_name_or_path}: cannot load a Hugging Face "
                f"tokenizer: {where}"
            ) from None
        self._vocab = self._tokenizer.get_vocab()
        self._inv_vocab = {i: t for t, i in self._vocab.items()}

    @property
    def tokenizer(self):
        """The wrapped ``transformers`` tokenizer."""
        return self._tokenizer

    def tokenize(self, text: str, **kwargs) -> List[int]:
        kwargs.setdefault("add_special_tokens", self._add_special_tokens)
        return self._tokenizer(text, **kwargs).input_ids

    def tokenize_batch(self, texts: Iterable[str]) -> List[List[int]]:
        texts = list(texts)
        return (
            self._tokenizer(texts, add_special_tokens=self._add_special_tokens).input_ids
            if texts
            else []
        )

    def detokenize(self, ids: List[int], **kwargs) -> str:
        return self._tokenizer.decode([int(i) for i in ids], **kwargs)

    @property
    def vocab(self) -> Dict[str, int]:
        return self._vocab

    @property
    def inv_vocab(self) -> Dict[int, str]:
        return self._inv_vocab

    @property
    def vocab_size(self) -> int:
        return len(self._tokenizer)

    def _special_id(self, name: str) -> int:
        # Read from the wrapped tokenizer at each call (its tokens can be changed through
        # ``.tokenizer``); the end of a document is its eos.
        name = "eos" if name == "eod" else name
        value: Optional[int] = getattr(self._tokenizer, f"{name}_token_id", None)
        if value is None:
            return self._missing(name)
        return value

    @property
    def additional_special_tokens_ids(self) -> Optional[List[int]]:
        ids = getattr(self._tokenizer, "additional_special_tokens_ids", None)
        return list(ids) if ids else None
