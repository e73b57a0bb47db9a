"""The theoretical memory report (megatron/training/theoretical_memory.py) against reality.

* Weights + gradients + optimizer state: the report for a flag set is compared with the MEASURED
  bytes (distinct storages of the parameters, the DDP gradient buffers, the fp32 master weights
  and their gradients, the optimizer state) after one real optimizer step of the GPTModel that
  pretrain_gpt.py builds from the same flags (DistributedDataParallel + get_megatron_optimizer):
  fp32 / bf16 / fp16 with Adam, fp32 with SGD, both stages of PP=2 (tied embedding copy on the
  last stage), and one spawned TP=2 world with sequence parallelism. Within 10 % (the issue's
  bound); in practice the only difference is Adam's per-tensor step counters.
* Bytes per parameter with --use-distributed-optimizer (Megatron's figures per precision, the
  optimizer's share divided over the ranks it is sharded across).
* Activations: the per-layer formula (Korthikanti et al.), the in-flight micro-batches of the
  pipeline schedules, and Megatron's own activation formula (written out independently below)
  for the case it assumes (sequence parallelism + selective recompute).
* tools/report_theoretical_memory.py on a Llama-3 8B flag set for 8 GPUs with TP=2: the printed
  numbers equal the module's, and the parameter count equals a meta-device build of the model.
"""

import contextlib
import io
import re
import subprocess
import sys

import pytest
import torch

from megatron.training.model_families import get_model_family
from megatron.training.theoretical_memory import (
    NUM_BYTES_IN_MEGABYTE,
    activation_components,
    attention_keeps_scores,
    bytes_per_parameter,
    compute_theoretical_memory,
    layer_activation_bytes,
    microbatches_in_flight,
)
from tests.harness import REPO
from tests.harness.argv import megatron_argv
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.tiny_configs import validated_args

sys.path.insert(0, str(REPO / "tools"))
import report_theoretical_memory as tool  # noqa: E402

TINY = megatron_argv(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    seq_length=16,
    max_position_embeddings=16,
    micro_batch_size=2,
    vocab_size=200,
    make_vocab_size_divisible_by=8,
    train_iters=1,
    lr=1e-3,
    attention_dropout=0,
    hidden_dropout=0,
)
LLAMA = [
    "--swiglu",
    "--normalization",
    "RMSNorm",
    "--position-embedding-type",
    "rope",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--disable-bias-linear",
    "--untie-embeddings-and-output-weights",
    "--ffn-hidden-size",
    "160",
]


pytestmark = pytest.mark.usefixtures("single_thread")


def make_args(argv, world_size=1):
    from megatron.training.tokenizer import build_tokenizer

    args = validated_args(argv, world_size, defaults={"tokenizer_type": "GPT2BPETokenizer"})
    with contextlib.redirect_stdout(io.StringIO()):
        build_tokenizer(args)
    return args


# ----------------------------------------------------------------------------- measurement
def build_and_step(args, pre_process=True, post_process=True, num_layers=None, state=None):
    """pretrain_gpt.py's model for this rank (model provider, Float16Module, DDP, optimizer), one
    forward/backward with labels and one optimizer step. Returns (model chunk, optimizer)."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.tensor_parallel import ProcessGroupCollection
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.multi_token_prediction import mtp_layer_spec
    from megatron.training.configs import (
        core_transformer_config_from_args,
        ddp_config_from_args,
        optimizer_config_from_args,
    )

    config = core_transformer_config_from_args(args)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    torch.manual_seed(0)
    model = GPTModel(
        config,
        spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        num_layers=num_layers,
        pg_collection=state,
        mtp_block_spec=mtp_layer_spec(spec) if getattr(args, "mtp_num_layers", None) else None,
    )
    if args.fp16 or args.bf16:
        model = Float16Module(config, model)
    dp_group = (
        state.get_data_parallel_group(with_context_parallel=True) if state is not None else None
    )
    ddp = DistributedDataParallel(
        config,
        ddp_config_from_args(args),
        model,
        pg_collection=ProcessGroupCollection(dp_cp=dp_group),
    )
    optimizer = get_megatron_optimizer(
        optimizer_config_from_args(args),
        [model],
        model_parallel_group=state.get_model_parallel_group() if state is not None else None,
        tp_rank=state.get_tensor_model_parallel_rank() if state is not None else 0,
    )

    s, b = args.seq_length, args.micro_batch_size
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 200, (b, s), generator=g)
    labels = torch.randint(0, 200, (b, s), generator=g)
    position_ids = torch.arange(s).unsqueeze(0).expand(b, s)
    ddp.zero_grad_buffer()
    if not pre_process:
        hidden = torch.randn(s, b, args.hidden_size, generator=g, requires_grad=True)
        ddp.module.set_input_tensor(hidden.to(config.params_dtype))
        if not getattr(args, "mtp_num_layers", None):  # MTP embeds the tokens on the last stage
            tokens = None
    output = ddp(tokens, position_ids, None, labels=labels if post_process else None)
    output.float().mean().backward()
    ddp.finish_grad_sync()
    updated, _, _ = optimizer.step()
    assert updated, "the optimizer step was skipped (inf/NaN gradients)"
    return ddp, optimizer


def measured_bytes(model, optimizer):
    """Bytes of the distinct storages held for weights, gradients and optimizer state."""
    seen, totals = set(), {"weights": 0, "gradients": 0, "optimizer": 0}

    def add(tensor, kind):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen and storage.nbytes():
            seen.add(storage.data_ptr())
            totals[kind] += storage.nbytes()

    params = [p for p in model.parameters()]
    for p in params:
        add(p, "weights")
    for p in params:
        for grad in (getattr(p, "main_grad", None), p.grad):
            if grad is not None:
                add(grad, "gradients")
    for group in optimizer.param_groups:
        for p in group["params"]:  # fp32 master weights (fp32 models: the params themselves)
            add(p, "optimizer")
            if p.grad is not None:
                add(p.grad, "optimizer")
    for state in optimizer.optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value):
                add(value, "optimizer")
    return totals


def assert_matches(report, measured, rel=0.10):
    expected = {
        "weights": report.weight_bytes,
        "gradients": report.gradient_bytes,
        "optimizer": report.optimizer_bytes,
    }
    for kind in expected:
        assert measured[kind] == pytest.approx(expected[kind], rel=rel), (kind, measured, expected)
    assert sum(measured.values()) == pytest.approx(report.weight_and_optimizer_bytes, rel=rel)


LAYOUTS = {
    "fp32_adam": [],
    "bf16_adam_fp32_grads": ["--bf16"],
    "fp16_adam": ["--fp16", "--initial-loss-scale", "1024"],
    "fp32_sgd": ["--optimizer", "sgd"],
    "bf16_llama": ["--bf16"] + LLAMA,
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_weight_and_optimizer_bytes_match_one_real_step(layout):
    args = make_args(TINY + LAYOUTS[layout])
    report = compute_theoretical_memory(args)
    model, optimizer = build_and_step(args)
    measured = measured_bytes(model, optimizer)
    assert_matches(report, measured)
    # The parameter count is exact; only Adam's 4-byte step counters are not in the formula.
    assert measured["weights"] == report.weight_bytes
    assert measured["gradients"] == report.gradient_bytes


@pytest.mark.parametrize("tied", [True, False])
def test_pipeline_stages_hold_their_embedding_and_output_layer(tied):
    """PP=2: stage 0 has the embedding, stage 1 the final norm and the output layer (with tied
    embeddings, its own copy of the word embedding). Each stage is built in this process."""
    flags = TINY + ["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--bf16"]
    args = make_args(
        flags + ([] if tied else ["--untie-embeddings-and-output-weights"]), world_size=2
    )
    for rank, (pre, post) in enumerate([(True, False), (False, True)]):
        report = compute_theoretical_memory(args, pp_rank=rank)
        model, optimizer = build_and_step(args, pre_process=pre, post_process=post, num_layers=2)
        assert sum(p.numel() for p in model.parameters()) == report.parameters
        assert_matches(report, measured_bytes(model, optimizer))
    assert (
        compute_theoretical_memory(args, pp_rank=1).activations.keys()
        != compute_theoretical_memory(args, pp_rank=0).activations.keys()
    )


def _tp2_worker(rank, world_size, argv, results):
    from megatron.core.parallel_state import destroy_model_parallel, initialize_model_parallel

    args = make_args(argv, world_size=world_size)
    state = initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        model, optimizer = build_and_step(args, state=state)
        report = compute_theoretical_memory(args)
        assert sum(p.numel() for p in model.parameters()) == report.parameters
        assert_matches(report, measured_bytes(model, optimizer))
    finally:
        destroy_model_parallel()


def test_tensor_parallel_shard_matches_a_spawned_tp2_world():
    """TP=2 with sequence parallelism, bf16, Llama-style (GQA, SwiGLU, untied): each rank holds
    half of every split matrix and whole copies of the norms."""
    argv = TINY + LLAMA + ["--bf16", "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    run_distributed(_tp2_worker, 2, argv, None)


# ----------------------------------------------------------------------------- bytes per parameter
@pytest.mark.parametrize(
    "precision,plain,sharded", [([], 16, 8), (["--bf16"], 18, 6), (["--fp16"], 20, 4)]
)
def test_distributed_optimizer_bytes_per_parameter(precision, plain, sharded):
    """Megatron's bytes per parameter: fp32 16 -> 8 + 8/d, bf16 + fp32 grads 18 -> 6 + 12/d,
    fp16 20 -> 4 + 16/d, d = data parallel x context parallel (the group the distributed
    optimizer shards over)."""
    base = TINY + precision + ["--global-batch-size", "16"]
    args, _ = tool.validated_args(base, 8)
    assert bytes_per_parameter(args).total == plain
    for extra, d in (
        (["--use-distributed-optimizer"], 8),
        (["--use-distributed-optimizer", "--context-parallel-size", "2"], 8),
        (["--use-distributed-optimizer", "--tensor-model-parallel-size", "2"], 4),
    ):
        args, notes = tool.validated_args(base + extra, 8)
        assert bytes_per_parameter(args).total == pytest.approx(sharded + (plain - sharded) / d)
        assert bytes_per_parameter(args).shards == d


MOE_DISTOPT = ["--num-experts", "4", "--moe-ffn-hidden-size", "48", "--disable-bias-linear"]
MOE_DISTOPT += ["--bf16", "--global-batch-size", "16", "--use-distributed-optimizer"]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]


@pytest.mark.parametrize(
    "layout, ep, etp, dense_shards, expert_shards",
    [
        (TP2_SP + ["--expert-model-parallel-size", "2"], 2, 2, 4, 2),
        (["--expert-model-parallel-size", "4"], 4, 1, 8, 2),
        (TP2_SP + ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"],
         2, 1, 4, 4),
    ],
    ids=["tp2-ep2-etp2", "ep4", "tp2-ep2-etp1"],
)  # fmt: skip
def test_distributed_optimizer_shards_expert_state_over_expert_data_parallel(
    layout, ep, etp, dense_shards, expert_shards
):
    """8 GPUs, bf16 (12 optimizer bytes per parameter unsharded): the distributed optimizer
    shards the dense parameters' state over DP x CP = 8 / TP ranks and the routed experts' over
    the expert-data-parallel group, 8 / (ETP x EP) ranks."""
    args, _ = tool.validated_args(TINY + MOE_DISTOPT + layout, 8)
    report = compute_theoretical_memory(args)
    # By hand: 2 MoE layers x (4 / EP) experts x (fc1 [48, 64] + fc2 [64, 48]) / ETP.
    experts = 2 * (4 // ep) * (48 * 64 + 64 * 48) // etp
    assert report.expert_parameters == experts
    dense = report.parameters - experts
    expected = dense * 12 / dense_shards + experts * 12 / expert_shards
    assert report.optimizer_bytes == pytest.approx(expected)
    assert report.weight_and_optimizer_bytes == pytest.approx(
        report.parameters * (2 + 4) + expected
    )
    line = f"sharded over {expert_shards} expert-data-parallel ranks"
    assert (line in "\n".join(report.breakdown_lines())) == (dense_shards != expert_shards)


def test_dry_run_model_state_shards_expert_state_over_expert_data_parallel():
    """The dry run's model-state figure on 8 GPUs, TP2 EP2 (ETP = TP), bf16: 4 layers of 8
    experts [4096 x 1024] x 2 (no biases), a quarter of them on each rank, with their optimizer
    state (12 bytes/param) over 8 / (2 x 2) = 2 ranks; everything else over DP = 4."""
    from megatron.training import dry_run

    big = ["--hidden-size", "1024", "--num-attention-heads", "8", "--num-layers", "4"]
    big += ["--moe-ffn-hidden-size", "4096", "--num-experts", "8"]
    flags = TINY + MOE_DISTOPT[4:] + ["--expert-model-parallel-size", "2"]
    args, _ = tool.validated_args(flags + TP2_SP + big, 8)
    lines = dict(dry_run.layout_lines(args, 256, None))
    largest = int(lines["parameters on the largest model-parallel rank"].split()[0])
    experts = 4 * 8 * 2 * 4096 * 1024 // 4
    expected = (largest - experts) * (2 + 4 + 12 / 4) + experts * (2 + 4 + 12 / 2)
    gigabytes = lines["model-state memory per GPU (GB)"]
    assert gigabytes.startswith(f"{expected / 2**30:.2f} (9 bytes/param")
    assert "routed experts' optimizer state over 2 expert-DP ranks" in gigabytes


@pytest.mark.parametrize("precision,plain", [([], 16), (["--bf16"], 18)])
def test_fsdp2_shards_everything_over_data_parallel(precision, plain):
    """FSDP2 (ZeRO-3): weights, gradients and optimizer state all divided by DP x CP."""
    base = (
        TINY
        + precision
        + [
            "--global-batch-size",
            "16",
            "--untie-embeddings-and-output-weights",
            "--no-gradient-accumulation-fusion",
            "--ckpt-format",
            "torch_dist",
        ]
    )
    for extra, d in (
        (["--use-torch-fsdp2"], 8),
        (["--use-torch-fsdp2", "--tensor-model-parallel-size", "2"], 4),
    ):
        args, _ = tool.validated_args(base + extra, 8)
        per = bytes_per_parameter(args)
        assert per.total == pytest.approx(plain / d) and per.shards == d and per.params_sharded


def test_megatron_fsdp_strategies_shard_more_and_more():
    """--use-megatron-fsdp at DP 8, fp32 Adam: no_shard 16, optim (ZeRO-1) 4 + 4 + 8/8,
    optim_grads (ZeRO-2) 4 + 4/8 + 8/8, optim_grads_params (ZeRO-3) 16/8 bytes per parameter."""
    base = TINY + ["--global-batch-size", "16", "--use-megatron-fsdp"]
    base += ["--ckpt-format", "fsdp_dtensor", "--untie-embeddings-and-output-weights"]
    expected = {"no_shard": 16, "optim": 9, "optim_grads": 5.5, "optim_grads_params": 2}
    for strategy, total in expected.items():
        args, _ = tool.validated_args(base + ["--data-parallel-sharding-strategy", strategy], 8)
        per = bytes_per_parameter(args)
        assert per.total == pytest.approx(total), (strategy, per)
        assert per.grads_sharded == (strategy == "optim_grads"), strategy


def test_sgd_without_momentum_keeps_no_state():
    assert (
        bytes_per_parameter(make_args(TINY + ["--optimizer", "sgd", "--sgd-momentum", "0"])).total
        == 8
    )


# ----------------------------------------------------------------------------- activations
def _gpt_argv():
    # Dropout 0 changes none of these numbers: the formula counts the dropout masks whatever
    # the rate, as Megatron's formula does.
    return megatron_argv(
        num_layers=8,
        hidden_size=256,
        num_attention_heads=8,
        seq_length=512,
        max_position_embeddings=512,
        micro_batch_size=2,
        vocab_size=1000,
        train_iters=1,
        lr=1e-3,
        bf16=True,
        attention_dropout=0,
        hidden_dropout=0,
    )


def _gpt(extra=(), world_size=1):
    """GPT-3-like shapes (ffn = 4h) so the formula's constants are the paper's."""
    return make_args(_gpt_argv() + list(extra), world_size)


def test_layer_activation_formula_matches_the_paper():
    # The paper's attention keeps its scores: the unfused path.
    unfused = ["--attention-backend", "unfused"]
    s, b, h, a = 512, 2, 256, 8
    sbh = s * b * h
    assert layer_activation_bytes(_gpt(unfused)).total == sbh * (34 + 5 * a * s / h)
    t = 4
    tp = unfused + ["--tensor-model-parallel-size", "4"]
    assert layer_activation_bytes(_gpt(tp, 4)).total == pytest.approx(
        sbh * (10 + 24 / t + 5 * a * s / (h * t))
    )
    assert layer_activation_bytes(_gpt(tp + ["--sequence-parallel"], 4)).total == pytest.approx(
        sbh / t * (34 + 5 * a * s / h)
    )
    assert layer_activation_bytes(
        _gpt(tp + ["--sequence-parallel", "--recompute-activations"], 4)
    ).total == pytest.approx(sbh / t * 34)
    # fp32 doubles everything but the three 1-byte dropout masks (2 sbh + a s^2 b).
    fp32 = make_args([x for x in _gpt_argv() if x != "--bf16"] + unfused)
    assert layer_activation_bytes(fp32).total == pytest.approx(
        2 * sbh * (34 + 5 * a * s / h) - 2 * sbh - a * s * s * b
    )


def test_attention_scores_are_counted_only_where_the_attention_keeps_them():
    s, b, h, a = 512, 2, 256, 8
    sbh, scores = s * b * h, 5 * a * s * s * b
    fp32_argv = [x for x in _gpt_argv() if x != "--bf16"]
    for backend in ("auto", "flash", "fused"):  # a GPU run's SDPA kernels keep no scores
        assert layer_activation_bytes(_gpt(["--attention-backend", backend])).total == 34 * sbh
    assert layer_activation_bytes(_gpt(["--attention-backend", "local"])).total == (
        34 * sbh + scores
    )
    # On CPU, auto runs the unfused path for fp32 up to 1024 tokens, SDPA for bf16 or longer.
    assert layer_activation_bytes(_gpt(), "cpu").attention_scores == 0
    assert layer_activation_bytes(make_args(fp32_argv), "cpu").attention_scores == 9 * a * s * s * b
    assert layer_activation_bytes(make_args(fp32_argv), "cuda").attention_scores == 0
    longer = [x if x != "512" else "2048" for x in fp32_argv]
    assert layer_activation_bytes(make_args(longer), "cpu").attention_scores == 0
    # A mask tensor (--reset-attention-mask, BERT's padding) or CP's ring attention: SDPA.
    unfused = ["--attention-backend", "unfused"]
    masked = _gpt(unfused + ["--reset-attention-mask"])
    assert layer_activation_bytes(masked).attention_scores == 0
    assert layer_activation_bytes(_gpt(unfused), explicit_mask=True).attention_scores == 0
    ring = _gpt(unfused + ["--context-parallel-size", "2"], world_size=2)
    assert layer_activation_bytes(ring).attention_scores == 0
    bert = get_model_family("bert")
    layers = bert.activation_components(_gpt(unfused), 1, 0, 8)["transformer layers"]
    assert layers == 8 * 34 * sbh
    # The trainer reports for the device it runs on.
    cpu = compute_theoretical_memory(make_args(fp32_argv), device_type="cpu")
    assert (
        cpu.activations["transformer layers"]
        == 8 * layer_activation_bytes(make_args(fp32_argv), "cpu").total
    )
    assert "on cpu" in "\n".join(cpu.breakdown_lines())


def _largest_saved_tensor(backend, dtype, seq):
    """numel of the largest tensor the attention saves for backward (CPU, 2 heads, d 16)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from tests.unit_tests.tiny_configs import tiny_transformer_config

    config = tiny_transformer_config(num_layers=1, attention_backend=backend)
    attention = DotProductAttention(config, layer_number=1)
    q, k, v = (torch.randn(seq, 1, 2, 16, dtype=dtype, requires_grad=True) for _ in range(3))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(t.numel()) or t, lambda t: t
    ):
        attention(q, k, v, None)
    return max(saved)


@pytest.mark.parametrize(
    "backend, dtype, seq",
    [
        ("auto", torch.float32, 256),
        ("auto", torch.bfloat16, 256),
        ("auto", torch.float32, 1040),
        ("flash", torch.float32, 256),
        ("unfused", torch.float32, 256),
        ("unfused", torch.bfloat16, 256),
    ],
)
def test_the_report_counts_scores_exactly_where_attention_saves_them(backend, dtype, seq):
    """Reality check on CPU: a tensor of a quarter of the score matrix (or more) is saved for
    backward exactly when the report counts the score term."""
    from types import SimpleNamespace

    args = SimpleNamespace(
        attention_backend=backend, bf16=dtype == torch.bfloat16, fp16=False, seq_length=seq
    )
    keeps = attention_keeps_scores(args, "cpu")
    assert keeps == (_largest_saved_tensor(backend, dtype, seq) >= 2 * seq * seq / 4)
    assert keeps == (
        backend == "unfused" or (dtype == torch.float32 and seq <= 1024 and backend == "auto")
    )


def test_full_recompute_keeps_only_the_chunk_inputs():
    s, b, h = 512, 2, 256
    none = compute_theoretical_memory(_gpt())
    uniform = compute_theoretical_memory(
        _gpt(
            [
                "--recompute-granularity",
                "full",
                "--recompute-method",
                "uniform",
                "--recompute-num-layers",
                "2",
            ]
        )
    )
    per_layer = layer_activation_bytes(_gpt()).total
    assert (
        uniform.activations["transformer layers (checkpointed inputs)"] == 4 * 2 * s * b * h
    )  # 8 layers / 2
    assert uniform.activations["recompute working set (one chunk)"] == 2 * per_layer
    assert none.activations["transformer layers"] == 8 * per_layer
    block = compute_theoretical_memory(
        _gpt(
            [
                "--recompute-granularity",
                "full",
                "--recompute-method",
                "block",
                "--recompute-num-layers",
                "3",
            ]
        )
    )
    assert block.activations["transformer layers (checkpointed inputs)"] == 3 * 2 * s * b * h
    assert block.activations["transformer layers (not recomputed)"] == 5 * per_layer
    assert uniform.activation_bytes < block.activation_bytes < none.activation_bytes


def test_microbatches_in_flight_of_the_schedules():
    args = _gpt(["--pipeline-model-parallel-size", "4", "--global-batch-size", "16"], 4)
    assert [microbatches_in_flight(args, 8, r) for r in range(4)] == [4, 3, 2, 1]
    assert microbatches_in_flight(args, 2, 0) == 2
    args = _gpt(
        [
            "--pipeline-model-parallel-size",
            "4",
            "--num-layers-per-virtual-pipeline-stage",
            "1",
            "--global-batch-size",
            "16",
        ],
        4,
    )
    vp, pp = 2, 4
    # Megatron's interleaving penalty on the first stage: PP x (1 + (PP - 1) / (PP x VP)).
    assert microbatches_in_flight(args, 8, 0) == pytest.approx(pp * (1 + (pp - 1) / (pp * vp)))
    # Megatron's factor assumes enough micro-batches; with M = PP every chunk's forward runs
    # before the first backward, so all M micro-batches (not more) are in flight.
    assert microbatches_in_flight(args, 4, 0) == 4
    assert microbatches_in_flight(_gpt(), 8, 0) == 1  # no pipelining: one micro-batch at a time


def megatron_activation_formula(args, num_microbatches):
    """Megatron's compute_activation_memory (sequence parallel + selective recompute), from
    its published formula: per layer sbh(18 + 4 ffn/h), embedding 8sb + sbh per in-flight
    micro-batch, interleaving penalty or min(1, M/PP), output layer 4sbh(1 + V/h) at PP=1, / TP."""
    s, b, h = args.seq_length, args.micro_batch_size, args.hidden_size
    pp, tp = args.pipeline_model_parallel_size, args.tensor_model_parallel_size
    memory = s * b * h * (18 + 4 * args.ffn_hidden_size / h) * args.num_layers
    memory += 8 * s * b * pp + s * b * h * pp
    vp = args.virtual_pipeline_model_parallel_size
    if vp is not None:
        memory *= 1 + (pp - 1) / (pp * vp)
    elif pp > 1:
        memory *= min(1, num_microbatches / pp)
    if pp == 1:
        memory += s * b * h * 4 * (1 + args.padded_vocab_size / h)
    return memory / tp


@pytest.mark.parametrize(
    "layout",
    [
        ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
        [
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
            "--pipeline-model-parallel-size",
            "4",
        ],
        [
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
            "--pipeline-model-parallel-size",
            "4",
            "--global-batch-size",
            "4",
        ],
        [
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
            "--pipeline-model-parallel-size",
            "2",
            "--num-layers-per-virtual-pipeline-stage",
            "2",
            "--global-batch-size",
            "16",
        ],
    ],
)
def test_activations_equal_megatrons_formula_in_the_case_it_assumes(layout):
    args = _gpt(layout + ["--recompute-activations"], world_size=8)
    m = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    ours = compute_theoretical_memory(args, m).activation_bytes
    # Only difference: the int64 token ids are not split over TP here (8sb per micro-batch).
    assert ours == pytest.approx(megatron_activation_formula(args, m), rel=1e-3)


def test_summary_line_is_megatrons():
    report = compute_theoretical_memory(_gpt())
    line = report.summary_line()
    match = re.fullmatch(
        r"Theoretical memory footprints: weight and optimizer=(\d+\.\d\d) MB, "
        r"activation=(\d+\.\d\d) MB, total=(\d+\.\d\d) MB",
        line,
    )
    assert match, line
    wo, act, total = (float(x) for x in match.groups())
    assert wo == round(report.weight_and_optimizer_bytes / NUM_BYTES_IN_MEGABYTE, 2)
    assert total == pytest.approx(wo + act, abs=0.011)


# ----------------------------------------------------------------------------- the tool
# The layout comes last, as extra: a test drops it with LLAMA3_8B[:-3].
LLAMA3_8B = megatron_argv(
    "--tensor-model-parallel-size",
    "2",
    "--sequence-parallel",
    num_layers=32,
    hidden_size=4096,
    ffn_hidden_size=14336,
    num_attention_heads=32,
    group_query_attention=True,
    num_query_groups=8,
    seq_length=8192,
    max_position_embeddings=8192,
    position_embedding_type="rope",
    rotary_base=500000,
    normalization="RMSNorm",
    swiglu=True,
    untie_embeddings_and_output_weights=True,
    disable_bias_linear=True,
    attention_dropout=0.0,
    hidden_dropout=0.0,
    micro_batch_size=1,
    global_batch_size=128,
    train_iters=10,
    lr=3e-4,
    bf16=True,
    vocab_size=128256,
)
SUMMARY = re.compile(
    r"^Theoretical memory footprints: weight and optimizer=([\d.]+) MB, "
    r"activation=([\d.]+) MB, total=([\d.]+) MB$",
    re.M,
)


def _run_tool(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = tool.main(argv)
    return code, out.getvalue(), err.getvalue()


def _tp_rank_parameters_of_meta_model(args):
    """Parameters per TP rank of the real model built on the meta device at TP=1: split params
    (tensor_model_parallel) are divided by TP, the rest are whole on every rank."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.training.configs import core_transformer_config_from_args

    tp = args.tensor_model_parallel_size
    args.tensor_model_parallel_size, args.sequence_parallel = 1, False
    config = core_transformer_config_from_args(args)
    args.tensor_model_parallel_size, args.sequence_parallel = tp, True
    config.init_model_with_meta_device = True
    config.__post_init__()
    model = GPTModel(
        config,
        get_gpt_decoder_block_spec(config, use_transformer_engine=False),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
    )
    names_split = (
        "linear_qkv.weight",
        "linear_proj.weight",
        "linear_fc1.weight",
        "linear_fc2.weight",
        "word_embeddings.weight",
        "output_layer.weight",
    )
    return sum(
        p.numel() // tp if n.endswith(names_split) else p.numel()
        for n, p in model.named_parameters()
    )


def test_tool_llama3_8b_on_8_gpus_tp2():
    argv = LLAMA3_8B + ["--recompute-activations"]
    code, out, err = _run_tool(["--world-size", "8"] + argv)
    assert code == 0, err
    lines = SUMMARY.findall(out)
    assert len(lines) == 1, out
    wo, act, total = (float(x) for x in lines[0])

    args = make_args(argv, world_size=8)
    report = compute_theoretical_memory(args)
    mb = NUM_BYTES_IN_MEGABYTE
    assert (wo, act, total) == (
        round(report.weight_and_optimizer_bytes / mb, 2),
        round(report.activation_bytes / mb, 2),
        round(report.total_bytes / mb, 2),
    )
    assert "TP 2 x PP 1 x CP 1 x DP 4" in out and "18 bytes/parameter" in out
    # Independent checks: the parameters per TP rank of the real model, 18 bytes each (bf16,
    # fp32 grads, Adam), and Megatron's activation formula (SP + selective recompute).
    params = _tp_rank_parameters_of_meta_model(args)
    assert report.parameters == params
    assert 8.0e9 / 2 < params < 8.1e9 / 2
    assert wo == pytest.approx(params * 18 / mb, abs=0.01)
    assert act == pytest.approx(megatron_activation_formula(args, 32) / mb, rel=1e-3)


def test_tool_command_line_with_the_distributed_optimizer_and_pipeline_stages():
    """The script as users run it: the distributed optimizer shards the optimizer state, one
    report line per pipeline stage."""
    argv = [a if a != "128" else "64" for a in LLAMA3_8B] + [
        "--use-distributed-optimizer",
        "--pipeline-model-parallel-size",
        "2",
    ]
    result = subprocess.run(
        [sys.executable, str(REPO / "tools" / "report_theoretical_memory.py"), "--world-size", "8"]
        + argv,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "not supported" not in result.stderr, result.stderr
    assert len(SUMMARY.findall(result.stdout)) == 2
    assert (
        "12 bytes/parameter (weight 2 + gradient 4 + optimizer 6, optimizer sharded over 2 ranks)"
        in result.stdout
    )


def test_tool_refuses_flags_it_cannot_account():
    code, _, err = _run_tool(["--world-size", "8"] + LLAMA3_8B + ["--moe-use-upcycling"])
    assert code == 2 and "error: not supported yet: --moe-use-upcycling" in err
    code, _, err = _run_tool(
        ["--world-size", "6"] + LLAMA3_8B[:-3] + ["--tensor-model-parallel-size", "4"]
    )
    assert code == 2 and "error:" in err
    code, _, err = _run_tool(["--world-size"])
    assert code == 2 and "--world-size needs a value" in err


@pytest.mark.parametrize(
    "extra",
    [
        [
            "--num-experts",
            "4",
            "--moe-ffn-hidden-size",
            "48",
            "--moe-shared-expert-intermediate-size",
            "32",
            "--moe-shared-expert-gate",
            "--moe-layer-freq",
            "2",
        ],
        ["--num-experts", "4", "--swiglu", "--disable-bias-linear"],
    ],
    ids=["moe-every-2nd-shared-gate", "moe-swiglu-no-bias"],
)
def test_moe_parameter_count_equals_the_built_model(extra):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.training.configs import core_transformer_config_from_args
    from megatron.training.theoretical_memory import count_parameters
    from tests.unit_tests.tiny_configs import tiny_args

    args = tiny_args(*extra)
    config = core_transformer_config_from_args(args)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_decoder_block_spec(config, use_transformer_engine=False),
        vocab_size=128,
        max_sequence_length=args.max_position_embeddings,
        share_embeddings_and_output_weights=True,
    )
    count = count_parameters(args, 128)
    assert count.total == sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert count.num_moe_layers * count.moe_experts == experts


@pytest.mark.parametrize(
    "extra",
    [
        ["--qk-layernorm", "--attention-output-gate", "--swiglu", "--disable-bias-linear"],
        ["--num-experts", "4", "--normalization", "RMSNorm"],
    ],
    ids=["gated-attention-qk-norm", "moe-biases"],
)
def test_gated_delta_net_parameter_count_equals_the_built_model(extra):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_transformer_block_with_experimental_attention_variant_spec,
    )
    from megatron.training.configs import core_transformer_config_from_args
    from megatron.training.theoretical_memory import count_parameters
    from tests.unit_tests.tiny_configs import tiny_args

    gdn = ["--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq", "2"]
    gdn += ["--linear-key-head-dim", "8", "--linear-value-head-dim", "16"]
    gdn += ["--linear-num-key-heads", "2", "--linear-num-value-heads", "4"]
    args = tiny_args(*gdn, *extra)
    config = core_transformer_config_from_args(args)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_transformer_block_with_experimental_attention_variant_spec(
            config
        ),
        vocab_size=128,
        max_sequence_length=args.max_position_embeddings,
        share_embeddings_and_output_weights=True,
    )
    count = count_parameters(args, 128)
    assert count.num_linear_layers == args.num_layers // 2
    assert count.total == sum(p.numel() for p in model.parameters())


def test_fused_cross_entropy_counts_one_chunk_of_logits():
    """--cross-entropy-loss-fusion keeps one chunk's fp32 numerator (the chunked fused loss), not
    the micro-batch's [s*b, V] fp32 logits; every other part is unchanged."""
    from megatron.core.fusions.fused_linear_cross_entropy import CHUNK_ELEMENTS

    # GPT-2 large's micro-batch 32 x 1024 and vocabulary: 13 chunks, one kept.
    gpt2 = ["--seq-length", "1024", "--max-position-embeddings", "1024", "--vocab-size", "50256"]
    gpt2 += ["--micro-batch-size"]
    plain = activation_components(_gpt(gpt2 + ["32"]))
    fused = activation_components(_gpt(gpt2 + ["32", "--cross-entropy-loss-fusion"]))
    logits = plain.pop("output layer and loss (input, fp32 logits)")
    chunk = fused.pop("output layer and loss (input, fp32 logits of one chunk)")
    assert fused == plain
    s, b, h, vocab = 1024, 32, 256, 50304  # the NullTokenizer's 50,257 tokens, padded
    assert logits == 4 * s * b * h + 4 * s * b * vocab
    assert chunk == 4 * s * b * h + 4 * 2521 * vocab and 2521 * vocab <= CHUNK_ELEMENTS


@pytest.mark.parametrize(
    "extra",
    [[], ["--untie-embeddings-and-output-weights"], ["--num-experts", "4"]],
    ids=["tied", "untied", "moe"],
)
def test_multi_token_prediction_parameters_are_counted_on_the_last_stage(extra):
    """--mtp-num-layers 2 at PP=2: the last stage holds the MTP depths (a layer like the last
    one, whose kind follows the model's last layer, plus enorm, hnorm, eh_proj, final norm) and
    its copy of the word embedding, tied or not; each stage's count is the built stage's."""
    mtp = ["--mtp-num-layers", "2", "--position-embedding-type", "rope"]
    flags = TINY + ["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--bf16"]
    args = make_args(flags + mtp + extra, world_size=2)
    for rank, (pre, post) in enumerate([(True, False), (False, True)]):
        report = compute_theoretical_memory(args, pp_rank=rank)
        model, _ = build_and_step(args, pre_process=pre, post_process=post, num_layers=2)
        from megatron.core.utils import unwrap_model

        assert hasattr(unwrap_model(model), "mtp") == post
        assert sum(p.numel() for p in model.parameters()) == report.parameters, rank


@pytest.mark.parametrize("extra", [[], ["--cross-entropy-loss-fusion"]], ids=["plain", "fused"])
def test_multi_token_prediction_activations_are_on_the_last_stage(extra):
    """Each MTP depth adds to the last stage one layer's activations, its enorm, hnorm and
    eh_proj inputs (4*s*b*h 16-bit elements) and a second output layer and loss; the first
    stage is unchanged."""
    flags = TINY + ["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--bf16"]
    flags += ["--position-embedding-type", "rope"] + extra
    plain = make_args(flags, world_size=2)
    mtp = make_args(flags + ["--mtp-num-layers", "2"], world_size=2)
    assert activation_components(mtp, pp_rank=0) == activation_components(plain, pp_rank=0)
    without = activation_components(plain, pp_rank=1)
    with_mtp = activation_components(mtp, pp_rank=1)
    added = with_mtp.pop("multi-token prediction (layers, eh_proj inputs, logits)")
    assert with_mtp == without
    s, b, h = 16, 2, 64
    layer = layer_activation_bytes(plain, "cuda").total  # one micro-batch in flight
    logits = next(v for k, v in without.items() if k.startswith("output layer"))
    assert added == 2 * (layer + 4 * 2 * s * b * h + logits)
