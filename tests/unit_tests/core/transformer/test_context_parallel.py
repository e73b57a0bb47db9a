"""Context parallelism: the load-balanced sequence split and causal ring attention.

Ring attention at CP = 4 (every block shape and three ring steps) is compared with SDPA over the
whole sequence: outputs and query/key/value gradients within 1e-5 relative (fp32), with GQA.
"""

import torch
import torch.nn.functional as F

from megatron.core.parallel_state import initialize_model_parallel
from megatron.core.transformer.context_parallel import (
    cp_chunk_indices,
    get_batch_on_this_cp_rank,
    ring_attention,
)
from tests.unit_tests.dist_utils import run_distributed

RTOL = 1e-5


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_chunks_are_load_balanced_and_cover_the_sequence():
    s, cp = 16, 4
    seen = []
    for r in range(cp):
        idx = cp_chunk_indices(s // cp, cp, r)
        assert idx.tolist() == [2 * r, 2 * r + 1, 14 - 2 * r, 15 - 2 * r]
        seen += idx.tolist()
    assert sorted(seen) == list(range(s))
    batch = {
        "tokens": torch.arange(32).view(2, 16),
        "attention_mask": torch.zeros(2, 1, 16, 16, dtype=torch.bool),
        "loss_mask": None,
    }
    part = get_batch_on_this_cp_rank(batch, cp, 1)
    assert part["tokens"].tolist() == [[2, 3, 12, 13], [18, 19, 28, 29]]
    assert part["attention_mask"].shape == (2, 1, 4, 16) and part["loss_mask"] is None
    assert get_batch_on_this_cp_rank(batch, 1, 0) is batch


def _worker(rank, world_size):
    torch.set_num_threads(1)
    state = initialize_model_parallel(context_parallel_size=world_size)
    group = state.get_context_parallel_group()
    s, b, heads, groups, d = 16, 2, 4, 2, 8
    g = torch.Generator().manual_seed(3)
    q, k, v, grad_out = (
        torch.randn(s, b, n, d, generator=g) for n in (heads, groups, groups, heads)
    )
    grad_out = grad_out.reshape(s, b, heads * d)
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(
        qf.permute(1, 2, 0, 3),
        kf.permute(1, 2, 0, 3),
        vf.permute(1, 2, 0, 3),
        is_causal=True,
        enable_gqa=True,
    )
    ref = ref.permute(2, 0, 1, 3).reshape(s, b, heads * d)
    (ref * grad_out).sum().backward()

    idx = cp_chunk_indices(s // world_size, world_size, rank)
    ql, kl, vl = (t.index_select(0, idx).clone().requires_grad_() for t in (q, k, v))
    out = ring_attention(ql, kl, vl, group, softmax_scale=d**-0.5)
    assert rel_err(out, ref.detach().index_select(0, idx)) <= RTOL
    (out * grad_out.index_select(0, idx)).sum().backward()
    for local, full, name in ((ql, qf, "q"), (kl, kf, "k"), (vl, vf, "v")):
        err = rel_err(local.grad, full.grad.index_select(0, idx))
        assert err <= RTOL, f"rank {rank}: grad of {name} relative error {err:.2e}"


def test_ring_attention_cp4_matches_full_causal_attention():
    run_distributed(_worker, 4)
