#!/usr/bin/env python3
"""Rebuild the test corpus and tokenizer files in ``tests/data`` from text on this machine.

Nothing is downloaded. The text is English documentation that ships with CPython (PSF License
Version 2, see tests/data/README.md):

* ``corpus.jsonl``  - docstrings of the standard library, parsed with ``ast`` (never imported):
  one document per module docstring, per top-level function, and per top-level class (the class
  docstring followed by its methods' docstrings). Keys ``text`` and ``source``.
* ``topics.jsonl``  - the Python Language Reference topics that ``pydoc`` ships
  (``pydoc_data.topics``). Keys ``title`` and ``body`` (for ``--json-keys`` tests).

Tokenizer files trained on both (all training here is single-threaded or order-independent, so
the output is byte-identical on every run with the same Python / tokenizers / sentencepiece):

* ``gpt2-vocab.json`` + ``gpt2-merges.txt`` - byte-level BPE in GPT-2 format, 8192 ids,
  ``<|endoftext|>`` last (id 8191) as in GPT-2.
* ``spm.model`` - SentencePiece BPE, 6000 pieces, Llama-style (byte fallback, identity
  normalisation, whitespace kept), unk/bos/eos = 0/1/2, no pad.
* ``bert-vocab.txt`` - uncased WordPiece, 8000 entries, ``[PAD] [UNK] [CLS] [SEP] [MASK]`` first.
* ``hf-tokenizer/`` - the GPT-2 BPE above as a Hugging Face fast-tokenizer directory.
* ``LICENSE-python.txt`` - CPython's licence file (the PSF License asks derivatives to keep it).

Usage: ``python tools/build_test_assets.py [--output-dir tests/data]``. The exact bytes depend on
the CPython patch release the stdlib comes from (3.11.7 here); another release gives a slightly
different, equally valid corpus, and the script says so.
"""

import argparse
import ast
import io
import json
import os
import shutil
import sys
import sysconfig
from pathlib import Path

BUILT_WITH_PYTHON = (3, 11, 7)
GPT2_VOCAB_SIZE = 8192
SPM_VOCAB_SIZE = 6000
WORDPIECE_VOCAB_SIZE = 8000
MIN_DOC_CHARS = 40
EOD = "<|endoftext|>"

# Test suites, generated tables and vendored code carry little prose or a different licence.
_EXCLUDED_PREFIXES = (
    "test/",
    "idlelib/idle_test/",
    "lib2to3/tests/",
    "tkinter/test/",
    "unittest/test/",
    "ctypes/test/",
    "distutils/tests/",
    "site-packages/",
    "encodings/",
    "pydoc_data/",
    "__phello__/",
    "ensurepip/_bundled/",
    "config-",
)


def _docstring(node) -> str:
    text = ast.get_docstring(node, clean=True)
    return text.strip() if text else ""


def stdlib_documents(stdlib: Path):
    """Yield (source, text) for the docstring documents of the standard library, in path order."""
    seen = set()
    for path in sorted(stdlib.rglob("*.py"), key=lambda p: p.relative_to(stdlib).as_posix()):
        rel = path.relative_to(stdlib).as_posix()
        if rel.startswith(_EXCLUDED_PREFIXES) or "/test/" in rel or "/tests/" in rel:
            continue
        try:
            tree = ast.parse(path.read_bytes(), filename=rel)
        except (SyntaxError, ValueError):
            continue
        pieces = [("", _docstring(tree))]
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                parts = [_docstring(node)] + [
                    _docstring(n)
                    for n in node.body
                    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                ]
                pieces.append((node.name, "\n\n".join(p for p in parts if p)))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                pieces.append((node.name, _docstring(node)))
        for name, text in pieces:
            if len(text) < MIN_DOC_CHARS or text in seen:
                continue
            seen.add(text)
            yield (f"python-stdlib:{rel}" + (f"#{name}" if name else "")), text


def topic_documents():
    from pydoc_data.topics import topics

    for title in sorted(topics):
        body = topics[title].strip()
        if body:
            yield title, body


def write_jsonl(path: Path, records) -> int:
    count = 0
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            count += 1
    return count


def train_gpt2_bpe(texts, out_dir: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=GPT2_VOCAB_SIZE - 1,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(texts, trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    vocab = dict(sorted(model["vocab"].items(), key=lambda kv: kv[1]))
    if EOD in vocab:
        raise RuntimeError(f"{EOD} learnt as a regular token")
    vocab[EOD] = len(vocab)  # GPT-2 keeps EOD as the very last id
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    with open(out_dir / "gpt2-vocab.json", "w", encoding="utf-8", newline="\n") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(out_dir / "gpt2-merges.txt", "w", encoding="utf-8", newline="\n") as f:
        f.write("#version: 0.2\n")
        for m in merges:
            f.write(m + "\n")
    return vocab, merges


def write_hf_dir(vocab, merges, out_dir: Path):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOD, special=True, normalized=False)])
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "tokenizer.json", "w", encoding="utf-8", newline="\n") as f:
        f.write(json.dumps(json.loads(tok.to_str()), ensure_ascii=False, sort_keys=True) + "\n")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOD,
        "eos_token": EOD,
        "unk_token": EOD,
        "model_max_length": 1024,
        "clean_up_tokenization_spaces": False,
    }
    with open(out_dir / "tokenizer_config.json", "w", encoding="utf-8", newline="\n") as f:
        f.write(json.dumps(config, indent=2, sort_keys=True) + "\n")


def train_sentencepiece(texts, out_dir: Path):
    import sentencepiece as spm

    lines = [line for t in texts for line in t.split("\n") if line.strip()]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        vocab_size=SPM_VOCAB_SIZE,
        model_type="bpe",
        character_coverage=1.0,
        byte_fallback=True,
        split_digits=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        max_sentence_length=16384,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        num_threads=1,
        input_sentence_size=0,
        shuffle_input_sentence=False,
        minloglevel=2,
    )
    (out_dir / "spm.model").write_bytes(model.getvalue())


def train_wordpiece(texts, out_dir: Path):
    # tokenizers' WordPiece trainer (and its BPE trainer with a "##" prefix) break frequency ties
    # in hash order, giving a different vocab on every run. SentencePiece BPE is deterministic, so
    # learn the pieces with it on BERT-normalised words and convert: a piece that starts a word
    # ("\u2581x") becomes "x", any other piece "##x"; every character gets both forms.
    import sentencepiece as spm
    from tokenizers import normalizers, pre_tokenizers

    normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=True
    )
    splitter = pre_tokenizers.BertPreTokenizer()
    lines, chars = [], set()
    for text in texts:
        for line in text.split("\n"):
            words = [w for w, _ in splitter.pre_tokenize_str(normalizer.normalize_str(line))]
            if words:
                lines.append(" ".join(words))
                chars.update("".join(words))
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    alphabet = sorted(chars)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        model_type="bpe",
        vocab_size=WORDPIECE_VOCAB_SIZE - len(special) - len(alphabet),
        character_coverage=1.0,
        normalization_rule_name="identity",
        split_digits=False,
        max_sentence_length=16384,
        num_threads=1,
        input_sentence_size=0,
        shuffle_input_sentence=False,
        unk_id=0,
        bos_id=-1,
        eos_id=-1,
        pad_id=-1,
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    vocab = dict.fromkeys(special + alphabet + ["##" + c for c in alphabet])
    for i in range(sp.get_piece_size()):
        if sp.is_unknown(i) or sp.is_control(i):
            continue
        piece = sp.id_to_piece(i)
        token = piece[1:] if piece.startswith("\u2581") else "##" + piece
        if token and token != "##":
            vocab.setdefault(token)
    with open(out_dir / "bert-vocab.txt", "w", encoding="utf-8", newline="\n") as f:
        for token in list(vocab)[:WORDPIECE_VOCAB_SIZE]:
            f.write(token + "\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--output-dir", default=str(Path(__file__).resolve().parent.parent / "tests" / "data")
    )
    args = parser.parse_args(argv)
    # The Rust trainers are order-independent, but keep them single-threaded for byte-identical
    # output.
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if sys.version_info[:3] != BUILT_WITH_PYTHON:
        print(
            "note: the committed corpus was built from "
            f"CPython {'.'.join(map(str, BUILT_WITH_PYTHON))}'s stdlib; "
            f"this is {sys.version.split()[0]}, so the files will differ slightly",
            file=sys.stderr,
        )
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])

    shutil.copyfile(stdlib / "LICENSE.txt", out / "LICENSE-python.txt")
    docs = list(stdlib_documents(stdlib))
    n_docs = write_jsonl(
        out / "corpus.jsonl", ({"text": text, "source": src} for src, text in docs)
    )
    topics = list(topic_documents())
    n_topics = write_jsonl(
        out / "topics.jsonl", ({"title": title, "body": body} for title, body in topics)
    )
    texts = [text for _, text in docs] + [body for _, body in topics]

    vocab, merges = train_gpt2_bpe(texts, out)
    write_hf_dir(vocab, merges, out / "hf-tokenizer")
    train_sentencepiece(texts, out)
    train_wordpiece(texts, out)

    total = 0
    for path in sorted(out.rglob("*")):
        if path.is_file() and path.name != "README.md":
            size = path.stat().st_size
            total += size
            print(f"{path.relative_to(out).as_posix():32s} {size:>10,d} bytes")
    print(f"{'total':32s} {total:>10,d} bytes  ({n_docs} corpus documents, {n_topics} topics)")


if __name__ == "__main__":
    main()
