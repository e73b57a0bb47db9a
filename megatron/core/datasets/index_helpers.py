"""Index builders of GPTDataset and BlendedDataset (what upstream does in helpers.cpp).

Each function reproduces the upstream index exactly (same values, same dtypes), so sample
orders agree with Megatron-LM for the same data and seed. The GPT indices are vectorized numpy;
the blending index is a sequential greedy loop (see below).
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
import tempfile
from array import array
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

logger = logging.getLogger(__name__)

_INT32_MAX = np.iinfo(np.int32).max


def build_document_index(
    documents: np.ndarray,
    num_epochs: int,
    numpy_random_state: np.random.RandomState,
    separate_final_epoch: bool,
) -> np.ndarray:
    """The split's document ids repeated ``num_epochs`` times (int32), shuffled in place.

    With ``separate_final_epoch`` the first ``num_epochs - 1`` epochs are shuffled together and
    the final epoch separately, so a small final epoch is not mixed into the others.
    """
    if not separate_final_epoch or num_epochs == 1:
        index = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
        numpy_random_state.shuffle(index)
        return index
    first = build_document_index(documents, num_epochs - 1, numpy_random_state, False)
    last = build_document_index(documents, 1, numpy_random_state, False)
    return np.concatenate((first, last))


def sample_count(
    num_epochs: int,
    tokens_per_epoch: int,
    sequence_length: int,
    drop_last_partial_sequence: bool,
    add_extra_token: int,
) -> int:
    usable = num_epochs * tokens_per_epoch - add_extra_token
    if drop_last_partial_sequence:
        return usable // sequence_length
    return -(-usable // sequence_length)


def build_sample_index(
    sequence_lengths: np.ndarray,
    document_index: np.ndarray,
    sequence_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
    drop_last_partial_sequence: bool = True,
    add_extra_token: int = 1,
    chunk: int = 1 << 22,
) -> np.ndarray:
    """``[num_samples + 1, 2]`` of (position in document_index, token offset) sample boundaries.

    Sample ``i`` runs from boundary ``i`` to boundary ``i + 1`` plus ``add_extra_token`` tokens,
    so consecutive samples overlap by that many tokens (the last label of one sample is the
    first input of the next). Upstream walks the documents token budget by token budget; that
    walk puts boundary ``i`` at global token position ``i * sequence_length`` of the
    concatenated document index, namely in the first document whose end reaches
    ``i * sequence_length + add_extra_token``. Here that is one cumulative sum and one
    ``searchsorted``; when the final (partial) sample runs past the last document the boundary
    is pinned to that document's end minus the extra token, as upstream does.
    """
    num_samples = sample_count(
        num_epochs, tokens_per_epoch, sequence_length, drop_last_partial_sequence, add_extra_token
    )
    num_samples = max(num_samples, 0)
    num_docs = len(document_index)
    dtype = np.int64 if num_docs - 1 > _INT32_MAX else np.int32
    sample_index = np.zeros((num_samples + 1, 2), dtype=dtype)
    if num_samples == 0:
        return sample_index
    doc_lengths = np.asarray(sequence_lengths)[np.asarray(document_index)]
    doc_ends = np.cumsum(doc_lengths, dtype=np.int64)
    last = num_docs - 1
    for lo in range(1, num_samples + 1, chunk):
        hi = min(lo + chunk, num_samples + 1)
        targets = np.arange(lo, hi, dtype=np.int64) * sequence_length + add_extra_token
        position = np.searchsorted(doc_ends, targets, side="left")
        overflow = position > last
        position[overflow] = last
        doc_starts = doc_ends[position] - doc_lengths[position]
        offsets = targets - add_extra_token - doc_starts
        offsets[overflow] = int(doc_lengths[last]) - add_extra_token
        sample_index[lo:hi, 0] = position
        sample_index[lo:hi, 1] = offsets
    return sample_index


def build_shuffle_index(
    num_samples: int, total_size: int, numpy_random_state: np.random.RandomState
) -> np.ndarray:
    """``arange(total_size)`` with ``[0, num_samples)`` and ``[num_samples, total_size)``
    shuffled separately."""
    dtype = np.uint32
    if total_size >= (np.iinfo(np.uint32).max - 1):
        dtype = np.int64
    first = np.arange(0, num_samples, dtype=dtype)
    numpy_random_state.shuffle(first)
    if num_samples == total_size:
        return first
    rest = np.arange(num_samples, total_size, dtype=dtype)
    numpy_random_state.shuffle(rest)
    return np.concatenate((first, rest))


# --- blending ---------------------------------------------------------------------------------
#
# The greedy blend is inherently sequential (each choice changes the next errors), so it cannot
# be vectorized exactly. It runs as a tight Python loop, or, for large blends, as the same loop
# in C compiled on first use when a C compiler is present (an optional accelerator, like
# upstream's helpers.cpp; the Python loop is the fallback and the tested reference).

_C_SOURCE = r"""
#include <stdint.h>
void greedy_blend(const double *weights, const int64_t *budgets, int32_t num, int64_t size,
                  int16_t *chosen, int64_t *sample, int64_t *counts) {
    for (int64_t n = 0; n < size; ++n) {
        double nd = n > 1 ? (double)n : 1.0;
        int32_t best = -1;
        double best_error = 0.0;
        for (int32_t i = 0; i < num; ++i) {
            if (budgets && counts[i] >= budgets[i]) continue;
            double error = weights[i] * nd - (double)counts[i];
            if (best < 0 || error > best_error) { best = i; best_error = error; }
        }
        chosen[n] = (int16_t)best;
        sample[n] = counts[best];
        counts[best] += 1;
    }
}
"""
_C_THRESHOLD = 1 << 21  # samples x datasets above which compiling pays off
_c_library: List[Any] = []  # [] = not tried yet, [None] = unavailable, [lib] = loaded


def _load_c_blend() -> Optional[Any]:
    if _c_library:
        return _c_library[0]
    lib = None
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler:
        # A private directory (mode 0700) so no other user can plant the library we load.
        with tempfile.TemporaryDirectory(prefix="megatron_blend_") as directory:
            source = os.path.join(directory, "blend.c")
            target = os.path.join(directory, "blend.so")
            with open(source, "w") as stream:
                stream.write(_C_SOURCE)
            try:
                subprocess.run(
                    [
                        compiler,
                        "-O2",
                        "-shared",
                        "-fPIC",
                        "-ffp-contract=off",
                        "-o",
                        target,
                        source,
                    ],
                    check=True,
                    capture_output=True,
                    timeout=120,
                )
                lib = ctypes.CDLL(target)
                lib.greedy_blend.restype = None
                lib.greedy_blend.argtypes = [
                    ctypes.c_void_p,
                    ctypes.c_void_p,
                    ctypes.c_int32,
                    ctypes.c_int64,
                    ctypes.c_void_p,
                    ctypes.c_void_p,
                    ctypes.c_void_p,
                ]
            except (OSError, subprocess.SubprocessError) as err:
                logger.info(f"blending helper not compiled ({err}); using the Python loop")
                lib = None
    _c_library.append(lib)
    return lib


def _greedy_blend_c(
    lib: Any, weights: Sequence[float], budgets: Optional[Sequence[int]], size: int
):
    w = np.ascontiguousarray(weights, dtype=np.float64)
    b = None if budgets is None else np.ascontiguousarray(budgets, dtype=np.int64)
    chosen = np.zeros(size, dtype=np.int16)
    sample = np.zeros(size, dtype=np.int64)
    counts = np.zeros(len(w), dtype=np.int64)
    lib.greedy_blend(
        w.ctypes.data,
        None if b is None else b.ctypes.data,
        len(w),
        size,
        chosen.ctypes.data,
        sample.ctypes.data,
        counts.ctypes.data,
    )
    return chosen, sample


def _greedy_blend(
    weights: Sequence[float],
    budgets: Optional[Sequence[int]],
    size: int,
    accelerate: Optional[bool] = None,
) -> Tuple[np.ndarray, np.ndarray]:
    """Greedy error minimization: sample n goes to the dataset maximizing
    ``weight * max(n, 1) - count`` (ties to the lowest index). With ``budgets`` a dataset that
    has received its budget drops out (the exhaustive variant).

    ``accelerate`` None picks the C loop for large blends when it can be built; True / False
    force it (tests). Both give identical results (same IEEE double arithmetic, no FMA).
    """
    num = len(weights)
    if num == 1 and budgets is None:
        return np.zeros(size, dtype=np.int16), np.arange(size, dtype=np.int64)
    if accelerate is None:
        accelerate = size * num >= _C_THRESHOLD
    if accelerate:
        lib = _load_c_blend()
        if lib is not None:
            return _greedy_blend_c(lib, weights, budgets, size)
    w = [float(x) for x in weights]
    counts = [0] * num
    live = [i for i in range(num) if budgets is None or budgets[i] > 0]
    chosen = array("h", bytes(2 * size))
    sample = array("q", bytes(8 * size))
    for n in range(size):
        nd = float(n) if n > 1 else 1.0
        best = live[0]
        best_error = w[best] * nd - counts[best]
        for i in live:
            error = w[i] * nd - counts[i]
            if error > best_error:
                best_error = error
                best = i
        chosen[n] = best
        count = counts[best]
        sample[n] = count
        counts[best] = count + 1
        if budgets is not None and count + 1 == budgets[best]:
            live.remove(best)
    return np.frombuffer(chosen, dtype=np.int16).copy(), np.frombuffer(
        sample, dtype=np.int64
    ).copy()


def build_blending_indices(
    weights: Sequence[float], size: int, accelerate: Optional[bool] = None
) -> Tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16 [size], dataset_sample_index int64 [size]) for normalized weights."""
    if len(weights) > np.iinfo(np.int16).max:
        raise ValueError(f"cannot blend {len(weights)} datasets (at most {np.iinfo(np.int16).max})")
    return _greedy_blend(weights, None, int(size), accelerate)


def build_exhaustive_blending_indices(
    sizes: Sequence[int], accelerate: Optional[bool] = None
) -> Tuple[np.ndarray, np.ndarray]:
    """Blend every sample of every dataset exactly once, in proportion to the sizes."""
    sizes = [int(s) for s in sizes]
    if len(sizes) > np.iinfo(np.int16).max:
        raise ValueError(f"cannot blend {len(sizes)} datasets (at most {np.iinfo(np.int16).max})")
    total = sum(sizes)
    if total == 0:
        return np.zeros(0, dtype=np.int16), np.zeros(0, dtype=np.int64)
    weights = [s / float(total) for s in sizes]
    return _greedy_blend(weights, sizes, total, accelerate)
