"""Flags of issue 15 part A, run in-process (one process): --verify-integrity (torch_dist and
torch), --log-progress, --log-memory-to-tensorboard, and the one-line errors of a resume with
another --train-iters and of a data flag that cannot be built.

The references are independent of our code: the checkpoint manifests are checked with
coreutils' ``sha256sum -c`` and with hashlib; progress.txt with a pattern written from
Megatron's format; the memory scalars against the process's own peak resident set size.
"""

import hashlib
import os
import re
import resource
import shutil
import subprocess
import sys

import pytest

from megatron.training import global_vars
from tests.functional_tests.runner import REPO, TINY_MODEL, read_tensorboard_scalars
from tests.harness.argv import TINY_RUN, megatron_argv

sys.path.insert(0, str(REPO))
import pretrain_gpt  # noqa: E402

MANIFEST = "integrity.sha256"


def _pretrain(argv, capsys):
    """(exit code, stdout, stderr) of an in-process run of pretrain_gpt.py."""
    global_vars.reset_globals()
    code = 0
    try:
        pretrain_gpt.pretrain(
            pretrain_gpt.train_valid_test_datasets_provider,
            pretrain_gpt.model_provider,
            pretrain_gpt.ModelType.encoder_or_decoder,
            pretrain_gpt.forward_step,
            args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
            argv=argv,
        )
    except SystemExit as exc:
        code = exc.code or 0
    captured = capsys.readouterr()
    global_vars.reset_globals()
    return code, captured.out, captured.err


def _manifest(directory):
    with open(os.path.join(directory, MANIFEST)) as f:
        return dict(reversed(line.rstrip("\n").split("  ", 1)) for line in f)


def _assert_manifest_is_true(directory):
    entries = _manifest(directory)
    on_disk = sorted(
        os.path.relpath(os.path.join(root, name), directory)
        for root, _, names in os.walk(directory)
        for name in names
        if name != MANIFEST
    )
    assert sorted(entries) == on_disk
    for name, digest in entries.items():
        with open(os.path.join(directory, name), "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == digest, name
    if shutil.which("sha256sum"):
        check = subprocess.run(
            ["sha256sum", "-c", MANIFEST],
            cwd=directory,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert check.returncode == 0, check.stdout + check.stderr
    return entries


PROGRESS_LINE = re.compile(
    r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\tJob ID: [^\t]*\t# GPUs: (?P<gpus>\d+)\t(?P<event>.*)$"
)
SAVED = re.compile(
    r"^Saved checkpoint\tIteration: (?P<iteration>\d+)\t"
    r"Job throughput: \d+\.\d TFLOP/s/GPU\tCumulative throughput: \d+\.\d TFLOP/s/GPU\t"
    r"Floating-point operations: (?P<flops>\d\.\d\de[+-]\d\d)\t"
    r"Tokens \(in billions\): (?P<tokens>\d+\.\d\d)$"
)


def _progress_events(save_dir):
    events = []
    with open(os.path.join(save_dir, "progress.txt")) as f:
        for line in f:
            match = PROGRESS_LINE.match(line.rstrip("\n"))
            assert match, line
            assert match["gpus"] == "1"
            events.append(match["event"])
    return events


def _corrupt(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.fixture(autouse=True)
def single_process(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


def test_torch_dist_integrity_progress_memory_and_resume(tmp_path, capsys):
    save, tb = str(tmp_path / "ckpt"), str(tmp_path / "tb")
    common = TINY_MODEL + ["--ckpt-format", "torch_dist", "--save", save, "--save-interval", "2"]
    code, out, err = _pretrain(
        common
        + ["--train-iters", "4", "--log-progress", "--verify-integrity"]
        + ["--tensorboard-dir", tb, "--log-memory-to-tensorboard"],
        capsys,
    )
    assert code == 0, err
    entries = _assert_manifest_is_true(os.path.join(save, "iter_0000004"))
    assert {"metadata.json", "common.pt", ".metadata"} <= set(entries)
    assert any(name.endswith(".distcp") for name in entries)

    # progress.txt: Megatron's lines; floating-point operations grow linearly with iterations.
    events = _progress_events(save)
    assert events[0] == "Starting job" and len(events) == 3
    saved = [SAVED.match(event) for event in events[1:]]
    assert all(saved) and [m["iteration"] for m in saved] == ["2", "4"]
    flops = [float(m["flops"]) for m in saved]
    assert flops[0] > 0 and abs(flops[1] / flops[0] - 2.0) < 0.02
    assert all(m["tokens"] == "0.00" for m in saved)  # 4 x 8 x 32 tokens

    # Memory scalars under Megatron's tags; on CPU the resident set size, said at start-up.
    # The kernel's resident-set counters are per-CPU approximations (batched by up to 64 pages
    # per CPU), so /proc/self/statm read during the run can exceed ru_maxrss read after it by a
    # few hundred KiB (seen: 0.05%): 1% of slack, far below any wrong unit or quantity.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 * 1.01
    for tag in ("mem-reserved-bytes", "mem-allocated-bytes", "mem-max-allocated-bytes"):
        values = read_tensorboard_scalars(tb, tag)
        assert sorted(values) == [1, 2, 3, 4], tag
        assert all(50e6 < value <= peak for value in values.values()), (tag, values, peak)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = EventAccumulator(tb).Reload().Tags()["scalars"]
    assert "mem-allocated-count" not in tags and "mem-allocated-bytes vs samples" not in tags
    assert "--log-memory-to-tensorboard on CPU: mem-reserved-bytes and mem-allocated-bytes" in out

    # Another --train-iters on resume: one line naming both scheduler flags, no traceback.
    code, out, err = _pretrain(common + ["--load", save, "--train-iters", "8"], capsys)
    assert code == 1 and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: OptimizerParamScheduler: "), err
    assert "--use-checkpoint-opt-param-scheduler" in err and "--override-opt-param-scheduler" in err

    # A verified resume appends to progress.txt.
    code, out, err = _pretrain(
        common
        + ["--load", save, "--train-iters", "6", "--override-opt-param-scheduler"]
        + ["--log-progress", "--verify-integrity"],
        capsys,
    )
    assert code == 0, err
    assert f"--verify-integrity: {os.path.join(save, 'iter_0000004')} matches" in out
    assert " iteration        5/       6 |" in out
    events = _progress_events(save)
    assert events[3] == "Starting job" and SAVED.match(events[4])["iteration"] == "6"

    # A changed file ends the load on its name.
    newest = os.path.join(save, "iter_0000006")
    shard = next(name for name in _manifest(newest) if name.endswith(".distcp"))
    _corrupt(os.path.join(newest, shard))
    code, out, err = _pretrain(
        common + ["--load", save, "--train-iters", "8", "--verify-integrity"], capsys
    )
    assert code == 1 and "Traceback" not in err
    assert err.strip() == (
        f"error: --verify-integrity: checkpoint {newest} does not match {MANIFEST}: "
        f"{shard} changed (its SHA-256 differs from the manifest)"
    )


def test_torch_format_integrity(tmp_path, capsys):
    save = str(tmp_path / "ckpt")
    common = TINY_MODEL + ["--save", save, "--save-interval", "2", "--verify-integrity"]
    code, _, err = _pretrain(common + ["--train-iters", "2", "--lr-warmup-iters", "1"], capsys)
    assert code == 0, err
    directory = os.path.join(save, "iter_0000002")
    entries = _assert_manifest_is_true(directory)
    assert list(entries) == ["mp_rank_00/model_optim_rng.pt"]
    _corrupt(os.path.join(directory, "mp_rank_00", "model_optim_rng.pt"))
    code, _, err = _pretrain(
        common + ["--load", save, "--train-iters", "2", "--lr-warmup-iters", "1"], capsys
    )
    assert code == 1
    assert "mp_rank_00/model_optim_rng.pt changed" in err and len(err.strip().splitlines()) == 1


def test_integrity_manifest_missing_file_and_missing_manifest(tmp_path):
    from megatron.training.checkpoint_integrity import (
        CheckpointIntegrityError,
        hash_checkpoint_files,
        verify_checkpoint,
        write_manifest,
    )

    directory = tmp_path / "iter_0000001"
    (directory / "sub").mkdir(parents=True)
    (directory / "a.bin").write_bytes(b"a" * 3000)
    (directory / "sub" / "b.bin").write_bytes(b"b")
    with pytest.raises(CheckpointIntegrityError, match=r"has no integrity\.sha256 \(it was saved"):
        verify_checkpoint(str(directory))
    write_manifest(str(directory), hash_checkpoint_files(str(directory)))
    verify_checkpoint(str(directory))
    os.remove(directory / "sub" / "b.bin")
    (directory / "c.bin").write_bytes(b"c")
    with pytest.raises(
        CheckpointIntegrityError, match=r"sub/b\.bin is missing; c\.bin is not in the manifest$"
    ):
        verify_checkpoint(str(directory))


def test_a_data_flag_that_cannot_be_built_is_one_error_line(tmp_path, capsys):
    missing = str(tmp_path / "no-such-args.txt")
    argv = megatron_argv(
        base=TINY_RUN, mock_data=None, data_args_path=missing, split="1,0,0", train_iters=4
    )
    code, _, err = _pretrain(argv, capsys)
    assert code == 1 and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"error: --data-args-path {missing}: No such file or directory")
    assert "[while building the datasets from the command-line flags, raised at megatron/" in err


def test_a_build_error_names_the_flags_of_its_message():
    import argparse

    from megatron.training.flag_errors import BuildFromFlagsError, building

    args = argparse.Namespace(hidden_size=10, num_attention_heads=3, seq_length=8)
    with pytest.raises(BuildFromFlagsError) as info:
        with building("model", args):
            raise ValueError("hidden_size (10) is not divisible by\nnum_attention_heads (3)")
    assert str(info.value).startswith(
        "hidden_size (10) is not divisible by num_attention_heads (3) "
        "(flags: --hidden-size, --num-attention-heads) [while building the model from the "
        "command-line flags, raised at tests/functional_tests/test_flag_features.py:"
    )
    with pytest.raises(BuildFromFlagsError, match=r"^AssertionError without a message \[while"):
        with building("datasets", args):
            raise AssertionError()  # a bare assert (pytest would rewrite one written here)
