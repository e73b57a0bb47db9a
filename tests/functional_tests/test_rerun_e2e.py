"""The rerun state machine in real training at 2 processes (torchrun, gloo): an injected
transient error is re-run on the same data and training goes on to the same losses as a run
without it; an injected persistent error saves a checkpoint with the machine's state and ends
the job with Megatron's exit code 16, and the job resumed from it on the same devices re-runs the
iteration and exits 16 again."""

import argparse
import re

from megatron.core import dist_checkpointing as dc
from megatron.core.rerun_state_machine import Call, RerunMode, RerunState
from tests.functional_tests.runner import TINY_MODEL, parse_log_lines, run_pretrain

ITERATIONS = 4
RUN = TINY_MODEL + ["--train-iters", str(ITERATIONS)]  # dropout 0.1: the re-run must redraw it


def _losses_and_norms(stdout):
    lines = parse_log_lines(stdout)
    assert sorted(lines) == list(range(1, ITERATIONS + 1)), stdout[-3000:]
    return {it: (lines[it]["losses"]["lm loss"], lines[it]["grad_norm"]) for it in lines}


def test_injected_transient_error_is_rerun_and_training_continues_unchanged():
    # The injection lands on the (non-fatal) spiky-loss check of every iteration after the
    # first, on both ranks (rate 1): each is re-run, found not reproducible, and continued.
    checks = ["--no-check-for-nan-in-loss-and-grad", "--check-for-spiky-loss"]
    injected = run_pretrain(RUN + checks + ["--error-injection-rate", "1"], nproc=2, timeout=200)
    out = injected.stdout
    assert injected.returncode == 0, out[-3000:] + injected.stderr[-3000:]
    assert out.count("Need to rerun step to check reproducibility of initial result") == 3, out
    for rank in (0, 1):
        for it in (1, 2, 3):
            assert f"Rank {rank}, node " in out
            assert f"iteration #{it}: Possible transient error!!" in out, out[-3000:]
            assert (
                f"on rank {rank} at iteration #{it} invocation #1 (message='Spiky loss')" in out
            ), out[-3000:]
    assert out.count("Continuing normal execution because failed validation was not fatal") == 3
    # The reference: the same layout without injection. The re-runs redraw the same dropout
    # masks on the same micro-batches, so every logged loss and grad norm is identical.
    reference = run_pretrain(RUN + checks, nproc=2, timeout=200)
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert "Need to rerun" not in reference.stdout
    assert _losses_and_norms(out) == _losses_and_norms(reference.stdout)


def test_injected_persistent_error_checkpoints_and_exits_16(tmp_path):
    ckpt = tmp_path / "ckpt"
    flags = ["--error-injection-rate", "1", "--error-injection-type", "persistent_error"]
    flags += ["--save", str(ckpt), "--save-interval", "100", "--ckpt-format", "torch_dist"]
    result = run_pretrain(RUN + flags, nproc=2, timeout=200)
    out = result.stdout
    # The ranks exit with 16; torchrun reports it (and exits 1 itself).
    assert re.search(r"exitcode\s*: 16 ", result.stderr), out[-3000:] + result.stderr[-3000:]
    assert result.returncode != 0
    assert "Injecting error type Persistent error" in out
    assert "First rerun: unexpected result is reproducible within the tolerance" in out, out[-3000:]
    assert (
        "Saving a checkpoint and exiting now. Please resume the job from the checkpoint to "
        "rerun the last iteration and establish a diagnostic"
    ) in out
    # Saved at the start of the suspicious iteration (the 2nd: the 1st is never validated),
    # before its optimizer step, with every rank's part of the machine's state.
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert " iteration        2/" not in out
    # megatron-core's form and types: the common part in common.pt with its enums ...
    common = dc.load_common(str(ckpt / "iter_0000001"), safe_globals=[argparse.Namespace])
    saved = common["rerun_state_machine"]
    assert saved == {
        "mode": RerunMode.VALIDATE_RESULTS,
        "state": RerunState.WILL_RERUN_FROM_CHECKPOINT,
        "current_iteration": 1,
    }
    # ... and each rank's part as the object rerun_state_machine_state on a (world size,) grid
    # at the rank, its failed validation a Call.
    parts = [
        dc.ShardedObject("rerun_state_machine_state", None, (2,), (rank,), read_back=True)
        for rank in range(2)
    ]
    dc.load({part.name: part for part in parts}, str(ckpt / "iter_0000001"))
    assert [part.data["suspicious_device"] for part in parts] == [0, 1]
    assert all(part.data["checkpoint_requested"] for part in parts)
    assert all(isinstance(part.data["failed_validation_call"], Call) for part in parts)

    # Resumed on the same devices, the machine reads its state back, re-runs the iteration,
    # finds itself on the suspicious device again and asks once more for a restart (exit 16).
    resumed = run_pretrain(RUN + flags + ["--load", str(ckpt)], nproc=2, timeout=200)
    out = resumed.stdout
    assert re.search(r"exitcode\s*: 16 ", resumed.stderr), out[-3000:] + resumed.stderr[-3000:]
    assert "Getting RerunStateMachine state from checkpoint. Will rerun step." in out
    assert (
        "Need to restart job from the same checkpoint because it was scheduled on the same node/GPU"
    ) in out, out[-3000:]
