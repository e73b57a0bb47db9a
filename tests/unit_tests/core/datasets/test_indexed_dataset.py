"""IndexedDataset / IndexedDatasetBuilder: byte layout, round trips, corrupt input."""

import os
import pickle
import re
import struct

import numpy as np
import pytest
import torch

from megatron.core.datasets.indexed_dataset import (
    DType,
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexedDatasetError,
    get_bin_path,
    get_idx_path,
    optimal_dtype,
)

# Independent description of Megatron's .idx/.bin format (dtype codes, header and index
# layout), written from the format rather than from our implementation.
CODES = {
    np.uint8: 1,
    np.int8: 2,
    np.int16: 3,
    np.int32: 4,
    np.int64: 5,
    np.float64: 6,
    np.float32: 7,
    np.uint16: 8,
}


def reference_idx_bytes(documents, dtype):
    """documents: list of documents, each a list of sequences (lists of ints)."""
    lengths, doc_idx = [], [0]
    for doc in documents:
        lengths.extend(len(s) for s in doc)
        doc_idx.append(len(lengths))
    pointers, pos = [], 0
    for n in lengths:
        pointers.append(pos)
        pos += n * np.dtype(dtype).itemsize
    out = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", CODES[dtype])
    out += struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(doc_idx))
    out += b"".join(struct.pack("<i", n) for n in lengths)
    out += b"".join(struct.pack("<q", p) for p in pointers)
    out += b"".join(struct.pack("<q", d) for d in doc_idx)
    return out


def reference_bin_bytes(documents, dtype):
    return b"".join(
        np.asarray(s, dtype=dtype).astype(np.dtype(dtype).newbyteorder("<")).tobytes()
        for d in documents
        for s in d
    )


DOCS = [[[5, 6, 7], [8]], [[9, 10, 11, 12]], [], [[1], [2], [3]], [[65000, 0]]]


def build(prefix, documents, dtype=np.uint16, use_items=False):
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=dtype)
    for doc in documents:
        if use_items and doc:
            for seq in doc:
                builder.add_item(torch.tensor(seq, dtype=torch.int64))
            builder.end_document()
        else:
            flat = [t for s in doc for t in s]
            builder.add_document(np.array(flat, dtype=np.int64), [len(s) for s in doc])
    builder.finalize(get_idx_path(prefix))
    return prefix


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64, np.uint8])
@pytest.mark.parametrize("use_items", [False, True])
def test_bytes_match_independent_writer(tmp_path, dtype, use_items):
    docs = DOCS if dtype != np.uint8 else [[[1, 2], [3]], [[4]]]
    prefix = build(str(tmp_path / "d"), docs, dtype, use_items)
    with open(prefix + ".idx", "rb") as f:
        assert f.read() == reference_idx_bytes(docs, dtype)
    with open(prefix + ".bin", "rb") as f:
        assert f.read() == reference_bin_bytes(docs, dtype)
    assert not [p for p in os.listdir(tmp_path) if "tmp" in p]


@pytest.mark.parametrize("mmap", [True, False])
def test_round_trip(tmp_path, mmap):
    prefix = build(str(tmp_path / "d"), DOCS)
    ds = IndexedDataset(prefix, mmap=mmap)
    seqs = [s for d in DOCS for s in d]
    assert len(ds) == len(seqs)
    assert ds.dtype == np.uint16
    for i, s in enumerate(seqs):
        assert ds[i].tolist() == s
        assert ds.get(i).tolist() == s
    assert ds[-1].tolist() == seqs[-1]
    assert [a.tolist() for a in ds[1:4]] == seqs[1:4]
    assert ds.get(2, offset=1, length=2).tolist() == [10, 11]
    assert ds.get(2, offset=3).tolist() == [12]
    assert ds.sequence_lengths.tolist() == [len(s) for s in seqs]
    assert ds.document_indices.tolist() == [0, 2, 3, 3, 6, 7]
    assert ds.sequence_pointers.tolist() == [0, 6, 8, 16, 18, 20, 22]
    with pytest.raises(IndexError, match=re.escape("get(2, offset=3, length=2) outside")):
        ds.get(2, offset=3, length=2)
    clone = pickle.loads(pickle.dumps(ds))
    assert clone[2].tolist() == seqs[2] and clone.mmap == mmap
    assert IndexedDataset.exists(prefix) and not IndexedDataset.exists(prefix + "x")


def test_add_index_and_dtype_mismatch(tmp_path):
    a = build(str(tmp_path / "a"), DOCS[:2])
    b = build(str(tmp_path / "b"), DOCS[2:])
    merged = str(tmp_path / "m")
    builder = IndexedDatasetBuilder(get_bin_path(merged), dtype=np.uint16)
    builder.add_index(a)
    builder.add_index(b)
    builder.finalize(get_idx_path(merged))
    with open(merged + ".idx", "rb") as f:
        assert f.read() == reference_idx_bytes(DOCS, np.uint16)
    with open(merged + ".bin", "rb") as f:
        assert f.read() == reference_bin_bytes(DOCS, np.uint16)

    c = build(str(tmp_path / "c"), DOCS[:1], dtype=np.int32)
    builder = IndexedDatasetBuilder(str(tmp_path / "n.bin"), dtype=np.uint16)
    with pytest.raises(ValueError, match=r"c\.idx.*int32.*n\.bin.*uint16"):
        builder.add_index(c)
    builder.abort()
    assert not os.path.exists(tmp_path / "n.bin")


def test_empty_dataset(tmp_path):
    prefix = build(str(tmp_path / "e"), [])
    ds = IndexedDataset(prefix)
    assert len(ds) == 0 and ds.document_indices.tolist() == [0]
    assert os.path.getsize(prefix + ".bin") == 0


def test_builder_rejects_out_of_range_ids_and_bad_lengths(tmp_path):
    builder = IndexedDatasetBuilder(str(tmp_path / "x.bin"), dtype=np.uint16)
    with pytest.raises(ValueError, match="do not fit"):
        builder.add_item(np.array([70000]))
    with pytest.raises(ValueError, match="sum to"):
        builder.add_document([1, 2, 3], [2])
    builder.abort()


def test_context_manager_removes_partial_bin(tmp_path):
    bin_path = str(tmp_path / "p.bin")
    with pytest.raises(RuntimeError, match="worker died"):
        with IndexedDatasetBuilder(bin_path, dtype=np.int32) as builder:
            builder.add_item([1, 2, 3])
            raise RuntimeError("worker died")
    assert not os.path.exists(bin_path)
    # A successfully finalized builder keeps its files even if the block raises afterwards.
    with pytest.raises(RuntimeError, match="later failure"):
        with IndexedDatasetBuilder(bin_path, dtype=np.int32) as builder:
            builder.add_item([1, 2, 3])
            builder.end_document()
            builder.finalize(str(tmp_path / "p.idx"))
            raise RuntimeError("later failure")
    assert IndexedDataset(str(tmp_path / "p"))[0].tolist() == [1, 2, 3]


def test_dtype_codes_and_optimal_dtype():
    for dtype, code in CODES.items():
        assert DType.code_from_dtype(dtype) == code
        assert DType.dtype_from_code(code) == dtype
        assert DType.size(code) == np.dtype(dtype).itemsize
    assert optimal_dtype(50257) == np.uint16
    assert optimal_dtype(65499) == np.uint16
    assert optimal_dtype(65500) == np.int32
    assert optimal_dtype(128256) == np.int32


# --- corrupt input: each case one clear error naming the file --------------------------------


def _corrupt(tmp_path, mutate_idx=None, mutate_bin=None):
    prefix = build(str(tmp_path / "d"), DOCS)
    if mutate_idx:
        data = bytearray(open(prefix + ".idx", "rb").read())
        open(prefix + ".idx", "wb").write(bytes(mutate_idx(data)))
    if mutate_bin:
        data = bytearray(open(prefix + ".bin", "rb").read())
        open(prefix + ".bin", "wb").write(bytes(mutate_bin(data)))
    return prefix


def _set(data, offset, fmt, value):
    struct.pack_into(fmt, data, offset, value)
    return data


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: b"GARBAGE!!" + d[9:], "bad magic"),
        (lambda d: b"TNTIDX\x00\x00" + d[8:], "legacy"),
        (lambda d: _set(d, 9, "<Q", 2), "unsupported index version 2"),
        (lambda d: _set(d, 17, "<B", 9), "unknown dtype code 9"),
        (lambda d: d[:20], "truncated index"),
        (lambda d: d[:-5], "truncated index"),
        (lambda d: d + b"\x00" * 3, "trailing bytes"),
        (lambda d: b"", "bad magic"),
        (lambda d: _set(d, 26, "<Q", 100), "truncated index"),
        (lambda d: _set(d, 26 + 8 + 7 * 12 + 5 * 8, "<q", 6), "inconsistent index"),
    ],
)
def test_corrupt_idx(tmp_path, mutate, message):
    prefix = _corrupt(tmp_path, mutate_idx=mutate)
    with pytest.raises(IndexedDatasetError, match=message) as info:
        IndexedDataset(prefix)
    assert "d.idx" in str(info.value)


@pytest.mark.parametrize("mutate", [lambda d: d[:-2], lambda d: d + b"\x00\x00"])
def test_bin_size_mismatch(tmp_path, mutate):
    prefix = _corrupt(tmp_path, mutate_bin=mutate)
    with pytest.raises(IndexedDatasetError, match=r"d\.bin.*bytes"):
        IndexedDataset(prefix)


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothere"):
        IndexedDataset(str(tmp_path / "nothere"))
    prefix = build(str(tmp_path / "d"), DOCS)
    os.remove(prefix + ".bin")
    with pytest.raises(FileNotFoundError, match=r"d\.bin"):
        IndexedDataset(prefix)


def test_multimodal_modes_round_trip(tmp_path):
    prefix = str(tmp_path / "mm")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32, multimodal=True)
    builder.add_item([1, 2, 3], mode=1)
    builder.add_item([4], mode=0)
    builder.end_document()
    builder.add_document([5, 6, 7], [2, 1], modes=[2, 3])
    builder.finalize(prefix + ".idx")
    ds = IndexedDataset(prefix, multimodal=True)
    assert ds.sequence_modes.tolist() == [1, 0, 2, 3]
    data, mode = ds[2]
    assert data.tolist() == [5, 6] and mode == 2
    assert os.path.getsize(prefix + ".idx") == 34 + 4 * (4 + 8 + 1) + 3 * 8
    with pytest.raises(IndexedDatasetError, match="multimodal=True"):
        IndexedDataset(prefix)
