"""FSDP2 (--use-torch-fsdp2) through torchrun on CPU/gloo: the losses and grad norms of DP=2 equal
the one-process run (no sharding) for 6 iterations. (--use-megatron-fsdp with optim_grads_params
takes the same code path; its flag mapping is tested in
tests/unit_tests/core/distributed/test_fsdp.py.)"""

import pytest

from tests.functional_tests.runner import (
    TINY_MODEL,
    assert_same_training,
    run_pretrain,
    train_metrics,
)

ITERS = 6
# FSDP2 needs untied embeddings and no gradient-accumulation fusion (the argument validation
# refuses --use-torch-fsdp2 otherwise, as Megatron's does).
BASE = TINY_MODEL + [
    "--hidden-dropout",
    "0.0",
    "--attention-dropout",
    "0.0",
    "--train-iters",
    str(ITERS),
    "--untie-embeddings-and-output-weights",
    "--no-gradient-accumulation-fusion",
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train_metrics(BASE, None, tmp_path_factory.mktemp("fsdp_ref"))


def test_fsdp2_dp2_matches_one_process(reference, tmp_path):
    # 8 sequences per step at DP=2 with micro-batches of 2: two micro-batches per rank, so the
    # gradient accumulation under no_sync is exercised too.
    got = train_metrics(BASE + ["--use-torch-fsdp2", "--ckpt-format", "torch_dist"], 2, tmp_path)
    assert_same_training(got, reference, range(1, ITERS + 1))


def test_fsdp2_refuses_checkpointing_with_a_clear_message(tmp_path):
    result = run_pretrain(
        BASE
        + [
            "--use-torch-fsdp2",
            "--ckpt-format",
            "torch_dist",
            "--save",
            str(tmp_path),
            "--save-interval",
            "2",
        ],
        nproc=None,
    )
    assert result.returncode != 0
    assert "--use-torch-fsdp2 does not support saving or loading checkpoints" in result.stderr, (
        result.stderr[-2000:]
    )
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
