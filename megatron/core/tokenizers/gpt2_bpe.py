"""GPT-2 byte-level BPE (``--tokenizer-type GPT2BPETokenizer``, ``--vocab-file`` + ``--merge-file``).

The files are the GPT-2 ones: ``vocab.json`` maps byte-level token strings to ids, ``merges.txt``
lists merge rules in priority order (an optional ``#version`` first line). EOD is
``<|endoftext|>``.

Two implementations give the same ids:

* ``_ByteLevelBPE`` - a plain-Python implementation of the GPT-2 algorithm (pre-split the text
  with the GPT-2 regex, map UTF-8 bytes to printable characters, repeatedly merge the
  lowest-ranked adjacent pair). It is the reference.
* the fast path used by ``tokenize``: the same regex split (for pure-ASCII text an equivalent
  ASCII pattern on the faster stdlib ``re`` engine), then a cache from each raw piece straight
  to its ids, so a word seen before costs one dict lookup (no byte mapping, no merge
  loop). A new piece is merged by the Rust ``tokenizers`` BPE model when it is installed and
  agrees with the reference on a probe text at load time, else by the reference merge loop.
  Measured on this machine on the shipped corpus (warm caches): 3.5-5x the reference and
  about as much over the Rust library's own full pipeline, whose byte-level pre-tokenizer (with
  its offset tracking) costs more than the BPE itself.

As in Megatron's classic tokenizer, the text ``<|endoftext|>`` inside a document is ordinary text
(it is split into ``<|``, ``endoftext``, ``|>``); only ``--append-eod`` puts the EOD id into data.
A document quoting that string therefore can not forge a document boundary.
"""
import json
import re
from itertools import chain
from typing import Dict, Iterable, List, Optional, Tuple

import regex

from .base import MegatronTokenizer

EOD_TOKEN = "<|endoftext|>"

# GPT-2's pre-tokenizer: English contractions, letter runs, digit runs, other-symbol runs (each
# with one optional leading space), then whitespace (keeping the last space for the next word).
GPT2_SPLIT_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# The same split for pure-ASCII text, where \p{L} is [A-Za-z], \p{N} is [0-9] and both engines'
# \s is [\t\n\v\f\r ]; the stdlib engine runs it ~2.5x faster than the unicode pattern.
GPT2_SPLIT_PATTERN_ASCII = r"""'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+"""

# Text on which the Rust engine must agree with the reference before it is trusted: contractions,
# runs of spaces, unicode whitespace, digits, CJK, emoji, combining marks, a lone surrogate-free
# private-use char, control chars and the EOD string as plain text.
_PROBE_TEXT = (
    "Hello world! It's what they'll've said: don't   stop.\n\n\tTabs\u00a0nbsp\u2003em\u2028ls\u3000ideo "
    "12345 3.14159 x=y+z; <|endoftext|> caf\u00e9 e\u0301 \u4e2d\u6587\u5b57 \U0001f600\U0001f44d\U0001f3fd "
    "\u0394\u03b5\u03bb\u03c4\u03b1 \u0645\u0631\u062d\u0628\u0627 \ue000\x00\x07\x7f trailing   \n  \r\n"
)


def bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters.

    Bytes that are already printable (and not space) map to themselves; the other 68 are
    shifted to code points 256, 257, ... in byte order, so no token string contains whitespace
    or control characters.
    """
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1))
                 + list(range(ord("\u00ae"), ord("\u00ff") + 1)))
    table = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shift)
            shift += 1
    return table


def load_gpt2_files(vocab_file: str, merge_file: str) -> Tuple[Dict[str, int], List[Tuple[str, str]]]:
    """Read and check a GPT-2 ``vocab.json`` / ``merges.txt`` pair; errors name the file and line."""
    try:
        with open(vocab_file, encoding="utf-8") as f:
            encoder = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{vocab_file}: not a GPT-2 vocab.json ({e})") from None
    if not isinstance(encoder, dict) or not all(isinstance(v, int) for v in encoder.values()):
        raise ValueError(f"{vocab_file}: not a GPT-2 vocab.json (expected an object of token -> integer id)")
    merges = []
    with open(merge_file, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\r\n")
            if not line.strip() or (lineno == 1 and line.startswith("#version")):
                continue
            parts = line.split(" ")
            if len(parts) != 2 or not parts[0] or not parts[1]:
                raise ValueError(f"{merge_file}:{lineno}: expected two space-separated tokens, got {line!r}")
            a, b = parts
            for token in (a, b, a + b):
                if token not in encoder:
                    raise ValueError(f"{merge_file}:{lineno}: token {token!r} of merge {line!r} is not in {vocab_file}")
            merges.append((a, b))
    return encoder, merges


class _ByteLevelBPE:
    """Plain-Python GPT-2 BPE; the reference the fast path is checked against."""

    _CACHE_LIMIT = 200_000

    def __init__(self, encoder: Dict[str, int], merges: List[Tuple[str, str]]):
        self.encoder = encoder
        self.ranks = {pair: rank for rank, pair in enumerate(merges)}
        self.byte_encoder = bytes_to_unicode()
        self.pattern = regex.compile(GPT2_SPLIT_PATTERN)
        self.cache: Dict[str, List[int]] = {}

    def _merge(self, word: str) -> List[str]:
        parts = list(word)
        ranks = self.ranks
        while len(parts) > 1:
            best_rank, best = None, None
            for pair in zip(parts, parts[1:]):
                rank = ranks.get(pair)
                if rank is not None and (best_rank is None or rank < best_rank):
                    best_rank, best = rank, pair
            if best is None:
                break
            first, second = best
            merged, i, n = [], 0, len(parts)
            while i < n:
                # Non-overlapping, left to right: "aaa" with rule (a, a) gives "aa", "a".
                if i + 1 < n and parts[i] == first and parts[i + 1] == second:
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        return parts

    def encode(self, text: str) -> List[int]:
        ids: List[int] = []
        cache, byte_encoder, encoder = self.cache, self.byte_encoder, self.encoder
        for piece in self.pattern.findall(text):
            word = "".join(byte_encoder[b] for b in piece.encode("utf-8"))
            word_ids = cache.get(word)
            if word_ids is None:
                word_ids = [encoder[t] for t in self._merge(word)]
                if len(cache) >= self._CACHE_LIMIT:
                    cache.clear()
                cache[word] = word_ids
            ids.extend(word_ids)
        return ids


def _build_rust_bpe(encoder: Dict[str, int], merges: List[Tuple[str, str]]):
    """The same merge rules as a Rust ``tokenizers`` BPE model, or None when it is not installed."""
    try:
        from tokenizers import models
    except ImportError:
        return None
    return models.BPE(vocab=dict(encoder), merges=list(merges))


class GPT2BPETokenizer(MegatronTokenizer):
    """GPT-2 byte-level BPE from ``vocab.json`` + ``merges.txt``.

    Args:
        vocab_file: GPT-2 ``vocab.json`` (must contain ``<|endoftext|>``).
        merge_file: GPT-2 ``merges.txt``.
        use_fast: None (default) = the cached fast path, merging new words with the Rust BPE
            when it is installed and agrees with the reference (else in Python); True = the same
            but raise if Rust is unavailable; False = the plain reference (slow, for checks).
    """

    def __init__(self, vocab_file: str, merge_file: str, use_fast: Optional[bool] = None):
        super().__init__(vocab_file, merge_file)
        encoder, merges = load_gpt2_files(vocab_file, merge_file)
        if EOD_TOKEN not in encoder:
            raise ValueError(f"{vocab_file}: GPT-2 vocab has no '{EOD_TOKEN}' entry (the EOD token)")
        self._encoder = encoder
        self._decoder = {i: t for t, i in encoder.items()}
        self._eod_id = encoder[EOD_TOKEN]
        self._reference = _ByteLevelBPE(encoder, merges)
        self._byte_decoder = {c: b for b, c in self._reference.byte_encoder.items()}
        self._piece_cache: Dict[str, List[int]] = {}
        self._ascii_pattern = re.compile(GPT2_SPLIT_PATTERN_ASCII, re.ASCII)
        self._rust_bpe = None
        if use_fast is not False:
            rust_bpe = _build_rust_bpe(encoder, merges)
            if rust_bpe is not None and self._rust_agrees(rust_bpe):
                self._rust_bpe = rust_bpe
            elif use_fast:
                raise ValueError(f"the Rust 'tokenizers' BPE is unavailable or disagrees with the GPT-2 "
                                 f"reference for {vocab_file}; use use_fast=False")
        self._use_fast = use_fast is not False

    def _rust_agrees(self, rust_bpe) -> bool:
        byte_encoder = self._reference.byte_encoder
        probe = _PROBE_TEXT + " ".join(list(self._encoder)[:: max(1, len(self._encoder) // 64)])
        for piece in self._reference.pattern.findall(probe):
            word = "".join(byte_encoder[b] for b in piece.encode("utf-8"))
            if [t.id for t in rust_bpe.tokenize(word)] != [self._encoder[t] for t in self._reference._merge(word)]:
                return False
        return True

    @property
    def uses_rust(self) -> bool:
        """Whether new words are merged by the Rust BPE model (same ids as the Python reference)."""
        return self._rust_bpe is not None

    def _piece_ids(self, piece: str) -> List[int]:
        word = "".join(self._reference.byte_encoder[b] for b in piece.encode("utf-8"))
        if self._rust_bpe is not None:
            ids = [t.id for t in self._rust_bpe.tokenize(word)]
        else:
            ids = [self._encoder[t] for t in self._reference._merge(word)]
        if len(self._piece_cache) >= _ByteLevelBPE._CACHE_LIMIT:
            self._piece_cache.clear()
        self._piece_cache[piece] = ids
        return ids

    def tokenize(self, text: str) -> List[int]:
        if not self._use_fast:
            return self._reference.encode(text)
        pattern = self._ascii_pattern if text.isascii() else self._reference.pattern
        pieces = pattern.findall(text)
        cache = self._piece_cache
        try:
            parts = [cache[piece] for piece in pieces]
        except KeyError:
            # Every piece has at least one id, so an empty list never stands for a miss.
            get, miss = cache.get, self._piece_ids
            parts = [get(piece) or miss(piece) for piece in pieces]
        return list(chain.from_iterable(parts))

    def detokenize(self, ids: List[int]) -> str:
        byte_decoder, decoder = self._byte_decoder, self._decoder
        data = bytearray(byte_decoder[c] for i in ids for c in decoder[int(i)])
        return data.decode("utf-8", errors="replace")

    @property
    def vocab(self) -> Dict[str, int]:
        return self._encoder

    @property
    def inv_vocab(self) -> Dict[int, str]:
        return self._decoder

    @property
    def vocab_size(self) -> int:
        return len(self._encoder)

    @property
    def eod(self) -> int:
        return self._eod_id

    # GPT-2 uses one token for all of these; it has no pad token (``pad`` raises, and the GPT
    # dataset then pads with -1 and masks those positions out of the loss).
    @property
    def eos(self) -> int:
        return self._eod_id

    @property
    def bos(self) -> int:
        return self._eod_id
