"""What the rules share: the error they raise and the helpers that raise it or print a note."""

from megatron.training.flag_errors import ArgumentValidationError

__all__ = ["ArgumentValidationError", "check", "fail", "flag_name", "info", "warn"]


def fail(message):
    raise ArgumentValidationError(message)


def check(condition, message):
    if not condition:
        fail(message)


def flag_name(dest):
    return "--" + dest.replace("_", "-")


def warn(args, message):
    if args.rank == 0:
        print(f"WARNING: {message}", flush=True)


def info(args, message):
    if args.rank == 0:
        print(message, flush=True)
