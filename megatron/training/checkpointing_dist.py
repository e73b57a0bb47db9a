"""Checkpoints in Megatron's ``torch_dist`` format: the training side.

Layout: ``<save>/iter_0000100/`` with DCP's ``.metadata`` and ``__<rank>_<n>.distcp`` (model
and optimizer tensors under global names, readable at any TP/PP/DP/CP layout, with or without
virtual stages or the distributed optimizer; the layers stacked and named as Megatron-LM writes
them, see megatron.core.dist_checkpointing.megatron_layout; checkpoints written here with one key
per layer still load), ``common.pt`` (args, iteration, scheduler,
optimizer hyperparameters and grad scaler; read with ``weights_only=True``) and ``metadata.json``.
The RNG state and the rerun state machine's per-rank state are objects in the DCP files, as
Megatron-LM writes them (see :mod:`.checkpoint_rng_state`).

Crash safety: every rank writes into ``iter_XXXXXXX.tmp``; once all have finished, rank 0 writes
metadata.json there, renames the directory to ``iter_XXXXXXX`` and only then moves the tracker.
A save interrupted at any point leaves the previous checkpoint (and the tracker pointing at it)
intact; a directory without metadata.json is never loaded.

``--async-save``: the tensors are copied to CPU and written by a background thread on a
dedicated gloo group; the save is committed (metadata.json, rename, tracker) by
:func:`maybe_finalize_async_save`, which the training loop calls every iteration (it commits
once every rank's writer is done), before the next save and at exit.
"""

from __future__ import annotations

import argparse
import os
import shutil
from typing import Dict, Optional

import torch
import torch.distributed as dist

from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.layout import (
    CHECKPOINT_VERSION,
    checkpoint_dir,
    commit_tracker,
    remove_partial,
    remove_unretained,
    why_write_failed,
)
from megatron.checkpointing.saved_args import check_model_args, checkpoint_args
from megatron.core import dist_checkpointing as dc
from megatron.core.device import collective_device
from megatron.core.dist_checkpointing import dp_reshardable as dpr
from megatron.core.dist_checkpointing.async_save import AsyncSave
from megatron.core.dist_checkpointing.megatron_layout import is_per_layer_layout
from megatron.core.dist_checkpointing.optimizer_state import (
    FULLY_RESHARDABLE,
    MAIN_PARAM,
    STATE_PREFIX,
    distributed_state_by_param,
    is_distributed,
    load_optimizer_common_state,
    state_key,
    state_names,
)
from megatron.core.distributed.torch_fully_sharded_data_parallel import (
    TorchFullyShardedDataParallel,
)
from megatron.core.utils import unwrap_model

from . import checkpoint_rng_state, global_vars
from .checkpoint_integrity import integrity_digests, seal
from .checkpointing_common import barrier, print_saved_checkpoint, set_rng_state
from .run import Run
from .utils import get_rank, get_world_size, print_rank_0

TMP_SUFFIX = ".tmp"


class AsyncSaver:
    """A run's --async-save: the save being written in the background (at most one; ``pending``
    holds its request, iteration, directory and flags until the commit) and the process group
    its writer thread uses (``run.async_saver``, made at the run's first asynchronous save)."""

    def __init__(self):
        self.pending: Optional[dict] = None
        self.group = None
        self.world = None

    def group_for_writes(self):
        # The writer thread's collectives must not interleave with the training thread's on the
        # same group, so async saves get their own gloo group (created once, by every rank).
        if not dist.is_initialized():
            return None
        if self.group is None or self.world is not dist.group.WORLD:
            self.group = dist.new_group(backend="gloo")
            self.world = dist.group.WORLD  # a new torch.distributed world needs a new group
        return self.group


def _async_saver(run: Run) -> AsyncSaver:
    if run.async_saver is None:
        run.async_saver = AsyncSaver()
    return run.async_saver


# ---------------------------------------------------------------------------------- helpers
def _layout(state, num_chunks: int) -> dict:
    return {
        "tensor_model_parallel_size": state.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": state.get_pipeline_model_parallel_world_size(),
        "virtual_pipeline_model_parallel_size": num_chunks if num_chunks > 1 else None,
        "context_parallel_size": state.get_context_parallel_world_size(),
        "data_parallel_size": state.get_data_parallel_world_size(),
    }


def _coordinates(state) -> tuple:
    return (
        state.get_pipeline_model_parallel_rank(),
        state.get_tensor_model_parallel_rank(),
        state.get_data_parallel_rank(),
        state.get_context_parallel_rank(),
    )


def _all_gather_object(obj) -> list:
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _sharded_model(model, state, megatron_layout: bool = True):
    wrapped = model if isinstance(model, list) else [model]
    chunks = [unwrap_model(c) for c in wrapped]
    entries, by_param = dc.model_sharded_state_dict(
        chunks,
        state.get_tensor_model_parallel_rank(),
        state.get_tensor_model_parallel_world_size(),
        state.get_expert_tensor_parallel_rank(),
        state.get_expert_tensor_parallel_world_size(),
        megatron_layout=megatron_layout,
    )
    # FSDP2: the optimizer steps plain tensors aliasing the parameters' shards; their state is
    # keyed and sharded like the parameters.
    for chunk in wrapped:
        if isinstance(chunk, TorchFullyShardedDataParallel):
            for param, local in chunk.shard_aliases():
                if id(param) in by_param:
                    by_param[id(local)] = by_param[id(param)]
    return chunks, entries, by_param


def _merged_optimizer_common(optimizer) -> dict:
    """The optimizer's common state with the param groups of every rank (pipeline stages may hold
    groups that rank 0 lacks, e.g. a decoupled LR for the output layer)."""
    common = dc.optimizer_common_state(optimizer)
    # Without the fp32 copies (fp32 optimizer) megatron-core keeps the groups at the top level.
    inner = common.get("optimizer", common)
    groups = inner["param_groups"]
    # Muon's layer-wise distributed optimizer: a rank may own no param that counts steps (Muon's
    # own update keeps no step): the step is the largest any rank counted.
    steps = inner.get("state", {})
    merged, seen = [], set()
    largest_step = None
    for other, step in _all_gather_object((groups, steps.get("common_step"))):
        if step is not None and (largest_step is None or step > largest_step):
            largest_step = step
        for group in other:
            signature = tuple(
                group.get(k)
                for k in (
                    "wd_mult",
                    "lr_mult",
                    "is_expert_parallel",
                    "is_decoupled_lr",
                    "optimizer",
                )
            )
            if signature not in seen:
                seen.add(signature)
                merged.append(group)
    groups[:] = merged
    if "state" in inner and largest_step is not None:
        inner["state"]["common_step"] = largest_step
    return common


# ---------------------------------------------------------------------------------- save
def save_checkpoint_dist(
    iteration: int,
    model,
    optimizer,
    opt_param_scheduler,
    flops: float,
    rerun_state=None,
    *,
    run: Run,
    args,
) -> None:
    """Write ``<save>/iter_XXXXXXX`` of ``run`` in torch_dist format with the flags ``args``
    (collective over all ranks).

    ``rerun_state`` (the rerun state machine's, when it asks for this checkpoint) goes to
    ``rerun_state_machine`` in the common state, its per-rank part to the
    ``rerun_state_machine_state`` object of the rank."""
    state = run.parallel_state
    maybe_finalize_async_save(blocking=True, run=run)
    save_dir = args.save
    print_rank_0(
        f"saving checkpoint at iteration {iteration:7d} to {save_dir} in torch_dist format"
        + (" (asynchronously)" if args.async_save else "")
    )
    chunks, entries, by_param = _sharded_model(model, state)
    save_optim = not args.no_save_optim and optimizer is not None
    optim_entries: Dict[str, dc.ShardedTensor] = {}
    sharding_type = FULLY_RESHARDABLE
    if save_optim and _writes_dp_reshardable(args, optimizer, state):
        sharding_type = dpr.DP_RESHARDABLE
        optim_entries = _dp_reshardable_entries(optimizer, state)
    elif save_optim:
        optim_entries = dc.optimizer_sharded_state_dict(optimizer, by_param)
    # Model weights (and the optimizer state of a non-distributed optimizer) are replicated over
    # DP x CP, experts over expert DP: one replica saves each of them.
    over_dp = dict(entries)
    # The layer-wise distributed optimizer's state exists on the DP rank owning the param only:
    # that rank writes it.
    if save_optim and not is_distributed(optimizer) and not dc.is_layer_wise(optimizer):
        over_dp.update(optim_entries)
    fully_parallel = getattr(args, "ckpt_fully_parallel_save", True)
    dc.spread_writes(
        {k: e for k, e in over_dp.items() if not getattr(e, "expert", False)},
        state.get_data_parallel_rank(with_context_parallel=True),
        state.get_data_parallel_world_size(with_context_parallel=True),
        fully_parallel=fully_parallel,
    )
    dc.spread_writes(
        {k: e for k, e in over_dp.items() if getattr(e, "expert", False)},
        state.get_expert_data_parallel_rank(),
        state.get_expert_data_parallel_world_size(),
        fully_parallel=fully_parallel,
    )
    sharded = {**entries, **optim_entries}

    if not args.no_save_rng:
        rng = checkpoint_rng_state.rng_sharded_object(
            state,
            run.rng_tracker,
            getattr(args, "data_parallel_random_init", False),
        )
        sharded[rng.name] = rng
    optim_common = None
    if save_optim and sharding_type == dpr.DP_RESHARDABLE:
        # Its param groups and grad scaler are objects per model-parallel rank (above).
        optim_common = {"param_state_sharding_type": dpr.DP_RESHARDABLE}
    elif save_optim:
        optim_common = _merged_optimizer_common(optimizer)
    if rerun_state is not None:
        rerun_state, rerun_object = checkpoint_rng_state.rerun_entries(
            rerun_state, get_rank(), get_world_size()
        )
        sharded[rerun_object.name] = rerun_object
    final_dir = checkpoint_dir(save_dir, iteration)
    work_dir = final_dir + TMP_SUFFIX
    if get_rank() == 0:
        common = {
            "args": checkpoint_args(args, run.state),
            "checkpoint_version": CHECKPOINT_VERSION,
            "iteration": iteration,
            "num_floating_point_operations_so_far": float(flops),
            "parallel_layout": _layout(state, len(chunks)),
            # How the optimizer state is sharded: Megatron-LM reads it before loading.
            "content_metadata": dc.content_metadata(sharding_type),
        }
        if save_optim:
            common["optimizer"] = optim_common
            if opt_param_scheduler is not None:
                common["opt_param_scheduler"] = opt_param_scheduler.state_dict()
        if rerun_state is not None:
            common["rerun_state_machine"] = rerun_state
        if os.path.isdir(work_dir):
            shutil.rmtree(work_dir)  # left by an interrupted save of the same iteration
        try:
            os.makedirs(work_dir)
            dc.save_common(common, work_dir)
        except (OSError, RuntimeError) as exc:
            remove_partial(work_dir)
            raise _write_failed(work_dir, exc) from None
    barrier()

    if args.async_save:
        saver = _async_saver(run)
        request = AsyncSave(sharded, work_dir, process_group=saver.group_for_writes())
        saver.pending = {
            "request": request,
            "iteration": iteration,
            "save_dir": save_dir,
            "args": args,
        }
        return
    try:
        dc.save_shards(sharded, work_dir)
    except (dc.CheckpointingError, OSError, RuntimeError) as exc:
        # Every rank learns of a failed write (DCP gathers the results): one removes the rest.
        if get_rank() == 0:
            remove_partial(work_dir)
        raise _write_failed(work_dir, exc) from None
    _commit(save_dir, iteration, run, args)


def _writes_dp_reshardable(args, optimizer, state) -> bool:
    """Megatron-LM's default for the distributed optimizer: megatron-core's dp_reshardable
    type, unless --dist-ckpt-optim-fully-reshardable asks otherwise or the model is one whose
    megatron-core buffer layout is not reproduced here (MoE, BERT, T5: written
    fully_reshardable, which content_metadata says). Agreed over the ranks."""
    if not is_distributed(optimizer) or getattr(args, "dist_ckpt_optim_fully_reshardable", False):
        return False
    reason = None
    try:
        dpr.megatron_core_buffers(
            _megatron_core_chunks(optimizer, state), _dtypes_of(optimizer), optimizer.dp_size
        )
    except dpr.UnmappableLayout as exc:
        reason = str(exc)
    reasons = [r for r in _all_gather_object(reason) if r is not None]
    if reasons:
        print_rank_0(
            " > distributed-optimizer state saved in the fully_reshardable type: megatron-core's "
            f"dp_reshardable layout is not reproduced for this model ({reasons[0]})"
        )
    return not reasons


def _dp_reshardable_entries(optimizer, state) -> dict:
    """This rank's part of megatron-core's dp_reshardable state: the whole flat bucket tensors
    and the objects of its model-parallel rank, written by DP rank 0 (a collective over DP)."""
    tp = state.get_tensor_model_parallel_world_size()
    mp_index = (
        state.get_pipeline_model_parallel_rank() * tp + state.get_tensor_model_parallel_rank()
    )
    buffers = dpr.megatron_core_buffers(
        _megatron_core_chunks(optimizer, state), _dtypes_of(optimizer), optimizer.dp_size
    )
    by_param = distributed_state_by_param(optimizer)
    common = dc.optimizer_common_state(optimizer)
    # DP rank 0 of distributed-optimizer instance 0 writes (every instance holds the same state).
    replica = optimizer.dp_rank != 0 or getattr(optimizer, "instance_rank", 0) != 0
    out = dpr.layout_objects(buffers, mp_index, replica)
    for name in ("optimizer", "grad_scaler"):
        if name in common:
            entry = dc.ShardedObject(
                dpr.object_key(mp_index, name), common[name], (1,), (0,), replica=replica
            )
            out[entry.name] = entry
    if by_param is not None and getattr(optimizer, "instance_rank", 0) == 0:
        names = (MAIN_PARAM,) + state_names(optimizer)
        out.update(dpr.bucket_state_entries(buffers, mp_index, by_param, names))
    return out


def _write_failed(work_dir: str, exc: BaseException) -> CheckpointError:
    return CheckpointError(
        f"cannot write checkpoint {work_dir}: {why_write_failed(exc, work_dir)}; the partial "
        "checkpoint was removed and the last complete one is kept"
    )


def release_async_save_group(run: Run) -> None:
    """Forget the async-save group of ``run`` at teardown, once no save is pending, so that it
    can be destroyed."""
    saver = run.async_saver
    if saver is None:
        return
    if saver.pending is not None:
        raise RuntimeError("an asynchronous save is still pending; finalize it before the teardown")
    saver.group = saver.world = None


def abandon_async_save(run: Run) -> Optional[str]:
    """A failed run ends without waiting for ``run``'s background save: forget it and return
    the directory it was writing into (None if none). That directory is never marked complete
    (metadata.json, rename and tracker are written only by the commit), so a later load takes
    the last complete checkpoint."""
    saver = run.async_saver
    if saver is None or saver.pending is None:
        return None
    pending, saver.pending = saver.pending, None
    return checkpoint_dir(pending["save_dir"], pending["iteration"]) + TMP_SUFFIX


def _commit(save_dir: str, iteration: int, run: Run, args, asynchronous: bool = False) -> None:
    """Every rank has written its part: mark the checkpoint complete and move the tracker."""
    barrier()
    final_dir = checkpoint_dir(save_dir, iteration)
    work_dir = final_dir + TMP_SUFFIX
    digests = integrity_digests(args, work_dir)
    if get_rank() == 0:
        dc.write_metadata_json(work_dir)
        seal(work_dir, digests)  # the --verify-integrity manifest, metadata.json included
        old = None
        if os.path.isdir(final_dir):
            old = final_dir + ".old"
            if os.path.isdir(old):
                shutil.rmtree(old)
            os.replace(final_dir, old)
        os.replace(work_dir, final_dir)
        commit_tracker(save_dir, iteration)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    print_saved_checkpoint(iteration, save_dir, run.parallel_state)
    remove_unretained(args, save_dir, iteration)
    if asynchronous and getattr(args, "log_progress", False):
        from .progress_log import log_async_checkpoint_committed

        log_async_checkpoint_committed(save_dir, args.world_size, iteration)


def maybe_finalize_async_save(blocking: bool = False, *, run: Optional[Run] = None) -> bool:
    """Commit the background save of ``run`` (default the current one) once every rank's writer
    has finished (collective while a save is pending). Returns True when nothing is pending any
    more."""
    run = run or global_vars.get_run()
    saver = run.async_saver
    pending = None if saver is None else saver.pending
    if pending is None:
        return True
    request: AsyncSave = pending["request"]
    if not blocking:
        done = torch.tensor(
            [1 if request.done() else 0], dtype=torch.int32, device=collective_device()
        )
        if dist.is_initialized():
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
        if not done.item():
            return False
    error = None
    try:
        request.wait()
    except BaseException as exc:  # report on every rank below, never hang the others
        error = exc
    failed = torch.tensor(
        [1 if error is not None else 0], dtype=torch.int32, device=collective_device()
    )
    if dist.is_initialized():
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    saver.pending = None
    if failed.item():
        reason = (
            f"{type(error).__name__}: {error}"
            if error is not None
            else "another rank's writer failed"
        )
        raise CheckpointError(
            f"asynchronous save of iteration {pending['iteration']} to "
            f"{pending['save_dir']} failed ({reason}); the previous checkpoint is kept"
        )
    _commit(pending["save_dir"], pending["iteration"], run, pending["args"], asynchronous=True)
    return True


# ---------------------------------------------------------------------------------- load
def load_checkpoint_dist(
    model,
    optimizer,
    opt_param_scheduler,
    load_dir: str,
    iteration: int,
    release: bool,
    *,
    run: Run,
    load_optim: bool,
    load_rng: bool,
):
    """Load ``load_dir``'s checkpoint of ``iteration`` into ``run``'s layout (collective); its
    sample counts go into ``run.state``. ``load_optim`` / ``load_rng``: as load_checkpoint's.

    Returns (iteration to resume from, flops so far, the checkpoint's args).
    """
    args, state = run.args, run.parallel_state
    directory = checkpoint_dir(load_dir, iteration, release)
    try:
        dc.check_complete(directory)
        common = dc.load_common(directory, safe_globals=[argparse.Namespace])
        dcp_metadata = dc.read_dcp_metadata(directory)
        ckpt_keys = set(dc.tensor_shapes(dcp_metadata))
    except dc.CheckpointingError as exc:
        raise CheckpointError(str(exc)) from None
    ckpt_args = common.get("args")
    check_model_args(ckpt_args, args, run.model_family.checkpoint_model_args, directory)
    # Checkpoints written here before the Megatron layout have one key per layer: read them so.
    per_layer = is_per_layer_layout(ckpt_keys)
    chunks, entries, by_param = _sharded_model(model, state, megatron_layout=not per_layer)

    finetune = args.finetune or release
    load_optim = not finetune and load_optim and optimizer is not None
    optim_load = None
    bucket_state = None
    if load_optim and dpr.holds_dp_reshardable(ckpt_keys):
        bucket_state, common = _dp_reshardable_source(
            optimizer, state, directory, dcp_metadata, ckpt_args, common
        )
    if load_optim:
        step = load_optimizer_common(optimizer, common, directory)
        if step > 0:
            optim_load = dc.OptimizerLoad(
                optimizer, by_param, lambda key: key in ckpt_keys, step, bucket_state=bucket_state
            )
    targets = dict(entries)
    if optim_load is not None:
        targets.update(optim_load.targets)
    # Here, not at module level: torch.distributed.checkpoint loads only when a run reads one.
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    object_keys = {
        k
        for k, v in dcp_metadata.state_dict_metadata.items()
        if isinstance(v, BytesStorageMetadata)
    }
    load_rng = not finetune and load_rng
    rng_entry = _rng_request(object_keys, state) if load_rng else None
    rerun_saved, rerun_entry = None, None
    if _job_sharding_changed(ckpt_args, args):
        # Megatron-LM's rule and line: the machine's per-rank state belongs to the old layout.
        print_rank_0("Job sharding has changed: Rerun state will be ignored")
    elif not finetune:
        rerun_saved = checkpoint_rng_state.plain_rerun_common(common.get("rerun_state_machine"))
        rerun_saved, rerun_entry = _rerun_request(rerun_saved, object_keys, run.rerun)
    for entry in (rng_entry, rerun_entry):
        if entry is not None:
            targets[entry.name] = entry

    strictness = dc.StrictHandling(getattr(args, "dist_ckpt_strictness", "assume_ok_unexpected"))
    try:
        result = dc.load_shards(
            targets,
            directory,
            strictness=strictness,
            counts_as_unexpected=lambda key: (
                not key.startswith((STATE_PREFIX, dpr.PREFIX))
                # fp32 main weights of fp32 parameters: the model weights themselves
                or (load_optim and not key.startswith(state_key(MAIN_PARAM, "")))
            ),
        )
    except dc.CheckpointingError as exc:
        raise CheckpointError(str(exc)) from None
    if strictness in (
        dc.StrictHandling.LOG_ALL,
        dc.StrictHandling.LOG_UNEXPECTED,
        dc.StrictHandling.RETURN_ALL,
        dc.StrictHandling.RETURN_UNEXPECTED,
    ):
        if result.missing:
            print_rank_0(
                f" > missing in checkpoint (kept their current values): {', '.join(result.missing)}"
            )
        if result.unexpected:
            print_rank_0(
                f" > unexpected in checkpoint (not loaded): {', '.join(result.unexpected)}"
            )

    if optim_load is not None:
        optim_load.finish()
    elif optimizer is not None and hasattr(optimizer, "reload_model_params"):
        optimizer.reload_model_params()  # the fp32 main params follow the loaded weights
    if load_optim and opt_param_scheduler is not None and "opt_param_scheduler" in common:
        opt_param_scheduler.load_state_dict(common["opt_param_scheduler"])

    if finetune:
        iteration = 0
    else:
        iteration = int(common.get("iteration", iteration))
        if ckpt_args is not None:
            run.state.restore_sample_counts(ckpt_args)
        if rng_entry is not None:
            _set_rng(rng_entry.data, state, args, directory, run.rng_tracker)
        elif load_rng and "rng_state" in common:  # the list form written here before
            _restore_rng(common, state, len(chunks), run.rng_tracker)
        _restore_rerun_state(rerun_saved, rerun_entry, run.rerun)
    barrier()
    return iteration, float(common.get("num_floating_point_operations_so_far", 0.0)), ckpt_args


def _rng_request(object_keys, state) -> Optional[dc.ShardedObject]:
    """The entry that reads this rank's RNG state, when the checkpoint holds Megatron-LM's
    ``rng_state`` object at this run's TP and PP sizes (Megatron-LM's rule: with another TP/PP
    layout no rank has a counterpart and the RNG is left as seeded)."""
    grid = checkpoint_rng_state.saved_grid(object_keys, checkpoint_rng_state.RNG_KEY)
    if grid is None:
        return None  # saved with --no-save-rng, or the list form written here before
    request = checkpoint_rng_state.rng_request(state)
    if grid != request.global_shape:
        print_rank_0(
            " > RNG state not restored: the checkpoint was saved with TP={} PP={}, this run "
            "uses TP={} PP={}".format(grid[1], grid[0], *reversed(request.global_shape))
        )
        return None
    return request


def _set_rng(saved: list, state, args, directory: str, tracker=None) -> None:
    """Restore this rank's RNG states (and ``tracker``'s streams, default the current run's)."""
    if tracker is None:
        tracker = global_vars.get_rng_tracker()
    try:
        chosen = checkpoint_rng_state.choose_rng_state(
            saved, state, getattr(args, "data_parallel_random_init", False)
        )
        checkpoint_rng_state.check_tracker_states(chosen.get("rng_tracker_states"), tracker)
        set_rng_state(chosen, tracker)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise CheckpointError(
            f"checkpoint {directory}: cannot restore the RNG state ({exc}); pass --no-load-rng "
            "to keep this run's seeds"
        ) from None


def _job_sharding_changed(ckpt_args, args) -> bool:
    """Whether the checkpoint was saved with another world size, TP/PP sizes or DP size
    (Megatron-LM's test; sizes missing from the checkpoint's args count as 1 for TP/PP and as
    unknown for the others)."""

    def sizes(source, tp_pp_default):
        return (
            getattr(source, "world_size", 0),
            getattr(source, "tensor_model_parallel_size", tp_pp_default),
            getattr(source, "pipeline_model_parallel_size", tp_pp_default),
            getattr(source, "data_parallel_size", 0),
        )

    return sizes(ckpt_args, 1) != sizes(args, 1)


def _rerun_request(saved, object_keys, machine=None):
    """(the machine's common state, the entry that reads this rank's part) when the checkpoint
    asks ``machine`` (default the current run's) to re-run an iteration; the entry is None for
    the list form written here before."""
    if machine is None:
        machine = global_vars.get_rerun_state_machine()
    if machine is None or not machine.validate_state_dict(saved):
        return saved, None
    if isinstance(saved.get("sharded"), list):
        return saved, None
    grid = checkpoint_rng_state.saved_grid(object_keys, checkpoint_rng_state.RERUN_KEY)
    if grid != (get_world_size(),):
        raise CheckpointError(
            f"the checkpoint asks to re-run an iteration on {grid[0] if grid else 0} ranks; "
            f"this run has {get_world_size()}: resume it with the same number of processes"
        )
    return saved, checkpoint_rng_state.rerun_request(get_rank(), get_world_size())


def _restore_rerun_state(saved, entry, machine=None) -> None:
    """Hand a checkpoint's pending re-run to this run's rerun state machine (``machine``,
    default the current run's; same world)."""
    if machine is None:
        machine = global_vars.get_rerun_state_machine()
    if machine is None or not machine.validate_state_dict(saved):
        return
    if entry is not None:
        machine.load_state_dict(
            dict(saved, sharded=checkpoint_rng_state.plain_rerun_part(entry.data))
        )
        return
    per_rank = saved["sharded"]
    if len(per_rank) != get_world_size():
        raise CheckpointError(
            f"the checkpoint asks to re-run an iteration on {len(per_rank)} ranks; this run has "
            f"{get_world_size()}: resume it with the same number of processes"
        )
    machine.load_state_dict(dict(saved, sharded=per_rank[get_rank()]))


def _dp_reshardable_source(optimizer, state, directory, metadata, ckpt_args, common):
    """For a checkpoint with megatron-core's dp_reshardable optimizer state: the targets that
    read this rank's buckets, and ``common`` with the optimizer's param groups (saved beside
    the tensors) in it. One CheckpointError on every rank when this run cannot place that
    state (collective: every rank calls it)."""
    problem, bucket_state, optimizer_common, grad_scaler = None, None, None, None
    tp = state.get_tensor_model_parallel_world_size()
    pp = state.get_pipeline_model_parallel_world_size()
    mp_index = (
        state.get_pipeline_model_parallel_rank() * tp + state.get_tensor_model_parallel_rank()
    )
    try:
        saved_tp = getattr(ckpt_args, "tensor_model_parallel_size", tp)
        saved_pp = getattr(ckpt_args, "pipeline_model_parallel_size", pp)
        if (saved_tp, saved_pp) != (tp, pp):
            raise dpr.UnmappableLayout(
                f"it was saved at TP={saved_tp} PP={saved_pp} and this run uses TP={tp} PP={pp} "
                "(that layout reshards over DP only)"
            )
        # Megatron-LM's Transformer Engine layers register their parameters in another order
        # (the norms inside the linear layers); checkpoints written here (they carry
        # parallel_layout) come from this code base's local layers.
        written_here = "parallel_layout" in common
        transformer_impl = getattr(ckpt_args, "transformer_impl", "local")
        if not written_here and transformer_impl == "transformer_engine":
            raise dpr.UnmappableLayout(
                "it was saved with --transformer-impl transformer_engine, whose parameter order "
                "this code base does not reproduce"
            )
        if not is_distributed(optimizer):
            raise dpr.UnmappableLayout("this run does not use --use-distributed-optimizer")
        buffers = dpr.megatron_core_buffers(
            _megatron_core_chunks(optimizer, state), _dtypes_of(optimizer), optimizer.dp_size
        )
        saved = dpr.read_object(
            directory, metadata, dpr.object_key(mp_index, "per_bucket_numel_unpadded")
        )
        optimizer_common = dpr.read_object(
            directory, metadata, dpr.object_key(mp_index, "optimizer")
        )
        if saved is None or optimizer_common is None:
            raise dpr.UnmappableLayout(
                f"it holds no state for model-parallel rank {mp_index} (dp_group_idx_{mp_index})"
            )
        ours = dpr.numel_summary([{b.dtypes: b.numel_unpadded()} for b in buffers])
        if dpr.numel_summary(saved) != ours:
            raise dpr.UnmappableLayout(
                f"its buckets hold {dpr.numel_summary(saved)} elements (unpadded, per buffer "
                f"dtypes), the layout megatron-core would use for this model {ours}"
            )
        bucket_state = dpr.BucketStateLoad(
            buffers,
            mp_index,
            (MAIN_PARAM,) + state_names(optimizer),
            optimizer.holds_any_state_root(),
        )
        grad_scaler = dpr.read_object(directory, metadata, dpr.object_key(mp_index, "grad_scaler"))
    # load_object's refusals are ValueErrors, as UnmappableLayout is.
    except (ValueError, OSError, RuntimeError) as exc:
        problem = f"rank {get_rank()}: {exc}"
    problems = [p for p in _all_gather_object(problem) if p is not None]
    if problems:
        raise CheckpointError(
            f"checkpoint {directory} holds the distributed optimizer's state in megatron-core's "
            f"dp_reshardable layout, which cannot be placed in this run ({problems[0]}); the "
            "optimizer state was not loaded: pass --no-load-optim or --finetune to load the "
            "model only"
        )
    merged = {"optimizer": optimizer_common, "param_state_sharding_type": dpr.DP_RESHARDABLE}
    if grad_scaler is not None:
        merged["grad_scaler"] = grad_scaler
    return bucket_state, dict(common, optimizer=merged)


def _megatron_core_chunks(optimizer, state):
    """(model chunk, the bucket size megatron-core's DDP would give it): its --ddp-bucket-size
    rule on the first pipeline stage's first chunk, one bucket elsewhere."""
    first_stage = state.get_pipeline_model_parallel_rank() == 0
    return [
        (
            unwrap_model(chunk),
            getattr(chunk, "bucket_size", None) if first_stage and i == 0 else None,
        )
        for i, chunk in enumerate(optimizer.model_chunks)
    ]


def _dtypes_of(optimizer):
    """param -> (param dtype, grad dtype) of the buffer this run keeps it in."""
    dtypes = {}
    for buffer in optimizer.buffers:
        for param in buffer.param_index_map:
            dtypes[id(param)] = (buffer.param_dtype, buffer.grad_dtype)
    return lambda param: dtypes[id(param)]


def _restore_rng(common: dict, state, num_chunks: int, tracker) -> None:
    """This rank's RNG state when the checkpoint's TP and PP sizes equal this run's (Megatron's
    rule: with another TP/PP layout no rank has a counterpart and the RNG is left as seeded)."""
    saved = common.get("parallel_layout", {})
    ours = _layout(state, num_chunks)
    same = all(
        saved.get(k) == ours[k]
        for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size")
    )
    if not same:
        print_rank_0(
            (
                " > RNG state not restored: the checkpoint was saved with TP={} PP={}, "
                "this run uses TP={} PP={}"
            ).format(
                saved.get("tensor_model_parallel_size"),
                saved.get("pipeline_model_parallel_size"),
                ours["tensor_model_parallel_size"],
                ours["pipeline_model_parallel_size"],
            )
        )
        return
    pp, tp, dp, cp = _coordinates(state)
    by_coordinates = {tuple(e["coordinates"]): e["state"] for e in common["rng_state"]}
    chosen = (
        by_coordinates.get((pp, tp, dp, cp))
        or by_coordinates.get((pp, tp, dp, 0))
        or by_coordinates.get((pp, tp, 0, 0))
    )
    if chosen is not None:
        set_rng_state(chosen, tracker)


def load_optimizer_common(optimizer, common: dict, directory) -> int:
    """Restore the optimizer's common (unsharded) state from a checkpoint's common dict; its step
    (0: no per-parameter state saved). One line naming the checkpoint when it has none or holds
    a state this code base cannot read."""
    if "optimizer" not in common:
        raise CheckpointError(
            f"checkpoint {directory} holds no optimizer state (saved with --no-save-optim?); "
            "pass --no-load-optim or --finetune"
        )
    try:
        return load_optimizer_common_state(optimizer, common["optimizer"])
    except dc.UnreadableOptimizerState as exc:
        raise CheckpointError(
            f"checkpoint {directory}: {exc}, which this code base cannot read; pass "
            "--no-load-optim or --finetune to load the model only"
        ) from None
