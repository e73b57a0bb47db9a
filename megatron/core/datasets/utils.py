"""Small helpers shared by the dataset classes: splits, blends, weights, rank-aware logging."""

from __future__ import annotations

import enum
import json
import logging
import re
from typing import List, Optional, Sequence, Tuple

import numpy as np

logger = logging.getLogger(__name__)


class Split(enum.Enum):
    train = 0
    valid = 1
    test = 2


def parse_and_normalize_split(split: str) -> List[float]:
    """``"969,30,1"`` (any separators) -> three non-negative floats summing to 1.

    Every number matching ``[.0-9]+`` counts, so ``"969, 30, 1"`` and ``"99/1/0"`` work; fewer
    than three numbers are padded with zeros.
    """
    if "-" in split:
        raise ValueError(f"--split {split!r}: split weights must be non-negative")
    try:
        values = [float(v) for v in re.findall(r"[.0-9]+", split)]
    except ValueError:
        raise ValueError(f"--split {split!r}: could not parse the numbers") from None
    if len(values) > len(Split):
        raise ValueError(f"--split {split!r}: at most {len(Split)} numbers (train, valid, test)")
    values = values + [0.0] * (len(Split) - len(values))
    total = sum(values)
    if total <= 0:
        raise ValueError(f"--split {split!r}: the split weights must not all be zero")
    return [v / total for v in values]


def convert_split_vector_to_split_matrix(
    vector_a: Sequence[float], vector_b: Optional[Sequence[float]] = None
) -> List[Optional[Tuple[float, float]]]:
    """Split fractions -> per-split ``(begin, end)`` bookends; zero-width splits become None.

    With ``vector_b`` the result is the overlap of the two bookend sets (used when a split is
    re-derived from a second split vector).
    """
    if vector_b is None:
        vector_b = vector_a

    def bookends(vector):
        edges = [0]
        for value in vector:
            edges.append(edges[-1] + value)
        return list(zip(edges[:-1], edges[1:]))

    matrix: List[Optional[Tuple[float, float]]] = []
    for (a_lo, a_hi), (b_lo, b_hi) in zip(bookends(vector_a), bookends(vector_b)):
        lo, hi = max(a_lo, b_lo), min(a_hi, b_hi)
        matrix.append(None if hi <= lo else (lo, hi))
    return matrix


def get_blend_from_list(
    blend: Optional[List[str]],
) -> Optional[Tuple[List[str], Optional[List[float]]]]:
    """``--data-path`` values -> ``(prefixes, weights or None)``.

    An odd number of values are all prefixes. An even number are ``weight prefix`` pairs when
    every would-be weight parses as a float; otherwise they are all prefixes.
    """
    if blend is None or len(blend) == 0:
        return None
    if len(blend) % 2 == 1:
        return [p.strip() for p in blend], None
    weights: List[float] = []
    for raw in blend[0::2]:
        try:
            weights.append(float(raw))
        except ValueError:
            return [p.strip() for p in blend], None
    return [p.strip() for p in blend[1::2]], weights


def get_blend_and_blend_per_split(
    data_path: Optional[List[str]] = None,
    data_args_path: Optional[str] = None,
    per_split_data_args_path: Optional[str] = None,
    train_data_path: Optional[List[str]] = None,
    valid_data_path: Optional[List[str]] = None,
    test_data_path: Optional[List[str]] = None,
):
    """``(blend, blend_per_split)`` from the data flags (at most one of the two is not None).

    ``--data-args-path`` is a text file holding what ``--data-path`` would;
    ``--per-split-data-args-path`` a JSON object with ``train``/``valid``/``test`` entries (a list
    or a whitespace-separated string).
    """
    if data_path and data_args_path:
        raise ValueError("--data-path and --data-args-path are mutually exclusive")
    per_split_flags = [train_data_path, valid_data_path, test_data_path]
    if data_path or data_args_path:
        if any(per_split_flags) or per_split_data_args_path:
            raise ValueError(
                "--data-path/--data-args-path and --train/valid/test-data-path are incompatible"
            )
        if data_args_path:
            try:
                with open(data_args_path) as stream:
                    data_path = stream.read().split()
            except OSError as err:
                raise ValueError(f"--data-args-path {data_args_path}: {err.strerror}") from None
            if not data_path:
                raise ValueError(f"--data-args-path {data_args_path}: the file is empty")
        return get_blend_from_list(data_path), None
    if per_split_data_args_path:
        if any(per_split_flags):
            raise ValueError(
                "--per-split-data-args-path and --train/valid/test-data-path are mutually exclusive"
            )
        try:
            with open(per_split_data_args_path) as stream:
                entries = json.load(stream)
        except OSError as err:
            raise ValueError(
                f"--per-split-data-args-path {per_split_data_args_path}: {err.strerror}"
            ) from None
        except json.JSONDecodeError as err:
            raise ValueError(
                f"{per_split_data_args_path}:{err.lineno}: invalid JSON ({err.msg})"
            ) from None
        if not isinstance(entries, dict):
            raise ValueError(
                f"{per_split_data_args_path}: expected a JSON object with train/valid/test keys"
            )
        per_split_flags = []
        for name in ("train", "valid", "test"):
            value = entries.get(name)
            per_split_flags.append(value.split() if isinstance(value, str) else value)
    if any(per_split_flags):
        return None, [get_blend_from_list(p) for p in per_split_flags]
    return None, None


def compile_helpers() -> None:
    """Megatron Core's entry point that builds the C++ dataset index helpers (``make`` in its
    datasets directory). Here the index builders are NumPy (index_helpers.py) and the optional C
    accelerator of the blending index compiles itself on first use, so there is nothing to build:
    this only imports the builders, so a broken install fails here as Megatron's would."""
    from megatron.core.datasets import index_helpers  # noqa: F401


def normalize(weights: Sequence[float]) -> List[float]:
    """Scale weights to sum to 1 (float64, as the index builders expect)."""
    w = np.array(weights, dtype=np.float64)
    total = np.sum(w)
    if not total > 0:
        raise ValueError(f"blend weights {list(weights)} must sum to a positive number")
    return (w / total).tolist()


def dist_rank() -> Optional[int]:
    """Global rank when torch.distributed is initialized, else None."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return None
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return None


def dist_barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def dist_all_ok(ok: bool) -> bool:
    """Barrier that also tells every rank whether all ranks succeeded (no hang when one fails).

    Without torch.distributed it just returns ``ok``.
    """
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return ok
    from megatron.core.device import collective_device

    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=collective_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def log_single_rank(log: logging.Logger, level: int, message: str, rank: int = 0) -> None:
    """Log only on global rank ``rank`` (everywhere when not distributed)."""
    current = dist_rank()
    if current is None or current == rank:
        log.log(level, message)
