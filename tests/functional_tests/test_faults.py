"""Faults injected into real runs (CPU, gloo, 2 processes), each bounded in time: the run ends
with a clear message, and what it saved is complete."""

import os
import re
import signal
import textwrap
import time

import pytest

from tests.functional_tests.runner import REPO, TINY_MODEL, Launched, run_pretrain

LONG_RUN = TINY_MODEL + ["--train-iters", "10000", "--lr-decay-iters", "100"]


@pytest.mark.faults
@pytest.mark.parametrize("num_workers", ["0", "2"])
def test_sigterm_to_the_launcher_saves_and_exits(tmp_path, num_workers):
    # Before: with data-loader workers, the run died in 1.3 s with "worker killed by signal:
    # Terminated" and saved nothing.
    ckpt = tmp_path / "ckpt"
    args = list(LONG_RUN)
    args[args.index("--num-workers") + 1] = num_workers
    run = Launched(
        args + ["--exit-signal-handler", "--save", str(ckpt), "--save-interval", "10000"]
    )
    run.wait_for("iteration        3/")
    os.killpg(run.proc.pid, signal.SIGTERM)  # as a scheduler does: the launcher's whole group
    _, seconds = run.finish(timeout=60)
    out = run.output()
    # torchrun itself ends with its own SignalException (exit 1); the workers must exit cleanly.
    assert "exiting program after receiving SIGTERM" in out, out[-4000:]
    assert "ChildFailedError" not in out, out[-4000:]
    for chunk in out.split("Traceback (most recent call last):")[1:]:
        assert "SignalException: Process" in chunk, out[-4000:]
    saved = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert (
        saved >= 3 and (ckpt / f"iter_{saved:07d}" / "mp_rank_00" / "model_optim_rng.pt").exists()
    ), out[-3000:]


NAN_AT_ITERATION_3 = textwrap.dedent("""
    import torch
    import {module} as target
    _real = target.{cls}.{method}
    _calls = [0]

    def _with_nan(self, *args, **kwargs):
        _calls[0] += 1
        {inject}
        return _real(self, *args, **kwargs)

    target.{cls}.{method} = _with_nan
""")
NAN_CASES = {
    # The model's output turns NaN on the 3rd micro-batch's forward (iteration 3: 4 per step).
    "loss": (
        "megatron.core.models.gpt.gpt_model",
        "GPTModel",
        "forward",
        "if _calls[0] == 9: return _real(self, *args, **kwargs) * float('nan')",
        "found NaN in local forward loss calculation at iteration 3 "
        "(--check-for-nan-in-loss-and-grad)",
    ),
    # One gradient element is NaN before the reduction of iteration 3.
    "grad": (
        "megatron.core.distributed.param_and_grad_buffer",
        "ParamAndGradBuffer",
        "finish_grad_sync",
        "if _calls[0] == 3: self.grad_data[0] = float('nan')",
        "found NaN or Inf in the reduced gradients (--check-for-nan-in-loss-and-grad)",
    ),
}


@pytest.mark.parametrize("where", sorted(NAN_CASES))
def test_nan_injected_into_loss_or_gradient_stops_with_one_line(tmp_path, where):
    module, cls, method, inject, message = NAN_CASES[where]
    (tmp_path / "sitecustomize.py").write_text(
        NAN_AT_ITERATION_3.format(module=module, cls=cls, method=method, inject=inject)
    )
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    # The check is on by default (Megatron's --check-for-nan-in-loss-and-grad is too). With the
    # default --rerun-mode validate_results a NaN is re-run and ends with the rerun state
    # machine's exit codes (tests of the machine); with the machine disabled it is this one line
    # and exit 1.
    args = TINY_MODEL + ["--train-iters", "5", "--rerun-mode", "disabled"]
    result = run_pretrain(args, extra_env=env, timeout=120)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == f"error: {message}", result.stderr[-2000:]
    assert "iteration        2/" in result.stdout and "iteration        3/" not in result.stdout


STOPS_RANK_1 = textwrap.dedent("""
    import os, signal
    import megatron.core.models.gpt.gpt_model as target
    import megatron.training.collective_watch as watch
    # Rank 0 waits this long for other ranks to report the same timeout before naming the
    # missing ones; the stopped rank never reports, so 1 s says the same as the default 5 s.
    watch.GRACE_SECONDS = 1.0
    _real = target.GPTModel.forward
    _calls = [0]

    def _stopped_mid_iteration_3(self, *args, **kwargs):
        _calls[0] += 1
        if os.environ.get("RANK") == "1" and _calls[0] == 5:  # 2 micro-batches per iteration
            with open({pid_file!r}, "w") as pid_file:
                pid_file.write(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)
        return _real(self, *args, **kwargs)

    target.GPTModel.forward = _stopped_mid_iteration_3
""")


@pytest.mark.faults
def test_a_stopped_rank_ends_the_run_within_the_timeout(tmp_path):
    # Before: rank 0 waited in the gradient all-reduce for --distributed-timeout-minutes (10 by
    # default) and torchrun's own failure report named no operation and no rank.
    pid_file = tmp_path / "stopped.pid"
    (tmp_path / "sitecustomize.py").write_text(STOPS_RANK_1.format(pid_file=str(pid_file)))
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    args = TINY_MODEL + ["--train-iters", "6", "--distributed-timeout-seconds-after-init", "5"]
    start = time.monotonic()
    run = Launched(args, extra_env=env, timeout=150)
    run.wait_for("error: rank 0: collective #", stream="stderr")
    seconds = time.monotonic() - start
    # Rank 0 failed, so torchrun ends the job: it sends SIGTERM to the other ranks, which the
    # stopped one cannot act on, and SIGKILLs what is left after a 30 s grace (torch 2.13 has
    # no setting for that grace when a worker failed). The test does that last step at once.
    run.wait_for("closing signal SIGTERM", timeout=30, stream="stderr")
    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    returncode, _ = run.finish(timeout=30)
    stdout, stderr = "".join(run.stdout), "".join(run.stderr)
    assert "outlived the process-group teardown" not in stderr, stderr[-3000:]  # as run_pretrain
    assert returncode != 0, stdout[-2000:]
    assert "iteration        2/" in stdout and "iteration        3/" not in stdout
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, stderr[-4000:]
    assert errors[0].startswith("error: rank 0: collective #"), errors[0]
    assert "over group ranks [0, 1] did not complete within 5 s" in errors[0], errors[0]
    assert errors[0].endswith("ranks [1] did not arrive"), errors[0]
    # The trace of rank 0's last collectives came first, ending with the one that hung.
    trace = [line for line in stderr.splitlines() if line.startswith("[rank 0]   #")]
    assert 0 < len(trace) <= 16 and trace[-1].endswith("did not complete"), stderr[-4000:]
    print(f"stopped rank: rank 0 named the hung collective after {seconds:.1f} s")


SLOWS_RANK_1 = textwrap.dedent("""
    import os, time
    import megatron.core.models.gpt.gpt_model as target
    _real = target.GPTModel.forward

    def _slow_on_rank_1(self, *args, **kwargs):
        if os.environ.get("RANK") == "1":
            time.sleep(0.2)
        return _real(self, *args, **kwargs)

    target.GPTModel.forward = _slow_on_rank_1
""")


def test_log_straggler_names_the_slow_rank(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(SLOWS_RANK_1)
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    args = TINY_MODEL + ["--train-iters", "3", "--log-straggler", "--straggler-minmax-count", "2"]
    result = run_pretrain(args, nproc=2, extra_env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = re.findall(
        r"^ \| MnRtt/Rnk: ([\d.]+)ms/(\d) \| MxRtt/Rnk: ([\d.]+)ms/(\d)"
        r" \| MnEtpt/Rnk: [\d.]+TF/(\d) \| MxEtpt/Rnk: [\d.]+TF/(\d)$",
        result.stdout,
        re.MULTILINE,
    )
    assert len(reports) == 3, result.stdout[-3000:]  # one per --log-interval (1)
    for fast_ms, fast, slow_ms, slow, low, high in reports:
        # 2 micro-batches per iteration, each forward sleeping 0.2 s on rank 1: the slow rank's
        # time holds both sleeps (time.sleep never returns early), whatever the load. The gap
        # to the fast rank has no such bound: a loaded machine once made the fast rank's time
        # 93 ms and the slow one's 410 ms (a gap of 316 ms).
        assert (fast, slow, low, high) == ("0", "1", "1", "0"), reports
        assert float(slow_ms) >= 400, reports
    assert re.search(
        r"^\^\^\^\^ Bottom 2 Ranks with lowest  Etpt\(TF\): [\d.]+/1, [\d.]+/0$",
        result.stdout,
        re.MULTILINE,
    ), result.stdout[-3000:]
    assert re.search(
        r"^\^\^\^\^ Top    2 Ranks with highest Etpt\(TF\): [\d.]+/0, [\d.]+/1$",
        result.stdout,
        re.MULTILINE,
    ), result.stdout[-3000:]
