#!/usr/bin/env python3
"""Data pipeline speed: ``tools/preprocess_data.py`` against an upstream-style baseline, and the
GPTDataset index build for a large synthetic dataset.

    python benchmarks/preprocess.py [--size-mb 20] [--workers 1 2] [--rounds 3]
        [--index-documents 1000000 --index-tokens 100000000 --seq-length 2048]

Input: the shipped corpus (``tests/data/corpus.jsonl`` + ``topics.jsonl``) repeated to about
``--size-mb`` MB of JSON lines (``--size-mb 0``: one copy, 2.2 MB), tokenized with the shipped
GPT-2 BPE files, ``--append-eod``.

Baseline ("upstream"): the approach of Megatron's preprocess_data.py - a ``multiprocessing.Pool``
of workers, ``imap(encode, lines, 32)`` one document per task, each worker a pure-Python GPT-2
BPE (regex split, byte map, merge loop with a per-word cache of the merged string that is split
and looked up on every use), token lists sent back and written by ``IndexedDatasetBuilder``.
(transformers 5 no longer has a pure-Python GPT-2 tokenizer, so the baseline is written here.)

Ours: the tool itself. Both run as subprocesses of this script, one at a time, alternating, for
``--rounds`` rounds per worker count; outputs are compared byte for byte (identical ids and
index) every round. Reported per implementation: the median over rounds of documents/s and
MB/s over the processing phase (from the worker pool's start to the index written; interpreter
start-up excluded for both), the CPU seconds of that phase summed over all processes (main and
workers, from ``getrusage``), the whole subprocess's wall time and peak RSS (largest single
process). Ratios are medians of the per-round ratios; the CPU ratio (baseline CPU / ours) is
what a machine with idle cores would see at equal cores, and barely moves when other jobs share
the CPU. Neither side uses extra threads: the baseline is pure Python, and our workers call the
Rust ``tokenizers`` BPE model only for words not seen before, one word at a time, with
``TOKENIZERS_PARALLELISM=false`` (no Rayon pool); the only other thread is numpy's idle BLAS pool,
present on both sides. Repeating the corpus makes every word cache warmer than on fresh text,
for both sides alike; ``--size-mb 0`` measures one copy.

Index build: a synthetic ``.idx`` of ``--index-documents`` one-sequence documents holding
``--index-tokens`` tokens (random lengths, seed 0; the ``.bin`` is a sparse file of the right
size), opened as an IndexedDataset; then the time of ``GPTDataset(...)`` for one epoch at
``--seq-length`` with an empty index cache (build + save), split into its three index
builders, and with the cache written (load).
"""

import argparse
import json
import multiprocessing
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import regex

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
sys.path.insert(0, ROOT)
DATA = os.path.join(ROOT, "tests", "data")
VOCAB = os.path.join(DATA, "gpt2-vocab.json")
MERGES = os.path.join(DATA, "gpt2-merges.txt")
PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Both sides print this line; docs/s has more digits than the seconds, so it gives the time.
DONE = re.compile(r"Done: (\d+) documents, .*\(([\d.]+) docs/s, [\d.]+ MB/s\); CPU ([\d.]+) s")


# --------------------------------------------------------------------------- baseline (upstream)
class UpstreamStyleGPT2:
    """GPT-2 BPE the way the original pure-Python tokenizer works (written for this benchmark)."""

    def __init__(self):
        with open(VOCAB, encoding="utf-8") as f:
            self.encoder = json.load(f)
        with open(MERGES, encoding="utf-8") as f:
            merges = [tuple(line.split()) for line in f.read().split("\n")[1:] if line]
        self.ranks = {pair: i for i, pair in enumerate(merges)}
        printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
        extra = [b for b in range(256) if b not in printable]
        self.byte_encoder = {
            **{b: chr(b) for b in printable},
            **{b: chr(256 + i) for i, b in enumerate(extra)},
        }
        self.pattern = regex.compile(PATTERN)
        self.cache = {}
        self.eod = self.encoder["<|endoftext|>"]

    def bpe(self, token):
        if token in self.cache:
            return self.cache[token]
        word = tuple(token)
        while len(word) > 1:
            pairs = set(zip(word, word[1:]))
            best = min(pairs, key=lambda p: self.ranks.get(p, float("inf")))
            if best not in self.ranks:
                break
            merged, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and word[i] == best[0] and word[i + 1] == best[1]:
                    merged.append(word[i] + word[i + 1])
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = tuple(merged)
        result = " ".join(word)
        self.cache[token] = result
        return result

    def tokenize(self, text):
        ids = []
        for piece in self.pattern.findall(text):
            token = "".join(self.byte_encoder[b] for b in piece.encode("utf-8"))
            ids.extend(self.encoder[t] for t in self.bpe(token).split(" "))
        return ids


_TOKENIZER = None


def _init():
    global _TOKENIZER
    _TOKENIZER = UpstreamStyleGPT2()


def _encode(line):
    text = json.loads(line)["text"]
    ids = _TOKENIZER.tokenize(text)
    if ids:
        ids.append(_TOKENIZER.eod)
    return ids, len(line)


def cpu_seconds():
    """(this process, its finished children): CPU seconds, user + system (as the tool counts
    them)."""
    import resource

    own, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def run_baseline_here(path, prefix, workers):
    """The baseline itself (in the subprocess); prints a Done line like the tool's."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    start, cpu_start = time.time(), cpu_seconds()
    docs = nbytes = 0
    with (
        open(path, encoding="utf-8") as f,
        multiprocessing.get_context("fork").Pool(workers, _init) as pool,
    ):
        for ids, size in pool.imap(_encode, f, 32):
            builder.add_document(ids, [len(ids)] if ids else [])
            docs += 1
            nbytes += size
        pool.close()
        pool.join()  # reaped, so the workers' CPU time is counted
    builder.finalize(prefix + ".idx")
    elapsed = time.time() - start
    cpu = sum(cpu_seconds()) - sum(cpu_start)
    print(
        f"Done: {docs} documents, baseline, in {elapsed:.3f} s ({docs / elapsed:.2f} docs/s, "
        f"{nbytes / elapsed / 1024 / 1024:.2f} MB/s); CPU {cpu:.3f} s",
        file=sys.stderr,
    )


# ---------------------------------------------------------------------------------- measuring
def run_measured(cmd, log_path):
    """Run ``cmd``; its Done line plus the subprocess tree's wall time and peak RSS."""
    start = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.time() - start
    with open(log_path) as log:
        text = log.read()
    match = DONE.search(text)
    if proc.returncode != 0 or match is None:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{text[-3000:]}")
    docs = int(match.group(1))
    return {
        "docs": docs,
        "seconds": docs / float(match.group(2)),
        "cpu": float(match.group(3)),
        "wall": wall,
        "rss_mb": usage.ru_maxrss / 1024,
    }


def run_ours(path, prefix, workers, log):
    cmd = [
        sys.executable,
        os.path.join(ROOT, "tools", "preprocess_data.py"),
        "--input",
        path,
        "--output-prefix",
        prefix,
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        VOCAB,
        "--merge-file",
        MERGES,
        "--append-eod",
        "--workers",
        str(workers),
        "--log-interval",
        "100000000",
    ]
    return run_measured(cmd, log)


def run_baseline(path, prefix, workers, log):
    return run_measured(
        [sys.executable, os.path.abspath(__file__), "--run-baseline", path, prefix, str(workers)],
        log,
    )


def build_input(path, size_mb):
    lines = []
    for name, key in (("corpus.jsonl", "text"), ("topics.jsonl", "body")):
        with open(os.path.join(DATA, name), encoding="utf-8") as f:
            lines += [json.dumps({"text": json.loads(line)[key]}) + "\n" for line in f]
    block = "".join(lines).encode("utf-8")
    copies = max(1, round(size_mb * 1024 * 1024 / len(block)))
    with open(path, "wb") as f:
        for _ in range(copies):
            f.write(block)
    return copies * len(lines)


def same_files(a, b):
    for ext in (".bin", ".idx"):
        with open(a + ext, "rb") as fa, open(b + ext, "rb") as fb:
            if fa.read() != fb.read():
                return False
    return True


def load():
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def bench_preprocess(args, tmp):
    path = os.path.join(tmp, "input.jsonl")
    n = build_input(path, args.size_mb)
    mb = os.path.getsize(path) / 1024 / 1024
    print(f"input: {n} documents, {mb:.1f} MB; cpus: {os.cpu_count()}; rounds: {args.rounds}")
    runs = {(impl, w): [] for w in args.workers for impl in ("upstream", "ours")}
    identical = True
    for r in range(args.rounds):
        for workers in args.workers:
            before = load()
            ref = run_baseline(
                path, os.path.join(tmp, "ref"), workers, os.path.join(tmp, "ref.log")
            )
            ours = run_ours(path, os.path.join(tmp, "ours"), workers, os.path.join(tmp, "ours.log"))
            same = same_files(os.path.join(tmp, "ours_text_document"), os.path.join(tmp, "ref"))
            identical &= same
            if ref["docs"] != n or ours["docs"] != n:
                raise SystemExit(
                    f"document counts differ: input {n}, baseline {ref['docs']}, "
                    f"ours {ours['docs']}"
                )
            runs[("upstream", workers)].append(ref)
            runs[("ours", workers)].append(ours)
            print(
                f"round {r + 1} workers {workers}: upstream {n / ref['seconds']:8.1f} docs/s  ours "
                f"{n / ours['seconds']:8.1f} docs/s  "
                f"ratio {ref['seconds'] / ours['seconds']:4.1f}x  CPU ratio "
                f"{ref['cpu'] / ours['cpu']:4.1f}x  identical {same}  load {before} -> {load()}",
                flush=True,
            )

    print(
        "\n| workers | implementation | docs/s median (best) | MB/s median (best) | CPU s median | "
        "docs per CPU-s | wall s with start-up | peak RSS MB |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for workers in args.workers:
        for impl in ("upstream", "ours"):
            rs = runs[(impl, workers)]
            sec, best = statistics.median(x["seconds"] for x in rs), min(x["seconds"] for x in rs)
            cpu = statistics.median(x["cpu"] for x in rs)
            print(
                f"| {workers} | {impl} | {n / sec:.0f} ({n / best:.0f}) | "
                f"{mb / sec:.2f} ({mb / best:.2f}) | "
                f"{cpu:.2f} | {n / cpu:.0f} | {statistics.median(x['wall'] for x in rs):.2f} | "
                f"{max(x['rss_mb'] for x in rs):.0f} |"
            )
    print(
        "\n| workers | ours / upstream docs/s: median of rounds (min-max) | best / best | "
        "CPU-time ratio median "
        "(min-max) | identical output |"
    )
    print("|---|---|---|---|---|")
    for workers in args.workers:
        pairs = list(zip(runs[("upstream", workers)], runs[("ours", workers)]))
        ratios = [a["seconds"] / b["seconds"] for a, b in pairs]
        cpu = [a["cpu"] / b["cpu"] for a, b in pairs]
        best = min(a["seconds"] for a, _ in pairs) / min(b["seconds"] for _, b in pairs)
        print(
            f"| {workers} | **{statistics.median(ratios):.1f}x** "
            f"({min(ratios):.1f}-{max(ratios):.1f}) | "
            f"{best:.1f}x | {statistics.median(cpu):.1f}x ({min(cpu):.1f}-{max(cpu):.1f}) | "
            f"{identical} |"
        )
    return identical


# --------------------------------------------------------------------------------- index build
def bench_index(args, tmp):
    from types import SimpleNamespace

    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.index_helpers import (
        build_document_index,
        build_sample_index,
        build_shuffle_index,
    )
    from megatron.core.datasets.indexed_dataset import IndexedDataset, write_index
    from megatron.core.datasets.utils import Split

    documents, tokens = args.index_documents, args.index_tokens
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 2 * tokens // documents, size=documents, dtype=np.int64)
    lengths = np.maximum(lengths * tokens // int(lengths.sum()), 1)
    lengths[rng.integers(0, documents, size=tokens - int(lengths.sum()))] += (
        1  # exactly `tokens` in all
    )
    while int(lengths.sum()) != tokens:
        lengths[np.argmax(lengths)] += tokens - int(lengths.sum())
    prefix = os.path.join(tmp, "synthetic")
    start = time.time()
    write_index(
        prefix + ".idx",
        np.uint16,
        lengths.astype(np.int32),
        np.arange(documents + 1, dtype=np.int64),
    )
    with open(prefix + ".bin", "wb") as f:
        f.truncate(tokens * 2)  # sparse: the index build never reads tokens
    write_s = time.time() - start
    start = time.time()
    dataset = IndexedDataset(prefix)
    open_s = time.time() - start
    tokenizer = SimpleNamespace(
        eod=0, pad=None, vocab_size=8192, unique_identifiers={"class": "BenchTokenizer"}
    )
    config = GPTDatasetConfig(
        random_seed=1234,
        sequence_length=args.seq_length,
        blend=([prefix], None),
        split="1",
        path_to_cache=os.path.join(tmp, "cache"),
        tokenizer=tokenizer,
    )
    indices = np.arange(documents, dtype=np.int32)
    start = time.time()
    built = GPTDataset(dataset, prefix, indices, None, Split.train, config)
    build_s = time.time() - start
    start = time.time()
    loaded = GPTDataset(dataset, prefix, indices, None, Split.train, config)
    load_s = time.time() - start
    assert not loaded.built_anew_on_cache_miss and np.array_equal(
        loaded.sample_index, built.sample_index
    )

    state = np.random.RandomState(1234)  # the three builders alone, as GPTDataset calls them
    t0 = time.time()
    document_index = build_document_index(indices, 1, state, False)
    t1 = time.time()
    sample_index = build_sample_index(
        dataset.sequence_lengths, document_index, args.seq_length, 1, tokens
    )
    t2 = time.time()
    build_shuffle_index(sample_index.shape[0] - 1, sample_index.shape[0] - 1, state)
    t3 = time.time()
    print(
        f"\nGPTDataset indices: {documents} documents, {tokens} tokens, "
        f"seq length {args.seq_length}, one epoch: "
        f"{len(built)} samples"
    )
    print("| step | seconds |")
    print("|---|---|")
    for name, sec in [
        ("write the synthetic .idx (not part of the build)", write_s),
        ("open the IndexedDataset", open_s),
        ("GPTDataset(...) with an empty cache: build + save the indices", build_s),
        (f"  of which build_document_index (shuffle {documents} ids)", t1 - t0),
        ("  of which build_sample_index", t2 - t1),
        ("  of which build_shuffle_index", t3 - t2),
        ("GPTDataset(...) again: load the cached indices", load_s),
    ]:
        print(f"| {name} | {sec:.3f} |")


def main():
    if len(sys.argv) == 5 and sys.argv[1] == "--run-baseline":
        run_baseline_here(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--size-mb", type=float, default=20, help="input size; 0 = one copy of the corpus"
    )
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument(
        "--rounds", type=int, default=3, help="runs of each implementation per worker count"
    )
    parser.add_argument("--index-documents", type=int, default=10**6)
    parser.add_argument("--index-tokens", type=int, default=10**8)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--skip-preprocess", action="store_true")
    parser.add_argument("--skip-index", action="store_true")
    args = parser.parse_args()
    print(
        f"python {sys.version.split()[0]}, numpy {np.__version__}; "
        f"load average {load()} (1/5/15 min)"
    )
    identical = True
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_preprocess:
            identical = bench_preprocess(args, tmp)
        if not args.skip_index:
            bench_index(args, tmp)
    if not identical:
        raise SystemExit("outputs differ")


if __name__ == "__main__":
    main()
