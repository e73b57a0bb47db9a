"""Straggler detection (``--log-straggler``): each rank times its own forward steps (compute,
not the waits in collectives, which a slow peer would spread to every rank); every
``--log-interval`` the times are gathered from all ranks and rank 0 names the slowest and the
fastest, in Megatron's report format (``MnRtt/Rnk``: the least step time and its rank,
``MxRtt/Rnk`` the most, ``MnEtpt/Rnk`` / ``MxEtpt/Rnk`` the least and most TFLOP/s per rank);
with ``--straggler-minmax-count`` N > 1 also the N ranks of lowest and highest throughput.

On CPU there is no device power, temperature, utilisation or clock to report, so the line
carries the timing and throughput columns only. On CUDA the forward steps are timed with CUDA
events (the host returns before the kernels have run).
"""

from __future__ import annotations

import time
from typing import List, Tuple

import torch
import torch.distributed as dist

from megatron.core.device import collective_device, computes_on_cuda


class _ForwardTimes:
    """Seconds spent in the timed calls since the last :meth:`take`.

    On CUDA the calls only queue kernels, so host clocks would time the launches: each call is
    bracketed by CUDA events on the current stream instead, and their times are read when taken
    (one wait for the last event then, none per call). On the CPU the work is done on return.
    """

    def __init__(self):
        self._seconds = 0.0
        self._events: List[Tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def time(self, call, *args, **kwargs):
        if computes_on_cuda():
            start, stop = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            try:
                return call(*args, **kwargs)
            finally:
                stop.record()
                self._events.append((start, stop))
        started = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            self._seconds += time.perf_counter() - started

    def take(self) -> float:
        seconds, self._seconds = self._seconds, 0.0
        if self._events:
            self._events[-1][1].synchronize()
            seconds += sum(start.elapsed_time(stop) for start, stop in self._events) / 1e3
            self._events = []
        return seconds


class StragglerDetector:
    """Per-rank forward time between two reports (every call of :meth:`report` is collective)."""

    def __init__(self, minmax_count: int = 1):
        if minmax_count < 1:
            raise ValueError(f"--straggler-minmax-count must be >= 1, got {minmax_count}")
        self.minmax_count = minmax_count
        self._times = _ForwardTimes()

    def timed(self, forward_step_func):
        """``forward_step_func`` that adds the time of each call to this rank's total."""

        def forward_step(*args, **kwargs):
            return self._times.time(forward_step_func, *args, **kwargs)

        return forward_step

    def gather(self, iterations: int) -> List[float]:
        """Every rank's forward time per iteration (seconds) since the last report; resets."""
        mean = self._times.take() / max(iterations, 1)
        if not dist.is_initialized():
            return [mean]
        local = torch.tensor([mean], dtype=torch.float64, device=collective_device())
        gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, local)
        return torch.cat(gathered).tolist()

    def report(self, flops_per_step: float, iterations: int) -> str:
        """Collective; the report line on rank 0, '' elsewhere. ``flops_per_step``: the FLOPs of
        one training step of the whole model (all ranks); ``iterations`` since the last report."""
        times = self.gather(iterations)
        if dist.is_initialized() and dist.get_rank() != 0:
            return ""
        world = len(times)
        tflops = [flops_per_step / world / max(t, 1e-12) / 1e12 for t in times]
        by_time = sorted(range(world), key=lambda r: times[r])
        by_tflops = sorted(range(world), key=lambda r: tflops[r])
        line = (
            f" | MnRtt/Rnk: {times[by_time[0]] * 1e3:.2f}ms/{by_time[0]}"
            f" | MxRtt/Rnk: {times[by_time[-1]] * 1e3:.2f}ms/{by_time[-1]}"
            f" | MnEtpt/Rnk: {tflops[by_tflops[0]]:.2f}TF/{by_tflops[0]}"
            f" | MxEtpt/Rnk: {tflops[by_tflops[-1]]:.2f}TF/{by_tflops[-1]}"
        )
        if self.minmax_count > 1:
            k = min(self.minmax_count, world)
            line += "\n" + _ranks(
                f"^^^^ Bottom {k} Ranks with lowest  Etpt(TF):", by_tflops[:k], tflops
            )
            top = list(reversed(by_tflops[-k:]))
            line += "\n" + _ranks(f"^^^^ Top    {k} Ranks with highest Etpt(TF):", top, tflops)
        return line


def _ranks(title: str, ranks: List[int], tflops: List[float]) -> str:
    pairs: List[Tuple[float, int]] = [(tflops[r], r) for r in ranks]
    return title + "".join(f" {value:.2f}/{rank}," for value, rank in pairs).rstrip(",")
