"""Checkpoint save/load entry points, and Megatron's ``torch`` format.

``--ckpt-format torch_dist`` (the default) is handled by :mod:`.checkpointing_dist`; this module
dispatches to it, detects the format of a checkpoint being loaded (``--auto-detect-ckpt-format``),
converts between formats (``--ckpt-convert-format``) and reads model flags back from a checkpoint
(``--use-checkpoint-args``). The format layer both formats and the offline converters share
(names, tracker, format detection, saved args, ``--save-retain-interval``) is the package
:mod:`megatron.checkpointing`; the RNG states and log lines are in :mod:`.checkpointing_common`.

torch-format layout: ``<save>/iter_0000100/mp_rank_00/model_optim_rng.pt`` (``mp_rank_TT_PPP``
with pipeline parallelism) and ``<save>/latest_checkpointed_iteration.txt``. Each file is
written under a temporary name and renamed; the tracker is written by rank 0 only after every
rank has finished, so an interrupted save never leaves the tracker pointing at an incomplete
checkpoint.

Loading uses ``torch.load(weights_only=True)``: nothing in a checkpoint can run code. ``args`` is
stored as an ``argparse.Namespace`` holding only plain values (allow-listed for the loader);
numpy's RNG state is stored as tensors and plain values.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

import torch
import torch.distributed as dist

from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.layout import (
    CHECKPOINT_VERSION,
    checkpoint_dir,
    checkpoint_name,
    commit_tracker,
    detect_format,
    format_to_load,
    load_torch_file,
    read_tracker,
    remove_partial,
    remove_unretained,
    tracker_path,
    why_write_failed,
)
from megatron.checkpointing.saved_args import (
    check_model_args,
    checkpoint_args,
    load_args_from_checkpoint,  # noqa: F401  (Megatron's import path: arguments.py uses it)
)
from megatron.core.device import collective_device
from megatron.core.dist_checkpointing.megatron_layout import with_extra_state, without_extra_state
from megatron.core.optimizer.param_order import (
    PARAM_ORDER,
    PARAM_ORDER_KEY,
    legacy_parameter_order,
)
from megatron.core.utils import unwrap_model

from . import global_vars
from .checkpoint_integrity import integrity_digests, seal, verify_checkpoint
from .checkpointing_common import (
    barrier,
    print_loaded_checkpoint,
    print_saved_checkpoint,
    rng_state,
    set_rng_state,
)
from .checkpointing_dist import (
    load_checkpoint_dist,
    maybe_finalize_async_save,
    save_checkpoint_dist,
)
from .checkpointing_fsdp_dtensor import load_checkpoint_fsdp_dtensor, save_checkpoint_fsdp_dtensor
from .frozen_args import replace_args
from .run import Run
from .utils import get_rank, print_rank_0

# fsdp_dtensor (Megatron-FSDP's): Megatron-LM's own layout, see .checkpointing_fsdp_dtensor.
SAVE_FORMATS = ("torch_dist", "torch", "fsdp_dtensor")
detect_checkpoint_format = detect_format  # the name it has here (tests call it so)


def distrib_optim_path(model_path: str) -> str:
    """Where the distributed optimizer's gathered state sits next to model_optim_rng.pt."""
    return os.path.join(os.path.dirname(model_path), "distrib_optim.pt")


def _check_distributed_optimizer_file(optimizer, path: str) -> None:
    """Fail on every rank together when a rank that reads ``path`` (DP rank 0; with experts also
    expert-DP rank 0) cannot see it (a collective over all ranks, which all load)."""
    missing = torch.zeros(1, device=collective_device())
    if optimizer.holds_any_state_root() and not os.path.isfile(path):
        missing.fill_(1.0)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(missing, op=dist.ReduceOp.MAX)
    if missing.item() > 0:
        raise CheckpointError(
            f"{path} does not exist: the checkpoint was saved without "
            "--use-distributed-optimizer (or with --no-save-optim); pass --no-load-optim"
        )


def _load_distributed_optimizer_state(optimizer, path: str, legacy_rank=None) -> None:
    """Re-shard distrib_optim.pt over this run's DP group (collective); any DP size may load it.
    ``legacy_rank``: the file lays the buffers out in this code base's earlier parameter order
    (see megatron/core/optimizer/param_order.py)."""
    try:
        optimizer.load_parameter_state(path, legacy_rank)
    except ValueError as exc:
        raise CheckpointError(f"{path}: {exc}") from None


def _atomic_save(obj, path: str) -> None:
    tmp = path + ".tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as exc:
        remove_partial(tmp)
        raise CheckpointError(
            f"cannot write checkpoint file {path}: {why_write_failed(exc, tmp)}; the partial "
            "file was removed and the last complete checkpoint is kept"
        ) from None


def _is_torch_format_writer(args, state) -> bool:
    """Whether this rank writes its file ``mp_rank_TT[_PPP][_EEE]``: data-parallel rank 0; with
    experts, expert-data-parallel rank 0 (the file of each (TP, PP, EP) rank holds the dense
    shards and that EP rank's experts: Megatron's torch format has one file per (TP, PP, EP) rank
    too)."""
    if not getattr(args, "num_experts", None):
        return state.get_data_parallel_rank(with_context_parallel=True) == 0
    etp = state.get_expert_tensor_parallel_world_size()
    if etp != state.get_tensor_model_parallel_world_size():
        raise CheckpointError(
            "--ckpt-format torch cannot save experts split differently from the dense layers "
            f"(--expert-tensor-parallel-size {etp}, "
            f"--tensor-model-parallel-size {state.get_tensor_model_parallel_world_size()}): "
            "use --ckpt-format torch_dist"
        )
    return state.get_expert_data_parallel_rank() == 0


def save_checkpoint(
    iteration: int,
    model,
    optimizer,
    opt_param_scheduler,
    num_floating_point_operations_so_far: float = 0.0,
    rerun_state: Optional[dict] = None,
    *,
    run: Optional[Run] = None,
    args=None,
) -> None:
    """Save this rank's shard; rank 0 updates the tracker once every rank is done.

    ``rerun_state``: the rerun state machine's state when it asks for a checkpoint to re-run an
    iteration from (kept in torch_dist checkpoints only, where Megatron's machine keeps it too).
    ``run``: the run saved (default the current one): its groups, RNG streams and progress
    (``run.state``, whose sample counts, last save and data flags go into the saved ``args`` as
    Megatron's).
    ``args``: the flags to save with, default ``run.args`` (a conversion saves with another
    format and directory)."""
    run = run or global_vars.get_run()
    args = args if args is not None else run.args
    state, timers = run.parallel_state, run.timers
    if args.ckpt_format not in SAVE_FORMATS:
        raise CheckpointError(
            f"--ckpt-format {args.ckpt_format} is not supported (use torch_dist or torch)"
        )
    maybe_finalize_async_save(blocking=True, run=run)
    if args.ckpt_format == "fsdp_dtensor":
        if rerun_state is not None:
            print_rank_0(
                "RerunStateMachine checkpoints ONLY SUPPORTED for checkpoint format torch_dist"
            )
        timers("save-checkpoint", log_level=0).start(barrier=True)
        save_checkpoint_fsdp_dtensor(
            iteration,
            model,
            optimizer,
            opt_param_scheduler,
            num_floating_point_operations_so_far,
            run=run,
            args=args,
        )
        timers("save-checkpoint").stop(barrier=True)
        return
    if args.ckpt_format == "torch_dist":
        timers("save-checkpoint", log_level=0).start(barrier=True)
        save_checkpoint_dist(
            iteration,
            model,
            optimizer,
            opt_param_scheduler,
            num_floating_point_operations_so_far,
            rerun_state=rerun_state,
            run=run,
            args=args,
        )
        timers("save-checkpoint").stop(barrier=True)
        return
    save_dir = args.save
    if rerun_state is not None:
        print_rank_0(
            "RerunStateMachine checkpoints ONLY SUPPORTED for checkpoint format torch_dist"
        )
    print_rank_0(f"saving checkpoint at iteration {iteration:7d} to {save_dir} in torch format")
    timers("save-checkpoint", log_level=0).start(barrier=True)

    rng_states = None
    if not args.no_save_rng:
        rng_states = [rng_state(run.rng_tracker)]
        dp_group = state.get_data_parallel_group(with_context_parallel=True)
        if (
            dist.is_initialized()
            and state.get_data_parallel_world_size(with_context_parallel=True) > 1
        ):
            gathered = [None] * state.get_data_parallel_world_size(with_context_parallel=True)
            dist.all_gather_object(gathered, rng_states[0], group=dp_group)
            rng_states = gathered

    path = checkpoint_name(
        save_dir,
        iteration,
        tp_rank=state.get_tensor_model_parallel_rank(),
        pp_rank=state.get_pipeline_model_parallel_rank(),
        pp_size=state.get_pipeline_model_parallel_world_size(),
        ep_rank=state.get_expert_model_parallel_rank(),
        ep_size=state.get_expert_model_parallel_world_size(),
    )
    is_writer = _is_torch_format_writer(args, state)
    if (
        getattr(args, "use_distributed_optimizer", False)
        and not args.no_save_optim
        and optimizer is not None
    ):
        # Every DP rank owns a slice of the optimizer state: gather it (a collective) to DP rank 0
        # (expert slices: to expert-DP rank 0, which writes this EP rank's file).
        param_state = optimizer.parameter_state_for_file()
        if param_state is not None and not is_writer:
            raise CheckpointError(
                f"rank {get_rank()} gathered distributed-optimizer state that no file of the "
                "torch format would hold (use --ckpt-format torch_dist)"
            )
        if is_writer:
            _atomic_save(param_state, distrib_optim_path(path))
        del param_state

    if is_writer:
        chunks = model if isinstance(model, list) else [model]
        state_dict = {
            "args": checkpoint_args(args, run.state),
            "checkpoint_version": CHECKPOINT_VERSION,
            "iteration": iteration,
            "num_floating_point_operations_so_far": float(num_floating_point_operations_so_far),
        }
        # Megatron's model entries, _extra_state included, so that Megatron-LM loads them strictly.
        for i, chunk in enumerate(chunks):
            inner = unwrap_model(chunk)
            key = "model" if len(chunks) == 1 else f"model{i}"
            state_dict[key] = with_extra_state(inner, inner.state_dict())
        if not args.no_save_optim:
            if optimizer is not None:
                state_dict["optimizer"] = optimizer.state_dict()
                state_dict[PARAM_ORDER_KEY] = PARAM_ORDER
            if opt_param_scheduler is not None:
                state_dict["opt_param_scheduler"] = opt_param_scheduler.state_dict()
        if rng_states is not None:
            state_dict["rng_state"] = rng_states
        _atomic_save(state_dict, path)

    barrier()
    digests = integrity_digests(args, checkpoint_dir(save_dir, iteration))
    if get_rank() == 0:
        seal(checkpoint_dir(save_dir, iteration), digests)
        commit_tracker(save_dir, iteration)
    barrier()
    timers("save-checkpoint").stop(barrier=True)
    print_saved_checkpoint(iteration, save_dir, state)
    remove_unretained(args, save_dir, iteration)


def _check_model_state(chunk, saved: dict, path: str, strict: bool) -> None:
    """Fail with a readable list of mismatches instead of a stack of tensor errors."""
    own = chunk.state_dict()
    missing = [k for k in own if k not in saved]
    unexpected = [k for k in saved if k not in own]
    shapes = [
        f"{k}: checkpoint {tuple(saved[k].shape)} vs model {tuple(own[k].shape)}"
        for k in own
        if k in saved and torch.is_tensor(saved[k]) and saved[k].shape != own[k].shape
    ]
    problems = []
    if shapes:
        problems.append("shape mismatches: " + "; ".join(shapes[:5]))
    if strict and missing:
        problems.append("missing in checkpoint: " + ", ".join(missing[:5]))
    if strict and unexpected:
        problems.append("unexpected in checkpoint: " + ", ".join(unexpected[:5]))
    if problems:
        raise CheckpointError(f"checkpoint {path} does not fit this model ({' | '.join(problems)})")


def _legacy_rank(chunks) -> dict:
    """id(param) -> its rank in this code base's earlier parameter order."""
    legacy = legacy_parameter_order(unwrap_model(chunk) for chunk in chunks)
    return {id(param): r for r, param in enumerate(legacy)}


def _in_current_parameter_order(optimizer, chunks, saved: dict) -> dict:
    """The optimizer state of a file without the parameter-order mark: Megatron-LM's (in the
    current order) or one written here before this code base followed megatron-core's
    registration order, whose per-parameter state is moved to the current positions (told
    apart by the shapes of the state, see megatron/core/optimizer/param_order.py)."""
    if not hasattr(optimizer, "state_dict_in_current_order"):
        return saved
    try:
        moved = optimizer.state_dict_in_current_order(saved, _legacy_rank(chunks))
    except KeyError:  # a parameter the model does not have: the load says what does not fit
        return saved
    if moved is None:
        return saved
    print_rank_0(
        " > the optimizer state lists the parameters in this code base's earlier order "
        "(linear_qkv before linear_proj): moved to megatron-core's"
    )
    return moved


def load_checkpoint(
    model,
    optimizer,
    opt_param_scheduler,
    load_arg: str = "load",
    strict: bool = True,
    *,
    run: Optional[Run] = None,
    load_optim: Optional[bool] = None,
    load_rng: Optional[bool] = None,
    exit_on_missing: Optional[bool] = None,
):
    """Load into ``model``/``optimizer``/``opt_param_scheduler``; returns (iteration, flops so far).
    The checkpoint's sample counts go into ``run.state`` (``run``: default the current one).

    A missing checkpoint directory or tracker starts training from scratch with a warning (so
    ``--load`` and ``--save`` may point at the same directory), unless ``exit_on_missing``
    (default --exit-on-missing-checkpoint). A corrupt checkpoint stops with a message naming the
    file. ``load_optim`` / ``load_rng`` (default: unless --no-load-optim / --no-load-rng) load
    the optimizer and scheduler state / the RNG states.
    """
    run = run or global_vars.get_run()
    args, state = run.args, run.parallel_state
    if load_optim is None:
        load_optim = not args.no_load_optim
    if load_rng is None:
        load_rng = not args.no_load_rng
    if exit_on_missing is None:
        exit_on_missing = args.exit_on_missing_checkpoint
    load_dir = getattr(args, load_arg)
    if not os.path.isfile(tracker_path(load_dir)):
        message = f"WARNING: could not find the metadata file {tracker_path(load_dir)}" + (
            "" if os.path.isdir(load_dir) else f" (directory {load_dir} does not exist)"
        )
        converting = getattr(args, "ckpt_convert_format", None) is not None
        if exit_on_missing or converting:
            reason = (
                "--ckpt-convert-format needs a checkpoint"
                if converting
                else "--exit-on-missing-checkpoint is set"
            )
            print_rank_0(f">> {message}; exiting because {reason}")
            barrier()
            sys.exit(1)
        print_rank_0(f"{message}\n    will not load any checkpoints and will start from random")
        return 0, 0.0

    iteration, release = read_tracker(load_dir)
    if getattr(args, "ckpt_step", None) is not None:
        iteration, release = args.ckpt_step, False
    fmt = format_to_load(args, checkpoint_dir(load_dir, iteration, release))
    if getattr(args, "verify_integrity", False):
        verify_checkpoint(checkpoint_dir(load_dir, iteration, release))
        print_rank_0(
            f" > --verify-integrity: {checkpoint_dir(load_dir, iteration, release)} matches"
        )
    if fmt == "torch_dist":
        print_rank_0(
            f" loading checkpoint from {load_dir} at iteration {iteration} (torch_dist format)"
        )
        iteration, flops, _ = load_checkpoint_dist(
            model,
            optimizer,
            opt_param_scheduler,
            load_dir,
            iteration,
            release,
            run=run,
            load_optim=load_optim,
            load_rng=load_rng,
        )
        print_loaded_checkpoint(load_dir, iteration, state)
        return iteration, flops
    if fmt == "fsdp_dtensor":
        print_rank_0(
            f" loading checkpoint from {load_dir} at iteration {iteration} (fsdp_dtensor format)"
        )
        iteration, flops = load_checkpoint_fsdp_dtensor(
            model,
            optimizer,
            opt_param_scheduler,
            load_dir,
            iteration,
            release,
            run=run,
            load_optim=load_optim,
            load_rng=load_rng,
        )
        print_loaded_checkpoint(load_dir, iteration, state)
        return iteration, flops
    path = checkpoint_name(
        load_dir,
        iteration,
        release,
        tp_rank=state.get_tensor_model_parallel_rank(),
        pp_rank=state.get_pipeline_model_parallel_rank(),
        pp_size=state.get_pipeline_model_parallel_world_size(),
        ep_rank=state.get_expert_model_parallel_rank(),
        ep_size=state.get_expert_model_parallel_world_size(),
    )
    print_rank_0(f" loading checkpoint from {load_dir} at iteration {iteration}")
    state_dict = load_torch_file(path)

    ckpt_args = state_dict.get("args")
    check_model_args(ckpt_args, args, run.model_family.checkpoint_model_args, path)

    chunks = model if isinstance(model, list) else [model]
    for i, chunk in enumerate(chunks):
        key = "model" if len(chunks) == 1 else f"model{i}"
        if key not in state_dict:
            raise CheckpointError(f"checkpoint {path} has no '{key}' entry")
        inner = unwrap_model(chunk)
        saved = without_extra_state(state_dict[key])  # Megatron-LM's, and ours
        _check_model_state(inner, saved, path, strict)
        inner.load_state_dict(saved, strict=strict)

    finetune = args.finetune or release
    if finetune:
        iteration = 0
    else:
        iteration = state_dict.get("iteration", iteration)
        if ckpt_args is not None:
            run.state.restore_sample_counts(ckpt_args)

    if not finetune and load_optim:
        if "optimizer" not in state_dict:
            raise CheckpointError(
                f"checkpoint {path} holds no optimizer state (saved with --no-save-optim?); "
                "pass --no-load-optim or --finetune"
            )
        saved_distributed = bool(getattr(ckpt_args, "use_distributed_optimizer", False))
        if ckpt_args is not None and saved_distributed != bool(
            getattr(args, "use_distributed_optimizer", False)
        ):
            raise CheckpointError(
                f"checkpoint {path} was saved {'with' if saved_distributed else 'without'} "
                f"--use-distributed-optimizer and this run is "
                f"{'without' if saved_distributed else 'with'} it: "
                "the torch format keeps the two optimizer states in different layouts; "
                "pass --no-load-optim to start a fresh optimizer from the loaded weights"
            )
        if optimizer is not None:
            if getattr(args, "use_distributed_optimizer", False):
                _check_distributed_optimizer_file(optimizer, distrib_optim_path(path))
            saved_optimizer = state_dict["optimizer"]
            if PARAM_ORDER_KEY not in state_dict:
                saved_optimizer = _in_current_parameter_order(optimizer, chunks, saved_optimizer)
            try:
                optimizer.load_state_dict(saved_optimizer)
            except (KeyError, ValueError) as exc:
                raise CheckpointError(
                    f"checkpoint {path}: the optimizer state does not fit this run "
                    f"({type(exc).__name__}: {exc}); pass --no-load-optim to load the model "
                    "only"
                ) from None
            if getattr(args, "use_distributed_optimizer", False):
                # Our distrib_optim.pt layout (per-bucket lists) is this code base's own: a file
                # without the order mark was written here, in the earlier order.
                legacy_rank = None
                if PARAM_ORDER_KEY not in state_dict:
                    legacy_rank = _legacy_rank(chunks)
                _load_distributed_optimizer_state(optimizer, distrib_optim_path(path), legacy_rank)
        if opt_param_scheduler is not None and "opt_param_scheduler" in state_dict:
            opt_param_scheduler.load_state_dict(state_dict["opt_param_scheduler"])
    elif optimizer is not None and hasattr(optimizer, "reload_model_params"):
        # Master weights must follow the freshly loaded model weights.
        optimizer.reload_model_params()

    if not finetune and load_rng and "rng_state" in state_dict:
        rng_states = state_dict["rng_state"]
        dp_rank = state.get_data_parallel_rank(with_context_parallel=True)
        chosen = (
            rng_states[dp_rank]
            if isinstance(rng_states, list) and dp_rank < len(rng_states)
            else (rng_states[0] if isinstance(rng_states, list) else rng_states)
        )
        set_rng_state(chosen, run.rng_tracker)

    barrier()
    print_loaded_checkpoint(load_dir, iteration, state)
    return iteration, float(state_dict.get("num_floating_point_operations_so_far", 0.0))


def convert_checkpoint_and_exit(
    model, optimizer, opt_param_scheduler, *, run: Optional[Run] = None
) -> None:
    """``--ckpt-convert-format F --ckpt-convert-save DIR``: re-save what was just loaded in format
    F under ``DIR/F`` (Megatron's layout) and end the process. The checkpoint's saved args are
    the run's with the target format and directory (as Megatron's, which sets them on its args)."""
    run = run or global_vars.get_run()
    source = run.args.ckpt_format
    target = run.args.ckpt_convert_format
    args = replace_args(
        run.args,
        ckpt_format=target,
        async_save=False,
        save=os.path.join(run.args.ckpt_convert_save, target),
        use_dist_ckpt=target != "torch",
    )
    state = run.state
    save_checkpoint(
        state.iteration,
        model,
        optimizer,
        opt_param_scheduler,
        state.num_floating_point_operations_so_far,
        run=run,
        args=args,
    )
    print_rank_0(f"> converted checkpoint: {source} -> {args.ckpt_format} (saved to {args.save})")
    barrier()
    sys.exit(0)
