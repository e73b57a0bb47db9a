"""The optimizer's fast paths (issue 29) train like the plain path, within what their arithmetic
allows, and each can be switched off:

* ``OptimizerConfig.foreach_grad_norm_and_copies``: the grad norm, the grad copies to the fp32
  main grads and the main-param copies back as multi-tensor operations. The copies round
  exactly as ``copy_``/``.float()`` and each tensor's norm is still accumulated in float64 (on
  CUDA too: the kernel accumulates in the type of the float64 result), so only the order of the
  float64 sum over tensors changes: the norm may differ by a few float64 roundings, and without
  clipping (the norm then feeds nothing back) the losses and weights are bit-identical;
* ``OptimizerConfig.optimizer_step_impl``: torch's fused (or foreach) AdamW/SGD instead of the
  per-param loop. The fused kernel evaluates the same update in another order of fp32
  operations: each element of each update may differ by a few fp32 roundings, which bounds the
  loss difference through the gradient (see _fp32_step_bound).

The reference is the plain path (per-param loop, per-tensor norms), itself checked against
torch.optim elsewhere (test_optimizer.py).
"""

import io
import math

import pytest
import torch

from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
from tests.unit_tests.tiny_configs import (
    TINY_SEQ,
    TINY_VOCAB,
    tiny_gpt_model,
    tiny_transformer_config,
)

pytestmark = pytest.mark.usefixtures("single_thread")

U64 = 2.0**-53  # unit roundoff of float64
U32 = 2.0**-24  # unit roundoff of float32
PLAIN = dict(optimizer_step_impl="for_loop", foreach_grad_norm_and_copies=False)
STEPS = 4


def _batch(step, b=2):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, TINY_VOCAB, (b, TINY_SEQ), generator=g)
    labels = torch.randint(0, TINY_VOCAB, (b, TINY_SEQ), generator=g)
    position_ids = torch.arange(TINY_SEQ).unsqueeze(0).expand(b, TINY_SEQ)
    return tokens, position_ids, labels


def _train(dtype, steps=STEPS, **config):
    """Losses, grad norms, final params and the params' count of a 4-layer tiny GPT."""
    model = tiny_gpt_model(tiny_transformer_config(num_layers=4)).to(dtype)
    # clip_grad far above the norms: the norm is computed and logged, and never clips.
    settings = dict(lr=1e-3, weight_decay=0.1, bf16=dtype == torch.bfloat16, clip_grad=1e9)
    settings.update(config)
    opt = get_megatron_optimizer(OptimizerConfig(**settings), [model])
    losses, norms = [], []
    for step in range(steps):
        tokens, pos, labels = _batch(step)
        opt.zero_grad()
        loss = model(tokens, pos, None, labels=labels).float().mean()
        opt.scale_loss(loss).backward()
        ok, norm, _ = opt.step()
        assert ok
        losses.append(loss.item())
        norms.append(norm)
    return losses, norms, [p.detach().clone() for p in model.parameters()], opt


def _fp32_step_bound(norms, params, lr, steps):
    """How far apart two runs' losses may be when each step's update of every element may
    differ by a few fp32 roundings: per element and step at most c*U32*(|w| + lr) (c = 16
    roundings: the ~10 operations of an AdamW element update, each rounding once, with room),
    so after ``steps`` steps ||dw|| <= steps*c*U32*(||w|| + lr*sqrt(P)), and the loss moves by
    at most ||grad|| * ||dw|| to first order (the next gradients differ by as little, a
    second-order term left out; the factor 2 covers it over a few steps)."""
    w_norm = math.sqrt(sum(float(p.double().pow(2).sum()) for p in params))
    count = sum(p.numel() for p in params)
    dw = steps * 16 * U32 * (w_norm + lr * math.sqrt(count))
    return 2 * max(norms) * dw


def test_foreach_norm_equals_per_tensor_norm_within_float64_summation():
    g = torch.Generator().manual_seed(0)
    sizes = [0, 1, 7, 4096, 333, 32 * 96, 61 * 32]
    grads = [torch.randn(n, generator=g) * 10.0 ** (i % 3 - 1) for i, n in enumerate(sizes)]
    for norm_type in (2.0, 1.0, 3.0):
        plain = get_grad_norm_fp32(grads, norm_type, foreach=False)
        fast = get_grad_norm_fp32(grads, norm_type, foreach=True)
        # Independent reference: every |x|^p in float64, summed exactly (math.fsum).
        exact = math.fsum(float(x) ** norm_type for t in grads for x in t.abs().double()) ** (
            1.0 / norm_type
        )
        # Each tensor's float64 norm: at most n*U64 relative error in its sum of powers (any
        # order of summation), plus the sum over K tensors; the p-th root divides by p.
        bound = (max(sizes) + len(sizes) + 2) * U64 / norm_type * exact
        assert abs(fast - exact) <= bound and abs(plain - exact) <= bound
    inf_fast = get_grad_norm_fp32(grads, math.inf, foreach=True)
    assert inf_fast == get_grad_norm_fp32(grads, math.inf, foreach=False)
    assert get_grad_norm_fp32([], 2.0, foreach=True) == 0.0


def test_foreach_copies_and_norm_train_bf16_bit_identically_without_clipping():
    plain = _train(torch.bfloat16, **PLAIN)
    fast = _train(torch.bfloat16, **{**PLAIN, "foreach_grad_norm_and_copies": True})
    assert fast[0] == plain[0]
    assert all(torch.equal(a, b) for a, b in zip(fast[2], plain[2]))
    count = len(plain[2])
    for a, b in zip(fast[1], plain[1]):
        # The float64 sums of `count` squared tensor norms in two orders.
        assert abs(a - b) <= 2 * count * U64 * b


def test_foreach_norm_clipping_every_step_fp32():
    # clip_grad far below the norms: every step is scaled by max_norm / norm, so the norm's
    # float64 roundings reach the update (through the fp32 scale factor: one fp32 rounding).
    plain = _train(torch.float32, clip_grad=0.05, **PLAIN)
    fast = _train(torch.float32, clip_grad=0.05, **{**PLAIN, "foreach_grad_norm_and_copies": True})
    assert min(plain[1]) > 0.05
    bound = _fp32_step_bound(plain[1], plain[2], 1e-3, STEPS)
    for a, b in zip(fast[0], plain[0]):
        assert abs(a - b) <= bound
    for a, b in zip(fast[1], plain[1]):
        assert abs(a - b) <= 2 * len(plain[2]) * U64 * b + bound


@pytest.mark.parametrize("impl", ["fused", "foreach"])
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_fused_and_foreach_steps_train_like_the_per_param_loop(impl, optimizer):
    plain = _train(torch.float32, optimizer=optimizer, **PLAIN)
    fast = _train(torch.float32, optimizer=optimizer, **{**PLAIN, "optimizer_step_impl": impl})
    inner = fast[3].optimizer
    assert all(group.get(impl) is True for group in inner.param_groups)
    bound = _fp32_step_bound(plain[1], plain[2], 1e-3, STEPS)
    assert bound < 1e-3 * min(plain[0])  # the bound is tight enough to mean something
    for a, b in zip(fast[0], plain[0]):
        assert abs(a - b) <= bound
    # The first step's gradient is the same in both runs: identical norms.
    assert fast[1][0] == plain[1][0]


def test_fused_bf16_with_all_fast_paths():
    # The fp32 masters follow the fp32 bound of _fp32_step_bound element by element; the bf16
    # model params are the masters rounded, so a master that moved by a few fp32 roundings
    # rounds to the same bf16 value or to a neighbouring one: at most one bf16 spacing apart.
    plain = _train(torch.bfloat16, **PLAIN)
    fast = _train(torch.bfloat16, optimizer_step_impl="fused", foreach_grad_norm_and_copies=True)
    for a, b in zip(fast[2], plain[2]):
        largest = torch.maximum(a.float().abs(), b.float().abs())
        bf16_spacing = torch.ldexp(torch.ones_like(largest), torch.frexp(largest).exponent - 8)
        assert bool(((a.float() - b.float()).abs() <= bf16_spacing).all())
    masters = [m for group in fast[3].fp32_from_float16_groups for m in group]
    plain_masters = [m for group in plain[3].fp32_from_float16_groups for m in group]
    for a, b in zip(masters, plain_masters):
        allowed = STEPS * 16 * U32 * (torch.maximum(a.abs(), b.abs()) + 1e-3)
        assert bool(((a - b).abs() <= allowed).all())
    bound = _fp32_step_bound(plain[1], plain_masters, 1e-3, STEPS)
    for a, b in zip(fast[0], plain[0]):
        assert abs(a - b) <= bound + 2 * max(plain[1]) * _bf16_rounding_norm(plain[2])


def _bf16_rounding_norm(params):
    """||w|| * 2^-8: how far the bf16 params may move when each element rounds to a neighbour."""
    return math.sqrt(sum(float(p.double().pow(2).sum()) for p in params)) * 2.0**-8


def test_a_checkpoint_of_another_step_impl_keeps_this_runs_impl():
    losses, _, _, opt = _train(torch.float32, **PLAIN)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    model = tiny_gpt_model(tiny_transformer_config(num_layers=4))
    config = OptimizerConfig(lr=1e-3, weight_decay=0.1, optimizer_step_impl="fused")
    fused = get_megatron_optimizer(config, [model])
    fused.load_state_dict(state)
    for group in fused.optimizer.param_groups:
        assert group["fused"] is True and not group["foreach"]
        for p in group["params"]:
            step = fused.optimizer.state[p]["step"]
            assert step.dtype == torch.float32 and step.device == p.device
            assert step.item() == STEPS


def test_unknown_step_impl_is_refused():
    model = tiny_gpt_model(tiny_transformer_config(num_layers=1))
    with pytest.raises(ValueError, match="optimizer_step_impl must be one of auto, fused"):
        get_megatron_optimizer(OptimizerConfig(lr=1e-3, optimizer_step_impl="apex"), [model])


def test_auto_leaves_the_cpu_on_torchs_default_step():
    model = tiny_gpt_model(tiny_transformer_config(num_layers=1))
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-3), [model])
    group = opt.optimizer.param_groups[0]
    assert not group["fused"] and group["foreach"] is None
