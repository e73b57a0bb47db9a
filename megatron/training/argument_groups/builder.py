"""Small helpers that keep the flag tables short: one call per flag.

`ArgGroup` wraps an argparse argument group. Each method adds one flag with Megatron's
spelling; the flag's dest is argparse's usual one (dashes become underscores) unless
given. `removed()` registers a flag that Megatron dropped, so that an old launch script
fails with a hint instead of a bare "unrecognized arguments".
"""

import argparse
import builtins
import re

__all__ = [
    "ArgGroup",
    "RemovedFlagAction",
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


class ArgGroup:
    """An argparse group with compact adders: `g.int('--seed', 1234, 'help')`."""

    def __init__(self, parser, title):
        self.parser = parser
        self.group = parser.add_argument_group(title=title)

    def _add(self, flags, **kwargs):
        flags = (flags,) if isinstance(flags, builtins.str) else tuple(flags)
        # '%' would be read by argparse as a format directive in help strings.
        kwargs["help"] = kwargs.get("help", "").replace("%", "%%")
        return self.group.add_argument(*flags, **kwargs)

    def int(self, flags, default, help, **kwargs):
        return self._add(flags, type=builtins.int, default=default, help=help, **kwargs)

    def float(self, flags, default, help, **kwargs):
        return self._add(flags, type=builtins.float, default=default, help=help, **kwargs)

    def str(self, flags, default, help, **kwargs):
        return self._add(flags, type=builtins.str, default=default, help=help, **kwargs)

    def true(self, flags, help, **kwargs):
        """A store_true switch (default False unless `default=` is given)."""
        return self._add(flags, action="store_true", help=help, **kwargs)

    def false(self, flags, dest, help, **kwargs):
        """A `--no-x` / `--disable-x` switch: dest defaults to True, the flag stores False."""
        return self._add(flags, action="store_false", dest=dest, help=help, **kwargs)

    def no(self, name, help, **kwargs):
        """Megatron's switch for a setting that is on by default: `--no-<name>` and
        `--disable-<name>` both store False into `<name>` (dashes become underscores)."""
        dest = name.replace("-", "_")
        return self.false((f"--no-{name}", f"--disable-{name}"), dest, help, **kwargs)

    def both(self, flag, default, help, **kwargs):
        """`--x` / `--no-x` (argparse.BooleanOptionalAction)."""
        return self._add(
            flag, action=argparse.BooleanOptionalAction, default=default, help=help, **kwargs
        )

    def list(self, flags, default, help, type=builtins.str, nargs="+", **kwargs):
        return self._add(flags, type=type, nargs=nargs, default=default, help=help, **kwargs)

    def alias(self, flag, dest, type=None):
        """A hidden older spelling that writes into an existing flag's dest (it has no default
        of its own, so the main flag's default stands)."""
        return self.group.add_argument(
            flag, dest=dest, type=type, default=argparse.SUPPRESS, help=argparse.SUPPRESS
        )

    def removed(self, flags, hint):
        return self.group.add_argument(
            *((flags,) if isinstance(flags, builtins.str) else flags),
            action=RemovedFlagAction,
            hint=hint,
        )


# Only digits, list/tuple brackets, commas, '+' and '*' (no '**'): enough for
# "([1]*3+[0])*2" and nothing that can name or call anything, so evaluating it cannot run
# user code.
_PATTERN_CHARS = re.compile(r"^[\d\s,\[\]\(\)\+\*]+$")


def layer_pattern_type(value):
    """Megatron's `--moe-layer-freq` / `--no-rope-freq` value: an int N or a list expression.

    "4" -> 4; "([1]*3+[0])*2" -> [1, 1, 1, 0, 1, 1, 1, 0].
    """
    if value is None or isinstance(value, builtins.int):
        return value
    text = builtins.str(value).strip()
    if "[" not in text:
        try:
            return builtins.int(text)
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
    if not (isinstance(result, builtins.list) and all(isinstance(x, builtins.int) for x in result)):
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
        return tuple(builtins.int(part) for part in builtins.str(value).strip("()").split(","))
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
