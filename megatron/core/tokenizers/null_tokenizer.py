"""NullTokenizer (``--tokenizer-type NullTokenizer --vocab-size N``): text is already token ids.

``tokenize("5 17 3")`` is ``[5, 17, 3]``; ``detokenize`` joins ids with single spaces.

Semantics chosen: Megatron's **classic** ones (up to core_v0.14, what existing scripts and data
were made with): ids ``0 .. N-1`` are text tokens and the EOD id ``N`` is appended after them, so
``vocab_size == N + 1`` and ``eod == N``. (Megatron HEAD instead counts EOD inside N:
``vocab_size == N``, ``eod == N - 1``.) ``--null-tokenizer-eod-id`` overrides the EOD id (the size
stays N + 1) and ``--null-tokenizer-pad-id`` sets ``pad`` (default -1, i.e. none). There are no
cls/sep/mask/bos/eos tokens (``-1``) and no string vocabulary.
"""

from typing import Dict, List, Optional

from .base import MegatronTokenizer


class NullTokenizer(MegatronTokenizer):
    """Whitespace-separated integers in, integers out (classic sizes: N text ids + 1 EOD)."""

    def __init__(self, vocab_size: int, eod_id: Optional[int] = None, pad_id: int = -1):
        vocab_size = int(vocab_size)
        if vocab_size < 1:
            raise ValueError(
                f"--vocab-size must be a positive integer for NullTokenizer, got {vocab_size}"
            )
        super().__init__(vocab_size=vocab_size, eod_id=eod_id, pad_id=pad_id)
        self._text_vocab_size = vocab_size
        eod = vocab_size if eod_id is None else int(eod_id)
        self._special_ids = {"eod": eod, "pad": int(pad_id)}
        self._special_ids.update(dict.fromkeys(("cls", "sep", "mask", "bos", "eos"), -1))

    def tokenize(self, text: str) -> List[int]:
        ids = []
        for word in text.split():
            try:
                ids.append(int(word))
            except ValueError:
                raise ValueError(
                    f"NullTokenizer expects whitespace-separated integers, got {word[:40]!r}"
                ) from None
            if not 0 <= ids[-1] < self.vocab_size:
                # An out-of-range id would index past the embedding table much later, far from
                # its cause.
                raise ValueError(
                    f"NullTokenizer: id {ids[-1]} is outside [0, {self.vocab_size - 1}] "
                    f"(--vocab-size {self._text_vocab_size})"
                )
        return ids

    def detokenize(self, ids: List[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    @property
    def vocab_size(self) -> int:
        return self._text_vocab_size + 1

    @property
    def vocab(self) -> Dict[str, int]:
        raise NotImplementedError("NullTokenizer has no string vocabulary")

    @property
    def inv_vocab(self) -> Dict[int, str]:
        raise NotImplementedError("NullTokenizer has no string vocabulary")
