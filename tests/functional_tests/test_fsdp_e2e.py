"""FSDP2 (--use-torch-fsdp2) through torchrun on CPU/gloo, over 10 iterations:

* DP=2 equals the one-process run (no sharding), loss within 1e-6 and grad norm within 1e-5
  relative, with tied embeddings (the tied weight is one FSDP2 parameter), and so does its
  params norm (--log-params-norm);
* its torch_dist checkpoint (saved at iteration 5) resumes with the one-process run's next losses
  at another DP size (DP=4) and without FSDP (one process), and a checkpoint written without FSDP
  resumes under FSDP2 at DP=2 likewise.

(--use-megatron-fsdp with optim_grads_params takes the same code path; its flag mapping is
tested in tests/unit_tests/core/distributed/test_fsdp.py.)
"""

import pytest

from tests.functional_tests.runner import (
    LOSS_RTOL,
    TINY_MODEL,
    assert_same_training,
    read_tensorboard_scalars,
    run_pretrain,
    train_metrics,
)

ITERS = 10
SAVED_AT = 5
MODEL = list(TINY_MODEL)
del MODEL[MODEL.index("--ckpt-format") : MODEL.index("--ckpt-format") + 2]  # torch_dist
# FSDP2 needs no gradient-accumulation fusion (the argument validation refuses it, as Megatron's).
BASE = MODEL + [
    "--hidden-dropout",
    "0.0",
    "--attention-dropout",
    "0.0",
    "--train-iters",
    str(ITERS),
    "--no-gradient-accumulation-fusion",
    "--log-params-norm",
]
FSDP2 = ["--use-torch-fsdp2"]


def _save(directory):
    return ["--save", str(directory), "--save-interval", str(SAVED_AT)]


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """The one-process run and the FSDP2 DP=2 run of the tied model, each saving at SAVED_AT."""
    root = tmp_path_factory.mktemp("fsdp_tied")
    reference = train_metrics(BASE + _save(root / "plain"), None, root / "tb_plain")
    fsdp = train_metrics(BASE + FSDP2 + _save(root / "fsdp"), 2, root / "tb_fsdp")
    return root, reference, fsdp


def test_fsdp2_dp2_with_tied_embeddings_matches_one_process(tied):
    # 8 sequences per step at DP=2 with micro-batches of 2: two micro-batches per rank, so the
    # gradient accumulation under no_sync is exercised too. (Untied embeddings add a parameter
    # to the same FSDP unit; Megatron's FSDP2 configurations tie them.)
    root, reference, fsdp = tied
    assert_same_training(fsdp, reference, range(1, ITERS + 1))
    # The params norm counts every shard once (summed over the FSDP group).
    want = read_tensorboard_scalars(root / "tb_plain", "params-norm")
    got = read_tensorboard_scalars(root / "tb_fsdp", "params-norm")
    assert sorted(got) == list(range(1, ITERS + 1))
    for it in got:
        assert abs(got[it] - want[it]) <= LOSS_RTOL * want[it], (it, got, want)


def _resumed_losses(args, nproc, load, tb):
    result = run_pretrain(
        args + ["--load", str(load), "--ckpt-step", str(SAVED_AT), "--tensorboard-dir", str(tb)],
        nproc=nproc,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert f"successfully loaded checkpoint from {load}" in result.stdout, result.stdout[-2000:]
    return read_tensorboard_scalars(tb, "lm loss")


@pytest.mark.parametrize(
    "saved_by, resumed_by, nproc",
    [("fsdp", FSDP2, 4), ("fsdp", [], None), ("plain", FSDP2, 2)],
    ids=["fsdp_dp2_to_fsdp_dp4", "fsdp_dp2_to_one_process", "one_process_to_fsdp_dp2"],
)
def test_checkpoint_resumes_with_the_next_losses(tied, saved_by, resumed_by, nproc, tmp_path):
    root, reference, _ = tied
    losses = _resumed_losses(BASE + resumed_by, nproc, root / saved_by, tmp_path / "tb")
    assert sorted(losses) == list(range(SAVED_AT + 1, ITERS + 1)), losses
    for it in losses:
        want = reference["loss"][it]
        assert abs(losses[it] - want) <= LOSS_RTOL * abs(want), (it, losses, reference["loss"])
