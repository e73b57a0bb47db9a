"""The unfused (blocked) attention against an explicit float64 computation and against SDPA,
and how DotProductAttention chooses between the two kernels (``--attention-backend``).

* blocked_attention: output and q/k/v gradients equal the textbook softmax(q k^T s + mask) v in
  float64 (autograd through explicit matmuls) for causal masks at block sizes that divide the
  sequence, that do not, that are 1 and that exceed it, and without a mask when the key length
  differs; grouped-query attention equals the explicit computation with each key/value group
  repeated for its heads (gradients summed per group); float32 equals torch's SDPA to rounding;
  strided inputs (the QKV split) work.
* dropout: with the keep masks replaced by known ones, output and gradients equal the explicit
  float64 computation with those masks applied (scaled by 1/(1-p)) to the probabilities; the
  real masks drop about p of the probabilities and repeat under the same seed.
* DotProductAttention runs the unfused path exactly where the backend and the call allow it
  ('auto' on CPU up to UNFUSED_AUTO_MAX_SEQ, 'unfused'/'local' always, never 'flash'/'fused',
  never with a mask tensor or half precision; with GQA and attention dropout), and
  both kernels give the same answer inside a whole GPTModel.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import blocked_attention as blocked_module
from megatron.core.transformer import dot_product_attention as dpa_module
from megatron.core.transformer.blocked_attention import blocked_attention
from megatron.core.transformer.dot_product_attention import (
    UNFUSED_AUTO_MAX_SEQ,
    DotProductAttention,
)
from megatron.core.transformer.enums import AttnMaskType
from tests.unit_tests.tiny_configs import tiny_transformer_config


def _qkv(sq, sk, b=2, n=3, d=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sq, b, n, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(sk, b, n, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(sk, b, n, d, generator=g, dtype=torch.float64).to(dtype)
    grad = torch.randn(sq, b, n * d, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v, grad


def _explicit_attention(q, k, v, scale, causal, dropout_keep=None, dropout_p=0.0):
    """softmax(q k^T * scale + mask) v per (batch, head), written out with einsum; with
    ``dropout_keep`` [b, n, s, t] the probabilities are masked and scaled by 1 / (1 - p) first."""
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) * scale
    if causal:
        keep = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).tril_()
        scores = scores.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if dropout_keep is not None:
        probs = probs * dropout_keep / (1.0 - dropout_p)
    out = torch.einsum("bnst,tbnd->sbnd", probs, v)
    return out.reshape(q.shape[0], q.shape[1], -1)


def _value_and_grads(fn, q, k, v, grad):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    out.backward(grad)
    return [out.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("seq,block_rows", [(12, 4), (13, 5), (9, 1), (10, 64)])
def test_causal_blocks_equal_explicit_float64(seq, block_rows):
    q, k, v, grad = _qkv(seq, seq)
    scale = 1.0 / math.sqrt(q.shape[-1])
    expected = _value_and_grads(
        lambda a, b_, c: _explicit_attention(a, b_, c, scale, True), q, k, v, grad
    )
    actual = _value_and_grads(
        lambda a, b_, c: blocked_attention(a, b_, c, scale, causal=True, block_rows=block_rows),
        q,
        k,
        v,
        grad,
    )
    for name, e, a in zip(("out", "dq", "dk", "dv"), expected, actual):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12, msg=name)


def test_no_mask_with_longer_keys_equals_explicit_float64():
    q, k, v, grad = _qkv(5, 11)
    expected = _value_and_grads(
        lambda a, b_, c: _explicit_attention(a, b_, c, 0.3, False), q, k, v, grad
    )
    actual = _value_and_grads(
        lambda a, b_, c: blocked_attention(a, b_, c, 0.3, causal=False), q, k, v, grad
    )
    for name, e, a in zip(("out", "dq", "dk", "dv"), expected, actual):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12, msg=name)


def test_grouped_query_attention_equals_explicit_float64_with_repeated_groups():
    q, _, _, grad = _qkv(10, 10, n=6)
    _, k, v, _ = _qkv(10, 10, n=2, seed=1)  # 2 groups of 3 query heads

    def explicit(a, b_, c):  # query head j reads group j // 3
        return _explicit_attention(
            a, b_.repeat_interleave(3, dim=2), c.repeat_interleave(3, dim=2), 0.4, True
        )

    expected = _value_and_grads(explicit, q, k, v, grad)
    actual = _value_and_grads(
        lambda a, b_, c: blocked_attention(a, b_, c, 0.4, causal=True, block_rows=4), q, k, v, grad
    )
    for name, e, a in zip(("out", "dq", "dk", "dv"), expected, actual):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12, msg=name)


def test_float32_strided_qkv_split_matches_sdpa():
    """q/k/v as the attention layer makes them: views of one fused [s, b, n, 3, d] projection."""
    s, b, n, d = 40, 2, 4, 16
    mixed = torch.randn(s, b, n, 3, d, generator=torch.Generator().manual_seed(1))
    grad = torch.randn(s, b, n * d, generator=torch.Generator().manual_seed(2))

    def sdpa(m):
        q, k, v = (x.permute(1, 2, 0, 3) for x in m.unbind(3))
        return (
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
            .permute(2, 0, 1, 3)
            .reshape(s, b, n * d)
        )

    def blocked(m):
        return blocked_attention(*m.unbind(3), 1.0 / math.sqrt(d), causal=True, block_rows=16)

    results = []
    for fn in (sdpa, blocked):
        m = mixed.clone().requires_grad_()
        out = fn(m)
        out.backward(grad)
        results.append((out.detach(), m.grad))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-5, atol=1e-5)


def test_dropout_with_known_masks_equals_explicit_float64(monkeypatch):
    seq, b, n, p_drop = 11, 2, 3, 0.3
    q, k, v, grad = _qkv(seq, seq, b=b, n=n)
    pattern = torch.rand(b * n, seq, seq, generator=torch.Generator().manual_seed(7)) >= p_drop
    # Each block gets the rows [r0, r1) and keys [0, keys) of one fixed [b*n, s, s] pattern; the
    # block bounds are read off the probabilities' shape (rows, keys) in call order.
    calls = []

    def known_keep(probs, dropout_p):
        assert dropout_p == p_drop
        r0 = sum(c[0] for c in calls)
        calls.append(probs.shape[1:])
        return pattern[:, r0 : r0 + probs.shape[1], : probs.shape[2]].clone()

    monkeypatch.setattr(blocked_module, "_dropout_keep", known_keep)
    full_keep = pattern.view(b, n, seq, seq).to(torch.float64)
    expected = _value_and_grads(
        lambda a, b_, c: _explicit_attention(a, b_, c, 0.5, True, full_keep, p_drop), q, k, v, grad
    )
    actual = _value_and_grads(
        lambda a, b_, c: blocked_attention(
            a, b_, c, 0.5, causal=True, block_rows=4, dropout_p=p_drop
        ),
        q,
        k,
        v,
        grad,
    )
    assert [tuple(c) for c in calls] == [(4, 4), (4, 8), (3, 11)]
    for name, e, a in zip(("out", "dq", "dk", "dv"), expected, actual):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12, msg=name)


def test_dropout_masks_drop_about_p_and_follow_the_seed():
    q, k, v, _ = _qkv(64, 64, b=4, n=4, d=8)
    keep = blocked_module._dropout_keep(torch.ones(16, 64, 64, dtype=torch.float64), 0.25)
    assert keep.dtype == torch.bool and abs(1.0 - keep.float().mean().item() - 0.25) < 0.01
    outs = []
    for seed in (5, 5, 6):
        torch.manual_seed(seed)
        outs.append(blocked_attention(q, k, v, 0.3, causal=True, dropout_p=0.25))
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])
    no_dropout = blocked_attention(q, k, v, 0.3, causal=True)
    assert not torch.allclose(outs[0], no_dropout)


def test_bad_shapes_are_refused_with_the_shapes():
    q, k, v, _ = _qkv(6, 7)
    with pytest.raises(ValueError, match="equal query and key lengths, got 6 and 7"):
        blocked_attention(q, k, v, 1.0, causal=True)
    with pytest.raises(ValueError, match=r"\(6, 2, 3, 8\), \(7, 2, 3, 8\), \(7, 2, 3, 4\)"):
        blocked_attention(q, k, v[..., :4], 1.0, causal=False)
    with pytest.raises(ValueError, match="g dividing n"):
        blocked_attention(q, k[:, :, :2], v[:, :, :2], 1.0, causal=False)
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\), got 1.0"):
        blocked_attention(q, k, v, 1.0, causal=False, dropout_p=1.0)


# ----------------------------------------------------------------------------- kernel choice


def _config(backend, **kw):
    return tiny_transformer_config(**{"num_layers": 1, "attention_backend": backend, **kw})


def _count_unfused_calls(monkeypatch):
    calls = []

    def spy(*args, **kwargs):
        calls.append((kwargs.get("causal"), kwargs.get("dropout_p")))
        return blocked_attention(*args, **kwargs)

    monkeypatch.setattr(dpa_module, "blocked_attention", spy)
    return calls


@pytest.mark.parametrize(
    "backend,seq,expect",
    [
        ("auto", 16, True),
        ("auto", UNFUSED_AUTO_MAX_SEQ + 1, False),
        ("unfused", UNFUSED_AUTO_MAX_SEQ + 1, True),
        ("local", 16, True),
        ("flash", 16, False),
        ("fused", 16, False),
    ],
)
def test_backend_chooses_the_kernel(monkeypatch, backend, seq, expect):
    calls = _count_unfused_calls(monkeypatch)
    attn = DotProductAttention(_config(backend), layer_number=1)
    q, k, v, _ = _qkv(seq, seq, b=1, n=4, d=8, dtype=torch.float32)
    attn(q, k, v, None)
    assert calls == ([(True, 0.0)] if expect else [])


def test_attention_dropout_goes_to_the_unfused_path_in_training_only(monkeypatch):
    calls = _count_unfused_calls(monkeypatch)
    attn = DotProductAttention(_config("auto", attention_dropout=0.1), layer_number=1)
    q, k, v, _ = _qkv(8, 8, b=1, n=4, d=8, dtype=torch.float32)
    attn.train()
    attn(q, k, v, None)
    attn.eval()
    attn(q, k, v, None)
    assert calls == [(True, 0.1), (True, 0.0)]


@pytest.mark.parametrize("case", ["mask_tensor", "bf16"])
def test_unfused_is_not_used_where_it_does_not_apply(monkeypatch, case):
    calls = _count_unfused_calls(monkeypatch)
    # bf16: 'auto' keeps half precision on SDPA ('unfused' takes it, see test_attention_precision)
    attn = DotProductAttention(_config("auto" if case == "bf16" else "unfused"), layer_number=1)
    attn.train()
    q, k, v, _ = _qkv(
        8, 8, b=1, n=4, d=8, dtype=torch.bfloat16 if case == "bf16" else torch.float32
    )
    mask = None
    if case == "mask_tensor":
        mask = torch.ones(8, 8, dtype=torch.bool).triu_(1)[None, None]
    attn(q, k, v, mask)
    assert calls == []


def test_no_mask_attention_uses_the_unfused_path_without_causal_mask(monkeypatch):
    calls = _count_unfused_calls(monkeypatch)
    attn = DotProductAttention(_config("auto"), layer_number=1, attn_mask_type=AttnMaskType.no_mask)
    q, k, v, _ = _qkv(6, 6, b=1, n=4, d=8, dtype=torch.float32)
    out = attn(q, k, v, None)
    assert calls == [(False, 0.0)]
    torch.testing.assert_close(
        out, _explicit_attention(q, k, v, 1 / math.sqrt(8), False), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("groups", [None, 2])
def test_gpt_model_gives_the_same_loss_and_grads_with_either_kernel(monkeypatch, groups):
    calls = _count_unfused_calls(monkeypatch)
    tokens = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(3))
    position_ids = torch.arange(24).unsqueeze(0).expand(2, -1)
    results = {}
    for backend in ("flash", "unfused"):
        torch.manual_seed(0)
        model = GPTModel(
            _config(backend, num_layers=2, num_query_groups=groups),
            get_gpt_layer_local_spec(),
            vocab_size=64,
            max_sequence_length=24,
        )
        loss = model(tokens, position_ids, None, labels=tokens.roll(-1, 1)).mean()
        loss.backward()
        results[backend] = (loss.detach(), [p.grad.clone() for p in model.parameters()])
        assert len(calls) == (2 if backend == "unfused" else 0)  # one call per layer
    torch.testing.assert_close(results["unfused"][0], results["flash"][0], rtol=1e-6, atol=1e-6)
    for a, e in zip(results["unfused"][1], results["flash"][1]):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-6)


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="attention_backend 'triton' unknown"):
        _config("triton")
