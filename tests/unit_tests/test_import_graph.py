"""The package's imports: no cycles, megatron.core never reaches megatron.training, neither does
the checkpoint format layer (megatron.checkpointing, shared by the trainer and the offline
converters), and the model-building layers of core import only downwards (tensor_parallel <
transformer < models). No entry script (pretrain_*.py) is imported by another one, by the package
or by a tool: what they share lives in megatron/training/model_families/.

Imports are read from the source (every ``import`` statement, also those inside functions: a
lazy import that closes a cycle is still a cycle), so the checks do not depend on import order.
"""

import ast
import subprocess
import sys
from pathlib import Path

from tests.harness import REPO

# A module of the key may not import any module under the listed packages.
NOT_BELOW = {
    "megatron.core": ("megatron.training",),
    "megatron.checkpointing": ("megatron.training",),
    "megatron.core.tensor_parallel": ("megatron.core.transformer", "megatron.core.models"),
    "megatron.core.transformer": ("megatron.core.models",),
    # The schedules reach the model through its methods (set_input_tensor,
    # set_moe_aux_loss_scale) and the trainer through the StepContext, never its modules.
    "megatron.core.pipeline_parallel": ("megatron.core.transformer", "megatron.core.models"),
}


def _modules(root: Path):
    """{dotted name: (path, is_package)} of every module under megatron/."""
    found = {}
    for path in sorted((root / "megatron").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        found[name] = (path, is_package)
    return found


def _imported(name: str, is_package: bool, node, modules) -> set:
    """The megatron modules one import statement of module ``name`` loads explicitly.

    ``from pkg import sub`` names the submodule ``pkg.sub`` (not pkg's ``__init__``, which Python
    runs for any submodule anyway); ``from pkg import obj`` names ``pkg`` itself.
    """
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in modules}
    if node.level:
        base = name.split(".") if is_package else name.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module
    targets = {f"{source}.{a.name}" for a in node.names if f"{source}.{a.name}" in modules}
    if len(targets) < len(node.names) and source in modules:
        targets.add(source)
    return targets


def import_graph(root: Path = REPO) -> dict:
    modules = _modules(root)
    graph = {}
    for name, (path, is_package) in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges |= _imported(name, is_package, node, modules)
        edges.discard(name)
        graph[name] = edges
    return graph


def find_cycle(graph: dict):
    """One import cycle as a list of modules (first == last), or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def _inside(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 100 and "megatron.training.training" in graph  # the walk saw the tree
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_core_layers_import_only_downwards():
    upward = sorted(
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        for target in targets
        for package, forbidden in NOT_BELOW.items()
        if _inside(module, package) and any(_inside(target, f) for f in forbidden)
    )
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_cycle_and_layer_checks_catch_what_they_should(tmp_path):
    """The checks fire on a planted cycle and a planted upward import."""
    for rel, text in {
        "megatron/__init__.py": "",
        "megatron/core/__init__.py": "",
        "megatron/core/a.py": "def f():\n    from megatron.core import b\n",
        "megatron/core/b.py": "from megatron.core.a import f\nimport megatron.training.x\n",
        "megatron/training/__init__.py": "",
        "megatron/training/x.py": "",
    }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    graph = import_graph(tmp_path)
    assert find_cycle(graph) == ["megatron.core.a", "megatron.core.b", "megatron.core.a"]
    assert "megatron.training.x" in graph["megatron.core.b"]


def test_importing_all_of_megatron_core_loads_no_training_module():
    code = (
        "import importlib, pkgutil, sys\n"
        "import megatron.core\n"
        "for info in pkgutil.walk_packages(megatron.core.__path__, 'megatron.core.'):\n"
        "    importlib.import_module(info.name)\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('megatron.core'))\n"
        "training = sorted(m for m in sys.modules if m.startswith('megatron.training'))\n"
        "print(len(loaded), training)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    count, training = result.stdout.split(" ", 1)
    assert int(count) > 80, result.stdout  # every core module was imported
    assert training.strip() == "[]", f"megatron.core loaded {training.strip()}"


def entry_script_imports(root: Path = REPO) -> list:
    """``file: module`` for each import of an entry script (a ``pretrain_*`` module, also through
    ``importlib.import_module("pretrain_...")``) in the entry scripts, megatron/ and tools/."""
    files = sorted(root.glob("pretrain_*.py")) + sorted((root / "megatron").rglob("*.py"))
    files += sorted((root / "tools").rglob("*.py"))
    found = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            elif (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                names = [str(node.args[0].value)]
            for name in names:
                if name.split(".")[0].startswith("pretrain_"):
                    found.append(f"{path.relative_to(root).as_posix()}: {name}")
    return found


def test_no_entry_script_is_imported_by_another_script_the_package_or_a_tool():
    assert len(list(REPO.glob("pretrain_*.py"))) >= 3  # the walk saw the scripts
    found = entry_script_imports()
    assert not found, "entry scripts imported:\n" + "\n".join(found)


def test_the_entry_script_check_catches_an_import(tmp_path):
    """The check fires on each way of importing a script."""
    for rel, text in {
        "pretrain_a.py": "import os\n",
        "pretrain_b.py": "from pretrain_a import loss_func\n",
        "megatron/x.py": "def f():\n    import pretrain_a\n",
        "tools/y.py": "import importlib\nimportlib.import_module('pretrain_b')\n",
    }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert entry_script_imports(tmp_path) == [
        "pretrain_b.py: pretrain_a",
        "megatron/x.py: pretrain_a",
        "tools/y.py: pretrain_b",
    ]
