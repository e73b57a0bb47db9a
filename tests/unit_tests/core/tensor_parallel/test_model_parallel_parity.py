"""GPT under tensor, sequence and context parallelism equals the single-process model.

In each spawned gloo world every rank builds the single-process reference model (no groups) and
the parallel model from the same seed, runs the same batch through both and checks:

* the parallel model's weights are exactly the reference's shards (CPU master-weight init);
* the mean per-token loss equals the reference's (CP: summed over CP ranks);
* every parameter's gradient, gathered back to full shape (TP shards concatenated, sequence-
  parallel grads all-reduced over TP, CP contributions summed over CP), equals the reference's.

Tolerance: ||parallel - reference|| / ||reference|| <= 1e-5 (fp32).
"""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.parallel_state import destroy_model_parallel, initialize_model_parallel
from megatron.core.tensor_parallel import allreduce_sequence_parallel_grads
from megatron.core.tensor_parallel import collectives as C
from megatron.core.tensor_parallel.layers import full_from_shards, shard_of
from megatron.core.transformer.context_parallel import get_batch_on_this_cp_rank
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.tiny_configs import tiny_gpt_model, tiny_transformer_config

RTOL = 1e-5
VOCAB = 64  # padded vocabulary (divisible by TP); labels only use the first TRUE_VOCAB ids
TRUE_VOCAB = 50
SEQ = 16
BATCH = 2

ARCHS = {
    # learned positions, LayerNorm, GeLU, biases, tied embedding/output
    "gpt": (
        dict(num_attention_heads=4),
        dict(position_embedding_type="learned_absolute", share_embeddings_and_output_weights=True),
    ),
    # RoPE, RMSNorm, SwiGLU, GQA (2 groups), no biases, untied output layer
    "llama": (
        dict(
            num_attention_heads=4,
            num_query_groups=2,
            normalization="RMSNorm",
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
        ),
        dict(position_embedding_type="rope", share_embeddings_and_output_weights=False),
    ),
    # GQA with 4 groups over 8 heads: one group per rank at TP=4
    "gqa8": (
        dict(
            num_attention_heads=8,
            num_query_groups=4,
            normalization="RMSNorm",
            gated_linear_unit=True,
            activation_func=F.silu,
        ),
        dict(position_embedding_type="rope", share_embeddings_and_output_weights=True),
    ),
}


def build(arch, tp=1, cp=1, sp=False, pg_collection=None):
    cfg_kwargs, model_kwargs = ARCHS[arch]
    config = tiny_transformer_config(
        ffn_hidden_size=64,
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
        sequence_parallel=sp,
        **cfg_kwargs,
    )
    return tiny_gpt_model(
        config,
        seed=1234,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pg_collection=pg_collection,
        **model_kwargs,
    )


def make_batch():
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, TRUE_VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, TRUE_VOCAB, (BATCH, SEQ), generator=g)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ).contiguous()
    return {"tokens": tokens, "labels": labels, "position_ids": position_ids}


def rel_err(actual, expected):
    return (
        (actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)
    ).item()


def _full_param(param, tp_group):
    if not getattr(param, "tensor_model_parallel", False):
        return param
    shards = C.all_gather_along_first_dim(param.detach().unsqueeze(0).contiguous(), tp_group)
    return full_from_shards(list(shards), param.partition_dim, param.partition_stride)


def check_parity(arch, tp, cp, sp):
    state = initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    tp_group, cp_group = state.get_tensor_model_parallel_group(), state.get_context_parallel_group()
    tp_rank, cp_rank = state.get_tensor_model_parallel_rank(), state.get_context_parallel_rank()
    tag = f"{arch} tp={tp} cp={cp} sp={sp}"

    batch = make_batch()
    num_tokens = batch["labels"].numel()
    ref = build(arch)
    ref_losses = ref(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    ref_loss = ref_losses.sum() / num_tokens
    ref_loss.backward()
    ref_logits = ref(batch["tokens"], batch["position_ids"], None).detach()

    model = build(arch, tp, cp, sp, pg_collection=state)
    ref_params = dict(ref.named_parameters())
    assert sorted(ref_params) == sorted(n for n, _ in model.named_parameters()), tag
    for name, param in model.named_parameters():
        if getattr(param, "tensor_model_parallel", False):
            expected = shard_of(
                ref_params[name].detach(), param.partition_dim, tp_rank, tp, param.partition_stride
            )
        else:
            expected = ref_params[name].detach()
        assert torch.equal(param.detach(), expected), f"{tag}: initial shard of {name}"

    local = get_batch_on_this_cp_rank(batch, cp, cp_rank)
    losses = model(local["tokens"], local["position_ids"], None, labels=local["labels"])
    loss_sum = losses.sum()
    (loss_sum / num_tokens).backward()
    total = C.all_reduce(loss_sum.detach().clone(), cp_group)
    assert rel_err(total / num_tokens, ref_loss.detach()) <= RTOL, (
        f"{tag}: loss {total / num_tokens} vs {ref_loss}"
    )

    if cp == 1:  # logits: this rank's vocab slice
        logits = model(local["tokens"], local["position_ids"], None).detach()
        assert logits.shape == (BATCH, SEQ, VOCAB // tp), tag
        err = rel_err(logits, shard_of(ref_logits, 2, tp_rank, tp))
        assert err <= RTOL, f"{tag}: logits error {err:.2e}"

    reduced = allreduce_sequence_parallel_grads(model, tp_group)
    assert (reduced > 0) == (sp and tp > 1), tag
    for name, param in model.named_parameters():
        assert param.grad is not None, f"{tag}: no grad for {name}"
        grad = C.all_reduce(param.grad.clone(), cp_group)
        if getattr(param, "tensor_model_parallel", False):
            shards = C.all_gather_along_first_dim(grad.unsqueeze(0).contiguous(), tp_group)
            grad = full_from_shards(list(shards), param.partition_dim, param.partition_stride)
        err = rel_err(grad, ref_params[name].grad)
        assert err <= RTOL, f"{tag}: grad of {name} relative error {err:.2e}"
    destroy_model_parallel()


def _worker(rank, world_size, cases):
    torch.set_num_threads(1)
    for case in cases:
        check_parity(*case)


def test_tp2_sp_and_cp2_match_single_process():
    cases = [
        ("gpt", 2, 1, False),
        ("llama", 2, 1, False),
        ("gpt", 2, 1, True),
        ("llama", 2, 1, True),
        ("gpt", 1, 2, False),
        ("llama", 1, 2, False),
    ]
    run_distributed(_worker, 2, cases)


def test_tp4_gqa_and_cp2_tp2_match_single_process():
    cases = [
        ("gqa8", 4, 1, False),
        ("gqa8", 4, 1, True),
        ("llama", 2, 2, False),
        ("gpt", 2, 2, True),
    ]
    run_distributed(_worker, 4, cases)


def test_bad_layouts_have_clear_messages():
    with pytest.raises(ValueError, match="num-attention-heads.*tensor-model-parallel-size"):
        TransformerConfig(
            num_layers=1, hidden_size=24, num_attention_heads=3, tensor_model_parallel_size=2
        )
    with pytest.raises(ValueError, match="num-query-groups.*tensor-model-parallel-size"):
        TransformerConfig(
            num_layers=1,
            hidden_size=32,
            num_attention_heads=4,
            num_query_groups=1,
            tensor_model_parallel_size=2,
        )
    with pytest.raises(ValueError, match="tensor-model-parallel-size"):
        build("gpt", tp=2)  # a TP=2 config without a TP group never runs unsplit
    with pytest.raises(ValueError, match="context-parallel-size"):
        build("gpt", cp=2)
    with pytest.raises(ValueError, match="2 \\* --context-parallel-size"):
        get_batch_on_this_cp_rank(make_batch(), 3, 0)
