"""Build the train / valid / test datasets from a config: one prefix, a blend, or one blend per
split."""

from __future__ import annotations

import logging
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, List, Optional, Sequence, Type

import numpy as np

from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset, get_bin_path, get_idx_path
from megatron.core.datasets.megatron_dataset import MegatronDataset
from megatron.core.datasets.utils import Split, dist_all_ok, dist_rank, log_single_rank, normalize

logger = logging.getLogger(__name__)

MidLevelDataset = MegatronDataset
TopLevelDataset = Any  # MegatronDataset or BlendedDataset


def _size_per_split_per_dataset(
    normalized_weights: Sequence[float],
    target_size_per_split: Sequence[Optional[int]],
    surplus: float = 0.0,
) -> List[List[Optional[int]]]:
    """For each dataset and split, ``ceil(ceil(target * weight) * (1 + surplus))`` samples."""
    return [
        [
            None if target is None else int(math.ceil(math.ceil(target * weight) * (1 + surplus)))
            for target in target_size_per_split
        ]
        for weight in normalized_weights
    ]


class BlendedMegatronDatasetBuilder:
    """``build()`` returns ``[train, valid, test]`` (None for an empty split or a rank not
    building).

    ``sizes`` are the target sample counts per split (None: one epoch). ``is_built_on_rank``
    says whether this rank needs the datasets (it must be True on global rank 0). In a
    distributed run rank 0 builds first and writes the index caches; every other rank waits on
    a barrier and then builds from the cache.
    """

    def __init__(
        self,
        cls: Type[MidLevelDataset],
        sizes: List[Optional[int]],
        is_built_on_rank: Callable[[], bool],
        config: BlendedMegatronDatasetConfig,
    ) -> None:
        self.cls = cls
        self.sizes = list(sizes)
        self.is_built_on_rank = is_built_on_rank
        self.config = config
        if len(self.sizes) != len(Split):
            raise ValueError(
                f"sizes must hold {len(Split)} values (train, valid, test), got {sizes}"
            )
        log_single_rank(
            logger,
            logging.INFO,
            f"Building {cls.__name__} splits with sizes={self.sizes} and config={config}",
        )
        if not config.mock:
            for split in Split:
                if config.blend_per_split is None:
                    blend = config.blend
                else:
                    blend = config.blend_per_split[split.value]
                    if blend is None:
                        continue
                if self.sizes[split.value] is None and blend[1] is not None:
                    raise ValueError(
                        f"the {split.name} split has blend weights but no target size; weights "
                        f"need a size (or drop the weights to use each dataset once)"
                    )
        if dist_rank() == 0 and not self.is_built_on_rank():
            raise ValueError("is_built_on_rank() must be True on global rank 0")

    def build(self) -> List[Optional[TopLevelDataset]]:
        datasets = self._build_blended_dataset_splits()
        for dataset in datasets:
            if isinstance(dataset, BlendedDataset) and dataset.size is not None:
                if len(dataset) != dataset.size:
                    raise RuntimeError(
                        f"internal error: {dataset.split.name} blend has {len(dataset)} samples, "
                        f"expected {dataset.size}"
                    )
        return datasets

    # --- the three configurations ---------------------------------------------------------------

    def _build_blended_dataset_splits(self) -> List[Optional[TopLevelDataset]]:
        config = self.config
        if config.mock:
            try:
                return self._build_megatron_dataset_splits(None, config.split_matrix, self.sizes)
            except Exception as error:
                raise RuntimeError(
                    f"{self.cls.__name__} failed to build as a mock data generator: {error}"
                ) from error

        if config.blend_per_split is None:
            prefixes, weights = config.blend
            return self._build_from_blend(prefixes, weights, config.split_matrix, self.sizes)

        datasets: List[Optional[TopLevelDataset]] = [None] * len(Split)
        for i in range(len(Split)):
            blend = config.blend_per_split[i]
            if blend is None:
                continue
            split_spoof: List[Optional[tuple]] = [None] * len(Split)
            split_spoof[i] = (0.0, 1.0)
            sizes_spoof: List[Optional[int]] = [0] * len(Split)
            sizes_spoof[i] = self.sizes[i]
            datasets[i] = self._build_from_blend(blend[0], blend[1], split_spoof, sizes_spoof)[i]
        return datasets

    def _build_from_blend(
        self,
        prefixes: List[str],
        weights: Optional[List[float]],
        split: List[Optional[tuple]],
        sizes: List[Optional[int]],
    ) -> List[Optional[TopLevelDataset]]:
        self._check_prefixes(prefixes)
        if len(prefixes) == 1 and (weights is None or self.config.blend_per_split is not None):
            return self._build_megatron_dataset_splits(prefixes[0], split, sizes)

        if weights is not None:
            weights = normalize(weights)
            sizes_target = _size_per_split_per_dataset(weights, sizes)
            sizes_buffer = _size_per_split_per_dataset(
                weights, sizes, surplus=self.config.mid_level_dataset_surplus
            )
        else:
            sizes_target = None
            sizes_buffer = [[None] * len(Split) for _ in prefixes]  # one epoch each

        mid_level = self._build_megatron_datasets_parallel(prefixes, split, sizes_buffer)

        blended: List[Optional[TopLevelDataset]] = [None] * len(Split)
        for i in range(len(Split)):
            if split[i] is None:
                continue
            if weights is not None:
                if sizes[i] is None:
                    raise ValueError(
                        f"blend weights for the {Split(i).name} split need a target size"
                    )
                blend_weights: Sequence[float] = weights
                size_i: Optional[int] = sum(row[i] for row in sizes_target)
            else:
                if any(d is None for d in mid_level[i]):
                    blend_weights = [0 for _ in prefixes]  # not built on this rank
                else:
                    blend_weights = [len(d) for d in mid_level[i]]
                size_i = None if sizes[i] is None else min(sizes[i], sum(blend_weights))
            blended[i] = self.build_generic_dataset(
                BlendedDataset,
                self.is_built_on_rank,
                True,
                mid_level[i],
                blend_weights,
                size_i,
                self.config,
            )
        return blended

    def _check_prefixes(self, prefixes: List[str]) -> None:
        """Fail early with the prefix that is missing, on every rank at once (a rank that
        raised alone would leave the others waiting at the next barrier)."""
        missing = None
        if self.is_built_on_rank():
            missing = next((p for p in prefixes if not IndexedDataset.exists(p)), None)
        everyone_ok = dist_all_ok(missing is None)
        if missing is not None:
            raise FileNotFoundError(
                f"data path {missing!r} not found: expected {get_idx_path(missing)} and "
                f"{get_bin_path(missing)} (give the prefix without .bin/.idx)"
            )
        if not everyone_ok:
            raise FileNotFoundError("a data path is missing on another rank; see its error message")

    # --- building ----------------------------------------------------------------------------

    def _build_megatron_datasets_parallel(
        self,
        prefixes: List[str],
        split: List[Optional[tuple]],
        sizes_per_dataset: List[List[Optional[int]]],
    ) -> List[List[Optional[MidLevelDataset]]]:
        """Component datasets per split: rank 0 first (writing caches), barrier, then the rest."""
        results: List[List[Optional[MidLevelDataset]]] = [[] for _ in range(len(Split))]

        def build_all(num_workers: int) -> None:
            def one(k: int):
                return self._build_megatron_dataset_splits(
                    prefixes[k], split, sizes_per_dataset[k], synchronize_ranks=False
                )

            if num_workers > 1:
                with ThreadPoolExecutor(max_workers=num_workers) as pool:
                    per_prefix = list(pool.map(one, range(len(prefixes))))
            else:
                per_prefix = [one(k) for k in range(len(prefixes))]
            for splits in per_prefix:
                for i, dataset in enumerate(splits):
                    results[i].append(dataset)

        threads = max(1, int(self.config.num_dataset_builder_threads))
        rank = dist_rank()
        if rank is None:
            build_all(threads)
        else:
            _rank0_first(lambda: build_all(threads), rank, True)
            if rank != 0:
                build_all(threads)
        return results

    def _build_megatron_dataset_splits(
        self,
        dataset_path: Optional[str],
        split: List[Optional[tuple]],
        sizes: List[Optional[int]],
        synchronize_ranks: bool = True,
    ) -> List[Optional[MidLevelDataset]]:
        if dist_rank() is not None and not self.is_built_on_rank():
            # Take part in as many barriers as the ranks that build.
            for i in range(len(Split)):
                if split[i] is not None and synchronize_ranks:
                    _rank0_first(lambda: None, dist_rank(), True)
            return [None] * len(Split)

        low_level = self.cls.build_low_level_dataset(dataset_path, self.config)
        num_elements = self.cls.numel_low_level_dataset(low_level)
        datasets: List[Optional[MidLevelDataset]] = []
        for i, index_split in enumerate(Split):
            if split[i] is None:
                datasets.append(None)
                continue
            beg = int(round(split[i][0] * float(num_elements)))
            end = int(round(split[i][1] * float(num_elements)))
            indices = np.arange(beg, end, dtype=np.int32)
            datasets.append(
                self.build_generic_dataset(
                    self.cls,
                    self.is_built_on_rank,
                    synchronize_ranks,
                    low_level,
                    dataset_path,
                    indices,
                    sizes[i],
                    index_split,
                    self.config,
                )
            )
        return datasets

    @staticmethod
    def build_generic_dataset(
        cls: Type, is_built_on_rank: Callable[[], bool], synchronize_ranks: bool, *args: Any
    ) -> Optional[Any]:
        """``cls(*args)`` on rank 0, barrier, then on the other ranks that build."""
        rank = dist_rank()
        if rank is None:
            return cls(*args)
        built: List[Any] = [None]

        def build() -> None:
            if is_built_on_rank():
                built[0] = cls(*args)

        _rank0_first(build, rank, synchronize_ranks)
        if rank != 0 and is_built_on_rank():
            built[0] = cls(*args)
        return built[0]


def _rank0_first(work: Callable[[], None], rank: int, synchronize: bool) -> None:
    """Run ``work`` on rank 0 then synchronize; a failure on rank 0 is raised on every rank
    instead of leaving the others waiting at a barrier forever."""
    error: Optional[BaseException] = None
    if rank == 0:
        try:
            work()
        except Exception as err:  # re-raised below, after the other ranks learn of it
            error = err
    if not synchronize:
        if error is not None:
            raise error
        return
    if not dist_all_ok(error is None):
        if error is not None:
            if isinstance(error, OSError):
                raise RuntimeError(
                    f"failed to build the datasets or write their index caches ({error}); "
                    f"pass a writable --data-cache-path if the cache directory is read-only"
                ) from error
            raise error
        raise RuntimeError("rank 0 failed to build the datasets; see its error message")
