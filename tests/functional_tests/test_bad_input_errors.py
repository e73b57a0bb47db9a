"""Mistakes a user makes with files and flags, each ending in one ``error:`` line that names the
file or flag, a non-zero exit of the whole job and no traceback (issue #16's list)."""

import numpy as np
import pytest

from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from tests.functional_tests.runner import TINY_MODEL, run_pretrain
from tests.harness.argv import TINY_RUN, megatron_argv


def _error_line(result):
    assert result.returncode != 0, result.stdout[-2000:]
    # torchrun reports a failed worker with a traceback of its own (ChildFailedError); a worker's
    # traceback would be any other.
    for chunk in result.stderr.split("Traceback (most recent call last):")[1:]:
        assert "ChildFailedError" in chunk, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert lines, result.stderr[-3000:]
    return lines[-1]


def _write_dataset(prefix, largest_id, documents=64, length=40):
    """Documents of ids below ``largest_id``, the last one holding ``largest_id`` itself."""
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for _ in range(documents):
        builder.add_document(rng.integers(0, 400, length).astype(np.uint16), [length])
    builder.add_document(np.full(length, largest_id, dtype=np.uint16), [length])
    builder.finalize(f"{prefix}.idx")


def _on_real_data(prefix):
    """A short run on the documents at ``prefix`` with the NullTokenizer's 500 ids."""
    return megatron_argv(
        base=TINY_RUN,
        mock_data=None,
        vocab_size=500,
        data_path=prefix,
        split="100,0,0",
        train_iters=12,
    )


@pytest.mark.parametrize("nproc, layout", [(None, []), (2, ["--tensor-model-parallel-size", "2"])])
def test_data_tokenized_with_a_larger_vocabulary(tmp_path, nproc, layout):
    # Checked before training: unchecked, one process fails with an IndexError 21 frames deep
    # and TP=2 trains silently on the masked ids.
    prefix = tmp_path / "big_vocab_text_document"
    _write_dataset(prefix, largest_id=5000)
    result = run_pretrain(_on_real_data(prefix) + layout, nproc=nproc, timeout=120)
    line = _error_line(result)
    assert f"token id 5000 in the data ({prefix})" in line, line
    assert "--tokenizer-type NullTokenizer (ids 0..500)" in line, line


def test_unwritable_save_directory_is_found_before_training(tmp_path):
    # Checked before training, or it would be found at the first save, after the compute was
    # spent. (Tests run as root here, so a chmod would not stop a write: a path under a regular
    # file cannot be created.)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    save = blocker / "ckpt"
    args = TINY_MODEL + ["--train-iters", "4", "--save", str(save), "--save-interval", "4"]
    result = run_pretrain(args, timeout=120)
    line = _error_line(result)
    assert line == f"error: --save {save} is not writable: Not a directory", line
    assert " iteration " not in result.stdout, result.stdout[-2000:]
