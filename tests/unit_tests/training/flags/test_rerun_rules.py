"""Every rule of flags/rules/rerun.py has a command line that breaks it (the words of
its message in order), and the module has no rule without one."""

import functools
import re

import pytest

from megatron.training.arguments import ArgumentValidationError
from megatron.training.flags.rules import rerun as rerun_rules
from tests.unit_tests.tiny_configs import tiny_args
from tests.unit_tests.training.flags.rule_coverage import fired_rule_sites, rule_sites

RULES = (rerun_rules,)

CASES = [
    pytest.param(
        ["--error-injection-rate", -1],
        ["--error-injection-rate must be >= 0", "got -1"],
        id="injection_rate_not_negative",
    ),
    pytest.param(
        ["--error-injection-rate", 5, "--rerun-mode", "report_stats"],
        ["--error-injection-rate 5 needs --rerun-mode validate_results", "report_stats"],
        id="injection_needs_validate_results",
    ),
    pytest.param(
        ["--check-for-large-grads", "--use-torch-fsdp2", "--no-gradient-accumulation-fusion"]
        + ["--untie-embeddings-and-output-weights"],
        ["--check-for-large-grads needs the DDP gradient buffers", "--use-torch-fsdp2"],
        id="large_grads_not_with_fsdp",
    ),
]


@pytest.mark.parametrize("extra, words", CASES)
def test_rule(extra, words):
    with pytest.raises(ArgumentValidationError, match=".*".join(map(re.escape, words))):
        tiny_args(*extra)


def test_the_flags_pass_together_where_they_apply():
    args = tiny_args(
        "--error-injection-rate", 3, "--error-injection-type", "persistent_error",
        "--check-for-spiky-loss", "--check-for-large-grads",
    )  # fmt: skip
    assert (args.rerun_mode, args.error_injection_rate) == ("validate_results", 3)


def test_every_rule_has_a_case():
    fired = fired_rule_sites([functools.partial(tiny_args, *p.values[0]) for p in CASES], RULES)
    sites = rule_sites(RULES)
    assert len(sites) == 3  # the module was read
    assert sites <= fired, f"rules in {rerun_rules.__file__} without a case: {sites - fired}"
