"""The part-A flags of issue 15 with two processes (gloo, data-parallel size 2), in one spawned
world: the weight-hash check across data-parallel replicas, --verify-integrity and
--log-progress. Every rank must end together with the same error: a check that only some
ranks fail would leave the others waiting in their next collective."""

import contextlib
import io
import os
import sys

import torch
import torch.distributed as dist

from tests.functional_tests.runner import REPO, TINY_MODEL
from tests.unit_tests.dist_utils import run_distributed


def _pretrain(argv, model_provider=None):
    """(exit code, stdout, stderr) of an in-process run on this rank."""
    sys.path.insert(0, str(REPO))
    import pretrain_gpt
    from megatron.training import global_vars

    global_vars.reset_globals()
    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            pretrain_gpt.pretrain(
                pretrain_gpt.train_valid_test_datasets_provider,
                model_provider or pretrain_gpt.model_provider,
                pretrain_gpt.ModelType.encoder_or_decoder,
                pretrain_gpt.forward_step,
                args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
                argv=argv,
            )
        except SystemExit as exc:
            code = exc.code or 0
    global_vars.reset_globals()
    return code, out.getvalue(), err.getvalue()


def _three_runs(rank, world_size, tmp):
    save = os.path.join(tmp, "ckpt")
    common = TINY_MODEL + ["--train-iters", "4", "--check-weight-hash-across-dp-replicas-interval"]
    common += ["2", "--save", save, "--save-interval", "4", "--ckpt-format", "torch_dist"]

    # 1. Identical replicas: checked before training and every 2 iterations; saved with a
    #    manifest and a progress line naming 2 GPUs.
    code, out, err = _pretrain(common + ["--verify-integrity", "--log-progress"])
    assert code == 0, err
    if rank == 0:
        for iteration in (0, 2, 4):
            assert f">>> Weight hashes match after {iteration} iterations..." in out, out
        assert os.path.isfile(os.path.join(save, "iter_0000004", "integrity.sha256"))
        with open(os.path.join(save, "progress.txt")) as f:
            lines = f.read().splitlines()
        assert [line.split("\t")[2:4] for line in lines] == [
            ["# GPUs: 2", "Starting job"],
            ["# GPUs: 2", "Saved checkpoint"],
        ]

    # 2. A changed file: both ranks end the load with the same line naming it.
    if rank == 0:
        with open(os.path.join(save, "iter_0000004", "common.pt"), "ab") as f:
            f.write(b"\0")
    dist.barrier()
    code, out, err = _pretrain(common + ["--load", save, "--verify-integrity"])
    assert code == 1, out[-2000:] + err
    assert err.strip().endswith("common.pt changed (its SHA-256 differs from the manifest)"), err
    assert len(err.strip().splitlines()) == 1

    # 3. Rank 1's replica differs (as after a silent corruption): both ranks stop before the
    #    first iteration, naming rank 1 and the parameter.
    perturbed = {}

    def model_provider(**kwargs):
        import pretrain_gpt

        model = pretrain_gpt.model_provider(**kwargs)
        if rank == 1:
            name, param = next(iter(model.named_parameters()))
            with torch.no_grad():
                param.add_(1e-3)
            perturbed["name"] = name
        return model

    code, out, err = _pretrain(common + ["--save", os.path.join(tmp, "other")], model_provider)
    assert code == 1, out[-2000:] + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "error: --check-weight-hash-across-dp-replicas-interval: after 0 iterations the "
        "parameters of rank(s) 1 differ from their first data-parallel replica (rank 0); "
        "first differing parameter on rank 1: "
    ), err
    if rank == 1:
        assert lines[0].endswith(perturbed["name"]), (lines[0], perturbed)
    assert " iteration        1/" not in out


def test_replica_hashes_integrity_and_progress_with_two_processes(tmp_path):
    run_distributed(_three_runs, 2, str(tmp_path))
