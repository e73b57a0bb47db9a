"""megatron.training.cpu_allocator: when it calls mallopt, with what, and that it stops the
per-step page faults of large tensors (measured in a child process, so this test process keeps
glibc's default settings)."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from megatron.training import cpu_allocator
from tests.harness import REPO

ROOT = str(REPO)


@pytest.fixture
def calls(monkeypatch):
    """Replace glibc's mallopt with a recorder that accepts every value."""
    recorded = []
    monkeypatch.setattr(
        cpu_allocator, "_libc_mallopt", lambda: lambda p, v: recorded.append((p, v)) or 1
    )
    monkeypatch.delenv(cpu_allocator.ENV_VAR, raising=False)
    return recorded


def test_sets_both_thresholds_on_cpu(calls):
    assert cpu_allocator.configure_cpu_allocator(torch.device("cpu")) is True
    assert calls == [(-3, 1 << 30), (-1, (1 << 31) - 1)]  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
    assert all(v < 2**31 for _, v in calls)  # mallopt takes a C int
    calls.clear()
    assert cpu_allocator.configure_cpu_allocator("cpu") is True and len(calls) == 2


@pytest.mark.parametrize("value", ["0", "false", "off", " No "])
def test_environment_variable_opts_out(calls, monkeypatch, value):
    monkeypatch.setenv("MEGATRON_CPU_MALLOPT", value)
    assert cpu_allocator.configure_cpu_allocator("cpu") is False
    assert calls == []


def test_gpu_device_and_missing_glibc_are_skipped(calls, monkeypatch):
    assert cpu_allocator.configure_cpu_allocator(torch.device("cuda", 0)) is False
    assert cpu_allocator.configure_cpu_allocator("meta") is False
    assert calls == []
    monkeypatch.setattr(cpu_allocator, "_libc_mallopt", lambda: None)
    assert cpu_allocator.configure_cpu_allocator("cpu") is False


def test_refused_value_reports_false(monkeypatch):
    monkeypatch.delenv(cpu_allocator.ENV_VAR, raising=False)
    monkeypatch.setattr(cpu_allocator, "_libc_mallopt", lambda: lambda p, v: 0)
    assert cpu_allocator.configure_cpu_allocator("cpu") is False


_CHILD = textwrap.dedent("""
    import resource, sys, torch
    sys.path.insert(0, sys.argv[1])
    from megatron.training.cpu_allocator import configure_cpu_allocator
    applied = configure_cpu_allocator("cpu")

    def step():  # a 64 MiB activation and a 16 MiB one, filled and freed
        a = torch.empty(16 << 20).fill_(1.0)
        b = torch.empty(4 << 20).fill_(2.0)
        del a, b

    for _ in range(8):  # warm-up: glibc's heap grows for the first few aligned blocks, then stays
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        step()
    print(int(applied), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def _faults(env_value):
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_CPU_MALLOPT"}
    if env_value is not None:
        env["MEGATRON_CPU_MALLOPT"] = env_value
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, ROOT],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.split()
    return int(out[0]), int(out[1])


@pytest.mark.skipif(cpu_allocator._libc_mallopt() is None, reason="needs glibc")
def test_large_tensors_stop_page_faulting():
    applied, faults = _faults(None)
    default_applied, default_faults = _faults("0")
    assert (applied, default_applied) == (1, 0)
    # Default: the 64 MiB block is a fresh mmap() every step, 5 x 16,384 faults of 4 KiB pages
    # (glibc's dynamic threshold soon keeps the 16 MiB one); with the setting: almost none.
    assert default_faults > 50_000, default_faults
    assert faults < default_faults / 20, (faults, default_faults)
