"""Model families: the trainer, the dry run and the checkpoint check take their model-specific
figures from the family given to pretrain(), never from GPT's formulas directly."""

import argparse
import dataclasses
import sys

import pytest
import torch

from megatron.training import global_vars
from megatron.training.model_families import get_model_family, model_family_names
from tests.functional_tests.runner import REPO, TINY_MODEL

sys.path.insert(0, str(REPO))
import pretrain_gpt  # noqa: E402


def test_registry_finds_gpt_and_names_the_known_families():
    assert "gpt" in model_family_names()
    gpt = get_model_family("gpt")
    assert gpt.name == "gpt" and gpt.args_defaults == {"tokenizer_type": "GPT2BPETokenizer"}
    assert "num_layers" in gpt.checkpoint_model_args
    with pytest.raises(ValueError, match="unknown model family 't6'; known: bert, gpt, mamba, t5"):
        get_model_family("t6")


def test_dry_run_takes_the_family_by_name(capsys):
    from megatron.training.dry_run import main

    flags = TINY_MODEL + ["--train-iters", "4"]
    assert main(["--dry-run-model", "nope"] + flags) == 2
    assert "error: --dry-run-model: unknown model family 'nope'" in capsys.readouterr().err
    assert main(["--dry-run-model=gpt"] + flags) == 0
    assert "dry run OK" in capsys.readouterr().out


def _pretrain(argv, family):
    global_vars.reset_globals()
    try:
        pretrain_gpt.pretrain(
            pretrain_gpt.train_valid_test_datasets_provider,
            pretrain_gpt.model_provider,
            pretrain_gpt.ModelType.encoder_or_decoder,
            pretrain_gpt.forward_step,
            argv=argv,
            model_family=family,
        )
    finally:
        global_vars.reset_globals()


def test_trainer_uses_the_family_for_flops_memory_and_checkpoint_args(tmp_path, capsys):
    gpt = get_model_family("gpt")
    counted = []

    def count_parameters(args, padded_vocab):
        counted.append(padded_vocab)
        return gpt.count_parameters(args, padded_vocab)

    probe = dataclasses.replace(
        gpt,
        name="probe",
        num_floating_point_operations=lambda args, batch_size: 1000.0 * batch_size,
        count_parameters=count_parameters,
        checkpoint_model_args=gpt.checkpoint_model_args + ("seed",),
    )
    save = ["--save", str(tmp_path), "--save-interval", "2"]
    _pretrain(TINY_MODEL + ["--train-iters", "3"] + save, probe)
    assert counted  # the start-up memory report counted with the family's formula
    path = tmp_path / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt"
    with torch.serialization.safe_globals([argparse.Namespace]):
        saved = torch.load(path, weights_only=True)
    assert saved["num_floating_point_operations_so_far"] == 2 * 8 * 1000.0  # 2 steps x 8 samples
    capsys.readouterr()

    seed = TINY_MODEL.index("--seed") + 1
    other_seed = TINY_MODEL[:seed] + ["99"] + TINY_MODEL[seed + 1 :]
    with pytest.raises(SystemExit, match="^1$"):
        _pretrain(other_seed + ["--train-iters", "5", "--load", str(tmp_path)], probe)
    assert "was saved with --seed 1234, but this run uses 99" in capsys.readouterr().err
