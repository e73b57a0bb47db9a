"""Checkpoints in Megatron's ``torch`` format.

Layout: ``<save>/iter_0000100/mp_rank_00/model_optim_rng.pt`` (``mp_rank_TT_PPP`` with pipeline
parallelism) and ``<save>/latest_checkpointed_iteration.txt``. Each file is written under a
temporary name and renamed; the tracker is written by rank 0 only after every rank has finished,
so an interrupted save never leaves the tracker pointing at an incomplete checkpoint.

Loading uses ``torch.load(weights_only=True)``: nothing in a checkpoint can run code. ``args`` is
stored as an ``argparse.Namespace`` holding only plain values (allow-listed for the loader);
numpy's RNG state is stored as tensors and plain values.
"""
from __future__ import annotations

import argparse
import enum
import os
import random
import sys

import numpy as np
import torch
import torch.distributed as dist

from . import global_vars
from .utils import get_rank, print_rank_0

CHECKPOINT_VERSION = 3.0
TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
_PLAIN = (int, float, str, bool, type(None))


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file."""


def tracker_path(checkpoints_path: str) -> str:
    return os.path.join(checkpoints_path, TRACKER_FILENAME)


def checkpoint_dir(checkpoints_path: str, iteration, release: bool = False) -> str:
    return os.path.join(checkpoints_path, "release" if release else "iter_{:07d}".format(iteration))


def checkpoint_name(checkpoints_path: str, iteration, release: bool = False, tp_rank: int = 0, pp_rank: int = 0,
                    pp_size: int = 1, ep_rank: int = 0, ep_size: int = 1) -> str:
    """``.../iter_XXXXXXX/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`` as Megatron names it."""
    name = f"mp_rank_{tp_rank:02d}"
    if pp_size > 1:
        name += f"_{pp_rank:03d}"
    if ep_size > 1:
        name += f"_{ep_rank:03d}"
    return os.path.join(checkpoint_dir(checkpoints_path, iteration, release), name, "model_optim_rng.pt")


def _plain(value):
    if type(value) in _PLAIN or isinstance(value, torch.dtype):
        return value, True
    if isinstance(value, enum.Enum):  # e.g. signal.Signals: store the plain value
        return _plain(value.value)
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        if all(ok for _, ok in items):
            return type(value)(v for v, _ in items), True
    if isinstance(value, dict):
        items = {k: _plain(v) for k, v in value.items() if isinstance(k, str)}
        if all(ok for _, ok in items.values()):
            return {k: v for k, (v, _) in items.items()}, True
    return None, False


def _checkpoint_args(args) -> argparse.Namespace:
    """A copy of ``args`` with only plain values, so it loads under ``weights_only=True``."""
    saved = argparse.Namespace()
    for key, value in vars(args).items():
        plain, ok = _plain(value)
        if ok:
            setattr(saved, key, plain)
    return saved


def _rng_state(tracker) -> dict:
    np_state = np.random.get_state()
    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": {"name": np_state[0], "keys": torch.from_numpy(np_state[1].astype(np.int64)),
                         "pos": int(np_state[2]), "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "rng_tracker_states": tracker.get_states() if tracker is not None else {},
    }
    return state


def _set_rng_state(state: dict, tracker) -> None:
    random.setstate(_as_random_state(state["random_rng_state"]))
    np_state = state["np_rng_state"]
    if isinstance(np_state, dict):
        np.random.set_state((np_state["name"], np_state["keys"].numpy().astype(np.uint32), np_state["pos"],
                             np_state["has_gauss"], np_state["cached_gaussian"]))
    else:
        np.random.set_state(np_state)
    torch.set_rng_state(state["torch_rng_state"])
    if torch.cuda.is_available() and state.get("cuda_rng_state") is not None:
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    if tracker is not None and state.get("rng_tracker_states"):
        tracker.set_states(state["rng_tracker_states"])


def _as_random_state(value):
    # torch.load turns the inner tuple of random.getstate() into a list; random wants tuples.
    version, internal, gauss = value
    return (version, tuple(internal), gauss)


def _unwrap(model_chunk):
    while hasattr(model_chunk, "module"):
        model_chunk = model_chunk.module
    return model_chunk


def _atomic_save(obj, path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(iteration: int, model, optimizer, opt_param_scheduler,
                    num_floating_point_operations_so_far: float = 0.0) -> None:
    """Save this rank's shard; rank 0 updates the tracker once every rank is done."""
    args = global_vars.get_args()
    state = global_vars.get_parallel_state()
    timers = global_vars.get_timers()
    if args.ckpt_format != "torch":
        raise CheckpointError(f"not supported yet: --ckpt-format {args.ckpt_format} (pass --ckpt-format torch)")
    save_dir = args.save
    print_rank_0(f"saving checkpoint at iteration {iteration:7d} to {save_dir} in torch format")
    timers("save-checkpoint", log_level=0).start(barrier=True)

    tracker = global_vars.get_rng_tracker()
    rng_state = None
    if not args.no_save_rng:
        rng_state = [_rng_state(tracker)]
        dp_group = state.get_data_parallel_group(with_context_parallel=True)
        if dist.is_initialized() and state.get_data_parallel_world_size(with_context_parallel=True) > 1:
            gathered = [None] * state.get_data_parallel_world_size(with_context_parallel=True)
            dist.all_gather_object(gathered, rng_state[0], group=dp_group)
            rng_state = gathered

    if state.get_data_parallel_rank(with_context_parallel=True) == 0:
        chunks = model if isinstance(model, list) else [model]
        state_dict = {
            "args": _checkpoint_args(args),
            "checkpoint_version": CHECKPOINT_VERSION,
            "iteration": iteration,
            "num_floating_point_operations_so_far": float(num_floating_point_operations_so_far),
        }
        if len(chunks) == 1:
            state_dict["model"] = _unwrap(chunks[0]).state_dict()
        else:
            for i, chunk in enumerate(chunks):
                state_dict[f"model{i}"] = _unwrap(chunk).state_dict()
        if not args.no_save_optim:
            if optimizer is not None:
                state_dict["optimizer"] = optimizer.state_dict()
            if opt_param_scheduler is not None:
                state_dict["opt_param_scheduler"] = opt_param_scheduler.state_dict()
        if rng_state is not None:
            state_dict["rng_state"] = rng_state
        path = checkpoint_name(save_dir, iteration, tp_rank=state.get_tensor_model_parallel_rank(),
                               pp_rank=state.get_pipeline_model_parallel_rank(),
                               pp_size=state.get_pipeline_model_parallel_world_size(),
                               ep_rank=state.get_expert_model_parallel_rank(),
                               ep_size=state.get_expert_model_parallel_world_size())
        _atomic_save(state_dict, path)

    _barrier()
    if get_rank() == 0:
        tmp = tracker_path(save_dir) + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(iteration))
        os.replace(tmp, tracker_path(save_dir))
    _barrier()
    timers("save-checkpoint").stop(barrier=True)
    print_rank_0("  successfully saved checkpoint from iteration {:7d} to {} [ t {}/{}, p {}/{} ]".format(
        iteration, save_dir, state.get_tensor_model_parallel_rank() + 1, state.get_tensor_model_parallel_world_size(),
        state.get_pipeline_model_parallel_rank() + 1, state.get_pipeline_model_parallel_world_size()))
    _remove_unretained(args, iteration)


def _remove_unretained(args, iteration):
    """Nothing yet: --save-retain-interval lands with the checkpoint issue."""


def read_tracker(load_dir: str):
    """(iteration, release) from the tracker; raises CheckpointError on a corrupt tracker."""
    path = tracker_path(load_dir)
    with open(path) as f:
        text = f.read().strip()
    if text == "release":
        return 0, True
    try:
        iteration = int(text)
    except ValueError:
        raise CheckpointError(f"{path} holds '{text[:40]}', expected an iteration number or 'release'") from None
    if iteration < 0:
        raise CheckpointError(f"{path} holds a negative iteration ({iteration})")
    return iteration, False


def _load_file(path: str) -> dict:
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} does not exist (the tracker points at an incomplete "
                              "or deleted checkpoint, or it was saved with another parallel layout)")
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for truncated or foreign files
        lines = [l.strip() for l in str(exc).splitlines() if l.strip()]
        reason = next((l for l in lines if "Unpickler error" in l), lines[0] if lines else "")
        raise CheckpointError(f"cannot read checkpoint file {path}: {type(exc).__name__}: {reason}") from None


def _check_model_state(chunk, saved: dict, path: str, strict: bool) -> None:
    """Fail with a readable list of mismatches instead of a stack of tensor errors."""
    own = chunk.state_dict()
    missing = [k for k in own if k not in saved]
    unexpected = [k for k in saved if k not in own]
    shapes = [f"{k}: checkpoint {tuple(saved[k].shape)} vs model {tuple(own[k].shape)}"
              for k in own if k in saved and torch.is_tensor(saved[k]) and saved[k].shape != own[k].shape]
    problems = []
    if shapes:
        problems.append("shape mismatches: " + "; ".join(shapes[:5]))
    if strict and missing:
        problems.append("missing in checkpoint: " + ", ".join(missing[:5]))
    if strict and unexpected:
        problems.append("unexpected in checkpoint: " + ", ".join(unexpected[:5]))
    if problems:
        raise CheckpointError(f"checkpoint {path} does not fit this model ({' | '.join(problems)})")


_MODEL_ARGS_TO_CHECK = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                        "padded_vocab_size", "max_position_embeddings", "num_query_groups", "kv_channels")


def load_checkpoint(model, optimizer, opt_param_scheduler, load_arg: str = "load", strict: bool = True):
    """Load into ``model``/``optimizer``/``opt_param_scheduler``; returns (iteration, flops so far).

    A missing checkpoint directory or tracker starts training from scratch with a warning (so
    ``--load`` and ``--save`` may point at the same directory), unless
    ``--exit-on-missing-checkpoint``. A corrupt checkpoint stops with a message naming the file.
    """
    args = global_vars.get_args()
    state = global_vars.get_parallel_state()
    load_dir = getattr(args, load_arg)
    if args.ckpt_format != "torch":
        raise CheckpointError(f"not supported yet: --ckpt-format {args.ckpt_format} (pass --ckpt-format torch)")
    if not os.path.isfile(tracker_path(load_dir)):
        message = (f"WARNING: could not find the metadata file {tracker_path(load_dir)}"
                   + ("" if os.path.isdir(load_dir) else f" (directory {load_dir} does not exist)"))
        if args.exit_on_missing_checkpoint:
            print_rank_0(f">> {message}; exiting because --exit-on-missing-checkpoint is set")
            _barrier()
            sys.exit(1)
        print_rank_0(f"{message}\n    will not load any checkpoints and will start from random")
        return 0, 0.0

    iteration, release = read_tracker(load_dir)
    if getattr(args, "ckpt_step", None) is not None:
        iteration, release = args.ckpt_step, False
    path = checkpoint_name(load_dir, iteration, release, tp_rank=state.get_tensor_model_parallel_rank(),
                           pp_rank=state.get_pipeline_model_parallel_rank(),
                           pp_size=state.get_pipeline_model_parallel_world_size(),
                           ep_rank=state.get_expert_model_parallel_rank(),
                           ep_size=state.get_expert_model_parallel_world_size())
    print_rank_0(f" loading checkpoint from {load_dir} at iteration {iteration}")
    state_dict = _load_file(path)

    ckpt_args = state_dict.get("args")
    if ckpt_args is not None:
        for name in _MODEL_ARGS_TO_CHECK:
            ours, theirs = getattr(args, name, None), getattr(ckpt_args, name, None)
            if ours is not None and theirs is not None and ours != theirs:
                raise CheckpointError(f"checkpoint {path} was saved with --{name.replace('_', '-')} {theirs}, "
                                      f"but this run uses {ours}")

    chunks = model if isinstance(model, list) else [model]
    for i, chunk in enumerate(chunks):
        key = "model" if len(chunks) == 1 else f"model{i}"
        if key not in state_dict:
            raise CheckpointError(f"checkpoint {path} has no '{key}' entry")
        inner = _unwrap(chunk)
        _check_model_state(inner, state_dict[key], path, strict)
        inner.load_state_dict(state_dict[key], strict=strict)

    finetune = args.finetune or release
    if finetune:
        iteration = 0
    else:
        iteration = state_dict.get("iteration", iteration)
        if ckpt_args is not None:
            args.consumed_train_samples = getattr(ckpt_args, "consumed_train_samples", 0)
            args.skipped_train_samples = getattr(ckpt_args, "skipped_train_samples", 0)
            args.consumed_valid_samples = getattr(ckpt_args, "consumed_valid_samples", 0)

    if not finetune and not args.no_load_optim:
        if "optimizer" not in state_dict:
            raise CheckpointError(f"checkpoint {path} holds no optimizer state (saved with --no-save-optim?); "
                                  "pass --no-load-optim or --finetune")
        if optimizer is not None:
            optimizer.load_state_dict(state_dict["optimizer"])
        if opt_param_scheduler is not None and "opt_param_scheduler" in state_dict:
            opt_param_scheduler.load_state_dict(state_dict["opt_param_scheduler"])
    elif optimizer is not None and hasattr(optimizer, "reload_model_params"):
        # Master weights must follow the freshly loaded model weights.
        optimizer.reload_model_params()

    if not finetune and not args.no_load_rng and "rng_state" in state_dict:
        rng_states = state_dict["rng_state"]
        dp_rank = state.get_data_parallel_rank(with_context_parallel=True)
        chosen = rng_states[dp_rank] if isinstance(rng_states, list) and dp_rank < len(rng_states) else (
            rng_states[0] if isinstance(rng_states, list) else rng_states)
        tracker = global_vars.get_rng_tracker()
        _set_rng_state(chosen, tracker)

    _barrier()
    print_rank_0("  successfully loaded checkpoint from {} [ t {}/{}, p {}/{} ] at iteration {}".format(
        load_dir, state.get_tensor_model_parallel_rank() + 1, state.get_tensor_model_parallel_world_size(),
        state.get_pipeline_model_parallel_rank() + 1, state.get_pipeline_model_parallel_world_size(), iteration))
    return iteration, float(state_dict.get("num_floating_point_operations_so_far", 0.0))
