"""Adding a model family edits no loop: a family defined in a test package (tests/unit_tests/
toy_family: its TrainSpec, a GPT-built model, datasets, forward step and FLOPs of its own) trains
through Megatron's pretrain() with the spec as its only registration."""

import argparse
import math

import pytest

from megatron.training import pretrain
from megatron.training.flag_errors import ArgumentValidationError
from megatron.training.log_parsing import parse_log_lines
from megatron.training.model_families import get_model_family
from tests.harness import REPO
from tests.harness.argv import TINY_RUN, megatron_argv
from tests.unit_tests import toy_family


def _outside_tests():
    files = sorted(REPO.glob("pretrain_*.py")) + sorted(REPO.glob("Makefile"))
    for folder in ("megatron", "tools", "examples", "docs"):
        files += sorted(p for p in (REPO / folder).rglob("*") if p.is_file())
    return files


def test_a_family_outside_the_package_trains_through_its_spec_alone(
    single_process_env, fresh_globals, capsys
):
    spec = toy_family.SPEC
    # Registered nowhere: neither the registry nor any file outside tests/ knows it.
    with pytest.raises(ValueError, match="unknown model family 'toy'; known: bert, gpt, mamba, t5"):
        get_model_family("toy")
    named = [str(p) for p in _outside_tests() if "toy_family" in p.read_text(errors="ignore")]
    assert not named, named

    toy_family.CALLS.clear()
    # No --tokenizer-type and no data flags: the spec's defaults and datasets supply them.
    argv = megatron_argv(
        base=TINY_RUN, mock_data=None, tokenizer_type=None, train_iters=2, lr_warmup_iters=1
    )
    pretrain(
        spec.train_valid_test_datasets_provider,
        spec.model_provider,
        spec.model_type,
        spec.forward_step,
        argv=argv,
        model_family=spec,
    )
    out = capsys.readouterr().out
    losses = parse_log_lines(out.splitlines()).get("lm loss")
    assert sorted(losses) == [1, 2] and all(math.isfinite(v) for v in losses.values()), out
    calls = dict(toy_family.CALLS)
    # One model chunk; datasets once, for 2 iterations x 8 samples; 4 micro-batches a step.
    assert calls["model_provider"] == 1 and calls["datasets"] == 1, calls
    assert calls["train samples"] == 16 and calls["forward_step"] == 8, calls
    assert calls["flops"] >= 2, calls  # the iteration's FLOPs came from the family's formula


def test_the_spec_checks_its_flags_like_a_registered_family():
    spec = toy_family.SPEC
    with pytest.raises(
        ArgumentValidationError,
        match=r"^--mask-prob is read by pretrain_bert.py / pretrain_t5.py only; the toy model",
    ):
        spec.check_args(argparse.Namespace(mask_prob=0.3, pipeline_model_parallel_size=1))
    with pytest.raises(ArgumentValidationError, match="keeps its model on one pipeline stage"):
        spec.check_args(argparse.Namespace(pipeline_model_parallel_size=2))
