"""Mamba layers under context parallelism (pretrain_mamba.py, --context-parallel-size 2).

One spawned world of 4 processes runs:

* the layout change alone (CP=4 over the whole world, both ways Megatron deals groups: 4 groups,
  one per CP rank, and 2 groups each shared by 2 CP ranks): a rank's head-sharded sequence is
  exactly the matching heads of the whole sequence in global order, and the way back returns
  the load-balanced sequence shard it started from, bit for bit;
* a hybrid model (M*-M: Mamba, attention, MLP, Mamba; 8 Mamba heads in 2 groups) trained for
  10 iterations at DP2 x CP2 and at TP2 x CP2 with sequence parallelism (one group per TP rank,
  shared by the 2 CP ranks): the lm loss (1e-6) and grad norm (1e-5, relative) of every
  iteration equal those of the one-process run (in this process).
"""

import contextlib
import inspect
import io
import json
import sys

import torch

from tests.functional_tests.runner import REPO, TINY_MODEL
from tests.unit_tests.dist_utils import run_distributed

ITERATIONS = 10
HYBRID = TINY_MODEL + ["--num-layers", "4", "--hybrid-override-pattern", "M*-M"]
HYBRID += ["--mamba-state-dim", "8", "--mamba-head-dim", "16", "--mamba-num-groups", "2"]
HYBRID += ["--normalization", "RMSNorm", "--hidden-dropout", "0.0", "--attention-dropout", "0.0"]
HYBRID += ["--train-iters", str(ITERATIONS)]
LAYOUTS = {
    "dp2-cp2": ["--context-parallel-size", "2"],
    "tp2-sp-cp2": ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2"]
    + ["--sequence-parallel"],
}
RTOL = {"lm loss": 1e-6, "grad norm": 1e-5}


def _train(argv):
    """[(lm loss, grad norm)] of each iteration of an in-process pretrain_mamba.py run, as
    training_log receives them on this rank."""
    sys.path.insert(0, str(REPO))
    import pretrain_mamba
    from megatron.training import global_vars, training

    received = []
    real = training.training_log
    names = list(inspect.signature(real).parameters)

    def spy(*args, **kwargs):
        given = {**dict(zip(names, args)), **kwargs}
        losses = {k: float(v) for k, v in given["loss_dict"].items()}
        received.append((losses.get("lm loss"), given["grad_norm"]))
        return real(*args, **kwargs)

    training.training_log = spy
    global_vars.reset_globals()
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            training.pretrain(
                pretrain_mamba.train_valid_test_datasets_provider,
                pretrain_mamba.model_provider,
                pretrain_mamba.SPEC.model_type,
                pretrain_mamba.forward_step,
                argv=argv,
                model_family=pretrain_mamba.SPEC,
            )
    finally:
        training.training_log = real
        global_vars.reset_globals()
    return received


def _check_layout_change(rank, world_size):
    """CP = the world: to_head_sharded gives the global tensor's heads of this rank in global
    order, to_sequence_sharded returns x exactly."""
    from megatron.core.ssm.mamba_context_parallel import MambaContextParallel
    from megatron.core.transformer.context_parallel import cp_chunk_indices

    cp, group = world_size, torch.distributed.group.WORLD
    heads, headdim, d_state, length, batch = 8, 3, 5, 4 * world_size, 2
    for groups in (4, 2):
        mcp = MambaContextParallel(group, heads, groups, headdim, d_state)
        gn = groups * d_state
        gen = torch.Generator().manual_seed(groups)
        xbc = torch.randn(length, batch, heads * headdim + 2 * gn, generator=gen)
        dt = torch.randn(length, batch, heads, generator=gen)
        mine = cp_chunk_indices(length // cp, cp, rank)
        got_xbc, got_dt = mcp.to_head_sharded(xbc[mine], dt[mine])
        # Expected: this rank's heads, and its group's B and C, over the whole sequence.
        x, B, C = torch.split(xbc, [heads * headdim, gn, gn], dim=-1)
        per_rank, group_of_rank = heads // cp, rank * groups // cp
        g_width = max(1, groups // cp) * d_state
        want_xbc = torch.cat(
            [
                x[..., rank * per_rank * headdim : (rank + 1) * per_rank * headdim],
                B[..., group_of_rank * d_state :][..., :g_width],
                C[..., group_of_rank * d_state :][..., :g_width],
            ],
            dim=-1,
        )
        assert torch.equal(got_xbc, want_xbc), (groups, rank)
        assert torch.equal(got_dt, dt[..., rank * per_rank : (rank + 1) * per_rank]), groups
        back = mcp.to_sequence_sharded(got_xbc[..., : per_rank * headdim])
        assert torch.equal(back, x[mine]), (groups, rank)


def _layouts(rank, world_size, path):
    _check_layout_change(rank, world_size)
    results = {name: _train(HYBRID + flags) for name, flags in LAYOUTS.items()}
    if rank == world_size - 1:  # the rank that logs
        with open(path, "w") as f:
            json.dump(results, f)


def test_mamba_context_parallel_equals_one_process(tmp_path):
    reference = _train(HYBRID)
    assert len(reference) == ITERATIONS and reference[-1][0] < reference[0][0], reference
    path = tmp_path / "layouts.json"
    run_distributed(_layouts, 4, str(path))
    results = json.loads(path.read_text())
    assert set(results) == set(LAYOUTS)
    for name, received in results.items():
        assert len(received) == ITERATIONS, name
        worst = {key: 0.0 for key in RTOL}
        for got, want in zip(received, reference):
            for key, g, w in zip(RTOL, got, want):
                worst[key] = max(worst[key], abs(g - w) / abs(w))
        print(f"{name}: largest relative deviation {worst}")  # shown with pytest -s
        for key, limit in RTOL.items():
            assert worst[key] <= limit, (name, key, worst[key], received, reference)
