"""torch_dist entries of FSDP2-sharded parameters: the rows each rank's shard holds, uneven and
empty shards included, saved by 3 ranks and read back whole by each of them (a spawned world of
3 gloo processes); and the row cut of a tensor-parallel entry with strided blocks."""

import torch

from megatron.core import dist_checkpointing as dc
from megatron.core.dist_checkpointing.mapping import Chunk, rows_of, tensor_parallel_sharded
from tests.unit_tests.dist_utils import run_distributed

# Rows over 3 ranks, torch.chunk-style: 10 -> 4, 4, 2; 5 -> 2, 2, 1; 2 -> 1, 1, 0 (an empty shard).
SHAPES = {"a.weight": (10, 3), "b.weight": (5,), "c.weight": (2, 4)}


def _module(seed):
    gen = torch.Generator().manual_seed(seed)
    module = torch.nn.Module()
    for name, shape in SHAPES.items():
        sub = torch.nn.Module()
        sub.weight = torch.nn.Parameter(torch.randn(*shape, generator=gen))
        module.add_module(name.split(".")[0], sub)
    return module


def _worker(rank, world, directory):
    from megatron.core.distributed.distributed_data_parallel import DistributedDataParallelConfig
    from megatron.core.distributed.torch_fully_sharded_data_parallel import (
        TorchFullyShardedDataParallel,
    )

    reference = _module(seed=5)
    sharded = TorchFullyShardedDataParallel(
        DistributedDataParallelConfig(), _module(seed=5), sub_modules_to_wrap=()
    )
    entries, by_param = dc.model_sharded_state_dict([sharded.module], megatron_layout=False)
    rows = {"a.weight": (4, 4, 2), "b.weight": (2, 2, 1), "c.weight": (1, 1, 0)}
    for key, entry in entries.items():
        assert entry.dp_sharded and not entry.replica, key
        assert entry.data.shape[0] == rows[key][rank], (key, entry.data.shape)
        full = reference.get_parameter(key).detach()
        for chunk in entry.chunks:
            start = chunk.global_offset[0]
            assert torch.equal(entry.view(chunk), full[start : start + chunk.shape[0]]), key
    # The optimizer's tensors alias the shards: keyed by the same entries.
    for param, local in sharded.shard_aliases():
        assert local.data_ptr() == param.to_local().data_ptr()
    dc.spread_writes(entries, rank, world)  # the shards are every rank's own: nothing spread
    assert not any(e.replica for e in entries.values())
    dc.save_shards(entries, directory)
    if rank == 0:
        dc.write_metadata_json(directory)
    torch.distributed.barrier()
    # Read back whole by a module without FSDP on every rank, and into other shards.
    whole = _module(seed=6)
    plain, _ = dc.model_sharded_state_dict([whole], megatron_layout=False)
    dc.load_shards(plain, directory, strictness=dc.StrictHandling.RAISE_ALL)
    for key in SHAPES:
        assert torch.equal(whole.get_parameter(key), reference.get_parameter(key)), key
    resharded = TorchFullyShardedDataParallel(
        DistributedDataParallelConfig(), _module(seed=7), sub_modules_to_wrap=()
    )
    again, _ = dc.model_sharded_state_dict([resharded.module], megatron_layout=False)
    dc.load_shards(again, directory, strictness=dc.StrictHandling.RAISE_ALL)
    for key in SHAPES:
        assert torch.equal(
            resharded.module.get_parameter(key).full_tensor(), whole.get_parameter(key)
        )


def test_fsdp2_shards_save_and_load_whole_and_sharded(tmp_path):
    run_distributed(_worker, 3, str(tmp_path / "ckpt"))


def test_rows_of_a_strided_tensor_parallel_entry():
    # TP rank 1 of 2 with stride 2 (SwiGLU's [gate; up]): local rows 0-2 are global rows 3-5,
    # local rows 3-5 are global rows 9-11. Rows 2..4 of the local tensor straddle both blocks.
    local = torch.arange(6 * 2).view(6, 2)
    entry = tensor_parallel_sharded("w", local, 0, 1, 2, stride=2)
    cut = rows_of(entry, 2, local[2:5])
    assert cut.dp_sharded and cut.global_shape == (12, 2)
    assert cut.chunks == (
        Chunk((5, 0), (0, 0), (1, 2)),
        Chunk((9, 0), (1, 0), (2, 2)),
    )
    assert torch.equal(cut.view(cut.chunks[1]), local[3:5])
    assert rows_of(entry, 6, local[6:]).chunks == ()
