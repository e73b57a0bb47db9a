"""What the cross-flag rules of validate_args (megatron/training/arguments.py) share: the error
they raise and the helpers that raise it or print a note.

The rules live beside this module, one family of flags each (model_rules, parallel_rules,
training_rules, io_rules, moe_rules, numerics_rules, rerun_rules): each `validate_*` function
checks its flags, fills in the values derived from them and raises ArgumentValidationError with
a message naming the flags and values.
"""


class ArgumentValidationError(ValueError):
    """A flag value, or a combination of flags, that cannot work. The message names them."""


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
