"""Tensor, sequence and context parallel training through torchrun equals the one-process run."""

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


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return {
        name: one_process_metrics(TINY_MODEL + NO_DROPOUT + extra, tmp_path_factory)
        for name, extra in (("gpt", []), ("llama", LLAMA_LIKE))
    }


@pytest.mark.parametrize(
    "model, layout",
    [
        ("gpt", ["--tensor-model-parallel-size", "2"]),
        ("gpt", ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
        ("gpt", ["--context-parallel-size", "2"]),
        ("llama", ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    ],
)
def test_layout_matches_single_process(references, model, layout, tmp_path):
    extra = LLAMA_LIKE if model == "llama" else []
    result = run_pretrain(
        TINY_MODEL + NO_DROPOUT + extra + layout + ["--tensorboard-dir", str(tmp_path)], nproc=2
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    got = {
        "loss": read_tensorboard_scalars(tmp_path, "lm loss"),
        "norm": read_tensorboard_scalars(tmp_path, "grad-norm"),
    }
    assert_same_training(got, references[model], range(1, 11))
