"""tools/checkpoint/convert.py reshards the checkpoints pretrain_gpt.py writes (NullTokenizer and
GPT-2 BPE), and its --help lists the plugins' flags."""

import subprocess
import sys

import pytest

from tests.functional_tests.runner import REPO, TINY_MODEL, env_for_tests, run_pretrain

GPT2_TOKENIZER = [
    "--tokenizer-type",
    "GPT2BPETokenizer",
    "--vocab-file",
    str(REPO / "tests/data/gpt2-vocab.json"),
    "--merge-file",
    str(REPO / "tests/data/gpt2-merges.txt"),
]


def _convert(*argv):
    cmd = [sys.executable, str(REPO / "tools/checkpoint/convert.py"), *map(str, argv)]
    return subprocess.run(
        cmd, cwd=REPO, env=env_for_tests(), capture_output=True, text=True, timeout=120
    )


def _with_tokenizer(tokenizer):
    args = list(TINY_MODEL)
    at = args.index("--tokenizer-type")
    del args[at : at + 4]  # NullTokenizer --vocab-size 500
    return args + tokenizer


@pytest.mark.parametrize("tokenizer", ["null", "gpt2"])
def test_converter_reshards_a_trainer_checkpoint(tmp_path, tokenizer):
    # Before: "--tokenizer-type NullTokenizer needs --vocab-size" (and the GPT-2 files) from
    # the core saver, for every checkpoint the trainer writes.
    flags = TINY_MODEL if tokenizer == "null" else _with_tokenizer(GPT2_TOKENIZER)
    ckpt, tp2 = tmp_path / "ckpt", tmp_path / "tp2"
    saved = run_pretrain(
        flags + ["--train-iters", "3", "--save", str(ckpt), "--save-interval", "3"], timeout=120
    )
    assert saved.returncode == 0, saved.stderr[-3000:]
    result = _convert(
        "--model-type", "GPT", "--loader", "core", "--saver", "core", "--load-dir", ckpt,
        "--save-dir", tp2, "--target-tensor-parallel-size", "2",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    expected = "--vocab-size 500" if tokenizer == "null" else GPT2_TOKENIZER[3]
    assert expected in result.stdout, result.stdout[-2000:]
    assert sorted(p.name for p in (tp2 / "iter_0000003").iterdir()) == ["mp_rank_00", "mp_rank_01"]
    if tokenizer == "null":  # the resharded checkpoint trains on at TP=2
        resumed = run_pretrain(
            flags
            + ["--train-iters", "4", "--load", str(tp2), "--tensor-model-parallel-size", "2"]
            + ["--no-load-optim"],  # the converter writes the weights only
            nproc=2,
            timeout=120,
        )
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert "iteration        4/" in resumed.stdout, resumed.stdout[-2000:]


def test_help_lists_the_plugins_flags():
    result = _convert("--help")
    assert result.returncode == 0, result.stderr
    for flag in ("--target-tensor-parallel-size", "--true-vocab-size", "--load-dir"):
        assert flag in result.stdout, result.stdout
