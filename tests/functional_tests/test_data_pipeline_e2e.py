"""Preprocess the shipped corpus, then train and validate on it through torchrun (2 processes)."""

import subprocess
import sys

from tests.functional_tests.runner import REPO, env_for_tests, parse_log_lines, run_pretrain

MODEL = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "64",
    "--max-position-embeddings",
    "64",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--lr",
    "3e-3",
    "--train-iters",
    "8",
    "--eval-interval",
    "4",
    "--eval-iters",
    "2",
    "--log-interval",
    "1",
    "--tokenizer-type",
    "GPT2BPETokenizer",
    "--vocab-file",
    "tests/data/gpt2-vocab.json",
    "--merge-file",
    "tests/data/gpt2-merges.txt",
    "--num-workers",
    "0",
]


def test_preprocess_then_train_and_validate(tmp_path):
    prefix = tmp_path / "corpus"
    pre = subprocess.run(
        [
            sys.executable,
            "tools/preprocess_data.py",
            "--input",
            "tests/data/corpus.jsonl",
            "--output-prefix",
            str(prefix),
            "--tokenizer-type",
            "GPT2BPETokenizer",
            "--vocab-file",
            "tests/data/gpt2-vocab.json",
            "--merge-file",
            "tests/data/gpt2-merges.txt",
            "--append-eod",
            "--workers",
            "2",
        ],
        cwd=REPO,
        env=env_for_tests(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert pre.returncode == 0, pre.stderr[-2000:]
    data = f"{prefix}_text_document"
    result = run_pretrain(
        MODEL
        + ["--data-path", data, "--split", "98,1,1", "--data-cache-path", str(tmp_path / "cache")],
        nproc=2,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    lines = parse_log_lines(result.stdout)
    assert sorted(lines) == list(range(1, 9))
    # vocab 8192 (a multiple of 128): the first loss is about ln(8192) = 9.01.
    assert abs(lines[1]["losses"]["lm loss"] - 9.01) < 0.5
    assert lines[8]["losses"]["lm loss"] < lines[1]["losses"]["lm loss"]
    assert " validation loss at iteration 4 | lm loss value: " in result.stdout
    assert " validation loss at iteration 8 on test set | lm loss value: " in result.stdout


def test_missing_data_path_is_one_clear_error(tmp_path):
    missing = tmp_path / "no_such_prefix"
    result = run_pretrain(MODEL + ["--data-path", str(missing), "--split", "98,1,1"], timeout=120)
    assert result.returncode != 0
    assert str(missing) in result.stderr
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
