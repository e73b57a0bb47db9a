"""Training features run in-process (one process, no torchrun): logging backends, precision,
batch-size ramp-up, and the SIGTERM handler (as a subprocess)."""

import re
import signal
import subprocess
import sys
import threading
import time
import types

import pytest
import torch

from megatron.training import global_vars
from tests.functional_tests.runner import (
    LOG_LINE,
    REPO,
    TINY_MODEL,
    env_for_tests,
    parse_log_lines,
    read_tensorboard_scalars,
)

sys.path.insert(0, str(REPO))
import pretrain_gpt  # noqa: E402
from tests.unit_tests.training.test_flops import flops_by_hand  # noqa: E402


def _pretrain(argv, capsys):
    global_vars.reset_globals()
    pretrain_gpt.pretrain(
        pretrain_gpt.train_valid_test_datasets_provider,
        pretrain_gpt.model_provider,
        pretrain_gpt.ModelType.encoder_or_decoder,
        pretrain_gpt.forward_step,
        args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
        argv=argv,
    )
    out = capsys.readouterr().out
    global_vars.reset_globals()
    return out


class _FakeWandbRun:
    def __init__(self):
        self.logged = []
        self.finished = False

    def log(self, metrics, step=None):
        self.logged.append((step, dict(metrics)))

    def finish(self):
        self.finished = True


@pytest.fixture
def fake_wandb(monkeypatch):
    run = _FakeWandbRun()
    module = types.ModuleType("wandb")
    module.init = lambda **kwargs: run
    monkeypatch.setitem(sys.modules, "wandb", module)
    return run


def test_wandb_gets_metrics_without_tensorboard(fake_wandb, capsys, tmp_path):
    _pretrain(
        TINY_MODEL
        + [
            "--train-iters",
            "4",
            "--wandb-project",
            "p",
            "--wandb-exp-name",
            "e",
            "--wandb-save-dir",
            str(tmp_path),
        ],
        capsys,
    )
    steps = {step for step, metrics in fake_wandb.logged if "lm loss" in metrics}
    assert steps == {1, 2, 3, 4}
    assert all("learning-rate" in m for s, m in fake_wandb.logged if "lm loss" in m)
    assert fake_wandb.finished


def test_tensorboard_tags_and_validation(capsys, tmp_path):
    tb = tmp_path / "tb"
    out = _pretrain(
        TINY_MODEL
        + [
            "--train-iters",
            "4",
            "--tensorboard-dir",
            str(tb),
            "--eval-interval",
            "2",
            "--eval-iters",
            "1",
        ],
        capsys,
    )
    for tag in (
        "learning-rate",
        "learning-rate vs samples",
        "batch-size",
        "lm loss",
        "lm loss vs samples",
        "loss-scale",
        "grad-norm",
        "lm loss validation",
    ):
        values = read_tensorboard_scalars(tb, tag)
        assert values, tag
    assert sorted(read_tensorboard_scalars(tb, "lm loss")) == [1, 2, 3, 4]
    assert sorted(read_tensorboard_scalars(tb, "lm loss validation")) == [2, 4]
    assert " validation loss at iteration 2 | lm loss value: " in out
    block = [
        line
        for line in out.splitlines()
        if line.startswith(" validation loss at iteration 4 on validation set")
    ]
    assert block, out[-2000:]
    lines = out.splitlines()
    i = lines.index(block[0])
    assert lines[i - 1] == "-" * (len(block[0]) + 1) == lines[i + 1]


def _hidden_dtypes(model):
    """Record the dtype of every first-layer output while the model trains."""
    seen = set()

    def hook(module, inputs, output):
        seen.add((output[0] if isinstance(output, tuple) else output).dtype)

    model.decoder.layers[0].register_forward_hook(hook)
    return seen


def _train_recording_dtypes(argv, capsys, monkeypatch):
    """Train; returns the log lines, the trained GPTModel and the dtypes that its first layer
    produced."""
    original = pretrain_gpt.model_provider
    models = []

    def provider(*args, **kwargs):
        model = original(*args, **kwargs)
        models.append((model, _hidden_dtypes(model)))
        return model

    monkeypatch.setattr(pretrain_gpt, "model_provider", provider)
    out = _pretrain(argv, capsys)
    ((model, seen),) = models
    return parse_log_lines(out), model, seen


def test_fp16_dynamic_loss_scale_skips_overflows_then_trains(capsys, monkeypatch):
    # 2^20 overflows the tiny model's fp16 gradients for the first steps; the scale comes down
    # to where steps succeed. --loss-scale-window 1000: the scale never grows back here.
    lines, model, dtypes = _train_recording_dtypes(
        TINY_MODEL
        + ["--train-iters", "12", "--fp16", "--initial-loss-scale", "1048576"]
        + ["--loss-scale-window", "1000", "--hysteresis", "2"],
        capsys,
        monkeypatch,
    )
    assert sorted(lines) == list(range(1, 13))
    skipped = [i for i in lines if int(lines[i]["skipped"])]
    applied = [i for i in lines if not int(lines[i]["skipped"])]
    assert 1 in skipped and len(applied) >= 6, lines
    # The dynamic scaler by its definition: each overflow uses up one unit of --hysteresis;
    # once used up, every overflow halves the scale. A successful step leaves it alone.
    scale, hysteresis = 2.0**20, 2
    for i in sorted(lines):
        if i in skipped:
            hysteresis -= 1
            if hysteresis <= 0:
                scale /= 2
        assert float(lines[i]["loss_scale"]) == scale, (i, lines[i])
    # A skipped step does not advance the LR schedule; an applied one does (warmup, then
    # cosine decay: every scheduler step changes the LR).
    for i in range(2, 13):
        assert (lines[i]["lr"] == lines[i - 1]["lr"]) == (i in skipped), (i, lines)
    # Skipped steps report no loss; applied ones do, and the loss falls.
    assert all("lm loss" not in lines[i]["losses"] for i in skipped)
    losses = [lines[i]["losses"]["lm loss"] for i in applied]
    assert losses[-1] < 0.97 * losses[0], losses
    # The model really is an fp16 model (parameters and activations).
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    assert dtypes == {torch.float16}


def test_bf16_trains_in_bf16_with_unit_loss_scale(capsys, monkeypatch):
    lines, model, dtypes = _train_recording_dtypes(
        TINY_MODEL + ["--train-iters", "8", "--bf16"], capsys, monkeypatch
    )
    assert sorted(lines) == list(range(1, 9))
    assert all(lines[i]["loss_scale"] == "1.0" and lines[i]["skipped"] == "0" for i in lines)
    assert lines[8]["losses"]["lm loss"] < 0.97 * lines[1]["losses"]["lm loss"]
    # fp32 training also prints loss scale 1.0: what shows bf16 is the model itself.
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert dtypes == {torch.bfloat16}


def test_rampup_batch_size_with_train_samples(capsys):
    argv = [a for a in TINY_MODEL]
    argv[argv.index("--global-batch-size") + 1] = "12"
    argv += [
        "--train-samples",
        "120",
        "--rampup-batch-size",
        "4",
        "4",
        "32",
        "--lr-warmup-samples",
        "8",
    ]
    i = argv.index("--lr-warmup-iters")
    del argv[i : i + 2]
    out = _pretrain(argv, capsys)
    lines = parse_log_lines(out)
    gbs = [int(lines[i]["gbs"]) for i in sorted(lines)]
    consumed = [int(lines[i]["consumed"]) for i in sorted(lines)]
    # 32 ramp samples over (12-4)/4 = 2 increments: 16 samples per increment.
    assert gbs[:4] == [4, 4, 4, 4] and gbs[4:6] == [8, 8] and set(gbs[6:]) == {12}
    assert consumed[-1] <= 120 and consumed == [sum(gbs[: k + 1]) for k in range(len(gbs))]


def test_sigterm_saves_and_exits_zero(tmp_path):
    ckpt = tmp_path / "ckpt"
    cmd = (
        [sys.executable, str(REPO / "pretrain_gpt.py")]
        + TINY_MODEL
        + [
            "--train-iters",
            "100000",
            "--exit-signal-handler",
            "--save",
            str(ckpt),
            "--save-interval",
            "100000",
        ]
    )
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env_for_tests(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    # Reading stdout line by line has no timeout of its own: a watchdog ends a stuck run.
    watchdog = threading.Timer(240, proc.kill)
    watchdog.start()
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if " iteration        3/" in line:
                proc.send_signal(signal.SIGTERM)
                break
        rest = proc.communicate(timeout=120)[0]
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert any(" iteration        3/" in line for line in seen), "".join(seen)[-2000:]
    assert proc.returncode == 0, rest[-2000:]
    iteration = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert iteration >= 3
    assert (ckpt / f"iter_{iteration:07d}" / "mp_rank_00" / "model_optim_rng.pt").is_file()


def test_log_throughput_against_measured_time_and_flop_formula(capsys, monkeypatch, tmp_path):
    """Tokens/s, TFLOP/s and MFU against what this test counts: the tokens of a step from the
    flags, the FLOPs from the per-matmul formula of test_flops.py, the time between two log
    lines from its own clock, and a peak it sets (MEGATRON_PEAK_TFLOPS)."""
    from megatron.training import training_log

    peak = 0.002  # TFLOP/s: a made-up device on which the tiny model has a readable MFU
    monkeypatch.setenv("MEGATRON_PEAK_TFLOPS", str(peak))
    printed = []  # (time, line) of every line the log prints

    def print_and_time(message):
        printed.append((time.perf_counter(), message))
        print(message, flush=True)

    monkeypatch.setattr(training_log, "print_rank_last", print_and_time)
    out = _pretrain(
        TINY_MODEL
        + ["--train-iters", "6", "--log-interval", "2", "--log-throughput"]
        + ["--tensorboard-dir", str(tmp_path)],
        capsys,
    )
    lines = parse_log_lines(out)
    assert sorted(lines) == [2, 4, 6]
    log_times = {
        int(m.group("iteration")): t
        for t, line in printed
        if (m := LOG_LINE.match(line)) is not None
    }
    extras = [line for _, line in printed if line.startswith(" tokens per second: ")]
    assert len(extras) == 3, out[-3000:]
    # TINY_MODEL: global batch 8 x sequence 32; 2 layers, hidden 64, 4 heads, FFN 4 x 64,
    # vocabulary 500 padded to a multiple of 128.
    tokens_per_step = 8 * 32
    flops_per_step = flops_by_hand(B=8, s=32, L=2, h=64, a=4, g=4, f=256, V=512, swiglu=False)
    tflops = read_tensorboard_scalars(tmp_path, "throughput")
    tokens = read_tensorboard_scalars(tmp_path, "tokens-per-sec")
    mfu = read_tensorboard_scalars(tmp_path, "mfu")
    assert sorted(tflops) == sorted(tokens) == sorted(mfu) == [2, 4, 6]
    for k, it in enumerate((4, 6), start=1):
        seconds_per_step = (log_times[it] - log_times[it - 2]) / 2  # this test's clock
        # The clocks differ by the few lines between the timer read and the print.
        assert float(lines[it]["elapsed"]) / 1000 == pytest.approx(seconds_per_step, rel=0.2)
        assert tokens[it] == pytest.approx(tokens_per_step / seconds_per_step, rel=0.2)
        assert tflops[it] == pytest.approx(flops_per_step / seconds_per_step / 1e12, rel=0.2)
        # Without the clock: FLOPs per token is the formula's, exactly.
        assert tflops[it] * 1e12 / tokens[it] == pytest.approx(
            flops_per_step / tokens_per_step, rel=1e-6
        )
        assert mfu[it] == pytest.approx(tflops[it] / peak, rel=1e-6)
        printed_mfu = re.search(r" MFU: (\d+\.\d)% of 0\.002 TFLOP/s \|", extras[k])
        assert printed_mfu, extras[k]
        assert float(printed_mfu.group(1)) == pytest.approx(100 * tflops[it] / peak, abs=0.051)
        printed_tokens = float(re.match(r" tokens per second: (\S+) \|", extras[k]).group(1))
        assert printed_tokens == pytest.approx(tokens[it], abs=0.051)


def test_real_wandb_offline_run_is_written(tmp_path):
    """The real wandb package in offline mode (no network): a run file appears in
    --wandb-save-dir."""
    cmd = (
        [sys.executable, str(REPO / "pretrain_gpt.py")]
        + TINY_MODEL
        + [
            "--train-iters",
            "3",
            "--wandb-project",
            "p",
            "--wandb-exp-name",
            "e",
            "--wandb-save-dir",
            str(tmp_path),
        ]
    )
    env = env_for_tests()
    env["WANDB_MODE"] = "offline"
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-2000:]
    runs = list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 1000
