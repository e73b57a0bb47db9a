"""GPTDataset: fixed-length, left-to-right language-model samples over an IndexedDataset."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.index_helpers import (
    build_document_index,
    build_sample_index,
    build_shuffle_index,
)
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.megatron_dataset import (
    MegatronDataset,
    cache_paths,
    load_cache_array,
    save_cache,
)
from megatron.core.datasets.utils import Split, dist_rank, log_single_rank

logger = logging.getLogger(__name__)

_PAD_TOKEN_ID = -1
_SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80


@dataclass
class GPTDatasetConfig(BlendedMegatronDatasetConfig):
    """BlendedMegatronDatasetConfig plus the GPT sample layout.

    The three switches below default to None as in Megatron Core; None means off."""

    reset_position_ids: Optional[bool] = None
    """Restart position ids after every end-of-document token (``--reset-position-ids``)."""

    reset_attention_mask: Optional[bool] = None
    """Forbid attention across end-of-document tokens (``--reset-attention-mask``)."""

    eod_mask_loss: Optional[bool] = None
    """Zero the loss where the input token is end-of-document (``--eod-mask-loss``)."""

    create_attention_mask: bool = True
    """Return an explicit ``attention_mask`` (``--no-create-attention-mask-in-dataloader`` turns it
    off)."""

    drop_last_partial_validation_sequence: bool = True
    """Drop the last incomplete validation sample instead of padding it."""

    add_extra_token_to_sequence: bool = True
    """Read ``sequence_length + 1`` tokens per sample so inputs and labels both have
    ``sequence_length``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sequence_length is None or int(self.sequence_length) <= 0:
            raise ValueError(f"--seq-length must be positive, got {self.sequence_length}")
        if self.tokenizer is None:
            raise ValueError("GPTDatasetConfig needs a tokenizer (for its eod and pad ids)")


def get_ltor_masks_and_position_ids(
    data: torch.Tensor,
    eod_token: int,
    reset_position_ids: bool,
    reset_attention_mask: bool,
    eod_mask_loss: bool,
    create_attention_mask: bool,
) -> Tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Causal mask ([1, s, s] bool, True = masked), loss mask (float) and position ids of one
    sample.

    A document ends *at* its EOD token: the EOD still belongs to (and attends within) the
    document it closes, and the next position starts a new document.
    """
    seq_length = data.numel()
    is_eod = data == eod_token
    loss_mask = torch.ones(seq_length, dtype=torch.float, device=data.device)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0
    position_ids = torch.arange(seq_length, dtype=torch.long, device=data.device)
    segment = None
    if reset_position_ids or reset_attention_mask:
        # segment[t] = number of EODs strictly before t
        segment = torch.cumsum(is_eod.long(), 0) - is_eod.long()
    if reset_position_ids:
        eod_positions = torch.nonzero(is_eod, as_tuple=True)[0]
        segment_starts = torch.cat(
            [torch.zeros(1, dtype=torch.long, device=data.device), eod_positions + 1]
        )
        starts = segment_starts[segment]
        position_ids = position_ids - starts
    attention_mask = None
    if create_attention_mask:
        causal = torch.ones((seq_length, seq_length), dtype=torch.bool, device=data.device).tril_()
        if reset_attention_mask:
            causal &= segment.unsqueeze(1) == segment.unsqueeze(0)
        attention_mask = (~causal).unsqueeze(0)
    return attention_mask, loss_mask, position_ids


class GPTDataset(MegatronDataset):
    """Samples of ``sequence_length`` (+1) tokens drawn across document boundaries.

    ``indexed_indices`` are the sequence ids of this split; ``num_samples`` None means one epoch.
    """

    def __init__(
        self,
        indexed_dataset: Any,
        dataset_path: Optional[str],
        indexed_indices: np.ndarray,
        num_samples: Optional[int],
        index_split: Split,
        config: GPTDatasetConfig,
    ) -> None:
        super().__init__(
            indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config
        )
        self.masks_and_position_ids_are_cacheable = not any(
            [config.reset_attention_mask, config.reset_position_ids, config.eod_mask_loss]
        )
        self._cached_masks: Optional[Tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]] = (
            None
        )
        self._pad_token_id = self._resolve_pad_id(config.tokenizer)
        self._eod_token_id = config.tokenizer.eod
        self._extra = int(bool(config.add_extra_token_to_sequence))
        self.document_index, self.sample_index, self.shuffle_index = (
            self._build_document_sample_shuffle_indices()
        )

    @staticmethod
    def _resolve_pad_id(tokenizer: Any) -> int:
        """The tokenizer's pad id, or -1 when it has none or it doubles as another special token
        (a pad equal to EOD would hide every EOD label from the loss)."""
        try:
            pad = getattr(tokenizer, "pad", None)
        except NotImplementedError:  # e.g. GPT-2 BPE has no pad token
            pad = None
        if pad is None or not isinstance(pad, (int, np.integer)) or pad < 0:
            return _PAD_TOKEN_ID
        for name in ("eod", "bos", "eos", "cls", "sep", "mask"):
            try:
                other = getattr(tokenizer, name, None)
            except Exception:  # tokenizers raise for ids they do not have
                other = None
            if isinstance(other, (int, np.integer)) and other == pad:
                return _PAD_TOKEN_ID
        return int(pad)

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: IndexedDataset) -> int:
        return low_level_dataset.sequence_lengths.shape[0]

    @staticmethod
    def _key_config_attributes() -> List[str]:
        # Both change the sample index, so both must change the cache file names.
        return MegatronDataset._key_config_attributes() + [
            "add_extra_token_to_sequence",
            "drop_last_partial_validation_sequence",
        ]

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: GPTDatasetConfig) -> IndexedDataset:
        return IndexedDataset(dataset_path, multimodal=False, mmap=config.mmap_bin_files)

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def __getitem__(self, idx: Optional[int]) -> Dict[str, torch.Tensor]:
        """idx None yields a padding sample whose loss mask is all zero."""
        text, _ = self._query_document_sample_shuffle_indices(0 if idx is None else idx)
        text = torch.from_numpy(text)  # host: a sample is collated on the host, then moved
        if self._extra:
            tokens = text[:-1].contiguous()
            labels = text[1:].contiguous()
        else:
            tokens = text
            labels = torch.roll(text, shifts=-1, dims=0)
            labels[-1] = self._pad_token_id

        cfg = self.config
        if self.masks_and_position_ids_are_cacheable and self._cached_masks is not None:
            attention_mask, loss_mask, position_ids = self._cached_masks
        else:
            attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
                tokens,
                self._eod_token_id,
                cfg.reset_position_ids,
                cfg.reset_attention_mask,
                cfg.eod_mask_loss,
                cfg.create_attention_mask,
            )
            if self.masks_and_position_ids_are_cacheable:
                self._cached_masks = (attention_mask, loss_mask, position_ids)
        # The cached loss mask is modified below and position ids may be modified by callers:
        # copy them. The [1, s, s] attention mask is shared by every sample (read-only, as
        # upstream) because copying it costs more than the rest of the sample.
        if self.masks_and_position_ids_are_cacheable:
            loss_mask = loss_mask.clone()
            position_ids = position_ids.clone()

        is_pad = labels == self._pad_token_id
        loss_mask[is_pad] = 0.0
        tokens[tokens == self._pad_token_id] = 0  # pads must be valid embedding rows
        labels[is_pad] = 0
        if idx is None:
            loss_mask.zero_()

        sample = {"tokens": tokens, "labels": labels}
        if attention_mask is not None:
            sample["attention_mask"] = attention_mask
        sample["loss_mask"] = loss_mask
        sample["position_ids"] = position_ids
        return sample

    def _query_document_sample_shuffle_indices(self, idx: int) -> Tuple[np.ndarray, np.ndarray]:
        """Tokens (int64, ``sequence_length + extra``, padded) and the document ids of one
        sample."""
        text, document_ids = self._read_sample(idx)
        want = self.config.sequence_length + self._extra
        if len(text) < want:
            text = np.concatenate([text, np.full(want - len(text), self._pad_token_id, np.int64)])
        return text, document_ids

    def _read_sample(self, idx: int) -> Tuple[np.ndarray, np.ndarray]:
        """The tokens of sample ``idx`` as stored (int64; shorter than ``sequence_length +
        extra`` only for the last partial validation sample) and its document ids."""
        if not 0 <= int(idx) < len(self):
            raise IndexError(
                f"sample {idx} out of range for a {self.index_split.name} split "
                f"of {len(self)} samples"
            )
        j = int(self.shuffle_index[idx])
        doc_beg, offset_beg = (int(v) for v in self.sample_index[j])
        doc_end, offset_end = (int(v) for v in self.sample_index[j + 1])
        document_ids: List[int] = []
        parts: List[np.ndarray] = []
        if doc_beg == doc_end:
            doc = int(self.document_index[doc_beg])
            document_ids.append(doc)
            parts.append(
                self.dataset.get(
                    doc, offset=offset_beg, length=offset_end - offset_beg + self._extra
                )
            )
        else:
            for position in range(doc_beg, doc_end + 1):
                doc = int(self.document_index[position])
                document_ids.append(doc)
                offset = offset_beg if position == doc_beg else 0
                length = offset_end + self._extra if position == doc_end else None
                parts.append(self.dataset.get(doc, offset=offset, length=length))
        return np.concatenate(parts).astype(np.int64, copy=False), np.array(
            document_ids, dtype=np.int64
        )

    # --- indices ------------------------------------------------------------------------------

    def _cache_directory(self) -> Optional[str]:
        if self.config.path_to_cache:
            return self.config.path_to_cache
        if self.config.mock or self.dataset_path is None:
            return None
        return os.path.join(self.dataset_path, "cache", f"{type(self).__name__}_indices")

    def _build_document_sample_shuffle_indices(self) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        name = f"{type(self).__name__} {self.index_split.name}"
        directory = self._cache_directory()
        paths = None
        if directory:
            base = f"{self.unique_description_hash}-{type(self).__name__}-{self.index_split.name}"
            paths = cache_paths(
                directory,
                base,
                ["description.txt", "document_index.npy", "sample_index.npy", "shuffle_index.npy"],
            )
            if all(os.path.isfile(p) for p in paths.values()):
                log_single_rank(logger, logging.INFO, f"Load the {name} indices from {directory}")
                return self._load_indices(paths)

        rank = dist_rank()
        writer = paths is not None and (rank is None or rank == 0)
        if paths is not None and not writer:
            # Normally rank 0 has written the cache before the builder's barrier; a rank that
            # still misses it (e.g. node-local storage) builds the same indices in memory.
            logger.warning(
                f"rank {rank}: {name} index cache missing in {directory}; building in memory"
            )
        log_single_rank(logger, logging.INFO, f"Build and save the {name} indices")
        self.built_anew_on_cache_miss = True
        started = time.time()
        document_index, sample_index, shuffle_index = self._build_indices()
        log_single_rank(
            logger,
            logging.INFO,
            f"> built the {name} indices in {time.time() - started:.2f} s: "
            f"{len(document_index)} documents, {sample_index.shape[0] - 1} samples",
        )
        if writer:
            try:
                save_cache(
                    paths,
                    self.unique_description,
                    {
                        "document_index.npy": document_index,
                        "sample_index.npy": sample_index,
                        "shuffle_index.npy": shuffle_index,
                    },
                )
            except OSError as err:
                logger.warning(
                    f"cannot write the {name} index cache to {directory} ({err}); pass a writable "
                    f"--data-cache-path to reuse indices between runs"
                )
        return document_index, sample_index, shuffle_index

    def _load_indices(self, paths: Dict[str, str]) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        document_index = load_cache_array(paths["document_index.npy"])
        sample_index = load_cache_array(paths["sample_index.npy"])
        shuffle_index = load_cache_array(paths["shuffle_index.npy"])
        if (
            sample_index.ndim != 2
            or sample_index.shape[1] != 2
            or shuffle_index.shape[0] != sample_index.shape[0] - 1
        ):
            raise ValueError(
                f"{paths['sample_index.npy']}: index cache is inconsistent "
                f"(sample index {sample_index.shape}, shuffle index {shuffle_index.shape}); "
                "delete it to rebuild"
            )
        return document_index, sample_index, shuffle_index

    def _build_indices(self) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        sequence_length = self.config.sequence_length
        extra = self._extra
        lengths = self.dataset.sequence_lengths
        tokens_per_epoch = int(np.sum(lengths[self.indices], dtype=np.int64))
        num_epochs = self._get_num_epochs(tokens_per_epoch)

        separate_final_epoch = False
        num_samples_sans_final_epoch = None
        if num_epochs > 1:
            num_samples_sans_final_epoch = (
                (num_epochs - 1) * tokens_per_epoch - extra
            ) // sequence_length
            num_samples_from_final_epoch = self.num_samples - num_samples_sans_final_epoch
            num_samples_per_epoch = (tokens_per_epoch - extra) // sequence_length
            if not 0 <= num_samples_from_final_epoch <= num_samples_per_epoch + 1:
                raise RuntimeError(
                    f"internal error: {num_samples_from_final_epoch} samples from the final epoch "
                    f"of {num_samples_per_epoch} per epoch"
                )
            separate_final_epoch = num_samples_from_final_epoch < int(
                _SEPARATE_FINAL_EPOCH_THRESHOLD * num_samples_per_epoch
            )

        numpy_random_state = np.random.RandomState(self.config.random_seed)
        document_index = build_document_index(
            self.indices, num_epochs, numpy_random_state, separate_final_epoch
        )

        drop_last = True
        if self.index_split == Split.valid:
            drop_last = self.config.drop_last_partial_validation_sequence
        if np.dtype(lengths.dtype) != np.int32:
            lengths = np.asarray(lengths, dtype=np.int32)
        sample_index = build_sample_index(
            lengths, document_index, sequence_length, num_epochs, tokens_per_epoch, drop_last, extra
        )

        total = sample_index.shape[0] - 1
        if separate_final_epoch:
            shuffle_index = build_shuffle_index(
                num_samples_sans_final_epoch, total, numpy_random_state
            )
        else:
            shuffle_index = build_shuffle_index(total, total, numpy_random_state)
        return document_index, sample_index, shuffle_index

    def _get_num_epochs(self, tokens_per_epoch: int) -> int:
        if self.num_samples is None:
            return 1
        if tokens_per_epoch <= 0:
            raise ValueError(
                f"{self.dataset_path}: the {self.index_split.name} split has no tokens; "
                f"cannot draw {self.num_samples} samples (check --split and the data)"
            )
        requested = self.num_samples * self.config.sequence_length + self._extra
        return max(1, -(-requested // tokens_per_epoch))


class MockGPTLowLevelDataset:
    """100000 synthetic documents: ``1, 2, ..., len-1`` (mod vocab) then EOD, deterministic."""

    seed: int = 0
    size: int = 100000
    max_sequence_length: int = 4096

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        rng = np.random.default_rng(seed=self.seed)
        self.sequence_lengths = rng.integers(
            low=1, high=self.max_sequence_length, size=self.size, dtype=np.int32
        )

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> np.ndarray:
        length = int(self.sequence_lengths[idx])
        body = (np.arange(length - 1, dtype=np.int64) + 1) % int(self.tokenizer.vocab_size)
        return np.concatenate([body, np.array([self.tokenizer.eod], dtype=np.int64)])

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        if length is None:
            length = int(self.sequence_lengths[idx]) - offset
        return self[idx][offset : offset + length]


class MockGPTDataset(GPTDataset):
    """GPTDataset over MockGPTLowLevelDataset (``--mock-data``)."""

    def __init__(
        self,
        dataset: MockGPTLowLevelDataset,
        dataset_path: Optional[str],
        indices: np.ndarray,
        num_samples: Optional[int],
        index_split: Split,
        config: GPTDatasetConfig,
    ) -> None:
        if not config.mock:
            raise ValueError("MockGPTDataset requires config.mock = True")
        if num_samples is None:
            num_samples = len(indices)
        super().__init__(dataset, dataset_path, indices, num_samples, index_split, config)

    def __len__(self) -> int:
        return self.num_samples

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: MockGPTLowLevelDataset) -> int:
        return len(low_level_dataset)

    @staticmethod
    def build_low_level_dataset(
        dataset_path: Optional[str], config: GPTDatasetConfig
    ) -> MockGPTLowLevelDataset:
        return MockGPTLowLevelDataset(config.tokenizer)
