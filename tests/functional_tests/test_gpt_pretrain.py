"""End-to-end GPT pretraining through torchrun on CPU (gloo): DP, log lines, bit-identical resume.
(DP=2 equals one process at the same global batch: test_distributed_optimizer_e2e's dp2 layout.)"""

import math

import pytest

from tests.functional_tests.runner import (
    TINY_MODEL,
    parse_log_lines,
    read_tensorboard_scalars,
    run_pretrain,
)


def _losses(result):
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = parse_log_lines(result.stdout)
    return {it: d["losses"]["lm loss"] for it, d in lines.items()}


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """DP=2, 20 iterations, TensorBoard on, no checkpoints."""
    tb = tmp_path_factory.mktemp("straight_tb")
    result = run_pretrain(
        TINY_MODEL + ["--train-iters", "20", "--tensorboard-dir", str(tb)], nproc=2
    )
    return result, tb


def test_dp2_loss_decreases_and_log_lines_parse(straight_run):
    result, _ = straight_run
    losses = _losses(result)
    assert sorted(losses) == list(range(1, 21)), (
        "one log line per iteration, each in Megatron's per-iteration log line format"
    )
    first, last = sum(losses[i] for i in (1, 2, 3)) / 3, sum(losses[i] for i in (18, 19, 20)) / 3
    assert last < first - 0.5, (first, last)
    # Initial loss of a random init is close to ln(vocab) (padded vocab 512 at TP=1 for 500 +
    # NullTokenizer).
    assert abs(losses[1] - math.log(512)) < 0.5
    lines = parse_log_lines(result.stdout)
    assert int(lines[20]["consumed"]) == 20 * 8 and int(lines[20]["gbs"]) == 8
    assert (
        " > number of parameters on (tensor, pipeline) model parallel rank (0, 0): "
        in result.stdout
    )
    assert "------------------------ arguments ------------------------" in result.stdout


def test_resume_is_bit_identical(straight_run, tmp_path):
    straight, tb_straight = straight_run
    ckpt = tmp_path / "ckpt"
    first = run_pretrain(
        TINY_MODEL
        + [
            "--train-iters",
            "20",
            "--exit-interval",
            "10",
            "--save",
            str(ckpt),
            "--save-interval",
            "10",
            "--tensorboard-dir",
            str(tmp_path / "tb1"),
        ],
        nproc=2,
    )
    assert first.returncode == 0, first.stderr[-3000:]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "10"
    assert (ckpt / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt").is_file()
    second = run_pretrain(
        TINY_MODEL
        + [
            "--train-iters",
            "20",
            "--load",
            str(ckpt),
            "--save",
            str(ckpt),
            "--save-interval",
            "10",
            "--tensorboard-dir",
            str(tmp_path / "tb2"),
        ],
        nproc=2,
    )
    resumed = _losses(second)
    assert sorted(resumed) == list(range(11, 21))
    ref = read_tensorboard_scalars(tb_straight, "lm loss")
    got = {
        **read_tensorboard_scalars(tmp_path / "tb1", "lm loss"),
        **read_tensorboard_scalars(tmp_path / "tb2", "lm loss"),
    }
    assert sorted(got) == list(range(1, 21))
    for it in range(1, 21):
        assert got[it] == ref[it], f"iteration {it}: resumed {got[it]!r} != straight {ref[it]!r}"
