"""megatron/training/checkpoint_rng_state.py: the RNG and rerun state in Megatron-LM's form.

End to end (a TP=2 resume with dropout, a rerun checkpoint resumed) in
tests/functional_tests/test_checkpoint_torch_dist.py and test_rerun_e2e.py; against the real
megatron-core in tests/interop/test_megatron_core_rng_interop.py.
"""

import io
import pickle
import pickletools
import random

import numpy as np
import pytest
import torch

from megatron.core import dist_checkpointing as dc
from megatron.core.dist_checkpointing.planner import load_object
from megatron.core.rerun_state_machine import Call, RerunDiagnostic, RerunMode, RerunState
from megatron.training import checkpoint_rng_state as crs
from tests.unit_tests.dist_utils import run_distributed


def _machine_state():
    """A rerun state machine's state_dict() at a re-run checkpoint (plain values)."""
    return {
        "mode": "validate_results",
        "state": 3,
        "current_iteration": 7,
        "sharded": {
            "rerun_requested": False,
            "checkpoint_requested": True,
            "restart_again_requested": False,
            "continue_requested": False,
            "error_injector_checkpoint": {
                "error_injection_rate": 1,
                "error_injection_type": "persistent_error",
                "injected_error_type": None,
            },
            "failed_validation_call": ["loss is NaN", 1, 0],
            "initial_result": 2.5,
            "suspicious_node": "node0",
            "suspicious_device": 1,
            "data_iterator_checkpoints": None,
            "large_value_counts": {"loss": 3},
            "max_values": {"loss": 4.0},
        },
    }


def _globals_named(obj) -> set:
    """The classes a pickle of ``obj`` names (protocol 2, as torch.save writes them)."""
    names = set()
    for opcode, arg, _ in pickletools.genops(pickle.dumps(obj, protocol=2)):
        if opcode.name == "GLOBAL":
            names.add(arg.replace(" ", "."))
    return names


def test_rerun_state_is_written_in_megatron_cores_types_and_read_back_plain():
    state = _machine_state()
    common, part = crs.rerun_entries(state, rank=1, world_size=2)
    assert part.unique_key == "rerun_state_machine_state/shard_1_2" and not part.replica
    assert common == {
        "mode": RerunMode.VALIDATE_RESULTS,
        "state": RerunState.WILL_RERUN_FROM_CHECKPOINT,
        "current_iteration": 7,
    }
    assert part.data["failed_validation_call"] == Call(("loss is NaN", 1), 0)
    injector = part.data["error_injector_checkpoint"]
    assert injector["error_injection_type"] is RerunDiagnostic.PERSISTENT_ERROR
    # The pickles name megatron-core's classes (the same module path and names here).
    assert {
        "megatron.core.rerun_state_machine.RerunMode",
        "megatron.core.rerun_state_machine.RerunState",
    } <= _globals_named(common)
    assert {
        "megatron.core.rerun_state_machine.Call",
        "megatron.core.rerun_state_machine.Caller",
        "megatron.core.rerun_state_machine.RerunDiagnostic",
    } <= _globals_named(part.data)

    # Read back safely (as an object of a checkpoint is), then plain again, as the machine loads.
    buffer = io.BytesIO()
    torch.save([part.data], buffer)
    buffer.seek(0)
    loaded = load_object(buffer, part.unique_key)
    assert crs.plain_rerun_part(loaded) == state["sharded"]
    plain = crs.plain_rerun_common(common)
    assert plain == {k: v for k, v in state.items() if k != "sharded"}
    assert type(plain["mode"]) is str and type(plain["state"]) is int
    # The plain values written here before stay as they are.
    assert crs.plain_rerun_common(plain) == plain


def test_an_object_that_would_run_code_is_refused():
    buffer = io.BytesIO()
    torch.save([{"hook": print}], buffer)
    buffer.seek(0)
    with pytest.raises(ValueError, match=r"rng_state/shard_0\.0_1\.1: cannot read the object "):
        load_object(buffer, "rng_state/shard_0.0_1.1")


def test_saved_grid_and_the_choice_of_the_data_parallel_entry():
    keys = {"rng_state/shard_0.1_2.4", "decoder.layers.x._extra_state/shard_0_2", "embedding"}
    assert crs.saved_grid(keys, crs.RNG_KEY) == (2, 4)
    assert crs.saved_grid(keys, crs.RERUN_KEY) is None

    class DataParallelRank3:
        def get_data_parallel_rank(self):
            return 3

    saved = [{"n": i} for i in range(4)]
    assert crs.choose_rng_state(saved, DataParallelRank3(), True) == {"n": 3}
    assert crs.choose_rng_state(saved, DataParallelRank3(), False) == {"n": 0}
    with pytest.raises(ValueError, match=r"holds 1 data-parallel state\(s\); data-parallel rank 3"):
        crs.choose_rng_state(saved[:1], DataParallelRank3(), True)


def _draws(tracker):
    with tracker.fork():
        tracked = torch.rand(2)
    return random.random(), float(np.random.random()), torch.rand(2), tracked


def _worker_data_parallel_random_init(rank, world, directory):
    from megatron.core.parallel_state import initialize_model_parallel
    from megatron.core.tensor_parallel.random import RNGStatesTracker, model_parallel_manual_seed

    state = initialize_model_parallel()  # DP = 2
    seed = 1234 + 10 * rank  # Megatron's --data-parallel-random-init seeds
    random.seed(seed), np.random.seed(seed), torch.manual_seed(seed)
    tracker = RNGStatesTracker("cpu")
    model_parallel_manual_seed(tracker, seed)
    entry = crs.rng_sharded_object(state, tracker, data_parallel_random_init=True)
    # Every DP rank's state gathered into one list, written once (by DP rank 0).
    assert len(entry.data) == 2 and entry.replica == (rank == 1)
    assert entry.unique_key == "rng_state/shard_0.0_1.1"
    dc.save_shards({entry.name: entry}, directory)
    if rank == 0:
        dc.write_metadata_json(directory)
    expected = _draws(tracker)

    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    request = crs.rng_request(state)
    dc.load_shards({request.name: request}, directory)
    from megatron.training.checkpointing_common import set_rng_state

    set_rng_state(crs.choose_rng_state(request.data, state, True), tracker)
    got = _draws(tracker)
    assert got[:2] == expected[:2], (rank, got, expected)
    assert torch.equal(got[2], expected[2]) and torch.equal(got[3], expected[3])


def test_data_parallel_random_init_saves_every_dp_ranks_state_and_each_gets_its_own(tmp_path):
    run_distributed(_worker_data_parallel_random_init, 2, str(tmp_path / "ckpt"))


def test_tracker_states_of_another_kind_of_device_are_refused():
    from megatron.core.tensor_parallel.random import RNGStatesTracker, model_parallel_manual_seed

    tracker = RNGStatesTracker("cpu")
    model_parallel_manual_seed(tracker, 1)
    crs.check_tracker_states(tracker.get_states(), tracker)  # its own: fine
    cuda_like = {"model-parallel-rng": torch.zeros(16, dtype=torch.uint8)}  # a CUDA Philox state
    with pytest.raises(ValueError, match=r"'model-parallel-rng'\] is a generator state of 16 "):
        crs.check_tracker_states(cuda_like, tracker)


def test_a_rerun_checkpoint_written_here_before_still_hands_its_state_to_the_machine():
    # Before: the common part with plain values and every rank's part as a list by global rank,
    # all inside common.pt (no object in the DCP files).
    from megatron.core.rerun_state_machine import RerunStateMachine
    from megatron.training import checkpointing_dist, global_vars

    earlier = dict(_machine_state(), sharded=[_machine_state()["sharded"]])
    machine = RerunStateMachine(mode="validate_results")
    global_vars.set_rerun_state_machine(machine)
    try:
        saved = crs.plain_rerun_common(earlier)
        saved, entry = checkpointing_dist._rerun_request(saved, object_keys=set())
        assert entry is None
        checkpointing_dist._restore_rerun_state(saved, entry)
    finally:
        global_vars.set_rerun_state_machine(None)
    assert machine.state is RerunState.WILL_RERUN_FROM_CHECKPOINT
    assert (machine.current_iteration, machine.suspicious_device) == (7, 1)
    assert machine.failed_validation_call == Call(("loss is NaN", 1), 0)
