#!/usr/bin/env python3
"""Tokenize a JSON-lines corpus into Megatron ``.bin/.idx`` datasets.

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json \\
        --merge-file gpt2-merges.txt \\
        --append-eod --workers 8

writes ``data/corpus_text_document.bin/.idx`` (one ``<prefix>_<key>_<level>`` pair per
``--json-keys`` key; level ``sentence`` with ``--split-sentences``, else ``document``).

How it runs: the main process streams the input lines (plain or ``.gz``; every file a glob
matches, in sorted order) in batches of 256 lines (or 1 MB) to ``--workers`` processes, each
with its own single-threaded tokenizer, keeps a bounded window of batches in flight and appends
the results in input order. A worker returns a whole batch as numpy arrays (the tokenizer's
``tokenize_batch_packed``; no Python int per token), which the main process writes with one
``write`` per batch and key. JSON is parsed with ``orjson`` when it is installed (the ``json``
module otherwise, and always for lines orjson rejects, so results and messages are the same).
Memory stays bounded whatever the input size. The final line gives throughput and the CPU
seconds of all processes. Outputs are written under temporary names and renamed
only when everything succeeded; a bad line stops the run with ``<file>:<line>: <reason>``,
exit status 1 and no output that looks complete. Blank lines are skipped; a document whose
text is empty is kept as an empty document (Megatron's tool also adds a document for it).

Differences from Megatron's tool, all deliberate:

* ``--partitions`` splits the work the same way for any value (one ordered pipeline over all
  files), so the output is identical for every ``--partitions``, and no per-partition files
  are left behind. It must still divide ``--workers``, which Megatron's tool asserts too.
  ``--keep-sequential-samples``
  is therefore always in effect (documents keep the input order).
* ``--split-sentences`` completes in one run for any ``--partitions`` (Megatron's tool needs
  a second run with one partition) and works offline: NLTK punkt when installed with its data,
  else the built-in splitter of ``megatron/core/tokenizers/sentence_splitter.py``.
* ``--find-optimal-num-workers`` / ``--workers-to-check`` / ``--max-documents`` are not provided.
"""

import argparse
import collections
import glob
import gzip
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Dict, Iterator, List, NamedTuple, Optional, Tuple

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

import multiprocessing  # noqa: E402

try:
    import resource  # noqa: E402
except ImportError:  # not on Windows; the CPU figure then covers the main process only
    resource = None

import numpy as np  # noqa: E402

from megatron.training.arguments import add_tokenizer_args  # noqa: E402

try:  # only when already installed; results never depend on it (see _parse_line)
    from orjson import loads as _fast_loads
except ImportError:
    _fast_loads = None

BATCH_LINES = 256
BATCH_BYTES = 1 << 20
BATCHES_IN_FLIGHT_PER_WORKER = 4


class InputError(Exception):
    """Bad input data; the message is ``<file>:<line>: <reason>`` (or ``<file>: <reason>``)."""


# --------------------------------------------------------------------------------------- flags
def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Tokenize JSON lines into Megatron .bin/.idx datasets.", allow_abbrev=False
    )
    g = parser.add_argument_group("input data")
    g.add_argument(
        "--input",
        type=str,
        required=True,
        help="JSON-lines file (.gz allowed) or a glob of them, read in sorted order.",
    )
    g.add_argument(
        "--json-keys", nargs="+", default=["text"], help="Keys to extract; one dataset per key."
    )
    g.add_argument("--split-sentences", action="store_true", help="One sequence per sentence.")
    g.add_argument(
        "--keep-newlines",
        action="store_true",
        help="With --split-sentences, keep newlines between sentences.",
    )
    g.add_argument(
        "--lang", type=str, default="english", help="NLTK punkt language for --split-sentences."
    )
    add_tokenizer_args(parser)  # the exact tokenizer flags of pretrain_gpt.py
    g = parser.add_argument_group("tokenization process")
    g.add_argument(
        "--append-eod",
        action="store_true",
        help="Append the end-of-document token to each document.",
    )
    g = parser.add_argument_group("output data")
    g.add_argument("--output-prefix", type=str, required=True, help="Prefix of the output files.")
    g = parser.add_argument_group("runtime")
    g.add_argument("--workers", type=int, required=True, help="Tokenizing worker processes.")
    g.add_argument(
        "--partitions",
        type=int,
        default=1,
        help="Must divide --workers; the output does not depend on it.",
    )
    g.add_argument(
        "--log-interval", type=int, default=1000, help="Report progress every N documents."
    )
    g.add_argument(
        "--keep-sequential-samples",
        action="store_true",
        help="Keep input order (always the case here; accepted for compatibility).",
    )
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers must be at least 1, got {args.workers}")
    if args.partitions < 1:
        parser.error(f"--partitions must be at least 1, got {args.partitions}")
    if args.workers % args.partitions != 0:
        parser.error(
            f"--workers {args.workers} must be divisible by --partitions {args.partitions}"
        )
    if args.log_interval < 1:
        parser.error(f"--log-interval must be at least 1, got {args.log_interval}")
    if args.keep_newlines and not args.split_sentences:
        print(
            "note: --keep-newlines only changes --split-sentences output; "
            "documents always keep their newlines",
            file=sys.stderr,
        )
    if len(set(args.json_keys)) != len(args.json_keys):
        parser.error(f"--json-keys names a key twice: {' '.join(args.json_keys)}")
    if args.tokenizer_type is None:
        parser.error("--tokenizer-type is required")
    # build_tokenizer reads these; the padded size it computes is unused here, and rank 1 keeps
    # its build/padding messages out of the tool's output.
    args.rank = 1
    args.make_vocab_size_divisible_by = getattr(args, "make_vocab_size_divisible_by", 128)
    args.tensor_model_parallel_size = 1
    return args


def input_files(pattern: str) -> List[str]:
    files = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
    if not files:
        raise InputError(f"--input {pattern}: no file matches")
    for path in files:
        if not os.path.isfile(path):
            raise InputError(f"--input {path}: no such file")
    return files


# ------------------------------------------------------------------------------------- workers
class _Worker:
    """Per-process state: the tokenizer and the sentence splitter (built once per worker)."""

    tokenizer = None
    splitter = None
    keys: List[str] = []
    eod: Optional[int] = None
    dtype = None


def _init_worker(args: argparse.Namespace, dtype, tokenizer=None) -> None:
    # One tokenizing thread per worker process: the workers are the parallelism.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if tokenizer is None:
        from megatron.training.tokenizer import build_tokenizer

        tokenizer = build_tokenizer(args)
    _Worker.tokenizer = tokenizer
    _Worker.keys = list(args.json_keys)
    _Worker.eod = _Worker.tokenizer.eod if args.append_eod else None
    _Worker.dtype = dtype
    _Worker.splitter = None
    if args.split_sentences:
        from megatron.core.tokenizers.sentence_splitter import SentenceSplitter

        _Worker.splitter = SentenceSplitter(lang=args.lang, keep_newlines=args.keep_newlines)


class KeyResult(NamedTuple):
    tokens: np.ndarray  # all token ids of the batch for one key, in the dataset dtype
    sequence_lengths: np.ndarray  # int32, one per non-empty sentence (or document)
    sequences_per_doc: np.ndarray  # int64, one per document


class BatchResult(NamedTuple):
    documents: int
    nbytes: int
    per_key: Dict[str, KeyResult]
    error: Optional[Tuple[int, str]]  # (line offset in the batch, reason)


def _parse_line_exactly(line: bytes, keys: List[str]):
    """The texts of ``keys`` in one JSON line, or a string saying what is wrong with it."""
    try:
        record = json.loads(line)
    except UnicodeDecodeError as e:
        return f"not valid UTF-8 ({e.reason} at byte {e.start})"
    except json.JSONDecodeError as e:
        return f"malformed JSON: {e.msg} (column {e.colno})"
    if not isinstance(record, dict):
        return f"expected a JSON object, got {type(record).__name__}"
    texts = []
    for key in keys:
        if key not in record:
            present = ", ".join(repr(k) for k in list(record)[:10])
            return (
                f"missing key '{key}' (the object has {present or 'no keys'}; "
                "choose with --json-keys)"
            )
        value = record[key]
        if not isinstance(value, str):
            return f"key '{key}' holds {type(value).__name__}, expected a string"
        texts.append(value)
    return texts


def _parse_line(line: bytes, keys: List[str]):
    """``_parse_line_exactly``, through orjson (when installed) for lines that are fine.

    orjson is about 3x faster than ``json`` but rejects some lines ``json`` accepts (NaN, a
    byte-order mark, lone surrogates, ...) and reads huge integers as floats. Its result is used
    only when it is a dict whose keys all hold strings, which ``json`` decodes to the same texts;
    anything else goes through ``json`` so results and messages do not depend on orjson.
    """
    if _fast_loads is not None:
        try:
            record = _fast_loads(line)
        except ValueError:
            record = None
        if type(record) is dict:
            texts = [record.get(key) for key in keys]
            if all(type(text) is str for text in texts):
                return texts
    return _parse_line_exactly(line, keys)


def encode_batch(lines: List[bytes]) -> BatchResult:
    """Tokenize a batch of JSON lines (runs in a worker)."""
    keys, splitter, tokenizer = _Worker.keys, _Worker.splitter, _Worker.tokenizer
    docs: List[List[str]] = []  # per document, per key
    for offset, line in enumerate(lines):
        if not line.strip():
            continue
        parsed = _parse_line(line, keys)
        if isinstance(parsed, str):
            return BatchResult(0, 0, {}, (offset, parsed))
        docs.append(parsed)
    per_key = {}
    for k, key in enumerate(keys):
        if splitter is None:
            sentences = [doc[k] for doc in docs]
            counts = np.ones(len(docs), dtype=np.int64)
        else:
            sentences, count_list = [], []
            for doc in docs:
                parts = splitter.split(doc[k])
                sentences.extend(parts)
                count_list.append(len(parts))
            counts = np.asarray(count_list, dtype=np.int64)
        try:
            tokens, lengths = tokenizer.tokenize_batch_packed(sentences, _Worker.dtype)
        except ValueError:  # e.g. NullTokenizer text that is not integers: find the document
            return BatchResult(0, 0, {}, _locate_tokenizer_error(lines, keys, k))
        per_key[key] = _pack(tokens, lengths, counts, _Worker.eod)
    return BatchResult(len(docs), sum(len(line) for line in lines), per_key, None)


def _locate_tokenizer_error(lines: List[bytes], keys: List[str], k: int) -> Tuple[int, str]:
    for offset, line in enumerate(lines):
        if line.strip():
            try:
                _Worker.tokenizer.tokenize(_parse_line(line, keys)[k])
            except ValueError as e:
                return offset, f"key '{keys[k]}': {e}"
    return 0, f"key '{keys[k]}': the tokenizer rejected this batch"


def _pack(
    tokens: np.ndarray, lengths: np.ndarray, counts: np.ndarray, eod: Optional[int]
) -> KeyResult:
    """One key's sentences as documents: drop empty sentences, append EOD to each non-empty
    document.

    ``tokens`` are the sentences' ids back to back, ``lengths`` the ids per sentence, ``counts``
    the sentences per document. EOD belongs to the document's last sequence (Megatron's encoder
    adds it to the last sentence's length).
    """
    documents = len(counts)
    doc_of_sentence = np.repeat(np.arange(documents), counts)
    kept = lengths > 0
    sequence_lengths = lengths[kept]
    sequences_per_doc = np.bincount(doc_of_sentence[kept], minlength=documents)
    if eod is not None:
        nonempty = sequences_per_doc > 0
        sentence_ends = np.concatenate(([0], np.cumsum(lengths)))
        doc_token_ends = sentence_ends[np.cumsum(counts)]
        tokens = np.insert(tokens, doc_token_ends[nonempty], eod)
        sequence_lengths[np.cumsum(sequences_per_doc)[nonempty] - 1] += 1
    return KeyResult(tokens, sequence_lengths.astype(np.int32), sequences_per_doc.astype(np.int64))


# ---------------------------------------------------------------------------------- main side
class _Batch(NamedTuple):
    path: str
    first_line: int
    lines: List[bytes]


def read_batches(files: List[str]) -> Iterator[_Batch]:
    """Stream the input files as batches of raw lines; never holds more than one batch."""
    for path in files:
        opener = gzip.open if path.endswith(".gz") else open
        lineno, saw_line = 0, False
        batch: List[bytes] = []
        nbytes, first = 0, 1
        try:
            with opener(path, "rb") as stream:
                for lineno, line in enumerate(stream, 1):
                    saw_line = saw_line or bool(line.strip())
                    batch.append(line)
                    nbytes += len(line)
                    if len(batch) >= BATCH_LINES or nbytes >= BATCH_BYTES:
                        yield _Batch(path, first, batch)
                        batch, nbytes, first = [], 0, lineno + 1
        except (OSError, EOFError, gzip.BadGzipFile) as e:
            raise InputError(f"{path}:{lineno + 1}: cannot read: {e}") from None
        if batch:
            yield _Batch(path, first, batch)
        if not saw_line:
            raise InputError(f"{path}: empty input (no JSON lines)")


def output_prefixes(args) -> Dict[str, str]:
    level = "sentence" if args.split_sentences else "document"
    return {key: f"{args.output_prefix}_{key}_{level}" for key in args.json_keys}


class _Outputs:
    """One builder per key writing to temporary names; ``commit`` renames, ``discard`` deletes."""

    SUFFIX = ".partial"

    def __init__(self, prefixes: Dict[str, str], dtype):
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

        self.prefixes = prefixes
        self.builders = {}
        # An existing pair under these names stays until this run's pair is complete: a failed
        # re-run must not lose a good dataset.
        for key, prefix in prefixes.items():
            self.builders[key] = IndexedDatasetBuilder(prefix + ".bin" + self.SUFFIX, dtype=dtype)
        self.sequences = 0
        self.tokens = 0

    def add(self, result: BatchResult) -> None:
        for key, packed in result.per_key.items():
            self.builders[key].add_documents(
                packed.tokens, packed.sequence_lengths, packed.sequences_per_doc
            )
            self.sequences += len(packed.sequence_lengths)
            self.tokens += len(packed.tokens)

    def commit(self) -> None:
        for key, builder in self.builders.items():
            builder.finalize(self.prefixes[key] + ".idx" + self.SUFFIX)
        # The old .idx goes first, then .bin, then .idx: an interruption leaves at worst a .bin
        # without its .idx (no reader takes it for a dataset), never a new .bin with an old .idx.
        renamed = []
        try:
            for prefix in self.prefixes.values():
                if os.path.exists(prefix + ".idx"):
                    os.remove(prefix + ".idx")
                for ext in (".bin", ".idx"):
                    os.replace(prefix + ext + self.SUFFIX, prefix + ext)
                    renamed.append(prefix + ext)
        except OSError:
            for path in renamed:  # all keys or none
                os.remove(path)
            raise

    def discard(self) -> None:
        for key, builder in self.builders.items():
            builder.abort()
            for ext in (".bin", ".idx"):
                path = self.prefixes[key] + ext + self.SUFFIX
                if os.path.exists(path):
                    os.remove(path)


def cpu_seconds() -> Tuple[float, float]:
    """CPU seconds (user + system) of this process and of its finished child processes."""
    if resource is None:
        return time.process_time(), 0.0
    own, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def _mp_context():
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else "spawn")


def preprocess(args: argparse.Namespace) -> Dict[str, str]:
    """Run the whole job; returns the output prefix per key. Raises InputError on bad data."""
    from megatron.core.datasets.indexed_dataset import optimal_dtype
    from megatron.training.tokenizer import build_tokenizer

    files = input_files(args.input)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the workers are the parallelism
    tokenizer = build_tokenizer(args)  # fail on bad tokenizer flags before any worker starts
    if args.append_eod:
        try:
            tokenizer.eod
        except NotImplementedError as e:
            raise InputError(f"--append-eod: {e}") from None
    dtype = optimal_dtype(tokenizer.vocab_size)
    prefixes = output_prefixes(args)
    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
    print(
        f"Tokenizer {args.tokenizer_type} (vocab size {tokenizer.vocab_size}, tokens stored as "
        f"{np.dtype(dtype).name}); {len(files)} input file(s); {args.workers} worker(s)",
        file=sys.stderr,
    )
    if args.split_sentences:
        from megatron.core.tokenizers.sentence_splitter import SentenceSplitter

        backend = SentenceSplitter(lang=args.lang).backend
        if backend != "nltk-punkt" and args.lang != "english":
            print(
                "note: NLTK punkt is unavailable; "
                "the built-in sentence rules are English-oriented "
                f"(--lang {args.lang})",
                file=sys.stderr,
            )
        print(f"Sentence splitter: {backend}", file=sys.stderr)

    outputs = _Outputs(prefixes, dtype)
    pending: "collections.deque" = collections.deque()
    documents = nbytes = 0
    next_report = args.log_interval
    start, cpu_start = time.time(), cpu_seconds()
    context = _mp_context()
    # Forked workers inherit the tokenizer built above instead of each reading the vocab again.
    inherited = tokenizer if context.get_start_method() == "fork" else None
    executor = ProcessPoolExecutor(
        max_workers=args.workers,
        mp_context=context,
        initializer=_init_worker,
        initargs=(args, dtype, inherited),
    )
    try:

        def collect_one():
            nonlocal documents, nbytes, next_report
            batch, future = pending.popleft()
            result = future.result()
            if result.error is not None:
                offset, reason = result.error
                raise InputError(f"{batch.path}:{batch.first_line + offset}: {reason}")
            outputs.add(result)
            documents += result.documents
            nbytes += result.nbytes
            if documents >= next_report:
                elapsed = max(time.time() - start, 1e-9)
                print(
                    f"Processed {documents} documents ({documents / elapsed:.2f} docs/s, "
                    f"{nbytes / elapsed / 1024 / 1024:.2f} MB/s).",
                    file=sys.stderr,
                    flush=True,
                )
                next_report = (documents // args.log_interval + 1) * args.log_interval

        window = args.workers * BATCHES_IN_FLIGHT_PER_WORKER
        for batch in read_batches(files):
            pending.append((batch, executor.submit(encode_batch, batch.lines)))
            if len(pending) >= window:
                collect_one()
        while pending:
            collect_one()
        outputs.commit()
    except BrokenProcessPool:
        outputs.discard()
        raise InputError(
            "a worker process died unexpectedly (out of memory, killed, or failed to start); "
            "no output was written"
        ) from None
    except BaseException:
        outputs.discard()
        raise
    finally:
        for _, future in pending:
            future.cancel()
        executor.shutdown(wait=True, cancel_futures=True)
    elapsed = max(time.time() - start, 1e-9)
    main_cpu, workers_cpu = (now - then for now, then in zip(cpu_seconds(), cpu_start))
    print(
        f"Done: {documents} documents, {outputs.sequences} sequences, {outputs.tokens} tokens in "
        f"{elapsed:.1f} s ({documents / elapsed:.2f} docs/s, "
        f"{nbytes / elapsed / 1024 / 1024:.2f} MB/s); "
        f"CPU {main_cpu + workers_cpu:.2f} s (main process {main_cpu:.2f} s, "
        f"workers {workers_cpu:.2f} s).",
        file=sys.stderr,
    )
    for prefix in prefixes.values():
        print(f"Wrote {prefix}.bin and {prefix}.idx", file=sys.stderr)
    return prefixes


def main(argv: Optional[List[str]] = None) -> int:
    args = get_args(argv)
    try:
        preprocess(args)
    except (InputError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; no output was written", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
