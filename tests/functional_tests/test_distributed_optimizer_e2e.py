"""The distributed optimizer, overlapped bucketed gradient reduction and overlapped param
all-gather (--overlap-param-gather) through torchrun on CPU:
the losses and grad norms equal the one-process run, and its sharded state resumes at another
DP size."""
import pytest
import torch

from tests.functional_tests.runner import TINY_MODEL, read_tensorboard_scalars, run_pretrain

BASE = TINY_MODEL + ["--hidden-dropout", "0.0", "--attention-dropout", "0.0", "--train-iters", "10"]
DIST_OPT = ["--use-distributed-optimizer"]


def _losses(args, nproc, tb):
    result = run_pretrain(args + ["--tensorboard-dir", str(tb)], nproc=nproc)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return {"loss": read_tensorboard_scalars(tb, "lm loss"), "norm": read_tensorboard_scalars(tb, "grad-norm")}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _losses(BASE, None, tmp_path_factory.mktemp("distopt_ref"))


def _assert_close(got, ref, iterations=range(1, 11)):
    assert sorted(got["loss"]) == list(iterations)
    for it in iterations:
        assert abs(got["loss"][it] - ref["loss"][it]) <= 1e-4 * abs(ref["loss"][it]), (it, got, ref)
        assert abs(got["norm"][it] - ref["norm"][it]) <= 1e-3 * abs(ref["norm"][it]), (it, got["norm"], ref["norm"])


@pytest.mark.parametrize("nproc, layout", [
    (2, DIST_OPT),
    (2, DIST_OPT + ["--overlap-grad-reduce", "--overlap-param-gather", "--ddp-num-buckets", "3"]),
    (2, ["--overlap-grad-reduce", "--ddp-bucket-size", "5000", "--ddp-average-in-collective"]),
    (4, DIST_OPT + ["--tensor-model-parallel-size", "2", "--overlap-grad-reduce"]),
    (4, DIST_OPT + ["--pipeline-model-parallel-size", "2", "--overlap-grad-reduce"]),
], ids=["dp2-distopt", "dp2-distopt-overlap-grad-and-param-3buckets", "dp2-overlap-buckets-avg", "tp2-dp2-distopt",
        "pp2-dp2-distopt"])
def test_layout_matches_one_process(reference, nproc, layout, tmp_path):
    _assert_close(_losses(BASE + layout, nproc, tmp_path), reference)


def test_distopt_checkpoint_resumes_at_another_dp_size(reference, tmp_path):
    ckpt = tmp_path / "ckpt"
    save = DIST_OPT + ["--save", str(ckpt), "--save-interval", "5"]
    first = _losses(BASE + save + ["--exit-interval", "5"], 2, tmp_path / "tb1")
    shard = ckpt / "iter_0000005" / "mp_rank_00" / "distrib_optim.pt"
    assert shard.is_file()
    # The gathered state holds the full (unsharded) fp32 params and both Adam moments.
    state = torch.load(shard, weights_only=True)
    per_key = state[0][(torch.float32, torch.float32)]
    total = sum(p.numel() for p in per_key["param"])
    assert total == sum(p.numel() for p in per_key["exp_avg_sq"]) and total > 0
    assert all(float(t.abs().sum()) > 0 for t in per_key["exp_avg"])
    # Resume on one process (DP=1): the sharded state must be re-sharded, not reused as is.
    second = _losses(BASE + DIST_OPT + ["--load", str(ckpt)], None, tmp_path / "tb2")
    _assert_close({k: {**first[k], **second[k]} for k in first}, reference)


def test_loading_plain_checkpoint_with_distopt_is_a_clear_error(tmp_path):
    ckpt = tmp_path / "ckpt"
    result = run_pretrain(BASE + ["--save", str(ckpt), "--save-interval", "2", "--exit-interval", "2"], nproc=None)
    assert result.returncode == 0, result.stderr[-3000:]
    result = run_pretrain(BASE + DIST_OPT + ["--load", str(ckpt)], nproc=None)
    assert result.returncode != 0
    assert "saved without --use-distributed-optimizer" in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    # Weights alone load into the distributed optimizer.
    result = run_pretrain(BASE + DIST_OPT + ["--load", str(ckpt), "--no-load-optim", "--train-iters", "3"], nproc=None)
    assert result.returncode == 0, result.stderr[-3000:]
