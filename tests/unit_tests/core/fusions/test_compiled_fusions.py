"""The torch.compile'd fusions (what ``--bias-gelu-fusion`` and ``--bias-dropout-fusion`` run on
CUDA) against the unfused aten chains, compiled here on CPU: the tests make the functions take
their CUDA branch on CPU (``_compiles``), which is the same code with only the device differing.

* the compiled functions equal the aten chain in float64, forward and backward, and the fused
  dropout draws the mask that F.dropout draws from the same generator state (and leaves the
  generator where F.dropout leaves it);
* a few training iterations of a tiny float64 GPT with the compiled fusions give the losses of
  the plain path;
* ``compile_transformer_layers`` compiles each layer, into one graph for all, that trains as the
  eager layers; it refuses recompute and dropout under TP.

The first two tests share two small compiled graphs (about 10-20 s each to compile on one core);
the third captures the layer without inductor's code generation (about 10 s).
"""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.fusions import fused_bias_dropout, fused_bias_gelu
from megatron.core.fusions.fused_bias_dropout import bias_dropout_add
from megatron.core.fusions.fused_bias_gelu import bias_gelu_tanh
from tests.unit_tests.tiny_configs import (
    TINY_SEQ,
    TINY_VOCAB,
    tiny_gpt_model,
    tiny_transformer_config,
)

pytestmark = pytest.mark.timeout(300)

# float64, the same function: only the rounding of reordered or contracted (FMA) float64
# operations can differ, a few ulps.
TIGHT = dict(rtol=1e-12, atol=1e-12)

# The tiny GPT of the training tests: [s, b, h] and the MLP's [s, b, ffn]; its hidden dropout.
BATCH, HIDDEN, FFN, DROPOUT = 2, 32, 48, 0.2
ACTIVATION = (TINY_SEQ, BATCH, HIDDEN)
MLP_ACTIVATION = (TINY_SEQ, BATCH, FFN)


@pytest.fixture
def compiled_on_cpu(monkeypatch):
    """The fused functions take their compiled (CUDA) branch on CPU too; returns how often each
    compiled function was called."""
    calls = {}
    for module, getter in (
        (fused_bias_gelu, "_compiled_bias_gelu_tanh"),
        (fused_bias_dropout, "_compiled_bias_mask_add"),
    ):
        monkeypatch.setattr(module, "_compiles", lambda x: not torch.compiler.is_compiling())
        compiled = getattr(module, getter)()

        def counted(*args, _compiled=compiled, _name=getter):
            calls[_name] = calls.get(_name, 0) + 1
            return _compiled(*args)

        monkeypatch.setattr(module, getter, lambda _counted=counted: _counted)
    return calls


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def test_compiled_functions_equal_the_aten_chain_in_float64(compiled_on_cpu):
    """The shapes, dtype and dropout probability of the training test below, and no bias (our
    linear layers add theirs in the matrix product), so that both tests run the same two
    compiled graphs: each compiles once in the file."""
    g = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(*ACTIVATION, generator=g, dtype=torch.float64) * 3 for _ in "xr")
    grad_out = torch.randn(*ACTIVATION, generator=g, dtype=torch.float64)
    h = torch.randn(*MLP_ACTIVATION, generator=g, dtype=torch.float64) * 3
    grad_h = torch.randn(*MLP_ACTIVATION, generator=g, dtype=torch.float64)

    # GELU (tanh approximation)
    (fused_in,), (plain_in,) = _leaves(h), _leaves(h)
    fused = bias_gelu_tanh(fused_in, None)
    plain = F.gelu(plain_in, approximate="tanh")
    torch.testing.assert_close(fused, plain, **TIGHT)
    (fused_grad,) = torch.autograd.grad(fused, fused_in, grad_h)
    (plain_grad,) = torch.autograd.grad(plain, plain_in, grad_h)
    torch.testing.assert_close(fused_grad, plain_grad, **TIGHT)

    # dropout-add: the same mask from the same generator state, the generator left alike.
    fused_in, plain_in = _leaves(x, residual), _leaves(x, residual)
    torch.manual_seed(5)
    fused = bias_dropout_add(fused_in[0], None, fused_in[1], DROPOUT, training=True, fused=True)
    state_after_fused = torch.get_rng_state()
    torch.manual_seed(5)
    plain = plain_in[1] + F.dropout(plain_in[0], p=DROPOUT, training=True)
    assert torch.equal(torch.get_rng_state(), state_after_fused)
    dropped = plain == plain_in[1]
    assert 0 < dropped.sum() < dropped.numel()
    assert torch.equal(fused == fused_in[1], dropped)
    torch.testing.assert_close(fused, plain, **TIGHT)
    fused_grads = torch.autograd.grad(fused, fused_in, grad_out)
    plain_grads = torch.autograd.grad(plain, plain_in, grad_out)
    for a, e in zip(fused_grads, plain_grads):
        torch.testing.assert_close(a, e, **TIGHT)
    assert compiled_on_cpu == {"_compiled_bias_gelu_tanh": 1, "_compiled_bias_mask_add": 1}


def _losses(config, iterations=3, prepare=None):
    """Per-iteration mean losses of a tiny float64 GPT trained with plain SGD."""
    model = tiny_gpt_model(config, seed=3).double()
    if prepare is not None:
        prepare(model)
    model.train()
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, TINY_VOCAB, (BATCH, TINY_SEQ + 1), generator=g)
    position_ids = torch.arange(TINY_SEQ).expand(BATCH, -1)
    torch.manual_seed(7)  # the dropout masks
    losses = []
    for _ in range(iterations):
        loss = model(tokens[:, :-1], position_ids, None, labels=tokens[:, 1:]).mean()
        model.zero_grad()
        loss.backward()
        with torch.no_grad():
            for param in model.parameters():
                param -= 0.5 * param.grad
        losses.append(loss.detach())
    return torch.stack(losses)


def test_training_with_the_compiled_fusions_equals_the_plain_path(compiled_on_cpu):
    """Switches on (the compiled CUDA functions) against switches off. Off, Megatron's MLP runs
    the erf GELU instead of the tanh one; the plain run is given the tanh GELU as its activation
    so that both compute the same function, and the float64 losses then agree to rounding. With
    dropout on, equal losses also mean equal masks."""
    common = dict(
        hidden_size=HIDDEN, hidden_dropout=DROPOUT, ffn_hidden_size=FFN, add_bias_linear=True
    )
    fused = _losses(
        tiny_transformer_config(bias_activation_fusion=True, bias_dropout_fusion=True, **common)
    )
    plain = _losses(
        tiny_transformer_config(
            bias_activation_fusion=False,
            bias_dropout_fusion=False,
            activation_func=lambda t: F.gelu(t, approximate="tanh"),
            **common,
        )
    )
    # 2 layers x 3 iterations: one compiled bias-GELU per MLP, two bias-dropout-adds per layer.
    assert compiled_on_cpu == {"_compiled_bias_gelu_tanh": 6, "_compiled_bias_mask_add": 12}
    assert fused[-1] < fused[0]  # it trains
    torch.testing.assert_close(fused, plain, **TIGHT)


def test_compiled_transformer_layers_train_as_the_eager_ones():
    """compile_transformer_layers: both layers share one captured graph, with no graph break,
    and its forward and backward (AOT autograd's) give the eager losses in float64. Without
    dropout: in a compiled graph the compiler draws the masks its own way.

    The graph is run by torch.compile's 'aot_eager' backend: capturing and differentiating the
    layer is what this project's code decides; inductor's code generation for the captured
    graph (about a minute here for one layer) is torch's, and the two tests above run it on CPU
    for the fused functions."""
    from torch._dynamo.utils import counters

    common = dict(ffn_hidden_size=FFN, add_bias_linear=True, bias_dropout_fusion=True)
    eager = _losses(tiny_transformer_config(**common))

    def compile_with_aot_eager(model):
        for layer in model.decoder.layers:
            assert layer._compiled_call_impl is not None  # the switch compiled it
            layer.compile(backend="aot_eager")

    torch._dynamo.reset()
    counters.clear()
    compiled = _losses(
        tiny_transformer_config(compile_transformer_layers=True, **common),
        prepare=compile_with_aot_eager,
    )
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]
    torch.testing.assert_close(compiled, eager, **TIGHT)


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(recompute_granularity="selective"), "cannot be combined with recompute_granularity"),
        (
            dict(tensor_model_parallel_size=2, hidden_dropout=0.1),
            "needs hidden_dropout and attention_dropout 0",
        ),
    ],
)
def test_compiled_layers_refuse_what_they_cannot_do(settings, message):
    with pytest.raises(ValueError, match=message):
        tiny_transformer_config(compile_transformer_layers=True, **settings)


def test_the_default_cpu_path_compiles_nothing(monkeypatch):
    """Both fusions on (Megatron's defaults): on CPU a training step runs the eager code."""

    def refuse(*args, **kwargs):
        raise AssertionError("torch.compile called on the default CPU path")

    monkeypatch.setattr(torch, "compile", refuse)
    for module in (fused_bias_gelu, fused_bias_dropout):
        for name in ("_compiled_bias_gelu_tanh", "_compiled_bias_mask_add"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, refuse)
    config = tiny_transformer_config(
        bias_activation_fusion=True, bias_dropout_fusion=True, hidden_dropout=0.2
    )
    assert _losses(config, iterations=1).isfinite().all()
