"""The unfused (blocked) attention against an explicit float64 computation and against SDPA,
and how DotProductAttention chooses between the two kernels (``--attention-backend``).

* blocked_attention: output and q/k/v gradients equal the textbook softmax(q k^T s + mask) v in
  float64 (autograd through explicit matmuls) for causal masks at block sizes that divide the
  sequence, that do not, that are 1 and that exceed it, and without a mask when the key length
  differs; float32 equals torch's SDPA to rounding; strided inputs (the QKV split) work.
* DotProductAttention runs the unfused path exactly where the backend and the call allow it
  ('auto' on CPU up to UNFUSED_AUTO_MAX_SEQ, 'unfused'/'local' always, never 'flash'/'fused',
  never with dropout, a mask tensor, GQA or half precision), and both kernels give the same
  answer inside a whole GPTModel.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import dot_product_attention as dpa_module
from megatron.core.transformer.blocked_attention import blocked_attention
from megatron.core.transformer.dot_product_attention import UNFUSED_AUTO_MAX_SEQ, DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig


def _qkv(sq, sk, b=2, n=3, d=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sq, b, n, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(sk, b, n, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(sk, b, n, d, generator=g, dtype=torch.float64).to(dtype)
    grad = torch.randn(sq, b, n * d, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v, grad


def _explicit_attention(q, k, v, scale, causal):
    """softmax(q k^T * scale + mask) v per (batch, head), written out with einsum."""
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) * scale
    if causal:
        keep = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).tril_()
        scores = scores.masked_fill(~keep, float("-inf"))
    out = torch.einsum("bnst,tbnd->sbnd", torch.softmax(scores, dim=-1), v)
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
    expected = _value_and_grads(lambda a, b_, c: _explicit_attention(a, b_, c, scale, True), q, k, v, grad)
    actual = _value_and_grads(lambda a, b_, c: blocked_attention(a, b_, c, scale, causal=True,
                                                                 block_rows=block_rows), q, k, v, grad)
    for name, e, a in zip(("out", "dq", "dk", "dv"), expected, actual):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12, msg=name)


def test_no_mask_with_longer_keys_equals_explicit_float64():
    q, k, v, grad = _qkv(5, 11)
    expected = _value_and_grads(lambda a, b_, c: _explicit_attention(a, b_, c, 0.3, False), q, k, v, grad)
    actual = _value_and_grads(lambda a, b_, c: blocked_attention(a, b_, c, 0.3, causal=False), q, k, v, grad)
    for name, e, a in zip(("out", "dq", "dk", "dv"), expected, actual):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12, msg=name)


def test_float32_strided_qkv_split_matches_sdpa():
    """q/k/v as the attention layer makes them: views of one fused [s, b, n, 3, d] projection."""
    s, b, n, d = 40, 2, 4, 16
    mixed = torch.randn(s, b, n, 3, d, generator=torch.Generator().manual_seed(1))
    grad = torch.randn(s, b, n * d, generator=torch.Generator().manual_seed(2))

    def sdpa(m):
        q, k, v = (x.permute(1, 2, 0, 3) for x in m.unbind(3))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(2, 0, 1, 3).reshape(s, b, n * d)

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


def test_bad_shapes_are_refused_with_the_shapes():
    q, k, v, _ = _qkv(6, 7)
    with pytest.raises(ValueError, match="equal query and key lengths, got 6 and 7"):
        blocked_attention(q, k, v, 1.0, causal=True)
    with pytest.raises(ValueError, match=r"\(6, 2, 3, 8\), \(7, 2, 3, 8\), \(7, 2, 3, 4\)"):
        blocked_attention(q, k, v[..., :4], 1.0, causal=False)


# ----------------------------------------------------------------------------- kernel choice

def _config(backend, **kw):
    base = dict(num_layers=1, hidden_size=32, num_attention_heads=4, attention_dropout=0.0,
                hidden_dropout=0.0, attention_backend=backend)
    base.update(kw)
    return TransformerConfig(**base)


def _count_unfused_calls(monkeypatch):
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs.get("causal"))
        return blocked_attention(*args, **kwargs)

    monkeypatch.setattr(dpa_module, "blocked_attention", spy)
    return calls


@pytest.mark.parametrize("backend,seq,expect", [
    ("auto", 16, True), ("auto", UNFUSED_AUTO_MAX_SEQ + 1, False), ("unfused", UNFUSED_AUTO_MAX_SEQ + 1, True),
    ("local", 16, True), ("flash", 16, False), ("fused", 16, False)])
def test_backend_chooses_the_kernel(monkeypatch, backend, seq, expect):
    calls = _count_unfused_calls(monkeypatch)
    attn = DotProductAttention(_config(backend), layer_number=1)
    q, k, v, _ = _qkv(seq, seq, b=1, n=4, d=8, dtype=torch.float32)
    attn(q, k, v, None)
    assert calls == ([True] if expect else [])


@pytest.mark.parametrize("case", ["dropout", "mask_tensor", "gqa", "bf16"])
def test_unfused_is_not_used_where_it_does_not_apply(monkeypatch, case):
    calls = _count_unfused_calls(monkeypatch)
    kw = {"attention_dropout": 0.1} if case == "dropout" else {}
    attn = DotProductAttention(_config("unfused", **kw), layer_number=1)
    attn.train()
    q, k, v, _ = _qkv(8, 8, b=1, n=4, d=8, dtype=torch.bfloat16 if case == "bf16" else torch.float32)
    mask = None
    if case == "mask_tensor":
        mask = torch.ones(8, 8, dtype=torch.bool).triu_(1)[None, None]
    if case == "gqa":
        k, v = k[:, :, :2], v[:, :, :2]
    attn(q, k, v, mask)
    assert calls == []


def test_no_mask_attention_uses_the_unfused_path_without_causal_mask(monkeypatch):
    calls = _count_unfused_calls(monkeypatch)
    attn = DotProductAttention(_config("auto"), layer_number=1, attn_mask_type=AttnMaskType.no_mask)
    q, k, v, _ = _qkv(6, 6, b=1, n=4, d=8, dtype=torch.float32)
    out = attn(q, k, v, None)
    assert calls == [False]
    torch.testing.assert_close(out, _explicit_attention(q, k, v, 1 / math.sqrt(8), False), rtol=1e-5, atol=1e-6)


def test_gpt_model_gives_the_same_loss_and_grads_with_either_kernel():
    tokens = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(3))
    position_ids = torch.arange(24).unsqueeze(0).expand(2, -1)
    results = {}
    for backend in ("flash", "unfused"):
        torch.manual_seed(0)
        model = GPTModel(_config(backend, num_layers=2), vocab_size=64, max_sequence_length=24)
        loss = model(tokens, position_ids, None, labels=tokens.roll(-1, 1)).mean()
        loss.backward()
        results[backend] = (loss.detach(), [p.grad.clone() for p in model.parameters()])
    torch.testing.assert_close(results["unfused"][0], results["flash"][0], rtol=1e-6, atol=1e-6)
    for a, e in zip(results["unfused"][1], results["flash"][1]):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-6)


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="attention_backend 'triton' unknown"):
        _config("triton")
