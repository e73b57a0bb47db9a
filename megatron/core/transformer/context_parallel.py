"""Context parallelism: the sequence split across CP ranks, and causal ring attention.

Load-balanced layout (Megatron's): the sequence is cut into 2·CP equal chunks and CP rank r keeps
chunks r and 2·CP−1−r, so every rank does the same amount of causal attention work. Tensors on a
rank are the concatenation [chunk r; chunk 2·CP−1−r] along the sequence.

Ring attention (``cp_comm_type`` 'p2p'): keys/values travel around the CP ring; at step i a rank
holds the K/V of rank (r − i) mod CP and attends its queries to it. Because of the layout only
three block shapes occur:

* step 0 (own K/V): causal attention of both local chunks to both (local order is global order);
* K/V from a lower rank: both query chunks attend, unmasked, to that rank's first chunk only
  (its second chunk lies after all local queries);
* K/V from a higher rank: only the second query chunk attends, unmasked, to both chunks.

Each block gives partial outputs and their log-sum-exp; blocks are merged exactly with
out = Σ_k out_k · exp(lse_k − lse), lse = logaddexp over blocks. The ring transfer is an autograd
function (its backward sends gradients the other way round the ring), so backward is autograd's.
Pure torch.distributed point-to-point: no CUDA-only kernel, runs on gloo.
"""

from typing import Dict, Optional

import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel import collectives as C


def cp_chunk_indices(local_len: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Global sequence positions of the ``local_len`` tokens held by ``cp_rank``."""
    if local_len % 2 != 0:
        raise ValueError(
            f"context parallelism needs an even local sequence length, got {local_len}"
        )
    chunk = local_len // 2
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    second_start = (2 * cp_size - 1 - cp_rank) * chunk
    second = torch.arange(second_start, second_start + chunk, device=device)
    return torch.cat([first, second])


def get_batch_on_this_cp_rank(
    batch: Dict[str, Optional[torch.Tensor]], cp_size: int, cp_rank: int
) -> Dict[str, Optional[torch.Tensor]]:
    """Keep this CP rank's two sequence chunks of every tensor in ``batch``.

    Tensors are [b, s] (tokens, labels, loss_mask, position_ids) or, for ``attention_mask``,
    [b, 1, s, s] (the query dimension, dim 2, is sliced; Megatron also cuts the mask along dim 2).
    None values pass through.
    """
    if cp_size == 1:
        return batch
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is outside [0, {cp_size})")
    out = {}
    for key, value in batch.items():
        if value is None:
            out[key] = None
            continue
        seq_dim = 2 if key == "attention_mask" else 1
        s = value.shape[seq_dim]
        if s % (2 * cp_size) != 0:
            raise ValueError(
                f"sequence length {s} of '{key}' must be divisible by "
                f"2 x context-parallel size = {2 * cp_size} "
                f"(--seq-length must be a multiple of 2 * --context-parallel-size)"
            )
        chunked = value.view(
            *value.shape[:seq_dim], 2 * cp_size, s // (2 * cp_size), *value.shape[seq_dim + 1 :]
        )
        index = torch.tensor([cp_rank, 2 * cp_size - 1 - cp_rank], device=value.device)
        picked = chunked.index_select(seq_dim, index)
        out[key] = picked.reshape(*value.shape[:seq_dim], s // cp_size, *value.shape[seq_dim + 1 :])
    return out


class _RingShift(torch.autograd.Function):
    """Forward: send to the next CP rank, receive from the previous one. Backward: the reverse."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group):
        ctx.group = group
        return C.ring_exchange(x, group, shift=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return C.ring_exchange(grad.contiguous(), ctx.group, shift=-1), None


def _block(q, k, v, scale, causal, dropout_p, training):
    """Attention of q [b, h, sq, d] to k, v [b, h, sk, d]; returns (out fp32, lse fp32 [b, h,
    sq])."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        mask = torch.ones(
            scores.shape[-2], scores.shape[-1], dtype=torch.bool, device=scores.device
        ).triu_(1)
        scores = scores.masked_fill(mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    if training and dropout_p > 0.0:
        # Dropout on the normalized probabilities is elementwise, so applying it per block and
        # rescaling the blocks gives the same distribution as dropout on the full softmax.
        probs = F.dropout(probs, p=dropout_p, training=True)
    return torch.matmul(probs, v.float()), lse


def _merge(out, lse, block_out, block_lse):
    if out is None:
        return block_out, block_lse
    new_lse = torch.logaddexp(lse, block_lse)
    out = out * torch.exp(lse - new_lse).unsqueeze(-1) + block_out * torch.exp(
        block_lse - new_lse
    ).unsqueeze(-1)
    return out, new_lse


def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cp_group,
    softmax_scale: float,
    dropout_p: float = 0.0,
    training: bool = False,
) -> torch.Tensor:
    """Causal attention over a sequence split across ``cp_group`` in the load-balanced layout.

    query [s_local, b, np, d], key/value [s_local, b, ng, d] (np a multiple of ng: query head j
    reads group j // (np/ng)) -> context [s_local, b, np * d] in the query's dtype.
    """
    cp_size, cp_rank = C.group_size(cp_group), C.group_rank(cp_group)
    s_local, b, np_, _ = query.shape
    if s_local % 2 != 0:
        raise ValueError(f"ring attention needs an even local sequence length, got {s_local}")
    half = s_local // 2
    heads_per_group = np_ // key.shape[2]
    dv = value.shape[-1]
    width = max(dv, key.shape[-1])
    if dv != key.shape[-1]:
        # Keys and values of different widths (multi-latent attention) travel zero-padded to
        # one width in the one ring buffer: zero query/key dims add nothing to the scores, and
        # the zero value dims' outputs are cut off below.
        query, key, value = (F.pad(t, (0, width - t.shape[-1])) for t in (query, key, value))
    q = query.permute(1, 2, 0, 3)  # [b, np, s, d]
    q_second = q[:, :, half:]
    kv = torch.stack([key, value]).permute(0, 2, 3, 1, 4)  # [2, b, ng, s, d]

    out_first = lse_first = out_second = lse_second = None
    for step in range(cp_size):
        if step > 0:
            kv = _RingShift.apply(kv.contiguous(), cp_group)
        k, v = kv[0], kv[1]
        if heads_per_group > 1:
            k = k.repeat_interleave(heads_per_group, dim=1)
            v = v.repeat_interleave(heads_per_group, dim=1)
        src = (cp_rank - step) % cp_size
        if step == 0:
            o, lse = _block(q, k, v, softmax_scale, True, dropout_p, training)
            out_first, lse_first = o[:, :, :half], lse[:, :, :half]
            out_second, lse_second = o[:, :, half:], lse[:, :, half:]
        elif src < cp_rank:
            o, lse = _block(
                q, k[:, :, :half], v[:, :, :half], softmax_scale, False, dropout_p, training
            )
            out_first, lse_first = _merge(out_first, lse_first, o[:, :, :half], lse[:, :, :half])
            out_second, lse_second = _merge(
                out_second, lse_second, o[:, :, half:], lse[:, :, half:]
            )
        else:
            o, lse = _block(q_second, k, v, softmax_scale, False, dropout_p, training)
            out_second, lse_second = _merge(out_second, lse_second, o, lse)
    context = torch.cat([out_first, out_second], dim=2)[..., :dv].to(query.dtype)  # [b,np,s,dv]
    return context.permute(2, 0, 1, 3).reshape(s_local, b, np_ * dv)
