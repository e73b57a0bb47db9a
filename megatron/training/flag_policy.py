"""What this code base does with each of Megatron's flags, and the start-up checks that say so.

Every flag of the parser is in exactly one class (the refused and no-effect rows are
megatron/training/flags/policy.py; every other flag is honoured where its field says):

* HONOURED: it does here what it does in Megatron;
* NO_EFFECT ("no effect here, speed only"): it only selects a faster kernel or communication path
  of a stack this code base does not have (Transformer Engine / apex fusions, CUDA graphs,
  userbuffer tensor-parallel overlap, SHARP, NCCL user buffers, DeepEP, ...). The run computes
  the same result without it, so it is accepted; one start-up line lists the given ones and why;
* REFUSED: it changes numerics, data or files and is not built here; start-up ends with one
  line naming it and why.

A flag counts as *given* when its value differs from the parser's default, unless its rule says
otherwise (a value-dependent rule refuses some values of a flag and honours the others, e.g.
``--optimizer``). The check runs on the values the user gave, before validation derives others.
Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import functools
from typing import Dict, List, Optional, Tuple

from megatron.training.flags import POLICY, add_megatron_flags
from megatron.training.flags.policy import HONOURED, NO_EFFECT, REFUSED, Rule


def flag_of(action: argparse.Action) -> str:
    """The spelling the messages use: the first long option."""
    return next((s for s in action.option_strings if s.startswith("--")), action.option_strings[0])


@functools.lru_cache(maxsize=1)
def megatron_actions() -> Dict[str, argparse.Action]:
    """dest -> the action of Megatron's parser (built once; no env-dependent use here)."""
    parser = add_megatron_flags(argparse.ArgumentParser(allow_abbrev=False))
    actions: Dict[str, argparse.Action] = {}
    for action in parser._actions:
        if action.option_strings and action.help != argparse.SUPPRESS and action.dest != "help":
            # Two flags may share a dest (--x / --no-x); the first one's default is the dest's.
            actions.setdefault(action.dest, action)
    return actions


def _shown(flag: str, value) -> str:
    if value is None or isinstance(value, bool):
        return flag
    if isinstance(value, (list, tuple)):
        return f"{flag} {' '.join(str(v) for v in value)}"
    return f"{flag} {getattr(value, 'name', value)}"


def is_given(rule: Rule, value, default, args) -> bool:
    if rule.given is not None:
        return bool(rule.given(value, args))
    return value != default


def given_flags(args: argparse.Namespace, kind: str) -> List[Tuple[str, str, str]]:
    """[(dest, the flag as given, reason)] for the flags of `kind` that `args` gives."""
    found = []
    actions = megatron_actions()
    for dest, rule in POLICY.items():
        if rule.kind != kind or not hasattr(args, dest) or dest not in actions:
            continue
        action, value = actions[dest], getattr(args, dest)
        if is_given(rule, value, action.default, args):
            found.append((dest, _shown(flag_of(action), value), rule.reason))
    return found


def refusal(args: argparse.Namespace) -> Optional[str]:
    """The one-line refusal of the REFUSED flags `args` gives, or None."""
    refused = given_flags(args, REFUSED)
    if not refused:
        return None
    return "not supported yet: " + "; ".join(f"{flag} ({why})" for _, flag, why in refused)


def no_effect_note(args: argparse.Namespace) -> Optional[str]:
    """The one start-up line naming the NO_EFFECT flags `args` gives (grouped by reason), or
    None."""
    by_reason: Dict[str, List[str]] = {}
    for _, flag, why in given_flags(args, NO_EFFECT):
        by_reason.setdefault(why, []).append(flag)
    if not by_reason:
        return None
    parts = [f"{', '.join(flags)} ({why})" for why, flags in by_reason.items()]
    return "no effect here (speed only): " + "; ".join(parts)


def annotate_help(parser: argparse.ArgumentParser) -> None:
    """Append the class of each refused or no-effect flag to its --help text."""
    for action in parser._actions:
        rule = POLICY.get(action.dest)
        if rule is None or rule.kind == HONOURED or action.help == argparse.SUPPRESS:
            continue
        label = "not supported yet" if rule.kind == REFUSED else "no effect here, speed only"
        if rule.given is not None:
            label += " (some values)"
        # argparse formats help strings with %: escape the reason's percent signs.
        action.help = f"{action.help or ''} [{label}: {rule.reason.replace('%', '%%')}]"
