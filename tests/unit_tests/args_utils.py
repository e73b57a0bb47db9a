"""Megatron argument namespaces for unit tests."""

from megatron.training.arguments import parse_args


def megatron_args(**overrides):
    """The arguments of a command line without flags (every flag at its Megatron default), with
    ``overrides`` set on top: code that starts reading another flag still finds it here, unlike in
    a hand-written ``argparse.Namespace``."""
    args = parse_args(argv=[])
    for name, value in overrides.items():
        setattr(args, name, value)
    return args
