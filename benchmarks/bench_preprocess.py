#!/usr/bin/env python3
"""Preprocessing throughput: ``tools/preprocess_data.py`` against an upstream-style baseline.

    python benchmarks/bench_preprocess.py [--size-mb 20] [--workers 1 2]

Input: the shipped corpus (``tests/data/corpus.jsonl`` + ``topics.jsonl``) repeated to about
``--size-mb`` MB of JSON lines, tokenized with the shipped GPT-2 BPE files, ``--append-eod``.

Baseline ("upstream"): the approach of Megatron's preprocess_data.py - a ``multiprocessing.Pool``
of workers, ``imap(encode, lines, 32)`` one document per task, each worker a pure-Python GPT-2
BPE (regex split, byte map, merge loop with a per-word cache of the merged string that is split
and looked up on every use), token lists sent back and written by ``IndexedDatasetBuilder``.
(transformers 5 no longer has a pure-Python GPT-2 tokenizer, so the baseline is written here.)

Ours: the tool itself, run as a subprocess. Both outputs are compared byte for byte (identical
ids and index). Throughput excludes interpreter start-up for both (ours: the tool's own
"Done:" line; the wall time with start-up is printed too). Repeating the corpus makes every
word cache warmer than on fresh text, for both sides alike.
"""
import argparse
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time

import regex

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
sys.path.insert(0, ROOT)
DATA = os.path.join(ROOT, "tests", "data")
VOCAB = os.path.join(DATA, "gpt2-vocab.json")
MERGES = os.path.join(DATA, "gpt2-merges.txt")
PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


class UpstreamStyleGPT2:
    """GPT-2 BPE the way the original pure-Python tokenizer works (written for this benchmark)."""

    def __init__(self):
        with open(VOCAB, encoding="utf-8") as f:
            self.encoder = json.load(f)
        with open(MERGES, encoding="utf-8") as f:
            merges = [tuple(line.split()) for line in f.read().split("\n")[1:] if line]
        self.ranks = {pair: i for i, pair in enumerate(merges)}
        printable = (list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256)))
        extra = [b for b in range(256) if b not in printable]
        self.byte_encoder = {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(extra)}}
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


def run_upstream_style(path, prefix, workers):
    import numpy as np

    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    start = time.time()
    docs = nbytes = 0
    with open(path, encoding="utf-8") as f, multiprocessing.get_context("fork").Pool(workers, _init) as pool:
        for ids, size in pool.imap(_encode, f, 32):
            builder.add_document(ids, [len(ids)] if ids else [])
            docs += 1
            nbytes += size
    builder.finalize(prefix + ".idx")
    elapsed = time.time() - start
    return docs, nbytes, elapsed


def run_ours(path, prefix, workers):
    cmd = [sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", path, "--output-prefix",
           prefix, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", VOCAB, "--merge-file", MERGES,
           "--append-eod", "--workers", str(workers), "--log-interval", "100000000"]
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.time() - start
    if proc.returncode != 0:
        raise SystemExit(proc.stderr)
    m = re.search(r"Done: (\d+) documents, .* in ([\d.]+) s", proc.stderr)
    docs = int(m.group(1))
    return docs, os.path.getsize(path), float(m.group(2)), wall


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


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=20)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "input.jsonl")
        n = build_input(path, args.size_mb)
        mb = os.path.getsize(path) / 1024 / 1024
        print(f"input: {n} documents, {mb:.1f} MB; cpus: {os.cpu_count()}")
        print(f"{'workers':>7} {'implementation':<16} {'docs/s':>10} {'MB/s':>8} {'wall s':>8}  ratio  identical")
        for workers in args.workers:
            ours_prefix, ref_prefix = os.path.join(tmp, f"ours{workers}"), os.path.join(tmp, f"ref{workers}")
            docs, nbytes, ref_s = run_upstream_style(path, ref_prefix, workers)
            docs_ours, _, ours_s, wall = run_ours(path, ours_prefix, workers)
            same = all(open(ours_prefix + "_text_document" + ext, "rb").read() == open(ref_prefix + ext, "rb").read()
                       for ext in (".bin", ".idx"))
            assert docs == docs_ours
            print(f"{workers:>7} {'upstream-style':<16} {docs / ref_s:>10.1f} {mb / ref_s:>8.2f} {ref_s:>8.1f}")
            print(f"{workers:>7} {'ours':<16} {docs / ours_s:>10.1f} {mb / ours_s:>8.2f} {wall:>8.1f}  "
                  f"{ref_s / ours_s:4.1f}x  {same}")


if __name__ == "__main__":
    main()
