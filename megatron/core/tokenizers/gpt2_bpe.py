"""GPT-2 byte-level BPE (``--tokenizer-type GPT2BPETokenizer``, ``--vocab-file`` +
``--merge-file``).

The files are the GPT-2 ones: ``vocab.json`` maps byte-level token strings to ids, ``merges.txt``
lists merge rules in priority order (an optional ``#version`` first line). EOD is
``<|endoftext|>``.

Two implementations give the same ids:

* ``_ByteLevelBPE`` - a plain-Python implementation of the GPT-2 algorithm (pre-split the text
  with the GPT-2 regex, map UTF-8 bytes to printable characters, repeatedly merge the
  lowest-ranked adjacent pair). It is the reference.
* the fast path used by ``tokenize`` and ``tokenize_batch_packed``: the text is cut into
  *chunks* - one optional whitespace character followed by a run of non-whitespace, or a run of
  whitespace - by a pattern with a single character class that the stdlib ``re`` engine runs
  about twice as fast as the GPT-2 pattern. Every chunk boundary is also a boundary of the
  GPT-2 split (a GPT-2 piece never extends from non-whitespace into whitespace, and a
  whitespace piece always leaves the last whitespace character before a non-whitespace
  character to the next piece), and the GPT-2 split of a chunk depends on the chunk alone, so
  the concatenated splits of the chunks are the split of the text. A cache maps each chunk
  straight to its ids, stored as bytes of the id dtype, so a chunk seen before costs one dict
  lookup and a text's ids are one ``bytes.join`` (no Python int per id). A new chunk is split
  with the GPT-2 regex (for pure-ASCII text an equivalent ASCII pattern on the faster stdlib
  engine) and each piece is merged by the Rust ``tokenizers`` BPE model when it is installed
  and agrees with the reference on a probe text at load time, else by the reference merge loop
  (pieces have their own cache). The Rust library's own full pipeline is not used: its
  byte-level pre-tokenizer (with its offset tracking) costs more than the BPE itself and made
  it several times slower than this path on the shipped corpus.

The text ``<|endoftext|>`` inside a document is ordinary text (it is split into ``<|``,
``endoftext``, ``|>``), which is how Megatron's classic GPT-2 tokenizer treats it too; only
``--append-eod`` puts the EOD id into data.
A document quoting that string therefore can not forge a document boundary.
"""

import json
import re
from array import array
from typing import Dict, Iterable, List, Optional, Tuple

import numpy as np
import regex

from .base import MegatronTokenizer, cast_ids

EOD_TOKEN = "<|endoftext|>"

# GPT-2's pre-tokenizer: English contractions, letter runs, digit runs, other-symbol runs (each
# with one optional leading space), then whitespace (keeping the last space for the next word).
GPT2_SPLIT_PATTERN = (
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)
# The same split for pure-ASCII text, where \p{L} is [A-Za-z], \p{N} is [0-9] and both engines'
# \s is [\t\n\v\f\r ]; the stdlib engine runs it ~2.5x faster than the unicode pattern.
GPT2_SPLIT_PATTERN_ASCII = (
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+"""
)
# The whitespace of GPT2_SPLIT_PATTERN's \s (the `regex` module's White_Space set), spelled out for
# the stdlib engine, whose unicode \s also matches \x1c-\x1f; a test checks it code point by code
# point.
GPT2_WHITESPACE_CLASS = r"\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
# Chunks whose boundaries are boundaries of the GPT-2 split (see the module docstring): optional
# whitespace + non-whitespace run, else a whitespace run that leaves its last character to the
# next chunk when a non-whitespace character follows, else the whole whitespace run.
GPT2_CHUNK_PATTERN = (
    rf"[{GPT2_WHITESPACE_CLASS}]?[^{GPT2_WHITESPACE_CLASS}]+"
    rf"|[{GPT2_WHITESPACE_CLASS}]+(?![^{GPT2_WHITESPACE_CLASS}])|[{GPT2_WHITESPACE_CLASS}]+"
)

# Text on which the Rust engine must agree with the reference before it is trusted: contractions,
# runs of spaces, unicode whitespace, digits, CJK, emoji, combining marks, a lone surrogate-free
# private-use char, control chars and the EOD string as plain text.
_PROBE_TEXT = (
    "Hello world! It's what they'll've said: don't   stop.\n\n"
    "\tTabs\u00a0nbsp\u2003em\u2028ls\u3000ideo "
    "12345 3.14159 x=y+z; <|endoftext|> caf\u00e9 e\u0301 \u4e2d\u6587\u5b57 "
    "\U0001f600\U0001f44d\U0001f3fd "
    "\u0394\u03b5\u03bb\u03c4\u03b1 \u0645\u0631\u062d\u0628\u0627 "
    "\ue000\x00\x07\x7f trailing   \n  \r\n"
)


def bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters.

    Bytes that are already printable (and not space) map to themselves; the other 68 are
    shifted to code points 256, 257, ... in byte order, so no token string contains whitespace
    or control characters.
    """
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\u00a1"), ord("\u00ac") + 1))
        + list(range(ord("\u00ae"), ord("\u00ff") + 1))
    )
    table = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shift)
            shift += 1
    return table


def load_gpt2_files(
    vocab_file: str, merge_file: str
) -> Tuple[Dict[str, int], List[Tuple[str, str]]]:
    """Read and check a GPT-2 ``vocab.json`` / ``merges.txt`` pair; errors name the file and
    line."""
    try:
        with open(vocab_file, encoding="utf-8") as f:
            encoder = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{vocab_file}: not a GPT-2 vocab.json ({e})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{vocab_file}: not a GPT-2 vocab.json ({not_text(e)})") from None
    if not isinstance(encoder, dict) or not all(isinstance(v, int) for v in encoder.values()):
        raise ValueError(
            f"{vocab_file}: not a GPT-2 vocab.json (expected an object of token -> integer id)"
        )
    try:
        return encoder, _read_merges(merge_file, encoder, vocab_file)
    except UnicodeDecodeError as e:
        raise ValueError(f"{merge_file}: not a GPT-2 merges.txt ({not_text(e)})") from None


def not_text(error: UnicodeDecodeError) -> str:
    return f"not UTF-8 text: byte 0x{error.object[error.start]:02x} at offset {error.start}"


def _clip(text: str, limit: int = 60) -> str:
    """A line quoted in an error, cut: a wrong file can hold one line of megabytes."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"


def _read_merges(merge_file: str, encoder: Dict[str, int], vocab_file: str):
    merges = []
    with open(merge_file, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\r\n")
            if not line.strip() or (lineno == 1 and line.startswith("#version")):
                continue
            parts = line.split(" ")
            if len(parts) != 2 or not parts[0] or not parts[1]:
                raise ValueError(
                    f"{merge_file}:{lineno}: not a GPT-2 merges.txt: expected two "
                    f"space-separated tokens, got {_clip(line)}"
                )
            a, b = parts
            for token in (a, b, a + b):
                if token not in encoder:
                    raise ValueError(
                        f"{merge_file}:{lineno}: token {_clip(token)} of merge {_clip(line)} "
                        f"is not in {vocab_file}"
                    )
            merges.append((a, b))
    return merges


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

    # About 70 MB at the limit; a text corpus has far more distinct chunks than pieces.
    _CHUNK_CACHE_LIMIT = 1 << 19

    def __init__(self, vocab_file: str, merge_file: str, use_fast: Optional[bool] = None):
        super().__init__(vocab_file, merge_file)
        encoder, merges = load_gpt2_files(vocab_file, merge_file)
        if EOD_TOKEN not in encoder:
            raise ValueError(
                f"{vocab_file}: GPT-2 vocab has no '{EOD_TOKEN}' entry (the EOD token)"
            )
        self._encoder = encoder
        self._decoder = {i: t for t, i in encoder.items()}
        # GPT-2 uses one token for all of these; it has no pad token (``pad`` raises, and the GPT
        # dataset then pads with -1 and masks those positions out of the loss).
        self._special_ids = dict.fromkeys(("eod", "eos", "bos"), encoder[EOD_TOKEN])
        self._reference = _ByteLevelBPE(encoder, merges)
        self._byte_decoder = {c: b for b, c in self._reference.byte_encoder.items()}
        # Ids are cached as bytes of the smallest dtype that holds every id of the vocab.
        self._ids_dtype = np.dtype(
            np.uint16 if max(encoder.values()) <= np.iinfo(np.uint16).max else np.int32
        )
        self._ids_typecode = (
            "H" if self._ids_dtype == np.uint16 else "i"
        )  # the same, for array.array
        self._byte_table = "".join(self._reference.byte_encoder[b] for b in range(256))
        self._piece_cache: Dict[str, bytes] = {}
        self._chunk_cache: Dict[str, bytes] = {}
        self._chunk_pattern = re.compile(GPT2_CHUNK_PATTERN)
        self._ascii_pattern = re.compile(GPT2_SPLIT_PATTERN_ASCII, re.ASCII)
        self._rust_bpe = None
        if use_fast is not False:
            rust_bpe = _build_rust_bpe(encoder, merges)
            if rust_bpe is not None and self._rust_agrees(rust_bpe):
                self._rust_bpe = rust_bpe
            elif use_fast:
                raise ValueError(
                    f"the Rust 'tokenizers' BPE is unavailable or disagrees with the GPT-2 "
                    f"reference for {vocab_file}; use use_fast=False"
                )
        self._use_fast = use_fast is not False

    def _rust_agrees(self, rust_bpe) -> bool:
        byte_encoder = self._reference.byte_encoder
        probe = _PROBE_TEXT + " ".join(list(self._encoder)[:: max(1, len(self._encoder) // 64)])
        for piece in self._reference.pattern.findall(probe):
            word = "".join(byte_encoder[b] for b in piece.encode("utf-8"))
            if [t.id for t in rust_bpe.tokenize(word)] != [
                self._encoder[t] for t in self._reference._merge(word)
            ]:
                return False
        return True

    @property
    def uses_rust(self) -> bool:
        """Whether new words are merged by the Rust BPE model (same ids as the Python reference)."""
        return self._rust_bpe is not None

    def _piece_ids(self, piece: str) -> bytes:
        # bytes -> GPT-2's printable characters: latin-1 keeps byte values as code points.
        word = piece.encode("utf-8").decode("latin-1").translate(self._byte_table)
        if self._rust_bpe is not None:
            ids = [t.id for t in self._rust_bpe.tokenize(word)]
        else:
            ids = [self._encoder[t] for t in self._reference._merge(word)]
        data = array(self._ids_typecode, ids).tobytes()
        if len(self._piece_cache) >= _ByteLevelBPE._CACHE_LIMIT:
            self._piece_cache.clear()
        self._piece_cache[piece] = data
        return data

    def _chunk_ids(self, chunk: str) -> bytes:
        pattern = self._ascii_pattern if chunk.isascii() else self._reference.pattern
        get, miss = self._piece_cache.get, self._piece_ids
        # Every piece has at least one id, so empty bytes never stand for a miss.
        data = b"".join([get(piece) or miss(piece) for piece in pattern.findall(chunk)])
        if len(self._chunk_cache) >= self._CHUNK_CACHE_LIMIT:
            self._chunk_cache.clear()  # bounded memory; the piece cache keeps refills cheap
        self._chunk_cache[chunk] = data
        return data

    def _encode_bytes(self, texts: Iterable[str]) -> List[bytes]:
        """Each text's ids as bytes of ``self._ids_dtype``."""
        findall, cache = self._chunk_pattern.findall, self._chunk_cache
        lookup, join = cache.__getitem__, b"".join
        out = []
        for text in texts:
            chunks = findall(text)
            try:
                out.append(join(map(lookup, chunks)))
            except KeyError:
                get, miss = cache.get, self._chunk_ids
                out.append(join([get(chunk) or miss(chunk) for chunk in chunks]))
        return out

    def tokenize(self, text: str) -> List[int]:
        if not self._use_fast:
            return self._reference.encode(text)
        return np.frombuffer(self._encode_bytes((text,))[0], dtype=self._ids_dtype).tolist()

    def tokenize_batch(self, texts: Iterable[str]) -> List[List[int]]:
        if not self._use_fast:
            return [self._reference.encode(t) for t in texts]
        dtype = self._ids_dtype
        return [np.frombuffer(data, dtype=dtype).tolist() for data in self._encode_bytes(texts)]

    def tokenize_batch_packed(
        self, texts: Iterable[str], dtype=np.int64
    ) -> Tuple[np.ndarray, np.ndarray]:
        if not self._use_fast:
            return super().tokenize_batch_packed(texts, dtype)
        encoded = self._encode_bytes(texts)
        itemsize = self._ids_dtype.itemsize
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded)) // itemsize
        ids = np.frombuffer(b"".join(encoded), dtype=self._ids_dtype)
        return cast_ids(ids, dtype, type(self).__name__), lengths

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
