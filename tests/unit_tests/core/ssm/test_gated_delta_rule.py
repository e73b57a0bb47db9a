"""The gated delta rule (the building block of Gated DeltaNet): the chunked (WY) form equals the
step-by-step recurrence in float64 within 1e-6 (chunk sizes 1, 4, 5, 16 over 13 steps, with and
without an initial state), and the recurrence agrees with transformers' Qwen3-Next reference
(which scales the queries by 1/sqrt(dk) itself and computes in float32)."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

from megatron.core.ssm.gated_delta_rule import gated_delta_rule_chunked, gated_delta_rule_recurrent

B, L, H, DK, DV = 2, 13, 3, 4, 5


def _inputs():
    gen = torch.Generator().manual_seed(0)

    def rand(*shape, fn=torch.randn):
        return fn(*shape, generator=gen, dtype=torch.float64)

    q = rand(B, L, H, DK)
    k = F.normalize(rand(B, L, H, DK), dim=-1)
    v = rand(B, L, H, DV)
    g = -rand(B, L, H, fn=torch.rand)
    beta = rand(B, L, H, fn=torch.rand)
    return q, k, v, g, beta, rand(B, H, DK, DV)


@pytest.mark.parametrize("chunk", [1, 4, 5, 16])
@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "initial_state"])
def test_chunked_equals_recurrence_in_float64(chunk, with_state):
    q, k, v, g, beta, s0 = _inputs()
    s0 = s0 if with_state else None
    out, state = gated_delta_rule_chunked(q, k, v, g, beta, chunk, initial_state=s0)
    ref, ref_state = gated_delta_rule_recurrent(q, k, v, g, beta, initial_state=s0)
    assert (out - ref).abs().max().item() < 1e-6
    assert (state - ref_state).abs().max().item() < 1e-6
    assert ref.abs().max() > 0.1


def test_recurrence_matches_transformers_qwen3_next():
    q, k, v, g, beta, s0 = _inputs()
    out, state = gated_delta_rule_recurrent(q * DK**-0.5, k, v, g, beta, initial_state=s0)
    want, want_state = torch_recurrent_gated_delta_rule(
        q, k, v, g, beta, initial_state=s0, output_final_state=True
    )
    assert (out - want.to(out.dtype)).abs().max().item() < 1e-5
    assert (state - want_state.to(state.dtype)).abs().max().item() < 1e-5
