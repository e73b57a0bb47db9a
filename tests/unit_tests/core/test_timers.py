import re
import time

import pytest
import torch.multiprocessing as mp

from megatron.core.timers import DummyTimer, Timer, Timers
from tests.unit_tests.dist_utils import run_distributed

LINE_MINMAX = re.compile(r"^    (\S[^:]*?) \.*: \((\d+\.\d{2}), (\d+\.\d{2})\)$")
LINE_MAX = re.compile(r"^    (\S[^:]*?) \.*: (\d+\.\d{2})$")


def _set_ms(timers, name, ms, level=0):
    timer = timers(name, log_level=level)
    timer._elapsed = ms / 1000.0
    return timer


def test_timer_accumulates_and_resets():
    t = Timer("x")
    t.start()
    time.sleep(0.01)
    t.stop()
    t.start()
    time.sleep(0.01)
    t.stop()
    first = t.elapsed(reset=False)
    assert first >= 0.02
    assert t.elapsed(reset=True) == first
    assert t.elapsed() == 0.0
    with pytest.raises(RuntimeError, match="not started"):
        t.stop()
    t.start()
    with pytest.raises(RuntimeError, match="already been started"):
        t.start()
    time.sleep(0.005)
    assert t.elapsed() > 0.0  # reading a running timer keeps it running
    t.stop()
    assert t.active_time() > first


def test_levels_make_dummies():
    timers = Timers(log_level=1, log_option="minmax")
    assert isinstance(timers("forward-backward", log_level=1), Timer)
    assert isinstance(timers("batch-generator", log_level=2), DummyTimer)
    assert isinstance(timers("no-level"), DummyTimer)  # default level is the max (2)
    assert timers("forward-backward") is timers("forward-backward", log_level=1)
    with pytest.raises(ValueError, match="log level"):
        timers("forward-backward", log_level=0)
    with pytest.raises(ValueError, match=r"--timing-log-option\) must be one of .*got 'median'"):
        Timers(log_level=0, log_option="median")
    with pytest.raises(
        ValueError, match=re.escape("(--timing-log-level) must be in [0, 2], got 3")
    ):
        Timers(log_level=3, log_option="max")


def test_minmax_format(capsys):
    timers = Timers(log_level=2, log_option="minmax")
    _set_ms(timers, "forward-backward", 1234.5)
    _set_ms(timers, "optimizer", 20.0)
    timers("never-started", log_level=0)
    text = timers.log(
        ["forward-backward", "optimizer", "never-started", "unknown"], normalizer=10.0
    )
    lines = text.split("\n")
    assert lines[0] == "(min, max) time across ranks (ms):"
    assert len(lines) == 3  # zero and unknown timers are left out
    assert lines[1] == "    " + "forward-backward ".ljust(48, ".") + ": (123.45, 123.45)"
    for line in lines[1:]:
        m = LINE_MINMAX.match(line)
        assert m, line
        assert len(line.split(":")[0]) == 4 + 48
    assert capsys.readouterr().out.strip() == text  # printed on the (only, last) rank
    assert timers.log(["forward-backward"]) is None  # reset by the previous log


def test_max_and_all_formats():
    timers = Timers(log_level=2, log_option="max")
    _set_ms(timers, "a-very-long-timer-name-that-is-longer-than-forty-eight-chars", 3.14159)
    text = timers.get_all_timers_string(
        ["a-very-long-timer-name-that-is-longer-than-forty-eight-chars"]
    )
    assert text.split("\n")[0] == "max time across ranks (ms):"
    assert LINE_MAX.match(text.split("\n")[1])
    assert text.split("\n")[1].endswith(": 3.14")

    timers = Timers(log_level=2, log_option="all")
    _set_ms(timers, "forward-compute", 5.0)
    text = timers.get_all_timers_string(["forward-compute"], normalizer=2.0)
    assert text == "times across ranks (ms):\n  forward-compute:\n     rank  0: 2.50"


class _Writer:
    def __init__(self):
        self.scalars = []

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))


def test_write():
    timers = Timers(log_level=1, log_option="minmax")
    _set_ms(timers, "optimizer", 40.0, level=1)
    writer = _Writer()
    timers.write(["optimizer", "missing"], writer, iteration=7, normalizer=4.0)
    assert writer.scalars == [("optimizer-time", pytest.approx(10.0), 7)]
    assert timers("optimizer").elapsed(reset=False) == pytest.approx(0.04)  # write does not reset


def _logs_per_option(rank, world_size, queue):
    out = {}
    for option in ("minmax", "max", "all"):
        timers = Timers(log_level=2, log_option=option)
        _set_ms(timers, "both", 10.0 * (rank + 1))
        if rank == 1:
            _set_ms(timers, "only-rank-1", 7.0)
        out[option] = timers.log(["both", "only-rank-1"], normalizer=1.0)
    queue.put((rank, out))


def test_across_two_ranks():
    queue = mp.get_context("spawn").SimpleQueue()
    run_distributed(_logs_per_option, 2, queue)
    results = dict(queue.get() for _ in range(2))
    assert results[0] == results[1]
    out = results[1]

    def label(n):
        return "    " + (n + " ").ljust(48, ".")

    assert out["minmax"] == (
        "(min, max) time across ranks (ms):\n"
        + label("both")
        + ": (10.00, 20.00)\n"
        + label("only-rank-1")
        + ": (7.00, 7.00)"
    )
    assert out["max"] == (
        "max time across ranks (ms):\n"
        + label("both")
        + ": 20.00\n"
        + label("only-rank-1")
        + ": 7.00"
    )
    assert out["all"] == (
        "times across ranks (ms):\n  both:\n     rank  0: 10.00\n     rank  1: 20.00\n"
        "  only-rank-1:\n     rank  1: 7.00"
    )
