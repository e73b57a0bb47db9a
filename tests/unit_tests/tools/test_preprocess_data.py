"""tools/preprocess_data.py: written ids equal direct tokenization; sentences; .gz/globs; bad
input."""

import gzip
import importlib.util
import json
import os
import random
import re
import subprocess
import sys

import numpy as np
import pytest

from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron.core.tokenizers.gpt2_bpe import (
    GPT2_CHUNK_PATTERN,
    GPT2_SPLIT_PATTERN,
    GPT2_WHITESPACE_CLASS,
    GPT2BPETokenizer,
)
from megatron.core.tokenizers.null_tokenizer import NullTokenizer
from megatron.core.tokenizers.sentence_splitter import SentenceSplitter
from tests.harness import REPO

ROOT = str(REPO)
DATA = os.path.join(ROOT, "tests", "data")
TOOL = os.path.join(ROOT, "tools", "preprocess_data.py")
GPT2_FLAGS = [
    "--tokenizer-type",
    "GPT2BPETokenizer",
    "--vocab-file",
    os.path.join(DATA, "gpt2-vocab.json"),
    "--merge-file",
    os.path.join(DATA, "gpt2-merges.txt"),
]


def _load_tool():
    spec = importlib.util.spec_from_file_location("preprocess_data", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules["preprocess_data"] = (
        module  # forked workers unpickle the task function by this name
    )
    spec.loader.exec_module(module)
    return module


tool = _load_tool()


@pytest.fixture(scope="module")
def reference():
    """The plain-Python GPT-2 BPE: independent of the tool's cached fast path."""
    return GPT2BPETokenizer(
        os.path.join(DATA, "gpt2-vocab.json"), os.path.join(DATA, "gpt2-merges.txt"), use_fast=False
    )


@pytest.fixture(scope="module")
def lines():
    with open(os.path.join(DATA, "corpus.jsonl"), encoding="utf-8") as f:
        return [next(f) for _ in range(320)]  # > one 256-line batch, ~90 KB


def run_inprocess(capsys, *argv):
    code = tool.main(list(argv))
    return code, capsys.readouterr().err


def read(prefix):
    ds = IndexedDataset(prefix)
    docs = ds.document_indices
    return [[ds[s].tolist() for s in range(docs[d], docs[d + 1])] for d in range(len(docs) - 1)], ds


def test_document_level_ids_equal_direct_tokenization(tmp_path, lines, reference):
    path = tmp_path / "in.jsonl"
    extra = [
        json.dumps({"text": ""}) + "\n",
        "\n",
        json.dumps({"text": "caf\u00e9 \U0001f600 <|endoftext|>"}) + "\n",
    ]
    path.write_text("".join(lines + extra), encoding="utf-8")
    prefix = str(tmp_path / "out")
    proc = subprocess.run(
        [
            sys.executable,
            TOOL,
            "--input",
            str(path),
            "--output-prefix",
            prefix,
            *GPT2_FLAGS,
            "--append-eod",
            "--workers",
            "2",
            "--log-interval",
            "100",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert (
        "Processed 256 documents (" in proc.stderr
        and " docs/s, " in proc.stderr
        and " MB/s)." in proc.stderr
    )
    assert re.search(
        r"Done: 322 documents, .* MB/s\); CPU [\d.]+ s \(main process [\d.]+ s, workers [\d.]+ s\)",
        proc.stderr,
    ), proc.stderr
    docs, ds = read(prefix + "_text_document")
    assert ds.dtype == np.uint16
    texts = [json.loads(line)["text"] for line in lines] + [
        "",
        "caf\u00e9 \U0001f600 <|endoftext|>",
    ]
    assert len(docs) == len(
        texts
    )  # the blank line is skipped, the empty text stays an empty document
    for got, text in zip(docs, texts):
        expected = reference.tokenize(text)
        assert got == ([expected + [reference.eod]] if expected else [])
    assert sorted(os.listdir(tmp_path)) == [
        "in.jsonl",
        "out_text_document.bin",
        "out_text_document.idx",
    ]


def test_no_eod_and_multiple_keys(tmp_path, capsys, reference):
    path = tmp_path / "topics.jsonl"
    with open(os.path.join(DATA, "topics.jsonl"), encoding="utf-8") as f:
        records = [json.loads(next(f)) for _ in range(6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    code, err = run_inprocess(
        capsys,
        "--input",
        str(path),
        "--output-prefix",
        str(tmp_path / "t"),
        *GPT2_FLAGS,
        "--json-keys",
        "title",
        "body",
        "--workers",
        "1",
    )
    assert code == 0, err
    for key in ("title", "body"):
        docs, _ = read(str(tmp_path / f"t_{key}_document"))
        assert docs == [[reference.tokenize(r[key])] for r in records]


def test_sentence_level_keeps_document_boundaries(tmp_path, capsys, lines, reference):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(lines[:60]), encoding="utf-8")
    code, err = run_inprocess(
        capsys,
        "--input",
        str(path),
        "--output-prefix",
        str(tmp_path / "s"),
        *GPT2_FLAGS,
        "--split-sentences",
        "--append-eod",
        "--workers",
        "2",
        "--partitions",
        "1",
    )
    assert code == 0, err
    docs, _ = read(str(tmp_path / "s_text_sentence"))
    splitter = SentenceSplitter(use_nltk=None)
    assert len(docs) == 60
    multi = 0
    for got, line in zip(docs, lines[:60]):
        expected = [
            ids
            for ids in (reference.tokenize(s) for s in splitter.split(json.loads(line)["text"]))
            if ids
        ]
        expected[-1] = expected[-1] + [reference.eod]  # EOD ends the document's last sentence
        assert got == expected
        multi += len(got) > 1
    assert multi > 20  # the slice really has multi-sentence documents


def test_gz_and_glob_with_partitions_equal_one_plain_file(tmp_path, capsys, lines):
    shards = tmp_path / "shards"
    shards.mkdir()
    parts = [lines[:100], lines[100:130], lines[130:]]
    (shards / "a.jsonl").write_text("".join(parts[0]), encoding="utf-8")
    with gzip.open(shards / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write("".join(parts[1]))
    (shards / "c.jsonl").write_text("".join(parts[2]), encoding="utf-8")
    whole = tmp_path / "whole.jsonl"
    whole.write_text("".join(lines), encoding="utf-8")
    common = [*GPT2_FLAGS, "--append-eod", "--workers", "2"]
    assert (
        run_inprocess(
            capsys,
            "--input",
            str(shards / "*.jsonl*"),
            "--output-prefix",
            str(tmp_path / "g"),
            "--partitions",
            "2",
            *common,
        )[0]
        == 0
    )
    assert (
        run_inprocess(
            capsys,
            "--input",
            str(whole),
            "--output-prefix",
            str(tmp_path / "w"),
            "--partitions",
            "1",
            *common,
        )[0]
        == 0
    )
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"g_text_document{ext}").read_bytes() == (
            tmp_path / f"w_text_document{ext}"
        ).read_bytes()


def test_malformed_json_line_stops_with_file_and_line(tmp_path, capsys, lines):
    path = tmp_path / "bad.jsonl"
    bad = lines[:299] + ['{"text": "unterminated\n'] + lines[299:]  # line 300, in the second batch
    path.write_text("".join(bad), encoding="utf-8")
    # The dataset of an earlier run stays as it was when a re-run fails (it was deleted when
    # the re-run started, so a failed re-run lost a good dataset).
    (tmp_path / "out_text_document.bin").write_bytes(b"earlier bin")
    (tmp_path / "out_text_document.idx").write_bytes(b"earlier idx")
    code, err = run_inprocess(
        capsys,
        "--input",
        str(path),
        "--output-prefix",
        str(tmp_path / "out"),
        *GPT2_FLAGS,
        "--workers",
        "2",
    )
    assert code == 1  # the CLI exits with this status (sys.exit(main()))
    assert f"error: {path}:300: malformed JSON" in err
    assert sorted(os.listdir(tmp_path)) == [
        "bad.jsonl",
        "out_text_document.bin",
        "out_text_document.idx",
    ]
    assert (tmp_path / "out_text_document.bin").read_bytes() == b"earlier bin"
    assert (tmp_path / "out_text_document.idx").read_bytes() == b"earlier idx"


def test_missing_key_and_wrong_types(tmp_path, capsys):
    path = tmp_path / "in.jsonl"
    path.write_text('{"text": "fine"}\n{"body": "no text key"}\n', encoding="utf-8")
    code, err = run_inprocess(
        capsys,
        "--input",
        str(path),
        "--output-prefix",
        str(tmp_path / "o"),
        *GPT2_FLAGS,
        "--workers",
        "1",
    )
    assert code == 1 and f"{path}:2: missing key 'text'" in err and "'body'" in err
    path.write_text('{"text": "fine"}\n[1, 2]\n', encoding="utf-8")
    code, err = run_inprocess(
        capsys,
        "--input",
        str(path),
        "--output-prefix",
        str(tmp_path / "o"),
        *GPT2_FLAGS,
        "--workers",
        "1",
    )
    assert code == 1 and f"{path}:2: expected a JSON object" in err
    path.write_text('{"text": 7}\n', encoding="utf-8")
    code, err = run_inprocess(
        capsys,
        "--input",
        str(path),
        "--output-prefix",
        str(tmp_path / "o"),
        *GPT2_FLAGS,
        "--workers",
        "1",
    )
    assert code == 1 and f"{path}:1: key 'text' holds int" in err
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]


def test_empty_and_missing_inputs(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n", encoding="utf-8")
    code, err = run_inprocess(
        capsys,
        "--input",
        str(empty),
        "--output-prefix",
        str(tmp_path / "o"),
        *GPT2_FLAGS,
        "--workers",
        "1",
    )
    assert code == 1 and f"{empty}: empty input" in err
    assert sorted(os.listdir(tmp_path)) == ["empty.jsonl"]
    code, err = run_inprocess(
        capsys,
        "--input",
        str(tmp_path / "none*.jsonl"),
        "--output-prefix",
        str(tmp_path / "o"),
        *GPT2_FLAGS,
        "--workers",
        "1",
    )
    assert code == 1 and "no file matches" in err
    with pytest.raises(SystemExit, match="^2$"):
        tool.main(
            [
                "--input",
                str(empty),
                "--output-prefix",
                "x",
                *GPT2_FLAGS,
                "--workers",
                "3",
                "--partitions",
                "2",
            ]
        )
    assert "--workers 3 must be divisible by --partitions 2" in capsys.readouterr().err


def test_null_tokenizer_rejects_text_with_its_line(tmp_path, capsys):
    path = tmp_path / "ids.jsonl"
    path.write_text('{"text": "1 2 3"}\n{"text": "4 five"}\n', encoding="utf-8")
    code, err = run_inprocess(
        capsys,
        "--input",
        str(path),
        "--output-prefix",
        str(tmp_path / "n"),
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "10",
        "--workers",
        "1",
    )
    assert (
        code == 1
        and f"{path}:2: key 'text': NullTokenizer expects whitespace-separated integers" in err
    )


def test_lines_orjson_rejects_read_as_json_reads_them(tmp_path, capsys, reference):
    path = tmp_path / "in.jsonl"
    texts = ["bom", "nan", "big", "dup"]
    path.write_bytes(
        b'\xef\xbb\xbf{"text": "bom"}\n{"text": "nan", "x": NaN}\n'
        b'{"text": "big", "n": 123456789012345678901234567890}\n{"text": "a", "text": "dup"}\n'
    )
    code, err = run_inprocess(
        capsys,
        "--input",
        str(path),
        "--output-prefix",
        str(tmp_path / "o"),
        *GPT2_FLAGS,
        "--workers",
        "1",
    )
    assert code == 0, err
    assert read(str(tmp_path / "o_text_document"))[0] == [[reference.tokenize(t)] for t in texts]
    for line, message in [
        ('{"text": 123456789012345678901234567890}', "1: key 'text' holds int"),
        ('{"text": "\\ud800"}', "1: key 'text': 'utf-8' codec can't encode"),
        ('{"text": "x"} {}', "1: malformed JSON: Extra data (column 15)"),
    ]:
        path.write_text(line + "\n", encoding="utf-8")
        code, err = run_inprocess(
            capsys,
            "--input",
            str(path),
            "--output-prefix",
            str(tmp_path / "o"),
            *GPT2_FLAGS,
            "--workers",
            "1",
        )
        assert code == 1 and f"{path}:{message}" in err, err


# ------------------------------------------------------------------------ fast paths, same results
def test_whitespace_class_is_the_gpt2_patterns_whitespace():
    import regex

    everything = "".join(map(chr, range(0x110000)))
    assert re.findall(f"[{GPT2_WHITESPACE_CLASS}]", everything) == regex.findall(r"\s", everything)


def test_chunks_split_like_the_text_and_packed_ids_equal_the_reference(reference):
    import regex

    rng = random.Random(0)
    alphabet = (
        [chr(c) for c in range(128)]
        + list(" \t\n\r'sdlmtrve") * 6  # favour the tricky pieces
        + [
            "\x1c",
            "\x85",
            "\xa0",
            "\u2003",
            "\u3000",
            "\u2028",
            "\u00e9",
            "e\u0301",
            "\u4e2d",
            "\U0001f600",
            "\u0663",
            "\u00b2",
            "\u00bd",
        ]
    )
    texts = [
        "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 40))) for _ in range(1500)
    ]
    chunker, gpt2_split = re.compile(GPT2_CHUNK_PATTERN), regex.compile(GPT2_SPLIT_PATTERN)
    for text in texts:  # the claim the fast path rests on
        assert [
            p for chunk in chunker.findall(text) for p in gpt2_split.findall(chunk)
        ] == gpt2_split.findall(text)
    fast = GPT2BPETokenizer(
        os.path.join(DATA, "gpt2-vocab.json"), os.path.join(DATA, "gpt2-merges.txt")
    )
    fast._CHUNK_CACHE_LIMIT = 50  # exercise the cache reset too
    expected = [reference.tokenize(t) for t in texts]
    for _ in range(2):  # cold, then warm caches
        tokens, lengths = fast.tokenize_batch_packed(texts, np.int32)
        assert tokens.dtype == np.int32 and lengths.tolist() == [len(ids) for ids in expected]
        assert tokens.tolist() == [i for ids in expected for i in ids]
        assert len(fast._chunk_cache) <= 50
    assert fast.tokenize_batch(texts[:50]) == expected[:50]
    null = NullTokenizer(vocab_size=70000)  # the generic path, with an id that does not fit uint16
    tokens, lengths = null.tokenize_batch_packed(["1 2", "", "69999"], np.int32)
    assert tokens.tolist() == [1, 2, 69999] and lengths.tolist() == [2, 0, 1]
    with pytest.raises(ValueError, match=r"\[1, 69999\] do not fit uint16"):
        null.tokenize_batch_packed(["1 2", "69999"], np.uint16)


@pytest.mark.parametrize("eod", [None, 99])
def test_pack_equals_a_document_loop(eod):
    rng = np.random.default_rng(0)
    for documents in (0, 1, 40):
        counts = rng.integers(0, 4, size=documents)
        lengths = rng.integers(0, 4, size=int(counts.sum()))  # zeros: empty sentences are dropped
        tokens = rng.integers(0, 90, size=int(lengths.sum())).astype(np.uint16)
        got = tool._pack(tokens, lengths, counts, eod)
        want_tokens, want_lengths, want_counts, t, s = [], [], [], 0, 0
        for count in counts:
            kept = []
            for n in lengths[s : s + count]:
                if n:
                    kept.append(tokens[t : t + n].tolist())
                t += n
            s += count
            if kept and eod is not None:
                kept[-1].append(eod)
            want_tokens += [i for seq in kept for i in seq]
            want_lengths += [len(seq) for seq in kept]
            want_counts.append(len(kept))
        assert got.tokens.dtype == np.uint16 and got.tokens.tolist() == want_tokens
        assert (
            got.sequence_lengths.tolist() == want_lengths
            and got.sequences_per_doc.tolist() == want_counts
        )


def test_add_documents_writes_what_add_document_writes(tmp_path):
    rng = np.random.default_rng(1)
    docs = [
        [rng.integers(0, 500, size=n) for n in rng.integers(1, 9, size=k)] for k in (2, 0, 1, 3, 0)
    ]
    one = IndexedDatasetBuilder(str(tmp_path / "one.bin"), dtype=np.uint16)
    for doc in docs:
        one.add_document(
            np.concatenate(doc) if doc else np.zeros(0, np.int64), [len(seq) for seq in doc]
        )
    one.finalize(str(tmp_path / "one.idx"))
    bulk = IndexedDatasetBuilder(str(tmp_path / "bulk.bin"), dtype=np.uint16)
    split = 2
    for part in (docs[:split], docs[split:]):
        seqs = [seq for doc in part for seq in doc]
        bulk.add_documents(
            np.concatenate(seqs), [len(seq) for seq in seqs], [len(doc) for doc in part]
        )
    with pytest.raises(ValueError, match="must agree"):
        bulk.add_documents(np.arange(3), [2], [1])
    with pytest.raises(ValueError, match="must agree"):
        bulk.add_documents(np.arange(3), [3], [2])
    bulk.finalize(str(tmp_path / "bulk.idx"))
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"bulk{ext}").read_bytes() == (tmp_path / f"one{ext}").read_bytes()


# ------------------------------------------------------------------------------ sentence splitter
def test_builtin_sentence_rules():
    split = SentenceSplitter(use_nltk=False).split
    text = (
        'Dr. Smith met J. R. Tolkien. "Hello!" he said. See Fig. 3, e.g. the plot... '
        "Then 3 cats ran? Yes."
        "\n\nno capital after a blank line\nstill the same sentence. end"
    )
    assert split(text) == [
        "Dr. Smith met J. R. Tolkien.",
        '"Hello!" he said.',
        "See Fig. 3, e.g. the plot...",
        "Then 3 cats ran?",
        "Yes.",
        "no capital after a blank line\nstill the same sentence. end",
    ]
    assert split("") == [] and split("  \n ") == []


def test_keep_newlines():
    text = "First one.\nSecond one. Third one.\n\nFourth"
    assert SentenceSplitter(use_nltk=False).split(text) == [
        "First one.",
        "Second one.",
        "Third one.",
        "Fourth",
    ]
    kept = SentenceSplitter(use_nltk=False, keep_newlines=True).split(text)
    assert kept == ["First one.\n", "Second one.", "Third one.\n\n", "Fourth"]
