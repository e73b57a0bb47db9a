"""Tokenizers: ids against independent references, round trips, special ids, build_tokenizer."""

import json
import math
import os
from types import SimpleNamespace

import pytest

from megatron.core.tokenizers import (
    TOKENIZER_TYPES,
    MegatronTokenizer,
    build_tokenizer_from_options,
)
from megatron.core.tokenizers.bert_wordpiece import BertWordPieceCase, BertWordPieceLowerCase
from megatron.core.tokenizers.gpt2_bpe import GPT2BPETokenizer, bytes_to_unicode
from megatron.core.tokenizers.huggingface import HuggingFaceTokenizer
from megatron.core.tokenizers.null_tokenizer import NullTokenizer
from megatron.core.tokenizers.sentencepiece_tokenizers import (
    GPTSentencePieceTokenizer,
    Llama2Tokenizer,
    SentencePieceTokenizer,
)
from megatron.training.tokenizer import _vocab_size_with_padding, build_tokenizer
from tests.harness import REPO

DATA = str(REPO / "tests" / "data")
GPT2_VOCAB = os.path.join(DATA, "gpt2-vocab.json")
GPT2_MERGES = os.path.join(DATA, "gpt2-merges.txt")
SPM_MODEL = os.path.join(DATA, "spm.model")
BERT_VOCAB = os.path.join(DATA, "bert-vocab.txt")
HF_DIR = os.path.join(DATA, "hf-tokenizer")

EDGE_CASES = [
    "",
    " ",
    "  leading and trailing  ",
    "it's they'll we've I'm you'd she's",
    "tabs\tand\nnew\n\nlines\r\n",
    "caf\u00e9 na\u00efve e\u0301 \u00c5ngstr\u00f6m",
    "\u4e2d\u6587 \u65e5\u672c\u8a9e",
    "emoji \U0001f600\U0001f44d\U0001f3fd",
    "numbers 1234567 3.14159 0x1F",
    "non\u00a0breaking\u2003spaces\u3000",
    "<|endoftext|> in text",
    "a" * 300,
]


@pytest.fixture(scope="module")
def corpus():
    """About 24 KB of corpus text (every 40th document, so short and long ones are mixed)."""
    with open(os.path.join(DATA, "corpus.jsonl"), encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for line in f]
    picked = docs[::40]
    assert 15_000 < sum(len(d) for d in picked) < 200_000
    return picked


@pytest.fixture(scope="module")
def gpt2():
    return GPT2BPETokenizer(GPT2_VOCAB, GPT2_MERGES)


# ------------------------------------------------------------------------------------- GPT-2 BPE
def test_bytes_to_unicode_is_a_printable_bijection():
    table = bytes_to_unicode()
    assert sorted(table) == list(range(256))
    assert len(set(table.values())) == 256
    assert all(ch.isprintable() and not ch.isspace() for ch in table.values())
    assert table[ord("A")] == "A" and table[ord(" ")] == "\u0120"  # GPT-2's famous "Ġ"


def test_gpt2_ascii_split_equals_unicode_split():
    import random
    import re

    import regex

    from megatron.core.tokenizers.gpt2_bpe import GPT2_SPLIT_PATTERN, GPT2_SPLIT_PATTERN_ASCII

    unicode_split, ascii_split = (
        regex.compile(GPT2_SPLIT_PATTERN),
        re.compile(GPT2_SPLIT_PATTERN_ASCII, re.ASCII),
    )
    rng = random.Random(0)
    alphabet = [chr(c) for c in range(128)] + list(" \t\n'sdlmtrve") * 4  # favour the tricky pieces
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 30)))
        assert ascii_split.findall(text) == unicode_split.findall(text), repr(text)


def test_gpt2_matches_transformers_and_python_reference(gpt2, corpus):
    from transformers import GPT2Tokenizer

    with open(GPT2_VOCAB, encoding="utf-8") as f:
        vocab = json.load(f)
    with open(GPT2_MERGES, encoding="utf-8") as f:
        merges = [tuple(line.split()) for line in f.read().splitlines()[1:] if line]
    # transformers 5 silently builds an empty tokenizer from vocab_file=/merges_file=; pass the
    # data.
    reference = GPT2Tokenizer(vocab=vocab, merges=merges)
    assert len(reference) == len(vocab)
    slow = GPT2BPETokenizer(GPT2_VOCAB, GPT2_MERGES, use_fast=False)
    assert gpt2.uses_rust  # new words merged by the Rust BPE, checked against the Python merge loop
    # transformers treats a literal "<|endoftext|>" as special; classic Megatron does not.
    texts = corpus + [t for t in EDGE_CASES if "<|endoftext|>" not in t]
    for text in texts:
        ids = gpt2.tokenize(text)
        assert ids == reference(text, add_special_tokens=False).input_ids, text[:80]
        assert ids == slow.tokenize(text), text[:80]
    assert gpt2.tokenize_batch(texts) == [slow.tokenize(t) for t in texts]


def test_gpt2_round_trip_and_special_ids(gpt2, corpus):
    for text in corpus + EDGE_CASES:
        assert gpt2.detokenize(gpt2.tokenize(text)) == text
    assert gpt2.vocab_size == 8192
    assert gpt2.eod == gpt2.vocab["<|endoftext|>"] == 8191
    assert gpt2.inv_vocab[gpt2.eod] == "<|endoftext|>"
    assert gpt2.eos == gpt2.bos == gpt2.eod
    # Classic Megatron semantics: the EOD string inside a document is plain text.
    assert gpt2.eod not in gpt2.tokenize("a <|endoftext|> b")
    with pytest.raises(NotImplementedError, match="pad"):
        gpt2.pad
    with pytest.raises(NotImplementedError, match="mask"):
        gpt2.mask


def test_binary_or_foreign_vocabulary_files_are_named_in_one_short_line(tmp_path):
    binary = tmp_path / "model.bin"
    binary.write_bytes(b"\x00\x01\xff\xfe" * 64)
    # Before: a bare UnicodeDecodeError naming no file.
    with pytest.raises(
        ValueError,
        match=r"model.bin: not a GPT-2 vocab.json \(not UTF-8 text: byte 0xff at offset 2\)",
    ):
        GPT2BPETokenizer(str(binary), GPT2_MERGES)
    with pytest.raises(ValueError, match=r"model.bin: not a GPT-2 merges.txt \(not UTF-8 text"):
        GPT2BPETokenizer(GPT2_VOCAB, str(binary))
    with pytest.raises(ValueError, match=r"model.bin: not a WordPiece vocab.txt \(not UTF-8 text"):
        BertWordPieceLowerCase(str(binary))
    # A wrong --merge-file (here: one line of 1 MB): the error quotes 60 characters of it.
    one_long_line = tmp_path / "corpus.txt"
    one_long_line.write_text("x" * 2**20 + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"corpus.txt:1: not a GPT-2 merges.txt") as info:
        GPT2BPETokenizer(GPT2_VOCAB, str(one_long_line))
    assert len(str(info.value)) < 300, len(str(info.value))
    assert f"... ({2**20} characters)" in str(info.value)


def test_gpt2_bad_files(tmp_path):
    bad_merges = tmp_path / "merges.txt"
    bad_merges.write_text("#version: 0.2\nzzzq qqq\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"merges.txt:2: .*not in"):
        GPT2BPETokenizer(GPT2_VOCAB, str(bad_merges))
    no_eod = tmp_path / "vocab.json"
    with open(GPT2_VOCAB, encoding="utf-8") as f:
        vocab = json.load(f)
    del vocab["<|endoftext|>"]
    no_eod.write_text(json.dumps(vocab), encoding="utf-8")
    with pytest.raises(ValueError, match="endoftext"):
        GPT2BPETokenizer(str(no_eod), GPT2_MERGES)


# ---------------------------------------------------------------------------------- SentencePiece
@pytest.fixture(scope="module")
def spm_processor():
    import sentencepiece

    return sentencepiece.SentencePieceProcessor(model_file=SPM_MODEL)


def test_sentencepiece_ids_equal_the_library(spm_processor, corpus):
    tok = SentencePieceTokenizer(SPM_MODEL)
    gpt = GPTSentencePieceTokenizer(SPM_MODEL)
    for text in corpus + EDGE_CASES:
        expected = spm_processor.encode(text)
        assert tok.tokenize(text) == expected
        assert gpt.tokenize(text) == expected
    assert tok.tokenize_batch(corpus) == spm_processor.encode(corpus)
    for text in corpus:
        assert tok.detokenize(tok.tokenize(text)) == text
        assert gpt.detokenize(gpt.tokenize(text)) == text


def test_sentencepiece_special_tokens(spm_processor):
    size = spm_processor.get_piece_size()
    tok = SentencePieceTokenizer(SPM_MODEL, vocab_extra_ids=3)
    # <CLS> <SEP> <EOD> <MASK> and <PAD> (the model has no pad piece) are appended; bos/eos exist.
    assert [tok.cls, tok.sep, tok.eod, tok.mask, tok.pad] == list(range(size, size + 5))
    assert tok.inv_vocab[tok.pad] == "<PAD>"
    assert (tok.bos, tok.eos) == (spm_processor.bos_id(), spm_processor.eos_id())
    assert tok.additional_special_tokens_ids == [size + 5, size + 6, size + 7]
    assert tok.inv_vocab[size + 7] == "<extra_id_2>"
    assert tok.vocab_size == size + 8
    text = "first part<MASK>second <extra_id_1> third"
    assert tok.tokenize(text) == (
        spm_processor.encode("first part")
        + [tok.mask]
        + spm_processor.encode("second ")
        + [tok.additional_special_tokens_ids[1]]
        + spm_processor.encode(" third")
    )
    assert tok.detokenize(tok.tokenize("a<SEP>b")) == "a <SEP> b"


def test_gpt_sentencepiece_and_llama2(spm_processor, corpus):
    gpt = GPTSentencePieceTokenizer(SPM_MODEL)
    assert gpt.vocab_size == spm_processor.get_piece_size()
    assert gpt.eod == gpt.eos == spm_processor.eos_id()
    assert (gpt.cls, gpt.sep, gpt.mask, gpt.pad) == (-1, -1, -1, -1)
    llama = Llama2Tokenizer(SPM_MODEL)
    text = corpus[0]
    assert llama.tokenize(text) == [spm_processor.bos_id()] + spm_processor.encode(text)
    assert llama.tokenize(text, bos=False, eos=True) == spm_processor.encode(text) + [
        spm_processor.eos_id()
    ]
    assert llama.tokenize_batch([text]) == [llama.tokenize(text)]
    assert llama.detokenize(llama.tokenize(text)) == text
    assert llama.eod == llama.eos == 2 and llama.bos == 1
    assert llama.additional_special_tokens_ids is None


# ----------------------------------------------------------------------------------- HuggingFace
def test_huggingface_local_directory(gpt2, corpus):
    tok = HuggingFaceTokenizer(HF_DIR)
    assert tok.vocab_size == 8192 and tok.eod == tok.eos == 8191
    # The directory holds the same BPE as the GPT-2 files.
    for text in corpus[:10]:
        assert tok.tokenize(text) == gpt2.tokenize(text)
        assert tok.detokenize(tok.tokenize(text)) == text
    assert tok.tokenize_batch(corpus[:3]) == [gpt2.tokenize(t) for t in corpus[:3]]
    with pytest.raises(ValueError, match="--tokenizer-model .*cannot load"):
        HuggingFaceTokenizer(os.path.join(DATA, "no-such-tokenizer-dir"))


# ------------------------------------------------------------------------------------ WordPiece
def test_bert_wordpiece_matches_transformers(corpus):
    from transformers import BertTokenizer

    with open(BERT_VOCAB, encoding="utf-8") as f:
        vocab = {token: i for i, token in enumerate(f.read().split("\n")[:-1])}
    for cls, lower in ((BertWordPieceLowerCase, True), (BertWordPieceCase, False)):
        reference = BertTokenizer(vocab=vocab, do_lower_case=lower)
        fast, slow = cls(BERT_VOCAB), cls(BERT_VOCAB, use_fast=False)
        assert fast.uses_rust
        texts = corpus[:12] + EDGE_CASES[:-1]
        for text in texts:
            ids = slow.tokenize(text)
            assert ids == reference(text, add_special_tokens=False).input_ids, text[:80]
            assert fast.tokenize(text) == ids
        assert fast.tokenize_batch(texts) == [slow.tokenize(t) for t in texts]


def test_bert_wordpiece_special_ids_and_round_trip():
    with open(BERT_VOCAB, encoding="utf-8") as f:
        n = len(f.read().split("\n")[:-1])
    tok = BertWordPieceLowerCase(BERT_VOCAB, vocab_extra_ids=2)
    assert (tok.pad, tok.cls, tok.sep, tok.mask) == (0, 2, 3, 4)
    assert (tok.bos, tok.eos) == (n, n + 1)  # Megatron's BERT tokenizer appends both
    assert tok.additional_special_tokens_ids == [n + 2, n + 3]
    assert tok.inv_vocab[n + 3] == "<extra_id_1>" and tok.vocab_size == n + 4
    assert (
        tok.detokenize(tok.tokenize("Return the Value, unchanged."))
        == "return the value , unchanged ."
    )
    with pytest.raises(NotImplementedError, match="eod"):
        tok.eod
    # BertWordPieceCase built from flags adds 100 sentinels unless --vocab-extra-ids says otherwise.
    case = build_tokenizer_from_options("BertWordPieceCase", vocab_file=BERT_VOCAB)
    assert len(case.additional_special_tokens_ids) == 100 and case.vocab_size == n + 102
    assert (
        len(
            build_tokenizer_from_options(
                "BertWordPieceCase", vocab_file=BERT_VOCAB, vocab_extra_ids=7
            ).additional_special_tokens_ids
        )
        == 7
    )


# ----------------------------------------------------------------------------------------- null
def test_null_tokenizer_classic_semantics():
    tok = NullTokenizer(100)
    # Classic Megatron (<= core_v0.14): N text ids plus one EOD id after them.
    assert tok.vocab_size == 101 and tok.eod == 100 and tok.pad == -1
    assert tok.tokenize("5 17  3\n99") == [5, 17, 3, 99]
    assert tok.detokenize([5, 17, 3]) == "5 17 3"
    assert (tok.cls, tok.sep, tok.mask, tok.bos, tok.eos) == (-1,) * 5
    with pytest.raises(ValueError, match="outside"):
        tok.tokenize("1 101")
    with pytest.raises(ValueError, match="integers"):
        tok.tokenize("1 two")
    assert NullTokenizer(100, eod_id=0, pad_id=7).eod == 0


# ------------------------------------------------------------------------------ build_tokenizer
def _args(**kw):
    defaults = dict(
        rank=0,
        make_vocab_size_divisible_by=128,
        tensor_model_parallel_size=1,
        padded_vocab_size=None,
        vocab_file=None,
        merge_file=None,
        tokenizer_model=None,
        vocab_size=None,
        vocab_extra_ids=0,
    )
    defaults.update(kw)
    return SimpleNamespace(**defaults)


@pytest.mark.parametrize(
    "vocab,divisible,tp",
    [(50257, 128, 1), (50257, 128, 2), (50257, 8, 4), (32000, 64, 8), (8192, 128, 1), (2, 128, 1)],
)
def test_padded_vocab_rule(vocab, divisible, tp, capsys):
    args = _args(
        tokenizer_type="NullTokenizer",
        vocab_size=vocab - 1,
        make_vocab_size_divisible_by=divisible,
        tensor_model_parallel_size=tp,
    )
    tok = build_tokenizer(args)
    multiple = divisible * tp
    expected = math.ceil(vocab / multiple) * multiple
    assert tok.vocab_size == vocab
    assert args.padded_vocab_size == expected
    assert args.padded_vocab_size % multiple == 0 and 0 <= expected - vocab < multiple
    out = capsys.readouterr().out
    assert "> building NullTokenizer tokenizer ..." in out
    assert (
        f" > padded vocab (size: {vocab}) with {expected - vocab} dummy tokens "
        f"(new size: {expected})" in out
    )


def test_padded_vocab_gpt2_size_and_overrides(capsys):
    assert _vocab_size_with_padding(50257, _args()) == 50304
    assert _vocab_size_with_padding(50257, _args(tensor_model_parallel_size=2)) == 50432
    capsys.readouterr()
    args = _args(
        tokenizer_type="GPT2BPETokenizer",
        vocab_file=GPT2_VOCAB,
        merge_file=GPT2_MERGES,
        rank=1,
        padded_vocab_size=9000,
    )
    build_tokenizer(args)
    assert args.padded_vocab_size == 9000
    assert capsys.readouterr().out == ""  # only rank 0 prints
    args = _args(
        tokenizer_type="GPT2BPETokenizer",
        vocab_file=GPT2_VOCAB,
        merge_file=GPT2_MERGES,
        pad_vocab_size=False,
        make_vocab_size_divisible_by=1000,
    )
    build_tokenizer(args)
    assert args.padded_vocab_size == 8192
    with pytest.raises(ValueError, match="--padded-vocab-size 100 is smaller"):
        build_tokenizer(
            _args(
                tokenizer_type="GPT2BPETokenizer",
                vocab_file=GPT2_VOCAB,
                merge_file=GPT2_MERGES,
                padded_vocab_size=100,
            )
        )


def test_missing_files_name_the_flag(tmp_path):
    missing = str(tmp_path / "nope.json")
    with pytest.raises(ValueError, match=f"--vocab-file {missing}: no such file"):
        build_tokenizer(
            _args(tokenizer_type="GPT2BPETokenizer", vocab_file=missing, merge_file=GPT2_MERGES)
        )
    with pytest.raises(ValueError, match="needs --merge-file"):
        build_tokenizer(_args(tokenizer_type="GPT2BPETokenizer", vocab_file=GPT2_VOCAB))
    with pytest.raises(ValueError, match="--tokenizer-model .*no such file"):
        build_tokenizer(
            _args(tokenizer_type="Llama2Tokenizer", tokenizer_model=str(tmp_path / "x.model"))
        )
    with pytest.raises(ValueError, match="needs --vocab-size"):
        build_tokenizer(_args(tokenizer_type="NullTokenizer"))
    with pytest.raises(ValueError, match="not supported"):
        build_tokenizer(_args(tokenizer_type="TikTokenizer"))


def test_every_type_builds_and_identifies_itself():
    files = dict(vocab_file=None, merge_file=None, tokenizer_model=None, vocab_size=None)
    per_type = {
        "BertWordPieceLowerCase": dict(vocab_file=BERT_VOCAB),
        "BertWordPieceCase": dict(vocab_file=BERT_VOCAB),
        "GPT2BPETokenizer": dict(vocab_file=GPT2_VOCAB, merge_file=GPT2_MERGES),
        "SentencePieceTokenizer": dict(tokenizer_model=SPM_MODEL),
        "GPTSentencePieceTokenizer": dict(tokenizer_model=SPM_MODEL),
        "Llama2Tokenizer": dict(tokenizer_model=SPM_MODEL),
        "HuggingFaceTokenizer": dict(tokenizer_model=HF_DIR),
        "NullTokenizer": dict(vocab_size=1000),
    }
    assert set(per_type) == set(TOKENIZER_TYPES)
    identities = set()
    for name, options in per_type.items():
        tok = build_tokenizer_from_options(name, **{**files, **options})
        assert isinstance(tok, MegatronTokenizer) and type(tok).__name__ == name
        ident = json.dumps(tok.unique_identifiers, indent=4)  # dataset caches hash exactly this
        assert name in ident
        identities.add(ident)
    assert len(identities) == len(per_type)
