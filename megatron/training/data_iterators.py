"""The train / validation / test data iterators: dataset sizes from the flags, datasets built
once, samplers resumed from the consumed-sample counts, one iterator per virtual stage."""

from __future__ import annotations

from typing import Callable, Optional

from . import global_vars
from .data_samplers import build_pretraining_data_loader
from .run import Run
from .utils import print_rank_0


def get_train_valid_test_num_samples(*, args=None):
    """Samples the train, validation and test datasets must hold (Megatron's targets).
    ``args``: the run's flags (default the current run's)."""
    args = args if args is not None else global_vars.get_args()
    train_samples = (
        args.train_samples if args.train_samples else args.train_iters * args.global_batch_size
    )
    eval_iters = args.eval_iters
    eval_gbs = getattr(args, "eval_global_batch_size", None) or args.global_batch_size
    if getattr(args, "full_validation", False):
        valid = None
    elif args.eval_interval:
        valid = (args.train_iters // args.eval_interval + 1) * eval_iters * eval_gbs
    else:
        valid = eval_iters * eval_gbs
    test = eval_iters * eval_gbs
    return train_samples, valid, test


def build_train_valid_test_data_iterators(provider: Callable, *, run: Optional[Run] = None):
    """Datasets (once), samplers from the consumed-sample counts of ``run.state`` (default the
    current run), loaders, iterators; ``run.state`` learns whether to train, validate, test."""
    run = run or global_vars.get_run()
    args, state, progress = run.args, run.parallel_state, run.state
    # A checkpoint without sample counts: those of a constant batch size.
    if progress.iteration > 0 and progress.consumed_train_samples == 0:
        progress.consumed_train_samples = progress.iteration * args.global_batch_size
    if progress.iteration > 0 and progress.consumed_valid_samples == 0 and args.eval_interval:
        progress.consumed_valid_samples = (
            (progress.iteration // args.eval_interval) * args.eval_iters * args.global_batch_size
        )
    train_n, valid_n, test_n = get_train_valid_test_num_samples(args=args)
    print_rank_0(" > datasets target sizes (minimum size):")
    print_rank_0("    train:      {}".format(train_n))
    print_rank_0("    validation: {}".format(valid_n))
    print_rank_0("    test:       {}".format(test_n))
    train_ds, valid_ds, test_ds = provider([train_n, valid_n, test_n])
    dp_rank = state.get_data_parallel_rank()
    dp_size = state.get_data_parallel_world_size()
    train_loader = build_pretraining_data_loader(
        train_ds, progress.consumed_train_samples, args, dp_rank, dp_size
    )
    valid_loader = (
        build_pretraining_data_loader(
            valid_ds, progress.consumed_valid_samples, args, dp_rank, dp_size
        )
        if valid_ds is not None and len(valid_ds) > progress.consumed_valid_samples
        else None
    )
    test_loader = (
        build_pretraining_data_loader(test_ds, 0, args, dp_rank, dp_size)
        if test_ds is not None
        else None
    )
    progress.do_train = train_loader is not None and args.train_iters > 0
    progress.do_valid = valid_loader is not None and args.eval_iters > 0
    progress.do_test = test_loader is not None and args.eval_iters > 0

    def as_iter(loader):
        if loader is None:
            return None
        return iter(loader) if args.dataloader_type == "single" else _cyclic(loader)

    num_chunks = args.virtual_pipeline_model_parallel_size or 1
    if num_chunks == 1:
        return as_iter(train_loader), as_iter(valid_loader), as_iter(test_loader)

    # Interleaved schedule: every model chunk walks its own iterator over the same samples.
    def per_chunk(dataset, consumed):
        if dataset is None or len(dataset) <= consumed:
            return None
        return [
            as_iter(build_pretraining_data_loader(dataset, consumed, args, dp_rank, dp_size))
            for _ in range(num_chunks)
        ]

    return (
        per_chunk(train_ds, progress.consumed_train_samples),
        per_chunk(valid_ds, progress.consumed_valid_samples),
        per_chunk(test_ds, 0),
    )


def _cyclic(loader):
    while True:
        for batch in loader:
            yield batch
