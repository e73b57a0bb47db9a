"""Muon's state in --ckpt-format torch_dist through torchrun on CPU, with and without its
layer-wise distributed optimizer (--optimizer muon --use-distributed-optimizer: each DP rank
updates, and writes the state of, whole parameters).

Muon as defined here (and by Megatron with --muon-tp-mode duplicated, the default here) gives
the same update at every layout: the layer-wise optimizer only moves whole-parameter updates
between DP ranks, and 'duplicated' orthogonalizes the gathered full matrix. So each layout
equals the one-process run (loss within 1e-6, grad norm within 1e-5, relative), and a checkpoint
resumes at another DP or TP size, with or without the layer-wise optimizer, with the losses of
the straight run."""

import pytest

from tests.functional_tests.runner import (
    TINY_MODEL,
    assert_same_training,
    one_process_metrics,
    train_metrics,
)

BASE = TINY_MODEL + ["--hidden-dropout", "0.0", "--attention-dropout", "0.0", "--train-iters", "10"]
BASE += ["--optimizer", "muon", "--muon-fp32-matmul-prec", "high"]
del BASE[BASE.index("--ckpt-format") : BASE.index("--ckpt-format") + 2]  # torch_dist
LAYER_WISE = ["--use-distributed-optimizer"]
TP2 = ["--tensor-model-parallel-size", "2"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return one_process_metrics(BASE, tmp_path_factory)


def _resume(saved_run, resumed_at, ckpt, tmp_path):
    """The first five iterations of ``saved_run`` and iterations 6..10 loaded from its
    checkpoint of iteration 5 at ``resumed_at`` (nproc, flags)."""
    load = ["--load", str(ckpt), "--ckpt-step", "5"]
    second = train_metrics(BASE + resumed_at[1] + load, resumed_at[0], tmp_path / "resumed")
    assert sorted(second["loss"]) == list(range(6, 11))
    return {
        k: {**{i: v for i, v in saved_run[k].items() if i <= 5}, **second[k]} for k in saved_run
    }


def test_layer_wise_dp2_equals_one_process_and_resumes_at_tp2_without_it(reference, tmp_path):
    ckpt = tmp_path / "ckpt"
    save = ["--save", str(ckpt), "--save-interval", "5"]
    straight = train_metrics(BASE + LAYER_WISE + save, 2, tmp_path / "dp2")
    assert_same_training(straight, reference, range(1, 11))
    joined = _resume(straight, (2, TP2), ckpt, tmp_path)
    assert_same_training(joined, reference, range(1, 11))


def test_one_process_state_resumes_with_the_layer_wise_optimizer_at_tp2_dp2(reference, tmp_path):
    ckpt = tmp_path / "ckpt"
    save = ["--save", str(ckpt), "--save-interval", "5", "--exit-interval", "5"]
    first = train_metrics(BASE + save, None, tmp_path / "one")
    joined = _resume(first, (4, LAYER_WISE + TP2), ckpt, tmp_path)
    assert_same_training(joined, reference, range(1, 11))


MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48"]
MOE += ["--moe-aux-loss-coeff", "0.01", "--swiglu"]


def test_layer_wise_with_experts_at_ep2_equals_one_process_and_resumes_at_ep1(tmp_path):
    # The experts are shared out over expert DP (the ranks holding the same experts), the dense
    # params over DP; the state resumes on one process (EP=1) without the layer-wise optimizer.
    reference = train_metrics(BASE + MOE, None, tmp_path / "one")
    ckpt = tmp_path / "ckpt"
    save = ["--save", str(ckpt), "--save-interval", "5"]
    ep2 = ["--expert-model-parallel-size", "2"]
    straight = train_metrics(BASE + MOE + LAYER_WISE + ep2 + save, 2, tmp_path / "ep2")
    assert_same_training(straight, reference, range(1, 11))
    load = ["--load", str(ckpt), "--ckpt-step", "5"]
    resumed = train_metrics(BASE + MOE + load, None, tmp_path / "resumed")
    assert_same_training(resumed, reference, range(6, 11))
