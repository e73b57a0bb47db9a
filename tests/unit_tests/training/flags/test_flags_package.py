"""The flags package (megatron/training/flags/): one record per flag, the policy joined to it, the
generated document kept current, and imports without torch."""

import subprocess
import sys
from typing import List, Optional

import pytest

from megatron.training.flags import GROUPS, POLICY
from megatron.training.flags.doc import DOCUMENT, render, rule_reads
from megatron.training.flags.policy import HONOURED, policy_of
from megatron.training.flags.spec import flag, flag_group, switch
from tests.harness import REPO


def test_the_flags_document_is_current():
    expected, actual = DOCUMENT.read_text().splitlines(), render().splitlines()
    first = next(
        (i for i, (a, b) in enumerate(zip(actual, expected)) if a != b),
        None if len(actual) == len(expected) else min(len(actual), len(expected)),
    )
    assert first is None, (
        f"docs/FLAGS.md is stale from line {first + 1} "
        "(python -m megatron.training.flags.doc rewrites it)"
    )


def test_every_dest_is_one_field_and_every_honoured_flag_says_where():
    fields = [f.name for group in GROUPS for f in group.__dataclass_fields__.values()]
    assert len(fields) == len(set(fields)) == len(POLICY) > 800
    honoured = [rule for rule in POLICY.values() if rule.kind == HONOURED]
    assert len(honoured) > 250 and all(rule.reason for rule in honoured)


def test_an_honoured_flag_without_its_place_is_refused_at_import():
    @flag_group("made up")
    class MadeUp:
        made_up_size: Optional[int] = flag(None, "A flag nobody reads.")

    with pytest.raises(ValueError, match="MadeUp.made_up_size: an honoured flag says where"):
        policy_of(GROUPS + (MadeUp,))


def test_a_dest_declared_twice_and_a_row_without_its_flag_are_refused():
    @flag_group("again")
    class Again:
        seed: int = flag(1, "Declared a second time.", honoured_at="nowhere")

    with pytest.raises(
        ValueError, match="seed is declared twice: in InitializationFlags and Again"
    ):
        policy_of(GROUPS + (Again,))
    with pytest.raises(ValueError, match="policy rows without a flag: .*softmax_type"):
        policy_of(GROUPS[1:])  # the network-size group's refused rows lose their flags


def test_a_declaration_argparse_cannot_take_fails_at_import():
    with pytest.raises(TypeError, match="no argparse type for the annotation"):

        @flag_group("bad")
        class Bad:
            sizes: Optional[List[complex]] = flag(None, "Complex sizes.", nargs="+")

    with pytest.raises(TypeError, match="Plain.plain is not declared with flag"):

        @flag_group("plain")
        class Plain:
            plain: int = 3
            on: bool = switch("A switch.", honoured_at="here")


def test_the_rule_steps_that_read_a_flag_are_found_in_their_source():
    reads = rule_reads()
    # The range of --moe-router-topk is checked once on the command line (core checks it too).
    assert reads["moe_router_topk"] == ["shape.validate_moe_shape"]
    # Read through megatron/core/transformer/config_rules.py's muP table.
    assert reads["mup_embedding_mult"] == ["numerics.validate_numerics"]
    assert "seed" not in reads


def test_the_rule_pass_visits_each_module_once():
    from megatron.training.flags.rules import RULES

    modules = [step.__module__ for step in RULES]
    runs = [m for i, m in enumerate(modules) if i == 0 or modules[i - 1] != m]
    assert len(RULES) > 15 and len(runs) == len(set(runs)), runs


def test_the_flags_import_without_torch():
    code = (
        "import sys\n"
        "import megatron.training.flag_policy, megatron.training.flags.rules\n"
        "import megatron.training.flags.doc\n"
        "print('torch' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "False"
