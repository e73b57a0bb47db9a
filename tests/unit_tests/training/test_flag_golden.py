"""Golden copies of the parser's surface as users see it: the ``--help`` text, byte for byte, and
the namespace of a command line without flags (every dest, its value and the value's type, in
parser order). test_flag_surface.py compares each option with Megatron-LM's; these goldens catch
what it does not read: help text, group titles and order, option order, hidden aliases, and the
order and types of the parsed defaults.

To accept an intended change, rewrite the goldens and review their diff:
    python -m tests.unit_tests.training.test_flag_golden
"""

import contextlib
import io
import json
import sys

import pytest

from megatron.training.arguments import parse_args
from tests.harness import REPO

DATA = REPO / "tests" / "data"
HELP_FILE = DATA / "megatron_help.txt"
DEFAULTS_FILE = DATA / "megatron_defaults.json"
# argparse lays help out differently across Python versions (3.10 appends "(default: ...)" to the
# help of --x/--no-x flags, 3.13 prints the metavar once for options with several spellings); the
# golden text was written by 3.11, whose layout 3.12 shares.
HELP_PYTHONS = ((3, 11), (3, 12))
COLUMNS = "100"
PROG = "pretrain_gpt.py"


def _environment(mp):
    # Defaults read from the environment (--local-rank, --inprocess-active-world-size) and the
    # rank/world size parse_args reads, as in a plain single-process start.
    for name in ("LOCAL_RANK", "WORLD_SIZE", "RANK"):
        mp.delenv(name, raising=False)
    mp.setenv("COLUMNS", COLUMNS)
    mp.setattr(sys, "argv", [PROG])


def help_text():
    with pytest.MonkeyPatch.context() as mp:
        _environment(mp)
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit, match="^0$"):
            parse_args(argv=["--help"])
    return out.getvalue()


def defaults():
    """[dest, type of the value, repr of the value] of every dest of parse_args([])."""
    with pytest.MonkeyPatch.context() as mp:
        _environment(mp)
        args = parse_args(argv=[])
    return [
        [dest, f"{type(value).__module__}.{type(value).__qualname__}", repr(value)]
        for dest, value in vars(args).items()
    ]


@pytest.mark.skipif(
    sys.version_info[:2] not in HELP_PYTHONS,
    reason="the golden --help text is argparse's layout of Python 3.11/3.12",
)
def test_help_text_is_unchanged():
    expected = HELP_FILE.read_text()
    actual = help_text()
    assert len(expected) > 100_000  # the golden holds every option
    if actual != expected:
        ours, theirs = actual.splitlines(), expected.splitlines()
        first = next(
            (i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs))
        )
        context = "\n".join(
            f"line {i + 1}:\n  now:    {ours[i] if i < len(ours) else '<end>'}\n"
            f"  golden: {theirs[i] if i < len(theirs) else '<end>'}"
            for i in range(first, min(first + 3, max(len(ours), len(theirs))))
        )
        pytest.fail(f"--help differs from {HELP_FILE.name} from line {first + 1}:\n{context}")


def test_defaults_are_unchanged():
    expected = json.loads(DEFAULTS_FILE.read_text())
    actual = defaults()
    assert len(expected) > 800  # every dest
    assert [row[0] for row in actual] == [row[0] for row in expected]  # the same dests, in order
    wrong = [(ours, theirs) for ours, theirs in zip(actual, expected) if ours != theirs]
    assert not wrong, f"{len(wrong)} defaults differ (now, golden): {wrong[:10]}"


def test_environment_defaults_are_read_when_the_parser_is_built(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    args = parse_args(argv=[])
    assert (args.local_rank, args.inprocess_active_world_size, args.world_size) == (3, 4, 4)
    monkeypatch.setenv("LOCAL_RANK", "5")
    assert parse_args(argv=[]).local_rank == 5


if __name__ == "__main__":
    HELP_FILE.write_text(help_text())
    DEFAULTS_FILE.write_text("[\n" + ",\n".join(json.dumps(row) for row in defaults()) + "\n]\n")
    print(f"wrote {HELP_FILE} and {DEFAULTS_FILE}")
