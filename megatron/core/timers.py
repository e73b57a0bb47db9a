"""Named wall-clock timers with log levels, reported across ranks (Megatron's timers).

Times are measured in seconds by each timer and reported in milliseconds by Timers.log /
Timers.write. A timer whose level is above the configured level is a no-op DummyTimer, so the
calls can stay in the code at no cost.
"""

from __future__ import annotations

import time
from typing import Dict, Iterable, List, Optional

import torch
import torch.distributed as dist

from megatron.core.device import collective_device, synchronize

_LOG_OPTIONS = ("max", "minmax", "all")
_MAX_LOG_LEVEL = 2


def _dist_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


class TimerBase:
    def __init__(self, name: str):
        self.name = name

    def start(self, barrier: bool = False) -> None:
        raise NotImplementedError

    def stop(self, barrier: bool = False) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        raise NotImplementedError

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        raise NotImplementedError


class DummyTimer(TimerBase):
    """Stands in for timers above the configured log level: does nothing, reports 0."""

    def __init__(self, name: str = "dummy timer"):
        super().__init__(name)

    def start(self, barrier: bool = False) -> None:
        pass

    def stop(self, barrier: bool = False) -> None:
        pass

    def reset(self) -> None:
        pass

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        return 0.0

    def active_time(self) -> float:
        return 0.0


class Timer(TimerBase):
    """Accumulates the time between start() and stop() calls until reset."""

    def __init__(self, name: str):
        super().__init__(name)
        self._elapsed = 0.0
        self._active_time = 0.0
        self._started = False
        self._start_time = 0.0
        self._barrier_group = None

    def set_barrier_group(self, barrier_group) -> None:
        self._barrier_group = barrier_group

    def _barrier(self, barrier: bool) -> None:
        if barrier and _dist_ready():
            dist.barrier(group=self._barrier_group)

    def start(self, barrier: bool = False) -> None:
        if self._started:
            raise RuntimeError(f"timer '{self.name}' has already been started")
        self._barrier(barrier)
        synchronize()  # kernels run asynchronously: time the work, not its launch
        self._start_time = time.perf_counter()
        self._started = True

    def stop(self, barrier: bool = False) -> None:
        if not self._started:
            raise RuntimeError(f"timer '{self.name}' is not started")
        self._barrier(barrier)
        synchronize()  # kernels run asynchronously: time the work, not its launch
        interval = time.perf_counter() - self._start_time
        self._elapsed += interval
        self._active_time += interval
        self._started = False

    def reset(self) -> None:
        self._elapsed = 0.0
        self._started = False

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        """Accumulated seconds; a running timer is stopped and restarted around the reading."""
        was_started = self._started
        if was_started:
            self.stop(barrier=barrier)
        value = self._elapsed
        if reset:
            self.reset()
        if was_started:
            self.start(barrier=barrier)
        return value

    def active_time(self) -> float:
        """Total seconds this timer has run, never reset."""
        return self._active_time


class Timers:
    """A registry of timers; timers with a level above `log_level` are dummies.

    log_option: 'minmax' (min and max across ranks), 'max' (max only) or 'all' (every rank).
    """

    def __init__(self, log_level: int, log_option: str):
        if log_option not in _LOG_OPTIONS:
            raise ValueError(
                f"timing log option (--timing-log-option) must be one of {list(_LOG_OPTIONS)}, "
                f"got {log_option!r}"
            )
        if not 0 <= int(log_level) <= _MAX_LOG_LEVEL:
            raise ValueError(
                f"timing log level (--timing-log-level) must be in [0, {_MAX_LOG_LEVEL}], "
                f"got {log_level}"
            )
        self._log_level = int(log_level)
        self._log_option = log_option
        self._timers: Dict[str, Timer] = {}
        self._log_levels: Dict[str, int] = {}
        self._dummy_timer = DummyTimer()
        self._max_log_level = _MAX_LOG_LEVEL

    def __call__(self, name: str, log_level: Optional[int] = None) -> TimerBase:
        if name in self._timers:
            if log_level is not None and log_level != self._log_levels[name]:
                raise ValueError(
                    f"timer '{name}' was created with log level {self._log_levels[name]}, "
                    f"now requested with {log_level}"
                )
            return self._timers[name]
        if log_level is None:
            log_level = self._max_log_level
        if not 0 <= log_level <= self._max_log_level:
            raise ValueError(
                f"timer '{name}': log level {log_level} is not in [0, {self._max_log_level}]"
            )
        if log_level > self._log_level:
            return self._dummy_timer
        self._timers[name] = Timer(name)
        self._log_levels[name] = log_level
        return self._timers[name]

    # ------------------------------------------------------------------ gathering
    def _get_elapsed_time_all_ranks(
        self, names: List[str], reset: bool, barrier: bool
    ) -> torch.Tensor:
        """A [world_size, len(names)] tensor of milliseconds; 0 where a rank has no such timer.

        Collective: every rank must call it with the same names.
        """
        if barrier and _dist_ready():
            dist.barrier()
        world_size = dist.get_world_size() if _dist_ready() else 1
        rank = dist.get_rank() if _dist_ready() else 0
        millis = [
            self._timers[name].elapsed(reset=reset) * 1000.0 if name in self._timers else 0.0
            for name in names
        ]
        device = collective_device()
        local = torch.tensor(millis, dtype=torch.float64, device=device)
        if world_size == 1:
            return local.unsqueeze(0).cpu()
        gathered = [torch.zeros_like(local) for _ in range(world_size)]
        dist.all_gather(gathered, local)
        result = torch.stack(gathered).cpu()
        result[rank] = local.cpu()
        return result

    def _get_global_min_max_time(self, names, reset, barrier, normalizer) -> Dict[str, tuple]:
        times = self._get_elapsed_time_all_ranks(names, reset, barrier)
        out = {}
        for i, name in enumerate(names):
            column = times[:, i]
            column = column[column > 0.0]
            if column.numel() > 0:
                out[name] = (column.min().item() / normalizer, column.max().item() / normalizer)
        return out

    def _min_max_string(self, names, reset, barrier, normalizer, max_only) -> Optional[str]:
        min_max = self._get_global_min_max_time(names, reset, barrier, normalizer)
        if not min_max:
            return None
        lines = [
            "max time across ranks (ms):" if max_only else "(min, max) time across ranks (ms):"
        ]
        for name, (t_min, t_max) in min_max.items():
            label = (name + " ").ljust(48, ".")
            if max_only:
                lines.append("    {}: {:.2f}".format(label, t_max))
            else:
                lines.append("    {}: ({:.2f}, {:.2f})".format(label, t_min, t_max))
        return "\n".join(lines)

    def _all_ranks_string(self, names, reset, barrier, normalizer) -> Optional[str]:
        times = self._get_elapsed_time_all_ranks(names, reset, barrier)
        lines = ["times across ranks (ms):"]
        found_any = False
        for i, name in enumerate(names):
            header_written = False
            for rank in range(times.shape[0]):
                value = times[rank, i].item()
                if value > 0.0:
                    found_any = True
                    if not header_written:
                        lines.append("  {}:".format(name))
                        header_written = True
                    lines.append("     rank {:2d}: {:.2f}".format(rank, value / normalizer))
        return "\n".join(lines) if found_any else None

    def _resolve_names(self, names: Optional[Iterable[str]]) -> List[str]:
        return list(self._timers.keys()) if names is None else list(names)

    # ------------------------------------------------------------------ public reporting
    def get_all_timers_string(
        self,
        names: Optional[Iterable[str]] = None,
        normalizer: float = 1.0,
        reset: bool = True,
        barrier: bool = False,
    ) -> Optional[str]:
        """The report in the configured format; None when no rank has timed any of `names`.

        Collective when torch.distributed is initialized.
        """
        if not normalizer > 0.0:
            raise ValueError(f"timers normalizer must be positive, got {normalizer}")
        names = self._resolve_names(names)
        if self._log_option == "all":
            return self._all_ranks_string(names, reset, barrier, normalizer)
        return self._min_max_string(names, reset, barrier, normalizer, self._log_option == "max")

    def log(
        self,
        names: Optional[Iterable[str]] = None,
        normalizer: float = 1.0,
        reset: bool = True,
        barrier: bool = False,
        rank: Optional[int] = None,
    ) -> Optional[str]:
        """Print the report on `rank` (default: the last rank) and return it (on every rank).

        Collective when torch.distributed is initialized: call it on all ranks.
        """
        text = self.get_all_timers_string(names, normalizer, reset, barrier)
        if rank is None:
            rank = (dist.get_world_size() - 1) if _dist_ready() else 0
        my_rank = dist.get_rank() if _dist_ready() else 0
        if text is not None and my_rank == rank:
            print(text, flush=True)
        return text

    def write(
        self,
        names: Optional[Iterable[str]],
        writer,
        iteration: int,
        normalizer: float = 1.0,
        reset: bool = False,
        barrier: bool = False,
    ) -> None:
        """Add `<name>-time` scalars (max across ranks, ms / normalizer) to a TensorBoard writer.

        Collective: call it on all ranks; only ranks with a writer write.
        """
        if not normalizer > 0.0:
            raise ValueError(f"timers normalizer must be positive, got {normalizer}")
        min_max = self._get_global_min_max_time(
            self._resolve_names(names), reset, barrier, normalizer
        )
        if writer is not None:
            for name, (_, t_max) in min_max.items():
                writer.add_scalar(name + "-time", t_max, iteration)
