"""MoE checkpoints: a torch_dist checkpoint saved at EP=2 x TP=2 (sequence parallel) resumes at
EP=1 (one process) and at EP=4 with the next iterations' losses and grad norms of the run that
saved it; the torch format writes one file per (TP, EP) rank (``mp_rank_TT_EEE``) and resumes
at the same layout; with the distributed optimizer, both formats keep the expert optimizer state
(sharded over expert DP) and resume."""

import torch

from tests.functional_tests.runner import (
    TINY_MODEL,
    assert_same_training,
    train_metrics,
    world_metrics,
)

MOE = [
    "--hidden-dropout",
    "0.0",
    "--attention-dropout",
    "0.0",
    "--train-iters",
    "4",
    "--num-experts",
    "4",
    "--moe-router-topk",
    "2",
    "--moe-ffn-hidden-size",
    "48",
    "--moe-aux-loss-coeff",
    "0.01",
    "--swiglu",
]


def _resumed(metrics):
    return {name: {it: v for it, v in values.items() if it > 2} for name, values in metrics.items()}


def test_torch_dist_checkpoint_reshards_across_expert_layouts(tmp_path):
    ckpt = tmp_path / "ckpt"
    fmt = ["--ckpt-format", "torch_dist"]
    saved = train_metrics(
        TINY_MODEL
        + MOE
        + fmt
        + ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2"]
        + ["--sequence-parallel", "--save", str(ckpt), "--save-interval", "2"],
        4,
        tmp_path / "tb_saved",
    )
    expected = _resumed(saved)
    load = fmt + ["--load", str(ckpt), "--ckpt-step", "2"]
    for name, nproc, layout in (
        ("ep1", None, []),
        ("ep4", 4, ["--expert-model-parallel-size", "4"]),
    ):
        got = train_metrics(TINY_MODEL + MOE + load + layout, nproc, tmp_path / f"tb_{name}")
        assert_same_training(got, expected, range(3, 5))


def test_torch_format_files_per_expert_rank_and_resume(tmp_path):
    ckpt = tmp_path / "ckpt"
    layout = ["--expert-model-parallel-size", "2", "--ckpt-format", "torch"]
    saved = train_metrics(
        TINY_MODEL + MOE + layout + ["--save", str(ckpt), "--save-interval", "2"],
        2,
        tmp_path / "tb_saved",
    )
    names = sorted(p.name for p in (ckpt / "iter_0000002").iterdir())
    assert names == ["mp_rank_00_000", "mp_rank_00_001"], names
    got = train_metrics(
        TINY_MODEL + MOE + layout + ["--load", str(ckpt), "--ckpt-step", "2"],
        2,
        tmp_path / "tb_resumed",
    )
    assert_same_training(got, _resumed(saved), range(3, 5))


def test_distributed_optimizer_with_experts_checkpoints(tmp_path):
    """EP=2 with the distributed optimizer: saved in torch_dist at 4 processes (dense state
    sharded over DP = 4, expert state over expert DP = 2), it resumes at EP=1 with and without
    the distributed optimizer; the torch format writes distrib_optim.pt per expert rank
    (Megatron's [dense, expert] list) and resumes at the same layout."""
    dist_opt = ["--use-distributed-optimizer"]
    ep2 = ["--expert-model-parallel-size", "2"] + dist_opt
    # torch: 2 processes (dense DP = 2, expert DP = 1) keep the test short.
    for fmt, nproc in (("torch_dist", 4), ("torch", 2)):
        ckpt = tmp_path / fmt
        args = TINY_MODEL + MOE + ["--ckpt-format", fmt]
        saved = train_metrics(
            args + ep2 + ["--save", str(ckpt), "--save-interval", "2"],
            nproc,
            tmp_path / f"tb_{fmt}",
        )
        load = args + ["--load", str(ckpt), "--ckpt-step", "2"]
        if fmt == "torch_dist":
            resumes = [("ep1-dist-opt", None, dist_opt), ("ep1", None, [])]
        else:
            # Written by expert-DP rank 0 of each EP rank; only DP rank 0 (EP rank 0) holds the
            # dense part.
            iteration = ckpt / "iter_0000002"
            parts = {
                d: [
                    part is not None
                    for part in torch.load(iteration / d / "distrib_optim.pt", weights_only=True)
                ]
                for d in ("mp_rank_00_000", "mp_rank_00_001")
            }
            assert parts == {"mp_rank_00_000": [True, True], "mp_rank_00_001": [False, True]}
            resumes = [("ep2-dist-opt", 2, ep2)]
        if fmt == "torch_dist":
            # Both one-process resumes in one spawned process (a start costs seconds of CPU),
            # each a pretrain() of its own that loads the checkpoint from disk.
            layouts = {name: layout for name, _, layout in resumes}
            resumed = world_metrics(load, layouts, 1, tmp_path / "tb_torch_dist_resumes")
        else:
            resumed = {
                name: train_metrics(load + layout, nproc, tmp_path / f"tb_{fmt}_{name}")
                for name, nproc, layout in resumes
            }
        assert sorted(resumed) == sorted(name for name, _, _ in resumes)
        for name, got in resumed.items():
            try:
                assert_same_training(got, _resumed(saved), range(3, 5))
            except AssertionError as exc:
                raise AssertionError(f"{fmt} resumed at {name}: {exc}") from None
