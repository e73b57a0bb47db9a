"""docs/FLAGS.md, generated from the flags: every option of the parser, its default, its class
(honoured, no effect here, refused), where it is honoured or why it is not, and the steps of the
rule pass that read it.

    python -m megatron.training.flags.doc    # rewrites docs/FLAGS.md

tests/unit_tests/training/flags/test_flags_package.py fails when the committed document is stale.
The steps that read a flag are found in their source: ``args.<dest>``, ``getattr(args, "<dest>")``
or a string that is exactly a dest, in the step, the private helpers and constants of its module
it uses, and the functions of megatron/core/transformer/config_rules.py it hands ``args`` to.
"""

import ast
import dataclasses
import inspect
import sys
from pathlib import Path
from typing import Dict, List, Set

from megatron.training.flags import GROUPS, POLICY
from megatron.training.flags.policy import HONOURED, NO_EFFECT, REFUSED
from megatron.training.flags.spec import TOGGLE, FromEnv, options_of

DOCUMENT = Path(__file__).resolve().parents[3] / "docs" / "FLAGS.md"
_CLASS = {HONOURED: "honoured", NO_EFFECT: "no effect here", REFUSED: "refused"}


def _module_tree(module) -> ast.Module:
    return ast.parse(inspect.getsource(module))


def _top_level(tree: ast.Module) -> Dict[str, ast.AST]:
    """name -> the module-level def or assignment that binds it."""
    found = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    found[target.id] = node
    return found


def _strings_and_reads(nodes, dests: Set[str]) -> Set[str]:
    found = set()
    for root in nodes:
        for node in ast.walk(root):
            if isinstance(node, ast.Attribute) and node.attr in dests:
                if isinstance(node.value, ast.Name) and node.value.id == "args":
                    found.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                if node.value in dests:
                    found.add(node.value)
    return found


def _reachable(start: ast.AST, names: Dict[str, ast.AST]) -> List[ast.AST]:
    """``start`` and the module-level defs and constants it uses, transitively."""
    seen, todo = [start], [start]
    while todo:
        for node in ast.walk(todo.pop()):
            if isinstance(node, ast.Name) and node.id in names and names[node.id] not in seen:
                seen.append(names[node.id])
                todo.append(names[node.id])
    return seen


def _handed_args(nodes, names: Dict[str, ast.AST]) -> List[str]:
    """Names of the functions these nodes call with ``args`` among the arguments."""
    called = []
    for root in nodes:
        for node in ast.walk(root):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                if any(isinstance(a, ast.Name) and a.id == "args" for a in node.args):
                    called.append(node.func.id)
    return called


def rule_reads() -> Dict[str, List[str]]:
    """dest -> the steps of the rule pass that read it ("module.function"), in pass order."""
    from megatron.core.transformer import config_rules
    from megatron.training.flags.rules import RULES

    dests = set(POLICY)
    core_tree = _module_tree(config_rules)
    core_names = _top_level(core_tree)
    reads: Dict[str, List[str]] = {}
    for step in RULES:
        module = sys.modules[step.__module__]
        names = _top_level(_module_tree(module))
        nodes = _reachable(names[step.__name__], names)
        for called in _handed_args(nodes, names):
            if called in core_names and getattr(module, called, None) is getattr(
                config_rules, called, None
            ):
                nodes += _reachable(core_names[called], core_names)
        label = f"{step.__module__.rsplit('.', 1)[-1]}.{step.__name__}"
        for dest in sorted(_strings_and_reads(nodes, dests)):
            reads.setdefault(dest, []).append(label)
    return reads


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _default(field: dataclasses.Field) -> str:
    if isinstance(field.default_factory, FromEnv):
        return f"`{field.default_factory!r}`"
    value = (
        field.default_factory()
        if field.default_factory is not dataclasses.MISSING
        else field.default
    )
    if hasattr(value, "name") and not isinstance(value, str):  # an enum member
        value = value.name
    return f"`{value!r}`"


def _spellings(field: dataclasses.Field) -> str:
    spec = field.metadata["flag"]
    options = list(options_of(field))
    if spec.kind == TOGGLE:
        options = [f"{o} / --no-{o[2:]}" for o in options]
    if spec.negation is not None:
        options.append(spec.negation[0])
    text = ", ".join(f"`{o}`" for o in options)
    if spec.aliases:
        text += " (also " + ", ".join(f"`{a}`" for a in spec.aliases) + ")"
    return text


def _class_and_where(field: dataclasses.Field):
    rule = POLICY[field.name]
    where = field.metadata["flag"].honoured_at
    if rule.kind == HONOURED:
        return ("honoured, extension" if field.metadata["flag"].extension else "honoured"), where
    if rule.given is None:
        return _CLASS[rule.kind], rule.reason
    text = f"some values: {rule.reason}"
    if where:
        text += f"; the others: {where}"
    return f"{_CLASS[rule.kind]} (some values)", text


def _extensions() -> List[str]:
    return [
        options_of(field)[0]
        for group in GROUPS
        for field in dataclasses.fields(group)
        if field.metadata["flag"].extension
    ]


def render() -> str:
    reads = rule_reads()
    counts = {kind: sum(r.kind == kind for r in POLICY.values()) for kind in _CLASS}
    lines = [
        "# Flags",
        "",
        "Generated by `python -m megatron.training.flags.doc` from megatron/training/flags/ "
        "(do not edit;",
        "tests/unit_tests/training/flags/test_flags_package.py checks that it is current).",
        "",
        f"{len(POLICY)} options: {counts[HONOURED]} honoured, {counts[NO_EFFECT]} with no "
        f"effect here (speed only), {counts[REFUSED]} refused (some of them for some values "
        "only). A refused flag ends the run at start-up with its reason; a no-effect flag is "
        "named in one start-up line; `--help` ends the text of both with their class and "
        "reason. *Honoured at* names the config field or the functions that take the value; "
        "*rules* the steps of the validation pass (megatron/training/flags/rules/, in the "
        "order of `RULES`) that read it. The class *extension* marks a flag of this project "
        "that Megatron-LM does not have: " + ", ".join(f"`{o}`" for o in _extensions()) + ".",
        "",
    ]
    for group in GROUPS:
        module = group.__module__.rsplit(".", 1)[-1]
        lines += [
            f"## {group.TITLE}",
            "",
            f"`{group.__name__}` in megatron/training/flags/{module}.py",
            "",
            "| flag | default | class | honoured at / reason | rules |",
            "|---|---|---|---|---|",
        ]
        for field in dataclasses.fields(group):
            kind, where = _class_and_where(field)
            steps = ", ".join(reads.get(field.name, [])) or "—"
            lines.append(
                f"| {_cell(_spellings(field))} | {_cell(_default(field))} | {kind} "
                f"| {_cell(where)} | {_cell(steps)} |"
            )
        for spellings, hint in group.REMOVED.items():
            flags = ", ".join(f"`{s}`" for s in spellings)
            lines.append(f"| {flags} | | removed: fails at parse time | {_cell(hint)} | — |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    DOCUMENT.parent.mkdir(exist_ok=True)
    DOCUMENT.write_text(render())
    print(f"wrote {DOCUMENT}")
