"""Configuration shared by every dataset the BlendedMegatronDatasetBuilder builds."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

from megatron.core.datasets.utils import (
    Split,
    convert_split_vector_to_split_matrix,
    log_single_rank,
    parse_and_normalize_split,
)

logger = logging.getLogger(__name__)

Blend = Tuple[List[str], Optional[List[float]]]


@dataclass
class BlendedMegatronDatasetConfig:
    """Where the data comes from, how it is split and where index caches go."""

    random_seed: int
    """Seed of every index shuffle (``--seed``)."""

    sequence_length: int
    """Tokens per sample (``--seq-length``)."""

    blend: Optional[Blend] = None
    """``(prefixes, weights or None)`` from ``--data-path``; all splits come from it."""

    blend_per_split: Optional[List[Optional[Blend]]] = None
    """One blend per split (train, valid, test) from ``--train/valid/test-data-path``; a split
    may be None. Incompatible with ``blend`` and ``split``."""

    split: Optional[str] = None
    """``--split`` string such as ``"969,30,1"``; required with ``blend``."""

    split_matrix: Optional[List[Optional[Tuple[float, float]]]] = field(init=False, default=None)
    """Derived from ``split``: per split the ``(begin, end)`` fraction of each dataset, or None."""

    num_dataset_builder_threads: int = 1
    """Threads building the components of a blend (``--num-dataset-builder-threads``)."""

    path_to_cache: Optional[str] = None
    """Index cache directory (``--data-cache-path``); default ``<prefix>/cache/<Class>_indices``."""

    mmap_bin_files: bool = True
    """Memory-map the ``.bin`` files (``--no-mmap-bin-files`` reads them with file reads)."""

    mock: bool = False
    """Synthetic data (``--mock-data``); also set when ``blend`` and ``blend_per_split`` are None.
    Mock data is always split "1,1,1" (``split`` is replaced): Megatron Core's config replaces
    the split of mock data with that even split too."""

    tokenizer: Optional[Any] = None
    """Object with ``eod``, ``pad`` (None or -1 when absent), ``vocab_size`` and optionally a
    ``unique_identifiers`` dict (hashed into the cache file names)."""

    mid_level_dataset_surplus: float = 0.005
    """Extra fraction of samples built per component of a weighted blend."""

    def __post_init__(self) -> None:
        if self.blend_per_split is not None and any(self.blend_per_split):
            if self.blend is not None:
                raise ValueError("--data-path and --train/valid/test-data-path are incompatible")
            if self.split is not None:
                raise ValueError("--split and --train/valid/test-data-path are incompatible")
            if len(self.blend_per_split) != len(Split):
                raise ValueError(
                    f"blend_per_split must hold {len(Split)} blends (train, valid, test), "
                    f"got {len(self.blend_per_split)}"
                )
            for split in Split:
                blend = self.blend_per_split[split.value]
                if blend is None:
                    log_single_rank(
                        logger, logging.INFO, f"blend not provided for {split.name} split"
                    )
                else:
                    _check_blend(blend, f"--{split.name}-data-path")
            self.mock = False
            return
        self.blend_per_split = None
        if self.blend is not None and not self.mock:
            _check_blend(self.blend, "--data-path")
            if self.split is None:
                raise ValueError("--split must be given with --data-path")
        else:
            # Megatron Core's rule: with neither a blend nor per-split blends the synthetic
            # documents are split evenly, whatever --split says.
            self.mock = True
            if self.split is not None and self.split.replace(" ", "") != "1,1,1":
                log_single_rank(
                    logger,
                    logging.INFO,
                    f"Let split = 1,1,1 instead of {self.split!r}: mock data is split evenly",
                )
            self.split = "1,1,1"
        self.split_matrix = convert_split_vector_to_split_matrix(
            parse_and_normalize_split(self.split)
        )
        log_single_rank(logger, logging.INFO, f"Let split_matrix = {self.split_matrix}")


def _check_blend(blend: Blend, flag: str) -> None:
    prefixes, weights = blend
    if not prefixes:
        raise ValueError(f"{flag}: no dataset prefixes given")
    if weights is not None:
        if len(weights) != len(prefixes):
            raise ValueError(
                f"{flag}: {len(prefixes)} prefixes but {len(weights)} weights; "
                "give weight/prefix pairs"
            )
        for weight, prefix in zip(weights, prefixes):
            if not weight > 0:
                raise ValueError(f"{flag}: weight {weight} of {prefix} must be positive")
