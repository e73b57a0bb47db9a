"""Fill-in-the-middle samples (--fim-data) against their definition (Megatron-LM's GPTFIMDataset):
the exact rewrite of hand-made token sequences under scripted random draws, the PSM / SPM rates
over 2,000 samples, and a sample order independent of the order, process and worker that reads."""

import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron.core.datasets.gpt_fim_dataset import (
    FimTransform,
    GPTFIMDataset,
    GPTFIMDatasetConfig,
    token_id,
)
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron.core.datasets.utils import Split
from megatron.core.tokenizers.gpt2_bpe import GPT2BPETokenizer
from megatron.core.tokenizers.null_tokenizer import NullTokenizer

DATA = Path(__file__).resolve().parents[3] / "data"
SPECIALS = {"<eod>": 0, "<pre>": 30, "<mid>": 31, "<suf>": 32, "<pad>": 33, "|": 34}
EXTRA = {"prefix": "<pre>", "middle": "<mid>", "suffix": "<suf>", "pad": "<pad>", "eod": "<eod>"}
EOD, PRE, MID, SUF, PAD, BAR = (
    SPECIALS[k] for k in ("<eod>", "<pre>", "<mid>", "<suf>", "<pad>", "|")
)


class CharTokenizer:
    """One token per letter (a=1 .. z=26), '|' = 34, and the specials above: a character cut
    point is a token cut point, so the rewrite is exactly checkable."""

    def __init__(self):
        self.vocab = dict(SPECIALS)
        self.vocab.update({chr(ord("a") + i): i + 1 for i in range(26)})
        self.inv = {v: k for k, v in self.vocab.items()}
        self.eod = EOD
        self.pad = None
        self.vocab_size = 40
        self.unique_identifiers = {"class": "CharTokenizer"}

    def tokenize(self, text):
        return [self.vocab[c] for c in text]

    def detokenize(self, ids):
        return "".join(self.inv[int(i)] for i in ids)


def ids(text):
    return CharTokenizer().tokenize(text)


class ScriptedRng:
    """Returns scripted draws and records each call, to check which rate each draw uses."""

    def __init__(self, *draws):
        self.draws = list(draws)
        self.calls = []

    def binomial(self, n, p):
        self.calls.append(("binomial", p))
        return self.draws.pop(0)

    def randint(self, low, high, size):
        self.calls.append(("randint", low, high, size))
        return np.array(self.draws.pop(0))


def transform(**kw):
    tok = CharTokenizer()
    ids_ = {"prefix": PRE, "middle": MID, "suffix": SUF, "pad": PAD, "eod": EOD, "split": None}
    ids_["split"] = kw.pop("split", None)
    kw.setdefault("rate", 0.5)
    kw.setdefault("spm_rate", 0.25)
    return FimTransform(ids=ids_, detokenize=tok.detokenize, tokenize=tok.tokenize, **kw)


def run(fim, text_ids, *draws):
    rng = ScriptedRng(*draws)
    out = fim(np.array(text_ids, dtype=np.int64), rng)
    assert not rng.draws, "not every scripted draw was used"
    return out.tolist(), rng.calls


def test_psm_and_spm_layouts_and_truncation():
    sample = ids("abcdefghij")
    # FIM, cut points drawn unsorted (7, 3): prefix abc, middle defg, suffix hij; PSM.
    out, calls = run(transform(), sample, 1, [7, 3], 0)
    full = [PRE, *ids("abc"), SUF, *ids("hij"), MID, *ids("defg")]
    assert out == full[:10]  # three sentinels longer: cut to the sample's length
    assert calls == [("binomial", 0.5), ("randint", 0, 11, 2), ("binomial", 0.25)]
    out, _ = run(transform(), sample, 1, [7, 3], 1)  # SPM
    assert out == [PRE, SUF, *ids("hij"), MID, *ids("abc"), *ids("defg")][:10]
    out, calls = run(transform(), sample, 0)  # no FIM: no further draw
    assert out == sample and calls == [("binomial", 0.5)]
    # Cut points at both ends: empty prefix and suffix, the whole text is the middle.
    out, _ = run(transform(), sample, 1, [10, 0], 0)
    assert out == [PRE, SUF, MID, *ids("abcdefg")]


def test_each_eod_segment_is_rewritten_alone_and_short_results_are_padded():
    # Two segments and an empty one (EOD right after EOD, dropped with its EOD): the result is
    # one token short and padded with the FIM pad token.
    sample = ids("abc") + [EOD, EOD] + ids("defgh")
    out, calls = run(transform(), sample, 1, [1, 2], 0, 0)
    assert out == [PRE, *ids("a"), SUF, *ids("c"), MID, *ids("b"), EOD, *ids("def")]
    assert [c[0] for c in calls] == ["binomial", "randint", "binomial", "binomial"]
    out, _ = run(transform(), sample, 0, 0)
    assert out == ids("abc") + [EOD] + ids("defgh") + [PAD]
    # So is a leading EOD (its segment is empty), as in Megatron-LM.
    assert run(transform(), [EOD] + ids("ab"), 0)[0] == ids("ab") + [PAD]


def test_fragments_split_on_the_split_token_use_the_fragment_rate():
    fim = transform(split=BAR, fragment_rate=0.75)
    sample = ids("abc|de||fg")
    # The sample holds the split token: one draw at --fim-rate for the whole segment, then one
    # per non-empty fragment at --fim-fragment-rate; the split tokens stay between fragments.
    out, calls = run(fim, sample, 1, 1, [0, 2], 1, 0, 0)
    assert out == [PRE, SUF, *ids("c"), MID, *ids("ab"), BAR, *ids("de"), BAR][:10]
    assert calls == [
        ("binomial", 0.5),
        ("binomial", 0.75),
        ("randint", 0, 4, 2),
        ("binomial", 0.25),
        ("binomial", 0.75),
        ("binomial", 0.75),
    ]
    out, calls = run(fim, sample, 0)  # no FIM for this sample: fragments untouched
    assert out == sample and calls == [("binomial", 0.5)]
    # A segment without the split token is rewritten as a whole at --fim-rate.
    out, calls = run(fim, ids("abcd"), 1, [2, 2], 0)
    assert out == [PRE, *ids("ab"), SUF, *ids("cd"), MID][:4]
    assert calls[0] == ("binomial", 0.5)


def test_no_prefix_keeps_segments_that_start_with_it():
    fim = transform(no_prefix="ab")
    out, calls = run(fim, ids("abcdef"), 1)  # drawn for FIM, then kept: no cut points drawn
    assert out == ids("abcdef") and calls == [("binomial", 0.5)]
    out, _ = run(fim, ids("bacdef"), 1, [1, 1], 0)
    assert out == [PRE, *ids("b"), SUF, *ids("acdef")][:6]


def test_retokenization_can_change_the_length():
    # NullTokenizer text is the ids written out: a cut inside "12" makes two tokens of one.
    tok = NullTokenizer(100)
    fim = FimTransform(
        rate=1.0,
        spm_rate=0.0,
        ids={"prefix": 97, "middle": 98, "suffix": 99, "pad": 96, "eod": 100, "split": None},
        detokenize=tok.detokenize,
        tokenize=tok.tokenize,
    )
    out, _ = run(fim, [12, 34], 1, [1, 1], 0)  # "12 34" -> "1" | "" | "2 34"
    assert out == [97, 1]


def test_special_token_ids_and_their_errors():
    assert token_id(CharTokenizer(), "<mid>", "--fim-middle-token") == MID
    assert token_id(NullTokenizer(100), "42", "--fim-pad-token") == 42
    with pytest.raises(ValueError, match="--fim-prefix-token '<fim_prefix>' is not a token"):
        token_id(CharTokenizer(), "<fim_prefix>", "--fim-prefix-token")
    # A token missing from a vocabulary with an unknown token is that token (Megatron-LM's
    # Hugging Face tokenizers): GPT-2's is <|endoftext|>.
    gpt2 = GPT2BPETokenizer(str(DATA / "gpt2-vocab.json"), str(DATA / "gpt2-merges.txt"))
    eod = gpt2.vocab["<|endoftext|>"]
    assert token_id(gpt2, "<fim_prefix>", "--fim-prefix-token") == eod == gpt2.eod
    with pytest.raises(ValueError, match="--fim-eod-token '1 2' is 2 tokens, not one"):
        token_id(NullTokenizer(100), "1 2", "--fim-eod-token")
    with pytest.raises(ValueError, match="--fim-suffix-token '<x>': NullTokenizer expects"):
        token_id(NullTokenizer(100), "<x>", "--fim-suffix-token")


# --- the dataset ------------------------------------------------------------------------------


def letters_dataset(prefix, n_docs=60, length=100, seed=0):
    """Documents of letters only (no EOD), so every sample is one segment."""
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(n_docs):
        builder.add_document(rng.integers(1, 27, size=length), [length])
    builder.finalize(prefix + ".idx")
    return IndexedDataset(prefix)


def fim_dataset(tmp_path, num_samples, seq_len=32, seed=1234, rate=0.5, spm_rate=0.3):
    low = letters_dataset(str(tmp_path / "d"))
    config = GPTFIMDatasetConfig(
        random_seed=seed,
        sequence_length=seq_len,
        blend=([str(tmp_path / "d")], None),
        split="1",
        path_to_cache=str(tmp_path / "cache"),
        tokenizer=CharTokenizer(),
        fim_rate=rate,
        fim_spm_rate=spm_rate,
        fim_extra_tokens=EXTRA,
    )
    docs = np.arange(len(low.sequence_lengths), dtype=np.int32)
    return GPTFIMDataset(low, str(tmp_path / "d"), docs, num_samples, Split.train, config)


def within_3_sigma(count, n, p):
    return abs(count - n * p) <= 3 * math.sqrt(n * p * (1 - p))


def test_fim_and_spm_rates_over_2000_samples(tmp_path):
    n, seq_len, rate, spm_rate = 2000, 32, 0.5, 0.3
    ds = fim_dataset(tmp_path, n, seq_len=seq_len, rate=rate, spm_rate=spm_rate)
    texts = np.stack([ds._query_document_sample_shuffle_indices(i)[0] for i in range(n)])
    fim = texts[:, 0] == PRE  # letters never equal a sentinel
    assert within_3_sigma(int(fim.sum()), n, rate), fim.sum()
    # SPM starts <pre> <suf>; so does PSM when its prefix is empty (then the two layouts are the
    # same sequence): P = spm + (1 - spm) * P(lower cut point = 0), with L = seq_len + 1 letters.
    length = seq_len + 1
    p_empty_prefix = 1 - (length / (length + 1)) ** 2
    p = spm_rate + (1 - spm_rate) * p_empty_prefix
    starts_pre_suf = int((texts[fim, 1] == SUF).sum())
    assert within_3_sigma(starts_pre_suf, int(fim.sum()), p), (starts_pre_suf, fim.sum(), p)
    # A kept sample is the stored one; a rewritten one holds the stored letters (those cut off at
    # the end excepted) and one of each sentinel that fits.
    for i in range(50):
        original, text = ds._read_sample(i)[0], texts[i]
        if text[0] != PRE:
            np.testing.assert_array_equal(text, original)
            continue
        letters = Counter(t for t in text.tolist() if t < PRE)
        assert not letters - Counter(original.tolist()), i
        sentinels = [t for t in text.tolist() if t >= PRE]
        assert len(sentinels) == len(text) - sum(letters.values()) and len(set(sentinels)) == len(
            sentinels
        )


def test_samples_do_not_depend_on_the_order_workers_or_process_that_reads(tmp_path):
    ds = fim_dataset(tmp_path, 64)
    first = [ds[i]["tokens"] for i in range(64)]
    # Another process reading only some indices, in another order (another DP rank).
    other = fim_dataset(tmp_path, 64)
    for i in reversed(range(1, 64, 3)):
        assert torch.equal(other[i]["tokens"], first[i]), i
    # Two data-loader workers, each reading every other batch.
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2)
    batches = torch.cat([batch["tokens"] for batch in loader])
    assert torch.equal(batches[:64], torch.stack(first))
    assert sum(int(t[0] == PRE) for t in first) not in (0, 64)  # the rewrite is exercised
    reseeded = fim_dataset(tmp_path, 64, seed=99)
    assert not all(torch.equal(reseeded[i]["tokens"], first[i]) for i in range(64))
