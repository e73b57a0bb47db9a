"""The argparse value types and actions of Megatron's flags that are not plain int/float/str:
layer patterns, tuples, enum members, and the action of a flag Megatron removed. Nothing here
imports torch."""

import argparse
import re

__all__ = [
    "RemovedFlagAction",
    "_parse_cuda_graph_modules_arg",
    "enum_type",
    "la_freq_type",
    "layer_pattern_type",
    "moe_freq_type",
    "no_rope_freq_type",
    "tuple_type",
]


class RemovedFlagAction(argparse.Action):
    """Fails the parse with a hint as soon as a removed flag is seen (exit status 2)."""

    def __init__(self, option_strings, dest, hint="", **kwargs):
        kwargs.pop("nargs", None)
        kwargs.pop("default", None)
        kwargs.pop("help", None)
        # nargs='?' so that both `--batch-size 8` and `--use-legacy-models` reach us.
        super().__init__(
            option_strings,
            dest=argparse.SUPPRESS,
            nargs="?",
            default=argparse.SUPPRESS,
            help=argparse.SUPPRESS,
        )
        self.hint = hint

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is no longer supported: {self.hint}")


# Only digits, list/tuple brackets, commas, '+' and '*' (no '**'): enough for
# "([1]*3+[0])*2" and nothing that can name or call anything, so evaluating it cannot run
# user code.
_PATTERN_CHARS = re.compile(r"^[\d\s,\[\]\(\)\+\*]+$")


def layer_pattern_type(value):
    """Megatron's `--moe-layer-freq` / `--no-rope-freq` value: an int N or a list expression.

    "4" -> 4; "([1]*3+[0])*2" -> [1, 1, 1, 0, 1, 1, 1, 0].
    """
    if value is None or isinstance(value, int):
        return value
    text = str(value).strip()
    if "[" not in text:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected an integer or a list pattern, got {value!r}"
            )
    if not _PATTERN_CHARS.match(text) or "**" in text:
        raise argparse.ArgumentTypeError(
            f"invalid layer pattern {value!r}: only digits, "
            "'[', ']', '(', ')', ',', '+' and '*' are allowed"
        )
    try:
        result = eval(text, {"__builtins__": {}}, {})  # noqa: S307 (charset checked above)
    except Exception as exc:  # SyntaxError, TypeError, ...
        raise argparse.ArgumentTypeError(f"invalid layer pattern {value!r}: {exc}")
    if not (isinstance(result, list) and all(isinstance(x, int) for x in result)):
        raise argparse.ArgumentTypeError(f"layer pattern {value!r} must evaluate to a list of ints")
    return result


# Megatron names its pattern parsers after the flags that use them; the flag surface test
# compares these names, and all three accept the same values.
def moe_freq_type(value):
    """`--moe-layer-freq` / `--window-attn-skip-freq`: an int N or a list pattern."""
    return layer_pattern_type(value)


def no_rope_freq_type(value):
    """`--no-rope-freq`: an int N or a list pattern."""
    return layer_pattern_type(value)


def la_freq_type(value):
    """`--linear-attention-freq`: an int N or a list pattern."""
    return layer_pattern_type(value)


def tuple_type(value):
    """`--window-size`: "128,0" or "(128, 0)" -> (128, 0)."""
    if value is None or isinstance(value, tuple):
        return value
    try:
        return tuple(int(part) for part in str(value).strip("()").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected integers separated by commas, such as 128,0 (got {value!r})"
        ) from None


def enum_type(enum_class):
    """The parser of a flag whose value names a member of `enum_class` (Megatron's handler
    for enum-typed config fields: `--attention-backend flash` -> AttnBackend.flash)."""

    def enum_type_handler(value):
        if isinstance(value, enum_class):
            return value
        try:
            return enum_class[value]
        except KeyError:
            names = ", ".join(member.name for member in enum_class)
            raise argparse.ArgumentTypeError(
                f"invalid choice: {value!r} (choose from {names})"
            ) from None

    return enum_type_handler


def _parse_cuda_graph_modules_arg(value):
    """One module name of `--cuda-graph-modules` / `--cuda-graph-scope` (Megatron's parser
    name); the names are checked where CUDA graphs are built."""
    return str(value)
