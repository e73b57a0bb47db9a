"""What the steps of benchmarks/gpu/check.sh share: launching an entry point under torchrun with a
deadline that takes its whole process tree down, reading the run back (log lines, TensorBoard
scalars), and the figures each step keeps in ``results.json`` of the log directory."""

from __future__ import annotations

import json
import math
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from megatron.training.log_parsing import RunMetrics, parse_log_lines  # noqa: E402

_LIVE: List["Launch"] = []  # every launch not yet reaped, for the SIGTERM of `timeout`


def run_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The environment of a launched run: the checkout on PYTHONPATH (the project need not be
    installed), unbuffered output (a killed run keeps its last lines), no network lookups."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("WANDB_MODE", "offline")
    env.update(extra or {})
    return env


def _children(pid: int) -> List[int]:
    """Direct children of ``pid`` (from /proc: torchrun puts its workers in sessions of their
    own, so a process-group kill would miss them)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[1]) == pid:
            found.append(int(entry))
    return found


def process_tree(pid: int) -> List[int]:
    """``pid`` and all its descendants."""
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo.extend(_children(current))
    return tree


class Launch:
    """One entry point (``pretrain_gpt.py`` ...) under ``torchrun --standalone``, its stdout and
    stderr in ``log_path``."""

    def __init__(
        self,
        script: str,
        flags: Sequence[str],
        log_path: Path,
        nproc: int = 1,
        env: Optional[Dict[str, str]] = None,
    ):
        self.cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        self.cmd += ["--nproc-per-node", str(nproc), str(REPO / script)] + [str(f) for f in flags]
        self.log_path = Path(log_path)
        self._log = open(self.log_path, "w")
        prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted((env or {}).items()))
        self._log.write(f"$ {prefix + ' ' if prefix else ''}{shlex.join(self.cmd)}\n")
        self._log.flush()
        self.proc = subprocess.Popen(
            self.cmd,
            cwd=REPO,
            env=run_env(env),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.started = time.monotonic()
        self.returncode: Optional[int] = None
        self.killed = False
        _LIVE.append(self)

    def wait(self, deadline: float) -> Optional[int]:
        """The return code, or None when ``deadline`` (time.monotonic) passed first: then the
        whole process tree is killed."""
        try:
            self.returncode = self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()
            return None
        self._close()
        return self.returncode

    def kill(self) -> None:
        """SIGKILL the launcher and everything it started (workers, data-loader workers)."""
        for pid in reversed(process_tree(self.proc.pid)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        self.killed = True
        self._close()

    def _close(self) -> None:
        if self in _LIVE:
            _LIVE.remove(self)
        self._log.close()

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> RunMetrics:
        return parse_log_lines(self.text().splitlines(), source=str(self.log_path))


def kill_all_on_sigterm() -> None:
    """`timeout` sends SIGTERM to the step: take every launched tree down, then exit 124."""

    def handler(signum, frame):
        for launch in list(_LIVE):
            launch.kill()
        print("RESULT: stopped by the step's time limit", flush=True)
        os._exit(124)

    signal.signal(signal.SIGTERM, handler)


def wait_all(launches: Sequence[Launch], deadline: float) -> List[Optional[int]]:
    return [launch.wait(deadline) for launch in launches]


def tensorboard_scalars(logdir: Path, tag: str) -> Dict[int, float]:
    """{step: value} of one scalar tag of the event files under ``logdir`` ({} if absent)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    accumulator.Reload()
    if tag not in accumulator.Tags().get("scalars", []):
        return {}
    return {event.step: event.value for event in accumulator.Scalars(tag)}


def failure_reason(launch: Launch, code: Optional[int]) -> str:
    """One line on why a run failed: the last error-looking line of its log."""
    if code is None:
        return f"{launch.log_path.name}: killed at the step's deadline (hung?)"
    lines = [line.strip() for line in launch.text().splitlines() if line.strip()]
    errors = [
        line
        for line in lines
        if line.startswith("error:") or "Error" in line.split(":")[0] or "Exception" in line
    ]
    last = (errors or lines or ["(no output)"])[-1]
    return f"{launch.log_path.name}: exit {code}: {last[:160]}"


def losses(launch: Launch, name: str = "lm loss") -> Dict[int, float]:
    return dict(launch.metrics().get(name))


def all_finite(series: Dict[int, float], iterations: int) -> Optional[str]:
    """None if every iteration 1..N logged a finite loss; else what is wrong."""
    missing = [i for i in range(1, iterations + 1) if i not in series]
    if missing:
        return f"iterations {missing} not logged"
    bad = [i for i, v in series.items() if not math.isfinite(v)]
    if bad:
        return f"non-finite loss at iterations {bad}"
    return None


def loss_falls(series: Dict[int, float], iterations: int) -> Optional[str]:
    """None if every iteration 1..N logged a finite loss and the last is below the first; else
    what is wrong."""
    problem = all_finite(series, iterations)
    if problem:
        return problem
    if not series[iterations] < series[1]:
        return f"loss did not fall: {series[1]:.4f} -> {series[iterations]:.4f}"
    return None


def median_ms(series: Dict[int, float], first: int, last: int) -> float:
    """Median of ``series`` over iterations first..last (the first iterations warm up)."""
    values = [series[i] for i in range(first, last + 1) if i in series]
    if not values:
        raise ValueError(f"no iterations {first}..{last} logged")
    return statistics.median(values)


class Results:
    """``results.json`` of the log directory: each step's figures, read by the later steps."""

    def __init__(self, log_dir: Path):
        self.path = Path(log_dir) / "results.json"

    def read(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def step(self, name: str) -> dict:
        return self.read().get(name, {})

    def write(self, name: str, figures: dict) -> None:
        data = self.read()
        data[name] = figures
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        tmp.replace(self.path)
