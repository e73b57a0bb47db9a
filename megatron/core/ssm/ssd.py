"""Mamba-2's state-space-duality (SSD) scan, its short causal convolution and its gated RMSNorm,
in plain PyTorch: what runs on CPU, and on CUDA where the ``mamba_ssm`` / ``causal_conv1d``
kernels are not installed (:mod:`.optional_kernels` chooses).

The SSM of one head h with state size n, per time step t (``dt`` after softplus and bias)::

    state_t = exp(dt_t * A_h) * state_{t-1} + dt_t * x_t B_t^T      (state [p, n])
    y_t     = state_t C_t + D_h * x_t

:func:`ssd_chunked` computes it in chunks of ``chunk_size`` steps: inside a chunk as a masked
(quadratic) attention-like product, between chunks by carrying the states, which is exact (the
same sums in another order). :func:`ssd_recurrent` is the step-by-step recurrence: the reference
of the tests and the single-token decode of generation.
"""

from typing import Optional, Tuple

import torch
import torch.nn.functional as F


def _segment_sum(x: torch.Tensor) -> torch.Tensor:
    """[..., T] -> [..., T, T] with out[..., i, j] = sum(x[..., j+1 : i+1]) for j <= i and -inf
    above the diagonal (exp of it is the decay from step j to step i), summed without the
    cancellation of a difference of cumulative sums."""
    t = x.shape[-1]
    x = x[..., None].expand(*x.shape, t)
    below = torch.ones(t, t, dtype=torch.bool, device=x.device).tril(-1)
    x = x.masked_fill(~below, 0)
    sums = torch.cumsum(x, dim=-2)
    keep = torch.ones(t, t, dtype=torch.bool, device=x.device).tril(0)
    return sums.masked_fill(~keep, float("-inf"))


def _heads_of_groups(t: torch.Tensor, nheads: int) -> torch.Tensor:
    """[b, l, g, n] -> [b, l, h, n]: each group's B or C shared by its h/g consecutive heads."""
    return t.repeat_interleave(nheads // t.shape[2], dim=2)


def ssd_chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: Optional[torch.Tensor] = None,
    initial_state: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """x [b, l, h, p], dt [b, l, h] (positive), A [h] (negative), B and C [b, l, g, n], D [h] ->
    (y [b, l, h, p], final state [b, h, p, n]). Computed in x's dtype except the decays, which
    are in at least float32."""
    b, length, h, p = x.shape
    B, C = _heads_of_groups(B, h), _heads_of_groups(C, h)
    pad = (-length) % chunk_size
    if pad:
        # Padded steps have dt = 0: no decay and no input, so the final state is unchanged.
        x, dt = F.pad(x, (0, 0, 0, 0, 0, pad)), F.pad(dt, (0, 0, 0, pad))
        B, C = F.pad(B, (0, 0, 0, 0, 0, pad)), F.pad(C, (0, 0, 0, 0, 0, pad))
    nchunks = (length + pad) // chunk_size
    decay_dtype = torch.promote_types(x.dtype, torch.float32)

    def chunks(t):
        return t.reshape(b, nchunks, chunk_size, *t.shape[2:])

    xs = chunks(x * dt.unsqueeze(-1).to(x.dtype))  # [b, c, q, h, p]: the discretized input
    Bs, Cs = chunks(B), chunks(C)  # [b, c, q, h, n]
    a = chunks(dt.to(decay_dtype) * A.to(decay_dtype)).permute(0, 3, 1, 2)  # [b, h, c, q]
    a_cum = torch.cumsum(a, dim=-1)

    # Within each chunk: y_i = sum_{j <= i} (C_i . B_j) decay(j -> i) x_j.
    decay_in = torch.exp(_segment_sum(a)).to(x.dtype)  # [b, h, c, q, q]
    y = torch.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", Cs, Bs, decay_in, xs)

    # Each chunk's own end state, then the states carried into each chunk.
    decay_to_end = torch.exp(a_cum[..., -1:] - a_cum).to(x.dtype)  # [b, h, c, q]
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", Bs, decay_to_end, xs)
    if initial_state is None:
        initial_state = torch.zeros_like(states[:, :1])
    else:
        initial_state = initial_state.unsqueeze(1).to(states.dtype)
    states = torch.cat([initial_state, states], dim=1)  # [b, c + 1, h, p, n]
    decay_chunks = torch.exp(_segment_sum(F.pad(a_cum[..., -1], (1, 0)))).to(x.dtype)
    states = torch.einsum("bhzc,bchpn->bzhpn", decay_chunks, states)
    states, final_state = states[:, :-1], states[:, -1]

    # What the state entering each chunk contributes to its outputs.
    decay_from_start = torch.exp(a_cum).to(x.dtype)  # [b, h, c, q]
    y = y + torch.einsum("bclhn,bchpn,bhcl->bclhp", Cs, states, decay_from_start)
    y = y.reshape(b, nchunks * chunk_size, h, p)[:, :length]
    if D is not None:
        y = y + x[:, :length] * D.to(x.dtype)[:, None]
    return y, final_state


def ssd_recurrent(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: Optional[torch.Tensor] = None,
    initial_state: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The same SSM one step at a time (shapes as :func:`ssd_chunked`)."""
    b, length, h, p = x.shape
    B, C = _heads_of_groups(B, h), _heads_of_groups(C, h)
    state = (
        torch.zeros(b, h, p, B.shape[-1], dtype=x.dtype, device=x.device)
        if initial_state is None
        else initial_state.to(x.dtype)
    )
    ys = []
    for t in range(length):
        decay = torch.exp(dt[:, t] * A).to(x.dtype)  # [b, h]
        inp = (dt[:, t].to(x.dtype)[..., None] * x[:, t])[..., None] * B[:, t, :, None, :]
        state = decay[..., None, None] * state + inp
        y = torch.einsum("bhpn,bhn->bhp", state, C[:, t])
        if D is not None:
            y = y + x[:, t] * D.to(x.dtype)[:, None]
        ys.append(y)
    return torch.stack(ys, dim=1), state


def causal_depthwise_conv1d(
    xbc: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    history: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Depthwise causal convolution of [b, d, l] with weight [d, 1, k]: output step t sees
    inputs t-k+1 .. t. ``history`` [b, d, k-1]: the inputs before the first (zeros if None)."""
    k = weight.shape[-1]
    if history is None:
        padded = F.pad(xbc, (k - 1, 0))
    else:
        padded = torch.cat([history.to(xbc.dtype), xbc], dim=-1)
    return F.conv1d(padded, weight, bias, groups=weight.shape[0])


def gated_rms_norm(
    y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float
) -> torch.Tensor:
    """Mamba-2's output norm (norm after the gate): RMSNorm(y * silu(z)) over groups of
    ``group_size`` channels of the last dimension, times ``weight``; computed in float32."""
    dtype = y.dtype
    g = (y.float() * F.silu(z.float())).unflatten(-1, (-1, group_size))
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return (g.flatten(-2) * weight.float()).to(dtype)
