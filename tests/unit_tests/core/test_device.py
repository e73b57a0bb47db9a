"""megatron.core.device: which device computes and which device a group's collectives take.

The CUDA answers are checked with torch's CUDA state and the group's backend configuration
stubbed (this machine has no GPU); a real gloo world is checked by test_implicit_devices.py.
"""

import pytest
import torch
import torch.distributed as dist

from megatron.core import device as D


def _stub(monkeypatch, *, cuda: bool, backend_config=None, current=3):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    if backend_config is not None:
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_backend_config", lambda group=None: backend_config)


def test_compute_device_is_the_current_cuda_device_once_cuda_is_initialised(monkeypatch):
    assert D.compute_device() == torch.device("cpu") and not D.computes_on_cuda()
    _stub(monkeypatch, cuda=True)
    assert D.compute_device() == torch.device("cuda", 3) and D.computes_on_cuda()


@pytest.mark.parametrize(
    "config, cuda, expected",
    [
        ("cuda:nccl", True, "cuda:3"),
        # An NCCL-only group takes CUDA tensors even from a process that computes on the CPU.
        ("cuda:nccl", False, "cuda:3"),
        ("cpu:gloo,cuda:nccl", True, "cuda:3"),
        ("cpu:gloo,cuda:nccl", False, "cpu"),
        # gloo (as the asynchronous save's group) stays on the host on a GPU too.
        ("cpu:gloo,cuda:gloo", True, "cpu"),
        ("cpu:gloo,cuda:gloo", False, "cpu"),
    ],
)
def test_collective_device_follows_the_groups_backend(monkeypatch, config, cuda, expected):
    _stub(monkeypatch, cuda=cuda, backend_config=config)
    assert D.collective_device() == torch.device(expected)


def test_backends_are_read_per_device_type(monkeypatch):
    _stub(monkeypatch, cuda=False, backend_config="cpu:gloo,cuda:nccl")
    assert D.backends_by_device_type() == {"cpu": "gloo", "cuda": "nccl"}


def test_without_torch_distributed_collectives_take_the_compute_device(monkeypatch):
    assert not dist.is_initialized()
    assert D.collective_device() == torch.device("cpu")
    _stub(monkeypatch, cuda=True)
    assert D.collective_device() == torch.device("cuda", 3)


def test_synchronize_waits_for_cuda_only_when_computing_there(monkeypatch):
    waits = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: waits.append(a))
    D.synchronize()
    assert waits == []
    _stub(monkeypatch, cuda=True)
    D.synchronize()
    assert waits == [()]


class _Event:
    """torch.cuda.Event's timing interface on a fake GPU clock (milliseconds)."""

    clock = 0.0
    synchronized = []

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.at = None

    def record(self):
        self.at = _Event.clock

    def synchronize(self):
        _Event.synchronized.append(self)

    def elapsed_time(self, end):
        return end.at - self.at


def test_straggler_times_cuda_work_with_events_not_host_clocks(monkeypatch):
    from megatron.training.straggler import StragglerDetector

    _stub(monkeypatch, cuda=True)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    _Event.synchronized = []

    def forward_step(ms):  # queues `ms` of GPU work and returns at once, as on CUDA
        _Event.clock += ms
        return ms

    detector = StragglerDetector()
    timed = detector.timed(forward_step)
    assert [timed(250.0), timed(150.0)] == [250.0, 150.0]
    assert _Event.synchronized == []  # no wait per micro-batch
    assert detector.gather(iterations=2) == [pytest.approx(0.2)]  # 400 ms over 2 iterations
    assert len(_Event.synchronized) == 1  # one wait, for the last event, when read
    assert detector.gather(iterations=1) == [0.0]  # reset


def test_straggler_times_cpu_work_with_the_host_clock():
    import time

    from megatron.training.straggler import StragglerDetector

    detector = StragglerDetector()
    detector.timed(time.sleep)(0.05)
    assert detector.gather(iterations=1)[0] >= 0.05
