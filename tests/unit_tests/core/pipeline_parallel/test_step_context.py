"""The schedule takes the trainer's loss scaler, gradient finalization, timers and per-token
option from a StepContext, and the model config holds only declared fields.

A tiny MoE GPT runs through the no-pipelining schedule in one process: once with a StepContext
and a config that carries none of those, once with the same callables set on the config the
Megatron Core way (no context). Both must give the same gradients bit for bit, the same
finalization call and the same timer calls, and match an independent reference: one backward of
the loss sum times the loss scale, with the routers' auxiliary losses taking the scale the
schedule applies to a micro-batch: with per-token loss (Megatron's scaling, which the model
config's ``calculate_per_token_loss`` turns on in the routers) the loss scale times the
micro-batch's token count, set by hand on routers that do not scale themselves."""

import copy
import functools

import pytest
import torch

from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
from megatron.core.pipeline_parallel.step_context import StepContext
from megatron.core.transformer.moe.router import TopKRouter
from tests.unit_tests.tiny_configs import tiny_gpt_model, tiny_transformer_config

VOCAB, SEQ, MBS, M = 32, 8, 2, 2
LOSS_SCALE = 8.0


class RecordingTimers:
    """Megatron's ``timers(name, log_level=...)`` interface; records start/stop per name."""

    def __init__(self):
        self.calls = []

    def __call__(self, name, log_level=0):
        calls = self.calls

        class _Timer:
            def start(self, barrier=False):
                calls.append((name, "start"))

            def stop(self, barrier=False):
                calls.append((name, "stop"))

        return _Timer()


def moe_gpt(per_token_loss=True):
    config = tiny_transformer_config(
        calculate_per_token_loss=per_token_loss,
        num_layers=2,
        hidden_size=16,
        ffn_hidden_size=32,
        num_attention_heads=2,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=16,
        moe_aux_loss_coeff=1.0,
        moe_z_loss_coeff=0.1,
    )
    return tiny_gpt_model(config, seed=5, vocab_size=VOCAB, max_sequence_length=SEQ)


def batches():
    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(M):
        out.append(
            dict(
                tokens=torch.randint(0, VOCAB, (MBS, SEQ), generator=g),
                labels=torch.randint(0, VOCAB, (MBS, SEQ), generator=g),
                loss_mask=(torch.rand(MBS, SEQ, generator=g) > 0.3).float(),
                position_ids=torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ),
            )
        )
    return out


def loss_func(loss_mask, output_tensor):
    total = (output_tensor.float() * loss_mask).sum()
    n = loss_mask.sum().int()
    return total, n, {"lm loss": torch.stack([total.detach(), n.float()])}


def forward_step_func(data_iterator, model):
    batch = next(data_iterator)
    out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return out, functools.partial(loss_func, batch["loss_mask"])


def run_schedule(model, step_context):
    finalized = []
    timers = RecordingTimers()
    callables = dict(
        grad_scale_func=lambda loss: loss * LOSS_SCALE,
        finalize_model_grads_func=lambda chunks, num_tokens=None: finalized.append(
            (chunks, num_tokens)
        ),
        timers=timers,
        calculate_per_token_loss=True,
    )
    if step_context:
        context = StepContext(**callables)
    else:  # Megatron Core's way: the same on the model config, no context
        context = None
        for name, value in callables.items():
            setattr(model.config, name, value)
    model.zero_grad()
    forward_backward_no_pipelining(
        forward_step_func=forward_step_func,
        data_iterator=iter(batches()),
        model=model,
        num_microbatches=M,
        seq_length=SEQ,
        micro_batch_size=MBS,
        step_context=context,
    )
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return grads, finalized, timers.calls


def reference_grads(model):
    """One backward of Σ loss-scale × (masked loss sum), the routers' losses scaled by
    loss-scale × the micro-batch's tokens (MBS × SEQ), set by hand on a model whose routers do
    not scale by tokens themselves (per-token loss off in its config)."""
    model.zero_grad()
    model.config.calculate_per_token_loss = False
    for module in model.modules():
        if isinstance(module, TopKRouter):
            assert not module.config.calculate_per_token_loss
            module.aux_loss_scale = LOSS_SCALE * MBS * SEQ
    total = 0.0
    for b in batches():
        losses = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
        total = total + (losses.float() * b["loss_mask"]).sum()
    (total * LOSS_SCALE).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def test_the_schedule_takes_the_trainer_channels_from_the_step_context():
    torch.manual_seed(0)
    model = moe_gpt().train()
    config_way = copy.deepcopy(model)
    reference = copy.deepcopy(model)
    config = model.config
    assert config.grad_scale_func is None and config.finalize_model_grads_func is None
    assert config.timers is None and config.calculate_per_token_loss

    grads, finalized, timer_calls = run_schedule(model, step_context=True)
    # Nothing was written on the config, and the routers got the micro-batch scale as a device
    # tensor (the loss scale is never read on the host).
    assert config.grad_scale_func is None and config.timers is None
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    assert len(routers) == 2
    for router in routers:
        assert torch.is_tensor(router.aux_loss_scale)
        assert router.aux_loss_scale.dtype == torch.float64
        assert router.aux_loss_scale.item() == LOSS_SCALE

    tokens = sum(int(b["loss_mask"].sum()) for b in batches())
    assert len(finalized) == 1
    assert finalized[0][0] == [model] and int(finalized[0][1]) == tokens
    assert timer_calls == [
        (name, what)
        for _ in range(M)
        for name in ("forward-compute", "backward-compute")
        for what in ("start", "stop")
    ]

    # Megatron Core's callers set the same on the config: the same run, bit for bit.
    config_grads, config_finalized, config_timer_calls = run_schedule(
        config_way, step_context=False
    )
    assert config_grads.keys() == grads.keys()
    for name in grads:
        assert torch.equal(config_grads[name], grads[name]), name
    assert int(config_finalized[0][1]) == tokens and config_timer_calls == timer_calls

    expected = reference_grads(reference)
    for name, grad in grads.items():
        err = ((grad - expected[name]).norm() / expected[name].norm().clamp_min(1e-30)).item()
        assert err <= 1e-5, f"{name}: relative error {err:.2e}"


def test_a_config_takes_only_its_declared_fields():
    config = tiny_transformer_config()
    with pytest.raises(AttributeError, match="TransformerConfig has no field 'moe_aux_loss_back"):
        config.moe_aux_loss_backward_scale = 1.0
    with pytest.raises(AttributeError, match="ModelParallelConfig has no field 'pipeline_event"):
        ModelParallelConfig().pipeline_event_callback = print
    # Declared fields, Megatron Core's trainer channels among them, stay writable.
    config.hidden_dropout = 0.25
    config.grad_scale_func = abs
    assert config.hidden_dropout == 0.25 and config.grad_scale_func is abs
