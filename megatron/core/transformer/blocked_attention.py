"""Unfused attention softmax(q k^T * scale + mask) v from batched GEMMs, in blocks of query rows.

This is the "unfused" attention of Megatron (``--attention-backend unfused`` / ``local``): the
scores are materialised, softmaxed and kept for backward, so the backward needs no recomputation.
Two things make it faster than torch's fused CPU kernel at the short sequences CPU runs use (a
forward + backward measured 1.15-1.65x faster at seq 256-1024, head dim 64, fp32, 1-2 threads;
``benchmarks/attention_cpu.py``):

- every product is one ``bmm`` over all (batch, head) pairs, MKL's best case;
- with a causal mask the query rows go in blocks of ``block_rows``: block [r0, r1) only meets
  keys [0, r1), so the fully masked upper-right part of the score matrix is neither computed
  nor stored (3/4 of the GEMM work at two blocks, about 1/2 at many).

The price is memory: the saved probabilities are (batch * heads * seq^2 / 2) elements per layer
instead of flash attention's O(seq). The caller decides when that is worth it
(``DotProductAttention``: ``auto`` uses this path on CPU up to a sequence length).

Dropout is Megatron's attention dropout on the probabilities: each block draws its keep mask
from the current CPU/CUDA generator (the caller forks the model-parallel stream under TP), keeps
it (one byte per probability) for backward, and scales the kept probabilities by 1 / (1 - p).

Half precision follows Megatron's unfused attention (``FusedScaleMaskSoftmax``): the score GEMM
runs in the input dtype (fp16/bf16), the softmax in ``softmax_dtype`` (fp32 with
``--attention-softmax-in-fp32``, else the input dtype), and the probabilities are cast back to
the input dtype for dropout and the GEMM with the values. ``softmax_rescale`` is the
``--apply-query-key-layer-scaling`` coefficient (the layer number): the GEMM scales by
``scale`` (already divided by it) so that fp16 scores stay finite, and the fp32 scores are
multiplied back by it before the softmax.

Layouts are Megatron's: q [s, b, heads, d], k, v [sk, b, groups, d] (any strides), output
[s, b, heads * d]. With grouped-query attention (groups < heads) query head j reads key/value
group j // (heads / groups), Megatron's grouping: keys and values are repeated per head before
the products (autograd sums their gradients back per group). There is no explicit mask.
"""

import torch

DEFAULT_BLOCK_ROWS = 128
"""Query rows per causal block: measured best at head dim 64 on CPU."""


def _batched_heads(x: torch.Tensor) -> torch.Tensor:
    """[s, b, n, d] -> [b * n, s, d] (a view when the strides allow it, as for the QKV split)."""
    s, b, n, d = x.shape
    return x.permute(1, 2, 0, 3).reshape(b * n, s, d)


def _row_blocks(seq: int, key_seq: int, block_rows: int, causal: bool):
    """(first row, end row, end key) of each query block."""
    if not causal:
        return [(0, seq, key_seq)]
    return [
        (r0, min(r0 + block_rows, seq), min(r0 + block_rows, seq))
        for r0 in range(0, seq, block_rows)
    ]


def _block_mask(rows: int, keys: int, like: torch.Tensor) -> torch.Tensor:
    """Additive mask [rows, keys] of a causal block whose last ``rows`` keys are its diagonal."""
    mask = torch.zeros(rows, keys, dtype=like.dtype, device=like.device)
    mask[:, keys - rows :] = torch.full(
        (rows, rows), float("-inf"), dtype=like.dtype, device=like.device
    ).triu_(1)
    return mask


def _dropout_keep(probs: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """Bool mask of the probabilities that survive dropout, drawn from the current generator."""
    return torch.rand_like(probs) >= dropout_p


def _dropped(probs: torch.Tensor, keep: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """The probabilities after dropout (recomputed in backward instead of kept)."""
    return torch.mul(probs, keep).mul_(1.0 / (1.0 - dropout_p))


class BlockedAttentionFunction(torch.autograd.Function):
    """out = dropout(softmax(q k^T * scale [+ causal mask])) v, probabilities (and dropout keep
    masks) saved per query block."""

    @staticmethod
    def forward(
        ctx,
        query,
        key,
        value,
        scale: float,
        causal: bool,
        block_rows: int,
        dropout_p: float,
        softmax_dtype: torch.dtype,
        softmax_rescale: float,
    ):
        s, b, n, d = query.shape
        q, k, v = _batched_heads(query), _batched_heads(key), _batched_heads(value)
        out = torch.empty(s, b, n, d, dtype=query.dtype, device=query.device)
        blocks = _row_blocks(s, key.shape[0], block_rows, causal)
        probs, keeps = [], []
        for r0, r1, keys in blocks:
            rows = r1 - r0
            if causal:
                scores = torch.baddbmm(
                    _block_mask(rows, keys, query),
                    q[:, r0:r1],
                    k[:, :keys].transpose(1, 2),
                    alpha=scale,
                )
            else:
                scores = torch.bmm(q[:, r0:r1], k.transpose(1, 2)).mul_(scale)
            if scores.dtype != softmax_dtype:
                scores = scores.to(softmax_dtype)
            if softmax_rescale != 1.0:
                scores.mul_(softmax_rescale)
            p = torch.softmax(scores, dim=-1)
            used = p if p.dtype == query.dtype else p.to(query.dtype)
            if dropout_p > 0.0:
                keeps.append(_dropout_keep(used, dropout_p))
                used = _dropped(used, keeps[-1], dropout_p)
            # bmm writes a fresh [b*n, rows, d]; one copy puts it in the output's [s, b, n, d].
            # (bmm or baddbmm_ into a strided slice falls back to one GEMM per batch entry.)
            out[r0:r1] = torch.bmm(used, v[:, :keys]).view(b, n, rows, d).permute(2, 0, 1, 3)
            probs.append(p)
        ctx.save_for_backward(q, k, v, *probs, *keeps)
        ctx.blocks, ctx.scale, ctx.shape, ctx.dropout_p = blocks, scale, (s, b, n, d), dropout_p
        ctx.softmax_rescale = softmax_rescale
        return out.view(s, b, n * d)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, *saved = ctx.saved_tensors
        probs, keeps = (
            saved[: len(ctx.blocks)],
            saved[len(ctx.blocks) :] or [None] * len(ctx.blocks),
        )
        s, b, n, d = ctx.shape
        g = _batched_heads(grad_out.reshape(s, b, n, d))
        grad_q_blocks = []
        grad_k = grad_v = None
        # The last block meets every key: its products are dK/dV, earlier blocks add to a prefix.
        for (r0, r1, keys), p, keep in reversed(list(zip(ctx.blocks, probs, keeps))):
            g_rows = g[:, r0:r1]
            used = p if p.dtype == q.dtype else p.to(q.dtype)
            if keep is not None:
                used = _dropped(used, keep, ctx.dropout_p)
            grad_v_part = torch.bmm(used.transpose(1, 2), g_rows)
            grad_p = torch.bmm(g_rows, v[:, :keys].transpose(1, 2))
            if keep is not None:
                grad_p = _dropped(grad_p, keep, ctx.dropout_p)
            if grad_p.dtype != p.dtype:
                grad_p = grad_p.to(p.dtype)
            grad_scores = torch._softmax_backward_data(grad_p, p, -1, p.dtype)
            if ctx.softmax_rescale != 1.0:
                grad_scores.mul_(ctx.softmax_rescale)
            if grad_scores.dtype != q.dtype:
                grad_scores = grad_scores.to(q.dtype)
            grad_q_blocks.append(torch.bmm(grad_scores, k[:, :keys]))
            grad_k_part = torch.bmm(grad_scores.transpose(1, 2), q[:, r0:r1])
            if grad_k is None:
                grad_k, grad_v = grad_k_part, grad_v_part
            else:
                grad_k[:, :keys] += grad_k_part
                grad_v[:, :keys] += grad_v_part
        grad_q = (
            grad_q_blocks[0] if len(grad_q_blocks) == 1 else torch.cat(grad_q_blocks[::-1], dim=1)
        )
        grad_q.mul_(ctx.scale)
        grad_k.mul_(ctx.scale)

        def to_layout(x):  # [b * n, s, d] -> [s, b, n, d] view
            return x.view(b, n, x.shape[1], d).permute(2, 0, 1, 3)

        return (
            to_layout(grad_q),
            to_layout(grad_k),
            to_layout(grad_v),
            *([None] * 6),
        )


def _repeat_groups(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[s, b, groups, d] -> [s, b, heads, d], group g serving heads g * heads/groups onwards."""
    s, b, groups, d = x.shape
    return x.unsqueeze(3).expand(s, b, groups, heads // groups, d).reshape(s, b, heads, d)


def blocked_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    causal: bool,
    block_rows: int = DEFAULT_BLOCK_ROWS,
    dropout_p: float = 0.0,
    softmax_in_fp32: bool = True,
    softmax_rescale: float = 1.0,
) -> torch.Tensor:
    """Attention of query [s, b, heads, d], key/value [sk, b, groups, d] -> [s, b, heads * d].

    ``causal``: position i attends to keys 0..i (needs equal query and key lengths); otherwise
    every query attends to every key. ``block_rows``: query rows per causal block.
    ``dropout_p``: attention dropout on the probabilities (pass 0
    outside training). ``softmax_in_fp32``: with fp16/bf16 inputs, upcast the scores and run
    the softmax in fp32 (otherwise in the input dtype; fp32/fp64 inputs keep their dtype).
    ``softmax_rescale``: multiply the upcast scores by this before the softmax (the
    query-key layer scaling coefficient; ``scale`` must already be divided by it). It needs an
    fp32 softmax for half inputs (Megatron's fused softmax also refuses a scale without an fp32
    softmax).
    """
    if (
        query.dim() != 4
        or key.shape != value.shape
        or key.dim() != 4
        or query.shape[1] != key.shape[1]
        or query.shape[3] != key.shape[3]
        or query.shape[2] % key.shape[2] != 0
    ):
        raise ValueError(
            f"blocked attention needs q [s, b, n, d] and k, v [sk, b, g, d] with the same b "
            f"and d and g dividing n; got {tuple(query.shape)}, {tuple(key.shape)}, "
            f"{tuple(value.shape)}"
        )
    if causal and key.shape[0] != query.shape[0]:
        raise ValueError(
            f"causal attention needs equal query and key lengths, got {query.shape[0]} "
            f"and {key.shape[0]}"
        )
    if block_rows < 1:
        raise ValueError(f"block_rows must be positive, got {block_rows}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    half = query.dtype in (torch.float16, torch.bfloat16)
    if softmax_rescale != 1.0 and half and not softmax_in_fp32:
        raise ValueError(
            "query-key layer scaling (softmax_rescale) needs the softmax in fp32 with "
            f"{query.dtype} inputs (--apply-query-key-layer-scaling implies "
            "--attention-softmax-in-fp32)"
        )
    softmax_dtype = torch.float32 if half and softmax_in_fp32 else query.dtype
    if key.shape[2] != query.shape[2]:
        key, value = _repeat_groups(key, query.shape[2]), _repeat_groups(value, query.shape[2])
    return BlockedAttentionFunction.apply(
        query,
        key,
        value,
        float(scale),
        bool(causal),
        int(block_rows),
        float(dropout_p),
        softmax_dtype,
        float(softmax_rescale),
    )
