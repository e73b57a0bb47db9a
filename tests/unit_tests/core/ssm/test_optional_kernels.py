"""The optional ``mamba_ssm`` / ``causal_conv1d`` kernels (megatron/core/ssm/optional_kernels.py).

The real kernels need CUDA and are not installed here, so these tests put stand-ins into
``sys.modules``: ``mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined`` and
``causal_conv1d.causal_conv1d_fn``, each written in float64 from the packages' documented
semantics (a step-by-step recurrence; an explicit loop over the convolution's taps), not from
our ssd.py. The kernel branch is run on CPU tensors by overriding the one decision
``kernels_apply``. This proves the ARGUMENT MAPPING to the documented API (layouts, what is
passed and what our code keeps: dt's bias and softplus, D, initial states, the gate left to
the norm, silu), not the kernels' numerics: those need a GPU with the packages installed.

* The dispatched scan and convolution equal the PyTorch path within 1e-10 (float64), groups
  shared by heads, with and without an initial state and D.
* A whole ``MambaMixer`` (float64) gives the same output and gradients either way (1e-10; the
  gradients through dt and A, float32 in the layer on both paths, at float32's resolution),
  and in generation the conv with a cached history and the decode step fall back to PyTorch.
* Not installed, or on CPU: the PyTorch path runs and the stand-ins are not called.
"""

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.ssm import optional_kernels
from megatron.core.ssm.mamba_mixer import MambaMixer
from megatron.core.ssm.ssd import causal_depthwise_conv1d, ssd_chunked
from megatron.core.transformer.transformer_config import TransformerConfig

SCAN_MODULE = "mamba_ssm.ops.triton.ssd_combined"


def _softplus(t):
    """The kernel's softplus: log(1 + e^t), the identity above 20 (``dt_softplus=True``)."""
    return torch.where(t <= 20.0, torch.log1p(torch.exp(t)), t)


def fake_mamba_chunk_scan_combined(calls):
    """``mamba_chunk_scan_combined`` as its docstring defines it, one time step at a time."""

    def scan(
        x,
        dt,
        A,
        B,
        C,
        chunk_size,
        D=None,
        z=None,
        dt_bias=None,
        initial_states=None,
        seq_idx=None,
        dt_softplus=False,
        dt_limit=(0.0, float("inf")),
        return_final_states=False,
    ):
        calls.append(dict(chunk_size=chunk_size, z=z, initial_states=initial_states))
        assert seq_idx is None  # not modelled by this stand-in
        b, length, h, p = x.shape
        g, n = B.shape[2:]
        assert dt.shape == (b, length, h) and A.shape == (h,) and h % g == 0
        assert B.shape == C.shape == (b, length, g, n)
        calls[-1].update(dt_bias=dt_bias, dt_softplus=dt_softplus)
        dt = dt.double()
        if dt_bias is not None:
            assert dt_bias.shape == (h,)
            dt = dt + dt_bias.double()
        if dt_softplus:
            dt = _softplus(dt)
        dt = dt.clamp(*dt_limit)
        group = torch.arange(h) // (h // g)  # head i reads group i // (h / g)
        if initial_states is None:
            state = torch.zeros(b, h, p, n, dtype=torch.float64)
        else:
            assert initial_states.shape == (b, h, p, n)
            state = initial_states.double()
        ys = []
        for t in range(length):
            Bt, Ct, xt = B[:, t, group].double(), C[:, t, group].double(), x[:, t].double()
            decay = torch.exp(dt[:, t] * A.double())  # [b, h]
            state = decay[..., None, None] * state + (dt[:, t, :, None] * xt)[
                ..., None
            ] * Bt.unsqueeze(2)
            y = (state * Ct.unsqueeze(2)).sum(-1)  # [b, h, p]
            if D is not None:
                y = y + xt * (D.double()[:, None] if D.dim() == 1 else D.double())
            if z is not None:
                y = y * F.silu(z[:, t].double())
            ys.append(y)
        out = torch.stack(ys, dim=1).to(x.dtype)
        return (out, state) if return_final_states else out

    return scan


def fake_causal_conv1d_fn(calls):
    """``causal_conv1d_fn``: x (batch, dim, seqlen), weight (dim, width); out[t] = bias +
    sum_i weight[:, i] x[t - width + 1 + i] (zeros before the start), then silu if asked."""

    def conv(
        x,
        weight,
        bias=None,
        seq_idx=None,
        initial_states=None,
        return_final_states=False,
        final_states_out=None,
        activation=None,
    ):
        calls.append(dict(activation=activation))
        assert seq_idx is None and initial_states is None and not return_final_states
        assert activation in (None, "silu", "swish")
        batch, dim, length = x.shape
        assert weight.dim() == 2 and weight.shape[0] == dim
        width = weight.shape[1]
        assert 2 <= width <= 4
        assert x.stride(2) == 1  # channel-first (the other layout needs dim % 8 == 0)
        assert bias is None or (bias.shape == (dim,) and bias.dtype == weight.dtype)
        columns = []
        for t in range(length):
            acc = torch.zeros(batch, dim, dtype=torch.float64)
            for i in range(width):
                src = t - (width - 1) + i
                if src >= 0:
                    acc = acc + weight[:, i].double() * x[:, :, src].double()
            if bias is not None:
                acc = acc + bias.double()
            columns.append(acc)
        out = torch.stack(columns, dim=-1)
        if activation is not None:
            out = out * torch.sigmoid(out)
        return out.to(x.dtype)

    return conv


@pytest.fixture
def fresh_lookup():
    """The package lookup is cached per process: start and end each test without it."""
    optional_kernels._optional_function.cache_clear()
    yield
    optional_kernels._optional_function.cache_clear()


@pytest.fixture
def fakes(monkeypatch, fresh_lookup):
    """Installs the stand-ins; returns their call logs."""
    calls = {"scan": [], "conv": []}
    for name in ("mamba_ssm", "mamba_ssm.ops", "mamba_ssm.ops.triton", SCAN_MODULE):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules[SCAN_MODULE].mamba_chunk_scan_combined = fake_mamba_chunk_scan_combined(
        calls["scan"]
    )
    conv_module = types.ModuleType("causal_conv1d")
    conv_module.causal_conv1d_fn = fake_causal_conv1d_fn(calls["conv"])
    monkeypatch.setitem(sys.modules, "causal_conv1d", conv_module)
    return calls


@pytest.fixture
def not_installed(monkeypatch, fresh_lookup):
    """``import`` of either package fails, as where they are not installed."""
    for name in ("mamba_ssm", SCAN_MODULE, "causal_conv1d"):
        monkeypatch.setitem(sys.modules, name, None)


def _force_kernels(monkeypatch):
    monkeypatch.setattr(optional_kernels, "kernels_apply", lambda t: True)


def _scan_inputs(b=2, length=19, h=4, p=3, g=2, n=5, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x, B, C = randn(b, length, h, p), randn(b, length, g, n), randn(b, length, g, n)
    dt = torch.rand(b, length, h, generator=gen, dtype=torch.float64)
    A = -3 * torch.rand(h, generator=gen, dtype=torch.float64)
    return x, dt, A, B, C, randn(h), randn(b, h, p, n)


def _max_diff(a, b):
    return (a - b).abs().max().item()


@pytest.mark.parametrize("with_D", [False, True], ids=["no_D", "D"])
@pytest.mark.parametrize("with_initial_state", [False, True], ids=["zero_state", "initial_state"])
def test_dispatched_scan_equals_pytorch_path(fakes, monkeypatch, with_D, with_initial_state):
    x, dt, A, B, C, D, s0 = _scan_inputs()
    D = D if with_D else None
    s0 = s0 if with_initial_state else None
    y_ref, state_ref = optional_kernels.chunk_scan(x, dt, A, B, C, 8, D, s0)
    assert fakes["scan"] == []  # CPU tensors: the PyTorch path
    _force_kernels(monkeypatch)
    y, state = optional_kernels.chunk_scan(x, dt, A, B, C, 8, D, s0)
    assert len(fakes["scan"]) == 1
    call = fakes["scan"][0]
    assert call["chunk_size"] == 8 and call["z"] is None
    assert call["dt_bias"] is None and call["dt_softplus"] is False  # dt arrives discretized
    assert (call["initial_states"] is None) == (s0 is None)
    assert _max_diff(y, y_ref) < 1e-10
    assert _max_diff(state, state_ref) < 1e-10
    assert y_ref.abs().max() > 0.1 and state_ref.abs().max() > 0.1  # not vacuous


def test_dispatched_conv_equals_pytorch_path(fakes, monkeypatch):
    gen = torch.Generator().manual_seed(2)
    # [b, L, d] transposed, as the mixer hands it over (channel-last strides).
    x = torch.randn(2, 11, 12, generator=gen, dtype=torch.float64).transpose(1, 2)
    w = torch.randn(12, 1, 4, generator=gen, dtype=torch.float64)
    bias = torch.randn(12, generator=gen, dtype=torch.float64)
    ref = optional_kernels.causal_conv1d_silu(x, w, bias)
    assert fakes["conv"] == []
    assert torch.equal(ref, F.silu(causal_depthwise_conv1d(x, w, bias)))
    _force_kernels(monkeypatch)
    out = optional_kernels.causal_conv1d_silu(x, w, bias)
    assert fakes["conv"] == [dict(activation="silu")]
    assert _max_diff(out, ref) < 1e-10 and ref.abs().max() > 0.1
    # A cached history, or a width the kernel lacks: the PyTorch path.
    history = torch.randn(2, 12, 3, generator=gen, dtype=torch.float64)
    with_history = optional_kernels.causal_conv1d_silu(x, w, bias, history)
    assert torch.equal(with_history, F.silu(causal_depthwise_conv1d(x, w, bias, history)))
    w5 = torch.randn(12, 1, 5, generator=gen, dtype=torch.float64)
    optional_kernels.causal_conv1d_silu(x, w5, bias)
    assert len(fakes["conv"]) == 1


def test_not_installed_runs_pytorch_path(not_installed, monkeypatch):
    _force_kernels(monkeypatch)  # even where a kernel could run
    x, dt, A, B, C, D, s0 = _scan_inputs()
    y, state = optional_kernels.chunk_scan(x, dt, A, B, C, 8, D, s0)
    y_ref, state_ref = ssd_chunked(x, dt, A, B, C, 8, D, initial_state=s0)
    assert torch.equal(y, y_ref) and torch.equal(state, state_ref)
    conv_x = x.reshape(2, 19, 12).transpose(1, 2)
    w = torch.ones(12, 1, 4, dtype=torch.float64)
    out = optional_kernels.causal_conv1d_silu(conv_x, w, None)
    assert torch.equal(out, F.silu(causal_depthwise_conv1d(conv_x, w, None)))


def test_kernels_apply_only_on_cuda():
    assert not optional_kernels.kernels_apply(torch.zeros(2))
    assert not optional_kernels.kernels_apply(torch.zeros(2, dtype=torch.bfloat16))


def _mixer():
    config = TransformerConfig(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        mamba_state_dim=4,
        mamba_head_dim=4,
        mamba_num_groups=2,  # 8 heads, 4 per group
        params_dtype=torch.float64,
        init_method_std=0.3,
        init_seed=3,
    )
    return MambaMixer(config, chunk_size=4, layer_number=1)


def _run(mixer, hidden):
    hidden = hidden.clone().requires_grad_(True)
    out, _ = mixer(hidden)
    mixer.zero_grad()
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    grads = {name: p.grad.clone() for name, p in mixer.named_parameters()}
    return out.detach(), hidden.grad, grads


def test_mixer_with_kernels_equals_pytorch(fakes, monkeypatch):
    mixer = _mixer()
    hidden = torch.randn(11, 2, 16, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    out_ref, dhidden_ref, grads_ref = _run(mixer, hidden)
    assert fakes == {"scan": [], "conv": []}
    _force_kernels(monkeypatch)
    out, dhidden, grads = _run(mixer, hidden)
    assert len(fakes["scan"]) == 1 and len(fakes["conv"]) == 1
    assert _max_diff(out, out_ref) < 1e-10 and out_ref.abs().max() > 0.01
    # dt and A are float32 in the layer whichever scan runs (softplus(dt.float() + dt_bias),
    # -exp(A_log.float())), so the gradients that flow through them are compared at float32's
    # resolution; every other gradient at 1e-10.
    dt_rows = slice(mixer.in_proj.weight.shape[0] - mixer.nheads, None)
    split = {
        "in_proj.weight[dt]": lambda g: g["in_proj.weight"][dt_rows],
        "in_proj.weight[z,x,B,C]": lambda g: g["in_proj.weight"][: dt_rows.start],
        **{name: (lambda g, name=name: g[name]) for name in grads_ref if name != "in_proj.weight"},
    }
    through_dt = {"in_proj.weight[dt]", "dt_bias", "A_log"}
    for name, pick in split.items():
        g_ref, g = pick(grads_ref), pick(grads)
        scale = g_ref.abs().max().item()
        assert scale > 0, name
        assert _max_diff(g, g_ref) < (1e-6 * scale if name in through_dt else 1e-10), name
    assert _max_diff(dhidden, dhidden_ref) < 1e-6 * dhidden_ref.abs().max().item()

    # Generation: a prompt (both kernels), a second piece continuing the cached conv history
    # (PyTorch conv, kernel scan from the cached state), one decode step (PyTorch recurrence).
    del fakes["scan"][:], fakes["conv"][:]
    generated = _generate(mixer, hidden)
    assert len(fakes["conv"]) == 1
    assert [c["initial_states"] is None for c in fakes["scan"]] == [True, False]
    monkeypatch.undo()
    assert _max_diff(generated, _generate(mixer, hidden)) < 1e-10


def _generate(mixer, hidden):
    context = StaticInferenceContext(2, 16)
    pieces = []
    with torch.no_grad():
        for start, stop in ((0, 5), (5, 10), (10, 11)):
            pieces.append(mixer(hidden[start:stop], inference_context=context)[0])
            context.advance(stop - start)
    return torch.cat(pieces)
