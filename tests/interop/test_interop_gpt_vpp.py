"""A GPT checkpoint written by megatron-core (0.16.1) at TP=2 loads here at layouts the other
interop tests do not use: pipeline parallel with virtual stages (PP=2 x VPP=2: rank 0 holds
layers 0 and 2, rank 1 layers 1 and 3, so each chunk reads the stacked layer axis at another
offset) and one process. Every tensor asked for must be there and none left over; the loss of
the driver's batch equals megatron-core's own within 1e-5, fp32. (test_megatron_core_interop.py
loads megatron-core's one-process checkpoint at TP=2 and at PP=2.)

Run by ``make interop`` (needs $MCORE_PYTHON), not by ``make test``.
"""

import json
import os
import subprocess

import torch

from megatron.core import dist_checkpointing as dc
from tests.harness import REPO
from tests.interop.test_megatron_core_interop import HIDDEN, LAYERS, SEQ, VOCAB, _batch, _our_model
from tests.unit_tests.dist_utils import run_distributed

DRIVER = REPO / "tools" / "interop" / "mcore_gpt.py"
MCORE_PYTHON = os.environ.get("MCORE_PYTHON")
RTOL = 1e-5
PP, VPP = 2, 2


def _load_strictly(chunks, directory):
    entries, _ = dc.model_sharded_state_dict(chunks)
    dc.load_shards(
        entries,
        str(directory),
        strictness=dc.StrictHandling.RAISE_ALL,
        counts_as_unexpected=lambda key: True,  # the file holds the model only
    )
    for chunk in chunks:
        chunk.eval()


def _worker_pp2_vpp2(rank, world, directory, expected):
    from megatron.core.parallel_state import initialize_model_parallel

    state = initialize_model_parallel(pipeline_model_parallel_size=PP)
    per_chunk = LAYERS // (PP * VPP)
    chunks = [
        _our_model(
            state,
            pre=rank == 0 and c == 0,
            post=rank == PP - 1 and c == VPP - 1,
            num_layers=per_chunk,
            offset=(c * PP + rank) * per_chunk,  # Megatron's interleaved assignment
        )
        for c in range(VPP)
    ]
    _load_strictly(chunks, directory)
    tokens, positions, labels = _batch(VOCAB, SEQ)
    hidden = torch.empty(SEQ, 2, HIDDEN)
    with torch.no_grad():
        # The stages in order: rank 0 chunk 0, rank 1 chunk 0, rank 0 chunk 1, rank 1 chunk 1.
        for c, chunk in enumerate(chunks):
            if rank == 0 and c == 0:
                hidden = chunk(tokens, positions, None)
            else:
                torch.distributed.recv(hidden, src=1 - rank)
                chunk.set_input_tensor(hidden)
                if rank == PP - 1 and c == VPP - 1:
                    loss = chunk(None, positions, None, labels=labels).mean().item()
                    assert abs(loss - expected) <= RTOL * abs(expected), (loss, expected)
                    return
                hidden = chunk(None, positions, None)
            torch.distributed.send(hidden.contiguous(), dst=1 - rank)


def test_megatron_core_tp2_checkpoint_loads_here_at_pp2_vpp2_and_one_process(tmp_path):
    from megatron.core.parallel_state import initialize_model_parallel

    command = [MCORE_PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    command += ["2", str(DRIVER), "save", str(tmp_path / "mcore"), "--out", str(tmp_path / "s")]
    command += ["--tensor-model-parallel-size", "2", "--num-layers", str(LAYERS)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # their `megatron`
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    expected = json.loads((tmp_path / "s").read_text())["loss"]
    directory = tmp_path / "mcore" / "iter_0000001"
    assert len(list(directory.glob("__1_*.distcp"))) > 0  # written by both TP ranks

    run_distributed(_worker_pp2_vpp2, PP, str(directory), expected)

    model = _our_model(initialize_model_parallel())
    _load_strictly([model], directory)
    tokens, positions, labels = _batch(VOCAB, SEQ)
    with torch.no_grad():
        loss = model(tokens, positions, None, labels=labels).mean().item()
    assert abs(loss - expected) <= RTOL * abs(expected), ("one process", loss, expected)
