"""Checkpoints in Megatron-LM's ``fsdp_dtensor`` format (``--ckpt-format fsdp_dtensor``, the
format of its Megatron-FSDP runs), written and read in Megatron-LM's own layout.

Layout (Megatron-LM megatron/training/checkpointing.py, ``save_checkpoint`` /
``_load_base_checkpoint`` for ``ckpt_format == "fsdp_dtensor"``): ``<save>/iter_0000100/`` is a
bare torch.distributed.checkpoint directory (``.metadata`` and ``__<rank>_0.distcp``; no
metadata.json, no common.pt) of one flattened state dict, plus
``<save>/latest_checkpointed_iteration.txt``. Its keys:

* ``model.module.<parameter>``: the weights under the model's own names, one key per layer and
  per expert with global layer and expert indices (``decoder.layers.3.mlp.experts.
  local_experts.5.linear_fc1.weight``; Megatron-LM's ``handle_experts_in_state_dict``), each
  the whole (TP=1, unsharded) tensor stored in chunks. As in Megatron-FSDP, whose model weights
  are the optimizer's fp32 main weights, a run with fp32 main weights saves those here and no
  separate copy.
* ``optimizer.state.module.module.module.<parameter>.<exp_avg|exp_avg_sq>``: the optimizer state
  keyed like the weight (Megatron-LM's ``sharded_param_state_fsdp_dtensor``; the
  ``module.module.module`` run is the default prefix of its converter,
  tools/checkpoint/checkpoint_inspector.py ``convert_checkpoint``).
* ``args``, ``checkpoint_version`` (3.0), ``iteration``, ``num_floating_point_operations_so_far``,
  ``opt_param_scheduler.<field>`` and the optimizer's hyperparameters (``optimizer.<...>``):
  plain objects, DCP's flattening of Megatron-LM's ``generate_state_dict``.
* ``rng_state.(<pp rank>, <tp rank>).<dp index>.<field>``: Megatron-LM's ``get_rng_state`` for
  this format (a dict keyed by ``"(pp, tp)"``), tensors stored as tensors.

Every tensor is stored at its global shape, so any strategy (Megatron-FSDP's optim_grads_params
on FSDP2 shards, optim / optim_grads on the distributed optimizer, no_shard on DDP), DP size,
EP size or TP size reads any other's. Not written: Megatron-LM's per-parameter
``optimizer.param_to_group_meta.*`` (the groups are written once, under ``optimizer.``), the
rerun state machine's state, SwiGLU's ``_w`` / ``_v`` split of fc1 (``handle_swiglu_in_state_dict``:
fc1 is stored whole).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import replace

import torch.distributed as dist

from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.fsdp_dtensor import (
    MASTER_NAMES,
    MODEL_PREFIX,
    NOT_COMMON,
    common_state,
    flatten,
    model_key,
    object_entries,
    optimizer_state_key,
    requests,
    rng_prefix,
    split_state_key,
    under,
    unflatten,
    values,
)
from megatron.checkpointing.layout import (
    CHECKPOINT_VERSION,
    checkpoint_dir,
    commit_tracker,
    remove_partial,
    remove_unretained,
)
from megatron.checkpointing.saved_args import check_model_args, checkpoint_args
from megatron.core import dist_checkpointing as dc
from megatron.core.dist_checkpointing.optimizer_state import is_distributed

from . import checkpoint_rng_state
from .checkpoint_integrity import integrity_digests, seal
from .checkpointing_common import barrier, print_saved_checkpoint, set_rng_state
from .checkpointing_dist import (
    TMP_SUFFIX,
    _merged_optimizer_common,
    _sharded_model,
    load_optimizer_common,
)
from .run import Run
from .utils import get_rank, print_rank_0

_MASTERS = MASTER_NAMES


def _rng_prefix(state) -> str:
    return rng_prefix(
        state.get_pipeline_model_parallel_rank(), state.get_tensor_model_parallel_rank()
    )


def _single_chunk(chunks) -> None:
    if len(chunks) > 1:
        raise CheckpointError(
            "--ckpt-format fsdp_dtensor holds one model chunk per rank (Megatron-FSDP has no "
            "virtual pipeline stages): use --ckpt-format torch_dist with "
            "--num-layers-per-virtual-pipeline-stage"
        )


def _distributed_master_keys(optimizer, by_param) -> set:
    """The keys whose fp32 main weight the distributed optimizer saves (every parameter in its
    buffers; written by the state root of each buffer)."""
    keys = set()
    for buffer in optimizer.buffers:
        for param in buffer.param_index_map:
            entry = by_param.get(id(param))
            if entry is not None:
                keys.add(entry.key)
    return keys


# ------------------------------------------------------------------ save
def save_checkpoint_fsdp_dtensor(
    iteration: int, model, optimizer, opt_param_scheduler, flops: float, *, run: Run, args
) -> None:
    """Write ``<save>/iter_XXXXXXX`` of ``run`` in Megatron-LM's fsdp_dtensor layout (a
    collective over all ranks). Written into ``iter_XXXXXXX.tmp`` and renamed once complete,
    then the tracker moves: an interrupted save leaves the previous checkpoint current."""
    state = run.parallel_state
    save_dir = args.save
    # (--async-save is refused with this format at start-up: flags/policy.py.)
    print_rank_0(
        f"saving checkpoint at iteration {iteration:7d} to {save_dir} in fsdp_dtensor format"
    )
    chunks, entries, by_param = _sharded_model(model, state, megatron_layout=False)
    _single_chunk(chunks)
    save_optim = not args.no_save_optim and optimizer is not None
    optim_entries = dc.optimizer_sharded_state_dict(optimizer, by_param) if save_optim else {}
    # One replica writes each replicated entry (as torch_dist): the weights over DP x CP,
    # experts over expert DP; the state of a non-distributed optimizer with them.
    over_dp = dict(entries)
    if save_optim and not is_distributed(optimizer) and not dc.is_layer_wise(optimizer):
        over_dp.update(optim_entries)
    for expert in (False, True):
        group = {k: e for k, e in over_dp.items() if getattr(e, "expert", False) == expert}
        rank, size = (
            (state.get_expert_data_parallel_rank(), state.get_expert_data_parallel_world_size())
            if expert
            else (
                state.get_data_parallel_rank(with_context_parallel=True),
                state.get_data_parallel_world_size(with_context_parallel=True),
            )
        )
        dc.spread_writes(group, rank, size, getattr(args, "ckpt_fully_parallel_save", True))

    sharded: dict = {}
    masters = set()
    for entry in optim_entries.values():
        name, key = split_state_key(entry.key)
        if name in _MASTERS:
            # Megatron-FSDP's model weights are the fp32 main weights: saved as the weight.
            masters.add(key)
            sharded[model_key(key)] = replace(entry, key=model_key(key))
        else:
            new_key = optimizer_state_key(name, key)
            sharded[new_key + entry.name_suffix] = replace(entry, key=new_key)
    if save_optim and is_distributed(optimizer):
        masters |= _distributed_master_keys(optimizer, by_param)
    for entry in entries.values():
        if isinstance(entry, dc.ShardedTensor) and entry.key not in masters:
            sharded[model_key(entry.name)] = replace(entry, key=model_key(entry.key))

    common = {
        "args": checkpoint_args(args, run.state),
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": iteration,
        "num_floating_point_operations_so_far": float(flops),
    }
    if save_optim:
        common["optimizer"] = _merged_optimizer_common(optimizer)  # collective
        if opt_param_scheduler is not None:
            common["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    flat: dict = {}
    for name, value in common.items():
        flatten(name, value, flat)
    sharded.update(object_entries(flat, replica=get_rank() != 0))
    if not args.no_save_rng:
        states = _rng_states(state, run, args)
        replica = state.get_data_parallel_rank(with_context_parallel=True) != 0
        sharded.update(object_entries(flatten(_rng_prefix(state), states, {}), replica))

    final_dir = checkpoint_dir(save_dir, iteration)
    work_dir = final_dir + TMP_SUFFIX
    if get_rank() == 0:
        if os.path.isdir(work_dir):
            shutil.rmtree(work_dir)  # left by an interrupted save of the same iteration
        os.makedirs(work_dir)
    barrier()
    try:
        dc.save_shards(sharded, work_dir)
    except (dc.CheckpointingError, OSError, RuntimeError) as exc:
        if get_rank() == 0:
            remove_partial(work_dir)
        raise CheckpointError(
            f"cannot write checkpoint {work_dir}: {exc}; the partial checkpoint was removed and "
            "the last complete one is kept"
        ) from None
    barrier()
    digests = integrity_digests(args, work_dir)
    if get_rank() == 0:
        seal(work_dir, digests)
        if os.path.isdir(final_dir):
            shutil.rmtree(final_dir)
        os.replace(work_dir, final_dir)
        commit_tracker(save_dir, iteration)
    barrier()
    print_saved_checkpoint(iteration, save_dir, state)
    remove_unretained(args, save_dir, iteration)


def _rng_states(state, run: Run, args) -> list:
    """Megatron-LM's rng_state list: this rank's states, or every DP rank's with
    --data-parallel-random-init (a collective over DP then)."""
    mine = checkpoint_rng_state.megatron_rng_state(run.rng_tracker)
    dp_size = state.get_data_parallel_world_size()
    if getattr(args, "data_parallel_random_init", False) and dp_size > 1 and dist.is_initialized():
        states = [None] * dp_size
        dist.all_gather_object(states, mine, group=state.get_data_parallel_group())
        return states
    return [mine]


# ------------------------------------------------------------------ load
def load_checkpoint_fsdp_dtensor(
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
    """Load an fsdp_dtensor checkpoint into this run at any strategy and layout (a collective);
    returns (iteration, flops so far)."""
    args, state = run.args, run.parallel_state
    directory = checkpoint_dir(load_dir, iteration, release)
    metadata = dc.read_dcp_metadata(directory)
    ckpt_keys = set(metadata.state_dict_metadata)

    def read(targets: dict) -> None:
        try:
            dc.load_shards(
                targets,
                directory,
                strictness=dc.StrictHandling(
                    getattr(args, "dist_ckpt_strictness", "assume_ok_unexpected")
                ),
                counts_as_unexpected=lambda key: key.startswith(MODEL_PREFIX),
                bare_dcp=True,
            )
        except dc.CheckpointingError as exc:
            raise CheckpointError(str(exc)) from None

    common_requests = requests(metadata, lambda key: not key.startswith(NOT_COMMON))
    read(common_requests)
    common = common_state(values(common_requests))
    ckpt_args = common.get("args")
    check_model_args(ckpt_args, args, run.model_family.checkpoint_model_args, directory)

    chunks, entries, by_param = _sharded_model(model, state, megatron_layout=False)
    _single_chunk(chunks)
    targets = {
        model_key(e.name): replace(e, key=model_key(e.key), replica=False)
        for e in entries.values()
        if isinstance(e, dc.ShardedTensor)
    }
    finetune = args.finetune or release
    load_optim = not finetune and load_optim and optimizer is not None
    optim_load, master_targets = None, {}
    if load_optim:
        step = load_optimizer_common(optimizer, common, directory)
        if step > 0:
            optim_load = dc.OptimizerLoad(optimizer, by_param, _has_state(ckpt_keys), step)
            for entry in optim_load.targets.values():
                name, key = split_state_key(entry.key)
                if name in _MASTERS:  # read in a second pass: the weight has the same key
                    master_targets[model_key(key)] = replace(entry, key=model_key(key))
                else:
                    new_key = optimizer_state_key(name, key)
                    targets[new_key + entry.name_suffix] = replace(entry, key=new_key)
    rng = None
    if not finetune and load_rng:
        rng = requests(metadata, under(_rng_prefix(state)))
        if not rng:
            print_rank_0("WARNING: RNG state not found for current TP/PP rank")  # Megatron's
        targets.update(rng)
    read(targets)
    if optim_load is not None:
        read(master_targets)  # every rank: step is the checkpoint's, the same on all
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
        if rng:
            _set_rng(unflatten(values(rng), _rng_prefix(state)), state, args, directory, run)
    barrier()
    return iteration, float(common.get("num_floating_point_operations_so_far", 0.0))


def _has_state(ckpt_keys: set):
    """Whether the checkpoint holds the torch_dist-named optimizer state ``key``
    (``optimizer.state.<name>.<param key>``) under its fsdp_dtensor name."""

    def has(key: str) -> bool:
        name, param_key = split_state_key(key)
        if name in _MASTERS:
            return model_key(param_key) in ckpt_keys
        return optimizer_state_key(name, param_key) in ckpt_keys

    return has


def _set_rng(saved, state, args, directory: str, run: Run) -> None:
    try:
        chosen = checkpoint_rng_state.choose_rng_state(
            saved, state, getattr(args, "data_parallel_random_init", False)
        )
        checkpoint_rng_state.check_tracker_states(chosen.get("rng_tracker_states"), run.rng_tracker)
        set_rng_state(chosen, run.rng_tracker)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise CheckpointError(
            f"checkpoint {directory}: cannot restore the RNG state ({exc}); pass --no-load-rng "
            "to keep this run's seeds"
        ) from None
