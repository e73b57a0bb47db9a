"""How much the results of re-runs vary, per validating caller (``--rerun-mode report_stats``):
the samples behind the rerun state machine's one-line report."""

from __future__ import annotations

from typing import List


class QuickStats:
    """Distribution of the relative differences seen by one caller in ``report_stats`` mode."""

    def __init__(self, max_size: int = 100000) -> None:
        self.samples: List[float] = []
        self.pos = 0
        self.zero_cnt = 0
        self.max = 0.0
        self.max_size = max_size

    def record(self, value: float) -> None:
        if value == 0.0:
            self.zero_cnt += 1
            return
        if self.pos < self.max_size:
            self.samples.append(value)
        else:  # keep the last max_size samples
            self.samples[self.pos % self.max_size] = value
        self.pos += 1
        self.max = max(self.max, value)

    def combine(self, others: List["QuickStats"]) -> None:
        """Add the samples of other ranks' stats."""
        if not others:
            return
        if len(self.samples) + sum(len(o.samples) for o in others) <= self.max_size:
            for other in others:
                self.samples.extend(other.samples)
            self.pos = len(self.samples)
        self.zero_cnt += sum(o.zero_cnt for o in others)
        self.max = max([self.max] + [o.max for o in others])

    def reset(self) -> None:
        self.samples, self.pos, self.zero_cnt, self.max = [], 0, 0, 0.0

    def print_stats(self) -> str:
        """Megatron's one-line summary."""
        self.samples.sort()
        zeros, n = self.zero_cnt, len(self.samples)
        if n == 0:
            return f"{zeros:,} samples, all identical"
        total = zeros + n
        average = sum(self.samples) / total
        percentiles = {}
        for p in (0.5, 0.9, 0.99, 0.999):
            # Identical samples (zeros) sort first and are not stored.
            index = int(total * p) - zeros
            percentiles[p] = f"{self.samples[index]:.3E}" if index >= 0 else "0.0"
        return (
            f"{total:,}/{zeros:,} total/identical samples, rel. variability: avg= {average:.3E}, "
            f"p50= {percentiles[0.5]}, p90= {percentiles[0.9]}, p99= {percentiles[0.99]}, "
            f"p99.9= {percentiles[0.999]}, max: {self.max:.3E}"
        )
