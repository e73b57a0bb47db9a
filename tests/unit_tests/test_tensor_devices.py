"""Every tensor the library makes names its device, read from the source.

A tensor factory without ``device=`` lands on torch's default device, the CPU, while a GPU run
computes on CUDA: the first run on a GPU failed at iteration 1 that way (schedules.py's token
counters, the rerun machine's flags). The rules, for megatron/ and the pretrain_*.py entry points:

* a call of a torch tensor factory (``torch.zeros``, ``torch.tensor``, ``torch.Generator``, ...)
  passes ``device=``; the ``*_like`` and ``Tensor.new_*`` variants inherit a device and are fine;
* a call that names the host literally (``device="cpu"``) says why on one of its lines with a
  ``# host: <reason>`` comment (dataset samples, checkpoint staging, CPU initialisation, ...), as
  does ``torch.from_numpy`` (always a host tensor);
* the factories are not imported by name (``from torch import zeros`` would hide them).

The ones made on a device chosen at run time are then checked by running the training step with
the implicit device pointing elsewhere (test_implicit_devices.py).
"""

import ast
import re
from pathlib import Path

from tests.harness import REPO

FACTORIES = frozenset(
    {
        "arange",
        "as_tensor",
        "asarray",
        "empty",
        "empty_strided",
        "eye",
        "full",
        "Generator",
        "linspace",
        "logspace",
        "ones",
        "rand",
        "randint",
        "randn",
        "randperm",
        "range",
        "scalar_tensor",
        "sparse_coo_tensor",
        "tensor",
        "tril_indices",
        "triu_indices",
        "zeros",
    }
)
# Host tensors by construction: no device to name, so they always say why.
HOST_ONLY = frozenset({"from_numpy", "frombuffer"})
HOST_MARKER = re.compile(r"#\s*host:\s*\S")


def _sources(root: Path = REPO):
    yield from sorted((root / "megatron").rglob("*.py"))
    yield from sorted(root.glob("pretrain_*.py"))


def _torch_aliases(tree) -> set:
    """Names the module binds to the torch package (``import torch``, ``import torch as th``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.asname or a.name for a in node.names if a.name == "torch")
    return names


def _names_the_host(value) -> bool:
    """``"cpu"`` / ``"cpu:0"`` or ``torch.device("cpu")``."""
    if isinstance(value, ast.Constant) and isinstance(value.value, str):
        return value.value.split(":")[0] == "cpu"
    if isinstance(value, ast.Call) and getattr(value.func, "attr", None) == "device":
        return bool(value.args) and _names_the_host(value.args[0])
    return False


def offenders_in(path: Path, root: Path = REPO) -> list:
    """``file:line: message`` for each call in ``path`` that breaks the rules."""
    source = path.read_text()
    lines = source.splitlines()
    tree = ast.parse(source, str(path))
    torch_names = _torch_aliases(tree)
    where = path.relative_to(root)
    found = []

    def marked(node) -> bool:
        span = lines[node.lineno - 1 : node.end_lineno]
        return any(HOST_MARKER.search(line) for line in span)

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "torch":
            for alias in node.names:
                if alias.name in FACTORIES | HOST_ONLY:
                    found.append(f"{where}:{node.lineno}: imports torch.{alias.name} by name")
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        owner, name = node.func.value, node.func.attr
        if not (isinstance(owner, ast.Name) and owner.id in torch_names):
            continue
        if name in HOST_ONLY:
            if not marked(node):
                found.append(f"{where}:{node.lineno}: torch.{name} without a reason")
            continue
        if name not in FACTORIES:
            continue
        device = next((k.value for k in node.keywords if k.arg == "device"), None)
        if device is None or (isinstance(device, ast.Constant) and device.value is None):
            found.append(f"{where}:{node.lineno}: torch.{name}(...) without device=")
        elif _names_the_host(device) and not marked(node):
            found.append(f"{where}:{node.lineno}: torch.{name}(..., device='cpu') without a reason")
    return sorted(found, key=lambda line: int(line.split(":")[1]))


HOW_TO_FIX = (
    "name the device: megatron.core.device.compute_device() for arithmetic, "
    "collective_device(group) for a collective's tensors, or an existing tensor's .device; a "
    "tensor that stays on the host says why with '# host: <reason>' on the call"
)


def test_every_tensor_factory_in_the_library_names_its_device():
    offenders = [line for path in _sources() for line in offenders_in(path)]
    assert not offenders, f"{HOW_TO_FIX}:\n" + "\n".join(offenders)


def test_the_check_finds_each_kind_of_offence(tmp_path):
    package = tmp_path / "megatron"
    package.mkdir()
    sample = package / "sample.py"
    sample.write_text(
        "import numpy as np\n"
        "import torch\n"
        "import torch as th\n"
        "from torch import zeros\n"
        "a = torch.tensor(0, dtype=torch.int)\n"
        "b = th.zeros(3)\n"
        "c = torch.ones(2, device=None)\n"
        "d = torch.empty(2, device='cpu')\n"
        "e = torch.arange(\n"
        "    4, device=torch.device('cpu')  # host: an index built on the host\n"
        ")\n"
        "f = torch.from_numpy(np.zeros(2))\n"
        "g = torch.from_numpy(np.zeros(2))  # host: a numpy array's view\n"
        "h = torch.zeros(3, device=x.device) + np.zeros(3).sum()\n"
        "i = torch.Generator()\n"
        "j = torch.zeros_like(h)\n"
    )
    got = offenders_in(sample, tmp_path)
    assert [line.split(":")[1] for line in got] == ["4", "5", "6", "7", "8", "12", "15"], got
    assert got[1].startswith("megatron/sample.py:5: torch.tensor(...) without device=")
    assert "device='cpu') without a reason" in got[4]
