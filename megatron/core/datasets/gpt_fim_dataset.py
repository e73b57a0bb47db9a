"""Fill-in-the-middle GPT samples (``--fim-data``), as Megatron-LM's ``GPTFIMDataset`` defines them
(Bavarian et al. 2022, "Efficient Training of Language Models to Fill in the Middle").

A sample of ``sequence_length + 1`` tokens is cut at every EOD token (``--fim-eod-token``) into
segments; each non-empty segment is transformed on its own and the EODs are put back between them:

- with probability ``fim_rate`` the segment is detokenized, two character positions are drawn
  uniformly from ``[0, len(text)]`` and sorted, and the text is cut into prefix / middle /
  suffix, each tokenized again; otherwise the segment is kept as it is;
- a FIM segment whose text starts with ``--fim-no-prefix`` is kept as it is;
- with probability ``fim_spm_rate`` the layout is SPM, ``<pre> <suf> suffix <mid> prefix middle``,
  else PSM, ``<pre> prefix <suf> suffix <mid> middle``.

With ``--fim-split-sample TOKEN`` a segment holding that token is, with probability ``fim_rate``,
cut at it into fragments, each transformed as above at ``--fim-fragment-rate`` (the split tokens
are kept between the fragments); a segment without the token is transformed as a whole. The
result is cut to the sample's length, or padded with ``--fim-pad-token``.

One deliberate difference from Megatron-LM: Megatron draws every sample from one random stream
per dataset, so a sample depends on which samples the same process read before it (on the number
of data-loader workers and DP ranks). Here each sample draws from its own stream, seeded by
``random_seed``, the split and the sample's index: the same seed gives the same samples whatever
the workers, ranks or order of reads. The draws within a sample are Megatron's, in its order
(``binomial`` for each rate, ``randint(0, len + 1, size=2)`` for the cut points).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.utils import log_single_rank

logger = logging.getLogger(__name__)

FIM_TOKEN_FLAGS = {
    "prefix": "--fim-prefix-token",
    "middle": "--fim-middle-token",
    "suffix": "--fim-suffix-token",
    "pad": "--fim-pad-token",
    "eod": "--fim-eod-token",
}


@dataclass
class GPTFIMDatasetConfig(GPTDatasetConfig):
    """GPTDatasetConfig plus the FIM options (Megatron's field names)."""

    fim_rate: float = None
    """Probability that a segment (or, with a split token, a sample) is FIM-transformed."""

    fim_spm_rate: float = None
    """Probability that a transformed segment uses the SPM layout rather than PSM."""

    fim_extra_tokens: Dict[str, str] = None
    """The prefix, middle, suffix, pad and eod token strings."""

    fim_split_sample: Optional[str] = None
    """Token at which a segment is cut into fragments transformed one by one."""

    fim_fragment_rate: Optional[float] = None
    """Probability of FIM for each fragment (with ``fim_split_sample``)."""

    fim_no_prefix: Optional[str] = None
    """Segments whose text starts with this string are never transformed."""


def _unknown_id(tokenizer: Any, vocab: Dict[str, int]) -> Optional[int]:
    """The id Megatron-LM's (Hugging Face based) tokenizers give a token missing from their
    vocabulary: the unknown token's; GPT-2's unknown token is ``<|endoftext|>``."""
    inner = getattr(tokenizer, "tokenizer", None)
    unk = getattr(inner, "unk_token_id", None)
    if isinstance(unk, (int, np.integer)):
        return int(unk)
    return vocab.get("<|endoftext|>")


def token_id(tokenizer: Any, token: str, flag: str) -> int:
    """The id of one special token: from the tokenizer's string vocabulary (a token missing from
    it maps to the unknown token, as in Megatron-LM: with GPT-2's vocabulary the default FIM
    tokens all become ``<|endoftext|>``), or, for a tokenizer without one (NullTokenizer: the
    token is its id written out), by tokenizing it."""
    try:
        vocab = tokenizer.vocab
    except NotImplementedError:
        vocab = None
    if vocab is not None:
        if token in vocab:
            return int(vocab[token])
        unk = _unknown_id(tokenizer, vocab)
        if unk is None:
            raise ValueError(f"{flag} {token!r} is not a token of the tokenizer's vocabulary")
        log_single_rank(
            logger,
            logging.WARNING,
            f"{flag} {token!r} is not in the tokenizer's vocabulary: it is the unknown token "
            f"(id {unk}), as in Megatron-LM",
        )
        return unk
    try:
        ids = tokenizer.tokenize(token)
    except ValueError as exc:
        raise ValueError(f"{flag} {token!r}: {exc}") from None
    if len(ids) != 1:
        raise ValueError(f"{flag} {token!r} is {len(ids)} tokens, not one")
    return int(ids[0])


class FimTransform:
    """The FIM rewrite of one sample's tokens (see the module docstring), drawing from ``rng``.

    ``detokenize`` / ``tokenize``: the tokenizer's text conversions. ``ids``: the token ids of
    ``prefix``, ``middle``, ``suffix``, ``pad``, ``eod`` and (optional) ``split``."""

    def __init__(
        self,
        *,
        rate: float,
        spm_rate: float,
        ids: Dict[str, Optional[int]],
        detokenize: Callable[[List[int]], str],
        tokenize: Callable[[str], List[int]],
        fragment_rate: Optional[float] = None,
        no_prefix: Optional[str] = None,
    ):
        self.rate = rate
        self.spm_rate = spm_rate
        self.fragment_rate = fragment_rate
        self.no_prefix = no_prefix
        self.ids = ids
        self.detokenize = detokenize
        self.tokenize = tokenize

    def __call__(self, sample: np.ndarray, rng: np.random.RandomState) -> np.ndarray:
        """The rewritten sample, cut or padded (with the FIM pad token) to ``len(sample)``."""
        eod = self.ids["eod"]
        pieces: List[np.ndarray] = []
        start = 0
        for end in np.flatnonzero(sample == eod):
            if end > start:  # empty segments (EOD right after EOD) are dropped with their EOD
                pieces += [self._segment(sample[start:end], rng), np.array([eod], np.int64)]
            start = end + 1
        pieces.append(self._segment(sample[start:], rng))
        out = np.concatenate(pieces).astype(np.int64, copy=False)
        if len(out) >= len(sample):
            return out[: len(sample)]
        return np.concatenate([out, np.full(len(sample) - len(out), self.ids["pad"], np.int64)])

    def _segment(self, segment: np.ndarray, rng: np.random.RandomState) -> np.ndarray:
        split = self.ids.get("split")
        if split is None:
            return self._permute(segment, self.rate, rng)
        breaks = np.flatnonzero(segment == split)
        if len(breaks) == 0:
            return self._permute(segment, self.rate, rng)
        if not rng.binomial(1, self.rate):
            return segment
        pieces: List[np.ndarray] = []
        start = 0
        for end in breaks:
            if end > start:
                pieces += [
                    self._permute(segment[start:end], self.fragment_rate, rng),
                    np.array([split], np.int64),
                ]
            start = end + 1
        pieces.append(self._permute(segment[start:], self.fragment_rate, rng))
        return np.concatenate(pieces)

    def _permute(self, tokens: np.ndarray, rate: float, rng: np.random.RandomState) -> np.ndarray:
        if not rng.binomial(1, rate):
            return tokens
        text = self.detokenize(tokens.tolist())
        if self.no_prefix is not None and text.startswith(self.no_prefix):
            return tokens
        low, high = sorted(rng.randint(low=0, high=len(text) + 1, size=2))
        prefix, middle, suffix = (
            np.array(self.tokenize(part), dtype=np.int64)
            for part in (text[:low], text[low:high], text[high:])
        )
        pre, mid, suf = self.ids["prefix"], self.ids["middle"], self.ids["suffix"]
        if rng.binomial(1, self.spm_rate):
            parts = [[pre, suf], suffix, [mid], prefix, middle]
        else:
            parts = [[pre], prefix, [suf], suffix, [mid], middle]
        return np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])


class GPTFIMDataset(GPTDataset):
    """GPTDataset whose samples are FIM-rewritten (``--fim-data``); the sample order, masks and
    labels are GPTDataset's."""

    def __init__(
        self,
        indexed_dataset: Any,
        dataset_path: Optional[str],
        indexed_indices: np.ndarray,
        num_samples: Optional[int],
        index_split: Any,
        config: GPTFIMDatasetConfig,
    ) -> None:
        super().__init__(
            indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config
        )
        tokenizer = config.tokenizer
        extra = config.fim_extra_tokens or {}
        ids = {
            name: token_id(tokenizer, extra.get(name), flag)
            for name, flag in FIM_TOKEN_FLAGS.items()
        }
        ids["split"] = (
            token_id(tokenizer, config.fim_split_sample, "--fim-split-sample")
            if config.fim_split_sample
            else None
        )
        self.fim = FimTransform(
            rate=config.fim_rate,
            spm_rate=config.fim_spm_rate,
            fragment_rate=config.fim_fragment_rate,
            no_prefix=config.fim_no_prefix,
            ids=ids,
            detokenize=tokenizer.detokenize,
            tokenize=tokenizer.tokenize,
        )

    def sample_rng(self, idx: int) -> np.random.RandomState:
        """The random stream of sample ``idx`` of this split (see the module docstring)."""
        seed = int(self.config.random_seed) & 0xFFFFFFFF
        return np.random.RandomState([seed, int(self.index_split.value), int(idx)])

    def _query_document_sample_shuffle_indices(self, idx: int) -> Tuple[np.ndarray, np.ndarray]:
        text, document_ids = self._read_sample(idx)
        text = self.fim(text, self.sample_rng(idx))
        want = self.config.sequence_length + self._extra
        if len(text) < want:  # the last partial validation sample: loss-masked padding
            text = np.concatenate([text, np.full(want - len(text), self._pad_token_id, np.int64)])
        return text, document_ids
