"""MegatronTokenizer.from_pretrained (Megatron Core's form) gives the same tokenizers as the flag
builder, for every library this framework has, and one clear error otherwise."""

import json
import os

import pytest

from megatron.core.tokenizers import (
    MegatronTokenizer,
    MegatronTokenizerBase,
    build_tokenizer_from_options,
)
from tests.harness import REPO

DATA = str(REPO / "tests" / "data")
TEXT = "Hello world, this is Megatron."


def test_null_libraries_and_the_quickstart_spelling(tmp_path):
    quickstart = MegatronTokenizer.from_pretrained(
        metdata_path={"library": "null-text"}, vocab_size=64
    )
    null = MegatronTokenizer.from_pretrained(metadata_path={"library": "null"}, vocab_size=10)
    assert (quickstart.vocab_size, quickstart.eod) == (65, 64)
    assert (null.vocab_size, null.eod) == (11, 10)
    assert isinstance(null, MegatronTokenizer) and isinstance(null, MegatronTokenizerBase)
    (tmp_path / "tokenizer_metadata.json").write_text(json.dumps({"library": "null-text"}))
    from_file = MegatronTokenizer.from_pretrained(
        metadata_path=str(tmp_path / "tokenizer_metadata.json"), vocab_size=7
    )
    assert from_file.tokenize("1 2 6") == [1, 2, 6]


@pytest.mark.parametrize(
    "library, path, kwargs, tokenizer_type, options",
    [
        ("huggingface", "hf-tokenizer", {}, "HuggingFaceTokenizer", {"tokenizer_model": "hf"}),
        ("sentencepiece", "spm.model", {}, "SentencePieceTokenizer", {"tokenizer_model": "spm"}),
        (
            "megatron",
            "GPT2BPETokenizer",
            {"vocab_file": "gpt2-vocab.json", "merges_file": "gpt2-merges.txt"},
            "GPT2BPETokenizer",
            {"vocab_file": "gpt2-vocab.json", "merge_file": "gpt2-merges.txt"},
        ),
        (
            "megatron",
            "BertWordPieceLowerCase",
            {"vocab_file": "bert-vocab.txt"},
            "BertWordPieceLowerCase",
            {"vocab_file": "bert-vocab.txt"},
        ),
    ],
)
def test_file_libraries_match_the_flag_builder(library, path, kwargs, tokenizer_type, options):
    def data(name):
        return os.path.join(DATA, name)

    files = {"hf": data("hf-tokenizer"), "spm": data("spm.model")}
    if library != "megatron":
        path = data(path)
    kwargs = {k: data(v) for k, v in kwargs.items()}
    options = {k: files.get(v, data(v)) for k, v in options.items()}
    ours = MegatronTokenizer.from_pretrained(path, metadata_path={"library": library}, **kwargs)
    reference = build_tokenizer_from_options(tokenizer_type, **options)
    assert type(ours) is type(reference)
    assert ours.unique_identifiers == reference.unique_identifiers
    assert ours.tokenize(TEXT) == reference.tokenize(TEXT)


def test_errors_are_one_clear_line(tmp_path):
    with pytest.raises(TypeError, match="from_pretrained"):
        MegatronTokenizer()
    with pytest.raises(ValueError, match="library 'tiktoken' is not supported here"):
        MegatronTokenizer.from_pretrained("x.model", metadata_path={"library": "tiktoken"})
    with pytest.raises(ValueError, match="takes no keyword pattern"):
        MegatronTokenizer.from_pretrained(
            metadata_path={"library": "null-text"}, vocab_size=8, pattern="x"
        )
    with pytest.raises(ValueError, match="needs vocab_size="):
        MegatronTokenizer.from_pretrained(metadata_path={"library": "null-text"})
    with pytest.raises(ValueError, match="not both"):
        MegatronTokenizer.from_pretrained(metadata_path={}, metdata_path={}, vocab_size=8)
    with pytest.raises(ValueError, match="tokenizer_metadata.json: No such file"):
        MegatronTokenizer.from_pretrained(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="needs tokenizer_path to name one of"):
        MegatronTokenizer.from_pretrained("gpt2", metadata_path={"library": "megatron"})
    with pytest.raises(ValueError, match="library 'huggingface' needs tokenizer_path"):
        MegatronTokenizer.from_pretrained(metadata_path={"library": "huggingface"})
