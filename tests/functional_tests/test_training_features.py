"""Training features run in-process (one process, no torchrun): logging backends, precision,
batch-size ramp-up, and the SIGTERM handler (as a subprocess)."""

import signal
import subprocess
import sys
import types

import pytest

from megatron.training import global_vars
from tests.functional_tests.runner import (
    REPO,
    TINY_MODEL,
    env_for_tests,
    parse_log_lines,
    read_tensorboard_scalars,
)

sys.path.insert(0, str(REPO))
import pretrain_gpt  # noqa: E402


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
        l
        for l in out.splitlines()
        if l.startswith(" validation loss at iteration 4 on validation set")
    ]
    assert block, out[-2000:]
    lines = out.splitlines()
    i = lines.index(block[0])
    assert lines[i - 1] == "-" * (len(block[0]) + 1) == lines[i + 1]


def test_fp16_dynamic_loss_scale_skips_overflows_then_trains(capsys):
    out = _pretrain(
        TINY_MODEL + ["--train-iters", "8", "--fp16", "--loss-scale-window", "1000"], capsys
    )
    lines = parse_log_lines(out)
    assert float(lines[1]["loss_scale"]) <= 2.0**32
    # Starting at 2^32 fp16 gradients overflow: steps are skipped and the scale comes down.
    assert int(lines[8]["skipped"]) + sum(int(lines[i]["skipped"]) for i in range(1, 8)) > 0
    assert float(lines[8]["loss_scale"]) < 2.0**32
    assert all("lm loss" in lines[i]["losses"] for i in lines if not int(lines[i]["skipped"]))


def test_bf16_trains_with_unit_loss_scale(capsys):
    out = _pretrain(TINY_MODEL + ["--train-iters", "8", "--bf16"], capsys)
    lines = parse_log_lines(out)
    assert all(lines[i]["loss_scale"] == "1.0" for i in lines)
    assert lines[8]["losses"]["lm loss"] < lines[1]["losses"]["lm loss"]


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
    try:
        for line in proc.stdout:
            if " iteration        3/" in line:
                proc.send_signal(signal.SIGTERM)
                break
        rest = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, rest[-2000:]
    iteration = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert iteration >= 3
    assert (ckpt / f"iter_{iteration:07d}" / "mp_rank_00" / "model_optim_rng.pt").is_file()


def test_log_throughput_fields(capsys, tmp_path):
    import re

    out = _pretrain(
        TINY_MODEL
        + [
            "--train-iters",
            "3",
            "--log-interval",
            "1",
            "--log-throughput",
            "--tensorboard-dir",
            str(tmp_path),
        ],
        capsys,
    )
    lines = parse_log_lines(out)
    assert "throughput per GPU (TFLOP/s/GPU): " in out
    tokens = [float(m) for m in re.findall(r"^ tokens per second: (\S+) \|", out, flags=re.M)]
    assert len(tokens) == 3
    elapsed_s = float(lines[2]["elapsed"]) / 1000.0
    assert tokens[1] == pytest.approx(8 * 32 / elapsed_s, rel=0.05)
    assert sorted(read_tensorboard_scalars(tmp_path, "tokens-per-sec")) == [1, 2, 3]


def test_real_wandb_offline_run_is_written(tmp_path):
    """The real wandb package in offline mode (no network): a run file appears in --wandb-save-dir."""
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
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    runs = list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 1000
