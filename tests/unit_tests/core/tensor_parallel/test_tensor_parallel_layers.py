"""Tensor-parallel layers and vocab-parallel cross entropy against their unsharded versions.

Each spawned gloo world (TP = 2 and TP = 4) builds a TP=1 reference layer and the TP=N layer
from the same seed and checks: the shards equal slices of the reference weights, and forward
outputs, input gradients and weight gradients equal the reference's (sliced where the parallel
layer holds a slice). Tolerance: ||parallel - reference|| / ||reference|| <= 1e-6 (fp32); only
the summation order differs.
"""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.parallel_state import initialize_model_parallel
from megatron.core.tensor_parallel import collectives as C
from megatron.core.tensor_parallel import mappings as M
from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.data import broadcast_data
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    full_from_shards,
    shard_of,
)
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.tiny_configs import tiny_transformer_config

RTOL = 1e-6


def close(actual, expected, what):
    err = (actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)
    assert err <= RTOL, f"{what}: relative error {err.item():.3e} > {RTOL}"


def config(tp, sp=False, **kw):
    return tiny_transformer_config(
        num_layers=1, hidden_size=16, tensor_model_parallel_size=tp, sequence_parallel=sp, **kw
    )


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _check_column(tp, rank, group, sp, gather_output, stride):
    s, b, hin, hout = 8, 3, 12, 16
    torch.manual_seed(5)
    ref = ColumnParallelLinear(
        hin,
        hout,
        config=config(1),
        init_method=lambda w: w.normal_(0, 0.3),
        gather_output=False,
        stride=stride,
    )
    with torch.no_grad():
        ref.bias.normal_()
    torch.manual_seed(5)
    par = ColumnParallelLinear(
        hin,
        hout,
        config=config(tp, sp),
        init_method=lambda w: w.normal_(0, 0.3),
        gather_output=gather_output,
        stride=stride,
        tp_group=group,
    )
    with torch.no_grad():
        par.bias.copy_(shard_of(ref.bias.detach(), 0, rank, tp, stride))
    assert torch.equal(par.weight, shard_of(ref.weight.detach(), 0, rank, tp, stride))
    assert par.weight.tensor_model_parallel and par.weight.partition_dim == 0
    assert par.weight.partition_stride == stride

    x = randn(s, b, hin, seed=1).requires_grad_()
    g = randn(s, b, hout, seed=2)
    out_ref, _ = ref(x)
    (out_ref * g).sum().backward()

    x_local = (x.detach().chunk(tp, 0)[rank] if sp else x.detach()).clone().requires_grad_()
    out, bias = par(x_local)
    assert bias is None
    g_local = g if gather_output else shard_of(g, 2, rank, tp, stride)
    close(
        out,
        out_ref.detach() if gather_output else shard_of(out_ref.detach(), 2, rank, tp, stride),
        f"column output sp={sp} gather={gather_output} stride={stride}",
    )
    (out * g_local).sum().backward()
    close(x_local.grad, x.grad.chunk(tp, 0)[rank] if sp else x.grad, "column input grad")
    close(par.weight.grad, shard_of(ref.weight.grad, 0, rank, tp, stride), "column weight grad")
    close(par.bias.grad, shard_of(ref.bias.grad, 0, rank, tp, stride), "column bias grad")
    # The shards gathered back give the full weight.
    shards = C.all_gather_along_first_dim(par.weight.detach().unsqueeze(0), group)
    assert torch.equal(full_from_shards(list(shards), 0, stride), ref.weight.detach())


def _check_row(tp, rank, group, sp, input_is_parallel):
    s, b, hin, hout = 8, 3, 16, 12
    torch.manual_seed(7)
    ref = RowParallelLinear(hin, hout, config=config(1), init_method=lambda w: w.normal_(0, 0.3))
    torch.manual_seed(7)
    par = RowParallelLinear(
        hin,
        hout,
        config=config(tp, sp),
        init_method=lambda w: w.normal_(0, 0.3),
        input_is_parallel=input_is_parallel,
        tp_group=group,
    )
    with torch.no_grad():
        ref.bias.normal_(generator=torch.Generator().manual_seed(3))
        par.bias.copy_(ref.bias)
    assert torch.equal(par.weight, shard_of(ref.weight.detach(), 1, rank, tp))
    assert par.bias.sequence_parallel is sp and not getattr(
        par.bias, "tensor_model_parallel", False
    )

    x = randn(s, b, hin, seed=11).requires_grad_()
    g = randn(s, b, hout, seed=12)
    out_ref, _ = ref(x)
    (out_ref * g).sum().backward()

    x_local = (
        shard_of(x.detach(), 2, rank, tp) if input_is_parallel else x.detach()
    ).requires_grad_()
    out, _ = par(x_local)
    g_local = g.chunk(tp, 0)[rank] if sp else g
    close(
        out, out_ref.detach().chunk(tp, 0)[rank] if sp else out_ref.detach(), f"row output sp={sp}"
    )
    (out * g_local).sum().backward()
    close(
        x_local.grad,
        shard_of(x.grad, 2, rank, tp) if input_is_parallel else x.grad,
        "row input grad",
    )
    close(par.weight.grad, shard_of(ref.weight.grad, 1, rank, tp), "row weight grad")
    bias_grad = par.bias.grad.clone()
    if sp:  # partial per rank: the trainer all-reduces grads marked sequence_parallel
        C.all_reduce(bias_grad, group)
    close(bias_grad, ref.bias.grad, "row bias grad")


def _check_embedding(tp, rank, group, reduce_scatter):
    vocab, h, s, b = 24, 8, 8, 2
    torch.manual_seed(9)
    ref = VocabParallelEmbedding(vocab, h, init_method=lambda w: w.normal_(), config=config(1))
    torch.manual_seed(9)
    par = VocabParallelEmbedding(
        vocab,
        h,
        init_method=lambda w: w.normal_(),
        config=config(tp, reduce_scatter),
        reduce_scatter_embeddings=reduce_scatter,
        tp_group=group,
    )
    assert torch.equal(par.weight, shard_of(ref.weight.detach(), 0, rank, tp))
    assert (par.vocab_start_index, par.vocab_end_index) == (
        rank * vocab // tp,
        (rank + 1) * vocab // tp,
    )
    ids = torch.randint(0, vocab, (s, b), generator=torch.Generator().manual_seed(4))
    ids[0, 0], ids[1, 0] = 0, vocab - 1  # both ends of the vocabulary
    g = randn(s, b, h, seed=6)
    out_ref = ref(ids)
    (out_ref * g).sum().backward()
    out = par(ids)
    g_local = g.chunk(tp, 0)[rank] if reduce_scatter else g
    close(
        out,
        out_ref.detach().chunk(tp, 0)[rank] if reduce_scatter else out_ref.detach(),
        "embedding output",
    )
    (out * g_local).sum().backward()
    close(par.weight.grad, shard_of(ref.weight.grad, 0, rank, tp), "embedding weight grad")


def _check_cross_entropy(tp, rank, group):
    s, b = 6, 3
    for vocab, true_vocab, smoothing in ((32, 32, 0.0), (64, 50, 0.0), (64, 50, 0.1)):
        logits = (randn(s, b, vocab, seed=21) * 4).requires_grad_()
        target = torch.randint(0, true_vocab, (s, b), generator=torch.Generator().manual_seed(22))
        g = randn(s, b, seed=23)
        # Megatron's smoothing e spreads e over the V - 1 other classes = torch's e * V / (V - 1).
        ref = F.cross_entropy(
            logits.reshape(-1, vocab),
            target.reshape(-1),
            reduction="none",
            label_smoothing=smoothing * vocab / (vocab - 1),
        ).view(s, b)
        (ref * g).sum().backward()
        local = shard_of(logits.detach(), 2, rank, tp).requires_grad_()
        loss = vocab_parallel_cross_entropy(
            local, target, label_smoothing=smoothing, tp_group=group
        )
        close(loss, ref.detach(), f"cross entropy V={vocab} smoothing={smoothing}")
        (loss * g).sum().backward()
        close(
            local.grad,
            shard_of(logits.grad, 2, rank, tp),
            f"cross entropy grad V={vocab} smoothing={smoothing}",
        )
    # Large logits stay finite (max subtraction).
    big = torch.full((2, 8 // tp), 1e4)
    assert torch.isfinite(
        vocab_parallel_cross_entropy(big, torch.tensor([0, 7]), tp_group=group)
    ).all()


def _check_mappings(tp, rank, group):
    x = randn(4 * tp, 2, 3 * tp, seed=31).requires_grad_()
    # gather(scatter(x)) is x along both dims and back-propagates ones
    y = M.gather_from_tensor_model_parallel_region(
        M.scatter_to_tensor_model_parallel_region(x, group), group
    )
    z = M.gather_from_sequence_parallel_region(
        M.scatter_to_sequence_parallel_region(y, group), group, tensor_parallel_output_grad=False
    )
    assert torch.equal(z, x)
    z.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
    # reduce_scatter then all-gather = all-reduce
    part = torch.full((2 * tp, 3), float(rank + 1))
    rs = M.reduce_scatter_to_sequence_parallel_region(part, group)
    assert torch.equal(rs, torch.full((2, 3), float(sum(range(1, tp + 1)))))
    # uneven all-gather
    mine = torch.full((rank + 1, 2), float(rank))
    got = C.all_gather_uneven(mine, group)
    assert [t.shape[0] for t in got] == list(range(1, tp + 1))
    assert all(torch.equal(t, torch.full((r + 1, 2), float(r))) for r, t in enumerate(got))


def _check_broadcast_data(rank, group):
    keys = ["tokens", "loss_mask", "attention_mask", "absent"]
    data = None
    if rank == 0:
        data = {
            "tokens": torch.arange(12).view(2, 6),
            "loss_mask": torch.ones(2, 6),
            "attention_mask": torch.ones(2, 1, 6, 6, dtype=torch.bool).triu(1),
            "absent": None,
        }
    got = broadcast_data(keys, data, group)
    assert torch.equal(got["tokens"], torch.arange(12).view(2, 6))
    assert got["loss_mask"].dtype == torch.float32 and got["loss_mask"].sum() == 12
    assert got["attention_mask"].dtype == torch.bool
    assert torch.equal(got["attention_mask"], torch.ones(2, 1, 6, 6, dtype=torch.bool).triu(1))
    assert got["absent"] is None


def _worker(rank, world_size):
    torch.set_num_threads(1)
    state = initialize_model_parallel(tensor_model_parallel_size=world_size)
    group = state.get_tensor_model_parallel_group()
    tp = world_size
    _check_mappings(tp, rank, group)
    for sp, gather_output, stride in (
        (False, False, 1),
        (False, True, 1),
        (True, False, 1),
        (False, False, 2),
        (True, False, 2),
    ):
        _check_column(tp, rank, group, sp, gather_output, stride)
    for sp, input_is_parallel in ((False, True), (False, False), (True, True)):
        _check_row(tp, rank, group, sp, input_is_parallel)
    for reduce_scatter in (False, True):
        _check_embedding(tp, rank, group, reduce_scatter)
    _check_cross_entropy(tp, rank, group)
    _check_broadcast_data(rank, group)


@pytest.mark.parametrize("tp", [2, 4])
def test_parallel_layers_match_unsharded(tp):
    run_distributed(_worker, tp)


def test_single_process_cross_entropy_and_errors():
    logits = randn(5, 11, seed=1).requires_grad_()
    target = torch.randint(0, 11, (5,), generator=torch.Generator().manual_seed(2))
    loss = vocab_parallel_cross_entropy(logits, target)
    ref = F.cross_entropy(logits, target, reduction="none")
    close(loss, ref.detach(), "single-process CE")
    with pytest.raises(ValueError, match="tensor-model-parallel-size"):
        ColumnParallelLinear(4, 4, config=config(2), init_method=torch.nn.init.zeros_)
    with pytest.raises(ValueError, match="does not match"):
        vocab_parallel_cross_entropy(logits, target[:3])
    assert torch.equal(
        shard_of(torch.arange(8.0), 0, 1, 2, stride=2), torch.tensor([2.0, 3.0, 6.0, 7.0])
    )
    assert torch.equal(
        full_from_shards([torch.tensor([0.0, 1, 4, 5]), torch.tensor([2.0, 3, 6, 7])], 0, 2),
        torch.arange(8.0),
    )
