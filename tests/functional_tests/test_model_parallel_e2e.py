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
    train_in_one_world,
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


MODELS = {"gpt": [], "llama": LLAMA_LIKE, "qk": QK_TEST_MODE}
TP2 = ["--tensor-model-parallel-size", "2"]
TP2_SP = TP2 + ["--sequence-parallel"]
# The two-rank layouts train a few after another in one spawned world (a start costs seconds of
# CPU per rank); each is compared with its model's one-process run on its own.
WORLD2 = [
    {"gpt tp2": TP2, "gpt tp2-sp": TP2_SP, "gpt cp2": ["--context-parallel-size", "2"]},
    {"llama tp2-sp": TP2_SP, "qk tp2": TP2},
]


@pytest.mark.parametrize("layouts", WORLD2, ids=["+".join(layouts) for layouts in WORLD2])
def test_layout_matches_single_process(references, layouts, tmp_path):
    dirs = {name: tmp_path / name.replace(" ", "-") for name in layouts}
    train_in_one_world(
        [
            (
                TINY_MODEL + NO_DROPOUT + MODELS[name.split()[0]] + layout
                + ["--tensorboard-dir", str(dirs[name])],
                dirs[name],
            )
            for name, layout in layouts.items()
        ],
        2,
    )  # fmt: skip
    for name, tb in dirs.items():
        got = {
            "loss": read_tensorboard_scalars(tb, "lm loss"),
            "norm": read_tensorboard_scalars(tb, "grad-norm"),
        }
        try:
            assert_same_training(got, references[name.split()[0]], range(1, 11))
        except AssertionError as exc:
            raise AssertionError(f"layout {name}: {exc}") from None


def test_hierarchical_cp_matches_single_process(references, tmp_path):
    result = run_pretrain(
        TINY_MODEL + NO_DROPOUT + HIERARCHICAL_CP + ["--tensorboard-dir", str(tmp_path)], nproc=4
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert result.stdout.splitlines().count(HIERARCHICAL_CP_LINE) == 1, result.stdout[:3000]
    got = {
        "loss": read_tensorboard_scalars(tmp_path, "lm loss"),
        "norm": read_tensorboard_scalars(tmp_path, "grad-norm"),
    }
    assert_same_training(got, references["gpt"], range(1, 11))
