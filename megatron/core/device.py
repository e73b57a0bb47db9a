"""Which device computes, and which device a process group's collectives take.

The one answer to "where should this tensor live" for library code:

* :func:`compute_device` for tensors that take part in the model's arithmetic: the current CUDA
  device once this process has initialised CUDA (training does, by ``torch.cuda.set_device``),
  else the CPU. A process that never touched CUDA computes on the CPU even where a GPU exists.
* :func:`collective_device` for tensors handed to a collective of a group: a group's backend
  reduces tensors of one device type (NCCL: CUDA only; gloo: the host, and the house keeps it
  there even though it can stage CUDA tensors). A group can hold several backends
  (``cpu:gloo,cuda:nccl``), and gloo groups live beside NCCL ones (the asynchronous save's group).

Tensors that stay on the host on purpose (dataset indices, checkpoint staging, CPU initialisation)
name ``device="cpu"`` with a ``# host: <reason>`` comment; tests/unit_tests/test_tensor_devices.py
checks both rules from the source.

Everything here is a function of torch's own state: nothing is cached.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.distributed as dist

_CPU = torch.device("cpu")


def compute_device() -> torch.device:
    """The device this process computes on: its current CUDA device, or the CPU."""
    # is_initialized() implies a usable CUDA and is False in a forked data-loader worker.
    if torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return _CPU


def computes_on_cuda() -> bool:
    """Whether :func:`compute_device` is a CUDA device (CUDA RNG states, memory statistics)."""
    return compute_device().type == "cuda"


def backends_by_device_type(group: Optional[dist.ProcessGroup] = None) -> Dict[str, str]:
    """``{device type: backend name}`` of ``group`` (None: the default group), for example
    ``{"cpu": "gloo", "cuda": "nccl"}``. A single backend is listed for every device type torch
    lets it take (gloo: ``cpu`` and ``cuda``)."""
    config = dist.get_backend_config(group)
    pairs = (entry.split(":", 1) for entry in config.split(",") if ":" in entry)
    return {device_type.strip(): backend.strip() for device_type, backend in pairs}


def collective_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """The device of the tensors that ``group``'s collectives take (None: the default group).

    The current CUDA device when the group reduces CUDA tensors with NCCL and either this process
    computes on CUDA or the group has no host backend; the CPU otherwise (gloo). Without
    torch.distributed no collective runs and the answer is :func:`compute_device`.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return compute_device()
    backends = backends_by_device_type(group)
    if backends.get("cuda") == "nccl" and (computes_on_cuda() or "cpu" not in backends):
        return torch.device("cuda", torch.cuda.current_device())
    return _CPU


def synchronize() -> None:
    """Wait for the work queued on the compute device (kernels run asynchronously on CUDA); a
    no-op on the CPU, so CPU runs never initialise CUDA."""
    if computes_on_cuda():
        torch.cuda.synchronize()
