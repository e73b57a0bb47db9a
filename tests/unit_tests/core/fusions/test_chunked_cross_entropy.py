"""The chunked output layer + cross entropy (``--cross-entropy-loss-fusion``) over several chunks
of tokens, against the plain path:

* float64: losses and gradients (hidden states, weight) equal F.cross_entropy(hidden @ W^T)
  for chunk sizes that do not divide the token count, one-token chunks and one chunk, with a
  GPT loss mask (masked tokens get zero gradient, as masked_token_loss gives them);
* bf16 weights over several chunks: the weight's gradient is summed in fp32 (the same values as
  one chunk up to bf16 rounding of each chunk's part);
* no [N, V] tensor is kept for the backward: only the last chunk's numerator;
* TP=2 (vocab shards, a spawned gloo world) equals one process, for the function over several
  chunks and for GPTModel with sequence parallelism;
* training a tiny GPT with the switch on (several chunks per micro-batch) gives the losses of
  the switch off.
"""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.fusions import fused_linear_cross_entropy as fused
from megatron.core.fusions import linear_cross_entropy
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.parallel_state import destroy_model_parallel, initialize_model_parallel
from megatron.core.tensor_parallel import allreduce_sequence_parallel_grads
from megatron.core.tensor_parallel import collectives as C
from megatron.core.tensor_parallel.layers import full_from_shards
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.tiny_configs import (
    TINY_SEQ,
    TINY_VOCAB,
    tiny_gpt_model,
    tiny_transformer_config,
)

pytestmark = pytest.mark.usefixtures("single_thread")

ROWS, HIDDEN, VOCAB = 15, 8, 37


def _inputs(dtype=torch.float64, seed=0, rows=ROWS, vocab=VOCAB, scale=4.0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(rows, HIDDEN, generator=g, dtype=torch.float64) * scale).to(dtype)
    w = torch.randn(vocab, HIDDEN, generator=g, dtype=torch.float64).to(dtype)
    target = torch.randint(0, vocab, (rows,), generator=g)
    # masked_token_loss: sum(loss * mask) / mask.sum(); the gradient of each token's loss is
    # mask / mask.sum(), zero for masked tokens (ends of documents, padding).
    mask = (torch.rand(rows, generator=g) > 0.3).to(torch.float64)
    return h, w, target, mask


def _masked_loss(losses, mask):
    return (losses.double() * mask).sum() / mask.sum()


def _plain(h, w, target, mask):
    h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    logits = h @ w.t()
    losses = F.cross_entropy(
        logits if logits.dtype == torch.float64 else logits.float(), target, reduction="none"
    )
    _masked_loss(losses, mask).backward()
    return losses.detach(), h.grad, w.grad


def _chunked(h, w, target, mask, **kwargs):
    h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    losses = linear_cross_entropy(h, w, target, **kwargs)
    _masked_loss(losses, mask).backward()
    return losses.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk_tokens", [1, 4, 7, 14, ROWS, 100])
def test_chunks_equal_plain_cross_entropy_in_float64(chunk_tokens):
    h, w, target, mask = _inputs()
    assert mask.min() == 0.0  # some tokens are masked
    expected = _plain(h, w, target, mask)
    actual = _chunked(h, w, target, mask, chunk_tokens=chunk_tokens)
    for name, a, e in zip(("losses", "grad hidden", "grad weight"), actual, expected):
        assert a.dtype == torch.float64, name
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-13, msg=name)
    assert actual[1][mask == 0].abs().max() == 0.0  # masked tokens: no gradient


def test_default_chunking_splits_rows_evenly_under_the_element_budget():
    # GPT-2 large, micro-batch 32: 13 chunks of 2,521 tokens, each under 2^27 logits.
    rows = fused.chunk_rows(32 * 1024, 50304)
    assert rows == 2521 and rows * 50304 <= fused.CHUNK_ELEMENTS
    assert fused.chunk_rows(ROWS, VOCAB, chunk_elements=VOCAB * 4) == 4  # 4 chunks: 4,4,4,3
    assert fused.chunk_rows(ROWS, VOCAB, chunk_elements=1) == 1
    assert fused.chunk_rows(ROWS, VOCAB) == ROWS  # fits: one chunk
    h, w, target, _ = _inputs()
    with pytest.raises(ValueError, match="chunk_tokens must be a positive"):
        linear_cross_entropy(h, w, target, chunk_tokens=0)


def test_only_the_last_chunk_of_logits_is_kept_for_backward():
    h, w, target, _ = _inputs(torch.float32)
    h.requires_grad_()
    losses = linear_cross_entropy(h, w, target, chunk_tokens=4)
    kept = [
        t
        for t in losses.grad_fn.next_functions[0][0].saved_tensors
        if t.dim() == 2 and t.shape[1] == VOCAB
    ]
    assert [tuple(t.shape) for t in kept] == [(ROWS - 12, VOCAB)]  # rows 12-14, not [15, 37]


def test_bf16_weight_gradient_summed_over_chunks_in_fp32():
    h, w, target, mask = _inputs(torch.bfloat16, rows=64, vocab=96, scale=1.0)
    one = _chunked(h, w, target, mask)
    several = _chunked(h, w, target, mask, chunk_tokens=10)
    exact = _plain(h.double(), w.double(), target, mask)
    assert several[0].dtype == torch.float32 and several[2].dtype == torch.bfloat16
    # The losses use the same bf16 logits per row: identical.
    assert torch.equal(one[0], several[0])
    # Gradients: one bf16 rounding of each chunk's part of the weight's gradient (summed in
    # fp32), of the same order as the one chunk's error against float64.
    for i, name in ((1, "grad hidden"), (2, "grad weight")):
        one_err = (one[i].double() - exact[i]).norm() / exact[i].norm()
        several_err = (several[i].double() - exact[i]).norm() / exact[i].norm()
        assert several_err <= 2 * one_err + 2**-8, name


# ----------------------------------------------------------------------------- TP = 2


def _tp_worker(rank, world_size):
    torch.set_num_threads(1)
    state = initialize_model_parallel(tensor_model_parallel_size=world_size)
    group = state.get_tensor_model_parallel_group()
    # The function over chunks that do not divide the tokens, vocab shards of 19 rows.
    h, w, target, mask = _inputs(vocab=38)
    expected = _plain(h, w, target, mask)
    shard = w.chunk(world_size)[rank]
    losses, grad_h, grad_shard = _chunked(h, shard, target, mask, tp_group=group, chunk_tokens=4)
    grad_h = C.all_reduce(grad_h.clone(), group)  # what copy_to_tensor_model_parallel_region does
    grad_w = torch.cat(list(C.all_gather_along_first_dim(grad_shard.unsqueeze(0), group)))
    for name, a, e in zip(
        ("losses", "grad hidden", "grad weight"), (losses, grad_h, grad_w), expected
    ):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-13, msg=f"function: {name}")

    # GPTModel with sequence parallelism, three chunks per micro-batch, against one process
    # without the fusion.
    # Vocab 64 (32 rows per rank): three chunks of 8 tokens per micro-batch of 2 x 12.
    fused.CHUNK_ELEMENTS = 8 * 32
    tokens, position_ids, labels = _batch(0)
    ref = tiny_gpt_model(tiny_transformer_config(), seed=5, vocab_size=64)
    ref_losses = ref(tokens, position_ids, None, labels=labels)
    ref_losses.sum().backward()
    config = tiny_transformer_config(
        cross_entropy_loss_fusion=True,
        tensor_model_parallel_size=world_size,
        sequence_parallel=True,
    )
    model = tiny_gpt_model(config, seed=5, vocab_size=64, pg_collection=state)
    losses = model(tokens, position_ids, None, labels=labels)
    losses.sum().backward()
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    allreduce_sequence_parallel_grads(model, group)
    ref_params = dict(ref.named_parameters())
    for name, param in model.named_parameters():
        grad = param.grad
        if getattr(param, "tensor_model_parallel", False):
            shards = C.all_gather_along_first_dim(grad.unsqueeze(0).contiguous(), group)
            grad = full_from_shards(list(shards), param.partition_dim, param.partition_stride)
        expected = ref_params[name].grad
        assert (grad - expected).norm() <= 1e-5 * expected.norm(), name
    destroy_model_parallel()


def test_chunks_over_vocab_shards_tp2_equal_one_process():
    run_distributed(_tp_worker, 2)


# ----------------------------------------------------------------------------- training


def _batch(step, b=2):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, TINY_VOCAB, (b, TINY_SEQ), generator=g)
    labels = torch.randint(0, TINY_VOCAB, (b, TINY_SEQ), generator=g)
    position_ids = torch.arange(TINY_SEQ).unsqueeze(0).expand(b, TINY_SEQ)
    return tokens, position_ids, labels


def _train(fusion, steps=4):
    model = tiny_gpt_model(tiny_transformer_config(cross_entropy_loss_fusion=fusion), seed=3)
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-3, weight_decay=0.1, clip_grad=1.0), [model])
    losses = []
    for step in range(steps):
        tokens, pos, labels = _batch(step)
        mask = torch.ones(labels.shape)
        mask[:, -3:] = 0.0  # a document ends three tokens before the sequence does
        opt.zero_grad()
        loss = (model(tokens, pos, None, labels=labels) * mask).sum() / mask.sum()
        opt.scale_loss(loss).backward()
        ok, _, _ = opt.step()
        assert ok
        losses.append(loss.item())
    return losses


def test_training_with_chunked_fusion_equals_plain_path(monkeypatch):
    # Five chunks of 5 tokens per micro-batch of 2 x 12 tokens.
    monkeypatch.setattr(fused, "CHUNK_ELEMENTS", 5 * TINY_VOCAB)
    plain, chunked = _train(False), _train(True)
    # Both compute the same fp32 sums in other orders (logsumexp per chunk, the weight's gradient
    # summed over chunks): a few fp32 roundings per step (2^-24 ~ 6e-8 relative), which four
    # AdamW steps at lr 1e-3 carry into the losses at ~1e-6; 2e-6 relative leaves room for it
    # and fails on any real difference (a dropped chunk or token moves the loss by > 1e-2).
    for step, (a, b) in enumerate(zip(chunked, plain)):
        assert abs(a - b) <= 2e-6 * abs(b), f"step {step}: {a} vs {b}"
