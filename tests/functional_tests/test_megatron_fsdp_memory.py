"""The memory each rank holds for its model state falls with --data-parallel-sharding-strategy as
the theoretical memory report predicts (issue #35), at DP2 on CPU/gloo: measured within 15 % of
the report's "weight and optimizer" figure for each strategy, and strictly
no_shard > optim > optim_grads > optim_grads_params: fp32 Adam at DP2 keeps 16, 12 (ZeRO-1: the
optimizer state sharded), 10 (ZeRO-2: the gradients too) and 8 (ZeRO-3) bytes per parameter.

What is measured, and why: after one training step (the model, the gradient buffers and the
optimizer state all built and used once), every tensor storage still alive in the rank's process
(``gc.get_objects()``; each storage counted once, whatever views point into it, with its allocated
size, so a storage resized to 0 by FSDP2 after its all-gather counts 0). That is the memory held by
weights, gradients (``.grad``, the DDP buffers' ``main_grad`` or, under optim_grads, their kept
slices, FSDP2's sharded gradients), the distributed optimizer's param buffer and the optimizer's
state, plus whatever else a strategy keeps that the report does not know of (an FSDP2 all-gather
buffer not freed, padding, a leaked model of an earlier run): an object-graph walk from the model
would miss those.
It is exactly the quantity the report's "weight and optimizer" figure predicts. It does not
include activations (none is alive after the step; the report's activation figure is a peak
during forward/backward, not tested here), the allocator's free lists, or the interpreter and
library memory that process RSS would add (noise of tens of MB that no strategy changes).

The model (fp32, 4 layers, hidden 384, ~7.3 M parameters) makes every strategy's figure tens of
MB, far above the few hundred KB of other tensors alive (RoPE tables, RNG states, the data
loader's sample). Each strategy runs one step in turn in one world of 2 ranks.
"""

import gc
import json
import os

import pytest
import torch

from tests.functional_tests.test_log_line_parity import _train
from tests.functional_tests.test_megatron_fsdp_e2e import MODEL, STRATEGIES, megatron_fsdp
from tests.unit_tests.dist_utils import run_distributed

BIG = MODEL + ["--num-layers", "4", "--hidden-size", "384", "--num-attention-heads", "4"]
BIG += ["--train-iters", "1", "--lr-warmup-iters", "0"]
MB = 1024 * 1024
TOLERANCE = 0.15


def held_tensor_bytes():
    """Bytes of the distinct tensor storages alive in this process (DTensors: their local
    shard's storage)."""
    from torch.distributed.tensor import DTensor

    seen, total = set(), 0
    for obj in gc.get_objects():
        kind = type(obj)  # not isinstance: it would touch deprecated module proxies' __class__
        if not issubclass(kind, torch.Tensor):
            continue
        tensor = obj._local_tensor if issubclass(kind, DTensor) else obj
        if tensor.is_meta:
            continue
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key and key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def _strategies(rank, world_size, path):
    from megatron.training import global_vars, training

    results = {}
    real_setup = training.setup_model_and_optimizer
    for strategy in STRATEGIES:
        kept = {}

        def setup(*args, **kwargs):
            model, optimizer, scheduler = real_setup(*args, **kwargs)
            kept.update(model=model, optimizer=optimizer, args=global_vars.get_args())
            return model, optimizer, scheduler

        gc.collect()
        before = held_tensor_bytes()
        training.setup_model_and_optimizer = setup
        try:
            received, _ = _train(BIG + megatron_fsdp(strategy))
        finally:
            training.setup_model_and_optimizer = real_setup
        assert [r["iteration"] for r in received] == [1], received
        gc.collect()
        held = held_tensor_bytes() - before
        from megatron.training.theoretical_memory import compute_theoretical_memory

        report = compute_theoretical_memory(kept["args"], device_type="cpu")
        results[strategy] = {
            "measured": held,
            "predicted": report.weight_and_optimizer_bytes,
            "parameters": sum(p.numel() for p in kept["model"][0].parameters()),
        }
        kept.clear()
        gc.collect()
    if rank == 0:
        with open(path, "w") as f:
            json.dump(results, f)


def test_held_memory_falls_with_the_strategy_as_the_report_predicts(tmp_path):
    path = os.path.join(tmp_path, "memory.json")
    run_distributed(_strategies, 2, path)
    with open(path) as f:
        results = json.load(f)
    for strategy, r in results.items():
        print(
            f"{strategy}: measured {r['measured'] / MB:.2f} MB, predicted "
            f"{r['predicted'] / MB:.2f} MB ({r['measured'] / r['predicted'] - 1:+.1%}), "
            f"{r['parameters']} local parameters"
        )
    for strategy, r in results.items():
        assert r["measured"] == pytest.approx(r["predicted"], rel=TOLERANCE), (strategy, results)
    no_shard, optim, optim_grads, optim_grads_params = (results[s]["measured"] for s in STRATEGIES)
    # Sharding the optimizer state saves 4 (Adam's two moments, halved) of 16 bytes per
    # parameter at DP2, then the gradients (ZeRO-2) another 2, then the weights (FSDP2) 2 more.
    assert no_shard > optim > optim_grads > optim_grads_params, results
