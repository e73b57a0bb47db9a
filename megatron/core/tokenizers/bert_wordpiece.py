"""BERT WordPiece (``--tokenizer-type BertWordPieceLowerCase|BertWordPieceCase
--vocab-file vocab.txt``).

The algorithm is BERT's: clean the text (drop NUL / U+FFFD / control characters, map whitespace
to spaces), put spaces around CJK ideographs, split on whitespace, lower-case and strip accents
(LowerCase only), split off every punctuation character, then WordPiece each word by greedy
longest match (continuations prefixed ``##``; a word longer than 200 characters or with no
match becomes ``[UNK]``). The vocab needs ``[CLS] [SEP] [PAD] [MASK] [UNK]``.

``[BOS]`` and ``[EOS]`` are appended to the vocab when missing (Megatron's BERT tokenizer adds
the same two), then the
``<extra_id_i>`` sentinels of ``--vocab-extra-ids`` (the T5 span-masking tokens returned by
``additional_special_tokens_ids``). BERT has no end-of-document token: ``eod`` raises.

A plain-Python implementation is the reference; the Rust ``tokenizers`` library (BertNormalizer
+ BertPreTokenizer + WordPiece) is used when installed and it agrees on a probe text.
"""

import unicodedata
from typing import Dict, Iterable, List, Optional

from .base import MegatronTokenizer
from .gpt2_bpe import not_text

MAX_WORD_CHARS = 200

_PROBE_TEXT = (
    "Hello, World! It's 3.14 -- naïve café RÉSUMÉ Straße İstanbul ǅ \u4e2d\u6587 \U0002a6b0 "
    "\u3042\u3044 "
    "tabs\tand\nnewlines\r\n\u00a0nbsp \u2028 \x00nul \ufffd ctrl\x07 \u200bzw e\u0301 [MASK] "
    "<extra_id_0> "
    "supercalifragilisticexpialidocious " + "x" * 205 + " don't ¿qué? «quotes» ‘single’ $5 a_b a-b"
)


def _is_whitespace(ch: str) -> bool:
    return ch in " \t\n\r" or unicodedata.category(ch) == "Zs"


def _is_control(ch: str) -> bool:
    if ch in "\t\n\r":
        return False
    return unicodedata.category(ch) in ("Cc", "Cf")


def _is_punctuation(ch: str) -> bool:
    cp = ord(ch)
    # All non-alphanumeric ASCII counts as punctuation ("$", "^", "`" are not category P).
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(ch).startswith("P")


def _is_cjk(cp: int) -> bool:
    return (
        0x4E00 <= cp <= 0x9FFF
        or 0x3400 <= cp <= 0x4DBF
        or 0x20000 <= cp <= 0x2A6DF
        or 0x2A700 <= cp <= 0x2B73F
        or 0x2B740 <= cp <= 0x2B81F
        or 0x2B820 <= cp <= 0x2CEAF
        or 0xF900 <= cp <= 0xFAFF
        or 0x2F800 <= cp <= 0x2FA1F
    )


def basic_tokenize(text: str, lower_case: bool) -> List[str]:
    """BERT's pre-tokenization: cleaned, optionally lower-cased words and punctuation marks."""
    chars = []
    for ch in text:
        cp = ord(ch)
        if cp == 0 or cp == 0xFFFD or _is_control(ch):
            continue
        if _is_whitespace(ch):
            chars.append(" ")
        elif _is_cjk(cp):
            chars.append(f" {ch} ")
        else:
            chars.append(ch)
    words = []
    for word in "".join(chars).split():
        if lower_case:
            word = "".join(
                c
                for c in unicodedata.normalize("NFD", word.lower())
                if unicodedata.category(c) != "Mn"
            )
        piece = []
        for ch in word:
            if _is_punctuation(ch):
                if piece:
                    words.append("".join(piece))
                    piece = []
                words.append(ch)
            else:
                piece.append(ch)
        if piece:
            words.append("".join(piece))
    return words


def wordpiece(word: str, vocab: Dict[str, int], unk: str = "[UNK]") -> List[str]:
    """Greedy longest-match-first split of one word into vocab pieces."""
    if len(word) > MAX_WORD_CHARS:
        return [unk]
    pieces, start = [], 0
    while start < len(word):
        end = len(word)
        while end > start:
            candidate = word[start:end] if start == 0 else "##" + word[start:end]
            if candidate in vocab:
                break
            end -= 1
        if end == start:
            return [unk]
        pieces.append(candidate)
        start = end
    return pieces


def load_vocab(vocab_file: str) -> Dict[str, int]:
    """One token per line, id = line number (a later duplicate wins, as in BERT's loader)."""
    try:
        with open(vocab_file, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except UnicodeDecodeError as e:
        raise ValueError(f"{vocab_file}: not a WordPiece vocab.txt ({not_text(e)})") from None
    if lines and lines[-1] == "":
        lines.pop()
    return {line.rstrip("\r"): i for i, line in enumerate(lines)}


class _BertWordPieceTokenizer(MegatronTokenizer):
    """BERT WordPiece with Megatron's [BOS]/[EOS] and sentinel additions."""

    _LOWER_CASE = True

    def __init__(self, vocab_file: str, vocab_extra_ids: int = 0, use_fast: Optional[bool] = None):
        super().__init__(vocab_file, lower_case=self._LOWER_CASE, vocab_extra_ids=vocab_extra_ids)
        self._vocab = load_vocab(vocab_file)
        missing = [
            t for t in ("[CLS]", "[SEP]", "[PAD]", "[MASK]", "[UNK]") if t not in self._vocab
        ]
        if missing:
            raise ValueError(f"{vocab_file}: WordPiece vocab lacks {' '.join(missing)}")
        # Ids of the file are fixed before anything is appended, so the Rust engine sees the same
        # vocab.
        file_vocab = dict(self._vocab)
        self._inv_vocab = {i: t for t, i in self._vocab.items()}
        bos, eos = self._add_token("[BOS]"), self._add_token("[EOS]")
        self._extra_tokens = [f"<extra_id_{i}>" for i in range(vocab_extra_ids)]
        self._extra_ids = [self._add_token(t) for t in self._extra_tokens]
        self._special_ids = {
            "cls": self._vocab["[CLS]"],
            "sep": self._vocab["[SEP]"],
            "pad": self._vocab["[PAD]"],
            "mask": self._vocab["[MASK]"],
            "bos": bos,
            "eos": eos,
        }
        self._fast = None
        if use_fast is not False:
            engine = self._build_rust_engine(file_vocab)
            if engine is not None and self._rust_agrees(engine):
                self._fast = engine
            elif use_fast:
                raise ValueError(
                    f"the Rust 'tokenizers' WordPiece is unavailable or disagrees with "
                    "the reference "
                    f"for {vocab_file}; use use_fast=False"
                )

    def _add_token(self, token: str) -> int:
        if token not in self._vocab:
            new_id = len(self._vocab)
            self._vocab[token] = new_id
            self._inv_vocab[new_id] = token
        return self._vocab[token]

    def _build_rust_engine(self, file_vocab: Dict[str, int]):
        try:
            from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
        except ImportError:
            return None
        engine = Tokenizer(
            models.WordPiece(
                vocab=file_vocab, unk_token="[UNK]", max_input_chars_per_word=MAX_WORD_CHARS
            )
        )
        engine.normalizer = normalizers.BertNormalizer(
            clean_text=True,
            handle_chinese_chars=True,
            strip_accents=self._LOWER_CASE,
            lowercase=self._LOWER_CASE,
        )
        engine.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        return engine

    def _reference_ids(self, text: str) -> List[int]:
        vocab = self._vocab
        return [
            vocab[p] for w in basic_tokenize(text, self._LOWER_CASE) for p in wordpiece(w, vocab)
        ]

    def _rust_agrees(self, engine) -> bool:
        probe = _PROBE_TEXT + " " + " ".join(list(self._vocab)[:: max(1, len(self._vocab) // 64)])
        return engine.encode(probe, add_special_tokens=False).ids == self._reference_ids(probe)

    @property
    def uses_rust(self) -> bool:
        return self._fast is not None

    def tokenize(self, text: str) -> List[int]:
        if self._fast is not None:
            return self._fast.encode(text, add_special_tokens=False).ids
        return self._reference_ids(text)

    def tokenize_batch(self, texts: Iterable[str]) -> List[List[int]]:
        texts = list(texts)
        if self._fast is not None:
            return [e.ids for e in self._fast.encode_batch(texts, add_special_tokens=False)]
        return [self._reference_ids(t) for t in texts]

    def detokenize(self, ids: List[int]) -> str:
        """Tokens joined by spaces with ``##`` continuations glued back (case/accents stay lost)."""
        return " ".join(self._inv_vocab[int(i)] for i in ids).replace(" ##", "").strip()

    @property
    def vocab(self) -> Dict[str, int]:
        return self._vocab

    @property
    def inv_vocab(self) -> Dict[int, str]:
        return self._inv_vocab

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def additional_special_tokens_ids(self) -> List[int]:
        return list(self._extra_ids)


class BertWordPieceLowerCase(_BertWordPieceTokenizer):
    """Uncased BERT WordPiece: text is lower-cased and accents are stripped first."""

    _LOWER_CASE = True


class BertWordPieceCase(_BertWordPieceTokenizer):
    """Cased BERT WordPiece: text is matched as written."""

    _LOWER_CASE = False
