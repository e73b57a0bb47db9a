"""The rerun state machine in real training at 2 processes (torchrun, gloo), judged as Megatron-LM
judges its own rerun functional tests: by the lines of the run's log.

Megatron's five rerun tests (tests/functional_tests/test_cases/gpt/gpt3_mcore_reruns_*) train
a GPT with ``--rerun-mode validate_results`` and an injected error, save, and resume; their
AFTER_SCRIPT then greps the log directory (stdout and stderr) for fixed lines, with
``grep -r -F`` or ``grep -r -E``. MEGATRON_CHECKS below are those lines, copied as they are;
the runs here are the same configurations shrunk to a tiny GPT on CPU:

* transient: an injected transient error (on the fatal NaN check) is re-run in place, found
  not reproducible, and the job ends (exit 17).
* persistent_1: an injected persistent error is reproduced in place; the job saves a checkpoint
  with the machine's state and exits 16.
* persistent_2: that checkpoint, resumed on other devices, re-runs the iteration there, finds it
  different and reports a persistent error (exit 17).
* resume: a checkpoint is loaded and validation goes on.
* reshard: that checkpoint, loaded at another tensor-parallel size, has its rerun state ignored.

The injection rate is 1 here (Megatron's 100 presumes 50 iterations of 32 micro-batches): the
error lands on the first validated iteration. Beside those checks, the runs are tested for what
they must do: an injected transient error on the non-fatal spiky-loss check is re-run on the
same data and training goes on to the same losses as without it; the machine's state is saved
in megatron-core's form; a job resumed on the suspicious devices asks to be restarted again."""

import argparse
import re
import shutil
import socket

import pytest

from megatron.core import dist_checkpointing as dc
from megatron.core.rerun_state_machine import Call, RerunMode, RerunState
from tests.functional_tests.runner import REPO, TINY_MODEL, parse_log_lines, run_pretrain

ITERATIONS = 4
RUN = TINY_MODEL + ["--train-iters", str(ITERATIONS)]  # dropout 0.1: the re-run must redraw it
RERUN = ["--rerun-mode", "validate_results"]
PERSISTENT = ["--error-injection-rate", "1", "--error-injection-type", "persistent_error"]
TORCH_DIST = ["--ckpt-format", "torch_dist"]
MACHINE = "megatron.core.rerun_state_machine"

# Megatron-LM's AFTER_SCRIPT of each rerun test: (grep option, pattern), every one must match a
# line of the log.
MEGATRON_CHECKS = {
    "transient": [
        ("-F", "WARNING:megatron.core.rerun_state_machine:Result validation enabled"),
        (
            "-F",
            "WARNING:megatron.core.rerun_state_machine:Injecting error type Transient error",
        ),
        (
            "-E",
            r"ERROR:megatron\.core\.rerun_state_machine:Rank [0-9]+, node ([0-9a-z]|\-)+, "
            r"device [0-9]+: Possible transient error!!",
        ),
    ],
    "persistent_1": [
        ("-F", "WARNING:megatron.core.rerun_state_machine:Result validation enabled"),
        (
            "-F",
            "WARNING:megatron.core.rerun_state_machine:Injecting error type Persistent error",
        ),
        (
            "-F",
            "WARNING:megatron.core.rerun_state_machine:First rerun: unexpected result is "
            "reproducible within the tolerance",
        ),
        (
            "-F",
            "WARNING:megatron.core.rerun_state_machine:Saving a checkpoint and exiting now. "
            "Please resume the job from the checkpoint to rerun the last iteration and "
            "establish a diagnostic",
        ),
    ],
    "persistent_2": [
        ("-F", "WARNING:megatron.core.rerun_state_machine:Result validation enabled"),
        (
            "-E",
            r"ERROR:megatron\.core\.rerun_state_machine:Rank [0-9]+, node ([0-9a-z]|\-)+, "
            r"device [0-9]+: Possible persistent error!!",
        ),
    ],
    "resume": [
        ("-F", "successfully loaded checkpoint"),
        ("-F", "WARNING:megatron.core.rerun_state_machine:Result validation enabled"),
    ],
    "reshard": [
        ("-F", "WARNING:megatron.core.rerun_state_machine:Result validation enabled"),
        ("-F", "Job sharding has changed: Rerun state will be ignored"),
    ],
}

# The restarted job on other devices of the node: local rank r runs on device n - 1 - r (on CPU
# the machine's "device" is the local rank; on a GPU the local rank picks the device).
OTHER_DEVICES = """import os, runpy, sys
local, size = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
os.environ["LOCAL_RANK"] = str(size - 1 - local)
sys.argv[0] = {script!r}
runpy.run_path({script!r}, run_name="__main__")
"""


def log_of(result) -> str:
    """What Megatron's checks grep: everything the run printed (its logger lines go to stderr,
    as Python logging's default handler sends them)."""
    return result.stdout + "\n" + result.stderr


def assert_megatron_checks_pass(test, result):
    """Megatron's ``check_log() { if [[ -z $(grep -r $1 "$2" $LOG_DIR) ]]; then exit 1; ...``
    for each line of the test's AFTER_SCRIPT."""
    lines = log_of(result).splitlines()
    for option, pattern in MEGATRON_CHECKS[test]:
        if option == "-F":
            found = any(pattern in line for line in lines)
        else:
            found = any(re.search(pattern, line) for line in lines)
        assert found, (
            f"{test}: no line matches grep {option} {pattern!r}\n" + log_of(result)[-4000:]
        )


def exit_code_of_ranks(result) -> int:
    """The exit code torchrun reports for the ranks that ended the job (it exits 1 itself, and
    stops any rank still running with SIGTERM, -15)."""
    assert result.returncode != 0, log_of(result)[-3000:]
    codes = set(re.findall(r"exitcode\s*: (-?\d+) ", result.stderr)) - {"-15"}
    assert len(codes) == 1, log_of(result)[-3000:]
    return int(codes.pop())


def _losses_and_norms(stdout):
    lines = parse_log_lines(stdout)
    assert sorted(lines) == list(range(1, ITERATIONS + 1)), stdout[-3000:]
    return {it: (lines[it]["losses"]["lm loss"], lines[it]["grad_norm"]) for it in lines}


def test_megatron_transient_error_is_rerun_in_place_and_ends_the_job():
    flags = RERUN + ["--error-injection-rate", "1", "--error-injection-type", "transient_error"]
    result = run_pretrain(RUN + flags, nproc=2, timeout=200)
    assert_megatron_checks_pass("transient", result)
    log = log_of(result)
    # A fresh start: the machine counts from iteration 0, as Megatron's train() sets it.
    assert "Setting rerun_state_machine.current_iteration to 0..." in result.stdout
    # The NaN check is fatal: the job ends after the in-place re-run (Megatron's exit code 17).
    assert exit_code_of_ranks(result) == 17
    assert (
        "WARNING:megatron.core.rerun_state_machine:Exiting now. A checkpoint at the last "
        "iteration is being saved if further examination is needed"
    ) in log
    assert " iteration        2/" not in result.stdout


def test_injected_transient_error_is_rerun_and_training_continues_unchanged():
    # The injection lands on the (non-fatal) spiky-loss check of every iteration after the
    # first, on both ranks (rate 1): each is re-run, found not reproducible, and continued.
    checks = ["--no-check-for-nan-in-loss-and-grad", "--check-for-spiky-loss"]
    injected = run_pretrain(RUN + checks + ["--error-injection-rate", "1"], nproc=2, timeout=200)
    log = log_of(injected)
    assert injected.returncode == 0, log[-6000:]
    assert_megatron_checks_pass("transient", injected)
    rerun = f"WARNING:{MACHINE}:Need to rerun step to check reproducibility of initial result"
    assert log.count(rerun) == 3, log  # rank 0 says it, once per iteration 2, 3, 4
    node = socket.gethostname()
    for rank in (0, 1):  # on CPU a rank's device is its local rank
        failure = f"ERROR:{MACHINE}:Rank {rank}, node {node}, device {rank}: "
        assert log.count(failure + "Possible transient error!!\n") == 3, log[-6000:]
    for it in (2, 3, 4):  # each rank's first validation of the iteration was rejected
        rejected = re.findall(
            rf"^ERROR:{MACHINE}:Unexpected result .+ at .+/megatron/training/rerun\.py line "
            rf"\d+, invokation #1 at iteration #{it} \(message='Spiky loss'\)$",
            log,
            flags=re.MULTILINE,
        )
        assert len(rejected) == 2, log[-6000:]
    continuing = f"WARNING:{MACHINE}:Continuing normal execution because failed validation was not"
    assert log.count(continuing) == 3
    # The reference: the same layout without injection. The re-runs redraw the same dropout
    # masks on the same micro-batches, so every logged loss and grad norm is identical.
    reference = run_pretrain(RUN + checks, nproc=2, timeout=200)
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert "Need to rerun" not in log_of(reference)
    assert _losses_and_norms(injected.stdout) == _losses_and_norms(reference.stdout)


@pytest.fixture(scope="module")
def persistent_first_job(tmp_path_factory):
    """persistent_1: the first job, with an injected persistent error and --save."""
    ckpt = tmp_path_factory.mktemp("rerun") / "ckpt"
    save = ["--save", str(ckpt), "--save-interval", "100"]
    return ckpt, run_pretrain(RUN + TORCH_DIST + RERUN + PERSISTENT + save, nproc=2, timeout=200)


def test_megatron_persistent_error_checkpoints_the_machine_and_exits_16(persistent_first_job):
    ckpt, first = persistent_first_job
    assert_megatron_checks_pass("persistent_1", first)
    assert exit_code_of_ranks(first) == 16
    # Saved at the start of the suspicious iteration (the 2nd: the 1st is never validated),
    # before its optimizer step, with every rank's part of the machine's state.
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert " iteration        2/" not in first.stdout
    # megatron-core's form and types: the common part in common.pt with its enums (the machine
    # numbers iterations as the log line does: the suspicious one is the 2nd) ...
    common = dc.load_common(str(ckpt / "iter_0000001"), safe_globals=[argparse.Namespace])
    assert common["rerun_state_machine"] == {
        "mode": RerunMode.VALIDATE_RESULTS,
        "state": RerunState.WILL_RERUN_FROM_CHECKPOINT,
        "current_iteration": 2,
    }
    # ... and each rank's part as the object rerun_state_machine_state on a (world size,) grid
    # at the rank, its failed validation a Call.
    parts = [
        dc.ShardedObject("rerun_state_machine_state", None, (2,), (rank,), read_back=True)
        for rank in range(2)
    ]
    dc.load_shards({part.name: part for part in parts}, str(ckpt / "iter_0000001"))
    assert [part.data["suspicious_device"] for part in parts] == [0, 1]
    assert all(part.data["checkpoint_requested"] for part in parts)
    assert all(isinstance(part.data["failed_validation_call"], Call) for part in parts)


def _resumed(ckpt, tmp_path, *flags, script="pretrain_gpt.py"):
    """A job started from the first job's checkpoint (a copy: every resume sees it as saved)."""
    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt, copy)
    load = ["--save", str(copy), "--save-interval", "100", "--load", str(copy)]
    return run_pretrain(
        RUN + TORCH_DIST + RERUN + load + list(flags), nproc=2, timeout=200, script=script
    )


def test_megatron_persistent_error_is_confirmed_on_other_devices(persistent_first_job, tmp_path):
    # persistent_2: resumed on other devices (no injection flags: the state comes from the
    # checkpoint), the iteration is re-run there, differs, and the job ends (exit 17).
    ckpt, _ = persistent_first_job
    wrapper = tmp_path / "on_other_devices.py"
    wrapper.write_text(OTHER_DEVICES.format(script=str(REPO / "pretrain_gpt.py")))
    second = _resumed(ckpt, tmp_path, script=str(wrapper))
    assert_megatron_checks_pass("persistent_2", second)
    log = log_of(second)
    assert (
        f"WARNING:{MACHINE}:Getting RerunStateMachine state from checkpoint, CLI rerun args ignored"
    ) in log
    assert exit_code_of_ranks(second) == 17
    assert (
        f"WARNING:{MACHINE}:Exiting now. A checkpoint at the last iteration already exists "
        "if further examination is needed"
    ) in log
    # The re-run keeps the suspicious iteration's number (Megatron would reset it to 1).
    assert "Setting rerun_state_machine.current_iteration" not in second.stdout


def test_megatron_resume_on_the_suspicious_devices_asks_for_another_restart(
    persistent_first_job, tmp_path
):
    # resume: on the suspicious devices themselves the machine reads its state back, re-runs
    # the iteration, and asks once more for a restart (exit 16).
    ckpt, _ = persistent_first_job
    again = _resumed(ckpt, tmp_path)
    assert_megatron_checks_pass("resume", again)
    assert exit_code_of_ranks(again) == 16
    assert (
        f"WARNING:{MACHINE}:Need to restart job from the same checkpoint because it was "
        "scheduled on the same node/GPU"
    ) in log_of(again)


def test_megatron_reshard_ignores_the_rerun_state(persistent_first_job, tmp_path):
    # reshard: at TP=2 (DP=1) the checkpoint's rerun state is ignored and training goes on.
    ckpt, _ = persistent_first_job
    resharded = _resumed(ckpt, tmp_path, "--tensor-model-parallel-size", "2")
    assert resharded.returncode == 0, log_of(resharded)[-6000:]
    assert_megatron_checks_pass("reshard", resharded)
    assert "Getting RerunStateMachine state" not in log_of(resharded)
    assert "Setting rerun_state_machine.current_iteration to 1..." in resharded.stdout
    assert sorted(parse_log_lines(resharded.stdout)) == [2, 3, 4]
