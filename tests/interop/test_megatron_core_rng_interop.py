"""The RNG state of a torch_dist checkpoint exchanged with the real megatron-core (0.16.1, from
PyPI, driven on CPU by ``tools/interop/mcore_gpt.py``), both ways. The check is what a resume
needs: the restored generators (Python's, numpy's, torch's and the model-parallel tracker's)
draw the same next numbers as the generators that were saved.

* megatron-core saves a model with ``rng_state`` built as Megatron-LM's training loop builds it
  (its ``get_rng_state``: a ShardedObject over (pp, tp)) and writes the next draws; this code
  base restores the RNG from that checkpoint with the functions its ``load_checkpoint`` uses and
  draws the same numbers (a run left at its own seeds does not).
* Two ranks of this code base at TP=2 save their RNG states (different per TP rank, as the
  tracker is) with the function its ``save_checkpoint`` uses; megatron-core's
  ``dist_checkpointing.load`` of the ``rng_state`` ShardedObjects on the (1, 2) grid returns
  them, and restored as Megatron-LM restores them they draw what each rank drew next.

Run by ``make interop`` (needs $MCORE_PYTHON), not by ``make test``.
"""

import json
import os
import random
import subprocess
import types
from pathlib import Path

import numpy as np
import torch

from megatron.core import dist_checkpointing as dc
from tests.harness import REPO
from tests.unit_tests.dist_utils import run_distributed

# The driver's fields of a rerun machine: its attributes are the same on both sides.
from tools.interop.mcore_gpt import machine_fields

DRIVER = REPO / "tools" / "interop" / "mcore_gpt.py"
MCORE_PYTHON = os.environ.get("MCORE_PYTHON")


def _mcore(action, directory, out, *extra):
    command = [MCORE_PYTHON, str(DRIVER), action, str(directory), "--out", str(out)]
    command += [str(e) for e in extra]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # ours is `megatron` too
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(Path(out).read_text())


def _draws():
    """The driver's ``rng_draws``: the same streams, in the same order."""
    from megatron.training import global_vars

    with global_vars.get_rng_tracker().fork():
        tracked = torch.rand(3).tolist()
    return {
        "random": random.random(),
        "numpy": float(np.random.random()),
        "torch": torch.rand(3).tolist(),
        "tracker": tracked,
    }


def _seed(seed, state):
    """This code base's seeding of a rank (megatron/training/initialize.py)."""
    from megatron.core.tensor_parallel.random import RNGStatesTracker, model_parallel_manual_seed
    from megatron.training import global_vars

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tracker = RNGStatesTracker("cpu")
    model_parallel_manual_seed(tracker, seed, tp_rank=state.get_tensor_model_parallel_rank())
    global_vars.set_rng_tracker(tracker)


def test_rng_state_saved_by_megatron_core_is_restored_here(tmp_path):
    from megatron.core.parallel_state import initialize_model_parallel
    from megatron.training import checkpointing_dist

    expected = _mcore(
        "save", tmp_path / "mcore", tmp_path / "saved.json", "--rng-draws", tmp_path / "d.json"
    )
    expected = json.loads((tmp_path / "d.json").read_text())
    directory = tmp_path / "mcore" / "iter_0000001"
    metadata = dc.read_dcp_metadata(str(directory)).state_dict_metadata
    assert "rng_state/shard_0.0_1.1" in metadata  # Megatron-LM's key, read as it is

    state = initialize_model_parallel()
    _seed(99, state)
    assert _draws() != expected  # the seeds alone do not give megatron-core's streams
    _seed(99, state)
    request = checkpointing_dist._rng_request(set(metadata), state)
    assert request is not None
    dc.load_shards({request.name: request}, str(directory))
    assert set(request.data[0]) == {
        "random_rng_state",
        "np_rng_state",
        "torch_rng_state",
        "cuda_rng_state",  # megatron-core's CPU stand-in; there is no CUDA generator to set here
        "rng_tracker_states",
    }
    args = types.SimpleNamespace(data_parallel_random_init=False)
    checkpointing_dist._set_rng(request.data, state, args, str(directory))
    assert _draws() == expected


def _worker_saves_rng_at_tp2(rank, world, directory, out):
    from megatron.core.parallel_state import initialize_model_parallel
    from megatron.training import checkpoint_rng_state, global_vars

    state = initialize_model_parallel(tensor_model_parallel_size=2)
    _seed(1234, state)
    torch.rand(5), random.random(), np.random.random()  # away from the seeds
    with global_vars.get_rng_tracker().fork():
        torch.rand(7)
    entry = checkpoint_rng_state.rng_sharded_object(state, global_vars.get_rng_tracker(), False)
    assert entry.unique_key == f"rng_state/shard_0.{rank}_1.2"
    dc.save_shards({entry.name: entry}, directory)
    if rank == 0:  # the rest of a checkpoint directory, as save_checkpoint finishes it
        dc.save_common({"iteration": 1, "checkpoint_version": 3.0}, directory)
        dc.write_metadata_json(directory)
    Path(out, f"{rank}.json").write_text(json.dumps(_draws()))


def test_rng_state_saved_here_at_tp2_is_read_by_megatron_core(tmp_path):
    directory = tmp_path / "ours"
    run_distributed(_worker_saves_rng_at_tp2, 2, str(directory), str(tmp_path))
    ours = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)]
    assert ours[0]["tracker"] != ours[1]["tracker"]  # each TP rank has its own tracked stream

    theirs = _mcore("rng", directory, tmp_path / "read.json", "--rng-grid", "1,2")
    assert sorted(theirs) == ["0.0", "0.1"]
    for rank in range(2):
        read = theirs[f"0.{rank}"]
        assert read["entries"] == 1
        assert read["fields"] == sorted(
            ["random_rng_state", "np_rng_state", "torch_rng_state", "rng_tracker_states"]
        )  # no cuda_rng_state: written without CUDA
        assert read["draws"] == ours[rank], rank


# ------------------------------------------------------------------ the rerun state machine
def _our_machine():
    from megatron.core.rerun_state_machine import RerunStateMachine
    from megatron.training import global_vars

    machine = RerunStateMachine(mode="validate_results")
    global_vars.set_rerun_state_machine(machine)
    return machine


def test_rerun_state_machine_state_exchanged_both_ways(tmp_path):
    # megatron-core's machine at a re-run checkpoint (a fault reproduced at iteration 1), saved
    # as Megatron-LM saves it; this code base's load hands it to its machine.
    from megatron.core.rerun_state_machine import Call, Caller, RerunDiagnostic, RerunState
    from megatron.training import checkpoint_rng_state, checkpointing_dist, global_vars

    saved = _mcore("save", tmp_path / "mcore", tmp_path / "saved.json", "--rerun-state")
    theirs = saved["rerun"]
    directory = tmp_path / "mcore" / "iter_0000001"
    try:
        machine = _our_machine()
        common = dc.load_common(str(directory))  # megatron-core's enums in it
        keys = set(dc.read_dcp_metadata(str(directory)).state_dict_metadata)
        plain = checkpoint_rng_state.plain_rerun_common(common["rerun_state_machine"])
        plain, entry = checkpointing_dist._rerun_request(plain, keys)
        assert entry is not None and entry.unique_key == "rerun_state_machine_state/shard_0_1"
        dc.load_shards({entry.name: entry}, str(directory))
        checkpointing_dist._restore_rerun_state(plain, entry)
        assert machine_fields(machine) == theirs
        assert theirs["state"] == "WILL_RERUN_FROM_CHECKPOINT"  # not a machine left as built

        # The other way: this code base's machine at a re-run checkpoint, saved as its
        # save_checkpoint saves it; megatron-core loads it as Megatron-LM does.
        machine = _our_machine()
        machine.state = RerunState.WILL_RERUN_FROM_CHECKPOINT
        machine.current_iteration = 5
        machine.checkpoint_requested = True
        machine.failed_validation_call = Call(Caller("found NaN in local grad norm", 0), 1)
        machine.initial_result = 0.25
        machine.suspicious_node, machine.suspicious_device = "node-b", 1
        machine.large_value_counts, machine.max_values = {"grad": 2}, {"grad": 7.5}
        machine.error_injector.error_injection_type = RerunDiagnostic.TRANSIENT_ERROR
        ours = tmp_path / "ours"
        common, part = checkpoint_rng_state.rerun_entries(
            machine.state_dict(None, force=True), rank=0, world_size=1
        )
        dc.save_shards({part.name: part}, str(ours))
        dc.save_common({"rerun_state_machine": common, "iteration": 5}, str(ours))
        dc.write_metadata_json(str(ours))
        read = _mcore("rerun", ours, tmp_path / "read.json")
        assert read == machine_fields(machine)
    finally:
        global_vars.set_rerun_state_machine(None)
