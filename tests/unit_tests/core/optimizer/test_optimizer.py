import copy
import io
import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from megatron.core.optimizer import (
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    OptimizerConfig,
    get_megatron_optimizer,
)
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.timers import Timers
from tests.unit_tests.dist_utils import run_distributed


class Embedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.word_embeddings = nn.Embedding(16, 8)


class TinyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = Embedding()
        self.linear = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.output_layer = nn.Linear(8, 16, bias=False)

    def forward(self, tokens):
        h = self.norm(torch.tanh(self.linear(self.embedding.word_embeddings(tokens))))
        return self.output_layer(h)


NO_DECAY = {"linear.bias", "norm.weight", "norm.bias"}


def _model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return TinyModel().to(dtype)


def _loss(model, step):
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 16, (4, 5), generator=g)
    labels = torch.randint(0, 16, (4, 5), generator=g)
    logits = model(tokens).float()
    return nn.functional.cross_entropy(logits.reshape(-1, 16), labels.reshape(-1))


def _config(**kw):
    base = dict(lr=1e-2, weight_decay=0.1, clip_grad=0.0)
    base.update(kw)
    return OptimizerConfig(**base)


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_param_groups_weight_decay_and_keys():
    model = _model()
    opt = get_megatron_optimizer(_config(), [model])
    assert isinstance(opt, FP32Optimizer)
    names = {id(p): n for n, p in model.named_parameters()}
    for group in opt.param_groups:
        for key in ("wd_mult", "lr_mult", "is_decoupled_lr", "max_lr", "min_lr"):
            assert key in group
        group_names = {names[id(p)] for p in group["params"]}
        if group["wd_mult"] == 0.0:
            assert group_names == NO_DECAY
            assert group["weight_decay"] == 0.0
        else:
            assert not group_names & NO_DECAY
            assert group["weight_decay"] == 0.1
        assert group["max_lr"] == 1e-2 and group["min_lr"] == 0.0 and not group["is_decoupled_lr"]


def test_decoupled_lr_groups_through_wrappers():
    wrapper = nn.Module()
    wrapper.module = _model()  # names become module.embedding.word_embeddings.weight, ...
    opt = get_megatron_optimizer(
        _config(decoupled_lr=5e-3, decoupled_min_lr=1e-4, min_lr=1e-5), [wrapper]
    )
    names = {id(p): n for n, p in wrapper.named_parameters()}
    decoupled = [g for g in opt.param_groups if g["is_decoupled_lr"]]
    assert {names[id(p)] for g in decoupled for p in g["params"]} == {
        "module.embedding.word_embeddings.weight",
        "module.output_layer.weight",
    }
    for g in opt.param_groups:
        assert (g["max_lr"], g["min_lr"]) == (
            (5e-3, 1e-4) if g["is_decoupled_lr"] else (1e-2, 1e-5)
        )
    sched = OptimizerParamScheduler(
        opt, 0.0, 1e-2, 1e-5, 0, 100, "constant", 0.1, 0.1, 100, "constant"
    )
    for g in opt.param_groups:
        assert g["lr"] == (5e-3 if g["is_decoupled_lr"] else 1e-2)
    assert sched.get_lr({}) == 1e-2


@pytest.mark.parametrize("use_main_grad", [False, True])
def test_fp32_adam_bitwise_equals_torch_adamw(use_main_grad):
    model = _model()
    ref_model = copy.deepcopy(model)
    config = _config(adam_beta1=0.8, adam_beta2=0.95, adam_eps=1e-6)
    opt = get_megatron_optimizer(config, [model])
    decay = [p for n, p in ref_model.named_parameters() if n not in NO_DECAY]
    no_decay = [p for n, p in ref_model.named_parameters() if n in NO_DECAY]
    ref = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-2,
        betas=(0.8, 0.95),
        eps=1e-6,
    )
    for step in range(5):
        opt.zero_grad()
        _loss(model, step).backward()
        if use_main_grad:  # what DDP does: the reduced grad lives in main_grad
            for p in model.parameters():
                p.main_grad = p.grad.clone()
                p.grad = None
        ref.zero_grad()
        _loss(ref_model, step).backward()
        ok, norm, zeros = opt.step()
        ref.step()
        assert ok and norm is None and zeros is None
    for (n, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(p, q), n
    if use_main_grad:
        assert all(p.grad is None for p in model.parameters())


def test_no_weight_decay_on_bias_and_norm():
    model = _model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = get_megatron_optimizer(_config(weight_decay=0.5, lr=0.1), [model])
    OptimizerParamScheduler(opt, 0.0, 0.1, 0.0, 0, 10, "constant", 0.5, 0.5, 10, "constant")
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # Adam step is 0: only decoupled weight decay moves params
    opt.step()
    for n, p in model.named_parameters():
        if n in NO_DECAY:
            assert torch.equal(p, before[n]), n
        else:
            assert torch.allclose(p, before[n] * (1 - 0.1 * 0.5), rtol=0, atol=1e-7), n


def test_clipping_matches_torch_clip_grad_norm():
    model = _model()
    ref_model = copy.deepcopy(model)
    opt = get_megatron_optimizer(
        _config(
            optimizer="sgd",
            sgd_momentum=0.0,
            weight_decay=0.0,
            lr=1.0,
            clip_grad=0.05,
            log_num_zeros_in_grad=True,
        ),
        [model],
    )
    _loss(model, 0).backward()
    _loss(ref_model, 0).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.05)
    ok, norm, zeros = opt.step()
    assert ok
    assert norm == pytest.approx(ref_norm.item(), rel=1e-6)
    assert norm > 0.05  # so clipping really happened
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-9)
    # Unused embedding rows have exactly-zero grads.
    expected_zeros = sum(int((q.grad == 0).sum()) for q in ref_model.parameters())
    assert zeros == expected_zeros and zeros > 0


def test_norm_counts_shared_and_tp_duplicates_once():
    model = _model()
    model.output_layer.weight.shared = True
    model.linear.weight.tensor_model_parallel = True
    _loss(model, 0).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    def norm(names):
        return math.sqrt(sum(float(grads[n].double().pow(2).sum()) for n in names))

    cfg = _config(clip_grad=1e9)
    tp0 = get_megatron_optimizer(cfg, [model], tp_rank=0)
    _, n0, _ = tp0.step()
    assert n0 == pytest.approx(norm([n for n in grads if n != "output_layer.weight"]), rel=1e-6)
    model2 = _model()
    model2.output_layer.weight.shared = True
    model2.linear.weight.tensor_model_parallel = True
    for n, p in model2.named_parameters():
        p.grad = grads[n].clone()
    tp1 = get_megatron_optimizer(cfg, [model2], tp_rank=1)
    _, n1, _ = tp1.step()
    assert n1 == pytest.approx(norm(["linear.weight"]), rel=1e-6)


def test_fp16_skips_overflow_and_backs_off_after_hysteresis():
    model = _model(dtype=torch.float16)
    cfg = _config(
        fp16=True,
        optimizer="sgd",
        sgd_momentum=0.0,
        weight_decay=0.0,
        lr=0.5,
        initial_loss_scale=2.0**10,
        hysteresis=2,
        loss_scale_window=1000,
    )
    opt = get_megatron_optimizer(cfg, [model])
    assert isinstance(opt, Float16OptimizerWithFloat16Params)
    assert opt.get_loss_scale().item() == 1024.0
    assert opt.scale_loss(torch.tensor(3.0)).item() == 3072.0
    before = [p.detach().clone() for p in model.parameters()]

    def set_grads(bad):
        for i, p in enumerate(model.parameters()):
            # true grad 0.25 everywhere, scaled by the loss scale (exact in fp16)
            p.grad = torch.full_like(p, 0.25 * opt.get_loss_scale().item())
            if bad and i == 2:
                p.grad.view(-1)[0] = float("inf")

    set_grads(bad=True)
    assert opt.step() == (False, None, None)
    assert opt.get_loss_scale().item() == 1024.0  # first overflow: hysteresis
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    set_grads(bad=True)
    assert opt.step()[0] is False
    assert opt.get_loss_scale().item() == 512.0  # second overflow: halved
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))

    set_grads(bad=False)
    ok, _, _ = opt.step()
    assert ok
    master_of = {
        id(p): m
        for hg, mg in zip(opt.float16_groups, opt.fp32_from_float16_groups)
        for p, m in zip(hg, mg)
    }
    for p, b in zip(model.parameters(), before):
        m = master_of[id(p)]
        expected = b.float() - 0.5 * 0.25
        assert torch.equal(m, expected)  # unscaled exactly, updated in fp32
        assert torch.equal(p, expected.half())  # copied back to the fp16 model
        assert p.dtype == torch.float16 and m.dtype == torch.float32


def test_bf16_keeps_fp32_master_weights():
    model = nn.Linear(4, 4, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        model.weight.fill_(1.0)
    opt = get_megatron_optimizer(
        _config(bf16=True, optimizer="sgd", sgd_momentum=0.0, weight_decay=0.0, lr=1e-3), [model]
    )
    assert opt.grad_scaler is None
    assert opt.get_loss_scale().item() == 1.0
    pure = torch.ones(4, 4, dtype=torch.bfloat16)
    for _ in range(10):
        model.weight.main_grad = torch.ones(4, 4, dtype=torch.float32)  # DDP-style fp32 grad
        assert opt.step()[0]
        pure = pure - 1e-3 * torch.ones_like(pure)  # what a bf16-only update does
    master = opt.fp32_from_float16_groups[0][0]
    expected = torch.ones(4, 4)
    for _ in range(10):
        expected = expected - 1e-3
    assert torch.equal(master, expected)  # ~0.99 kept in fp32
    assert torch.equal(pure, torch.ones_like(pure))  # each 1e-3 step is lost in bf16
    assert torch.equal(model.weight, master.bfloat16())
    assert model.weight[0, 0].item() < 1.0


@pytest.mark.parametrize("kind", ["fp32", "fp16", "bf16"])
def test_state_dict_weights_only_restores_identical_steps(kind):
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[kind]
    cfg = dict(fp16=kind == "fp16", bf16=kind == "bf16", initial_loss_scale=2.0**8, clip_grad=1.0)
    model = _model(dtype=dtype)
    opt = get_megatron_optimizer(_config(**cfg), [model])
    for step in range(3):
        opt.zero_grad()
        opt.scale_loss(_loss(model, step)).backward()
        opt.step()
    state = _roundtrip(opt.state_dict())
    if kind != "fp32":
        assert "fp32_from_fp16_params" in state
    if kind == "fp16":
        assert state["grad_scaler"]["scale"].item() == opt.get_loss_scale().item()

    model2 = _model(seed=1, dtype=dtype)
    model2.load_state_dict(_roundtrip(model.state_dict()))
    opt2 = get_megatron_optimizer(_config(**cfg), [model2])
    opt2.load_state_dict(state)
    for step in range(3, 6):
        for m, o in ((model, opt), (model2, opt2)):
            o.zero_grad()
            o.scale_loss(_loss(m, step)).backward()
            assert o.step()[0]
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
    if kind != "fp32":
        for a, b in zip(opt.fp32_from_float16_groups, opt2.fp32_from_float16_groups):
            assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_reload_model_params_and_load_errors():
    model = _model(dtype=torch.bfloat16)
    opt = get_megatron_optimizer(_config(bf16=True), [model])
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.5)
    opt.reload_model_params()
    assert all(
        torch.equal(m, torch.full_like(m, 0.5)) for g in opt.fp32_from_float16_groups for m in g
    )

    other = get_megatron_optimizer(_config(bf16=True), [nn.Linear(3, 3).to(torch.bfloat16)])
    with pytest.raises(ValueError, match="optimizer state in the checkpoint does not match"):
        other.load_state_dict(opt.state_dict())


def test_optimizer_state_in_another_parameter_order_is_refused():
    # torch pairs saved state with parameters by position: a checkpoint listing them in another
    # order (Megatron-LM's linear_proj before linear_qkv) must not load onto the wrong ones.
    model = _model()
    opt = get_megatron_optimizer(_config(), [model])
    _loss(model, 0).backward()
    opt.step()
    state = opt.state_dict()
    other = get_megatron_optimizer(_config(), [_model(seed=1)])
    other.load_state_dict(_roundtrip(state))  # the same order loads
    swapped = _roundtrip(state)
    first = swapped["param_groups"][0]["params"]
    first[0], first[1] = first[1], first[0]  # two parameters of different shapes
    with pytest.raises(ValueError, match="lists the parameters in another order"):
        other.load_state_dict(swapped)


def test_timers_and_errors():
    timers = Timers(log_level=1, log_option="minmax")
    model = _model()
    opt = get_megatron_optimizer(_config(timers=timers, clip_grad=1.0), [model])
    _loss(model, 0).backward()
    opt.step()
    text = timers.log(
        ["optimizer-copy-to-main-grad", "optimizer-clip-main-grad", "optimizer-inner-step"]
    )
    assert "optimizer-inner-step" in text and "optimizer-clip-main-grad" in text
    with pytest.raises(ValueError, match="--lr"):
        get_megatron_optimizer(OptimizerConfig(), [model])
    with pytest.raises(ValueError, match="--fp16 and --bf16"):
        get_megatron_optimizer(_config(fp16=True, bf16=True), [model])
    with pytest.raises(ValueError, match="--optimizer"):
        get_megatron_optimizer(_config(optimizer="lamb"), [model])


# ---------------------------------------------------------------------------- two ranks
def _two_rank_steps(rank, world_size, queue):
    group = dist.new_group([0, 1])
    # A "tensor-parallel" weight (different slice per rank) and a replicated bias.
    w = nn.Parameter(torch.zeros(2, 3))
    w.tensor_model_parallel = True
    b = nn.Parameter(torch.zeros(3))
    module = nn.ParameterList([w, b])
    opt = get_megatron_optimizer(
        _config(clip_grad=1e9, log_num_zeros_in_grad=True),
        [module],
        model_parallel_group=group,
        tp_rank=rank,
    )
    w.grad = torch.full((2, 3), float(rank + 1))
    w.grad[0, 0] = 0.0
    b.grad = torch.tensor([2.0, 0.0, 0.0])
    _, norm, zeros = opt.step()

    half = nn.Linear(2, 2).half()
    opt16 = get_megatron_optimizer(
        _config(fp16=True, initial_loss_scale=4.0, hysteresis=1),
        [half],
        model_parallel_group=group,
        tp_rank=rank,
    )
    for p in half.parameters():
        p.grad = torch.ones_like(p)
    if rank == 1:
        half.weight.grad[0, 0] = float("nan")
    ok16 = opt16.step()[0]
    queue.put((rank, norm, zeros, ok16, opt16.get_loss_scale().item()))


def test_two_rank_norm_zeros_and_overflow():
    queue = mp.get_context("spawn").SimpleQueue()
    run_distributed(_two_rank_steps, 2, queue)
    results = sorted(queue.get() for _ in range(2))
    # w: 5 entries of 1 (rank 0) and 5 of 2 (rank 1); bias counted once (rank 0): [2, 0, 0].
    expected_norm = math.sqrt(5 * 1 + 5 * 4 + 4)
    for rank, norm, zeros, ok16, scale in results:
        assert norm == pytest.approx(expected_norm, rel=1e-6)  # per-tensor norms are fp32
        assert zeros == 1 + 1 + 2
        assert ok16 is False and scale == 2.0  # the NaN on rank 1 skips the step everywhere
