"""Plain DP=2, the distributed optimizer, overlapped bucketed gradient reduction and overlapped
param all-gather (--overlap-param-gather) on CPU:
the losses and grad norms equal the one-process run, and its sharded state resumes at another
DP size."""

import pytest
import torch

from tests.functional_tests.runner import (
    TINY_MODEL,
    assert_same_training,
    one_process_metrics,
    run_pretrain,
    train_metrics,
    world_metrics,
)

BASE = TINY_MODEL + ["--hidden-dropout", "0.0", "--attention-dropout", "0.0", "--train-iters", "10"]
DIST_OPT = ["--use-distributed-optimizer"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return one_process_metrics(BASE, tmp_path_factory)


def _assert_close(got, ref):
    assert_same_training(got, ref, range(1, 11))


# The layouts of one world size train one after another in one spawned world (a start costs
# seconds of CPU per rank); each is compared with the one-process run on its own.
WORLDS = {
    2: {
        # Plain DP=2 (one seed for both replicas, no dropout) at the same global batch.
        "dp2": [],
        "dp2-distopt": DIST_OPT,
        "dp2-distopt-overlap-grad-and-param-3buckets": DIST_OPT
        + ["--overlap-grad-reduce", "--overlap-param-gather", "--ddp-num-buckets", "3"],
        "dp2-overlap-buckets-avg": [
            "--overlap-grad-reduce",
            "--ddp-bucket-size",
            "5000",
            "--ddp-average-in-collective",
        ],
    },
    4: {
        "tp2-dp2-distopt": DIST_OPT
        + ["--tensor-model-parallel-size", "2", "--overlap-grad-reduce"],
        "pp2-dp2-distopt": DIST_OPT
        + ["--pipeline-model-parallel-size", "2", "--overlap-grad-reduce"],
    },
}


@pytest.mark.parametrize("world_size", sorted(WORLDS), ids=lambda n: f"world{n}")
def test_layout_matches_one_process(reference, world_size, tmp_path):
    results = world_metrics(BASE, WORLDS[world_size], world_size, tmp_path)
    assert sorted(results) == sorted(WORLDS[world_size])
    for name, got in results.items():
        try:
            _assert_close(got, reference)
        except AssertionError as exc:
            raise AssertionError(f"layout {name}: {exc}") from None


def test_distopt_checkpoint_resumes_at_another_dp_size(reference, tmp_path):
    ckpt = tmp_path / "ckpt"
    save = DIST_OPT + ["--save", str(ckpt), "--save-interval", "5"]
    first = train_metrics(BASE + save + ["--exit-interval", "5"], 2, tmp_path / "tb1")
    shard = ckpt / "iter_0000005" / "mp_rank_00" / "distrib_optim.pt"
    assert shard.is_file()
    # The gathered state holds the full (unsharded) fp32 params and both Adam moments.
    state = torch.load(shard, weights_only=True)
    per_key = state[0][(torch.float32, torch.float32)]
    total = sum(p.numel() for p in per_key["param"])
    assert total == sum(p.numel() for p in per_key["exp_avg_sq"]) and total > 0
    assert all(float(t.abs().sum()) > 0 for t in per_key["exp_avg"])
    # Resume on one process (DP=1): the sharded state must be re-sharded, not reused as is.
    second = train_metrics(BASE + DIST_OPT + ["--load", str(ckpt)], None, tmp_path / "tb2")
    _assert_close({k: {**first[k], **second[k]} for k in first}, reference)


def test_loading_plain_checkpoint_with_distopt_is_a_clear_error(tmp_path):
    ckpt = tmp_path / "ckpt"
    result = run_pretrain(
        BASE + ["--save", str(ckpt), "--save-interval", "2", "--exit-interval", "2"], nproc=None
    )
    assert result.returncode == 0, result.stderr[-3000:]
    result = run_pretrain(BASE + DIST_OPT + ["--load", str(ckpt)], nproc=None)
    assert result.returncode != 0
    assert "saved without --use-distributed-optimizer" in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    # Weights alone load into the distributed optimizer.
    result = run_pretrain(
        BASE + DIST_OPT + ["--load", str(ckpt), "--no-load-optim", "--train-iters", "3"], nproc=None
    )
    assert result.returncode == 0, result.stderr[-3000:]
