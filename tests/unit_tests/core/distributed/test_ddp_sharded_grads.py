"""Sharded gradients (Megatron-FSDP's optim_grads, ZeRO-2) in the DDP buffers: each rank keeps
only its slice of every bucket's gradient, reduce-scattered per micro-batch, and that slice equals
the one the unsharded distributed-optimizer buffer (optim) ends with, in float64, over two
micro-batches, with and without overlap (several buckets), autograd's gradients and the fused
linear layers' (gradient accumulation fusion adding into ``get_main_grad()``), and with a weight
whose gradient partly arrives after its bucket was reduced."""

import torch

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.tensor_parallel import layers
from tests.unit_tests.dist_utils import run_distributed


class _Net(torch.nn.Module):
    """Three tanh layers; with ``reuse`` the first weight is also used outside its layer, on the
    input (by autograd, beside its fused use: a second gradient contribution per micro-batch that
    comes after the fused layer's, once the weight's bucket may have been reduced)."""

    def __init__(self, fuse: bool, reuse: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.fuse, self.reuse = fuse, reuse
        self.layers = torch.nn.ModuleList(
            [torch.nn.Linear(6, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 3)]
        )
        self.to(torch.float64)

    def forward(self, x):
        if self.reuse:
            x = x + torch.tanh(torch.nn.functional.linear(x, self.layers[0].weight))[..., :6]
        for layer in self.layers:
            x = torch.tanh(layers.linear(x, layer.weight, layer.bias, self.fuse))
        return x


def _data(rank, micro):
    g = torch.Generator().manual_seed(1000 * rank + micro)
    return torch.randn(5, 6, generator=g, dtype=torch.float64)


def _run(rank, strategy, overlap, fuse, reuse=False):
    config = DistributedDataParallelConfig(
        use_distributed_optimizer=True,
        data_parallel_sharding_strategy=strategy,
        overlap_grad_reduce=overlap,
        bucket_size=60 if overlap else None,
    )
    ddp = DistributedDataParallel(None, config, _Net(fuse, reuse))
    (buffer,) = ddp.buffers
    storage_after_backward = []
    for micro in range(2):
        last = micro == 1
        context = ddp.no_sync() if not last else torch.enable_grad()
        with context:
            ddp(_data(rank, micro)).pow(2).sum().backward()
        storage_after_backward.append([b.grad_data is not None for b in buffer.buckets])
    ddp.finish_grad_sync()
    shards = [b.local_grad_shard().clone() for b in buffer.buckets]
    return ddp, buffer, shards, storage_after_backward


def _check(rank, world_size):
    _, reference, expected, _ = _run(rank, "optim", overlap=False, fuse=False)
    assert not reference.grads_sharded
    for overlap in (False, True):
        for fuse in (False, True):
            where = f"overlap={overlap} fuse={fuse}"
            ddp, buffer, shards, held = _run(rank, "optim_grads", overlap, fuse)
            assert buffer.grads_sharded, where
            # Only this rank's slice is kept, and no bucket's full-size gradient outlives the
            # micro-batch's backward: each was reduce-scattered once complete.
            assert buffer.grad_data.numel() == buffer.numel // world_size, where
            assert held == [[False] * len(buffer.buckets)] * 2, (where, held)
            if overlap:
                assert len(buffer.buckets) > 1, where
            if not overlap:
                assert len(shards) == len(expected)
                for got, want in zip(shards, expected):
                    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=where)
            else:  # other bucket boundaries: compare param by param (owned parts)
                ref_ddp, ref_buffer, _, _ = _run(rank, "optim", overlap=True, fuse=False)
                for p, q in zip(ddp.module.parameters(), ref_ddp.module.parameters()):
                    torch.testing.assert_close(
                        p.main_grad, _owned(ref_buffer, q), rtol=1e-12, atol=1e-12, msg=where
                    )
            # main_grad is the owned part of the reduced gradient (what the reductions after
            # DP, such as the tied-embedding all-reduce, and the optimizer read).
            owned = sum(p.main_grad.numel() for p in ddp.module.parameters())
            total = torch.tensor([owned])
            torch.distributed.all_reduce(total)
            assert total.item() == sum(p.numel() for p in ddp.module.parameters()), where
            ddp.zero_grad_buffer()
            assert not buffer.grad_data.any(), where
    # A weight whose gradient comes in two parts (fused, then autograd's): whatever arrives after
    # its bucket was reduced is reduced by finish_grad_sync; the sums are the same.
    for overlap in (False, True):
        _, _, want, _ = _run(rank, "optim", overlap, fuse=False, reuse=True)
        _, _, got, held = _run(rank, "optim_grads", overlap, fuse=True, reuse=True)
        assert any(any(bucket) for bucket in held), "the late contribution was not exercised"
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, msg=f"reuse {overlap=}")


def _owned(buffer, param):
    """The part of ``param``'s reduced gradient this rank owns in an unsharded buffer."""
    start, end, b = buffer.param_index_map[param]
    bucket = buffer.buckets[b]
    own_start, own_end = (bucket.offset + x for x in bucket.shard_range(buffer.dp_rank))
    lo, hi = max(start, own_start), min(end, own_end)
    return buffer.grad_data[lo : max(lo, hi)]


def test_sharded_gradients_equal_the_unsharded_slices():
    run_distributed(_check, 2)
