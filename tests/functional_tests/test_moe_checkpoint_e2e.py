"""MoE checkpoints: a torch_dist checkpoint saved at EP=2 x TP=2 (sequence parallel) resumes at
EP=1 (one process) and at EP=4 with the next iterations' losses and grad norms of the run that
saved it; the torch format writes one file per (TP, EP) rank (``mp_rank_TT_EEE``) and resumes
at the same layout."""

from tests.functional_tests.runner import TINY_MODEL, assert_same_training, train_metrics

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
