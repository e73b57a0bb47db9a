"""DDP buckets: layout (reverse order, sizes, distributed-optimizer padding) and overlapped
reduction."""

import torch

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.distributed_data_parallel import bucket_size_for_num_buckets
from megatron.core.tensor_parallel import ProcessGroupCollection
from tests.unit_tests.dist_utils import run_distributed


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    layers = []
    for fan_in, fan_out in ((6, 8), (8, 8), (8, 8)):
        layers += [torch.nn.Linear(fan_in, fan_out), torch.nn.Tanh()]
    layers.append(torch.nn.Linear(8, 3))
    return torch.nn.Sequential(*layers).to(dtype)


def _data(rank, micro, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * rank + micro)
    return torch.randn(5, 6, generator=g).to(dtype)


def test_buckets_follow_reverse_order_and_bucket_size():
    model = _model()
    ddp = DistributedDataParallel(
        None, DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=60), model
    )
    (buffer,) = ddp.buffers
    params = list(model.parameters())
    # Reverse order: b3(3) w3(24) b2(8) w2(64) -> 99 >= 60 closes; b1 w1 -> 72; b0 w0 -> 56.
    assert [len(b.params) for b in buffer.buckets] == [4, 2, 2]
    assert [p for b in buffer.buckets for p in b.params] == params[::-1]
    assert [b.numel for b in buffer.buckets] == [99, 72, 56]
    assert [b.offset for b in buffer.buckets] == [0, 99, 171]
    for p in params:
        start, end, _ = buffer.param_index_map[p]
        assert p.main_grad.data_ptr() == buffer.grad_data[start:].data_ptr()
    # Without overlap Megatron reduces each buffer as one bucket whatever --ddp-bucket-size says.
    plain = DistributedDataParallel(None, DistributedDataParallelConfig(bucket_size=60), _model())
    assert len(plain.buffers[0].buckets) == 1
    # --ddp-num-buckets: total params / number of buckets.
    assert bucket_size_for_num_buckets([_model()], 3) == sum(p.numel() for p in params) // 3


def test_distributed_optimizer_padding_and_shared_embedding_bucket():
    model = _model()
    model[2].weight.shared_embedding = True  # pretend this is the tied embedding of a PP end
    ddp = DistributedDataParallel(
        None, DistributedDataParallelConfig(use_distributed_optimizer=True), model
    )
    (buffer,) = ddp.buffers
    for p in model.parameters():
        start, end, _ = buffer.param_index_map[p]
        assert start % 64 == 0 and end - start == p.numel()
        # The params live in the flat param buffer (the optimizer all-gathers into it).
        assert p.data_ptr() == buffer.param_data[start:].data_ptr()
    for b in buffer.buckets:
        assert b.numel % 128 == 0 and b.offset % 128 == 0
    # The shared embedding sits alone in its bucket, at offset 0 of it.
    own = [b for b in buffer.buckets if any(p is model[2].weight for p in b.params)]
    assert len(own) == 1 and own[0].params == [model[2].weight]
    assert len(buffer.buckets) == 3
    torch.testing.assert_close(model(_data(0, 0)), _model()(_data(0, 0)), rtol=0, atol=0)


def _grads_after_iteration(ddp, model, rank, dtype=torch.float32, num_micro=3, events=None):
    ddp.zero_grad_buffer()
    with ddp.no_sync():
        for micro in range(num_micro - 1):
            ddp(_data(rank, micro, dtype)).float().pow(2).sum().backward()
    if events is not None:
        assert not [e for e in events if e.startswith("launch")], (
            "no reduction may start inside no_sync"
        )
        events.clear()
    ddp(_data(rank, num_micro - 1, dtype)).float().pow(2).sum().backward()
    if events is not None:
        events.append("backward-returned")
    ddp.finish_grad_sync()
    return [p.main_grad.clone() for p in model.parameters()]


def _check_overlap(rank, world_size):
    torch.set_num_threads(1)
    group = torch.distributed.group.WORLD
    ref_model = _model()
    ref = _grads_after_iteration(
        DistributedDataParallel(
            None,
            DistributedDataParallelConfig(),
            ref_model,
            pg_collection=ProcessGroupCollection(dp_cp=group),
        ),
        ref_model,
        rank,
    )

    # Overlapped: identical gradients, and buckets launched while backward still runs.
    model = _model()
    ddp = DistributedDataParallel(
        None,
        DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=60),
        model,
        pg_collection=ProcessGroupCollection(dp_cp=group),
    )
    events = []
    for bucket in ddp.buffers[0].buckets:

        def launch(bucket=bucket, original=bucket.start_grad_sync):
            events.append(f"launch {bucket.index}")
            original()

        bucket.start_grad_sync = launch
    # A tensor hook on the first layer's weight runs when its gradient is computed: the very end
    # of backward (it is the last param backward reaches).
    model[0].weight.register_hook(lambda grad: events.append("first-layer-grad"))
    grads = _grads_after_iteration(ddp, model, rank, events=events)
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r, rtol=0, atol=0)
    assert events.index("launch 0") < events.index("first-layer-grad"), events
    assert events.index("launch 1") < events.index("first-layer-grad"), events
    assert events.index("launch 2") < events.index("backward-returned"), events
    # A second iteration works the same way (bucket state is reset by zero_grad_buffer).
    events.clear()
    grads = _grads_after_iteration(ddp, model, rank, events=events)
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r, rtol=0, atol=0)

    # Averaging in the collective (gloo: sum, then divide) equals pre-scaling up to rounding.
    model = _model()
    ddp = DistributedDataParallel(
        None,
        DistributedDataParallelConfig(
            overlap_grad_reduce=True, bucket_size=60, average_in_collective=True
        ),
        model,
        pg_collection=ProcessGroupCollection(dp_cp=group),
    )
    for g, r in zip(_grads_after_iteration(ddp, model, rank), ref):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-7)

    # Reduce-scatter for the distributed optimizer: this rank's slice equals the all-reduced grads.
    model = _model()
    ddp = DistributedDataParallel(
        None,
        DistributedDataParallelConfig(
            overlap_grad_reduce=True, bucket_size=60, use_distributed_optimizer=True
        ),
        model,
        pg_collection=ProcessGroupCollection(dp_cp=group),
    )
    _grads_after_iteration(ddp, model, rank)
    (buffer,) = ddp.buffers
    ref_flat = torch.zeros_like(buffer.grad_data)
    for p, r in zip(model.parameters(), ref):
        start, end, _ = buffer.param_index_map[p]
        ref_flat[start:end] = r.view(-1)
    for bucket in buffer.buckets:
        lo, hi = bucket.shard_range(rank)
        torch.testing.assert_close(
            bucket.local_grad_shard(),
            ref_flat[bucket.offset + lo : bucket.offset + hi],
            rtol=0,
            atol=0,
        )

    # bf16 params with fp32 grad accumulation (hook path): overlapped equals non-overlapped.
    grads = []
    for overlap in (False, True):
        model = _model(torch.bfloat16)
        cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=overlap, bucket_size=60
        )
        ddp = DistributedDataParallel(
            None, cfg, model, pg_collection=ProcessGroupCollection(dp_cp=group)
        )
        grads.append(_grads_after_iteration(ddp, model, rank, dtype=torch.bfloat16))
        assert all(
            p.grad is None and p.main_grad.dtype == torch.float32 for p in model.parameters()
        )
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_overlapped_reduction_matches_and_starts_during_backward():
    run_distributed(_check_overlap, 2)


def test_dropped_wrapper_is_freed_and_its_hooks_fall_back_to_plain_autograd():
    # The grad hooks live on the params: a strong reference back to the wrapper would keep it (and
    # its buffers and process groups) alive for ever, out of the garbage collector's reach.
    import gc
    import weakref

    model = _model()
    ddp = DistributedDataParallel(
        None, DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=60), model
    )
    ref = weakref.ref(ddp)
    del ddp
    gc.collect()
    assert ref() is None
    model(_data(0, 0)).pow(2).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
