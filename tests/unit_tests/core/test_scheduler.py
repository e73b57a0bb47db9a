import io
import math

import pytest
import torch

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


class _MockOptimizer:
    def __init__(self, groups=None):
        self.param_groups = groups if groups is not None else [{"wd_mult": 1.0}, {"wd_mult": 0.0}]


MAX_LR, MIN_LR, INIT_LR = 1.0e-3, 1.0e-5, 1.0e-6
WARMUP, DECAY = 100, 1000


def _sched(style="linear", opt=None, warmup=WARMUP, **kw):
    args = dict(
        init_lr=INIT_LR,
        max_lr=MAX_LR,
        min_lr=MIN_LR,
        lr_warmup_steps=warmup,
        lr_decay_steps=DECAY,
        lr_decay_style=style,
        start_wd=0.1,
        end_wd=0.1,
        wd_incr_steps=DECAY,
        wd_incr_style="constant",
    )
    args.update(kw)
    return OptimizerParamScheduler(opt or _MockOptimizer(), **args)


def _reference_lr(
    n, style, wsd_steps=None, wsd_style=None, warmup=WARMUP, max_lr=MAX_LR, min_lr=MIN_LR
):
    """Megatron's learning-rate schedule formulas (warmup, then the decay style), written out
    independently of the implementation."""
    if warmup > 0 and n <= warmup:
        return INIT_LR + (max_lr - INIT_LR) * n / warmup
    if style == "constant":
        return max_lr
    if n > DECAY:
        return min_lr
    if style == "inverse-square-root":
        return max(min_lr, max_lr * math.sqrt(max(warmup, 1)) / math.sqrt(max(n, 1)))
    r = (n - warmup) / (DECAY - warmup)
    if style == "linear":
        c = 1 - r
    elif style == "cosine":
        c = (math.cos(math.pi * r) + 1) / 2
    else:
        start = DECAY - wsd_steps
        if n <= start:
            c = 1.0
        else:
            q = (n - start) / wsd_steps
            c = {
                "linear": 1 - q,
                "cosine": (math.cos(math.pi * q) + 1) / 2,
                "exponential": 2 * 0.5**q - 1,
                "minus_sqrt": 1 - math.sqrt(q),
            }[wsd_style]
    return min_lr + c * (max_lr - min_lr)


CHECK_POINTS = [0, 1, 50, 99, 100, 101, 250, 500, 777, 799, 800, 801, 900, 999, 1000, 1001, 5000]


@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "inverse-square-root"])
def test_lr_decay_styles(style):
    s = _sched(style)
    prev = 0
    for n in CHECK_POINTS:
        s.step(n - prev)
        prev = n
        expected = _reference_lr(n, style)
        assert s.get_lr({}) == pytest.approx(expected, rel=1e-12, abs=1e-15), (style, n)
        assert s.optimizer.param_groups[0]["lr"] == pytest.approx(expected, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("wsd_style", ["linear", "cosine", "exponential", "minus_sqrt"])
def test_wsd_decay_styles(wsd_style):
    s = _sched("WSD", wsd_decay_steps=200, lr_wsd_decay_style=wsd_style)
    for n in CHECK_POINTS:
        s.num_steps = n
        assert s.get_lr({}) == pytest.approx(
            _reference_lr(n, "WSD", 200, wsd_style), rel=1e-12, abs=1e-15
        )
    # Stable phase holds max_lr; end of decay reaches min_lr.
    s.num_steps = 800
    assert s.get_lr({}) == MAX_LR
    s.num_steps = 1000
    assert s.get_lr({}) == pytest.approx(MIN_LR, abs=1e-15)


def test_no_warmup_and_samples_semantics():
    s = _sched("linear", warmup=0)
    assert s.get_lr({}) == MAX_LR  # n=0, no warmup branch
    s.step(64)  # one iteration of gbs 64 = 64 samples
    assert s.num_steps == 64
    assert s.get_lr({}) == pytest.approx(_reference_lr(64, "linear", warmup=0))


def test_group_max_min_lr_and_multipliers():
    groups = [{"wd_mult": 1.0}, {"wd_mult": 0.0, "max_lr": 5e-3, "min_lr": 1e-4, "lr_mult": 0.5}]
    s = _sched(
        "cosine", opt=_MockOptimizer(groups), start_wd=0.0, end_wd=0.2, wd_incr_style="linear"
    )
    s.step(550)
    assert groups[0]["lr"] == pytest.approx(_reference_lr(550, "cosine"))
    assert groups[1]["lr"] == pytest.approx(
        0.5 * _reference_lr(550, "cosine", max_lr=5e-3, min_lr=1e-4)
    )
    assert groups[0]["weight_decay"] == pytest.approx(0.2 * 550 / DECAY)
    assert groups[1]["weight_decay"] == 0.0


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_weight_decay_styles(style):
    start, end = (0.05, 0.05) if style == "constant" else (0.01, 0.1)
    s = _sched(start_wd=start, end_wd=end, wd_incr_steps=400, wd_incr_style=style)
    for n in [0, 1, 100, 200, 399, 400, 401, 1000]:
        s.num_steps = n
        if n > 400 or style == "constant":
            expected = end
        else:
            r = n / 400
            c = r if style == "linear" else 0.5 * (math.cos(math.pi * (1 - r)) + 1)
            expected = start + c * (end - start)
        assert s.get_wd() == pytest.approx(expected, rel=1e-12), (style, n)


@pytest.mark.parametrize(
    "kw, needle",
    [
        (dict(lr_warmup_steps=1000), "warmup"),
        (dict(init_lr=1.0), "lr-warmup-init"),
        (dict(min_lr=1.0), "--min-lr"),
        (dict(lr_decay_style="WSD"), "WSD"),
        (dict(lr_decay_style="poly"), "lr-decay-style"),
        (dict(start_wd=0.2, end_wd=0.1), "weight decay"),
        (dict(start_wd=0.0, end_wd=0.1, wd_incr_style="constant"), "constant weight decay"),
        (dict(override_opt_param_scheduler=True), "both set"),
    ],
)
def test_invalid_arguments(kw, needle):
    args = dict(
        init_lr=INIT_LR,
        max_lr=MAX_LR,
        min_lr=MIN_LR,
        lr_warmup_steps=WARMUP,
        lr_decay_steps=DECAY,
        lr_decay_style="linear",
        start_wd=0.1,
        end_wd=0.1,
        wd_incr_steps=DECAY,
        wd_incr_style="constant",
    )
    args.update(kw)
    with pytest.raises(ValueError, match=needle):
        OptimizerParamScheduler(_MockOptimizer(), **args)


def test_state_dict_round_trip():
    s = _sched("cosine")
    s.step(321)
    buf = io.BytesIO()
    torch.save(s.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    assert set(sd) == {
        "max_lr",
        "lr_warmup_steps",
        "num_steps",
        "lr_decay_style",
        "lr_decay_steps",
        "min_lr",
        "start_wd",
        "end_wd",
        "wd_incr_style",
        "wd_incr_steps",
    }
    t = _sched("cosine", use_checkpoint_opt_param_scheduler=False)
    t.load_state_dict(sd)
    assert t.num_steps == 321
    assert t.optimizer.param_groups[0]["lr"] == s.optimizer.param_groups[0]["lr"]
    s.step(10)
    t.step(10)
    assert t.optimizer.param_groups[0]["lr"] == s.optimizer.param_groups[0]["lr"]


def test_old_key_names():
    old = {
        "start_lr": MAX_LR,
        "min_lr": MIN_LR,
        "warmup_iter": WARMUP,
        "end_iter": DECAY,
        "decay_style": "linear",
        "num_iters": 400,
    }
    t = _sched("linear", use_checkpoint_opt_param_scheduler=False)
    t.load_state_dict(old)
    assert t.num_steps == 400
    assert t.get_lr({}) == pytest.approx(_reference_lr(400, "linear"))
    mid = {
        "max_lr": MAX_LR,
        "min_lr": MIN_LR,
        "warmup_steps": WARMUP,
        "decay_steps": DECAY,
        "lr_decay_style": "linear",
        "num_steps": 7,
    }
    t.load_state_dict(mid)
    assert t.num_steps == 7  # loading is idempotent, not additive


def test_mismatch_policies():
    sd = _sched("linear").state_dict()
    sd["max_lr"] = 2e-3
    strict = _sched("linear", use_checkpoint_opt_param_scheduler=False)
    with pytest.raises(ValueError, match="learning rate"):
        strict.load_state_dict(dict(sd))

    groups = [
        {"max_lr": MAX_LR, "min_lr": MIN_LR, "is_decoupled_lr": False},
        {"max_lr": 7e-3, "min_lr": MIN_LR, "is_decoupled_lr": True},
    ]
    from_ckpt = _sched(
        "linear", opt=_MockOptimizer(groups), use_checkpoint_opt_param_scheduler=True
    )
    from_ckpt.load_state_dict(dict(sd))
    assert from_ckpt.max_lr == 2e-3
    assert groups[0]["max_lr"] == 2e-3  # plain groups follow the checkpoint's LR
    assert groups[1]["max_lr"] == 7e-3  # decoupled LR is not part of the scheduler state

    override = _sched(
        "linear", use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True
    )
    override.load_state_dict(dict(sd))
    assert override.max_lr == MAX_LR
