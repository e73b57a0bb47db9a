"""Reader and writer of Megatron's memory-mapped ``.bin``/``.idx`` token datasets.

On-disk layout (little-endian, as Megatron writes it)::

    <prefix>.idx  b"MMIDIDX\\x00\\x00"     9-byte magic
                  u64 version = 1
                  u8  dtype code (see DType)
                  u64 sequence_count
                  u64 document_count          (= documents + 1)
                  int32[sequence_count]       sequence_lengths (in tokens)
                  int64[sequence_count]       sequence_pointers (byte offsets into .bin)
                  int64[document_count]       document_indices (sequence boundaries,
                                              0 ... sequence_count)
                  int8[sequence_count]        sequence_modes (multimodal only)
    <prefix>.bin  all sequences concatenated in the token dtype, no header

Files written here load in Megatron-LM and files written by Megatron-LM load here.
"""

from __future__ import annotations

import enum
import os
import shutil
import struct
from array import array
from typing import Optional, Sequence, Type, Union

import numpy as np

_INDEX_MAGIC = b"MMIDIDX\x00\x00"
_LEGACY_MAGIC = b"TNTIDX\x00\x00"
_INDEX_VERSION = 1
# magic (9) + version (8) + dtype code (1) + sequence count (8) + document count (8)
_HEADER = struct.Struct("<9sQBQQ")
assert array("i").itemsize == 4 and array("q").itemsize == 8
HEADER_SIZE = _HEADER.size  # 34

__all__ = [
    "DType",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "IndexedDatasetError",
    "get_bin_path",
    "get_idx_path",
]


class IndexedDatasetError(ValueError):
    """A ``.bin``/``.idx`` pair is missing, corrupt or inconsistent."""


class DType(enum.IntEnum):
    """Token dtype codes stored in byte 17 of the ``.idx`` header."""

    uint8 = 1
    int8 = 2
    int16 = 3
    int32 = 4
    int64 = 5
    float64 = 6
    float32 = 7
    uint16 = 8

    @classmethod
    def code_from_dtype(cls, value: Union[Type[np.number], np.dtype]) -> int:
        """The header code of a numpy dtype (ValueError if the format cannot store it)."""
        name = np.dtype(value).name
        if name not in cls.__members__:
            raise ValueError(
                f"dtype {name} cannot be stored in an indexed dataset; "
                f"supported: {', '.join(cls.__members__)}"
            )
        return int(cls[name])

    @classmethod
    def dtype_from_code(cls, value: int) -> Type[np.number]:
        """The numpy scalar type of a header code (ValueError on an unknown code)."""
        try:
            return getattr(np, cls(value).name)
        except ValueError:
            raise ValueError(f"unknown dtype code {value}") from None

    @staticmethod
    def size(key: Union[int, Type[np.number], np.dtype]) -> int:
        """Bytes per element of a code or a numpy dtype."""
        if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
            return np.dtype(DType.dtype_from_code(int(key))).itemsize
        return np.dtype(key).itemsize

    @staticmethod
    def optimal_dtype(cardinality: Optional[int]) -> Type[np.number]:
        """uint16 when every token id fits with room to spare (vocab < 65500), else int32."""
        if cardinality is not None and cardinality < 65500:
            return np.uint16
        return np.int32


def optimal_dtype(vocab_size: Optional[int]) -> Type[np.number]:
    """Token dtype Megatron uses for a vocabulary of ``vocab_size`` ids."""
    return DType.optimal_dtype(vocab_size)


def get_idx_path(path_prefix: str) -> str:
    return path_prefix + ".idx"


def get_bin_path(path_prefix: str) -> str:
    return path_prefix + ".bin"


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


class _Index:
    """The parsed, validated ``.idx`` file; arrays are views into one memmap."""

    def __init__(self, idx_path: str, multimodal: bool) -> None:
        self.path = idx_path
        try:
            file_size = os.path.getsize(idx_path)
        except OSError as err:
            raise FileNotFoundError(
                f"{idx_path}: cannot open index file ({err.strerror})"
            ) from None
        with open(idx_path, "rb") as stream:
            header = stream.read(HEADER_SIZE)
        if header[: len(_LEGACY_MAGIC)] == _LEGACY_MAGIC:
            raise IndexedDatasetError(
                f"{idx_path}: legacy lazy/cached indexed dataset (magic TNTIDX); only the mmap "
                f"format (magic MMIDIDX) is supported, re-run tools/preprocess_data.py"
            )
        if len(header) < len(_INDEX_MAGIC) or header[: len(_INDEX_MAGIC)] != _INDEX_MAGIC:
            raise IndexedDatasetError(
                f"{idx_path}: not an indexed dataset index (bad magic {header[:9]!r}, "
                f"expected {_INDEX_MAGIC!r})"
            )
        if len(header) < HEADER_SIZE:
            raise IndexedDatasetError(
                f"{idx_path}: truncated index: {file_size} bytes, "
                f"the header alone needs {HEADER_SIZE}"
            )
        _, version, code, sequence_count, document_count = _HEADER.unpack(header)
        if version != _INDEX_VERSION:
            raise IndexedDatasetError(
                f"{idx_path}: unsupported index version {version} (expected {_INDEX_VERSION})"
            )
        try:
            self.dtype = DType.dtype_from_code(code)
        except ValueError:
            raise IndexedDatasetError(
                f"{idx_path}: unknown dtype code {code} (known: "
                + ", ".join(f"{int(c)}={c.name}" for c in DType)
                + ")"
            ) from None
        self.dtype_size = np.dtype(self.dtype).itemsize
        self.sequence_count = sequence_count
        self.document_count = document_count

        expected = HEADER_SIZE + sequence_count * (4 + 8) + document_count * 8
        if multimodal:
            expected += sequence_count
        if file_size < expected:
            raise IndexedDatasetError(
                f"{idx_path}: truncated index: {file_size} bytes but the header "
                f"({sequence_count} sequences, {document_count} document indices"
                f"{', multimodal' if multimodal else ''}) implies {expected}"
            )
        if file_size > expected:
            hint = ""
            if not multimodal and file_size == expected + sequence_count:
                hint = " (it looks multimodal: open it with multimodal=True)"
            raise IndexedDatasetError(
                f"{idx_path}: index has {file_size - expected} unexpected trailing bytes "
                f"({file_size} bytes, header implies {expected}){hint}"
            )
        if document_count < 1:
            raise IndexedDatasetError(f"{idx_path}: document count is 0 (must be at least 1)")

        if file_size > HEADER_SIZE:
            buffer = np.memmap(idx_path, mode="r", dtype=np.uint8)
        else:  # mmap of an empty range is not allowed
            buffer = np.zeros(HEADER_SIZE, dtype=np.uint8)
        offset = HEADER_SIZE
        self.sequence_lengths = np.frombuffer(buffer, np.int32, sequence_count, offset)
        offset += self.sequence_lengths.nbytes
        self.sequence_pointers = np.frombuffer(buffer, np.int64, sequence_count, offset)
        offset += self.sequence_pointers.nbytes
        self.document_indices = np.frombuffer(buffer, np.int64, document_count, offset)
        offset += self.document_indices.nbytes
        self.sequence_modes = None
        if multimodal:
            self.sequence_modes = np.frombuffer(buffer, np.int8, sequence_count, offset)

        if self.document_indices[0] != 0 or self.document_indices[-1] != sequence_count:
            raise IndexedDatasetError(
                f"{idx_path}: inconsistent index: document_indices must run from 0 to the "
                f"sequence count {sequence_count}, found {int(self.document_indices[0])} ... "
                f"{int(self.document_indices[-1])}"
            )
        if sequence_count and self.sequence_pointers[0] != 0:
            raise IndexedDatasetError(
                f"{idx_path}: inconsistent index: first sequence pointer is "
                f"{int(self.sequence_pointers[0])}, expected 0"
            )

    def bin_nbytes(self) -> int:
        """Size the ``.bin`` must have according to this index."""
        if self.sequence_count == 0:
            return 0
        return int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype_size


class IndexedDataset:
    """Random access to the sequences of a ``<prefix>.bin``/``<prefix>.idx`` pair.

    ``dataset[i]`` is sequence i as a numpy array (a read-only view when the ``.bin`` is
    memory-mapped); with ``multimodal`` it is ``(array, mode)``. ``dataset[a:b]`` is a list.
    """

    def __init__(self, path_prefix: str, multimodal: bool = False, mmap: bool = True) -> None:
        self.path_prefix = path_prefix
        self.multimodal = multimodal
        self.mmap = mmap
        self._open()

    def _open(self) -> None:
        idx_path = get_idx_path(self.path_prefix)
        bin_path = get_bin_path(self.path_prefix)
        if not os.path.isfile(idx_path) or not os.path.isfile(bin_path):
            missing = [p for p in (idx_path, bin_path) if not os.path.isfile(p)]
            raise FileNotFoundError(
                f"indexed dataset {self.path_prefix!r}: missing {' and '.join(missing)}"
            )
        self.index = _Index(idx_path, self.multimodal)
        expected = self.index.bin_nbytes()
        actual = os.path.getsize(bin_path)
        if actual != expected:
            raise IndexedDatasetError(
                f"{bin_path}: data file has {actual} bytes but {idx_path} describes "
                f"{expected} bytes (last pointer + last length x {self.index.dtype_size}); "
                f"the pair is truncated or mismatched"
            )
        self._bin_path = bin_path
        self._bin_buffer = None
        if self.mmap and expected > 0:
            self._bin_buffer = np.memmap(bin_path, mode="r", dtype=np.uint8)

    # Pickling (DataLoader workers) reopens the files rather than copying the arrays.
    def __getstate__(self):
        return (self.path_prefix, self.multimodal, self.mmap)

    def __setstate__(self, state) -> None:
        self.path_prefix, self.multimodal, self.mmap = state
        self._open()

    def __len__(self) -> int:
        return self.index.sequence_count

    def _read(self, pointer: int, count: int) -> np.ndarray:
        dtype = self.index.dtype
        if count <= 0:
            return np.empty(0, dtype=dtype)
        if self._bin_buffer is not None:
            return np.frombuffer(self._bin_buffer, dtype, count, pointer)
        out = np.empty(count, dtype=dtype)
        with open(self._bin_path, "rb", buffering=0) as stream:
            stream.seek(pointer)
            got = stream.readinto(memoryview(out).cast("B"))
        if got != out.nbytes:
            raise IndexedDatasetError(f"{self._bin_path}: short read at byte {pointer}")
        return out

    def __getitem__(self, idx: Union[int, np.integer, slice]):
        index = self.index
        if isinstance(idx, (int, np.integer)):
            i = int(idx)
            if i < 0:
                i += index.sequence_count
            if not 0 <= i < index.sequence_count:
                raise IndexError(
                    f"sequence {idx} out of range for {index.sequence_count} sequences"
                )
            data = self._read(int(index.sequence_pointers[i]), int(index.sequence_lengths[i]))
            if self.multimodal:
                return data, index.sequence_modes[i]
            return data
        if isinstance(idx, slice):
            start, stop, step = idx.indices(index.sequence_count)
            if step != 1:
                raise ValueError(f"slices into an IndexedDataset must be contiguous (step {step})")
            if stop <= start:
                return []
            lengths = index.sequence_lengths[start:stop]
            total = int(lengths.sum(dtype=np.int64))
            flat = self._read(int(index.sequence_pointers[start]), total)
            splits = np.cumsum(lengths, dtype=np.int64)[:-1]
            parts = np.split(flat, splits)
            if self.multimodal:
                return parts, index.sequence_modes[start:stop]
            return parts
        raise TypeError(f"cannot index an IndexedDataset with {type(idx).__name__}")

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` (to its end if length is
        None)."""
        index = self.index
        i = int(idx)
        if not 0 <= i < index.sequence_count:
            raise IndexError(f"sequence {idx} out of range for {index.sequence_count} sequences")
        seq_len = int(index.sequence_lengths[i])
        offset = int(offset)
        if length is None:
            length = seq_len - offset
        length = int(length)
        if offset < 0 or length < 0 or offset + length > seq_len:
            raise IndexError(
                f"get({i}, offset={offset}, length={length}) outside sequence of length {seq_len}"
            )
        pointer = int(index.sequence_pointers[i]) + offset * index.dtype_size
        data = self._read(pointer, length)
        if self.multimodal:
            return data, index.sequence_modes[i]
        return data

    @property
    def dtype(self) -> Type[np.number]:
        return self.index.dtype

    @property
    def sequence_lengths(self) -> np.ndarray:
        return self.index.sequence_lengths

    @property
    def sequence_pointers(self) -> np.ndarray:
        return self.index.sequence_pointers

    @property
    def document_indices(self) -> np.ndarray:
        return self.index.document_indices

    @property
    def sequence_modes(self) -> Optional[np.ndarray]:
        return self.index.sequence_modes

    def get_document_indices(self) -> np.ndarray:
        return self.index.document_indices

    @staticmethod
    def exists(path_prefix: str) -> bool:
        """True when both ``<prefix>.idx`` and ``<prefix>.bin`` are present."""
        return os.path.isfile(get_idx_path(path_prefix)) and os.path.isfile(
            get_bin_path(path_prefix)
        )


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


def write_index(
    idx_path: str,
    dtype: Type[np.number],
    sequence_lengths: Union[np.ndarray, Sequence[int]],
    document_indices: Union[np.ndarray, Sequence[int]],
    sequence_modes: Optional[Union[np.ndarray, Sequence[int]]] = None,
) -> None:
    """Write an ``.idx`` file atomically (temporary name in the same directory, then rename)."""
    lengths = np.asarray(sequence_lengths, dtype=np.int32)
    documents = np.asarray(document_indices, dtype=np.int64)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
    pointers *= np.dtype(dtype).itemsize
    header = _HEADER.pack(
        _INDEX_MAGIC, _INDEX_VERSION, DType.code_from_dtype(dtype), len(lengths), len(documents)
    )
    tmp_path = f"{idx_path}.tmp{os.getpid()}"
    try:
        with open(tmp_path, "wb") as stream:
            stream.write(header)
            stream.write(lengths.tobytes(order="C"))
            stream.write(pointers.tobytes(order="C"))
            stream.write(documents.tobytes(order="C"))
            if sequence_modes is not None:
                stream.write(np.asarray(sequence_modes, dtype=np.int8).tobytes(order="C"))
        os.replace(tmp_path, idx_path)
    except BaseException:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)
        raise


def _as_numpy(tensor) -> np.ndarray:
    if hasattr(tensor, "detach") and hasattr(tensor, "cpu"):  # torch.Tensor without importing torch
        return tensor.detach().cpu().numpy()
    return np.asarray(tensor)


class IndexedDatasetBuilder:
    """Stream sequences into ``bin_path``; ``finalize(idx_path)`` writes the index.

    The ``.bin`` is written as items arrive (memory holds only the per-sequence lengths). The
    ``.idx`` is written last and atomically, so a run that dies part-way leaves at most a
    ``.bin`` without an ``.idx``, which no reader accepts as a dataset. Use ``abort()`` (or the
    builder as a context manager) to delete the partial ``.bin`` on failure.
    """

    def __init__(
        self, bin_path: str, dtype: Type[np.number] = np.int32, multimodal: bool = False
    ) -> None:
        DType.code_from_dtype(dtype)  # reject unsupported dtypes before creating a file
        self.bin_path = bin_path
        self.dtype = np.dtype(dtype).type
        self.multimodal = multimodal
        self._info = np.iinfo(self.dtype) if np.issubdtype(self.dtype, np.integer) else None
        self.data_file = open(bin_path, "wb")
        self.sequence_lengths = array("i")  # C int is 32-bit on every supported platform
        self.document_indices = array("q", [0])
        self.sequence_modes: Optional[array] = array("b") if multimodal else None
        self._finalized = False
        self._complete = False

    def __enter__(self) -> "IndexedDatasetBuilder":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()

    def _check_open(self) -> None:
        if self._finalized:
            raise RuntimeError(f"{self.bin_path}: builder already finalized or aborted")

    def _to_array(self, tensor) -> np.ndarray:
        data = _as_numpy(tensor)
        if data.dtype != self.dtype:
            if self._info is not None and data.size and np.issubdtype(data.dtype, np.integer):
                lo, hi = int(data.min()), int(data.max())
                if lo < self._info.min or hi > self._info.max:
                    raise ValueError(
                        f"{self.bin_path}: token ids in [{lo}, {hi}] do not fit the dataset "
                        f"dtype {np.dtype(self.dtype).name}"
                    )
            data = data.astype(self.dtype)
        return np.ascontiguousarray(data).reshape(-1)

    def add_item(self, tensor, mode: int = 0) -> None:
        """Append one sequence (a sentence, or a whole document)."""
        self._check_open()
        data = self._to_array(tensor)
        self.data_file.write(memoryview(data))
        self.sequence_lengths.append(data.size)
        if self.multimodal:
            self.sequence_modes.append(mode)

    def add_document(
        self, tensor, lengths: Sequence[int], modes: Optional[Sequence[int]] = None
    ) -> None:
        """Append a document made of ``len(lengths)`` consecutive sequences of ``tensor``.

        Empty ``lengths`` just closes a document (how Megatron records an empty one).
        """
        self._check_open()
        data = self._to_array(tensor)
        lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        if int(lengths.sum()) != data.size or (lengths.size and lengths.min() < 0):
            raise ValueError(
                f"{self.bin_path}: add_document lengths {lengths.tolist()[:8]}... sum to "
                f"{int(lengths.sum())} but the document has {data.size} tokens"
            )
        self.data_file.write(memoryview(data))
        self.sequence_lengths.frombytes(lengths.astype(np.int32).tobytes())
        if self.multimodal:
            if modes is None:
                modes = np.zeros(lengths.size, dtype=np.int8)
            self.sequence_modes.frombytes(np.asarray(modes, dtype=np.int8).tobytes())
        self.document_indices.append(len(self.sequence_lengths))

    def add_documents(
        self, tensor, lengths: Sequence[int], sequences_per_document: Sequence[int]
    ) -> None:
        """Append many documents at once (one write): ``tensor`` holds their sequences back to back,
        ``lengths`` one entry per sequence, ``sequences_per_document`` one per document (0 = empty).

        The same files as ``add_document`` called per document, without its per-call cost.
        """
        self._check_open()
        if self.multimodal:
            raise ValueError(
                f"{self.bin_path}: add_documents does not take sequence modes; use add_document"
            )
        data = self._to_array(tensor)
        lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        counts = np.asarray(sequences_per_document, dtype=np.int64).reshape(-1)
        if (lengths.size and lengths.min() < 0) or (counts.size and counts.min() < 0):
            raise ValueError(
                f"{self.bin_path}: add_documents got a negative sequence length or count"
            )
        if int(lengths.sum()) != data.size or int(counts.sum()) != lengths.size:
            raise ValueError(
                f"{self.bin_path}: add_documents: {lengths.size} sequence lengths summing to "
                f"{int(lengths.sum())} for {data.size} tokens, {int(counts.sum())} sequences in "
                f"{counts.size} documents; they must agree"
            )
        self.data_file.write(memoryview(data))
        ends = np.cumsum(counts) + len(self.sequence_lengths)
        self.sequence_lengths.frombytes(lengths.astype(np.int32).tobytes())
        self.document_indices.frombytes(ends.astype(np.int64).tobytes())

    def end_document(self) -> None:
        """Close the current document (after one or more add_item calls)."""
        self._check_open()
        self.document_indices.append(len(self.sequence_lengths))

    def add_index(self, path_prefix: str) -> None:
        """Append every document of the dataset at ``path_prefix`` (same dtype required)."""
        self._check_open()
        index = _Index(get_idx_path(path_prefix), self.multimodal)
        if index.dtype != self.dtype:
            raise ValueError(
                f"cannot merge {get_idx_path(path_prefix)} (dtype {np.dtype(index.dtype).name}) "
                f"into {self.bin_path} (dtype {np.dtype(self.dtype).name}): dtypes must match"
            )
        bin_path = get_bin_path(path_prefix)
        expected = index.bin_nbytes()
        actual = os.path.getsize(bin_path) if os.path.isfile(bin_path) else -1
        if actual != expected:
            raise IndexedDatasetError(
                f"{bin_path}: data file has {actual} bytes but {get_idx_path(path_prefix)} "
                f"describes {expected} bytes"
            )
        offset = len(self.sequence_lengths)
        self.sequence_lengths.frombytes(np.ascontiguousarray(index.sequence_lengths).tobytes())
        if self.multimodal:
            self.sequence_modes.frombytes(np.ascontiguousarray(index.sequence_modes).tobytes())
        shifted = np.asarray(index.document_indices[1:], dtype=np.int64) + offset
        self.document_indices.frombytes(shifted.tobytes())
        with open(bin_path, "rb") as source:
            shutil.copyfileobj(source, self.data_file, length=16 << 20)

    def finalize(self, idx_path: str) -> None:
        """Flush and close the ``.bin``, check its size, then write ``idx_path`` atomically."""
        self._check_open()
        self.data_file.flush()
        os.fsync(self.data_file.fileno())
        self.data_file.close()
        self._finalized = True
        lengths = (
            np.frombuffer(self.sequence_lengths, dtype=np.int32)
            if self.sequence_lengths
            else np.zeros(0, np.int32)
        )
        written = os.path.getsize(self.bin_path)
        expected = int(lengths.sum(dtype=np.int64)) * np.dtype(self.dtype).itemsize
        if written != expected:
            raise IndexedDatasetError(
                f"{self.bin_path}: wrote {written} bytes but the sequences add up to {expected}"
            )
        documents = np.frombuffer(self.document_indices, dtype=np.int64)
        modes = None
        if self.multimodal:
            modes = (
                np.frombuffer(self.sequence_modes, dtype=np.int8)
                if self.sequence_modes
                else np.zeros(0, np.int8)
            )
        write_index(idx_path, self.dtype, lengths, documents, modes)
        self._complete = True

    def abort(self) -> None:
        """Close and delete the partial ``.bin`` (nothing that looks like a dataset remains)."""
        if not self.data_file.closed:
            self.data_file.close()
        self._finalized = True
        if not self._complete and os.path.exists(self.bin_path):
            os.remove(self.bin_path)
