"""The rules the test suite keeps so that a newcomer can trust it, checked on its source:

- every ``pytest.raises`` names the error it expects (``match=``), or binds it (``as err``) and
  reads its message (``str(err.value)``), so that a different error cannot pass;
- every subprocess is bounded in time (``timeout=``);
- no test skips itself over a missing dependency: setup.py's dev extra installs them all;
- no test picks a free port by binding and closing a socket (another test can take it before
  use): spawned worlds use a file store (dist_utils.run_distributed), torchrun ``--standalone``.
"""

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
SOURCES = sorted(p for p in TESTS.rglob("*.py") if p.name != Path(__file__).name)


def _calls(tree, owner, names):
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == owner
            and node.func.attr in names
        ):
            yield node


def _enclosing_functions(tree):
    """{id(node): the innermost function (or module) source node containing it}."""
    owner = {}

    def visit(node, function):
        for child in ast.iter_child_nodes(node):
            inner = (
                child if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            )
            owner[id(child)] = inner
            visit(child, inner)

    visit(tree, tree)
    return owner


def _raises_without_match(path):
    source = path.read_text()
    tree = ast.parse(source)
    owner = _enclosing_functions(tree)
    bound = {}  # id(call) -> the name it is bound to by `with ... as name`
    for node in ast.walk(tree):
        if isinstance(node, ast.With):
            for item in node.items:
                if isinstance(item.optional_vars, ast.Name):
                    bound[id(item.context_expr)] = item.optional_vars.id
    for call in _calls(tree, "pytest", {"raises"}):
        if any(k.arg == "match" for k in call.keywords):
            continue
        name = bound.get(id(call))
        body = ast.get_source_segment(source, owner[id(call)]) or source
        if name is None or f"str({name}.value)" not in body:
            yield f"{path.relative_to(TESTS)}:{call.lineno}"


def _unbounded_subprocesses(path):
    source = path.read_text()
    tree = ast.parse(source)
    owner = _enclosing_functions(tree)
    for call in _calls(tree, "subprocess", {"run", "call", "check_call", "check_output", "Popen"}):
        if any(k.arg == "timeout" for k in call.keywords):
            continue
        # Popen has no timeout of its own: its function must bound the wait (communicate or a
        # watchdog).
        body = ast.get_source_segment(source, owner[id(call)]) or ""
        if call.func.attr == "Popen" and "timeout=" in body:
            continue
        yield f"{path.relative_to(TESTS)}:{call.lineno}"


@pytest.mark.parametrize(
    "rule, finder",
    [("pytest.raises without match=", _raises_without_match)]
    + [("a subprocess without a timeout", _unbounded_subprocesses)],
    ids=["raises_match", "subprocess_timeout"],
)
def test_rule_holds(rule, finder):
    offenders = [where for path in SOURCES for where in finder(path)]
    assert len(SOURCES) > 50  # the suite was found
    assert not offenders, f"{rule}: {offenders}"


def test_no_skip_for_a_missing_dependency_and_no_port_picking():
    offenders = []
    for path in SOURCES:
        tree = ast.parse(path.read_text())
        for call in _calls(tree, "pytest", {"importorskip"}):
            offenders.append(f"{path.relative_to(TESTS)}:{call.lineno}: importorskip")
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "bind"
            ):
                offenders.append(f"{path.relative_to(TESTS)}:{node.lineno}: socket bind")
    assert not offenders, offenders
