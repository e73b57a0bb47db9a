"""DDP with contiguous gradient buffers: layout, in-place accumulation, averaging across ranks."""

import torch

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.tensor_parallel import ProcessGroupCollection
from tests.unit_tests.dist_utils import run_distributed


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))


def _data(rank, micro):
    g = torch.Generator().manual_seed(100 * rank + micro)
    return torch.randn(5, 4, generator=g)


def test_single_process_buffer_aliases_grads_and_accumulates():
    model = _model()
    ddp = DistributedDataParallel(None, DistributedDataParallelConfig(), model)
    params = list(model.parameters())
    # Reverse registration order: the last parameter starts the buffer.
    assert params[-1].main_grad.data_ptr() == ddp.buffers[0].data.data_ptr()
    ddp.zero_grad_buffer()
    ref = _model()
    for micro in range(3):
        ddp(_data(0, micro)).pow(2).sum().backward()
        ref(_data(0, micro)).pow(2).sum().backward()
    for p, r in zip(model.parameters(), ref.parameters()):
        assert p.grad.data_ptr() == p.main_grad.data_ptr()
        torch.testing.assert_close(p.main_grad, r.grad, rtol=0, atol=0)
    ddp.zero_grad_buffer()
    assert all(p.main_grad.abs().sum() == 0 for p in model.parameters())


def test_fp32_grad_buffer_for_bf16_params_uses_hooks():
    model = _model().to(torch.bfloat16)
    ddp = DistributedDataParallel(
        None, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model
    )
    ddp.zero_grad_buffer()
    ddp(_data(0, 0).bfloat16()).float().pow(2).sum().backward()
    ddp(_data(0, 1).bfloat16()).float().pow(2).sum().backward()
    # Reference: each micro-batch's bf16 gradient of the same model, summed in float32.
    ref = _model().to(torch.bfloat16)
    sums = [torch.zeros_like(p, dtype=torch.float32) for p in ref.parameters()]
    for micro in range(2):
        ref.zero_grad()
        ref(_data(0, micro).bfloat16()).float().pow(2).sum().backward()
        for total, p in zip(sums, ref.parameters()):
            total += p.grad.float()
    for p, total in zip(model.parameters(), sums):
        assert p.grad is None and p.main_grad.dtype == torch.float32
        assert total.abs().sum() > 0
        torch.testing.assert_close(p.main_grad, total, rtol=0, atol=0)


def _check_average(rank, world_size):
    model = _model()
    ddp = DistributedDataParallel(
        None,
        DistributedDataParallelConfig(),
        model,
        pg_collection=ProcessGroupCollection(dp_cp=torch.distributed.group.WORLD),
    )
    ddp.zero_grad_buffer()
    for micro in range(2):
        ddp(_data(rank, micro)).pow(2).sum().backward()
    ddp.finish_grad_sync()
    # Reference: every rank's gradients computed here in float64, then averaged.
    grads = None
    for r in range(world_size):
        ref = _model().double()
        for micro in range(2):
            ref(_data(r, micro).double()).pow(2).sum().backward()
        g = [p.grad for p in ref.parameters()]
        grads = g if grads is None else [a + b for a, b in zip(grads, g)]
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.main_grad.double(), g / world_size, rtol=1e-6, atol=1e-7)


def test_average_across_two_ranks():
    run_distributed(_check_average, 2)
