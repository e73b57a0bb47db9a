"""FSDP2 (``TorchFullyShardedDataParallel``) on CPU/gloo against the one-process model.

In a spawned world of 2 ranks (DP=2) every rank builds the one-process reference GPT and the same
GPT sharded with ``fully_shard`` (each transformer layer, then the root). Ten iterations of
2 micro-batches (the first inside ``no_sync``) run on both: the reference on the whole global
batch, each FSDP rank on its half. Checked:

* each rank holds 1/DP of every parameter (the shards add up to the full parameter);
* per iteration, the loss (averaged over DP) and the clipped gradient norm equal the reference's;
* after 10 steps the gathered parameters equal the one-process reference's and those of plain
  DDP at the same DP=2;
* the model-parallel attributes survive sharding, and per-token scaling reaches the shards.

The run is done twice. In float64 norms and parameters hold to 1e-12 (measured: 5e-16), which leaves
no room for a wrong shard, scale or reduction; the loss itself is computed in fp32 (the logits are
cast with ``.float()``, which Megatron's loss does too), so it holds to 1e-6 (measured: 6e-8). In
float32 the per-rank half batches round differently from the whole batch, and Adam, dividing by
sqrt(v), magnifies those last bits from step to step (gradient norm against the one-process run:
4e-7 at iteration 1, 4e-6 at 8, 1.6e-5 at 9; parameters: 1e-5 after 10); there the one-process norm
and parameter comparisons use 1e-4, while FSDP against DDP on the same halves stays at 1e-5
(measured: 5e-16).
"""

import pytest
import torch

from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    TorchFullyShardedDataParallel,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.tensor_parallel import ProcessGroupCollection
from tests.harness.argv import megatron_argv
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.tiny_configs import tiny_gpt_model, tiny_transformer_config, validated_args

VOCAB, SEQ, LAYERS = 64, 16, 2
MICRO, PER_RANK = 2, 2  # micro-batches per iteration, sequences per rank and micro-batch
ITERATIONS = 10
# dtype -> (losses against the one-process run, norms and parameters against it, anything against
# DDP at the same DP=2); see the module docstring for the measured errors.
TOLERANCES = {torch.float64: (1e-6, 1e-12, 1e-12), torch.float32: (1e-5, 1e-4, 1e-5)}


def _build(dtype=torch.float32):
    config = tiny_transformer_config(num_layers=LAYERS, ffn_hidden_size=64, params_dtype=dtype)
    return tiny_gpt_model(
        config,
        seed=1234,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    )


def _micro_batch(iteration, micro, world):
    g = torch.Generator().manual_seed(100 * iteration + micro)
    tokens = torch.randint(0, VOCAB, (world * PER_RANK, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (world * PER_RANK, SEQ), generator=g)
    return tokens, labels


def _loss(model, tokens, labels):
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(tokens.shape[0], SEQ)
    return model(tokens, position_ids, None, labels=labels).mean() / MICRO


def _rel_err(actual, expected):
    return (
        (actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)
    ).item()


def _worker(rank, world, dtype):
    from megatron.core.parallel_state import destroy_model_parallel, initialize_model_parallel

    loss_rtol, ref_rtol, ddp_rtol = TOLERANCES[dtype]
    torch.set_num_threads(1)
    state = initialize_model_parallel()
    opt_config = OptimizerConfig(lr=1e-2, clip_grad=0.5, weight_decay=0.1)

    ref = _build(dtype)
    ref_opt = get_megatron_optimizer(opt_config, [ref])
    module = _build(dtype)
    marked = {
        n
        for n, p in module.named_parameters()
        if getattr(p, "tensor_model_parallel", None) is not None
    }
    fsdp = TorchFullyShardedDataParallel(
        DistributedDataParallelConfig(),
        module,
        state.get_data_parallel_group(with_context_parallel=True),
    )
    opt = get_megatron_optimizer(
        opt_config, [fsdp.local_shards()], model_parallel_group=state.group("tp-dp-cp")
    )

    # The reference: plain DDP at the same DP=2 on the same local halves.
    ddp_module = _build(dtype)
    ddp = DistributedDataParallel(
        None,
        DistributedDataParallelConfig(),
        ddp_module,
        pg_collection=ProcessGroupCollection(
            dp_cp=state.get_data_parallel_group(with_context_parallel=True)
        ),
    )
    ddp_opt = get_megatron_optimizer(opt_config, [ddp_module])

    ref_params = dict(ref.named_parameters())
    for name, param in module.named_parameters():
        assert name in marked and hasattr(param, "tensor_model_parallel"), name
        local = param.to_local()
        total = torch.tensor([local.numel()])
        torch.distributed.all_reduce(total)
        assert int(total) == ref_params[name].numel(), name
        assert (
            local.numel() <= -(-ref_params[name].shape[0] // world) * ref_params[name][0].numel()
        ), name
    assert len(fsdp.sharded_units) == LAYERS

    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    for iteration in range(ITERATIONS):
        ref_opt.zero_grad()
        ref_loss = 0.0
        for micro in range(MICRO):
            tokens, labels = _micro_batch(iteration, micro, world)
            loss = _loss(ref, tokens, labels)
            loss.backward()
            ref_loss += loss.item()
        _, ref_norm, _ = ref_opt.step()

        opt.zero_grad()
        fsdp.zero_grad_buffer()
        local_loss = torch.zeros((), dtype=dtype)
        with fsdp.no_sync():
            tokens, labels = _micro_batch(iteration, 0, world)
            loss = _loss(fsdp, tokens[mine], labels[mine])
            loss.backward()
            local_loss += loss.detach()
        tokens, labels = _micro_batch(iteration, 1, world)
        loss = _loss(fsdp, tokens[mine], labels[mine])
        loss.backward()
        local_loss += loss.detach()
        fsdp.finish_grad_sync()
        torch.distributed.all_reduce(local_loss)
        _, norm, _ = opt.step()

        ddp_opt.zero_grad()
        ddp.zero_grad_buffer()
        with ddp.no_sync():
            tokens, labels = _micro_batch(iteration, 0, world)
            _loss(ddp, tokens[mine], labels[mine]).backward()
        tokens, labels = _micro_batch(iteration, 1, world)
        _loss(ddp, tokens[mine], labels[mine]).backward()
        ddp.finish_grad_sync()
        _, ddp_norm, _ = ddp_opt.step()
        assert abs(norm - ddp_norm) <= ddp_rtol * ddp_norm, (iteration, norm, ddp_norm)
        assert abs(local_loss.item() / world - ref_loss) <= loss_rtol * abs(ref_loss), (
            iteration,
            local_loss,
            ref_loss,
        )
        assert abs(norm - ref_norm) <= ref_rtol * ref_norm, (iteration, norm, ref_norm)

    ddp_params = dict(ddp_module.named_parameters())
    for name, param in module.named_parameters():
        err = _rel_err(param.full_tensor().detach(), ref_params[name].detach())
        assert err <= ref_rtol, f"{name}: relative error {err:.2e}"
        err = _rel_err(param.full_tensor().detach(), ddp_params[name].detach())
        assert err <= ddp_rtol, f"{name}: relative error against DDP {err:.2e}"

    # Per-token loss scaling multiplies this rank's gradient shards.
    shard = fsdp._shards[0][2].main_grad.clone()
    fsdp.scale_gradients(0.5)
    assert torch.equal(fsdp._shards[0][2].main_grad, shard * 0.5)
    destroy_model_parallel()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fsdp2_dp2_matches_one_process_with_accumulation_and_clipping(dtype):
    run_distributed(_worker, 2, dtype)


def test_fsdp2_needs_torch_distributed_and_refuses_the_distributed_optimizer():
    import pytest

    with pytest.raises(ValueError, match="use-torch-fsdp2 needs torch.distributed"):
        TorchFullyShardedDataParallel(DistributedDataParallelConfig(), _build())
    with pytest.raises(ValueError, match="cannot be combined with --use-distributed-optimizer"):
        TorchFullyShardedDataParallel(
            DistributedDataParallelConfig(use_distributed_optimizer=True), _build()
        )


# ------------------------------------------------------------------ flags
_ARGV = megatron_argv(num_layers=2, max_position_embeddings=128)
_FSDP2 = [
    "--use-torch-fsdp2",
    "--no-gradient-accumulation-fusion",
    "--untie-embeddings-and-output-weights",
]


def _validate(monkeypatch, *extra, world_size=2):
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    return validated_args(_ARGV + list(extra), world_size)


def _error(monkeypatch, *extra, world_size=2):
    import pytest

    from megatron.training.arguments import ArgumentValidationError

    with pytest.raises(ArgumentValidationError) as info:
        _validate(monkeypatch, *extra, world_size=world_size)
    return str(info.value)


def test_fsdp_flags_and_sharding_strategy_mapping(monkeypatch):
    from megatron.training.training import uses_torch_fsdp2

    args = _validate(monkeypatch, *_FSDP2)  # default --ckpt-format torch_dist
    assert uses_torch_fsdp2(args) and not args.use_distributed_optimizer
    # --use-megatron-fsdp: the strategy picks the machinery (and the optimizer).
    mfsdp = ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor", "--use-distributed-optimizer"]
    for strategy, dist_opt, fsdp2 in (
        ("no_shard", False, False),
        ("optim", True, False),
        ("optim_grads", True, False),
        ("optim_grads_params", False, True),
    ):
        extra = mfsdp + ["--data-parallel-sharding-strategy", strategy]
        if fsdp2:
            extra += _FSDP2[1:]
        args = _validate(monkeypatch, *extra)
        assert (args.use_distributed_optimizer, uses_torch_fsdp2(args)) == (dist_opt, fsdp2), (
            strategy
        )
    args = _validate(
        monkeypatch,
        "--use-megatron-fsdp",
        "--ckpt-format",
        "fsdp_dtensor",
        "--data-parallel-sharding-strategy",
        "optim",
        "--overlap-grad-reduce",
        "--overlap-param-gather",
    )
    assert args.use_distributed_optimizer and args.overlap_param_gather


def test_megatron_fsdp_turns_off_grad_accumulation_fusion_and_takes_expert_parallelism(
    monkeypatch, capsys
):
    # Megatron-LM warns and turns the fusion off (torch FSDP2 refuses it); expert parallelism
    # runs with every strategy (experts sharded over expert DP under optim_grads_params).
    for strategy in ("no_shard", "optim", "optim_grads", "optim_grads_params"):
        args = _validate(
            monkeypatch,
            "--use-megatron-fsdp",
            "--ckpt-format",
            "fsdp_dtensor",
            "--data-parallel-sharding-strategy",
            strategy,
            "--num-experts",
            "4",
            "--expert-model-parallel-size",
            "2",
        )
        assert not args.gradient_accumulation_fusion, strategy
        assert args.expert_model_parallel_size == 2
    out = capsys.readouterr().out
    assert (
        "WARNING: Gradient accumulation fusion is not supported with Megatron-FSDP, "
        "setting to False"
    ) in out, out


def test_fsdp_flag_errors_name_the_flags(monkeypatch):
    assert "--data-parallel-sharding-strategy optim needs --use-megatron-fsdp" in _error(
        monkeypatch, "--data-parallel-sharding-strategy", "optim"
    )
    assert (
        "--data-parallel-sharding-strategy no_shard cannot be used with --use-torch-fsdp2"
        in _error(monkeypatch, *_FSDP2, "--data-parallel-sharding-strategy", "no_shard")
    )
    assert "--use-torch-fsdp2 does not support pipeline parallelism" in _error(
        monkeypatch, *_FSDP2, "--pipeline-model-parallel-size", "2"
    )
    assert "--use-torch-fsdp2 does not support expert parallelism" in _error(
        monkeypatch, *_FSDP2, "--num-experts", "4", "--expert-model-parallel-size", "2"
    )
    assert "--use-torch-fsdp2 does not support --fp16" in _error(monkeypatch, *_FSDP2, "--fp16")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    import pytest

    from megatron.training.arguments import ArgumentValidationError, parse_args, validate_args

    with pytest.raises(ArgumentValidationError, match="CUDA_DEVICE_MAX_CONNECTIONS=1"):
        validate_args(parse_args(argv=_ARGV + _FSDP2))
