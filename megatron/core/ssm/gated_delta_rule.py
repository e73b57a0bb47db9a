"""The gated delta rule (Gated DeltaNet, the linear attention of Qwen3-Next and of Megatron's
``gated_delta_net`` variant) in plain PyTorch: the scan of :mod:`.gated_delta_net`'s layer.

Per head, with key size dk and value size dv, a state S [dk, dv] and per step t a decay
``g_t`` (log space, <= 0) and a write strength ``beta_t`` in (0, 1)::

    S_t = exp(g_t) S_{t-1}
    S_t = S_t + k_t (beta_t (v_t - S_t^T k_t))^T       (the delta rule: write the error)
    o_t = S_t^T q_t

:func:`gated_delta_rule_chunked` computes it in chunks of ``chunk_size`` steps (the WY form:
inside a chunk the writes are solved as one unit-lower-triangular system, between chunks the
state is carried), :func:`gated_delta_rule_recurrent` step by step (the reference and the
decode step).
"""

from typing import Optional, Tuple

import torch
import torch.nn.functional as F


def gated_delta_rule_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """q, k [b, l, h, dk], v [b, l, h, dv], g and beta [b, l, h] -> (o [b, l, h, dv], final
    state [b, h, dk, dv])."""
    b, length, h, dk = k.shape
    state = (
        q.new_zeros(b, h, dk, v.shape[-1]) if initial_state is None else initial_state.to(q.dtype)
    )
    outs = []
    for t in range(length):
        state = state * torch.exp(g[:, t]).to(q.dtype)[..., None, None]
        error = v[:, t] - torch.einsum("bhkv,bhk->bhv", state, k[:, t])
        state = state + k[:, t, :, :, None] * (beta[:, t, :, None] * error)[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(outs, dim=1), state


def gated_delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    initial_state: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The same as :func:`gated_delta_rule_recurrent`, chunk by chunk."""
    b, length, h, dk = k.shape
    dv = v.shape[-1]
    pad = (-length) % chunk_size
    # Padded steps: g = 0 (no decay) and beta = 0 (no write), so the state is unchanged.
    q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
    g, beta = (F.pad(t, (0, 0, 0, pad)) for t in (g, beta))
    n = (length + pad) // chunk_size

    def chunks(t):  # [b, l, h, ...] -> [b, h, n, c, ...]
        t = t.reshape(b, n, chunk_size, h, *t.shape[3:])
        return t.transpose(1, 3).transpose(2, 3)

    q, k, v, g, beta = (chunks(t) for t in (q, k, v, g, beta))
    g = torch.cumsum(g.to(torch.promote_types(q.dtype, torch.float32)), dim=-1)  # [b, h, n, c]
    # decay[i, j] = exp(g_i - g_j) for j <= i (the decay from step j to step i), else 0.
    lower = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    decay = torch.exp((g[..., :, None] - g[..., None, :]).masked_fill(~lower, float("-inf")))
    decay = decay.to(q.dtype)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    # The writes of a chunk: (I + strictly_lower(diag(beta) K K^T * decay)) W = beta V, solved
    # once for the values and once for the decayed keys.
    system = (k_beta @ k.transpose(-1, -2)) * decay
    system = system.tril(-1)
    eye = torch.eye(chunk_size, dtype=q.dtype, device=q.device)
    inverse = torch.linalg.solve_triangular(eye + system, eye, upper=False, unitriangular=True)
    u = inverse @ v_beta  # [b, h, n, c, dv]
    w = inverse @ (k_beta * torch.exp(g).to(q.dtype)[..., None])  # [b, h, n, c, dk]

    state = q.new_zeros(b, h, dk, dv) if initial_state is None else initial_state.to(q.dtype)
    outs = []
    for i in range(n):
        qi, ki = q[:, :, i], k[:, :, i]
        gi = g[:, :, i]
        new_values = u[:, :, i] - w[:, :, i] @ state  # what the chunk writes, given the state
        inside = (qi @ ki.transpose(-1, -2)) * decay[:, :, i]
        from_state = (qi * torch.exp(gi).to(q.dtype)[..., None]) @ state
        outs.append(from_state + inside @ new_values)
        to_end = torch.exp(gi[..., -1:] - gi).to(q.dtype)  # decay of each step to the chunk end
        state = (
            state * torch.exp(gi[..., -1]).to(q.dtype)[..., None, None]
            + (ki * to_end[..., None]).transpose(-1, -2) @ new_values
        )
    out = torch.stack(outs, dim=2)  # [b, h, n, c, dv]
    out = out.reshape(b, h, n * chunk_size, dv).transpose(1, 2)[:, :length]
    return out, state
