"""Read training metrics back from Megatron's per-interval log line and from TensorBoard.

Megatron's log line starts with `` [date time] iteration N/ M |`` and continues
with `` name: value |`` fields. The prefix is matched strictly; the fields after it are read
generically, so optional fields (throughput, grad norm, num zeros, params norm, MoE losses,
fields added later) never break parsing. ``LOG_LINE`` is the strict whole-line pattern for
callers that want to check the exact format (tests/functional_tests/runner.py has its own).
"""

import math
import os
import re
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional

# Strict form of the whole line, optional fields included.
LOG_LINE = re.compile(
    r"^ \[\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}(?:\.\d+)?\]"
    r" iteration +(?P<iteration>\d+)/ +(?P<train_iters>\d+) \|"
    r" consumed samples: +(?P<consumed_samples>\d+) \|"
    r"(?: skipped samples: +\d+ \|)?"
    r" elapsed time per iteration \(ms\): (?P<elapsed_ms>\d+\.\d) \|"
    r"(?: throughput per GPU \(TFLOP/s/GPU\): \d+\.\d \|)?"
    r"(?: [^|:]+: [^|]+ \|)*?"
    r" learning rate: (?P<learning_rate>-?\d\.\d{6}E[+-]\d{2}) \|"
    r" global batch size: +(?P<global_batch_size>\d+) \|"
    r"(?P<losses>(?: [A-Za-z][\w -]*: -?(?:\d\.\d{6}E[+-]\d{2}|nan|inf) \|)*)"
    r" loss scale: (?P<loss_scale>\d+\.\d) \|"
    r"(?: grad norm: (?P<grad_norm>\d+\.\d{3}|nan|inf) \|)?"
    r"(?: num zeros: [\d.]+ \|)?"
    r"(?: params norm: \d+\.\d{3} \|)?"
    r" number of skipped iterations: +(?P<skipped>\d+) \|"
    r" number of nan iterations: +(?P<nan>\d+) \|$"
)

# The part every version of the line shares; a launcher may put a prefix such as "[rank1]:"
# in front of it, so it is searched for rather than anchored.
_PREFIX = re.compile(
    r" \[\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}(?:\.\d+)?\]"
    r" iteration +(?P<iteration>\d+)/ +(?P<train_iters>\d+) \|(?P<rest>.*)$"
)
_FIELD = re.compile(r" ([^|:]+?): ([^|]*?) \|")

# Field names of the log line -> short series names used by plots and callers.
LOG_FIELDS = {
    "elapsed time per iteration (ms)": "elapsed_ms",
    "learning rate": "learning_rate",
    "grad norm": "grad_norm",
    "loss scale": "loss_scale",
    "global batch size": "global_batch_size",
    "consumed samples": "consumed_samples",
    "throughput per GPU (TFLOP/s/GPU)": "tflops_per_gpu",
    "params norm": "params_norm",
    "num zeros": "num_zeros",
    "number of skipped iterations": "skipped_iterations",
    "number of nan iterations": "nan_iterations",
}

# Megatron's TensorBoard tags -> the same series names; iteration-time is in seconds there.
TENSORBOARD_TAGS = {
    "lm loss": "lm loss",
    "learning-rate": "learning_rate",
    "grad-norm": "grad_norm",
    "iteration-time": "elapsed_ms",
    "loss-scale": "loss_scale",
    "batch-size": "global_batch_size",
    "params-norm": "params_norm",
    "num-zeros": "num_zeros",
    "throughput": "tflops_per_gpu",
}
_TB_SCALE = {"iteration-time": 1000.0}


@dataclass
class RunMetrics:
    """Metric series of one run: ``series[name][iteration] = value``."""

    source: str
    """The log file or TensorBoard directory the series were read from."""
    series: Dict[str, Dict[int, float]] = field(default_factory=dict)
    """Series name (``lm loss``, ``learning_rate``, ``grad_norm``, ``elapsed_ms``, ...) to
    {iteration: value}; a later value for the same iteration (a resumed run) wins."""

    def add(self, name: str, iteration: int, value: float) -> None:
        self.series.setdefault(name, {})[iteration] = value

    def get(self, name: str) -> Dict[int, float]:
        return self.series.get(name, {})


def _number(text: str) -> Optional[float]:
    try:
        return float(text)
    except ValueError:
        return None


def parse_log_line(line: str) -> Optional[Dict[str, float]]:
    """The fields of one per-interval log line as {series name: value}, or None for any
    other line. Losses keep their own names (``lm loss``); other fields use LOG_FIELDS."""
    match = _PREFIX.search(line.rstrip("\r\n"))
    if match is None:
        return None
    values = {
        "iteration": float(match.group("iteration")),
        "train_iters": float(match.group("train_iters")),
    }
    for name, text in _FIELD.findall(match.group("rest")):
        value = _number(text.strip())
        if value is not None:
            values[LOG_FIELDS.get(name, name)] = value
    return values


def parse_log_lines(lines: Iterable[str], source: str = "<text>") -> RunMetrics:
    """Every per-interval log line of ``lines`` (an open file, a list, or text.splitlines())."""
    run = RunMetrics(source=source)
    for line in lines:
        values = parse_log_line(line)
        if values is None:
            continue
        iteration = int(values.pop("iteration"))
        values.pop("train_iters")
        for name, value in values.items():
            run.add(name, iteration, value)
    return run


def parse_log_file(path: str) -> RunMetrics:
    with open(path, encoding="utf-8", errors="replace") as handle:
        return parse_log_lines(handle, source=str(path))


def has_tensorboard_events(path: str) -> bool:
    for _, _, files in os.walk(path):
        if any(name.startswith("events.out.tfevents") for name in files):
            return True
    return False


def read_tensorboard_run(logdir: str) -> RunMetrics:
    """The scalars of TENSORBOARD_TAGS from the event files under ``logdir`` (iteration-time
    converted to ms so it matches the log line)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = RunMetrics(source=str(logdir))
    accumulator = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    accumulator.Reload()
    available = set(accumulator.Tags().get("scalars", []))
    for tag, name in TENSORBOARD_TAGS.items():
        if tag not in available:
            continue
        scale = _TB_SCALE.get(tag, 1.0)
        for event in accumulator.Scalars(tag):
            if math.isfinite(event.value):
                run.add(name, int(event.step), float(event.value) * scale)
    return run


def read_run(path: str) -> RunMetrics:
    """A log file, or a directory holding TensorBoard event files (searched recursively)."""
    if os.path.isdir(path):
        if not has_tensorboard_events(path):
            raise ValueError(
                f"{path}: directory holds no TensorBoard event files (events.out.tfevents.*)"
            )
        return read_tensorboard_run(path)
    if not os.path.exists(path):
        raise ValueError(f"{path}: no such log file or TensorBoard directory")
    if os.path.basename(path).startswith("events.out.tfevents"):
        return read_tensorboard_run(os.path.dirname(path) or ".")
    return parse_log_file(path)


def loss_series_names(run: RunMetrics) -> List[str]:
    """Names of the loss series of a run (``lm loss`` first)."""
    known = set(LOG_FIELDS.values()) | {"iteration", "train_iters"}
    names = [name for name in run.series if name not in known]
    return sorted(names, key=lambda name: (name != "lm loss", name))
