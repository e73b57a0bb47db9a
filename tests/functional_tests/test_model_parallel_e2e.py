"""Tensor, sequence and context parallel training through torchrun equals the one-process run:
tensor parallelism also with QK layernorm under --test-mode, context parallelism also as
Megatron's hierarchical a2a+p2p (CP 4 as 2 x 2, which runs as the p2p ring and says so at
start-up)."""

import pytest

from tests.functional_tests.runner import (
    TINY_MODEL,
    assert_same_training,
    one_process_metrics,
    read_tensorboard_scalars,
    run_pretrain,
)

NO_DROPOUT = ["--hidden-dropout", "0.0", "--attention-dropout", "0.0", "--train-iters", "10"]
LLAMA_LIKE = [
    "--position-embedding-type",
    "rope",
    "--normalization",
    "RMSNorm",
    "--swiglu",
    "--disable-bias-linear",
    "--untie-embeddings-and-output-weights",
    "--group-query-attention",
    "--num-query-groups",
    "2",
]
# QK layernorm under TP: each rank normalizes its own heads, so the norms' gradients are summed
# over TP; --test-mode checks at every forward that their replicas stay equal.
QK_TEST_MODE = ["--qk-layernorm", "--test-mode"]
HIERARCHICAL_CP = [
    "--context-parallel-size",
    "4",
    "--cp-comm-type",
    "a2a+p2p",
    "--hierarchical-context-parallel-sizes",
    "2",
    "2",
]
HIERARCHICAL_CP_LINE = (
    " > context parallelism: --cp-comm-type a2a+p2p with --hierarchical-context-parallel-sizes "
    "2 2 runs as the p2p ring over all 4 context-parallel ranks (the same attention)"
)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return {
        name: one_process_metrics(TINY_MODEL + NO_DROPOUT + extra, tmp_path_factory)
        for name, extra in (("gpt", []), ("llama", LLAMA_LIKE), ("qk", QK_TEST_MODE))
    }


@pytest.mark.parametrize(
    "model, layout",
    [
        ("gpt", ["--tensor-model-parallel-size", "2"]),
        ("gpt", ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
        ("gpt", ["--context-parallel-size", "2"]),
        ("gpt", HIERARCHICAL_CP),
        ("llama", ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
        ("qk", ["--tensor-model-parallel-size", "2"]),
    ],
)
def test_layout_matches_single_process(references, model, layout, tmp_path):
    extra = {"gpt": [], "llama": LLAMA_LIKE, "qk": QK_TEST_MODE}[model]
    nproc = 4 if layout is HIERARCHICAL_CP else 2
    result = run_pretrain(
        TINY_MODEL + NO_DROPOUT + extra + layout + ["--tensorboard-dir", str(tmp_path)],
        nproc=nproc,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    if layout is HIERARCHICAL_CP:
        assert result.stdout.splitlines().count(HIERARCHICAL_CP_LINE) == 1, result.stdout[:3000]
    got = {
        "loss": read_tensorboard_scalars(tmp_path, "lm loss"),
        "norm": read_tensorboard_scalars(tmp_path, "grad-norm"),
    }
    assert_same_training(got, references[model], range(1, 11))
