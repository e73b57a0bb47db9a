"""MoE routing, balancing losses, capacity and experts against independent references:
hand-computed routing on small inputs, the loss formulas written out in float64 loops, a
plain Sinkhorn, a per-expert count of the tokens each drop policy keeps."""

import math

import pytest
import torch
import torch.nn.functional as F

from megatron.core.transformer.moe import moe_utils as U
from megatron.core.transformer.moe.experts import grouped_linear
from megatron.core.transformer.moe.router import TopKRouter
from tests.unit_tests.tiny_configs import tiny_gpt_model, tiny_transformer_config


def moe_config(**overrides):
    settings = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16)
    settings.update(overrides)
    return tiny_transformer_config(**settings)


def test_softmax_topk_by_hand():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.5, 0.1, 0.2, 2.0]])
    probs, routing_map = U.route_topk(logits, 2)
    # Row 0 picks experts 1 (3.0) and 2 (2.0): softmax([3, 2]) = [e/(e+1), 1/(e+1)].
    e = math.e
    expected = torch.tensor([[0, e / (e + 1), 1 / (e + 1), 0], [e**1.5 / (e**1.5 + 1), 0, 0, 0]])
    expected[1, 3] = 1 / (e**1.5 + 1)
    # Row 1 picks experts 3 (2.0) and 0 (0.5): softmax([2.0, 0.5]).
    expected[1, 3], expected[1, 0] = 1 / (1 + e**-1.5), e**-1.5 / (1 + e**-1.5)
    assert torch.allclose(probs, expected, atol=1e-6)
    assert routing_map.tolist() == [[False, True, True, False], [True, False, False, True]]


def test_pre_softmax_sigmoid_scaling_groups_and_bias_by_hand():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    full = torch.softmax(logits, dim=-1)
    probs, _ = U.route_topk(logits, 2, pre_softmax=True, scaling_factor=2.0)
    assert torch.allclose(probs[0, [1, 2]], 2.0 * full[0, [1, 2]])
    assert probs[0, [0, 3]].abs().sum() == 0

    probs, _ = U.route_topk(logits, 2, score_function="sigmoid")
    s = torch.sigmoid(torch.tensor([3.0, 2.0]))
    assert torch.allclose(probs[0, [1, 2]], s / s.sum())

    # Groups {0,1} and {2,3}; best-1 sums 3.0 vs 2.0 -> only group 0; top-2 inside it.
    _, routing_map = U.route_topk(logits, 2, num_groups=2, group_topk=1)
    assert routing_map.tolist() == [[True, True, False, False]]

    # The bias moves the selection (expert 3 instead of 2) but not the weights' source scores.
    bias = torch.tensor([0.0, 0.0, 0.0, 0.9])
    probs, routing_map = U.route_topk(logits, 2, score_function="sigmoid", expert_bias=bias)
    assert routing_map.tolist() == [[False, True, False, True]]
    s = torch.sigmoid(torch.tensor([3.0, 0.0]))
    assert torch.allclose(probs[0, [1, 3]], s / s.sum())


def test_sqrtsoftplus_scores_by_hand():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]], dtype=torch.float64)

    def score(x):  # sqrt(softplus(x)) = sqrt(log(1 + e^x))
        return math.sqrt(math.log1p(math.exp(x)))

    s = [score(x) for x in (1.0, 3.0, 2.0, 0.0)]
    # Top-2 of the scores: experts 1 and 2, normalized to sum 1; top-1: the raw score.
    probs, routing_map = U.route_topk(logits, 2, score_function="sqrtsoftplus")
    assert routing_map.tolist() == [[False, True, True, False]]
    expected = [0.0, s[1] / (s[1] + s[2]), s[2] / (s[1] + s[2]), 0.0]
    assert probs[0].tolist() == pytest.approx(expected, rel=1e-12)
    probs, _ = U.route_topk(logits, 1, score_function="sqrtsoftplus", scaling_factor=2.5)
    assert probs[0].tolist() == pytest.approx([0.0, 2.5 * s[1], 0.0, 0.0], rel=1e-12)
    # The bias picks expert 3 instead of 2; the weights stay the unbiased scores.
    bias = torch.tensor([0.0, 0.0, 0.0, 0.9], dtype=torch.float64)
    probs, routing_map = U.route_topk(logits, 2, score_function="sqrtsoftplus", expert_bias=bias)
    assert routing_map.tolist() == [[False, True, False, True]]
    assert probs[0, [1, 3]].tolist() == pytest.approx(
        [s[1] / (s[1] + s[3]), s[3] / (s[1] + s[3])], rel=1e-12
    )
    # The balancing losses weigh the scores normalized over all experts.
    aux = U.scores_for_aux_loss(logits, "sqrtsoftplus")
    assert aux[0].tolist() == pytest.approx([v / sum(s) for v in s], rel=1e-12)


def _aux_loss_loops(scores, routing_map, topk, coeff):
    tokens, experts = scores.shape
    total = 0.0
    for i in range(experts):
        f_i = sum(float(routing_map[t, i]) for t in range(tokens)) / (tokens * topk)
        p_i = sum(float(scores[t, i]) for t in range(tokens)) / tokens
        total += f_i * p_i
    return coeff * experts * total


def test_aux_seq_aux_and_z_losses_match_formulas_in_float64():
    torch.manual_seed(0)
    seq, batch, experts, topk, coeff = 5, 3, 4, 2, 0.1
    logits = torch.randn(seq * batch, experts, dtype=torch.float64)
    _, routing_map = U.route_topk(logits, topk)
    scores = torch.softmax(logits, dim=-1)

    got = U.switch_load_balancing_loss(
        scores, routing_map.sum(0), seq * batch, topk, experts, coeff
    )
    assert got.item() == pytest.approx(_aux_loss_loops(scores, routing_map, topk, coeff), rel=1e-12)

    # seq_aux_loss: tokens are sequence-major ([s, b] flattened), one loss per sequence.
    per_seq = [
        _aux_loss_loops(
            scores.view(seq, batch, experts)[:, b],
            routing_map.view(seq, batch, -1)[:, b],
            topk,
            coeff,
        )
        for b in range(batch)
    ]
    config = moe_config(
        moe_router_load_balancing_type="seq_aux_loss",
        moe_aux_loss_coeff=coeff,
        moe_router_dtype="fp64",
    )
    router = TopKRouter(config)
    seq_loss = _loss_of(router, logits, routing_map, seq)
    # The router keeps its tracked values in float32.
    assert seq_loss == pytest.approx(sum(per_seq) / batch, rel=1e-6)

    z = U.z_loss(logits, 0.5)
    expected = (
        0.5
        * sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits.tolist())
        / len(logits)
    )
    assert z.item() == pytest.approx(expected, rel=1e-12)


def _global_aux_loss_loops(scores, counts, tokens, topk, coeff):
    """coeff * E * sum_i f_i * P_i with f_i = counts[i] / (tokens * topk), P_i = the mean of
    scores[:, i] over the tokens of ``scores``, divided by ``tokens`` / len(scores) as the
    scores are one part of ``tokens``."""
    experts = scores.shape[1]
    total = 0.0
    for i in range(experts):
        f_i = float(counts[i]) / (tokens * topk)
        p_i = sum(float(scores[t, i]) for t in range(len(scores))) / tokens
        total += f_i * p_i
    return coeff * experts * total


def test_global_aux_loss_matches_formula_in_float64():
    """Counts of the global batch averaged over the step's micro-batches so far; reset per
    step."""
    torch.manual_seed(1)
    experts, topk, coeff, tokens = 4, 2, 0.1, 6
    config = moe_config(
        moe_router_load_balancing_type="global_aux_loss",
        moe_aux_loss_coeff=coeff,
        moe_router_dtype="fp64",
    )
    router = TopKRouter(config).train()
    batches = [torch.randn(tokens, experts, dtype=torch.float64) for _ in range(4)]
    maps = [U.route_topk(logits, topk)[1] for logits in batches]
    expected = []
    for m, (logits, routing_map) in enumerate(zip(batches[:3], maps[:3])):
        running = sum(r.sum(0).double() for r in maps[: m + 1]) / (m + 1)
        scores = torch.softmax(logits, dim=-1)
        expected.append(_global_aux_loss_loops(scores, running, tokens, topk, coeff))
        probs = torch.zeros_like(logits, requires_grad=True)
        with torch.enable_grad():
            router._attach_losses(logits, probs, routing_map, tokens)
    # The router tracks the sum over the micro-batches, without the coefficient, in float32.
    got = router.tracked["global_load_balancing_loss"].item() * coeff
    assert got == pytest.approx(sum(expected), rel=1e-6)
    # A new step: the counts start again from the next micro-batch alone (the plain aux loss).
    router.reset_global_counts()
    router.tracked.clear()
    probs = torch.zeros_like(batches[3], requires_grad=True)
    with torch.enable_grad():
        router._attach_losses(batches[3], probs, maps[3], tokens)
    scores = torch.softmax(batches[3], dim=-1)
    assert router.tracked["global_load_balancing_loss"].item() * coeff == pytest.approx(
        _aux_loss_loops(scores, maps[3], topk, coeff), rel=1e-6
    )


def _loss_of(router, logits, routing_map, seq):
    router.train()
    probs = torch.zeros_like(logits, requires_grad=True)
    with torch.enable_grad():
        router._attach_losses(logits, probs, routing_map, seq)
    return router.tracked["seq_load_balancing_loss"].item() * router.coeffs[0]


def _plain_sinkhorn(cost, tol=1e-4):
    k = torch.exp(cost.double())
    r = torch.ones(k.shape[0], dtype=torch.float64)
    c = torch.ones(k.shape[1], dtype=torch.float64)
    for _ in range(10000):
        r_new = 1.0 / (k.shape[0] * (k @ c))
        c_new = 1.0 / (k.shape[1] * (k.t() @ r_new))
        done = (c_new - c).abs().mean() < tol
        r, c = r_new, c_new
        if done:
            break
    return r[:, None] * k * c[None, :]


def test_sinkhorn_matches_plain_iteration_and_balances():
    torch.manual_seed(1)
    cost = torch.randn(12, 4, dtype=torch.float64)
    got = U.sinkhorn(cost)
    assert torch.allclose(got, _plain_sinkhorn(cost), rtol=1e-3, atol=1e-6)
    # Columns carry equal mass: each expert gets 1/E of the total.
    assert torch.allclose(got.sum(0), torch.full((4,), 1 / 4, dtype=torch.float64), atol=1e-3)


def test_capacity_drops_match_an_independent_count():
    torch.manual_seed(2)
    tokens, experts, topk = 10, 4, 2
    logits = torch.randn(tokens, experts)
    probs, routing_map = U.route_topk(logits, topk)
    capacity = U.expert_capacity(tokens, experts, topk, 0.5)
    assert capacity == math.ceil(tokens * topk / experts * 0.5)
    for policy in ("probs", "position"):
        kept_probs, kept = U.apply_capacity(probs, routing_map, capacity, policy)
        for e in range(experts):
            routed = [t for t in range(tokens) if routing_map[t, e]]
            if policy == "probs":
                routed.sort(key=lambda t: -float(probs[t, e]))
            expected = sorted(routed[:capacity])
            assert [t for t in range(tokens) if kept[t, e]] == expected, (policy, e)
        assert torch.equal(kept_probs, probs * kept)
    # Padding: every expert gets exactly `capacity` rows, the fillers with weight 0.
    padded_probs, padded = U.apply_capacity(probs, routing_map, capacity, "probs", True)
    assert padded.sum(0).tolist() == [capacity] * experts
    assert torch.equal(padded_probs, U.apply_capacity(probs, routing_map, capacity, "probs")[0])


def test_aux_loss_enters_backward_with_the_schedule_scale():
    config = moe_config(moe_aux_loss_coeff=0.3, moe_z_loss_coeff=0.2)
    torch.manual_seed(3)
    router = TopKRouter(config).train()
    tokens = torch.randn(6, config.hidden_size)
    router.aux_loss_scale = 0.25  # what the schedule sets through set_moe_aux_loss_scale
    probs, _ = router(tokens, seq_length=3)
    (probs * torch.arange(4.0)).sum().backward()
    got = router.weight.grad.clone()

    # Reference: the same objective with the losses added explicitly (times 0.25).
    weight = router.weight.detach().clone().requires_grad_(True)
    logits = tokens @ weight.t()
    dense, routing_map = U.route_topk(logits, 2)
    scores = torch.softmax(logits, dim=-1)
    aux = U.switch_load_balancing_loss(scores, routing_map.sum(0), 6, 2, 4, 0.3)
    z = U.z_loss(logits, 0.2)
    ((dense * torch.arange(4.0)).sum() + 0.25 * (aux + z)).backward()
    assert torch.allclose(got, weight.grad, rtol=1e-5, atol=1e-7)
    assert router.tracked["load_balancing_loss"].item() == pytest.approx(aux.item() / 0.3, rel=1e-5)
    assert router.tracked["z_loss"].item() == pytest.approx(z.item() / 0.2, rel=1e-5)


def test_expert_bias_moves_towards_balance():
    config = moe_config(
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=0.1,
        moe_router_score_function="sigmoid",
    )
    router = TopKRouter(config).train()
    router.local_tokens_per_expert.copy_(torch.tensor([5.0, 1.0, 3.0, 3.0]))
    router.update_expert_bias()
    assert router.expert_bias.tolist() == pytest.approx([-0.1, 0.1, 0.0, 0.0])
    assert router.local_tokens_per_expert.sum() == 0


def test_grouped_linear_equals_per_group_products():
    torch.manual_seed(4)
    counts = [3, 0, 5, 1]
    tokens = torch.randn(sum(counts), 6, dtype=torch.float64)
    weights = torch.randn(4, 7, 6, dtype=torch.float64)
    expected = torch.cat([chunk @ w.t() for chunk, w in zip(torch.split(tokens, counts), weights)])
    assert torch.allclose(grouped_linear(tokens, weights, counts), expected, atol=1e-12)


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_grouped_gemm_and_dispatchers_equal_sequential_experts(dispatcher):
    seq, batch = 6, 2
    tokens = torch.randint(0, 50, (batch, seq))
    pos = torch.arange(seq).expand(batch, seq)
    results = []
    for grouped in (False, True):
        config = moe_config(
            moe_grouped_gemm=grouped,
            moe_token_dispatcher_type=dispatcher,
            gated_linear_unit=True,
            activation_func=F.silu,
        )
        model = tiny_gpt_model(config, seed=5)
        loss = model(tokens, pos, None, labels=tokens).mean()
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        results.append((loss.detach(), grads))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.allclose(loss_a, loss_b, rtol=1e-6)
    assert "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight" in grads_a
    for name in grads_a:
        assert torch.allclose(grads_a[name], grads_b[name], rtol=1e-5, atol=1e-7), name


def test_moe_config_errors_name_the_flags():
    with pytest.raises(ValueError, match="num-experts.*expert-model-parallel-size"):
        moe_config(num_moe_experts=3, expert_model_parallel_size=2)
    with pytest.raises(ValueError, match="moe-router-group-topk"):
        moe_config(moe_router_num_groups=2)
    with pytest.raises(ValueError, match="moe-aux-loss-coeff"):
        moe_config(
            moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"], moe_aux_loss_coeff=0.1
        )
    with pytest.raises(ValueError, match="sequence-parallel"):
        moe_config(tensor_model_parallel_size=2)
    with pytest.raises(ValueError, match="moe-layer-freq"):
        moe_config(moe_layer_freq=[1, 0, 1])


def test_moe_flag_rules_name_the_flags():
    from megatron.training.flag_errors import ArgumentValidationError
    from tests.unit_tests.tiny_configs import tiny_args

    cases = [
        (["--tensor-model-parallel-size", "2"], "needs --sequence-parallel"),
        (["--moe-router-topk", "5"], "--moe-router-topk"),
        (["--moe-pad-expert-input-to-capacity"], "needs --moe-expert-capacity-factor"),
    ]
    for extra, message in cases:
        with pytest.raises(ArgumentValidationError, match=message):
            tiny_args("--num-experts", "4", *extra, world_size=4)
    args = tiny_args("--num-experts", "4", "--moe-token-dispatcher-type", "flex", world_size=2)
    assert args.moe_token_dispatcher_type == "alltoall"
    assert "--moe-token-dispatcher-type flex" in args.no_effect_note
