"""Bad input to pretrain_gpt.py: one clear line naming the flags, a non-zero exit, no hang."""

import pytest

from tests.functional_tests.runner import TINY_MODEL, parse_log_lines, run_pretrain


def _error_line(result):
    assert result.returncode != 0
    lines = [text for text in result.stderr.splitlines() if "error: " in text]
    assert lines, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    return lines[-1]


@pytest.mark.parametrize(
    "extra, env, words",
    [
        (["--fp16", "--bf16"], {}, ["--fp16", "--bf16"]),
        (
            ["--tensor-model-parallel-size", "4"],
            {"WORLD_SIZE": "6"},
            ["world size (6)", "tensor-model-parallel size (4)"],
        ),
        (["--num-attention-heads", "3", "--hidden-size", "63"], {"WORLD_SIZE": "2"}, []),
        (["--save", "/tmp/never"], {}, ["--save-interval"]),
        # Accepted once, then every rank died in TransformerConfig with a traceback.
        (
            ["--group-query-attention", "--num-query-groups", "1"]
            + ["--tensor-model-parallel-size", "2"],
            {"WORLD_SIZE": "2"},
            ["--num-query-groups (1)", "--tensor-model-parallel-size (2)"],
        ),
    ],
)
def test_contradicting_flags(extra, env, words, tmp_path):
    if extra[:2] == ["--num-attention-heads", "3"]:
        # heads (3) not divisible by TP (2): world 2, TP 2.
        extra = extra + ["--tensor-model-parallel-size", "2"]
        words = ["--num-attention-heads", "3", "2"]
    result = run_pretrain(TINY_MODEL + ["--train-iters", "2"] + extra, extra_env=env, timeout=120)
    line = _error_line(result)
    for w in words:
        assert w in line, line


def test_unknown_flag_is_an_error():
    result = run_pretrain(TINY_MODEL + ["--train-iters", "2", "--no-such-flag"], timeout=120)
    assert result.returncode != 0
    assert "--no-such-flag" in result.stderr


def test_load_from_missing_directory_warns_and_exit_on_missing_fails(tmp_path):
    missing = tmp_path / "nothing_here"
    tracker = missing / "latest_checkpointed_iteration.txt"
    # Without --exit-on-missing-checkpoint: a warning naming the directory, then training
    # from scratch (so --load and --save may name the same, still empty, directory).
    result = run_pretrain(TINY_MODEL + ["--train-iters", "3", "--load", str(missing)], timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (
        f"WARNING: could not find the metadata file {tracker} (directory {missing} does not "
        "exist)\n    will not load any checkpoints and will start from random"
    ) in result.stdout, result.stdout[-2000:]
    assert parse_log_lines(result.stdout).keys() == {1, 2, 3}
    # With it: the same warning, an exit with status 1 and no training.
    result = run_pretrain(
        TINY_MODEL + ["--train-iters", "3", "--load", str(missing), "--exit-on-missing-checkpoint"],
        timeout=120,
    )
    assert result.returncode == 1, result.stderr[-2000:]
    assert (
        f">> WARNING: could not find the metadata file {tracker} (directory {missing} does not "
        "exist); exiting because --exit-on-missing-checkpoint is set"
    ) in result.stdout, result.stdout[-2000:]
    assert parse_log_lines(result.stdout) == {}
    assert "Traceback" not in result.stderr, result.stderr[-2000:]


def test_load_from_corrupt_checkpoint_names_the_file(tmp_path):
    ckpt = tmp_path / "ckpt"
    (ckpt / "iter_0000005" / "mp_rank_00").mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("5")
    bad = ckpt / "iter_0000005" / "mp_rank_00" / "model_optim_rng.pt"
    bad.write_bytes(b"this is not a checkpoint")
    result = run_pretrain(TINY_MODEL + ["--train-iters", "6", "--load", str(ckpt)], timeout=120)
    line = _error_line(result)
    assert str(bad) in line
    (ckpt / "latest_checkpointed_iteration.txt").write_text("garbage")
    result = run_pretrain(TINY_MODEL + ["--train-iters", "6", "--load", str(ckpt)], timeout=120)
    line = _error_line(result)
    assert "latest_checkpointed_iteration.txt" in line and "garbage" in line
