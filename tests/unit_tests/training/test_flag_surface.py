"""The parser accepts every option of Megatron-LM's parser (commit d98e8a64) with Megatron's
spellings, dest, kind, type, nargs, choices and default.

The reference is tests/data/megatron_head_flags.jsonl: one JSON object per Megatron option, with
choices and defaults written the way json.dumps(..., default=repr) writes them (an enum member
as its repr, an IntEnum such as signal.SIGTERM as its number). Our parser's values are passed
through the same conversion before they are compared.
"""

import argparse
import json
import signal

import pytest

from megatron.core.transformer.enums import AttnBackend
from megatron.training.arguments import add_megatron_arguments, parse_args
from megatron.training.flags.types import RemovedFlagAction
from tests.harness import REPO

FLAGS_FILE = REPO / "tests" / "data" / "megatron_head_flags.jsonl"
ROWS = [json.loads(line) for line in FLAGS_FILE.read_text().splitlines() if line.strip()]
KINDS = {
    argparse._StoreAction: "value",
    argparse._StoreTrueAction: "store_true",
    argparse._StoreFalseAction: "store_false",
    argparse.BooleanOptionalAction: "bool_optional",
}


@pytest.fixture(scope="module")
def parser():
    # Defaults read from the environment (--local-rank, --inprocess-active-world-size) as in a
    # plain single-process start, the situation the reference file was written in.
    with pytest.MonkeyPatch.context() as mp:
        for name in ("LOCAL_RANK", "WORLD_SIZE", "RANK"):
            mp.delenv(name, raising=False)
        return add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))


def _as_json(value):
    return json.loads(json.dumps(value, default=repr))


def _same(a, b):
    """Equal and of the same JSON type (100 == 100.0 and 1 == True, but Megatron's int default
    of a float flag must stay an int)."""
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b and type(a) is type(b)


def _describe(action):
    nargs = action.nargs
    return {
        "flags": sorted(action.option_strings),
        "dest": action.dest,
        "kind": KINDS.get(type(action), type(action).__name__),
        "type": None if action.type is None else action.type.__name__,
        "nargs": nargs,
        "choices": None if action.choices is None else _as_json(list(action.choices)),
        "default": _as_json(action.default),
    }


def test_the_reference_file_is_the_whole_surface():
    assert len(ROWS) == 838
    assert len({flag for row in ROWS for flag in row["flags"]}) == sum(
        len(r["flags"]) for r in ROWS
    )


def test_every_megatron_option_parses_as_in_megatron(parser):
    by_flag = {flag: action for action in parser._actions for flag in action.option_strings}
    wrong = []
    for row in ROWS:
        actions = {id(by_flag[f]): by_flag[f] for f in row["flags"] if f in by_flag}
        if len(actions) != 1 or any(f not in by_flag for f in row["flags"]):
            wrong.append((row["flags"], "not one action for all spellings"))
            continue
        ours = _describe(next(iter(actions.values())))
        theirs = {key: row[key] for key in ours}
        theirs["flags"] = sorted(row["flags"])
        diff = {k: (ours[k], theirs[k]) for k in ours if not _same(ours[k], theirs[k])}
        if diff:
            wrong.append((row["flags"][0], diff))
    assert not wrong, f"{len(wrong)} options differ from Megatron's:\n" + "\n".join(map(str, wrong))


def test_no_option_of_our_own(parser):
    """Every option is Megatron's, a removed-flag hint, a hidden older spelling or one of the
    extensions declared as such (listed in docs/FLAGS.md; test_the_extensions below)."""
    megatron = {flag for row in ROWS for flag in row["flags"]}
    extra = [
        flag
        for action in parser._actions
        if not isinstance(action, (RemovedFlagAction, argparse._HelpAction))
        and action.help != argparse.SUPPRESS
        and not action.extension
        for flag in action.option_strings
        if flag not in megatron
    ]
    assert extra == []


def test_the_extensions(parser):
    """The flags of this project that Megatron-LM lacks: none of them is Megatron's."""
    megatron = {flag for row in ROWS for flag in row["flags"]}
    extensions = [
        f for a in parser._actions if getattr(a, "extension", False) for f in a.option_strings
    ]
    assert extensions == ["--compile-transformer-layers"]
    assert not megatron.intersection(extensions)


def test_typed_values_parse_like_megatron():
    args = parse_args(
        argv=[
            "--attention-backend",
            "flash",
            "--exit-signal",
            "SIGUSR1",
            "--rampup-batch-size",
            "16",
            "8",
            "300",
            "--window-size",
            "(128, 0)",
            "--moe-layer-freq",
            "([1]*2+[0])*2",
            "--linear-attention-freq",
            "3",
            "--local_rank",
            "3",
            "--no-inference-dynamic-batching-prefix-caching",
            "--disable-tp-comm-bulk-wgrad",
        ]
    )
    assert args.attention_backend is AttnBackend.flash
    assert args.exit_signal is signal.SIGUSR1
    assert args.rampup_batch_size == [16, 8, 300]
    assert args.window_size == (128, 0)
    assert args.moe_layer_freq == [1, 1, 0, 1, 1, 0]
    assert args.linear_attention_freq == 3
    assert args.local_rank == 3
    assert args.inference_dynamic_batching_enable_prefix_caching is False
    assert args.tp_comm_bulk_wgrad is False


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--attention-backend", "cudnn"], "invalid choice: 'cudnn'"),
        (["--exit-signal", "SIGFOO"], "invalid choice: 'SIGFOO'"),
        (["--window-size", "a,b"], "expected integers"),
        (["--rampup-batch-size", "16", "8"], "expected 3 arguments"),
    ],
)
def test_bad_typed_values_end_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit, match="^2$"):
        parse_args(argv=argv)
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
