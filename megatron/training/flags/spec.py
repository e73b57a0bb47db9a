"""One record per flag: a field of a flag-group dataclass, and the argparse parser made from them.

A flag group is a class decorated with ``@flag_group(title)``; each of its fields is one argparse
dest (the field name) declared by one of the factories below, which hold the spellings, type,
default, choices, nargs, help and where the flag is honoured (``honoured_at``). ``add_groups``
turns the groups into argparse groups and actions, in field order, and tags each action with the
module that declares it (``action.home_module``). Nothing here imports torch.

    @flag_group("initialization")
    class InitializationFlags:
        seed: int = flag(1234, "Random seed for python, numpy, torch and CUDA.",
                         honoured_at="TransformerConfig.init_seed; ...")

The value type of a ``flag`` is its annotation's (``int``, ``Optional[float]``, ``List[str]``);
other parsers (layer patterns, enums) and untyped flags (``type=None``) say so with ``type=``.
"""

import argparse
import dataclasses
import functools
import os
import typing
from typing import Any, Dict, Optional, Sequence, Tuple, Union

from megatron.training.flags.types import RemovedFlagAction

__all__ = [
    "FlagSpec",
    "FromEnv",
    "add_group",
    "add_groups",
    "flag",
    "flag_group",
    "off_switch",
    "options_of",
    "switch",
    "toggle",
]

VALUE = "value"
SWITCH = "store_true"
OFF_SWITCH = "store_false"
TOGGLE = "--x/--no-x"


class _FromAnnotation:
    def __repr__(self):
        return "<the annotation's type>"


FROM_ANNOTATION = _FromAnnotation()


@dataclasses.dataclass(frozen=True)
class FlagSpec:
    """What a field says about its flag besides its name (the dest) and default."""

    kind: str
    """VALUE (store), SWITCH (store_true), OFF_SWITCH (store_false) or TOGGLE (--x/--no-x)."""
    help: str
    options: Optional[Tuple[str, ...]] = None
    """The spellings; None: derived from the dest (``--a-b``; ``--no-a-b --disable-a-b`` for an
    OFF_SWITCH)."""
    type: Any = FROM_ANNOTATION
    nargs: Any = None
    choices: Any = None
    metavar: Any = None
    aliases: Tuple[str, ...] = ()
    """Hidden older spellings writing into the same dest (no default of their own)."""
    negation: Optional[Tuple[str, str]] = None
    """(spelling, help) of a store_false flag sharing a SWITCH's dest."""
    extension: bool = False
    """A flag of this project that Megatron-LM does not have (docs/FLAGS.md says so)."""
    honoured_at: Optional[str] = None
    """Where the value takes effect: a config field (``TransformerConfig.x``) or the functions
    that read it (``module.function``, relative to megatron/training/; ``core.`` for
    megatron/core/, ``pretrain_gpt``, ``pretrain_*`` for every family's script, ``tools.``).
    Refused and no-effect flags have a row in flags/policy.py instead."""


class FromEnv:
    """A default read from the environment when the parser is built, as Megatron's parser reads
    ``LOCAL_RANK`` and ``WORLD_SIZE``."""

    def __init__(self, variable: str, fallback: int):
        self.variable, self.fallback = variable, fallback

    def __call__(self):
        return type(self.fallback)(os.getenv(self.variable, str(self.fallback)))

    def __repr__(self):
        return f"${self.variable} (unset: {self.fallback})"


def _spellings(options) -> Optional[Tuple[str, ...]]:
    if options is None:
        return None
    return (options,) if isinstance(options, str) else tuple(options)


def _field(default, spec: FlagSpec):
    metadata = {"flag": spec}
    if isinstance(default, FromEnv):
        return dataclasses.field(default_factory=default, metadata=metadata)
    if isinstance(default, list):  # a fresh list for each parser, as a literal in a function gives
        return dataclasses.field(
            default_factory=functools.partial(list, default), metadata=metadata
        )
    return dataclasses.field(default=default, metadata=metadata)


def flag(
    default=None,
    help: str = "",
    *,
    options=None,
    type=FROM_ANNOTATION,
    nargs=None,
    choices=None,
    metavar=None,
    aliases: Sequence[str] = (),
    honoured_at: Optional[str] = None,
):
    """A flag that takes a value (argparse's store)."""
    spec = FlagSpec(
        VALUE,
        help,
        _spellings(options),
        type,
        nargs,
        choices,
        metavar,
        tuple(aliases),
        honoured_at=honoured_at,
    )
    return _field(default, spec)


def switch(
    help: str,
    *,
    default=False,
    options=None,
    negation: Optional[Tuple[str, str]] = None,
    honoured_at: Optional[str] = None,
    extension: bool = False,
):
    """``--x`` stores True (argparse's store_true). ``extension``: a flag of this project, not
    Megatron-LM's."""
    spec = FlagSpec(
        SWITCH,
        help,
        _spellings(options),
        None,
        negation=negation,
        honoured_at=honoured_at,
        extension=extension,
    )
    return _field(default, spec)


def off_switch(help: str, *, options=None, honoured_at: Optional[str] = None):
    """A setting that is on by default: the flag stores False (argparse's store_false). Its
    spellings default to Megatron's pair ``--no-<x>`` / ``--disable-<x>``."""
    spec = FlagSpec(OFF_SWITCH, help, _spellings(options), None, honoured_at=honoured_at)
    return _field(True, spec)


def toggle(default, help: str, *, options=None, type=None, honoured_at: Optional[str] = None):
    """``--x`` / ``--no-x`` (argparse.BooleanOptionalAction)."""
    spec = FlagSpec(TOGGLE, help, _spellings(options), type, honoured_at=honoured_at)
    return _field(default, spec)


def _value_type(annotation):
    """int/float/str from ``int``, ``Optional[int]``, ``List[int]``, ``Optional[List[int]]``."""
    if annotation in (int, float, str):
        return annotation
    origin, members = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Union:
        present = [m for m in members if m is not type(None)]
        if len(present) == 1:
            return _value_type(present[0])
    elif origin is list and len(members) == 1:
        return _value_type(members[0])
    raise TypeError(f"no argparse type for the annotation {annotation!r}: pass type=")


def _options(name: str, spec: FlagSpec) -> Tuple[str, ...]:
    if spec.options is not None:
        return spec.options
    dashed = name.replace("_", "-")
    if spec.kind == OFF_SWITCH:
        return (f"--no-{dashed}", f"--disable-{dashed}")
    return (f"--{dashed}",)


def _help(text: str) -> str:
    # argparse formats help strings with %: a literal percent sign is written %%.
    return text.replace("%", "%%")


def _default(field: dataclasses.Field):
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def _argparse_kwargs(field: dataclasses.Field, annotation, default) -> Dict[str, Any]:
    spec: FlagSpec = field.metadata["flag"]
    kwargs: Dict[str, Any] = {"dest": field.name, "help": _help(spec.help)}
    if spec.kind == VALUE:
        value_type = _value_type(annotation) if spec.type is FROM_ANNOTATION else spec.type
        kwargs.update(type=value_type, default=default)
        for key in ("nargs", "choices", "metavar"):
            if getattr(spec, key) is not None:
                kwargs[key] = getattr(spec, key)
    elif spec.kind == SWITCH:
        kwargs.update(action="store_true", default=default)
    elif spec.kind == OFF_SWITCH:
        kwargs.update(action="store_false")
    elif spec.kind == TOGGLE:
        kwargs.update(action=argparse.BooleanOptionalAction, default=default)
        if spec.type is not None:
            kwargs["type"] = spec.type
    else:
        raise ValueError(f"{field.name}: unknown flag kind {spec.kind!r}")
    return kwargs


def flag_group(title: str, *, removed: Optional[Dict[Union[str, Tuple[str, ...]], str]] = None):
    """Make ``cls`` a flag group: a dataclass whose fields are the flags of the argparse group
    ``title``, in order. ``removed`` maps the spellings of flags Megatron dropped to a hint: an
    old launch script fails with it instead of a bare "unrecognized arguments"."""

    def make(cls):
        cls = dataclasses.dataclass(kw_only=True)(cls)
        cls.TITLE = title
        cls.REMOVED = {_spellings(k): hint for k, hint in (removed or {}).items()}
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            if "flag" not in field.metadata:
                raise TypeError(f"{cls.__name__}.{field.name} is not declared with flag()")
            # Checked now, so that a wrong declaration fails at import, not at parse time.
            _argparse_kwargs(field, hints[field.name], None)
        return cls

    return make


def add_group(parser: argparse.ArgumentParser, group) -> argparse.ArgumentParser:
    """Add the argparse group of one flag group; returns the parser."""
    container = parser.add_argument_group(title=group.TITLE)
    hints = typing.get_type_hints(group)

    def added(action, extension=False):
        action.home_module = group.__module__
        action.extension = extension
        return action

    for field in dataclasses.fields(group):
        spec: FlagSpec = field.metadata["flag"]
        kwargs = _argparse_kwargs(field, hints[field.name], _default(field))
        added(container.add_argument(*_options(field.name, spec), **kwargs), spec.extension)
        if spec.negation is not None:
            spelling, help_text = spec.negation
            negation = container.add_argument(
                spelling, action="store_false", dest=field.name, help=_help(help_text)
            )
            added(negation)
        for alias in spec.aliases:
            hidden = container.add_argument(
                alias,
                dest=field.name,
                type=kwargs.get("type"),
                default=argparse.SUPPRESS,
                help=argparse.SUPPRESS,
            )
            added(hidden)
    for spellings, hint in group.REMOVED.items():
        added(container.add_argument(*spellings, action=RemovedFlagAction, hint=hint))
    return parser


def add_groups(parser: argparse.ArgumentParser, groups) -> argparse.ArgumentParser:
    """Add every group's flags to ``parser``, in order; returns it."""
    for group in groups:
        parser = add_group(parser, group)
    return parser


def options_of(field: dataclasses.Field) -> Tuple[str, ...]:
    """The spellings of a field's flag (its negation and hidden aliases aside)."""
    return _options(field.name, field.metadata["flag"])
