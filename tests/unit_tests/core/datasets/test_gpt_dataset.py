"""GPTDataset indices and samples against a slow, straightforward reference of Megatron's
index algorithms."""

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron.core.datasets.gpt_dataset import (
    GPTDataset,
    GPTDatasetConfig,
    MockGPTDataset,
    MockGPTLowLevelDataset,
)
from megatron.core.datasets.index_helpers import build_sample_index
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron.core.datasets.utils import Split

EOD = 0


def tokenizer(pad=None, vocab_size=1000):
    return SimpleNamespace(
        eod=EOD, pad=pad, vocab_size=vocab_size, unique_identifiers={"class": "TestTokenizer"}
    )


def write_dataset(prefix, lengths, seed=0):
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for n in lengths:
        doc = rng.integers(1, 1000, size=n)
        if n:
            doc[-1] = EOD
            builder.add_document(doc, [n])
        else:  # a zero-length sequence (add_document with no lengths would add none)
            builder.add_item(doc)
            builder.end_document()
    builder.finalize(prefix + ".idx")
    return IndexedDataset(prefix)


# --- reference (loops, exactly as the facts describe the algorithm) ----------------------------


def reference_indices(lengths, documents, num_samples, seq_len, seed, extra=1, drop_last=True):
    tpe = sum(int(lengths[d]) for d in documents)
    epochs = 1
    if num_samples is not None:
        while epochs * tpe < num_samples * seq_len + extra:
            epochs += 1
    separate = False
    sans_final = None
    if epochs > 1:
        sans_final = ((epochs - 1) * tpe - extra) // seq_len
        from_final = num_samples - sans_final
        per_epoch = (tpe - extra) // seq_len
        separate = from_final < int(0.80 * per_epoch)

    rs = np.random.RandomState(seed)
    if separate:
        first = np.array(list(documents) * (epochs - 1), dtype=np.int32)
        rs.shuffle(first)
        last = np.array(list(documents), dtype=np.int32)
        rs.shuffle(last)
        doc_index = np.concatenate([first, last])
    else:
        doc_index = np.array(list(documents) * epochs, dtype=np.int32)
        rs.shuffle(doc_index)

    total = epochs * tpe - extra
    n = total // seq_len if drop_last else -(-total // seq_len)
    sample_index = [(0, 0)]
    pos, offset = 0, 0
    while len(sample_index) <= n:
        remaining = seq_len + extra
        while remaining != 0:
            doc_len = int(lengths[doc_index[pos]]) - offset
            remaining -= doc_len
            if remaining <= 0:
                offset += remaining + doc_len - extra
                remaining = 0
            else:
                if pos == len(doc_index) - 1:
                    offset = int(lengths[doc_index[pos]]) - extra
                    break
                pos += 1
                offset = 0
        sample_index.append((pos, offset))
    sample_index = np.array(sample_index)

    if separate:
        a = np.arange(sans_final, dtype=np.uint32)
        rs.shuffle(a)
        b = np.arange(sans_final, n, dtype=np.uint32)
        rs.shuffle(b)
        shuffle = np.concatenate([a, b])
    else:
        shuffle = np.arange(n, dtype=np.uint32)
        rs.shuffle(shuffle)
    return doc_index, sample_index, shuffle, epochs, separate


_streams = {}


def reference_text(ds, doc_index, shuffle, i, seq_len, extra=1, pad=-1):
    """Sample i = seq_len + extra tokens starting at global token i*seq_len of the epoch stream."""
    key = (id(ds), doc_index.tobytes())
    if key not in _streams:
        _streams.clear()
        _streams[key] = np.concatenate([ds[int(d)].astype(np.int64) for d in doc_index])
    stream = _streams[key]
    j = int(shuffle[i])
    text = stream[j * seq_len : j * seq_len + seq_len + extra]
    return np.concatenate([text, np.full(seq_len + extra - len(text), pad, dtype=np.int64)])


def make_config(tmp_path, seq_len=10, seed=1234, **kw):
    kw.setdefault("tokenizer", tokenizer())
    return GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_len,
        blend=([str(tmp_path / "d")], None),
        split="1",
        path_to_cache=str(tmp_path / "cache"),
        **kw,
    )


LENGTHS = [37, 5, 120, 1, 64, 0, 33, 250, 8, 2, 99, 17, 40, 3, 71]  # 750 tokens, one empty doc


@pytest.mark.parametrize(
    "num_samples, seq_len, expect_epochs, expect_separate",
    [
        (None, 10, 1, False),  # one epoch
        (30, 10, 1, False),
        (140, 10, 2, False),  # final epoch large enough to be shuffled with the others
        (90, 10, 2, True),  # small final epoch shuffled separately
        (400, 7, 4, False),
        (200, 16, 5, True),
    ],
)
def test_indices_and_tokens_match_reference(
    tmp_path, num_samples, seq_len, expect_epochs, expect_separate
):
    ds = write_dataset(str(tmp_path / "d"), LENGTHS)
    documents = np.arange(2, len(LENGTHS), dtype=np.int32)  # a split that skips the first sequences
    config = make_config(tmp_path, seq_len=seq_len)
    gpt = GPTDataset(ds, str(tmp_path / "d"), documents, num_samples, Split.train, config)

    doc_index, sample_index, shuffle, epochs, separate = reference_indices(
        ds.sequence_lengths, documents, num_samples, seq_len, 1234
    )
    assert (epochs, separate) == (expect_epochs, expect_separate)
    assert gpt.document_index.dtype == np.int32 and gpt.sample_index.dtype == np.int32
    assert gpt.shuffle_index.dtype == np.uint32
    np.testing.assert_array_equal(gpt.document_index, doc_index)
    np.testing.assert_array_equal(gpt.sample_index, sample_index)
    np.testing.assert_array_equal(gpt.shuffle_index, shuffle)
    assert len(gpt) == len(shuffle)
    if num_samples is not None:
        assert len(gpt) >= num_samples
    for i in range(len(gpt)):
        text = reference_text(ds, doc_index, shuffle, i, seq_len)
        sample = gpt[i]
        np.testing.assert_array_equal(sample["tokens"].numpy(), text[:-1])
        np.testing.assert_array_equal(sample["labels"].numpy(), text[1:])
        assert sample["tokens"].dtype == torch.int64 and sample["labels"].dtype == torch.int64
        assert sample["loss_mask"].dtype == torch.float32 and bool((sample["loss_mask"] == 1).all())
        np.testing.assert_array_equal(sample["position_ids"].numpy(), np.arange(seq_len))
        mask = sample["attention_mask"]
        assert mask.shape == (1, seq_len, seq_len) and mask.dtype == torch.bool
        assert torch.equal(mask[0], ~torch.ones(seq_len, seq_len, dtype=torch.bool).tril())


def test_sample_index_random_cases_match_reference():
    rng = np.random.default_rng(7)
    for case in range(40):
        num_docs = int(rng.integers(1, 30))
        lengths = rng.integers(0 if case % 3 == 0 else 1, 60, size=num_docs).astype(np.int32)
        if lengths.sum() < 3:
            lengths[0] = 3
        seq_len = int(rng.integers(1, 40))
        documents = np.arange(num_docs, dtype=np.int32)
        tpe = int(lengths.sum())
        extra = int(case % 4 != 0)
        drop_last = bool(case % 2)
        epochs = int(rng.integers(1, 4))
        doc_index = np.tile(documents, epochs)
        np.random.RandomState(case).shuffle(doc_index)
        fast = build_sample_index(lengths, doc_index, seq_len, epochs, tpe, drop_last, extra)
        # the reference walk with the same document index
        total = epochs * tpe - extra
        n = total // seq_len if drop_last else -(-total // seq_len)
        ref = [(0, 0)]
        pos, offset = 0, 0
        while len(ref) <= n:
            remaining = seq_len + extra
            while remaining != 0:
                doc_len = int(lengths[doc_index[pos]]) - offset
                remaining -= doc_len
                if remaining <= 0:
                    offset += remaining + doc_len - extra
                    remaining = 0
                else:
                    if pos == len(doc_index) - 1:
                        offset = int(lengths[doc_index[pos]]) - extra
                        break
                    pos += 1
                    offset = 0
            ref.append((pos, offset))
        np.testing.assert_array_equal(fast, np.array(ref).reshape(-1, 2), err_msg=f"case {case}")


def test_partial_validation_sequence_is_padded(tmp_path):
    ds = write_dataset(str(tmp_path / "d"), LENGTHS)
    documents = np.arange(len(LENGTHS), dtype=np.int32)
    config = make_config(tmp_path, seq_len=16, drop_last_partial_validation_sequence=False)
    gpt = GPTDataset(ds, str(tmp_path / "d"), documents, None, Split.valid, config)
    doc_index, sample_index, shuffle, _, _ = reference_indices(
        ds.sequence_lengths, documents, None, 16, 1234, drop_last=False
    )
    np.testing.assert_array_equal(gpt.sample_index, sample_index)
    assert len(gpt) == -(-(750 - 1) // 16)
    last = int(np.nonzero(np.asarray(gpt.shuffle_index) == len(gpt) - 1)[0][0])
    text = reference_text(ds, doc_index, shuffle, last, 16)
    n_pad = int((text == -1).sum())
    assert n_pad > 0
    sample = gpt[last]
    np.testing.assert_array_equal(sample["tokens"].numpy(), np.where(text[:-1] == -1, 0, text[:-1]))
    np.testing.assert_array_equal(sample["labels"].numpy(), np.where(text[1:] == -1, 0, text[1:]))
    np.testing.assert_array_equal(sample["loss_mask"].numpy(), (text[1:] != -1).astype(np.float32))
    # the same split with the default drops that sample
    config = make_config(tmp_path, seq_len=16)
    assert (
        len(GPTDataset(ds, str(tmp_path / "d"), documents, None, Split.valid, config))
        == (750 - 1) // 16
    )


def test_no_extra_token(tmp_path):
    ds = write_dataset(str(tmp_path / "d"), LENGTHS)
    documents = np.arange(len(LENGTHS), dtype=np.int32)
    config = make_config(tmp_path, seq_len=12, add_extra_token_to_sequence=False)
    gpt = GPTDataset(ds, str(tmp_path / "d"), documents, 100, Split.train, config)
    doc_index, sample_index, shuffle, _, _ = reference_indices(
        ds.sequence_lengths, documents, 100, 12, 1234, extra=0
    )
    np.testing.assert_array_equal(gpt.sample_index, sample_index)
    np.testing.assert_array_equal(gpt.shuffle_index, shuffle)
    for i in range(0, len(gpt), 7):
        text = reference_text(ds, doc_index, shuffle, i, 12, extra=0)
        sample = gpt[i]
        np.testing.assert_array_equal(sample["tokens"].numpy(), text)
        np.testing.assert_array_equal(sample["labels"].numpy()[:-1], text[1:])
        assert (
            sample["labels"][-1] == 0
            and sample["loss_mask"][-1] == 0
            and sample["loss_mask"][:-1].all()
        )


# --- masks and position ids ----------------------------------------------------------------------


def reference_masks(tokens, reset_position_ids, reset_attention_mask, eod_mask_loss):
    s = len(tokens)
    allowed = np.tril(np.ones((s, s), dtype=bool))
    loss = np.ones(s, dtype=np.float32)
    pos = np.arange(s)
    prev = 0
    for i in range(s):
        if tokens[i] != EOD:
            continue
        if eod_mask_loss:
            loss[i] = 0
        if reset_attention_mask:
            allowed[i + 1 :, : i + 1] = False
        if reset_position_ids:
            pos[i + 1 :] -= i + 1 - prev
            prev = i + 1
    return ~allowed[None], loss, pos


@pytest.mark.parametrize("reset_position_ids", [False, True])
@pytest.mark.parametrize("reset_attention_mask", [False, True])
@pytest.mark.parametrize("eod_mask_loss", [False, True])
def test_reset_and_eod_flags(tmp_path, reset_position_ids, reset_attention_mask, eod_mask_loss):
    ds = write_dataset(str(tmp_path / "d"), [5, 3, 9, 1, 12, 7, 4, 6, 2, 8])
    config = make_config(
        tmp_path,
        seq_len=16,
        reset_position_ids=reset_position_ids,
        reset_attention_mask=reset_attention_mask,
        eod_mask_loss=eod_mask_loss,
    )
    gpt = GPTDataset(
        ds, str(tmp_path / "d"), np.arange(10, dtype=np.int32), 20, Split.train, config
    )
    saw_eod = False
    for i in range(len(gpt)):
        sample = gpt[i]
        tokens = sample["tokens"].numpy()
        saw_eod |= bool((tokens == EOD).any())
        mask, loss, pos = reference_masks(
            tokens, reset_position_ids, reset_attention_mask, eod_mask_loss
        )
        np.testing.assert_array_equal(sample["attention_mask"].numpy(), mask)
        np.testing.assert_array_equal(sample["loss_mask"].numpy(), loss)
        np.testing.assert_array_equal(sample["position_ids"].numpy(), pos)
    assert saw_eod


def test_no_attention_mask_and_cached_masks_are_not_shared(tmp_path):
    ds = write_dataset(str(tmp_path / "d"), LENGTHS)
    documents = np.arange(len(LENGTHS), dtype=np.int32)
    gpt = GPTDataset(
        ds,
        str(tmp_path / "d"),
        documents,
        10,
        Split.train,
        make_config(tmp_path, create_attention_mask=False),
    )
    sample = gpt[0]
    assert "attention_mask" not in sample
    sample["loss_mask"].zero_()
    assert bool((gpt[1]["loss_mask"] == 1).all())
    padding = gpt[None]
    assert padding["tokens"].shape == (10,) and float(padding["loss_mask"].sum()) == 0.0


def test_pad_id(tmp_path):
    ds = write_dataset(str(tmp_path / "d"), LENGTHS)
    documents = np.arange(len(LENGTHS), dtype=np.int32)
    collide = GPTDataset(
        ds,
        str(tmp_path / "d"),
        documents,
        5,
        Split.train,
        make_config(tmp_path, tokenizer=tokenizer(pad=EOD)),
    )
    assert collide._pad_token_id == -1  # pad == eod would hide every EOD label
    own = GPTDataset(
        ds,
        str(tmp_path / "d"),
        documents,
        5,
        Split.train,
        make_config(tmp_path, tokenizer=tokenizer(pad=999)),
    )
    assert own._pad_token_id == 999


def test_cache_files_and_reuse(tmp_path):
    ds = write_dataset(str(tmp_path / "d"), LENGTHS)
    documents = np.arange(len(LENGTHS), dtype=np.int32)
    config = make_config(tmp_path)
    first = GPTDataset(ds, str(tmp_path / "d"), documents, 50, Split.train, config)
    assert first.built_anew_on_cache_miss
    names = sorted(os.listdir(tmp_path / "cache"))
    base = f"{first.unique_description_hash}-GPTDataset-train-"
    assert names == sorted(
        base + s
        for s in ["description.txt", "document_index.npy", "sample_index.npy", "shuffle_index.npy"]
    )
    assert open(tmp_path / "cache" / (base + "description.txt")).read() == first.unique_description
    second = GPTDataset(ds, str(tmp_path / "d"), documents, 50, Split.train, config)
    assert not second.built_anew_on_cache_miss
    assert isinstance(second.sample_index, np.memmap)
    for name in ["document_index", "sample_index", "shuffle_index"]:
        np.testing.assert_array_equal(getattr(first, name), getattr(second, name))
        assert getattr(first, name).dtype == getattr(second, name).dtype
    # a different seed is a different cache entry
    third = GPTDataset(
        ds, str(tmp_path / "d"), documents, 50, Split.train, make_config(tmp_path, seed=5)
    )
    assert (
        third.built_anew_on_cache_miss
        and third.unique_description_hash != first.unique_description_hash
    )


def test_default_cache_directory_is_under_the_prefix(tmp_path):
    ds = write_dataset(str(tmp_path / "d"), LENGTHS)
    config = GPTDatasetConfig(
        random_seed=1,
        sequence_length=8,
        blend=([str(tmp_path / "d")], None),
        split="1",
        tokenizer=tokenizer(),
    )
    GPTDataset(ds, str(tmp_path / "d"), np.arange(4, dtype=np.int32), 3, Split.train, config)
    assert len(os.listdir(tmp_path / "d" / "cache" / "GPTDataset_indices")) == 4


def test_empty_split_with_samples_requested_is_a_clear_error(tmp_path):
    ds = write_dataset(str(tmp_path / "d"), LENGTHS)
    with pytest.raises(ValueError, match="no tokens"):
        GPTDataset(
            ds,
            str(tmp_path / "d"),
            np.arange(0, dtype=np.int32),
            5,
            Split.test,
            make_config(tmp_path),
        )


# --- mock ----------------------------------------------------------------------------------------


def test_mock_low_level_dataset():
    tok = tokenizer(vocab_size=100)
    low = MockGPTLowLevelDataset(tok)
    expected = np.random.default_rng(0).integers(1, 4096, size=100000, dtype=np.int32)
    np.testing.assert_array_equal(low.sequence_lengths, expected)
    n = int(low.sequence_lengths[3])
    doc = low[3]
    assert len(doc) == n and doc[-1] == EOD
    np.testing.assert_array_equal(doc[:-1], (np.arange(n - 1) + 1) % 100)
    np.testing.assert_array_equal(low.get(3, 2, 5), doc[2:7])


def test_mock_gpt_dataset_deterministic():
    def build():
        config = GPTDatasetConfig(random_seed=3, sequence_length=32, tokenizer=tokenizer())
        assert config.mock and config.split == "1,1,1"
        low = MockGPTDataset.build_low_level_dataset(None, config)
        return MockGPTDataset(low, None, np.arange(1000, dtype=np.int32), 64, Split.train, config)

    a, b = build(), build()
    assert len(a) == 64
    for i in (0, 17, 63):
        sa, sb = a[i], b[i]
        assert sa["tokens"].shape == (32,) and sa["attention_mask"].shape == (1, 32, 32)
        for key in sa:
            assert torch.equal(sa[key], sb[key])
    with pytest.raises(IndexError, match="sample 64 out of range for a train split of 64"):
        a[64]
