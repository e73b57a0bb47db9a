"""tools/plot_logs.py and megatron/training/log_parsing.py: parse Megatron's per-iteration log
line and TensorBoard event files back into series equal to what was written, and draw them into
a PNG."""

import os
import subprocess
import sys

import pytest

from megatron.training.log_parsing import LOG_LINE, parse_log_lines, read_run
from tests.harness import REPO

sys.path.insert(0, str(REPO / "tools"))
import plot_logs  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _line(iteration, loss, lr, grad_norm, elapsed_ms, *, extra_before_lr="", extra_after_norm=""):
    """A log line written by hand in Megatron's per-iteration log line format (its field
    formats and order)."""
    return (
        f" [2026-01-02 03:04:05] iteration {iteration:8d}/{100:8d} |"
        f" consumed samples: {iteration * 16:12d} |"
        f" elapsed time per iteration (ms): {elapsed_ms:.1f} |{extra_before_lr}"
        f" learning rate: {lr:.6E} | global batch size: {16:5d} |"
        f" lm loss: {loss:.6E} | loss scale: 1.0 | grad norm: {grad_norm:.3f} |{extra_after_norm}"
        f" number of skipped iterations: {0:3d} | number of nan iterations: {0:3d} |"
    )


def _synthetic_run():
    iterations = [10, 20, 30, 40]
    losses = [9.5, 8.25, 7.125, 6.0625]
    lrs = [1e-4, 2.5e-4, 1.75e-4, 3.125e-5]
    norms = [3.25, 1.5, 1.125, 0.875]
    times = [120.5, 98.0, 97.5, 101.0]
    return iterations, losses, lrs, norms, times


def _write_log(path):
    iterations, losses, lrs, norms, times = _synthetic_run()
    lines = ["using world size: 2, data-parallel size: 2", "training ..."]
    for i, it in enumerate(iterations):
        extra_before = " throughput per GPU (TFLOP/s/GPU): 12.3 |" if it == 20 else ""
        extra_after = " num zeros: 0 | params norm: 123.456 |" if it == 30 else ""
        line = _line(
            it,
            losses[i],
            lrs[i],
            norms[i],
            times[i],
            extra_before_lr=extra_before,
            extra_after_norm=extra_after,
        )
        lines.append(("[rank1]:" + line) if it == 40 else line)  # a launcher prefix is tolerated
        lines.append("    forward-backward ...............................: (12.00, 13.00)")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_synthetic_log_series_equal_inputs(tmp_path):
    iterations, losses, lrs, norms, times = _synthetic_run()
    run = read_run(str(_write_log(tmp_path / "a.log")))
    assert run.get("lm loss") == dict(zip(iterations, losses))
    # lr is printed with 7 significant digits: every input above is exact at that precision.
    assert run.get("learning_rate") == dict(zip(iterations, lrs))
    assert run.get("grad_norm") == dict(zip(iterations, norms))
    assert run.get("elapsed_ms") == dict(zip(iterations, times))
    assert run.get("tflops_per_gpu") == {20: 12.3}
    assert run.get("params_norm") == {30: 123.456}


def test_strict_regex_matches_the_hand_written_and_the_produced_line():
    from megatron.training.training_log import format_log_line

    produced = format_log_line(
        timestamp="2026-01-02 03:04:05",
        iteration=7,
        train_iters=50,
        consumed_samples=56,
        skipped_samples=0,
        elapsed_ms=33.25,
        throughput=None,
        learning_rate=3e-4,
        batch_size=8,
        losses={"lm loss": 5.5},
        loss_scale=1.0,
        grad_norm=0.75,
        num_zeros=None,
        params_norm=None,
        skipped_iters=0,
        nan_iters=0,
    )
    for line in (produced, _line(10, 9.5, 1e-4, 3.25, 120.5)):
        assert LOG_LINE.match(line), line
    run = parse_log_lines([produced])
    assert run.get("lm loss") == {7: 5.5}
    assert run.get("learning_rate") == {7: 3e-4}
    assert run.get("elapsed_ms") == {7: 33.2} or run.get("elapsed_ms") == {7: 33.3}
    assert run.get("grad_norm") == {7: 0.75}
    assert parse_log_lines(["iteration 5/ 10 | lm loss: 1.0 |", "random text"]).series == {}


def _write_tensorboard(logdir):
    from torch.utils.tensorboard import SummaryWriter

    iterations, losses, lrs, norms, times = _synthetic_run()
    writer = SummaryWriter(log_dir=str(logdir))
    for i, it in enumerate(iterations):
        writer.add_scalar("lm loss", losses[i], it)
        writer.add_scalar("learning-rate", lrs[i], it)
        writer.add_scalar("grad-norm", norms[i], it)
        writer.add_scalar("iteration-time", times[i] / 1000.0, it)  # seconds, as Megatron writes it
        writer.add_scalar("lm loss vs samples", losses[i], it * 16)
    writer.close()
    return logdir


def test_tensorboard_series_equal_inputs(tmp_path):
    iterations, losses, lrs, norms, times = _synthetic_run()
    run = read_run(str(_write_tensorboard(tmp_path / "tb")))
    # Event files store float32.
    for name, values in (
        ("lm loss", losses),
        ("learning_rate", lrs),
        ("grad_norm", norms),
        ("elapsed_ms", times),
    ):
        series = run.get(name)
        assert sorted(series) == iterations, name
        for it, expected in zip(iterations, values):
            assert series[it] == pytest.approx(expected, rel=1e-6), (name, it)


def test_plot_writes_png_with_both_kinds_of_input(tmp_path):
    log = _write_log(tmp_path / "a.log")
    tb = _write_tensorboard(tmp_path / "run_b" / "tensorboard")
    output = tmp_path / "out" / "curves.png"
    assert (
        plot_logs.main([str(log), str(tb), "--labels", "log", "tb", "--output", str(output)]) == 0
    )
    assert output.read_bytes()[:8] == PNG_MAGIC
    assert output.stat().st_size > 10_000
    runs = plot_logs.load_runs([str(log), str(tb)])
    assert [label for label, _ in runs] == ["a", "run_b"]


def test_cli_errors_name_the_input(tmp_path):
    empty = tmp_path / "empty.log"
    empty.write_text("no log lines here\n")
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "plot_logs.py"),
            str(empty),
            str(tmp_path / "missing.log"),
            "--output",
            str(tmp_path / "x.png"),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    assert result.returncode == 2
    assert str(empty) in result.stderr and "no training log lines" in result.stderr
    assert not (tmp_path / "x.png").exists()
    with pytest.raises(SystemExit, match="^2$"):
        plot_logs.get_args(["a.log", "b.log", "--labels", "only-one"])
