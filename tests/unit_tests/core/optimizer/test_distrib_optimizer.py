"""Distributed optimizer (ZeRO-1) at DP=2 and DP=4: same training as the plain optimizer, 1/DP of
its state per rank, and a distrib_optim.pt saved at DP=2 that resumes at DP=4 and DP=1.

--overlap-param-gather: the same training as the synchronous gather (bit for bit); after a step
every bucket's gather is pending, and the forward's pre-hooks leave none pending."""

import os

import torch
import torch.distributed as dist

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import DistributedOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.tensor_parallel import ProcessGroupCollection
from tests.unit_tests.dist_utils import run_distributed

GLOBAL_BATCH = 8
STEPS = 10
SAVE_AFTER = 5


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 3),
    ).to(dtype)


def _local_batch(step, rank, world_size, dtype=torch.float32):
    """This rank's share of the global batch of ``step`` (the same global batch at every DP
    size)."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(GLOBAL_BATCH, 6, generator=g)
    y = torch.randn(GLOBAL_BATCH, 3, generator=g)
    per_rank = GLOBAL_BATCH // world_size
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    return x[mine].to(dtype), y[mine]


def _build(distributed, group, dtype=torch.float32, overlap_param_gather=False, **settings):
    model = _model(dtype)
    ddp = DistributedDataParallel(
        None,
        DistributedDataParallelConfig(
            use_distributed_optimizer=distributed,
            overlap_grad_reduce=distributed,
            bucket_size=2000,
            grad_reduce_in_fp32=dtype != torch.float32,
            overlap_param_gather=overlap_param_gather,
        ),
        model,
        pg_collection=ProcessGroupCollection(dp_cp=group),
    )
    config = OptimizerConfig(
        lr=2e-2,
        weight_decay=0.1,
        clip_grad=0.3,
        use_distributed_optimizer=distributed,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        log_num_zeros_in_grad=True,
        **settings,
    )
    chunks = [ddp] if distributed else [model]
    return model, ddp, get_megatron_optimizer(config, chunks)


def _train_step(model, ddp, optimizer, step, rank, world_size, dtype=torch.float32):
    optimizer.zero_grad()
    ddp.zero_grad_buffer()
    x, y = _local_batch(step, rank, world_size, dtype)
    with ddp.no_sync():
        loss0 = (ddp(x[:1]).float() - y[:1]).pow(2).sum() / x.shape[0]
        loss0.backward()
    loss1 = (ddp(x[1:]).float() - y[1:]).pow(2).sum() / x.shape[0]
    loss1.backward()
    ddp.finish_grad_sync()
    ok, grad_norm, num_zeros = optimizer.step()
    assert ok
    return (loss0 + loss1).item(), grad_norm


def _state_bytes(optimizer):
    total = 0
    for state in optimizer.optimizer.state.values():
        total += sum(
            v.numel() * v.element_size()
            for v in state.values()
            if torch.is_tensor(v) and v.dim() > 0
        )
    return total


def _flat_params(model):
    return torch.cat([p.detach().float().view(-1) for p in model.parameters()])


def _check_world(rank, world_size, ckpt_dir):
    torch.set_num_threads(1)
    group = dist.group.WORLD

    # fp32: the distributed optimizer trains exactly like the plain one.
    ref_model, ref_ddp, ref_opt = _build(False, group)
    model, ddp, opt = _build(True, group)
    assert isinstance(opt, DistributedOptimizer)
    ov_model, ov_ddp, ov_opt = _build(True, group, overlap_param_gather=True)
    ov_buckets = ov_ddp.buffers[0].buckets
    assert len(ov_buckets) >= 2
    for step in range(STEPS):
        ref_loss, ref_norm = _train_step(ref_model, ref_ddp, ref_opt, step, rank, world_size)
        loss, norm = _train_step(model, ddp, opt, step, rank, world_size)
        assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss), (step, loss, ref_loss)
        assert abs(norm - ref_norm) <= 1e-6 * ref_norm, (step, norm, ref_norm)
        assert _train_step(ov_model, ov_ddp, ov_opt, step, rank, world_size) == (loss, norm), step
        assert all(b.param_gather_work is not None for b in ov_buckets), (
            "gathers are launched, not waited"
        )
        if step == SAVE_AFTER - 1 and world_size == 2:
            opt_state = opt.state_dict()
            param_state = opt.get_parameter_state_dp_zero()
            if rank == 0:
                torch.save(
                    {"model": model.state_dict(), "optimizer": opt_state},
                    os.path.join(ckpt_dir, "model_optim_rng.pt"),
                )
                torch.save(param_state, os.path.join(ckpt_dir, "distrib_optim.pt"))
            else:
                assert param_state is None
        if step == SAVE_AFTER and world_size == 2 and rank == 0:
            torch.save(_flat_params(model), os.path.join(ckpt_dir, "params_after_next_step.pt"))
    torch.testing.assert_close(_flat_params(model), _flat_params(ref_model), rtol=1e-6, atol=1e-7)
    ov_ddp(_local_batch(0, rank, world_size)[0])
    assert all(b.param_gather_work is None for b in ov_buckets)
    assert torch.equal(_flat_params(ov_model), _flat_params(model))

    # Optimizer state: each element is held by exactly one rank; each rank holds ~1/DP.
    ref_bytes, local_bytes = _state_bytes(ref_opt), _state_bytes(opt)
    assert local_bytes == opt.optimizer_state_bytes()
    total = torch.tensor([local_bytes], dtype=torch.float64)
    dist.all_reduce(total)
    assert int(total.item()) == ref_bytes
    assert local_bytes <= 1.1 * ref_bytes / world_size, (local_bytes, ref_bytes)
    # Exact bound: Adam's two fp32 tensors over this rank's slice of every (padded) bucket.
    assert local_bytes <= 8 * sum(b.shard_size for b in ddp.buffers[0].buckets)

    # bf16 params with fp32 main params and grads: same as the plain mixed-precision optimizer.
    ref_model, ref_ddp, ref_opt = _build(False, group, torch.bfloat16)
    model, ddp, opt = _build(True, group, torch.bfloat16)
    for step in range(3):
        _train_step(ref_model, ref_ddp, ref_opt, step, rank, world_size, torch.bfloat16)
        _train_step(model, ddp, opt, step, rank, world_size, torch.bfloat16)
    masters = torch.cat([m.view(-1) for g in ref_opt.fp32_from_float16_groups for m in g])
    assert opt.optimizer_state_bytes() <= 1.1 * 3 * masters.numel() * 4 / world_size
    torch.testing.assert_close(_flat_params(model), _flat_params(ref_model), rtol=0, atol=0)

    if world_size == 2:
        _check_fast_paths_off(rank, world_size, group)
    if world_size == 4:
        _check_resume(rank, world_size, ckpt_dir, group)


def _check_fast_paths_off(rank, world_size, group):
    """bf16, sharded: the fused step with multi-tensor norm and copies (issue 29) against the
    per-param loop and per-param norm and copies (test_fast_optimizer_step.py has the bounds):
    the fp32 main params move apart by a few fp32 roundings per element and step, so the bf16
    params are at most one bf16 spacing apart; the first step's norms agree up to the order
    of the float64 sum over tensors."""
    plain = dict(optimizer_step_impl="for_loop", foreach_grad_norm_and_copies=False)
    fast = dict(optimizer_step_impl="fused", foreach_grad_norm_and_copies=True)
    runs = [_build(True, group, torch.bfloat16, **settings) for settings in (plain, fast)]
    assert runs[1][2].optimizer.param_groups[0]["fused"] is True
    norms = [[], []]
    for step in range(3):
        for (model, ddp, opt), out in zip(runs, norms):
            out.append(_train_step(model, ddp, opt, step, rank, world_size, torch.bfloat16)[1])
    assert abs(norms[1][0] - norms[0][0]) <= 16 * 2.0**-53 * norms[0][0]
    a, b = _flat_params(runs[1][0]), _flat_params(runs[0][0])
    largest = torch.maximum(a.abs(), b.abs())
    bf16_spacing = torch.ldexp(torch.ones_like(largest), torch.frexp(largest).exponent - 8)
    assert bool(((a - b).abs() <= bf16_spacing).all())


def _check_resume(rank, world_size, ckpt_dir, group):
    """Load the DP=2 checkpoint at this DP size; the next step equals the one DP=2 took."""
    model, ddp, opt = _build(True, group)
    saved = torch.load(os.path.join(ckpt_dir, "model_optim_rng.pt"), weights_only=True)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    opt.load_parameter_state(os.path.join(ckpt_dir, "distrib_optim.pt"))
    _train_step(model, ddp, opt, SAVE_AFTER, rank, world_size)
    expected = torch.load(os.path.join(ckpt_dir, "params_after_next_step.pt"), weights_only=True)
    torch.testing.assert_close(_flat_params(model), expected, rtol=1e-6, atol=1e-7)


def test_distributed_optimizer_parity_memory_and_resharded_resume(tmp_path):
    run_distributed(_check_world, 2, str(tmp_path))
    run_distributed(_check_world, 4, str(tmp_path))
    # DP=1 (no process group) loads the same distrib_optim.pt.
    _check_resume(0, 1, str(tmp_path), None)


def test_distributed_optimizer_needs_ddp_chunks():
    config = OptimizerConfig(lr=1e-3, use_distributed_optimizer=True)
    try:
        get_megatron_optimizer(config, [_model()])
    except ValueError as exc:
        assert "DistributedDataParallel" in str(exc)
    else:
        raise AssertionError("expected a ValueError")
