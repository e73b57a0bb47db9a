"""megatron.core.fusions against the unfused torch ops they replace.

* linear_cross_entropy: loss and gradients (hidden states, weight) equal F.cross_entropy on
  the explicitly computed logits, in float64 (tight) and float32 (rounding-level tolerance),
  for large logits too; the softmax dtype rules of fp16_lm_cross_entropy; bad shapes.
* GPTModel with cross_entropy_loss_fusion equals the model without it (tied and untied output
  weight), and at TP=2 (with and without sequence parallelism) equals the one-process model.
* The tanh GELU (x * sigmoid(2z), hand-written backward) equals F.gelu(approximate='tanh') in
  value and gradient, with and without the bias, and the MLP uses it under bias_activation_fusion.
"""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.fusions import bias_gelu_tanh, gelu_tanh, linear_cross_entropy
from megatron.core.fusions.fused_bias_gelu import GeLUTanhFunction
from megatron.core.parallel_state import destroy_model_parallel, initialize_model_parallel
from megatron.core.tensor_parallel import allreduce_sequence_parallel_grads
from megatron.core.tensor_parallel import collectives as C
from megatron.core.tensor_parallel.layers import full_from_shards
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.tiny_configs import tiny_gpt_model, tiny_transformer_config


def _reference_ce(hidden, weight, target, grad_loss):
    """Unfused: explicit logits, torch's cross entropy, autograd's gradients."""
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    logits = h.reshape(-1, h.shape[-1]) @ w.t()
    loss = F.cross_entropy(
        logits.float() if logits.dtype != torch.float64 else logits,
        target.reshape(-1),
        reduction="none",
    ).view(target.shape)
    loss.backward(grad_loss)
    return loss.detach(), h.grad, w.grad


def _fused_ce(hidden, weight, target, grad_loss, **kwargs):
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    loss = linear_cross_entropy(h, w, target, **kwargs)
    loss.backward(grad_loss)
    return loss.detach(), h.grad, w.grad


def _ce_inputs(dtype, n_rows=(3, 5), hidden=16, vocab=37, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*n_rows, hidden, generator=g, dtype=torch.float64).to(dtype) * scale
    w = torch.randn(vocab, hidden, generator=g, dtype=torch.float64).to(dtype)
    target = torch.randint(0, vocab, n_rows, generator=g)
    grad_loss = torch.rand(*n_rows, generator=g, dtype=torch.float64).to(
        torch.float32 if dtype != torch.float64 else dtype
    )
    return h, w, target, grad_loss


@pytest.mark.parametrize("scale", [1.0, 30.0])
def test_linear_cross_entropy_float64_matches_torch(scale):
    h, w, target, grad_loss = _ce_inputs(torch.float64, scale=scale)
    expected = _reference_ce(h, w, target, grad_loss)
    actual = _fused_ce(h, w, target, grad_loss)
    for name, a, e in zip(("loss", "grad hidden", "grad weight"), actual, expected):
        assert a.dtype == torch.float64, name
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12, msg=name)


def test_linear_cross_entropy_float32_matches_torch():
    h, w, target, grad_loss = _ce_inputs(
        torch.float32, n_rows=(64, 4), hidden=64, vocab=1000, scale=3.0
    )
    expected = _reference_ce(h, w, target, grad_loss)
    actual = _fused_ce(h, w, target, grad_loss)
    assert actual[0].dtype == torch.float32 and actual[0].shape == (64, 4)
    for name, a, e in zip(("loss", "grad hidden", "grad weight"), actual, expected):
        torch.testing.assert_close(a, e, rtol=2e-5, atol=2e-6, msg=name)
    # And both agree with a float64 computation to fp32 rounding.
    exact = _reference_ce(h.double(), w.double(), target, grad_loss.double())
    torch.testing.assert_close(actual[0].double(), exact[0], rtol=1e-5, atol=1e-5)


def test_linear_cross_entropy_fp32_softmax_of_bf16():
    h, w, target, grad_loss = _ce_inputs(torch.bfloat16, vocab=64)
    # Default: bf16 matmul, fp32 softmax and loss (the unfused path's logits.float()).
    loss, grad_h, grad_w = _fused_ce(h, w, target, grad_loss)
    ref_loss, ref_h, ref_w = _reference_ce(h, w, target, grad_loss)
    assert loss.dtype == torch.float32 and grad_h.dtype == grad_w.dtype == torch.bfloat16
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_h, ref_h, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(grad_w, ref_w, rtol=2e-2, atol=2e-2)
    # fp32_softmax=False: the softmax stays in the matmul's dtype (fp16_lm_cross_entropy).
    loss_half = linear_cross_entropy(h, w, target, fp32_softmax=False)
    assert loss_half.dtype == torch.bfloat16
    torch.testing.assert_close(loss_half.float(), ref_loss, rtol=5e-2, atol=5e-2)


def test_linear_cross_entropy_bad_shapes_and_double_backward():
    h, w, target, _ = _ce_inputs(torch.float32)
    with pytest.raises(ValueError, match="target of shape"):
        linear_cross_entropy(h, w, target.t())
    with pytest.raises(ValueError, match="hidden size"):
        linear_cross_entropy(h, w[:, :-1], target)
    h.requires_grad_()
    loss = linear_cross_entropy(h, w, target).sum()
    loss.backward(retain_graph=True)
    # The saved numerator became the gradient in place: a second backward must refuse.
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


# ----------------------------------------------------------------------------- GPTModel

VOCAB, SEQ, BATCH = 64, 16, 2


def _gpt(fusion, tied=True, tp=1, sp=False, pg_collection=None, **extra):
    config = tiny_transformer_config(
        ffn_hidden_size=64,
        cross_entropy_loss_fusion=fusion,
        tensor_model_parallel_size=tp,
        sequence_parallel=sp,
        **extra,
    )
    return tiny_gpt_model(
        config,
        seed=1234,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pg_collection=pg_collection,
        share_embeddings_and_output_weights=tied,
        position_embedding_type="learned_absolute" if tied else "rope",
    )


def _batch():
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    return tokens, position_ids, labels


def _rel_err(actual, expected):
    return (
        (actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)
    ).item()


@pytest.mark.parametrize("tied", [True, False])
def test_gpt_model_fused_loss_equals_unfused(tied):
    tokens, position_ids, labels = _batch()
    weights = torch.rand(
        BATCH, SEQ, generator=torch.Generator().manual_seed(3)
    )  # a loss mask-like weighting
    results = []
    for fusion in (False, True):
        model = _gpt(fusion, tied)
        losses = model(tokens, position_ids, None, labels=labels)
        (losses * weights).sum().backward()
        results.append((losses.detach(), {n: p.grad for n, p in model.named_parameters()}))
        if fusion:  # without labels the model still returns logits
            logits = model(tokens, position_ids, None)
            assert logits.shape == (BATCH, SEQ, VOCAB)
    (ref_losses, ref_grads), (losses, grads) = results
    assert losses.shape == (BATCH, SEQ) and losses.dtype == torch.float32 and losses.is_contiguous()
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert sorted(grads) == sorted(ref_grads)
    for name, grad in grads.items():
        assert _rel_err(grad, ref_grads[name]) <= 1e-5, name


def test_gpt_model_fused_loss_float64():
    """A float64 model keeps its loss in float64 (the unfused path computes it in fp32): the
    reference is F.cross_entropy on the model's own float64 logits."""
    tokens, position_ids, labels = _batch()
    weights = torch.rand(
        BATCH, SEQ, generator=torch.Generator().manual_seed(3), dtype=torch.float64
    )
    ref = _gpt(False, params_dtype=torch.float64)
    logits = ref(tokens, position_ids, None)
    assert logits.dtype == torch.float64
    ref_losses = F.cross_entropy(
        logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none"
    ).view(BATCH, SEQ)
    (ref_losses * weights).sum().backward()
    model = _gpt(True, params_dtype=torch.float64)
    losses = model(tokens, position_ids, None, labels=labels)
    (losses * weights).sum().backward()
    assert losses.dtype == torch.float64
    torch.testing.assert_close(losses, ref_losses, rtol=1e-12, atol=1e-12)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-12, msg=name)


def _tp_worker(rank, world_size):
    torch.set_num_threads(1)
    state = initialize_model_parallel(tensor_model_parallel_size=world_size)
    tp_group = state.get_tensor_model_parallel_group()
    tokens, position_ids, labels = _batch()
    for tied, sp in ((True, False), (False, True)):
        ref = _gpt(False, tied)
        ref_losses = ref(tokens, position_ids, None, labels=labels)
        ref_losses.sum().backward()
        model = _gpt(True, tied, tp=world_size, sp=sp, pg_collection=state)
        losses = model(tokens, position_ids, None, labels=labels)
        losses.sum().backward()
        tag = f"tied={tied} sp={sp}"
        assert _rel_err(losses, ref_losses) <= 1e-5, tag
        allreduce_sequence_parallel_grads(model, tp_group)
        ref_params = dict(ref.named_parameters())
        for name, param in model.named_parameters():
            grad = param.grad
            if getattr(param, "tensor_model_parallel", False):
                shards = C.all_gather_along_first_dim(grad.unsqueeze(0).contiguous(), tp_group)
                grad = full_from_shards(list(shards), param.partition_dim, param.partition_stride)
            assert _rel_err(grad, ref_params[name].grad) <= 1e-5, f"{tag}: {name}"
    destroy_model_parallel()


def test_gpt_model_fused_loss_vocab_parallel_tp2():
    run_distributed(_tp_worker, 2)


# ----------------------------------------------------------------------------- GELU


@pytest.mark.parametrize("with_bias", [False, True])
def test_gelu_tanh_float64_matches_torch(with_bias):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 3, 40, generator=g, dtype=torch.float64) * 3).requires_grad_()
    bias = torch.randn(40, generator=g, dtype=torch.float64).requires_grad_() if with_bias else None
    grad_out = torch.randn(4, 3, 40, generator=g, dtype=torch.float64)
    y = bias_gelu_tanh(x, bias)
    grads = torch.autograd.grad(y, [x] + ([bias] if with_bias else []), grad_out)
    x_ref = x.detach().clone().requires_grad_()
    b_ref = bias.detach().clone().requires_grad_() if with_bias else None
    y_ref = F.gelu(x_ref + b_ref if with_bias else x_ref, approximate="tanh")
    ref_grads = torch.autograd.grad(y_ref, [x_ref] + ([b_ref] if with_bias else []), grad_out)
    torch.testing.assert_close(y, y_ref, rtol=1e-14, atol=1e-14)
    for a, e in zip(grads, ref_grads):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)
    # Second derivative is not provided; the first one is checked numerically as well.
    assert torch.autograd.gradcheck(
        lambda t: GeLUTanhFunction.apply(t), (x[:1, :1, :8].detach().requires_grad_(),)
    )


def test_gelu_tanh_float32_no_grad_and_fallbacks():
    x = torch.randn(8, 64) * 4
    with torch.no_grad():
        y = gelu_tanh(x)
    torch.testing.assert_close(y, F.gelu(x, approximate="tanh"), rtol=1e-6, atol=1e-6)
    xb = x.bfloat16()  # half precision: aten's kernel (rounds once), identical to F.gelu
    assert torch.equal(gelu_tanh(xb), F.gelu(xb, approximate="tanh"))


def test_mlp_uses_tanh_gelu_under_bias_activation_fusion():
    common = dict(num_layers=1, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32)
    fused = MLP(TransformerConfig(bias_activation_fusion=True, **common))
    exact = MLP(TransformerConfig(bias_activation_fusion=False, **common))
    assert fused.activation_func is gelu_tanh and exact.activation_func is F.gelu
    with torch.no_grad():
        for p in fused.parameters():
            p.normal_()
    x = torch.randn(5, 2, 16)
    out, _ = fused(x)
    h = F.linear(x, fused.linear_fc1.weight, fused.linear_fc1.bias)
    expected = F.linear(
        F.gelu(h, approximate="tanh"), fused.linear_fc2.weight, fused.linear_fc2.bias
    )
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
