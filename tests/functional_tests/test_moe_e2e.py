"""Mixture-of-experts training through torchrun equals the one-process run: expert parallelism
alone, with tensor + sequence parallelism (alltoall dispatcher, experts split over ETP = TP),
with pipeline parallelism (also with two virtual stages per rank), experts unsplit (ETP = 1)
beside TP = 2, and with the distributed optimizer (dense and expert optimizer state sharded over
their own data-parallel groups).

fp32, dropless, no dropout; loss, grad norm and the load-balancing loss per iteration
(TensorBoard) within the suite's tolerances (runner.LOSS_RTOL / GRAD_NORM_RTOL)."""

import pytest

from tests.functional_tests.runner import (
    TINY_MODEL,
    assert_same_training,
    read_tensorboard_scalars,
    run_pretrain,
    train_layouts_in_one_world,
)

MOE = [
    "--hidden-dropout",
    "0.0",
    "--attention-dropout",
    "0.0",
    "--train-iters",
    "10",
    "--num-experts",
    "4",
    "--moe-router-topk",
    "2",
    "--moe-ffn-hidden-size",
    "48",
    "--moe-aux-loss-coeff",
    "0.01",
    "--moe-z-loss-coeff",
    "0.001",
    "--moe-shared-expert-intermediate-size",
    "32",
    "--moe-shared-expert-gate",
]
ITERATIONS = range(1, 11)


def _metrics(tb):
    return {
        "loss": read_tensorboard_scalars(tb, "lm loss"),
        "norm": read_tensorboard_scalars(tb, "grad-norm"),
        "balance": read_tensorboard_scalars(tb, "load_balancing_loss"),
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tb = tmp_path_factory.mktemp("moe_ref")
    result = run_pretrain(TINY_MODEL + MOE + ["--tensorboard-dir", str(tb)])
    assert result.returncode == 0, result.stderr[-3000:]
    assert " load_balancing_loss: " in result.stdout and " z_loss: " in result.stdout
    return _metrics(tb)


# Layouts train two by two in one spawned world (a start costs seconds of CPU per rank); each
# is compared with the one-process run on its own.
WORLDS = [
    (
        2,
        {
            "ep2": ["--expert-model-parallel-size", "2"],
            "etp1-tp2-sp": [
                "--expert-tensor-parallel-size", "1",
                "--tensor-model-parallel-size", "2",
                "--sequence-parallel",
            ],
        },
    ),
    (
        4,
        {
            "ep2-tp2-sp-alltoall": [
                "--expert-model-parallel-size", "2",
                "--tensor-model-parallel-size", "2",
                "--sequence-parallel",
                "--moe-token-dispatcher-type", "alltoall",
            ],
            "ep2-pp2": ["--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
        },
    ),
    (
        4,
        {
            # 2 layers over 2 x 2 virtual stages: embedding | layer | layer | loss.
            "ep2-pp2-vpp2": [
                "--expert-model-parallel-size", "2",
                "--pipeline-model-parallel-size", "2",
                "--num-virtual-stages-per-pipeline-rank", "2",
                "--account-for-embedding-in-pipeline-split",
                "--account-for-loss-in-pipeline-split",
                "--moe-token-dispatcher-type", "alltoall",
            ],
            # Dense params sharded over DP = 4, expert params over expert DP = 2.
            "ep2-dist-opt": ["--expert-model-parallel-size", "2", "--use-distributed-optimizer"],
        },
    ),
]  # fmt: skip


@pytest.mark.parametrize(
    "world_size, layouts", WORLDS, ids=["+".join(layouts) for _, layouts in WORLDS]
)
def test_moe_layout_matches_single_process(reference, world_size, layouts, tmp_path):
    dirs = train_layouts_in_one_world(TINY_MODEL + MOE, layouts, world_size, tmp_path)
    assert sorted(dirs) == sorted(layouts)
    for name, tb in dirs.items():
        got = _metrics(tb)
        try:
            assert_same_training(got, reference, ITERATIONS)
            for it in ITERATIONS:
                assert got["balance"][it] == pytest.approx(reference["balance"][it], rel=1e-5), it
        except AssertionError as exc:
            raise AssertionError(f"layout {name}: {exc}") from None


def test_per_token_loss_with_aux_losses_matches_single_process(tmp_path):
    """--calculate-per-token-loss with the load-balancing and z-losses (Megatron scales each by
    the micro-batch's tokens): context parallelism 2 with the experts split over 2 ranks equals
    the one-process run. Each CP rank holds half of every sequence, so a loss scaled by the
    rank's own tokens only (not the whole sequences') would halve the auxiliary gradients
    there and move the grad norm."""
    per_token = MOE + ["--calculate-per-token-loss", "--eod-mask-loss"]
    runs = {}
    for name, nproc, layout in (
        ("one", None, []),
        ("cp2-ep2", 2, ["--context-parallel-size", "2", "--expert-model-parallel-size", "2"]),
    ):
        tb = tmp_path / name
        result = run_pretrain(
            TINY_MODEL + per_token + layout + ["--tensorboard-dir", str(tb)], nproc
        )
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        runs[name] = _metrics(tb)
    assert_same_training(runs["cp2-ep2"], runs["one"], ITERATIONS)
    for it in ITERATIONS:
        assert runs["cp2-ep2"]["balance"][it] == pytest.approx(runs["one"]["balance"][it], rel=1e-5)
