"""The rerun state machine (megatron/core/rerun_state_machine.py), in one process: each mode,
each injected error type, the transient / persistent / correct decision, the thresholds of the
spiky-loss and large-gradient checks against hand-computed cases, and its checkpointed state.

The "training step" here is a loop over a RerunDataIterator that validates one value per
micro-batch, as the loss function does in pretrain_gpt.py."""

import argparse
import io
import logging
import math
import random
import re

import pytest
import torch

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.rerun_state_machine import (
    EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
    EXIT_CODE_RESUME_TO_DISAMBIGUATE,
    QuickStats,
    RerunDataIterator,
    RerunErrorInjector,
    RerunMode,
    RerunStateMachine,
    compare_floats,
)
from megatron.core.utils import NonFiniteValueError
from megatron.training import global_vars
from megatron.training.rerun import check_loss, results_not_validated

NAN = float("nan")


def machine_for(mode="validate_results", rate=0, kind="transient_error", device=0, **kwargs):
    return RerunStateMachine(
        mode=mode,
        error_injector=RerunErrorInjector(rate, kind),
        node="node-a",
        device=device,
        **kwargs,
    )


def step(machine, iterator, compute, fatal=True, micro_batches=1):
    """One iteration: returns (batches the forward saw, should_checkpoint_and_exit())."""
    seen = []
    while machine.should_run_forward_backward(iterator):
        for _ in range(micro_batches):
            batch = next(iterator)
            seen.append(batch)
            machine.validate_result(
                torch.tensor(compute(batch)), torch.isnan, "found NaN in test", fatal=fatal
            )
    return seen, machine.should_checkpoint_and_exit()


STEP_VALIDATES_AT = step.__code__.co_firstlineno + 7
"""The line of step() that calls validate_result (the caller the log line names)."""


def messages(caplog):
    return [r.getMessage() for r in caplog.records]


def log_lines(caplog):
    """The records as the training processes print them: logging's default format,
    ``LEVEL:logger.name:message`` (Megatron-LM's checks grep for these lines)."""
    formatter = logging.Formatter(logging.BASIC_FORMAT)
    return [formatter.format(r) for r in caplog.records]


MACHINE = "megatron.core.rerun_state_machine"


@pytest.fixture(autouse=True)
def _capture_machine_logs(caplog):
    caplog.set_level(logging.INFO, logger="megatron.core.rerun_state_machine")


# ------------------------------------------------------------------ modes without rejection
def test_validate_results_runs_each_iteration_once_when_every_result_is_good():
    machine = machine_for()
    iterator = RerunDataIterator(iter(range(10)))
    for expected in range(3):
        seen, decision = step(machine, iterator, float)
        assert seen == [expected] and decision == (False, False, 0)
    assert machine.current_iteration == 2


def test_the_first_iteration_is_not_validated(caplog):
    # No checkpoint can be taken before the first optimizer step: Megatron does not validate it.
    machine = machine_for()
    seen, decision = step(machine, RerunDataIterator(iter([0, 1])), lambda b: NAN)
    assert seen == [0] and decision == (False, False, 0)
    assert not any("Unexpected result" in m for m in messages(caplog))


def test_disabled_mode_runs_once_and_stops_on_a_fatal_result():
    machine = machine_for("disabled")
    iterator = RerunDataIterator(iter(range(10)), record=False)
    assert step(machine, iterator, float) == ([0], (False, False, 0))
    assert iterator.saved_microbatches == []  # nothing kept to replay
    with pytest.raises(
        NonFiniteValueError,
        match=r"^Rank 0, node node-a, device 0, iteration 1: Unexpected result nan "
        r"\(message='found NaN in test'\)$",
    ):
        step(machine, iterator, lambda b: NAN)


def test_disabled_mode_only_logs_a_non_fatal_result(caplog):
    machine = machine_for("disabled")
    seen, decision = step(machine, RerunDataIterator(iter(range(3))), lambda b: NAN, fatal=False)
    assert (seen, decision) == ([0], (False, False, 0))
    assert (
        "iteration 0: Unexpected result nan (message='found NaN in test')" in messages(caplog)[-1]
    )


# ------------------------------------------------------------------ real faults
def test_a_transient_fatal_fault_is_rerun_on_the_same_data_then_checkpoints_and_exits_17(caplog):
    machine = machine_for()
    iterator = RerunDataIterator(iter(range(10)))
    step(machine, iterator, float)
    results = iter([NAN, 1.0])  # the NaN does not come back in the re-run
    seen, decision = step(machine, iterator, lambda b: next(results), micro_batches=1)
    assert seen == [1, 1]  # re-run on the replayed micro-batch
    assert decision == (True, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION)
    log = log_lines(caplog)
    assert (
        f"ERROR:{MACHINE}:Unexpected result nan at {__file__} line {STEP_VALIDATES_AT}, "
        "invokation #1 at iteration #1 (message='found NaN in test')"
    ) in log
    assert f"WARNING:{MACHINE}:Need to rerun step to check reproducibility of initial result" in log
    assert (
        f"WARNING:{MACHINE}:First rerun: unexpected result is not reproducible within the "
        "tolerance (1.0 != nan)"
    ) in log
    assert f"ERROR:{MACHINE}:Rank 0, node node-a, device 0: Possible transient error!!" in log
    assert messages(caplog)[-1] == (
        "Exiting now. A checkpoint at the last iteration is being saved if further examination "
        "is needed"
    )


def test_a_transient_non_fatal_fault_is_rerun_and_training_continues(caplog):
    machine = machine_for()
    iterator = RerunDataIterator(iter(range(10)))
    step(machine, iterator, float)
    results = iter([NAN, 1.0])
    seen, decision = step(machine, iterator, lambda b: next(results), fatal=False)
    assert seen == [1, 1] and decision == (False, False, 0)
    assert "Continuing normal execution because failed validation was not fatal" in messages(caplog)
    # The next iteration reads the next batch, once.
    assert step(machine, iterator, float) == ([2], (False, False, 0))


def test_a_reproduced_fatal_fault_checkpoints_with_its_state_and_exits_16(caplog):
    machine = machine_for()
    iterator = RerunDataIterator(iter(range(10)))
    step(machine, iterator, float)
    seen, decision = step(machine, iterator, lambda b: NAN)
    assert seen == [1, 1]
    assert decision == (True, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE)
    assert messages(caplog)[-1] == (
        "Saving a checkpoint and exiting now. Please resume the job from the checkpoint to "
        "rerun the last iteration and establish a diagnostic"
    )
    state = machine.state_dict(iterator)
    assert RerunStateMachine.validate_state_dict(state)
    assert state["sharded"]["suspicious_device"] == 0
    assert state["sharded"]["data_iterator_checkpoints"][0]["saved_microbatches"] == [1]


def test_the_rerun_state_survives_a_weights_only_checkpoint():
    machine = machine_for(rate=1, kind="persistent_error")
    iterator = RerunDataIterator(iter([torch.ones(2), torch.zeros(2)]))
    step(machine, iterator, lambda b: 1.0)
    step(machine, iterator, lambda b: 1.0)
    buffer = io.BytesIO()
    torch.save(machine.state_dict(iterator), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    other = machine_for(device=1)
    other.load_state_dict(loaded)
    assert other.state.name == "WILL_RERUN_FROM_CHECKPOINT"
    assert other.failed_validation_call == machine.failed_validation_call
    assert other.error_injector.injected_error_type == machine.error_injector.injected_error_type
    assert torch.equal(other.initial_result, machine.initial_result)
    assert torch.equal(other.data_iterator_checkpoints[0]["saved_microbatches"][0], torch.zeros(2))


def test_nothing_is_checkpointed_between_iterations():
    machine = machine_for()
    iterator = RerunDataIterator(iter(range(3)))
    step(machine, iterator, float)
    assert machine.state_dict(iterator) is None
    assert not RerunStateMachine.validate_state_dict(None)


# ------------------------------------------------------------------ injected errors
def _injected_first_job(kind, caplog):
    """A first job with an error injected at iteration 1; returns (decision, saved state)."""
    machine = machine_for(rate=1, kind=kind)
    iterator = RerunDataIterator(iter(range(10)))
    step(machine, iterator, float)
    seen, decision = step(machine, iterator, float)
    assert seen == [1, 1]
    assert "Injecting error type" in "\n".join(messages(caplog))
    return decision, machine.state_dict(iterator)


def _restarted_job(state, device):
    """The restarted job (on ``device``) re-runs the iteration from the checkpoint."""
    machine = machine_for(rate=1, kind="transient_error", device=device)
    machine.load_state_dict(state)
    return step(machine, RerunDataIterator(iter(range(1, 10))), float)


def test_injected_transient_error_on_a_non_fatal_check_continues(caplog):
    machine = machine_for(rate=1, kind="transient_error")
    iterator = RerunDataIterator(iter(range(10)))
    step(machine, iterator, float)
    for expected in (1, 2, 3):  # rate 1: every iteration is injected, re-run, continued
        assert step(machine, iterator, float, fatal=False) == (
            [expected, expected],
            (False, False, 0),
        )
    log = log_lines(caplog)
    assert log.count(f"WARNING:{MACHINE}:Injecting error type Transient error") == 3
    assert (
        f"WARNING:{MACHINE}:First rerun: unexpected result is not reproducible within the "
        "tolerance (3.0 != 3.0)"
    ) in log
    # Megatron logs the diagnostic as an error whether or not the check is fatal.
    assert (
        log.count(f"ERROR:{MACHINE}:Rank 0, node node-a, device 0: Possible transient error!!") == 3
    )


def test_injected_transient_error_on_a_fatal_check_exits_17(caplog):
    decision, _ = _injected_first_job("transient_error", caplog)
    assert decision == (True, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION)
    assert f"ERROR:{MACHINE}:Rank 0, node node-a, device 0: Possible transient error!!" in (
        log_lines(caplog)
    )


def test_injected_persistent_error_exits_16_then_17_on_another_device(caplog):
    decision, state = _injected_first_job("persistent_error", caplog)
    assert decision == (True, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE)
    first_job = log_lines(caplog)
    for line in (  # the lines Megatron-LM's gpt3_mcore_reruns_persistent_1 test greps for
        "Result validation enabled",
        "Injecting error type Persistent error",
        "First rerun: unexpected result is reproducible within the tolerance (1.0 = 1.0). "
        "Need to rerun on a different GPU to verify correctness",
        "Saving a checkpoint and exiting now. Please resume the job from the checkpoint to "
        "rerun the last iteration and establish a diagnostic",
    ):
        assert f"WARNING:{MACHINE}:{line}" in first_job
    seen, decision = _restarted_job(state, device=1)
    assert seen == [1]
    assert decision == (False, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION)
    log = messages(caplog)
    assert "Getting RerunStateMachine state from checkpoint, CLI rerun args ignored" in log
    assert any(
        m.startswith(
            "Second rerun: unexpected result is not reproducible on a different GPU, "
            "therefore was likely incorrect"
        )
        for m in log
    )
    assert f"ERROR:{MACHINE}:Rank 0, node node-a, device 1: Possible persistent error!!" in (
        log_lines(caplog)
    )
    assert log[-1] == (
        "Exiting now. A checkpoint at the last iteration already exists if further "
        "examination is needed"
    )


def test_injected_correct_result_is_confirmed_on_another_device(caplog):
    decision, state = _injected_first_job("correct_result", caplog)
    assert decision == (True, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE)
    _, decision = _restarted_job(state, device=1)
    assert decision == (False, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION)
    assert (
        f"ERROR:{MACHINE}:Rank 0, node node-a, device 1: Correct result (but possible "
        "Application error) (found NaN in test)!"
    ) in log_lines(caplog)


def test_a_restart_on_the_same_device_asks_to_resume_again(caplog):
    _, state = _injected_first_job("persistent_error", caplog)
    _, decision = _restarted_job(state, device=0)
    assert decision == (False, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE)
    log = messages(caplog)
    assert (
        "Got rescheduled on the same GPU. Need to resume again from the same checkpoint "
        "(node: node-a, gpu: 0)"
    ) in log
    assert log[-1] == (
        "Exiting now. Please resume the job from the same checkpoint to rerun the last "
        "iteration and establish a diagnostic"
    )


def test_injection_rate_draws_one_in_n_per_rank():
    # (randint(0, N-1) + rank) % N == 0: for each draw exactly one rank of N injects.
    for rank in range(3):
        injector = RerunErrorInjector(3, "transient_error", rank=rank)
        random.seed(7)
        hits = []
        for _ in range(30):
            hits.append(injector.maybe_inject())
            injector.injected_error_type = None
        random.seed(7)
        draws = [random.randint(0, 2) for _ in range(30)]
        assert hits == [d == (3 - rank) % 3 for d in draws]
    assert not RerunErrorInjector(0).maybe_inject()


# ------------------------------------------------------------------ RNG and data rewind
def test_the_rerun_starts_from_the_same_rng_states_and_leaves_them_as_one_run_would():
    def noisy(batch):
        return batch + torch.rand(()).item() + random.random()

    reference_machine = machine_for()
    reference = RerunDataIterator(iter(range(10)))
    torch.manual_seed(0)
    random.seed(0)
    step(reference_machine, reference, noisy)
    step(reference_machine, reference, noisy, fatal=False)
    expected = (torch.rand(()).item(), random.random())

    machine = machine_for(rate=1, kind="transient_error")
    iterator = RerunDataIterator(iter(range(10)))
    torch.manual_seed(0)
    random.seed(0)
    step(machine, iterator, noisy)
    values = []
    step(machine, iterator, lambda b: values.append(noisy(b)) or values[-1], fatal=False)
    assert len(values) == 2 and values[0] == values[1]  # same data, same random draws
    assert (torch.rand(()).item(), random.random()) == expected


def test_the_data_iterator_replays_the_iteration():
    iterator = RerunDataIterator(iter(range(10)))
    assert [next(iterator), next(iterator)] == [0, 1]
    iterator.rewind()
    assert [next(iterator), next(iterator)] == [0, 1]
    with pytest.raises(RuntimeError, match="more micro-batches than the initial run"):
        next(iterator)
    iterator.advance()
    assert next(iterator) == 2


def test_a_plain_iterator_is_refused_outside_disabled_mode():
    machine = machine_for()
    with pytest.raises(TypeError, match="needs RerunDataIterator data iterators, got"):
        machine.should_run_forward_backward(iter(range(3)))


# ------------------------------------------------------------------ report_stats
def test_report_stats_reruns_every_iteration_and_reports_the_variability(caplog):
    machine = machine_for("report_stats")
    iterator = RerunDataIterator(iter(range(10)))
    runs = iter([1.0, 1.0, 1.0, 3.0, 2.0, 2.0])  # iteration 1 differs between its two runs
    for expected in range(3):
        seen, decision = step(machine, iterator, lambda b: next(runs), fatal=True)
        assert seen == [expected, expected] and decision == (False, False, 0)
    log = messages(caplog)
    # Reported at iterations 0 and 2 (every 2); |1 - 3| / mean(1, 3) = 1.0.
    assert log.count("Stats on computation determinism in validation calls") == 2
    assert log[-2:] == [
        "  From 'found NaN in test':",
        "    3/2 total/identical samples, rel. variability: avg= 3.333E-01, p50= 0.0, "
        "p90= 1.000E+00, p99= 1.000E+00, p99.9= 1.000E+00, max: 1.000E+00",
    ]


def test_quick_stats_summary_by_hand():
    stats = QuickStats()
    for value in (0.0, 0.5, 0.25):
        stats.record(value)
    # zeros 1, samples [0.25, 0.5], total 3: avg 0.75 / 3; p50 index int(1.5) - 1 = 0.
    assert stats.print_stats() == (
        "3/1 total/identical samples, rel. variability: avg= 2.500E-01, p50= 2.500E-01, "
        "p90= 5.000E-01, p99= 5.000E-01, p99.9= 5.000E-01, max: 5.000E-01"
    )
    empty = QuickStats()
    empty.record(0.0)
    assert empty.print_stats() == "1 samples, all identical"


def test_compare_floats_by_hand():
    assert compare_floats(torch.tensor(2.0), torch.tensor(2.0)) == 0.0
    assert compare_floats(torch.tensor(NAN), torch.tensor(NAN)) == 0.0
    assert compare_floats(torch.tensor(1.0), torch.tensor(NAN)) == math.inf
    assert compare_floats(torch.tensor(math.inf), torch.tensor(1.0)) == math.inf
    assert compare_floats(torch.tensor(1.0), torch.tensor(3.0)) == 1.0  # |-2| / 2


# ------------------------------------------------------------------ thresholds
def test_is_unexpectedly_large_against_hand_computed_cases(caplog):
    machine = machine_for()
    large = machine.is_unexpectedly_large
    # The first 3 samples set the max of absolute values: 4.
    assert [large(torch.tensor(v), 10, "loss", num_samples=3) for v in (1.0, -4.0, 2.0)] == [
        False
    ] * 3
    assert "Max value for loss: 4.0" in messages(caplog)
    assert large(torch.tensor(39.99), 10, "loss", num_samples=3) is False
    assert large(torch.tensor(40.0), 10, "loss", num_samples=3) is True  # >= 10 x 4
    assert large(torch.tensor(-40.0), 10, "loss", num_samples=3) is True
    assert large(torch.tensor(NAN), 10, "loss", num_samples=3) is False  # left to the NaN check
    assert large(torch.tensor(1000.0), 10, "grads", num_samples=3) is False  # own context


def test_spiky_loss_check_is_ten_times_the_max_of_the_first_100_losses(caplog):
    machine = machine_for()
    global_vars.set_rerun_state_machine(machine)
    try:
        args = argparse.Namespace(check_for_nan_in_loss_and_grad=True, check_for_spiky_loss=True)
        iterator = RerunDataIterator(iter(range(200)))
        # Iteration 0 is not validated; iterations 1..100 are the samples (max 2.0).
        losses = iter([50.0, 2.0] + [1.0] * 99 + [19.99, 20.0])

        def loss_step():
            while machine.should_run_forward_backward(iterator):
                batch = next(iterator)
                value = next(losses) if machine.state.name == "INITIAL_RUN" else 1.0
                check_loss(torch.tensor(value), args, iteration=batch)
            return machine.should_checkpoint_and_exit()

        for _ in range(102):  # iteration 0, the 100 samples, then 19.99: below 10 x 2.0
            assert loss_step() == (False, False, 0)
        assert not any("Spiky loss" in m for m in messages(caplog))
        assert "Max value for loss: 2.0" in messages(caplog)
        assert loss_step() == (False, False, 0)  # 20.0: a spike, not reproduced, not fatal
        log = messages(caplog)
        assert any("Unexpected result 20.0" in m and "(message='Spiky loss')" in m for m in log)
        assert log[-1] == "Continuing normal execution because failed validation was not fatal"
    finally:
        global_vars.set_rerun_state_machine(None)


def test_ddp_validates_each_buckets_local_grad_norm_before_the_reduction(caplog):
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3)
    config = DistributedDataParallelConfig(check_for_nan_in_grad=True, check_for_large_grads=True)
    ddp = DistributedDataParallel(None, config, layer)
    machine = machine_for()
    ddp.set_rerun_state_machine(machine)
    iterator = RerunDataIterator(iter([torch.ones(2, 4)] * 3))
    norms = []

    def run(scale):
        while machine.should_run_forward_backward(iterator):
            ddp.zero_grad_buffer()
            (ddp(next(iterator)).sum() * scale).backward()
            ddp.finish_grad_sync()
            norms.append(
                torch.cat([p.main_grad.double().flatten() for p in layer.parameters()]).norm()
            )
        return machine.should_checkpoint_and_exit()

    run(1.0)  # the first iteration is not validated
    run(2.0)
    assert machine.max_values["grads"] == pytest.approx(norms[-1].item(), rel=1e-6)
    assert run(NAN) == (True, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE)  # NaN both times
    assert any(
        "(message='found NaN in local grad norm for bucket #0 in backward pass before "
        "data-parallel communication collective')" in m
        for m in messages(caplog)
    )


def test_rejected_results_are_recorded_in_the_tracker_file(tmp_path):
    tracker = tmp_path / "rejected.txt"
    machine = machine_for(result_rejected_tracker_filename=str(tracker))
    iterator = RerunDataIterator(iter(range(10)))
    step(machine, iterator, float)
    results = iter([NAN, 1.0])
    step(machine, iterator, lambda b: next(results))
    lines = tracker.read_text().splitlines()
    pattern = (
        r"ts=\S+ \S+ node=node-a device=0 jobID=N/A rank=0 iteration=1 status={} "
        r"result={} message='found NaN in test'"
    )
    assert re.fullmatch(pattern.format("initial_run", "nan"), lines[0]), lines
    assert re.fullmatch(pattern.format("first_rerun_not_reproducible", "1.0"), lines[1]), lines
    assert len(lines) == 2
    with pytest.raises(IsADirectoryError, match="--result-rejected-tracker-filename .* cannot"):
        machine_for(result_rejected_tracker_filename=str(tmp_path))


def test_evaluation_runs_with_the_machine_disabled(caplog):
    machine = machine_for()
    global_vars.set_rerun_state_machine(machine)
    args = argparse.Namespace(check_for_nan_in_loss_and_grad=True, check_for_spiky_loss=False)
    try:
        with results_not_validated():
            assert machine.mode == RerunMode.DISABLED
            with pytest.raises(NonFiniteValueError, match="found NaN in local forward loss"):
                check_loss(torch.tensor(NAN), args, iteration=3)
        assert machine.mode == RerunMode.VALIDATE_RESULTS
    finally:
        global_vars.set_rerun_state_machine(None)


# ------------------------------------------------------------------ where the lines go
def test_training_processes_print_logger_lines_in_loggings_default_format(monkeypatch, capsys):
    """A training process (no logging configured) prints every logger line from INFO up on
    stderr as ``LEVEL:logger.name:message``, the lines Megatron-LM's checks grep for;
    MEGATRON_LOGGING_LEVEL sets the level, and a malformed one is refused with one line."""
    from megatron.training.initialize import configure_logging

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    root.handlers.clear()  # as in a fresh process (pytest adds its own); restored below
    monkeypatch.delenv("MEGATRON_LOGGING_LEVEL", raising=False)
    try:
        configure_logging()
        machine = logging.getLogger(MACHINE)
        machine.warning("Result validation enabled")
        logging.getLogger("megatron.core.num_microbatches_calculator").info("constant 4")
        logging.getLogger("megatron.core.datasets").debug("not shown")
        assert capsys.readouterr().err.splitlines() == [
            f"WARNING:{MACHINE}:Result validation enabled",
            "INFO:megatron.core.num_microbatches_calculator:constant 4",
        ]
        monkeypatch.setenv("MEGATRON_LOGGING_LEVEL", str(logging.WARNING))
        configure_logging()  # the handler is kept, the level is the environment's
        logging.getLogger("megatron.core.num_microbatches_calculator").info("not shown")
        machine.error("Rank 0, node n, device 0: Possible transient error!")
        assert capsys.readouterr().err.splitlines() == [
            f"ERROR:{MACHINE}:Rank 0, node n, device 0: Possible transient error!"
        ]
        monkeypatch.setenv("MEGATRON_LOGGING_LEVEL", "warning")
        with pytest.raises(SystemExit, match="^2$"):
            configure_logging()
        assert (
            capsys.readouterr().err == "error: MEGATRON_LOGGING_LEVEL='warning' is not a number\n"
        )
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
