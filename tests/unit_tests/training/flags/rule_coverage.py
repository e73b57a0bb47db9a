"""Which rules of the validate_args rule modules (megatron/training/flags/rules/)
the tests break: the tests of each module assert that every check(...)/fail(...) call in it
is reached by one of their cases, so a new rule arrives with its test."""

import ast
from pathlib import Path

import pytest

from megatron.training.flag_errors import ArgumentValidationError

_HELPERS = ("check", "fail")


def rule_sites(modules):
    """(file, line) of every check(...)/fail(...) call in the modules, outside the helpers that
    define them."""
    sites = set()
    for module in modules:
        tree = ast.parse(Path(module.__file__).read_text())
        for function in tree.body:
            if isinstance(function, ast.FunctionDef) and function.name in _HELPERS:
                continue
            for node in ast.walk(function):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Name)
                    and node.func.id in _HELPERS
                ):
                    sites.add((module.__file__, node.lineno))
    return sites


def _rule_site(error, files):
    """The innermost frame of the error's traceback that is in one of the files and is not
    check() or fail() itself: the rule that raised it (None when none of the files did)."""
    site = None
    traceback = error.__traceback__
    while traceback is not None:
        code = traceback.tb_frame.f_code
        if code.co_filename in files and code.co_name not in _HELPERS:
            site = (code.co_filename, traceback.tb_lineno)
        traceback = traceback.tb_next
    return site


def fired_rule_sites(runs, modules):
    """Calls each of `runs` (each must raise ArgumentValidationError) and returns the rule
    sites in the modules that raised."""
    files = {module.__file__ for module in modules}
    fired = set()
    for run in runs:
        with pytest.raises(ArgumentValidationError, match=r"\S") as raised:
            run()
        fired.add(_rule_site(raised.value, files))
    fired.discard(None)
    return fired
