"""BlendedDataset: interleave several mid-level datasets by weight, deterministically."""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.index_helpers import (
    build_blending_indices,
    build_exhaustive_blending_indices,
)
from megatron.core.datasets.megatron_dataset import (
    MegatronDataset,
    cache_paths,
    describe,
    load_cache_array,
    md5_hex,
    save_cache,
)
from megatron.core.datasets.utils import dist_rank, log_single_rank, normalize

logger = logging.getLogger(__name__)


class BlendedDataset(torch.utils.data.Dataset):
    """Sample ``n`` comes from ``datasets[dataset_index[n]]`` at ``dataset_sample_index[n]``.

    With ``size`` the float ``weights`` are normalized and ``size`` samples are drawn by greedy
    error minimization; with ``size`` None the weights are integer sample counts and every
    one of those samples is drawn exactly once.
    """

    def __init__(
        self,
        datasets: List[MegatronDataset],
        weights: Sequence[Union[int, float]],
        size: Optional[int],
        config: BlendedMegatronDatasetConfig,
    ) -> None:
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        if not 0 < len(datasets) < np.iinfo(np.int16).max:
            raise ValueError(f"cannot blend {len(datasets)} datasets")
        if any(type(d) is not type(datasets[0]) for d in datasets):
            raise ValueError("all blended datasets must have the same class")
        if any(d.index_split != datasets[0].index_split for d in datasets):
            raise ValueError("all blended datasets must belong to the same split")
        if size is None:
            if any(float(w) != int(w) or w < 0 for w in weights):
                raise ValueError(
                    f"without a size the weights must be sample counts, got {list(weights)}"
                )
            weights = [int(w) for w in weights]
        else:
            if any(not w > 0 for w in weights):
                raise ValueError(f"blend weights must be positive, got {list(weights)}")
            size = int(size)
            weights = normalize(weights)
        if len(datasets) == 1:
            log_single_rank(
                logger, logging.WARNING, "Building a BlendedDataset for a single MegatronDataset"
            )

        self.datasets = datasets
        self.split = datasets[0].index_split
        self.weights = list(weights)
        self.size = size
        self.config = config

        identifiers: Dict[str, Any] = OrderedDict()
        identifiers["class"] = type(self).__name__
        identifiers["datasets"] = [d.unique_identifiers for d in datasets]
        identifiers["split"] = self.split.name
        identifiers["weights"] = self.weights
        identifiers["size"] = self.size
        self.unique_identifiers = identifiers
        self.unique_description = describe(identifiers)
        self.unique_description_hash = md5_hex(self.unique_description)

        self.built_anew_on_cache_miss = False
        self.dataset_index, self.dataset_sample_index = self._build_indices()
        self._check_not_oversampled()

    def __len__(self) -> int:
        return self.dataset_index.shape[0]

    def __getitem__(self, idx: int) -> Dict[str, Any]:
        dataset_id = int(self.dataset_index[idx])
        sample_id = int(self.dataset_sample_index[idx])
        return {"dataset_id": dataset_id, **self.datasets[dataset_id][sample_id]}

    def _build_indices(self) -> Tuple[np.ndarray, np.ndarray]:
        directory = self.config.path_to_cache
        paths = None
        if directory:
            base = f"{self.unique_description_hash}-{type(self).__name__}-{self.split.name}"
            paths = cache_paths(
                directory,
                base,
                ["description.txt", "dataset_index.npy", "dataset_sample_index.npy"],
            )
            if all(os.path.isfile(p) for p in paths.values()):
                log_single_rank(
                    logger,
                    logging.INFO,
                    f"Load the {type(self).__name__} {self.split.name} indices from {directory}",
                )
                dataset_index = load_cache_array(paths["dataset_index.npy"])
                dataset_sample_index = load_cache_array(paths["dataset_sample_index.npy"])
                if dataset_index.shape != dataset_sample_index.shape:
                    raise ValueError(
                        f"{paths['dataset_index.npy']}: inconsistent blend cache; "
                        "delete it to rebuild"
                    )
                return dataset_index, dataset_sample_index

        log_single_rank(
            logger,
            logging.INFO,
            f"Build and save the {type(self).__name__} {self.split.name} indices",
        )
        self.built_anew_on_cache_miss = True
        started = time.time()
        if self.size is not None:
            dataset_index, dataset_sample_index = build_blending_indices(self.weights, self.size)
        else:
            dataset_index, dataset_sample_index = build_exhaustive_blending_indices(self.weights)
        log_single_rank(
            logger,
            logging.INFO,
            f"> built the {type(self).__name__} {self.split.name} indices "
            f"in {time.time() - started:.2f} s",
        )
        rank = dist_rank()
        if paths is not None and (rank is None or rank == 0):
            try:
                save_cache(
                    paths,
                    self.unique_description,
                    {
                        "dataset_index.npy": dataset_index,
                        "dataset_sample_index.npy": dataset_sample_index,
                    },
                )
            except OSError as err:
                logger.warning(f"cannot write the blend index cache to {directory} ({err})")
        return dataset_index, dataset_sample_index

    def _check_not_oversampled(self) -> None:
        if len(self.dataset_index) == 0:
            return
        counts = np.bincount(
            np.asarray(self.dataset_index, dtype=np.int64), minlength=len(self.datasets)
        )
        for i, (count, dataset) in enumerate(zip(counts, self.datasets)):
            if count > len(dataset):
                raise ValueError(
                    f"the {self.split.name} blend oversamples dataset {i} "
                    f"({getattr(dataset, 'dataset_path', None)}): {count} samples drawn but it "
                    f"holds {len(dataset)}; build it with more samples or lower its weight"
                )
