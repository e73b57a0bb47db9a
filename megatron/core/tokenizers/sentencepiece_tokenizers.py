"""SentencePiece tokenizers (``--tokenizer-model <file>.model``).

Three Megatron flavours share one model file format:

* ``SentencePieceTokenizer`` (BERT/T5 style): the model's pieces, then the special tokens
  ``<CLS> <SEP> <EOD> <MASK>``, the model's pad/bos/eos pieces (``<PAD>``, ``<BOS>``, ``<EOS>``
  appended when the model has none) and ``--vocab-extra-ids`` sentinels ``<extra_id_0..N-1>``,
  each appended after the model's ids when it is not a piece already. ``tokenize`` cuts the text
  at the literal special-token strings and encodes the pieces between them, so ``"<MASK>"`` in
  text becomes the mask id. ``detokenize`` surrounds special tokens with spaces (Megatron's
  ``detokenize`` puts a space after the text before a special token and after the token).
* ``GPTSentencePieceTokenizer``: the bare model; eod = eos; no cls/sep/mask (``-1``).
* ``Llama2Tokenizer``: the bare model; ``tokenize`` puts BOS first (``bos=True``) and no EOS
  (``eos=False``) by default, as Megatron's Llama-2 tokenizer; eod = eos.
"""

from typing import Dict, Iterable, List, Optional

from .base import MegatronTokenizer


def _load_processor(model_file: str):
    import sentencepiece

    processor = sentencepiece.SentencePieceProcessor()
    try:
        processor.Load(model_file)
    except (OSError, RuntimeError) as e:
        raise ValueError(f"{model_file}: not a SentencePiece model ({e})") from None
    return processor


class _SentencePieceBase(MegatronTokenizer):
    """Shared loading and vocabulary of the SentencePiece flavours."""

    def __init__(self, model_file: str, **options):
        super().__init__(model_file, **options)
        self._processor = _load_processor(model_file)
        size = self._processor.GetPieceSize()
        self._inv_vocab: Dict[int, str] = {i: self._processor.IdToPiece(i) for i in range(size)}
        self._vocab: Dict[str, int] = {piece: i for i, piece in self._inv_vocab.items()}

    @property
    def processor(self):
        """The underlying ``sentencepiece.SentencePieceProcessor``."""
        return self._processor

    def _piece_or(self, piece_id: int, fallback: str) -> str:
        """The model's piece for a special id, or ``fallback`` when the model has none (id -1)."""
        return (
            self._processor.IdToPiece(piece_id)
            if 0 <= piece_id < self._processor.GetPieceSize()
            else fallback
        )

    @property
    def vocab(self) -> Dict[str, int]:
        return self._vocab

    @property
    def inv_vocab(self) -> Dict[int, str]:
        return self._inv_vocab

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)


class SentencePieceTokenizer(_SentencePieceBase):
    """SentencePiece with Megatron's BERT/T5 special tokens (see the module docstring)."""

    def __init__(self, model_file: str, vocab_extra_ids: int = 0):
        super().__init__(model_file, vocab_extra_ids=vocab_extra_ids)
        self._special: Dict[str, int] = {}
        self._inv_special: Dict[int, str] = {}
        # Added in this order: the appended ids follow it.
        self._special_ids = {
            "cls": self._add_special("<CLS>"),
            "sep": self._add_special("<SEP>"),
            "eod": self._add_special("<EOD>"),
            "mask": self._add_special("<MASK>"),
            "pad": self._add_special(self._piece_or(self._processor.pad_id(), "<PAD>")),
            "bos": self._add_special(self._piece_or(self._processor.bos_id(), "<BOS>")),
            "eos": self._add_special(self._piece_or(self._processor.eos_id(), "<EOS>")),
        }
        self._extra_ids = [self._add_special(f"<extra_id_{i}>") for i in range(vocab_extra_ids)]

    def _add_special(self, token: str) -> int:
        if token not in self._vocab:
            new_id = len(self._vocab)
            self._vocab[token] = new_id
            self._inv_vocab[new_id] = token
        self._special[token] = self._vocab[token]
        self._inv_special[self._vocab[token]] = token
        return self._vocab[token]

    def tokenize(self, text: str) -> List[int]:
        ids: List[int] = []
        start = 0
        while True:
            # The earliest special string wins; on a tie the one registered first.
            best_pos, best_token = None, None
            for token in self._special:
                pos = text.find(token, start)
                if pos >= 0 and (best_pos is None or pos < best_pos):
                    best_pos, best_token = pos, token
            if best_token is None:
                break
            ids.extend(self._processor.EncodeAsIds(text[start:best_pos]))
            ids.append(self._special[best_token])
            start = best_pos + len(best_token)
        ids.extend(self._processor.EncodeAsIds(text[start:]))
        return ids

    def tokenize_batch(self, texts: Iterable[str]) -> List[List[int]]:
        texts = list(texts)
        if not any(token in t for t in texts for token in self._special):
            return self._processor.Encode(texts)
        return [self.tokenize(t) for t in texts]

    def detokenize(self, ids: List[int]) -> str:
        text, run = "", []
        for i in ids:
            i = int(i)
            if i in self._inv_special:
                text += self._processor.DecodeIds(run) + " " + self._inv_special[i] + " "
                run = []
            else:
                run.append(i)
        return text + self._processor.DecodeIds(run)

    @property
    def additional_special_tokens_ids(self) -> List[int]:
        return list(self._extra_ids)


class GPTSentencePieceTokenizer(_SentencePieceBase):
    """The bare SentencePiece model for GPT training: eod = eos, no cls/sep/mask (-1)."""

    def __init__(self, model_file: str):
        super().__init__(model_file)
        eos = self._processor.eos_id()
        self._special_ids = {"pad": self._processor.pad_id(), "bos": self._processor.bos_id()}
        self._special_ids.update({"eos": eos, "eod": eos, "cls": -1, "sep": -1, "mask": -1})

    def tokenize(self, text: str) -> List[int]:
        return self._processor.EncodeAsIds(text)

    def tokenize_batch(self, texts: Iterable[str]) -> List[List[int]]:
        return self._processor.Encode(list(texts))

    def detokenize(self, ids: List[int]) -> str:
        return self._processor.DecodeIds([int(i) for i in ids])


class Llama2Tokenizer(GPTSentencePieceTokenizer):
    """Llama 2's SentencePiece model: ``tokenize`` prepends BOS (and appends EOS only if asked)."""

    def tokenize(self, text: str, bos: bool = True, eos: bool = False) -> List[int]:
        if not isinstance(text, str):
            raise TypeError(f"Llama2Tokenizer.tokenize expects str, got {type(text).__name__}")
        ids = self._processor.EncodeAsIds(text)
        return ([self.bos] if bos else []) + ids + ([self.eos] if eos else [])

    def tokenize_batch(
        self, texts: Iterable[str], bos: bool = True, eos: bool = False
    ) -> List[List[int]]:
        head, tail = ([self.bos] if bos else []), ([self.eos] if eos else [])
        return [head + ids + tail for ids in self._processor.Encode(list(texts))]

    @property
    def additional_special_tokens_ids(self) -> Optional[List[int]]:
        return None
