"""Gradient accumulation fusion (``--gradient-accumulation-fusion``, on by default as in Megatron;
``--no-gradient-accumulation-fusion``): the linear layers add their weight gradients into
``main_grad`` in backward, and DDP's per-param hook is not called for those weights.

Tolerance: none. On the CPU both paths form the same product in the weights' dtype (checked here
for fp32 and bf16) and add it to ``main_grad`` once per micro-batch in the same order, so the
gradients, losses and weights agree bitwise; only the mixed-dtype addmm taken on CUDA (bf16
operands, fp32 ``main_grad``) changes the rounding, and that is GPU-only.
"""

import contextlib
import io
import sys

import pytest
import torch
import torch.nn.functional as F

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    LinearWithGradAccumulation,
    RowParallelLinear,
)
from tests.functional_tests.runner import REPO, TINY_MODEL, parse_log_lines
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.tiny_configs import tiny_transformer_config


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_function_adds_autograds_weight_grad_into_main_grad(dtype):
    torch.manual_seed(0)
    x = torch.randn(5, 3, 16, dtype=dtype)
    weight = torch.nn.Parameter(torch.randn(8, 16, dtype=dtype))
    bias = torch.nn.Parameter(torch.randn(8, dtype=dtype))
    grad_out = torch.randn(5, 3, 8, dtype=dtype)

    x_ref = x.clone().requires_grad_()
    F.linear(x_ref, weight, bias).backward(grad_out)
    ref = (x_ref.grad, weight.grad.clone(), bias.grad.clone())
    weight.grad, bias.grad = None, None

    start = torch.randn(8, 16)  # what earlier micro-batches left
    weight.main_grad = start.clone()
    x_fused = x.clone().requires_grad_()
    out = LinearWithGradAccumulation.apply(x_fused, weight.detach(), bias, (weight,))
    assert torch.equal(out, F.linear(x, weight, bias))
    out.backward(grad_out)
    assert weight.grad is None
    assert torch.equal(x_fused.grad, ref[0]) and torch.equal(bias.grad, ref[2])
    assert torch.equal(weight.main_grad, start + ref[1].float())


def _config(fusion, dtype):
    return tiny_transformer_config(params_dtype=dtype, gradient_accumulation_fusion=fusion)


def _mlp(fusion, dtype):
    torch.manual_seed(3)
    config = _config(fusion, dtype)
    init = torch.nn.init.normal_
    return torch.nn.Sequential(
        ColumnParallelLinear(16, 32, config=config, init_method=init),
        RowParallelLinear(32, 16, config=config, init_method=init),
    )


def _run(fusion, overlap, calls):
    """Three micro-batches through a DDP-wrapped bf16 MLP with fp32 main grads; ``calls`` counts
    the hook calls per param name."""
    model = _mlp(fusion, torch.bfloat16)
    names = {id(p): n for n, p in model.named_parameters()}
    make_hook = DistributedDataParallel._make_grad_hook

    def counting_hook(self, buffer):
        hook = make_hook(self, buffer)

        def counted(param):
            calls[names[id(param)]] = calls.get(names[id(param)], 0) + 1
            hook(param)

        return counted

    DistributedDataParallel._make_grad_hook = counting_hook
    try:
        ddp = DistributedDataParallel(
            None,
            DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=overlap),
            model,
        )
    finally:
        DistributedDataParallel._make_grad_hook = make_hook
    torch.manual_seed(5)
    for micro_batch in range(3):
        context = ddp.no_sync() if micro_batch < 2 else contextlib.nullcontext()
        with context:
            x = torch.randn(4, 2, 16, dtype=torch.bfloat16)
            out, _ = model[1](model[0](x)[0])
            out.float().square().sum().backward()
    launched = [b.launched for buffer in ddp.all_buffers for b in buffer.buckets]
    ddp.finish_grad_sync()
    return model, launched


@pytest.mark.parametrize("overlap", [False, True])
def test_ddp_calls_no_hook_for_fused_weights_and_gets_the_same_main_grads(overlap):
    calls_off, calls_on = {}, {}
    plain, launched_off = _run(False, overlap, calls_off)
    fused, launched_on = _run(True, overlap, calls_on)
    # Plain path: the hook runs for every param at every micro-batch.
    assert calls_off == {"0.weight": 3, "0.bias": 3, "1.weight": 3, "1.bias": 3}
    # Fused: the weights' hooks are never called (the biases still go through autograd).
    assert calls_on == {"0.bias": 3, "1.bias": 3}
    for (name, p), q in zip(plain.named_parameters(), fused.parameters()):
        assert p.grad is None and q.grad is None, name
        assert torch.equal(p.main_grad, q.main_grad), name
    if overlap:
        # The layer's backward marked its weights ready: every bucket launched during backward.
        assert launched_on == launched_off and all(launched_on)


def test_the_accumulation_traces_into_one_compiled_graph():
    """--compile-transformer-layers compiles the linear layers' backward too: the add into
    ``main_grad`` must trace with no graph break (on an H200 the mixed-dtype addmm's ``out_dtype``
    failed under dynamo's fake tensors, so compiled code takes the plain add) and give eager's
    gradient. 'aot_eager' traces forward and backward as inductor would, without code generation."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(6, 4, dtype=torch.float64))
    weight.main_grad = torch.zeros_like(weight)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)

    def loss(x):
        return LinearWithGradAccumulation.apply(x, weight.detach(), None, (weight,)).sin().sum()

    loss(x).backward()
    eager = weight.main_grad.clone()
    weight.main_grad.zero_()
    torch._dynamo.reset()
    torch.compile(loss, backend="aot_eager", fullgraph=True)(x).backward()
    assert torch.equal(weight.main_grad, eager)
    assert weight.grad is None


def test_without_a_main_grad_the_layer_takes_the_plain_path():
    plain, fused = _mlp(False, torch.float32), _mlp(True, torch.float32)
    x = torch.randn(3, 16)
    for model in (plain, fused):
        model[1](model[0](x)[0])[0].sum().backward()
    for p, q in zip(plain.parameters(), fused.parameters()):
        assert torch.equal(p.grad, q.grad)


# ------------------------------------------------------------------ training, on against off


def _pretrain(argv):
    """(stdout, flat copy of this rank's final params, how many weight gradients were added into
    main_grad by the fused backward) of an in-process run of pretrain_gpt."""
    sys.path.insert(0, str(REPO))
    import pretrain_gpt
    from megatron.core.tensor_parallel import layers
    from megatron.training import global_vars

    models, fused = [], []
    accumulate = layers.accumulate_weight_grad

    def counted(weight, *args):
        fused.append(1)
        accumulate(weight, *args)

    def provider(**kwargs):
        model = pretrain_gpt.model_provider(**kwargs)
        models.append(model)
        return model

    global_vars.reset_globals()
    out = io.StringIO()
    layers.accumulate_weight_grad = counted
    with contextlib.redirect_stdout(out):
        pretrain_gpt.pretrain(
            pretrain_gpt.train_valid_test_datasets_provider,
            provider,
            pretrain_gpt.ModelType.encoder_or_decoder,
            pretrain_gpt.forward_step,
            args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
            argv=argv,
        )
    layers.accumulate_weight_grad = accumulate
    global_vars.reset_globals()
    params = torch.cat([p.detach().float().flatten() for m in models for p in m.parameters()])
    return out.getvalue(), params, len(fused)


LAYOUTS = {
    "tp2 sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2 distopt": ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"],
    "dp2 overlap moe": [
        "--overlap-grad-reduce",
        "--ddp-bucket-size",
        "3000",
        "--num-experts",
        "2",
        "--expert-model-parallel-size",
        "2",
    ],
}


def _on_and_off(rank, world_size):
    for name, layout in LAYOUTS.items():
        argv = TINY_MODEL + ["--train-iters", "3", "--bf16"] + layout
        runs = [_pretrain(argv + extra) for extra in ([], ["--no-gradient-accumulation-fusion"])]
        (out_on, params_on, fused_on), (out_off, params_off, fused_off) = runs
        # Every rank's linear layers took the fused backward with the flag, none without it.
        assert fused_on > 0 and fused_off == 0, (name, fused_on, fused_off)
        lines_on, lines_off = parse_log_lines(out_on), parse_log_lines(out_off)
        if lines_off:  # the last pipeline stage logs
            assert sorted(lines_on) == [1, 2, 3], (name, out_on[-2000:])
            for it in lines_off:
                for key in ("losses", "grad_norm"):
                    assert lines_on[it][key] == lines_off[it][key], (name, it, key)
        assert torch.equal(params_on, params_off), name


def test_training_is_bitwise_the_same_with_and_without_the_fusion():
    run_distributed(_on_and_off, 2)
