"""Megatron's per-iteration log line and validation block formats."""

from megatron.training.training_log import format_log_line
from tests.functional_tests.runner import LOG_LINE, parse_log_lines


def _line(**overrides):
    fields = dict(
        timestamp="2024-05-01 10:00:00",
        iteration=609,
        train_iters=500000,
        consumed_samples=311808,
        skipped_samples=0,
        elapsed_ms=1234.5,
        throughput=None,
        learning_rate=5.999998e-05,
        batch_size=512,
        losses={"lm loss": 6.54321},
        loss_scale=1.0,
        grad_norm=0.8124,
        num_zeros=None,
        params_norm=None,
        skipped_iters=0,
        nan_iters=0,
    )
    fields.update(overrides)
    return format_log_line(**fields)


def test_line_equals_megatron_example_character_for_character():
    # An example of Megatron's per-iteration log line, typed in by hand (not produced by our
    # code).
    expected = (
        " [2024-05-01 10:00:00] iteration      609/  500000 | consumed samples:       311808 |"
        " elapsed time per iteration (ms): 1234.5 | learning rate: 5.999998E-05 |"
        " global batch size:   512 | lm loss: 6.543210E+00 | loss scale: 1.0 | grad norm: 0.812 |"
        " number of skipped iterations:   0 | number of nan iterations:   0 |"
    )
    assert _line() == expected


def test_optional_fields_in_order_and_regex():
    line = _line(
        skipped_samples=16,
        throughput=123.45,
        num_zeros=7,
        params_norm=12.3456,
        grad_norm=None,
        losses={"lm loss": 2.0, "z loss": 0.5},
        skipped_iters=2,
        nan_iters=1,
        loss_scale=65536.0,
    )
    assert LOG_LINE.match(line), line
    assert (
        line.index("skipped samples")
        < line.index("elapsed time")
        < line.index("throughput per GPU")
        < line.index("learning rate")
        < line.index("global batch size")
        < line.index("lm loss")
        < line.index("z loss")
        < line.index("loss scale: 65536.0")
        < line.index("num zeros: 7")
        < line.index("params norm: 12.346")
        < line.index("number of skipped iterations:   2")
    )
    parsed = parse_log_lines(line)
    assert parsed[609]["losses"] == {"lm loss": 2.0, "z loss": 0.5}


def test_regex_rejects_wrong_widths():
    bad = _line().replace("iteration      609/  500000", "iteration 609/500000")
    assert not LOG_LINE.match(bad)
