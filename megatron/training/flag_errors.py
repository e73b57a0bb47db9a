"""The errors of bad flags: a flag value or combination that validation refuses
(ArgumentValidationError), and a ValueError or AssertionError raised while the model or the data
is built from the flags: the user's input at fault (a shape that does not divide, a data path, a
split ...). Each ends the run with one ``error:`` line that names the flags involved, not with a
traceback."""

from __future__ import annotations

import os
import re
import traceback
from contextlib import contextmanager

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class ArgumentValidationError(ValueError):
    """A flag value, or a combination of flags, that cannot work. The message names them."""


class BuildFromFlagsError(RuntimeError):
    """What was being built, the message of the error raised, the flags it names and where."""


class UserInputError(RuntimeError):
    """Input the user gave (a data file, a flag) found wrong while the run goes on; its message
    names the file or flag and the run ends with that one line, without a traceback."""


def _flags_named(message: str, args) -> list:
    """The flags whose dest appears as a word of `message` (e.g. ``num_attention_heads``)."""
    if args is None:
        return []
    words = set(re.findall(r"[a-z][a-z0-9_]+", message))
    return sorted(
        "--" + dest.replace("_", "-")
        for dest in vars(args)
        if "_" in dest and dest in words and f"--{dest.replace('_', '-')}" not in message
    )


def _where(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    frame = frames[-1]
    path = (
        os.path.relpath(frame.filename, _REPO)
        if frame.filename.startswith(_REPO)
        else frame.filename
    )
    return f"{path}:{frame.lineno}"


def describe(exc: BaseException, what: str, args) -> str:
    """One line: the error's message (all its lines joined), the flags it names, and where it
    was raised."""
    message = " ".join(str(exc).split()) or f"{type(exc).__name__} without a message"
    flags = _flags_named(message, args)
    named = f" (flags: {', '.join(flags)})" if flags else ""
    where = _where(exc)
    at = f", raised at {where}" if where else ""
    return f"{message}{named} [while building the {what} from the command-line flags{at}]"


@contextmanager
def building(what: str, args):
    """Turn a ValueError/AssertionError raised inside into a BuildFromFlagsError."""
    try:
        yield
    except (ValueError, AssertionError) as exc:
        raise BuildFromFlagsError(describe(exc, what, args)) from exc
