"""--attention-softmax-in-fp32 and --apply-query-key-layer-scaling in every attention path.

Reference: the same attention in float64 on the (rounded) half-precision inputs.

* Unfused path (``--attention-backend unfused``), bf16 and fp16: with the flag the softmax and its
  backward run in fp32, which lowers the query/key gradient error against float64 (summed over
  four seeds, by >= 1.5 %; measured 3-5 %). The forward error is the same with and without: like
  Megatron's torch path, the probabilities are rounded to the input dtype before the GEMM with
  the values either way, and torch's half softmax kernel already accumulates in fp32. The value
  gradient does not see the softmax's precision and stays equal.
* SDPA and ring attention (CP = 2): their kernels keep the softmax in fp32 whatever the flag; their
  errors are at most those of the unfused path with the flag (+15 %).
* Query-key layer scaling: fp32 results (outputs and gradients) are unchanged at layer 6, also
  through a whole GPTModel; in fp16, scores that overflow the score GEMM without it (NaN
  output) stay finite with it and give the float64 reference's output, which the scaling alone
  (no multiply back) would not.
"""

import math

import pytest
import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.parallel_state import initialize_model_parallel
from megatron.core.transformer.context_parallel import cp_chunk_indices
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.dist_utils import run_distributed

S, B, HEADS, D = 128, 2, 4, 32
HALF = [torch.bfloat16, torch.float16]


def _config(**kw):
    kw.setdefault("attention_backend", "unfused")
    return TransformerConfig(
        num_layers=8,
        hidden_size=HEADS * D,
        num_attention_heads=HEADS,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        **kw,
    )


def _inputs(seed, s=S):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(s, B, HEADS, D, generator=g) for _ in range(3))
    return q, k, v, torch.randn(s, B, HEADS * D, generator=g)


def _run(attention, dtype, q, k, v, grad_out):
    """Output and q/k/v gradients of ``attention`` on inputs rounded to ``dtype``."""
    xs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out = attention(*xs, None)
    out.backward(grad_out.to(dtype))
    return [out] + [x.grad for x in xs]


def _errors(attention, dtype, seed):
    """Relative errors (output, dq, dk, dv) against float64 on the same rounded inputs."""
    q, k, v, grad_out = _inputs(seed)
    q, k, v, grad_out = (t.to(dtype) for t in (q, k, v, grad_out))
    reference = _run(DotProductAttention(_config(), 1), torch.float64, q, k, v, grad_out)
    result = _run(attention, dtype, q, k, v, grad_out)
    return torch.tensor(
        [((r.double() - e).norm() / e.norm()).item() for r, e in zip(result, reference)]
    )


def _summed_errors(attention, dtype, seeds=range(4)):
    return sum(_errors(attention, dtype, seed) for seed in seeds)


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_fp32_softmax_lowers_the_unfused_gradient_error(dtype):
    without = _summed_errors(
        DotProductAttention(_config(attention_softmax_in_fp32=False), 1), dtype
    )
    with_flag = _summed_errors(
        DotProductAttention(_config(attention_softmax_in_fp32=True), 1), dtype
    )
    out, dq, dk, dv = range(4)
    assert with_flag[dq] < 0.985 * without[dq] and with_flag[dk] < 0.985 * without[dk], (
        with_flag,
        without,
    )
    assert with_flag[out] == without[out] and with_flag[dv] == without[dv]
    assert with_flag.max() < (0.05 if dtype == torch.bfloat16 else 0.01)


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_sdpa_keeps_an_fp32_softmax(dtype):
    unfused = _summed_errors(DotProductAttention(_config(attention_softmax_in_fp32=True), 1), dtype)
    for flag in (True, False):
        sdpa = DotProductAttention(
            _config(attention_backend="flash", attention_softmax_in_fp32=flag), 1
        )
        errors = _summed_errors(sdpa, dtype)
        assert (errors <= 1.15 * unfused).all(), (flag, errors, unfused)


def _ring_worker(rank, world_size, bounds):
    torch.set_num_threads(1)
    state = initialize_model_parallel(context_parallel_size=world_size)
    config = _config(context_parallel_size=world_size, attention_softmax_in_fp32=True)
    ring = DotProductAttention(config, 1, pg_collection=state)
    index = cp_chunk_indices(S // world_size, world_size, state.get_context_parallel_rank())
    for dtype, bound in zip(HALF, bounds):
        errors = torch.zeros(4)
        for seed in RING_SEEDS:
            q, k, v, grad_out = (t.to(dtype) for t in _inputs(seed))
            reference = _run(DotProductAttention(_config(), 1), torch.float64, q, k, v, grad_out)
            local = [t.index_select(0, index) for t in (q, k, v, grad_out)]
            result = _run(ring, dtype, *local)
            # The ring's backward leaves each rank the whole gradient of its own chunks, so the
            # chunks of all ranks put together are the full output and gradients.
            for i, (r, e) in enumerate(zip(result, reference)):
                full = torch.zeros_like(e).index_copy_(0, index, r.double())
                torch.distributed.all_reduce(full)
                errors[i] += ((full - e).norm() / e.norm()).item()
        assert (errors <= 1.15 * bound).all(), (dtype, errors, bound)


RING_SEEDS = range(2)


def test_ring_attention_keeps_an_fp32_softmax():
    unfused = DotProductAttention(_config(attention_softmax_in_fp32=True), 1)
    bounds = torch.stack([_summed_errors(unfused, dtype, RING_SEEDS) for dtype in HALF])
    run_distributed(_ring_worker, 2, bounds)


def test_query_key_layer_scaling_leaves_fp32_results_unchanged():
    q, k, v, grad_out = _inputs(5)
    plain = _run(DotProductAttention(_config(), 6), torch.float32, q, k, v, grad_out)
    scaled = _run(
        DotProductAttention(_config(apply_query_key_layer_scaling=True), 6),
        torch.float32,
        q,
        k,
        v,
        grad_out,
    )
    for a, b in zip(plain, scaled):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

    def gpt_loss_and_grads(**flags):
        torch.manual_seed(11)
        config = TransformerConfig(
            num_layers=3, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0,
            attention_dropout=0.0, attention_backend="unfused", **flags,
        )  # fmt: skip
        model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=16)
        tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
        loss = model(tokens, None, None, labels=tokens.roll(-1, 1)).mean()
        loss.backward()
        return [loss] + [p.grad for p in model.parameters()]

    for a, b in zip(gpt_loss_and_grads(), gpt_loss_and_grads(apply_query_key_layer_scaling=True)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_query_key_layer_scaling_keeps_fp16_scores_finite():
    # q.k * scale is 1.1e5 for every key (above fp16's 65504), plus 640 for the query's own key:
    # the softmax picks that key (fp16 rounds 1.1e5 to within ~70), so each output row is one
    # value row. Scaled by 1/320 the margin is 2: without the multiply back the rows would mix.
    s, layer, d = 16, 320, 64
    shared = torch.full((d,), 128.0)
    marker = torch.eye(s, d) * (640.0 * math.sqrt(d)) ** 0.5
    q = k = (shared + marker).view(s, 1, 1, d)
    v = torch.randn(s, 1, 1, d, generator=torch.Generator().manual_seed(2))
    expected = v.view(s, 1, d)  # causal: key i wins for query i (the diagonal)
    half = [t.to(torch.float16) for t in (q, k, v)]

    overflow = DotProductAttention(_config(attention_softmax_in_fp32=True), layer)(*half, None)
    assert not torch.isfinite(overflow).all()

    scaled = DotProductAttention(_config(apply_query_key_layer_scaling=True), layer)
    out = scaled(*half, None)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), expected, rtol=2e-3, atol=2e-3)
