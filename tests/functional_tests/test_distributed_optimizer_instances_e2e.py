"""--num-distributed-optimizer-instances N through torchrun on CPU (Megatron's partial
distributed optimizer: sharded within N blocks of the data-parallel ranks, replicated across
them): the losses and grad norms equal the one-process run, and its checkpoints, in both formats,
resume at another N and DP size with the losses of the straight run."""

import pytest

from tests.functional_tests.runner import (
    TINY_MODEL,
    assert_same_training,
    one_process_metrics,
    train_metrics,
)

BASE = TINY_MODEL + ["--hidden-dropout", "0.0", "--attention-dropout", "0.0", "--train-iters", "10"]
TORCH_DIST = list(BASE)
del TORCH_DIST[TORCH_DIST.index("--ckpt-format") : TORCH_DIST.index("--ckpt-format") + 2]


def instances(n):
    return ["--use-distributed-optimizer", "--num-distributed-optimizer-instances", str(n)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return one_process_metrics(BASE, tmp_path_factory)


def _assert_close(got, ref, iterations=range(1, 11)):
    assert_same_training(got, ref, iterations)


def _save_then_resume(base, saved_at, resumed_at, tmp_path, straight=False):
    """Train at ``saved_at`` (nproc, flags) saving at iteration 5, then load iteration 5 and
    train to 10 at ``resumed_at``. ``straight``: the first run trains on to 10 (its own 10
    iterations are then returned too). Returns the checkpoint, the first run's metrics and the
    resumed ones joined with the first five."""
    ckpt = tmp_path / "ckpt"
    save = ["--save", str(ckpt), "--save-interval", "5"]
    if not straight:
        save += ["--exit-interval", "5"]
    first = train_metrics(base + saved_at[1] + save, saved_at[0], tmp_path / "tb1")
    load = ["--load", str(ckpt), "--ckpt-step", "5"]
    second = train_metrics(base + resumed_at[1] + load, resumed_at[0], tmp_path)
    assert sorted(second["loss"]) == list(range(6, 11))
    joined = {k: {**{i: v for i, v in first[k].items() if i <= 5}, **second[k]} for k in first}
    return ckpt, first, joined


def test_dp4_two_instances_torch_format(reference, tmp_path):
    # DP=4 in 2 instances equals one process over 10 iterations; its checkpoint resumes at DP=2
    # with one instance.
    ckpt, straight, joined = _save_then_resume(
        BASE, (4, instances(2)), (2, instances(1)), tmp_path, straight=True
    )
    _assert_close(straight, reference)
    # Instance 0's DP rank 0 wrote the gathered state (the same in every instance).
    assert (ckpt / "iter_0000005" / "mp_rank_00" / "distrib_optim.pt").is_file()
    _assert_close(joined, reference)


def test_one_rank_per_instance_overlapped_torch_dist(reference, tmp_path):
    # DP=2 in 2 instances (every bucket all-reduced across them), overlapped and averaged in the
    # collective, equals one process; its checkpoint in Megatron-LM's default type
    # (dp_reshardable, tied to the bucket layout: the same buckets) resumes at DP=4 in 2
    # instances.
    overlap = ["--overlap-grad-reduce", "--overlap-param-gather", "--ddp-num-buckets", "3"]
    overlap += ["--ddp-average-in-collective"]
    _, straight, joined = _save_then_resume(
        TORCH_DIST,
        (2, instances(2) + overlap),
        (4, instances(2) + overlap),
        tmp_path,
        straight=True,
    )
    _assert_close(straight, reference)
    _assert_close(joined, reference)


def test_torch_dist_fully_reshardable_resumes_on_one_process(reference, tmp_path):
    fully = ["--dist-ckpt-optim-fully-reshardable"]
    _, _, joined = _save_then_resume(
        TORCH_DIST, (2, instances(2) + fully), (None, instances(1)), tmp_path
    )
    _assert_close(joined, reference)
