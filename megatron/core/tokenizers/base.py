"""The interface every tokenizer of the framework implements.

Datasets and tools only talk to this interface: ``tokenize`` / ``detokenize``, the vocabulary
(``vocab``, ``inv_vocab``, ``vocab_size``) and the special ids (``eod``, ``pad``, ``bos``, ``eos``,
``cls``, ``sep``, ``mask``, ``additional_special_tokens_ids``). A special token that a family does
not have raises ``NotImplementedError`` naming the tokenizer, so a wrong tokenizer for a dataset
fails loudly instead of writing ``-1`` into token streams. Families that Megatron defines with a
``-1`` placeholder (GPT sentencepiece, Llama 2, null) return ``-1``, the value Megatron's
tokenizers return for them.

``unique_identifiers`` is a JSON-serialisable dict that identifies the tokenizer (class, files,
options); dataset index caches hash it, so two tokenizers that give different ids never share a
cache entry.
"""

from abc import ABC, abstractmethod
from collections import OrderedDict
from itertools import chain
from typing import Dict, Iterable, List, Mapping, Optional, Tuple

import numpy as np


class MegatronTokenizer(ABC):
    """Abstract tokenizer.

    Args:
        tokenizer_paths: the files or directories the tokenizer was built from.
        tokenizer_options: the options that change its ids (e.g. ``vocab_extra_ids``).
    """

    def __init__(self, *tokenizer_paths: str, **tokenizer_options):
        self.unique_identifiers: Dict[str, object] = OrderedDict()
        self.unique_identifiers["class"] = f"{type(self).__module__}.{type(self).__qualname__}"
        self.unique_identifiers["tokenizer_path"] = [str(p) for p in tokenizer_paths]
        for name, value in tokenizer_options.items():
            plain = isinstance(value, (bool, int, float, str, type(None)))
            self.unique_identifiers[name] = value if plain else str(value)

    # ----------------------------------------------------------------------------------- text
    @abstractmethod
    def tokenize(self, text: str) -> List[int]:
        """Convert text to token ids."""

    def tokenize_batch(self, texts: Iterable[str]) -> List[List[int]]:
        """Token ids of several texts; families with a batched fast path override this."""
        return [self.tokenize(t) for t in texts]

    def tokenize_batch_packed(
        self, texts: Iterable[str], dtype=np.int64
    ) -> Tuple[np.ndarray, np.ndarray]:
        """The ids of several texts back to back in one ``dtype`` array, and each text's id count
        (int64).

        What ``preprocess_data.py`` writes. This default goes through ``tokenize_batch``; families
        that can produce the array without a Python int per id override it.
        """
        encoded = self.tokenize_batch(texts)
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        ids = np.fromiter(chain.from_iterable(encoded), dtype=np.int64, count=int(lengths.sum()))
        return cast_ids(ids, dtype, type(self).__name__), lengths

    def detokenize(self, ids: List[int]) -> str:
        """Convert token ids back to text."""
        raise NotImplementedError(f"{type(self).__name__} has no method 'detokenize'")

    # ----------------------------------------------------------------------------- vocabulary
    @property
    @abstractmethod
    def vocab(self) -> Dict[str, int]:
        """Token string -> id."""

    @property
    @abstractmethod
    def inv_vocab(self) -> Dict[int, str]:
        """Id -> token string."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (before padding for the embedding)."""

    # --------------------------------------------------------------------------- special ids
    _special_ids: Mapping[str, int] = {}
    """Special token name (``eod``, ``pad``, ``bos``, ``eos``, ``cls``, ``sep``, ``mask``) -> id,
    set by each tokenizer; a name it lacks has no such token."""

    def _missing(self, name: str):
        raise NotImplementedError(f"{type(self).__name__} has no '{name}' token")

    def _special_id(self, name: str) -> int:
        """The id of the special token ``name``; NotImplementedError where there is none."""
        if name not in self._special_ids:
            return self._missing(name)
        return self._special_ids[name]

    @property
    def eod(self) -> int:
        """End-of-document id, appended by ``preprocess_data.py --append-eod``."""
        return self._special_id("eod")

    @property
    def pad(self) -> int:
        return self._special_id("pad")

    @property
    def bos(self) -> int:
        return self._special_id("bos")

    @property
    def eos(self) -> int:
        return self._special_id("eos")

    @property
    def cls(self) -> int:
        return self._special_id("cls")

    @property
    def sep(self) -> int:
        return self._special_id("sep")

    @property
    def mask(self) -> int:
        return self._special_id("mask")

    @property
    def additional_special_tokens_ids(self) -> Optional[List[int]]:
        """Sentinel ids (``<extra_id_i>``) used by T5 span masking; None where there are none."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size})"


def cast_ids(ids: np.ndarray, dtype, owner: str) -> np.ndarray:
    """``ids`` as ``dtype``; ValueError (naming ``owner``) when an id does not fit."""
    dtype = np.dtype(dtype)
    if ids.dtype == dtype:
        return ids
    if ids.size and np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        lo, hi = int(ids.min()), int(ids.max())
        if lo < info.min or hi > info.max:
            raise ValueError(f"{owner}: token ids in [{lo}, {hi}] do not fit {dtype.name}")
    return ids.astype(dtype)
