"""megatron-core's default distributed-optimizer checkpoint layout, ``dp_reshardable``, read here.

megatron-core (0.16.1, ``tools/interop/mcore_gpt.py train``) trains at DP=2 with its distributed
optimizer and saves after iteration 2 in its default sharding type. Its checkpoint holds the
optimizer state as flat per-bucket tensors in its grad-buffer layout; this code base computes
that layout from the model's parameter names and shapes
(``megatron.core.dist_checkpointing.dp_reshardable``):

* the layout equals megatron-core's own buffers (every parameter's bucket, start and size, every
  bucket's padded and unpadded size), with several buckets (``--ddp-bucket-size``) and one;
* we load the checkpoint with the optimizer state at DP=1 and train iterations 3 and 4 on the
  same batches: the losses equal megatron-core's own (1e-5 relative); without the optimizer
  state iteration 4 differs (the negative control);
* a run whose buffers megatron-core would lay out otherwise (another bucket size) is refused
  in one line naming --no-load-optim / --finetune, and then loads with --no-load-optim;
* the other way: we train at DP=1 with the distributed optimizer and save after iteration 2
  (dp_reshardable, Megatron-LM's default); megatron-core loads it at DP=2 with its default and
  trains 3 and 4: its losses equal ours.

Run by ``make interop`` (needs $MCORE_PYTHON), not by ``make test``.
"""

import argparse
import json

import pytest
import torch

from megatron.core import dist_checkpointing as dc
from megatron.core.dist_checkpointing import dp_reshardable as dpr
from megatron.training import checkpointing, global_vars
from tests.interop.test_megatron_core_optimizer_interop import (
    LAST,
    RTOL,
    SAVED_AT,
    _close,
    _mcore_train,
    _Ours,
)

BUCKET_SIZE = 5000  # several buckets in the 2-layer test model (about 30k parameters)


def _ours_layout(ours, bucket_size):
    names = [n for n, _ in ours.model.named_parameters()]
    shapes = dict(ours.model.named_parameters())
    ordered = dpr.registration_order(names)
    buckets = dpr.buffer_layout([(n, shapes[n].numel()) for n in ordered], 2, bucket_size)
    return [
        {
            "numel": b.numel,
            "numel_unpadded": b.numel_unpadded,
            "params": [[s.name, s.start, s.numel] for s in b.params],
        }
        for b in buckets
    ]


@pytest.mark.parametrize("bucket_size", [BUCKET_SIZE, None], ids=["buckets", "one-bucket"])
def test_megatron_core_dp_reshardable_checkpoint_resumes_here_with_its_optimizer_state(
    tmp_path, bucket_size
):
    saved = tmp_path / "mcore"
    extra = ["--save-at", SAVED_AT, "--optimizer-sharding", "dp_reshardable"]
    if bucket_size is not None:
        extra += ["--ddp-bucket-size", bucket_size]
    theirs = _mcore_train(tmp_path / "mc.json", saved, *extra, processes=2)
    their_buffers = json.loads((tmp_path / "mc.json").read_text())["buffers"]

    ours = _Ours(tmp_path, True, load=saved, save=tmp_path / "unused", ddp_bucket_size=bucket_size)
    # Our pure layout function equals megatron-core's own buffers (at its DP=2).
    assert len(their_buffers) == 1
    assert their_buffers[0]["dtypes"] == ["torch.float32", "torch.float32"]
    assert _ours_layout(ours, bucket_size) == their_buffers[0]["buckets"]
    assert (len(their_buffers[0]["buckets"]) > 1) == (bucket_size is not None)

    assert ours.load() == SAVED_AT
    resumed = {it: ours.step(it) for it in range(SAVED_AT + 1, LAST + 1)}
    _close(resumed, theirs, "megatron-core dp_reshardable DP=2 -> here DP=1")

    fresh = _Ours(
        tmp_path,
        True,
        load=saved,
        save=tmp_path / "unused",
        ddp_bucket_size=bucket_size,
        no_load_optim=True,
    )
    assert fresh.load() == SAVED_AT
    without = {it: fresh.step(it) for it in range(SAVED_AT + 1, LAST + 1)}
    assert abs(without[LAST] - theirs[LAST]) > 100 * RTOL * abs(theirs[LAST]), (without, theirs)

    if bucket_size is not None:
        # Our run without buckets: megatron-core would lay its buffer out as one bucket, which
        # is not the checkpoint's layout. One line says what was not loaded and how to go on.
        other = _Ours(tmp_path, True, load=saved, save=tmp_path / "unused")
        with pytest.raises(
            checkpointing.CheckpointError,
            match=r"dp_reshardable layout, which cannot be placed in this run \(rank 0: its "
            r"buckets hold .*the optimizer state was not loaded: pass --no-load-optim or "
            r"--finetune to load the model only",
        ):
            other.load()
        global_vars.get_args().no_load_optim = True
        assert other.load() == SAVED_AT


def test_dp_reshardable_checkpoint_saved_here_resumes_in_megatron_core(tmp_path):
    ours = _Ours(
        tmp_path,
        True,
        load=tmp_path / "unused",
        save=tmp_path / "ours",
        ddp_bucket_size=BUCKET_SIZE,
    )
    for it in range(1, SAVED_AT + 1):
        ours.step(it)
    ours.save(SAVED_AT)
    straight = {it: ours.step(it) for it in range(SAVED_AT + 1, LAST + 1)}
    directory = str(tmp_path / "ours" / f"iter_{SAVED_AT:07d}")
    assert dc.load_common(directory, safe_globals=[argparse.Namespace])["content_metadata"][
        "distrib_optim_sharding_type"
    ] == ("dp_reshardable")
    keys = set(dc.tensor_shapes(dc.read_dcp_metadata(directory)))
    assert not any(k.startswith("optimizer.state.") for k in keys)
    # several buckets, as megatron-core lays them out
    assert dpr.bucket_key(0, 0, (torch.float32, torch.float32), 1, "exp_avg") in keys

    theirs = _mcore_train(
        tmp_path / "mc.json",
        tmp_path / "unused_mcore",
        "--load",
        tmp_path / "ours",
        "--optimizer-sharding",
        "dp_reshardable",
        "--ddp-bucket-size",
        BUCKET_SIZE,
        processes=2,
    )
    assert sorted(theirs) == list(range(SAVED_AT + 1, LAST + 1))  # resumed after iteration 2
    _close(theirs, straight, "here dp_reshardable DP=1 -> megatron-core DP=2")
