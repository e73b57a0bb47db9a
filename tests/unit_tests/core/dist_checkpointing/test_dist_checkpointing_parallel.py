"""torch_dist checkpoints across tensor-parallel layouts in one spawned world of 4 gloo processes.

A TP=2 x DP=2 model (column-parallel fc1 with SwiGLU's stride 2, row-parallel fc2, a replicated
LayerNorm) is saved; it is loaded back at TP=4 x DP=1 and at TP=1 x DP=4 into models built from
another seed. Reference: the TP=1 model built from the saving seed (the TP layers draw the full
master weight and keep their slice, so the TP=2 model holds exactly its shards); every loaded
shard must equal ``shard_of`` of the reference, bit for bit. The save planner's check that the
chunks tile each tensor exactly once is exercised with deliberately bad sharding.
"""

import os

import pytest
import torch

from megatron.core import dist_checkpointing as dc
from megatron.core.parallel_state import initialize_model_parallel
from megatron.core.tensor_parallel import collectives as C
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, shard_of
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.dist_utils import run_distributed


def _model(tp, group, seed):
    cfg = TransformerConfig(
        num_layers=1, hidden_size=12, num_attention_heads=4, tensor_model_parallel_size=tp
    )
    torch.manual_seed(seed)
    init = lambda w: w.normal_(0, 0.3)  # noqa: E731
    model = torch.nn.Module()
    model.fc1 = ColumnParallelLinear(12, 16, config=cfg, init_method=init, stride=2, tp_group=group)
    model.fc2 = RowParallelLinear(
        16, 12, config=cfg, init_method=init, input_is_parallel=True, tp_group=group
    )
    model.norm = torch.nn.LayerNorm(12)
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 1)
        model.norm.weight.copy_(torch.randn(12, generator=g))
        full_bias = torch.randn(16, generator=g)
        model.fc1.bias.copy_(shard_of(full_bias, 0, C.group_rank(group) if group else 0, tp, 2))
    return model


def _check_layout(model, reference, tp, tp_rank):
    for name, param in model.named_parameters():
        full = reference.get_parameter(name).detach()
        if getattr(param, "tensor_model_parallel", False) and tp > 1:
            expected = shard_of(full, param.partition_dim, tp_rank, tp, param.partition_stride)
        else:
            expected = full
        assert torch.equal(param.detach(), expected), (tp, name)


def _worker(rank, world, directory):
    reference = _model(1, None, seed=11)

    state2 = initialize_model_parallel(tensor_model_parallel_size=2)
    tp_rank, dp_rank = state2.get_tensor_model_parallel_rank(), state2.get_data_parallel_rank()
    saved = _model(2, state2.get_tensor_model_parallel_group(), seed=11)
    _check_layout(saved, reference, 2, tp_rank)  # the premise of the reference
    entries, _ = dc.model_sharded_state_dict([saved], tp_rank, 2)
    assert entries["norm.weight"].replica == (tp_rank != 0)
    dc.spread_writes(entries, dp_rank, 2)
    dc.save_shards(entries, directory)
    if rank == 0:
        dc.write_metadata_json(directory)
    torch.distributed.barrier()
    # One copy of everything: 2 (fc1 blocks) x 2 TP ranks + 2 TP shards + 1 of each replicated
    # tensor.
    chunks = dc.read_dcp_metadata(directory).state_dict_metadata
    assert len(chunks["fc1.weight"].chunks) == 4 and len(chunks["fc2.weight"].chunks) == 2
    assert len(chunks["norm.weight"].chunks) == 1 and len(chunks["fc2.bias"].chunks) == 1
    assert sorted(n for n in os.listdir(directory) if n.endswith(".distcp")) == [
        f"__{r}_0.distcp" for r in range(4)
    ]

    state4 = initialize_model_parallel(tensor_model_parallel_size=4)
    for tp, group, new_rank in ((4, state4.get_tensor_model_parallel_group(), rank), (1, None, 0)):
        loaded = _model(tp, group, seed=99)
        entries, _ = dc.model_sharded_state_dict([loaded], new_rank, tp)
        dc.load_shards(entries, directory, strictness=dc.StrictHandling.RAISE_ALL)
        _check_layout(loaded, reference, tp, new_rank)

    # Every rank claims the same replicated tensor: it would be written four times.
    twice = {"x": dc.replicated("x", torch.ones(3))}
    with pytest.raises(
        dc.CheckpointingError, match="chunk at \\(0,\\) is written by rank 0 and rank 1"
    ):
        dc.save_shards(twice, directory + "_bad1")
    # A TP shard nobody saves leaves a hole.
    hole = {
        "y": dc.tensor_parallel_sharded("y", torch.ones(2, 3), 0, tp_rank, 2, replica=rank != 0)
    }
    with pytest.raises(dc.CheckpointingError, match="y: chunks cover 6 of its 12 elements"):
        dc.save_shards(hole, directory + "_bad2")


def test_save_at_tp2_dp2_loads_at_tp4_and_tp1(tmp_path):
    run_distributed(_worker, 4, str(tmp_path / "ckpt"))
