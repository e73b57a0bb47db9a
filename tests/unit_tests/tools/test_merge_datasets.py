"""tools/merge_datasets.py: round trip, agreement with preprocessing the whole input, dtype
mismatch."""

import importlib.util
import os
import sys

import numpy as np

from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from tests.harness import REPO

ROOT = str(REPO)
DATA = os.path.join(ROOT, "tests", "data")


def _load(name):
    # Reuse a copy another test file loaded: worker processes look task functions up by module
    # name, so two copies under one name break pickling.
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


merge_tool = _load("merge_datasets")


def _write(prefix, documents, dtype=np.uint16):
    """documents: list of lists of sequences (lists of ids)."""
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in documents:
        builder.add_document(
            np.array([t for seq in doc for t in seq], dtype=dtype), [len(seq) for seq in doc]
        )
    builder.finalize(prefix + ".idx")


def _documents(prefix):
    ds = IndexedDataset(prefix)
    bounds = ds.document_indices
    return [
        [ds[s].tolist() for s in range(bounds[d], bounds[d + 1])] for d in range(len(bounds) - 1)
    ], ds.dtype


def _random_documents(rng, n):
    return [
        [
            rng.integers(0, 60000, size=rng.integers(1, 9)).tolist()
            for _ in range(rng.integers(0, 4))
        ]
        for _ in range(n)
    ]


def test_merge_round_trip(tmp_path, capsys):
    rng = np.random.default_rng(0)
    shards = tmp_path / "shards"
    shards.mkdir()
    parts = {name: _random_documents(rng, n) for name, n in (("b", 7), ("a", 5), ("c", 1))}
    for name, docs in parts.items():
        _write(str(shards / name), docs)
    (shards / "orphan.bin").write_bytes(b"")  # no .idx: reported and skipped
    out = str(
        shards / "merged"
    )  # the output inside the input directory is never merged into itself
    assert merge_tool.main(["--input", str(shards), "--output-prefix", out]) == 0
    assert "skipping" in capsys.readouterr().err
    docs, dtype = _documents(out)
    assert dtype == np.uint16
    assert docs == parts["a"] + parts["b"] + parts["c"]  # sorted name order
    assert (
        merge_tool.main(["--input", str(shards), "--output-prefix", out]) == 0
    )  # re-run: same result
    assert _documents(out)[0] == docs


def test_merge_of_preprocessed_halves_equals_preprocessing_the_whole(tmp_path, capsys):
    preprocess = _load("preprocess_data")
    with open(os.path.join(DATA, "corpus.jsonl"), encoding="utf-8") as f:
        lines = [next(f) for _ in range(80)]
    flags = [
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        os.path.join(DATA, "gpt2-vocab.json"),
        "--merge-file",
        os.path.join(DATA, "gpt2-merges.txt"),
        "--append-eod",
        "--workers",
        "1",
    ]
    halves = tmp_path / "halves"
    halves.mkdir()
    for i, chunk in enumerate((lines[:50], lines[50:])):
        (tmp_path / f"{i}.jsonl").write_text("".join(chunk), encoding="utf-8")
        assert (
            preprocess.main(
                [
                    "--input",
                    str(tmp_path / f"{i}.jsonl"),
                    "--output-prefix",
                    str(halves / str(i)),
                    *flags,
                ]
            )
            == 0
        )
    (tmp_path / "all.jsonl").write_text("".join(lines), encoding="utf-8")
    assert (
        preprocess.main(
            [
                "--input",
                str(tmp_path / "all.jsonl"),
                "--output-prefix",
                str(tmp_path / "all"),
                *flags,
            ]
        )
        == 0
    )
    assert (
        merge_tool.main(["--input", str(halves), "--output-prefix", str(tmp_path / "merged")]) == 0
    )
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"merged{ext}").read_bytes() == (
            tmp_path / f"all_text_document{ext}"
        ).read_bytes()
    capsys.readouterr()


def test_dtype_mismatch_names_both_files(tmp_path, capsys):
    shards = tmp_path / "shards"
    shards.mkdir()
    _write(str(shards / "a"), [[[1, 2, 3]]], dtype=np.uint16)
    _write(str(shards / "b"), [[[70000, 5]]], dtype=np.int32)
    out = tmp_path / "merged"
    assert merge_tool.main(["--input", str(shards), "--output-prefix", str(out)]) == 1
    err = capsys.readouterr().err
    assert (
        f"{shards / 'b'}.idx" in err
        and f"{shards / 'a'}.idx" in err
        and "int32" in err
        and "uint16" in err
    )
    assert not [p for p in os.listdir(tmp_path) if p.startswith("merged")]


def test_bad_input_directory(tmp_path, capsys):
    assert (
        merge_tool.main(
            ["--input", str(tmp_path / "missing"), "--output-prefix", str(tmp_path / "m")]
        )
        == 1
    )
    assert "not a directory" in capsys.readouterr().err
    assert merge_tool.main(["--input", str(tmp_path), "--output-prefix", str(tmp_path / "m")]) == 1
    assert "no <prefix>.bin/<prefix>.idx pairs" in capsys.readouterr().err
