"""Megatron-LM command-line arguments: parse_args, validate_args, print_args.

Each flag is one field of a flag group in megatron/training/flags/ (its spelling, default, help
and where it is honoured); the flags this code base refuses or ignores are the rows of
flags/policy.py, applied by flag_policy.py; the cross-flag rules of `validate_args` are one
ordered pass, flags.rules.RULES.
"""

import argparse
import os
import sys

from megatron.training import flag_policy
from megatron.training.flag_errors import ArgumentValidationError
from megatron.training.flags import add_megatron_flags
from megatron.training.flags.data import REMOVED_TOKENIZER_TYPES, add_tokenizer_args
from megatron.training.flags.rules import run_rules
from megatron.training.flags.rules.base import warn

__all__ = [
    "ArgumentValidationError",
    "add_megatron_arguments",
    "add_tokenizer_args",
    "parse_args",
    "validate_args",
    "print_args",
    "parse_and_validate_args",
]


# --------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------
def add_megatron_arguments(parser):
    """Add every Megatron argument group to `parser`; returns it. The help text of each refused
    or no-effect flag names its class (flag_policy)."""
    parser = add_megatron_flags(parser)
    flag_policy.annotate_help(parser)
    return parser


def _reject_removed_tokenizer_type(parser, argv):
    """An old script's --tokenizer-type that Megatron dropped ends with a hint, not with
    argparse's bare "invalid choice"."""
    argv = sys.argv[1:] if argv is None else list(argv)
    for index, item in enumerate(argv):
        if item == "--tokenizer-type" and index + 1 < len(argv):
            value = argv[index + 1]
        elif item.startswith("--tokenizer-type="):
            value = item.split("=", 1)[1]
        else:
            continue
        if value in REMOVED_TOKENIZER_TYPES:
            parser.error(
                f"--tokenizer-type {value} is no longer supported: {REMOVED_TOKENIZER_TYPES[value]}"
            )


def parse_args(extra_args_provider=None, ignore_unknown_args=False, argv=None):
    """Parse `argv` (default sys.argv[1:]). Unknown flags exit with status 2 unless
    `ignore_unknown_args`. `extra_args_provider(parser) -> parser` adds script flags."""
    parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    parser = add_megatron_arguments(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    _reject_removed_tokenizer_type(parser, argv)
    if ignore_unknown_args:
        args, _ = parser.parse_known_args(argv)
    else:
        args = parser.parse_args(argv)
    args.rank = int(os.getenv("RANK", "0"))
    args.world_size = int(os.getenv("WORLD_SIZE", "1"))
    return args


def print_args(title, args):
    """Print every argument on rank 0 in Megatron's format (48-column dots, sorted); the
    no-effect note is printed once, on its own line, by initialize_megatron."""
    if args.rank != 0:
        return
    print(f"------------------------ {title} ------------------------", flush=True)
    lines = [
        f"  {name} {'.' * (48 - len(name))} {value}"
        for name, value in vars(args).items()
        if name != "no_effect_note"
    ]
    for line in sorted(lines, key=lambda text: text.lower()):
        print(line, flush=True)
    print(f"-------------------- end of {title} ---------------------", flush=True)


def parse_and_validate_args(
    extra_args_provider=None, args_defaults=None, ignore_unknown_args=False, argv=None
):
    """parse_args + validate_args; a validation error prints one line and exits with 2."""
    args = parse_args(extra_args_provider, ignore_unknown_args, argv)
    try:
        if args.use_checkpoint_args or (args_defaults or {}).get("use_checkpoint_args", False):
            # Megatron reads the model flags from the checkpoint before validating them.
            from megatron.training.checkpointing import CheckpointError, load_args_from_checkpoint

            try:
                load_args_from_checkpoint(args)
            except CheckpointError as exc:
                raise ArgumentValidationError(f"--use-checkpoint-args: {exc}") from None
        return validate_args(args, args_defaults)
    except ArgumentValidationError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)


# --------------------------------------------------------------------------------------
# Validation (the rules themselves are in flags/rules/, run in the order of flags.rules.RULES)
# --------------------------------------------------------------------------------------
def validate_args(args, defaults=None):
    """Apply `defaults` (only where the arg is None), check every cross-flag rule, fill in
    the derived values and apply the flag policy: refused flags raise, no-effect flags are
    named in ``args.no_effect_note`` (printed at start-up). Raises ArgumentValidationError
    naming the flags and values at fault. Megatron's validate_args ends by printing the
    arguments; this one leaves that to the caller (initialize_megatron calls print_args)."""
    _apply_defaults(args, defaults or {})
    # The policy judges what the user gave, before the rules derive other values from it.
    given = argparse.Namespace(**vars(args))
    run_rules(args)
    refusal = flag_policy.refusal(given)
    if refusal is not None:
        raise ArgumentValidationError(refusal)
    if not hasattr(args, "no_effect_note"):  # validate_args may run twice on one args
        args.no_effect_note = flag_policy.no_effect_note(given)
    # Transformer Engine is never used: the local implementation runs whatever was asked
    # (the note above says so when another implementation was requested).
    args.transformer_impl = "local"
    return args


def _apply_defaults(args, defaults):
    for key, value in defaults.items():
        current = getattr(args, key, None)
        if current is None:
            setattr(args, key, value)
        elif current != value:
            warn(args, f"overriding default arguments for {key}:{value} with {key}:{current}")
