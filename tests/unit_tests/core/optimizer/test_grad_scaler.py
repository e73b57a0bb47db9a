import io
import re

import pytest
import torch

from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler


def _scale(s):
    return s.scale.item()


def test_constant_scaler_never_changes():
    s = ConstantGradScaler(128.0)
    for flag in (True, True, False, True):
        s.update(flag)
    assert _scale(s) == 128.0
    assert s.inv_scale.item() == 1.0 / 128.0
    assert s.state_dict() == {}


def test_hysteresis_two_then_every_overflow_halves():
    s = DynamicGradScaler(initial_scale=1024.0, min_scale=1.0, growth_interval=1000, hysteresis=2)
    s.update(True)  # hysteresis 2 -> 1: keep
    assert _scale(s) == 1024.0
    s.update(True)  # 1 -> 0: halve
    assert _scale(s) == 512.0
    s.update(True)  # tracker not refilled by backoff: halve again
    assert _scale(s) == 256.0
    s.update(False)  # a clean step does not refill the hysteresis either
    s.update(True)
    assert _scale(s) == 128.0


def test_growth_after_window_and_refills_hysteresis():
    s = DynamicGradScaler(initial_scale=8.0, min_scale=1.0, growth_interval=3, hysteresis=2)
    s.update(True)
    s.update(True)
    assert _scale(s) == 4.0
    s.update(False)
    s.update(False)
    assert _scale(s) == 4.0
    s.update(False)  # third clean step in a row: grow
    assert _scale(s) == 8.0
    s.update(True)  # hysteresis was refilled: this overflow is tolerated
    assert _scale(s) == 8.0
    s.update(False)
    s.update(False)  # growth tracker was reset by the overflow: only 2 clean steps
    assert _scale(s) == 8.0
    s.update(False)
    assert _scale(s) == 16.0


def test_overflow_resets_growth_counter():
    s = DynamicGradScaler(initial_scale=2.0, min_scale=1.0, growth_interval=2, hysteresis=5)
    s.update(False)
    s.update(True)
    s.update(False)
    assert _scale(s) == 2.0
    s.update(False)
    assert _scale(s) == 4.0


def test_min_scale_floor():
    s = DynamicGradScaler(initial_scale=4.0, min_scale=1.5, growth_interval=100, hysteresis=1)
    s.update(True)
    assert _scale(s) == 2.0
    s.update(True)
    assert _scale(s) == 1.5
    s.update(True)
    assert _scale(s) == 1.5


def test_inv_scale():
    s = DynamicGradScaler(initial_scale=2.0**32, min_scale=1.0)
    assert s.inv_scale.item() == 2.0**-32
    assert s.scale.dtype == torch.float32


def test_state_dict_round_trip_weights_only():
    s = DynamicGradScaler(initial_scale=64.0, min_scale=1.0, growth_interval=4, hysteresis=3)
    for flag in (True, False, True, True, False):
        s.update(flag)
    buf = io.BytesIO()
    torch.save(s.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    t = DynamicGradScaler(initial_scale=64.0, min_scale=1.0, growth_interval=4, hysteresis=3)
    t.load_state_dict(loaded)
    for flag in (False, True, False, False, False, False, True):
        s.update(flag)
        t.update(flag)
        assert _scale(s) == _scale(t)
    assert s.state_dict()["growth_tracker"] == t.state_dict()["growth_tracker"]
    assert s.state_dict()["hysteresis_tracker"] == t.state_dict()["hysteresis_tracker"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(initial_scale=0.0, min_scale=1.0), "loss scale must be positive, got 0.0"),
        (
            dict(initial_scale=1.0, min_scale=2.0),
            "min loss scale (--min-loss-scale 2.0) is larger than the initial loss scale "
            "(--initial-loss-scale 1.0)",
        ),
        (
            dict(initial_scale=4.0, min_scale=1.0, hysteresis=0),
            "hysteresis (--hysteresis) must be >= 1, got 0",
        ),
        (
            dict(initial_scale=4.0, min_scale=1.0, growth_interval=0),
            "loss scale window (--loss-scale-window) must be > 0, got 0",
        ),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        DynamicGradScaler(**kwargs)
