"""Every logging option at 2 processes: a collective reached by only some ranks (the TensorBoard
writer lives on the last rank alone) is a hang, so each option runs in a real 2-process world
with the layout that splits the ranks (tensor or pipeline parallel) and must finish in time."""

import pytest

from tests.functional_tests.runner import TINY_MODEL, read_tensorboard_scalars, run_pretrain

LOGGING_OPTIONS = [
    "--log-timers-to-tensorboard",
    "--log-memory-to-tensorboard",
    "--log-world-size-to-tensorboard",
    "--log-validation-ppl-to-tensorboard",
    "--log-params-norm",
    "--log-num-zeros-in-grad",
    "--log-throughput",
    "--log-progress",
    "--timing-log-level",
    "2",
    "--timing-log-option",
    "all",
    "--tensorboard-log-interval",
    "1",
    "--wandb-project",
    "p",
    "--wandb-exp-name",
    "e",
]


@pytest.mark.parametrize(
    "layout", ["--tensor-model-parallel-size", "--pipeline-model-parallel-size"]
)
def test_every_logging_option_finishes_at_two_processes(tmp_path, layout):
    tb = tmp_path / "tb"
    args = (
        TINY_MODEL
        + LOGGING_OPTIONS
        + [
            layout,
            "2",
            "--train-iters",
            "3",
            "--eval-interval",
            "2",
            "--eval-iters",
            "1",
            "--tensorboard-dir",
            str(tb),
            "--wandb-save-dir",
            str(tmp_path / "wandb"),
            "--save",
            str(tmp_path / "ckpt"),
            "--save-interval",
            "2",
        ]
    )
    # Before the fix, --log-timers-to-tensorboard waited for ever in the timers' all-gather.
    result = run_pretrain(args, nproc=2, timeout=120)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    # The gathered timers reach the writer: the max over ranks of each timed phase.
    assert sorted(read_tensorboard_scalars(tb, "forward-backward-time")) == [1, 2, 3]
    assert sorted(read_tensorboard_scalars(tb, "iteration-time")) == [1, 2, 3]
    assert sorted(read_tensorboard_scalars(tb, "lm loss validation ppl")) == [2, 3]
