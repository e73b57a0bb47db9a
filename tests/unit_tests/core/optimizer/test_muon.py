"""--optimizer muon against a plain float64 reference, under TP=2 and with the layer-wise
distributed optimizer (DP=2).

Reference (written here, in float64): momentum M <- beta M + (1 - beta) G; direction M, or
(1 - beta) G + beta M with Nesterov; Newton-Schulz on the wide orientation of the direction
normalized by its Frobenius norm, with the published coefficients; scale sqrt(max(out, in))
(spectral), sqrt(out / in) (unit_rms_norm) or sqrt(max(1, out / in)) (shape_scaling), times
the extra scale factor; decoupled weight decay W (1 - lr wd); the fused QKV weight
orthogonalized per Q, K, V part of its grouped layout. Every other parameter (word embedding,
output layer, 1-D) takes AdamW or Lion by formula.

* One process, fp32 (Newton-Schulz matmuls 'high'): two steps of a small GPT (GQA, SwiGLU,
  RMSNorm, learned positions, untied output) match the reference within 1e-5 (relative, per
  parameter), for three flag combinations; with 'medium' (bf16 iterations) the updates within
  15 %; the quintic iteration's output has singular values in [0.6, 1.3] (it orthogonalizes).
* TP=2 (spawned): the gradients before any step are the one-process ones; with 'duplicated'
  and 'distributed' every rank holds the shard of the reference fed with the layout's own
  gradients (1e-5); 'blockwise' gives each shard's own orthogonalization, which differs.
* Layer-wise distributed optimizer, DP=2 (spawned, DDP all-reduce): the all-reduced gradients
  before any step are the one-process ones; each rank holds state for about half of the
  parameters only; both ranks end with the same parameters, the reference fed with the
  all-reduced gradients (1e-5). (Why not the one-process parameters: see "layouts" below.)
"""

import math

import pytest
import torch
import torch.nn.functional as F

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.parallel_state import initialize_model_parallel
from megatron.core.tensor_parallel import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import full_from_shards, shard_of
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.harness.argv import megatron_argv
from tests.unit_tests.dist_utils import run_distributed

VOCAB, SEQ, BATCH, HEADS, GROUPS, KV = 64, 16, 4, 4, 2, 8
LR, WD = 0.02, 0.1

COEFFICIENTS = {  # published sets (modded-nanogpt quintic, Muon's simple, Polar Express)
    "quintic": [
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ],
    "simple": [(3.4445, -4.7750, 2.0315)] * 3,
    "polar_express": [
        (8.2051, -22.9019, 16.4607),
        (4.0664, -2.8612, 0.5184),
        (3.9096, -2.8234, 0.5250),
        (3.2856, -2.4153, 0.4853),
        (2.2779, -1.6198, 0.3985),
        (1.8726, -1.2307, 0.3585),
        (1.8564, -1.2132, 0.3568),
        (1.8750, -1.2500, 0.3750),
    ],
}


def build(tp=1, pg_collection=None):
    config = TransformerConfig(
        num_layers=2,
        hidden_size=HEADS * KV,
        ffn_hidden_size=48,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        gated_linear_unit=True,
        activation_func=F.silu,
        # No biases: the key bias has a zero gradient, whose rounding noise Adam would
        # normalize into full-size, layout-dependent updates.
        add_bias_linear=False,
        normalization="RMSNorm",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        init_seed=1234,
    )
    return GPTModel(
        config,
        get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="learned_absolute",
        share_embeddings_and_output_weights=False,
        # One process unless groups are given (GPTModel would take the current parallel_state's).
        pg_collection=pg_collection if pg_collection is not None else ProcessGroupCollection(),
    )


def batch(step, rows=slice(None)):
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return tokens[rows], torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)[rows]


def optimizer_config(**kw):
    kw.setdefault("muon_fp32_matmul_prec", "high")
    return OptimizerConfig(optimizer="muon", lr=LR, weight_decay=WD, clip_grad=0.0, **kw)


def train_step(model, optimizer, step, rows=slice(None)):
    tokens, labels = batch(step, rows)
    optimizer.zero_grad()
    model(tokens, None, None, labels=labels).mean().backward()
    grads = {n: p.grad.detach().double().clone() for n, p in model.named_parameters()}
    assert optimizer.step()[0]
    return grads


# ------------------------------------------------------------------------------ reference
def ref_newton_schulz(m, coefficients):
    x = m.double()
    transpose = x.shape[0] > x.shape[1]
    x = x.t() if transpose else x
    x = x / x.norm().clamp_min(1e-7)
    for a, b, c in coefficients:
        gram = x @ x.t()
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.t() if transpose else x


def ref_scale(rows, cols, mode):
    return {
        "spectral": math.sqrt(max(rows, cols)),
        "unit_rms_norm": math.sqrt(rows / cols),
        "shape_scaling": math.sqrt(max(1.0, rows / cols)),
    }[mode]


def ref_orthogonalize(name, direction, flags, coefficients):
    def one(m):
        scale = ref_scale(*m.shape, flags["scale_mode"]) * flags.get("extra_scale", 1.0)
        return ref_newton_schulz(m, coefficients) * scale

    if flags["split_qkv"] and name.endswith("linear_qkv.weight"):
        per_group = (HEADS // GROUPS + 2) * KV
        grouped = direction.view(GROUPS, per_group, -1)
        parts = torch.split(grouped, [HEADS // GROUPS * KV, KV, KV], dim=1)
        done = [one(p.reshape(-1, p.shape[-1])).view(p.shape) for p in parts]
        return torch.cat(done, dim=1).view(direction.shape)
    return one(direction)


class ReferenceMuon:
    """The update rules of the module docstring, on float64 copies of the parameters."""

    def __init__(self, model, flags):
        self.flags = flags
        self.params = {n: p.detach().double().clone() for n, p in model.named_parameters()}
        self.state = {n: {} for n in self.params}
        self.steps = 0

    def is_muon(self, name):
        return self.params[name].dim() == 2 and not name.startswith(
            ("embedding.word_embeddings", "output_layer")
        )

    def step(self, grads):
        self.steps += 1
        flags = self.flags
        for name, w in self.params.items():
            g, state = grads[name], self.state[name]
            wd = 0.0 if w.dim() == 1 or name.endswith(".bias") else WD
            if self.is_muon(name):
                m = state.setdefault("m", torch.zeros_like(w))
                w.mul_(1 - LR * wd)
                m.mul_(flags["momentum"]).add_((1 - flags["momentum"]) * g)
                direction = (
                    (1 - flags["momentum"]) * g + flags["momentum"] * m if flags["nesterov"] else m
                )
                coefficients = COEFFICIENTS[flags["coefficient_type"]]
                w.sub_(LR * ref_orthogonalize(name, direction, flags, coefficients))
            elif flags["scalar"] == "adam":
                m = state.setdefault("m", torch.zeros_like(w))
                v = state.setdefault("v", torch.zeros_like(w))
                w.mul_(1 - LR * wd)
                m.mul_(0.9).add_(0.1 * g)
                v.mul_(0.999).add_(0.001 * g * g)
                m_hat, v_hat = m / (1 - 0.9**self.steps), v / (1 - 0.999**self.steps)
                w.sub_(LR * m_hat / (v_hat.sqrt() + 1e-8))
            else:  # lion
                m = state.setdefault("m", torch.zeros_like(w))
                w.mul_(1 - LR * wd)
                w.sub_(LR * torch.sign(0.95 * m + 0.05 * g))
                m.mul_(0.98).add_(0.02 * g)


def rel_err(actual, expected):
    return ((actual.double() - expected).norm() / expected.norm()).item()


FLAG_SETS = [
    dict(
        momentum=0.9, nesterov=False, scale_mode="spectral", coefficient_type="quintic",
        split_qkv=True, scalar="adam",
    ),
    dict(
        momentum=0.95, nesterov=True, scale_mode="unit_rms_norm",
        coefficient_type="polar_express", split_qkv=False, scalar="adam", extra_scale=0.2,
    ),
    dict(
        momentum=0.8, nesterov=False, scale_mode="shape_scaling", coefficient_type="simple",
        split_qkv=True, scalar="lion",
    ),
]  # fmt: skip


def _config_for(flags, **kw):
    return optimizer_config(
        muon_momentum=flags["momentum"],
        muon_nesterov=flags["nesterov"],
        muon_scale_mode=flags["scale_mode"],
        muon_coefficient_type=flags["coefficient_type"],
        muon_num_ns_steps=len(COEFFICIENTS[flags["coefficient_type"]]),
        muon_split_qkv=flags["split_qkv"],
        muon_scalar_optimizer=flags["scalar"],
        muon_extra_scale_factor=flags.get("extra_scale", 1.0),
        **kw,
    )


@pytest.mark.parametrize("flags", FLAG_SETS, ids=["default", "nesterov_polar", "lion_simple"])
def test_muon_matches_the_reference(flags):
    model = build()
    reference = ReferenceMuon(model, flags)
    optimizer = get_megatron_optimizer(_config_for(flags), [model])
    kinds = {g["optimizer"] for g in optimizer.param_groups}
    assert kinds == {"muon", flags["scalar"]}
    for step in range(2):
        reference.step(train_step(model, optimizer, step))
    for name, param in model.named_parameters():
        assert rel_err(param, reference.params[name]) < 1e-5, name


def test_muon_bf16_newton_schulz_and_orthogonality():
    model = build()
    flags = FLAG_SETS[0]
    reference = ReferenceMuon(model, flags)
    optimizer = get_megatron_optimizer(_config_for(flags, muon_fp32_matmul_prec="medium"), [model])
    before = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    reference.step(train_step(model, optimizer, 0))
    update_errors = [
        rel_err(p.detach().double() - before[n], reference.params[n] - before[n])
        for n, p in model.named_parameters()
        if reference.is_muon(n)
    ]
    # bf16 iterations: near the reference (worst on the near-low-rank attention projection
    # gradient, whose small singular values the iteration amplifies), but not fp32-near.
    assert min(update_errors) > 1e-4 and max(update_errors) < 0.15, update_errors
    g = torch.Generator().manual_seed(0)
    sv = torch.linalg.svdvals(
        ref_newton_schulz(torch.randn(24, 40, generator=g), COEFFICIENTS["quintic"])
    )
    assert 0.6 < sv.min() and sv.max() < 1.3


# ------------------------------------------------------------------------------ layouts
# A parallel layout computes its gradients in another order than the one-process run: they
# differ by fp32 rounding (measured 2e-7, relative). Newton-Schulz amplifies such differences in
# the near-low-rank attention projection gradients, exactly as it would in exact arithmetic:
# float64 references fed with the two runs' gradients end 1.0e-5 apart, which is what a direct
# comparison of the two fp32 runs measures (9e-6 to 1.03e-5 here, depending on the kernels the
# CPU dispatches). So a layout is held to the float64 reference applied to the gradients it
# computed (the one-process run's own standard, 1e-5; measured <= 3.5e-6 under every kernel
# dispatch tried), and its gradients to the one-process ones before any step (no Newton-Schulz
# in between; both are the same fp32 sums over at most 64 terms in another order, which differ
# by at most 2 * 64 * 2^-24 = 7.6e-6 of the magnitudes summed; measured 2.2e-7).
GRAD_RTOL = 2 * 64 * 2.0**-24


def full_gradients(model, grads, world_size, group):
    """The whole-model gradients of a tensor-parallel model: each split parameter's shards
    gathered from every rank."""
    full = {}
    for name, param in model.named_parameters():
        g = grads[name]
        if world_size > 1 and getattr(param, "tensor_model_parallel", False):
            shards = [torch.empty_like(g) for _ in range(world_size)]
            torch.distributed.all_gather(shards, g.contiguous(), group=group)
            g = full_from_shards(shards, param.partition_dim, param.partition_stride)
        full[name] = g
    return full


def one_process_gradients():
    """The one-process model's gradients of step 0 (before any update), in float64."""
    model = build()
    tokens, labels = batch(0)
    model(tokens, None, None, labels=labels).mean().backward()
    return {n: p.grad.detach().double() for n, p in model.named_parameters()}


def assert_follows_reference(model, reference, rank=0, world_size=1, context=""):
    for name, param in model.named_parameters():
        expected = reference.params[name]
        if world_size > 1 and getattr(param, "tensor_model_parallel", False):
            expected = shard_of(
                expected, param.partition_dim, rank, world_size, param.partition_stride
            )
        assert rel_err(param, expected) < 1e-5, (context, name)


# ------------------------------------------------------------------------------ TP = 2
def _tp_worker(rank, world_size):
    torch.set_num_threads(1)
    state = initialize_model_parallel(tensor_model_parallel_size=world_size)
    tp_group = state.get_tensor_model_parallel_group()
    flags = FLAG_SETS[0]
    single_grads = one_process_gradients()
    updates = {}
    for mode in ("duplicated", "distributed", "blockwise"):
        model = build(tp=world_size, pg_collection=state)
        reference = ReferenceMuon(build(), flags)  # the layouts start from the same weights
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        optimizer = get_megatron_optimizer(
            _config_for(flags, muon_tp_mode=mode), [model], tp_rank=rank, tp_group=tp_group
        )
        for step in range(2):
            grads = full_gradients(model, train_step(model, optimizer, step), world_size, tp_group)
            if step == 0:
                for name, g in grads.items():
                    assert rel_err(g, single_grads[name]) < GRAD_RTOL, (mode, name)
            reference.step(grads)
        updates[mode] = {n: p.detach() - before[n] for n, p in model.named_parameters()}
        if mode != "blockwise":
            assert_follows_reference(model, reference, rank, world_size, mode)
        del model, optimizer
    split = "decoder.layers.0.mlp.linear_fc2.weight"  # row-parallel: split along its inputs
    assert rel_err(updates["blockwise"][split], updates["duplicated"][split].double()) > 1e-2


def test_muon_tensor_parallel_modes():
    run_distributed(_tp_worker, 2)


# ------------------------------------------------------------------------------ DP = 2
def _dp_worker(rank, world_size):
    torch.set_num_threads(1)
    state = initialize_model_parallel()
    dp_group = state.get_data_parallel_group()
    flags = FLAG_SETS[0]
    single_grads = one_process_gradients()
    model = build()
    reference = ReferenceMuon(model, flags)
    ddp = DistributedDataParallel(
        None,
        DistributedDataParallelConfig(),
        model,
        pg_collection=ProcessGroupCollection(dp_cp=dp_group),
    )
    optimizer = get_megatron_optimizer(
        _config_for(flags, use_layer_wise_distributed_optimizer=True),
        [model],
        model_parallel_group=torch.distributed.group.WORLD,
        data_parallel_group=dp_group,
    )
    share = BATCH // world_size
    for step in range(2):
        tokens, labels = batch(step, slice(rank * share, (rank + 1) * share))
        optimizer.zero_grad()
        ddp.zero_grad_buffer()
        ddp(tokens, None, None, labels=labels).mean().backward()
        ddp.finish_grad_sync()
        grads = {n: p.main_grad.detach().double().clone() for n, p in model.named_parameters()}
        if step == 0:
            for name, g in grads.items():
                assert rel_err(g, single_grads[name]) < GRAD_RTOL, name
        assert optimizer.step()[0]
        reference.step(grads)
    assert_follows_reference(model, reference)
    # Each parameter was updated on its owner rank and sent from there: the ranks agree exactly.
    flat = torch.cat([p.detach().view(-1) for p in model.parameters()])
    copies = [torch.empty_like(flat) for _ in range(world_size)]
    torch.distributed.all_gather(copies, flat, group=dp_group)
    assert all(torch.equal(copy, flat) for copy in copies)
    owned = sum(p.numel() for p in optimizer.optimizer.state)
    total = sum(p.numel() for p in model.parameters())
    assert 0.3 * total < owned < 0.7 * total, (owned, total)
    counts = torch.tensor([float(owned)])
    torch.distributed.all_reduce(counts)
    assert counts.item() == total
    del ddp, optimizer, model


def test_layer_wise_distributed_optimizer_matches_one_process():
    run_distributed(_dp_worker, 2)


# ------------------------------------------------------------------------------ start-up rules
COMMAND_LINE = megatron_argv(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    max_position_embeddings=16,
    seq_length=16,
    micro_batch_size=1,
    train_iters=1,
    vocab_size=128,
    optimizer="muon",
)


def _validated(*flags):
    from megatron.training.arguments import parse_args, validate_args

    return validate_args(parse_args(argv=COMMAND_LINE + [str(f) for f in flags]))


def test_muon_start_up_rules(single_process_env, capsys):
    from megatron.training.arguments import ArgumentValidationError

    args = _validated("--use-distributed-optimizer")
    assert args.use_layer_wise_distributed_optimizer and not args.use_distributed_optimizer
    assert "the layer-wise distributed optimizer" in capsys.readouterr().out
    args = _validated("--optimizer", "dist_muon")
    assert args.optimizer == "muon" and args.use_layer_wise_distributed_optimizer
    assert not _validated().use_layer_wise_distributed_optimizer
    # Muon's state is checkpointed in both formats; the layer-wise optimizer's in torch_dist.
    for flags in (
        ["--ckpt-format", "torch"],
        ["--ckpt-format", "torch_dist"],
        ["--ckpt-format", "torch_dist", "--use-distributed-optimizer"],
    ):
        assert _validated("--save", "/tmp/x", "--save-interval", 1, *flags).save == "/tmp/x"
    for flags, message in (
        (["--fp16"], "--optimizer muon does not support --fp16"),
        (["--muon-fp32-matmul-prec", "low"], "--muon-fp32-matmul-prec low is not available"),
        (["--muon-num-ns-steps", 4], "needs --muon-num-ns-steps a multiple of 5, got 4"),
        (["--muon-coefficient-type", "cans"], "--muon-coefficient-type 'cans' unknown"),
        (
            ["--use-distributed-optimizer", "--save", "/tmp/x", "--save-interval", 1]
            + ["--ckpt-format", "torch"],
            "saves and loads its state in --ckpt-format torch_dist only",
        ),
    ):
        with pytest.raises(ArgumentValidationError, match=message):
            _validated(*flags)
