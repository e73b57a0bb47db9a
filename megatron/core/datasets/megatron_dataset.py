"""Base class of the mid-level datasets (one split of one low-level dataset) and index caching."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch

from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.utils import Split

logger = logging.getLogger(__name__)


def _json_default(obj: Any) -> Any:
    identifiers = getattr(obj, "unique_identifiers", None)
    if identifiers is not None:
        return identifiers
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    # Never repr(): an object address would change the hash on every run.
    return {
        "class": f"{type(obj).__module__}.{type(obj).__qualname__}",
        **{
            k: getattr(obj, k)
            for k in ("vocab_size", "eod", "pad")
            if isinstance(getattr(obj, k, None), (int, np.integer))
        },
    }


def describe(identifiers: Dict[str, Any]) -> str:
    """The JSON text whose md5 names the cache files."""
    return json.dumps(identifiers, indent=4, default=_json_default)


def md5_hex(text: str) -> str:
    return hashlib.md5(text.encode("utf-8"), usedforsecurity=False).hexdigest()


class MegatronDataset(ABC, torch.utils.data.Dataset):
    """One split of a low-level dataset, sized to ``num_samples`` (None: one epoch)."""

    def __init__(
        self,
        dataset: Any,
        dataset_path: Optional[str],
        indices: np.ndarray,
        num_samples: Optional[int],
        index_split: Split,
        config: BlendedMegatronDatasetConfig,
    ) -> None:
        self.dataset = dataset
        self.dataset_path = dataset_path
        self.indices = indices
        self.num_samples = num_samples
        self.index_split = index_split
        self.config = config
        self.built_anew_on_cache_miss = False

        self.unique_identifiers: Dict[str, Any] = OrderedDict()
        self.unique_identifiers["class"] = type(self).__name__
        self.unique_identifiers["dataset_path"] = self.dataset_path
        self.unique_identifiers["num_samples"] = self.num_samples
        self.unique_identifiers["index_split"] = self.index_split.name
        for attr in self._key_config_attributes():
            self.unique_identifiers[attr] = getattr(self.config, attr)
        self.unique_description = describe(self.unique_identifiers)
        self.unique_description_hash = md5_hex(self.unique_description)

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: Any) -> int:
        """Number of elements (sequences, for GPT) the split fractions apply to."""
        raise NotImplementedError

    @staticmethod
    def build_low_level_dataset(
        dataset_path: Optional[str], config: BlendedMegatronDatasetConfig
    ) -> Any:
        raise NotImplementedError

    @staticmethod
    def _key_config_attributes() -> List[str]:
        """Config fields that change the indices and therefore enter the cache hash."""
        return ["random_seed", "sequence_length", "split", "split_matrix", "tokenizer"]

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __getitem__(self, idx: int) -> Dict[str, Any]: ...


# --- cache files ------------------------------------------------------------------------------


def cache_paths(directory: str, base: str, suffixes: Sequence[str]) -> Dict[str, str]:
    return {suffix: os.path.join(directory, f"{base}-{suffix}") for suffix in suffixes}


def _write_atomically(path: str, write) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as stream:
            write(stream)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def save_cache(paths: Dict[str, str], description: str, arrays: Dict[str, np.ndarray]) -> None:
    """Write each array (temporary name, then rename) and the description last.

    Readers test for all files, so a reader never sees a partial set or a partial file.
    """
    os.makedirs(os.path.dirname(paths["description.txt"]) or ".", exist_ok=True)
    for suffix, array in arrays.items():
        _write_atomically(paths[suffix], lambda s, a=array: np.save(s, a, allow_pickle=False))
    _write_atomically(paths["description.txt"], lambda s: s.write(description.encode("utf-8")))


def load_cache_array(path: str) -> np.ndarray:
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as err:
        raise ValueError(
            f"{path}: unreadable index cache file ({err}); delete it to rebuild"
        ) from None
