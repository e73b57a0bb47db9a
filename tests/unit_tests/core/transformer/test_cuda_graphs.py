"""``--cuda-graph-impl local``: the per-layer graph bookkeeping, proven on the CPU with the
:class:`EagerReplay` backend (a replay reads only the static input buffers and writes only the
static outputs and what the captured code writes, like a CUDA graph, but by running the layer).

What this proves: warm-up counting per input signature, the static buffers and the copies into
them, the outputs handed to autograd, which gradients come back through autograd (DDP's hook)
and which the captured backward writes into ``main_grad`` itself (gradient accumulation fusion),
the pending-backward check, the eager paths (evaluation, no_grad). Tolerance: none, the replay
runs the same operations on the same values. What it cannot prove: the CUDA capture itself
(kernels recorded, the shared memory pool, the speed); see the GPU step in the module docstring of
megatron/core/transformer/cuda_graphs.py and the report of the change.
"""

import contextlib

import pytest
import torch

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.transformer.cuda_graphs import EagerReplay, LayerGraphs, layer_graphs_for
from megatron.training.flag_errors import ArgumentValidationError
from tests.unit_tests.tiny_configs import tiny_args, tiny_gpt_model, tiny_transformer_config

VOCAB, SEQ, BATCH = 64, 16, 2
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]


def _gpt(graphs: bool, fusion: bool = True, warmup: int = 2):
    config = tiny_transformer_config(
        ffn_hidden_size=64,
        params_dtype=torch.bfloat16,
        bf16=True,
        gradient_accumulation_fusion=fusion,
        cuda_graph_impl="local" if graphs else "none",
        cuda_graph_warmup_steps=warmup,
    )
    model = tiny_gpt_model(config, seed=1234, vocab_size=VOCAB, max_sequence_length=SEQ)
    if graphs:
        model.decoder.layer_graphs.backend = EagerReplay
    return model


def _batches(n):
    g = torch.Generator().manual_seed(7)
    for _ in range(n):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        yield tokens, torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ), labels


def _train(model, iterations=4, micro_batches=2):
    """Losses of a DDP-wrapped run (bf16 params, fp32 main grads, SGD on main_grad) and the
    final params."""
    ddp = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model
    )
    batches = _batches(iterations * micro_batches)
    losses = []
    for _ in range(iterations):
        ddp.zero_grad_buffer()
        for m in range(micro_batches):
            tokens, position_ids, labels = next(batches)
            context = ddp.no_sync() if m < micro_batches - 1 else contextlib.nullcontext()
            with context:
                loss = model(tokens, position_ids, None, labels=labels).float().mean()
                loss.backward()
            losses.append(loss.detach())
        ddp.finish_grad_sync()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.main_grad.to(p.dtype), alpha=-0.1)
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("fusion", [True, False])
def test_graphed_layers_train_exactly_like_eager_layers(fusion):
    eager_losses, eager_params = _train(_gpt(False, fusion))
    model = _gpt(True, fusion, warmup=2)
    losses, params = _train(model)
    assert torch.equal(losses, eager_losses)
    for p, q in zip(params, eager_params):
        assert torch.equal(p, q)
    # 8 forwards per layer: 2 eager (warm-up), then one capture and 6 more replays.
    for runner in model.decoder.layer_graphs.runners:
        assert list(runner.eager_calls.values()) == [2]
        assert len(runner.captured) == 1 and runner.replays == 6
        (captured,) = runner.captured.values()
        names = {id(p): n for n, p in runner.layer.named_parameters()}
        through_autograd = sorted(names[id(p)] for p in captured.params)
        if fusion:  # the linear weights accumulate inside the captured backward
            assert all("weight" not in n or "norm" in n for n in through_autograd)
        else:
            assert len(through_autograd) == len(names)


def test_eval_and_no_grad_run_eagerly_and_new_shapes_warm_up_again():
    model = _gpt(True, warmup=1)
    runner = model.decoder.layer_graphs.runners[0]
    tokens, position_ids, labels = next(_batches(1))
    for _ in range(2):  # one eager warm-up, then capture + replay
        model(tokens, position_ids, None, labels=labels).mean().backward()
    assert runner.replays == 1
    model.eval()
    model(tokens, position_ids, None, labels=labels)
    model.train()
    with torch.no_grad():
        model(tokens, position_ids, None, labels=labels)
    assert runner.replays == 1 and len(runner.captured) == 1
    short = (tokens[:, :8], position_ids[:, :8], labels[:, :8])
    model(*short[:2], None, labels=short[2]).mean().backward()
    assert len(runner.captured) == 1 and sum(runner.eager_calls.values()) == 2


def test_a_second_forward_before_the_backward_is_refused():
    model = _gpt(True, warmup=1)
    tokens, position_ids, labels = next(_batches(1))
    model(tokens, position_ids, None, labels=labels).mean().backward()
    model(tokens, position_ids, None, labels=labels)
    with pytest.raises(RuntimeError, match="next forward before the backward of the previous"):
        model(tokens, position_ids, None, labels=labels)


def test_the_cuda_backend_refuses_cpu_tensors():
    model = _gpt(True, warmup=1)
    model.decoder.layer_graphs.backend = LayerGraphs([], 1).backend  # the default: CUDA graphs
    tokens, position_ids, labels = next(_batches(1))
    model(tokens, position_ids, None, labels=labels).mean().backward()
    with pytest.raises(ValueError, match="--cuda-graph-impl local needs CUDA: .* on cpu"):
        model(tokens, position_ids, None, labels=labels)


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"pipeline_model_parallel_size": 2}, "pipeline_model_parallel_size > 1"),
        ({"hidden_dropout": 0.1}, "dropout"),
        ({"recompute_granularity": "selective"}, "recompute_granularity"),
    ],
)
def test_the_core_refuses_what_a_replay_cannot_serve(extra, message):
    config = tiny_transformer_config(cuda_graph_impl="local", **extra)
    with pytest.raises(ValueError, match=f"cuda_graph_impl='local'.*does not support {message}"):
        layer_graphs_for(config, [])


@pytest.mark.parametrize("argv", [["--cuda-graph-impl", "local"], ["--enable-cuda-graph"]])
def test_start_up_refuses_graphs_without_cuda(argv, monkeypatch, capsys):
    from megatron.training.initialize import check_flags_against_the_machine

    args = tiny_args(*argv, *NO_DROPOUT)  # valid flags: the dry run accepts them on a CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="^2$"):  # the exit code of bad flags
        check_flags_against_the_machine(args)
    assert capsys.readouterr().err == (
        "error: --cuda-graph-impl local needs CUDA (no GPU is visible here)\n"
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    check_flags_against_the_machine(args)  # returns


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "does not support dropout"),
        (
            [*NO_DROPOUT, "--overlap-grad-reduce"],
            "does not support --overlap-grad-reduce",
        ),
        (
            [*NO_DROPOUT, "--recompute-activations"],
            "does not support --recompute-granularity",
        ),
        (
            [*NO_DROPOUT, "--num-experts", "2"],
            "does not support --num-experts",
        ),
    ],
)
def test_the_command_line_refuses_what_a_replay_cannot_serve(argv, message, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ArgumentValidationError, match=f"^--cuda-graph-impl local {message}"):
        tiny_args("--cuda-graph-impl", "local", *argv)
