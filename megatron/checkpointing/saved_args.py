"""The ``args`` Namespace a checkpoint stores (Megatron's ``checkpoint["args"]``), and reading it
back: the model-flag check of a load, ``--use-checkpoint-args``, and the older dest names that
checkpoints written before hold.
"""

from __future__ import annotations

import argparse
import enum
import os

import torch

from .errors import CheckpointError
from .layout import (
    checkpoint_dir,
    detect_format,
    format_to_load,
    load_torch_file,
    read_tracker,
    tracker_path,
)

_PLAIN = (int, float, str, bool, type(None))

# Checkpoints saved before the dests took Megatron's current names hold the old ones.
OLD_ARG_NAMES = {
    "layernorm_zero_centered_gamma": "apply_layernorm_1p",
    "layernorm_epsilon": "norm_epsilon",
}

# Model-shape flags --use-checkpoint-args reads back (Megatron's list): the forced ones replace
# the command line's value, the others fill in only flags left unset.
# The settings of multi-latent attention's shape and positions (one name per flag).
MLA_ARGS = (
    "q_lora_rank",
    "kv_lora_rank",
    "qk_head_dim",
    "qk_pos_emb_head_dim",
    "v_head_dim",
    "rope_type",
    "rotary_scaling_factor",
    "mscale",
    "mscale_all_dim",
    "yarn_original_max_position_embeddings",
    "yarn_beta_fast",
    "yarn_beta_slow",
    "yarn_correction_range_round_to_int",
)
_FORCED_CHECKPOINT_ARGS = (
    "num_query_groups",
    "group_query_attention",
    "position_embedding_type",
    "add_position_embedding",
    "use_rotary_position_embeddings",
    "rotary_percent",
    "rotary_interleaved",
    "rotary_base",
    "add_bias_linear",
    "add_qkv_bias",
    "swiglu",
    "squared_relu",
    "untie_embeddings_and_output_weights",
    "layernorm_zero_centered_gamma",
    "normalization",
    "qk_layernorm",
    "layernorm_epsilon",
    # Multi-latent attention: its shape and its positions (a server built without them would
    # not load the checkpoint, or would rotate differently).
    "multi_latent_attention",
    *MLA_ARGS,
)
_UNSET_CHECKPOINT_ARGS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "seq_length",
    "num_attention_heads",
    "kv_channels",
    "max_position_embeddings",
    "tokenizer_type",
    "padded_vocab_size",
    "vocab_size",
)
_PARALLEL_CHECKPOINT_ARGS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "num_layers_per_virtual_pipeline_stage",
)


# ------------------------------------------------------------------------------ saving
def _plain(value):
    if type(value) in _PLAIN or isinstance(value, torch.dtype):
        return value, True
    if isinstance(value, enum.IntEnum):  # e.g. signal.Signals: store the number
        return _plain(value.value)
    if isinstance(value, enum.Enum):  # e.g. AttnBackend: store the name the flag takes
        return value.name, True
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        if all(ok for _, ok in items):
            return type(value)(v for v, _ in items), True
    if isinstance(value, dict):
        items = {k: _plain(v) for k, v in value.items() if isinstance(k, str)}
        if all(ok for _, ok in items.values()):
            return {k: v for k, (v, _) in items.items()}, True
    return None, False


def checkpoint_args(args, state=None) -> argparse.Namespace:
    """A copy of ``args`` with only plain values, so it loads under ``weights_only=True``.

    ``state`` (the run's TrainState) supplies Megatron's run-state names (its ``args_entries()``:
    consumed samples, iteration, ...), which Megatron's trainer keeps on its args: each takes its
    place among the dests where validation put it (frozen args tell their ``dest_order()``), the
    others follow the dests, in the order Megatron's trainer adds them."""
    values = vars(args)
    if state is not None:
        values = _with_run_state(args, state.args_entries())
    saved = argparse.Namespace()
    for key, value in values.items():
        plain, ok = _plain(value)
        if ok:
            setattr(saved, key, plain)
    return saved


def _with_run_state(args, entries: dict) -> dict:
    own = vars(args)
    order = args.dest_order() if hasattr(type(args), "dest_order") else tuple(own)
    merged = {}
    for key in order:
        if key in entries:
            merged[key] = entries[key]
        elif key in own:
            merged[key] = own[key]
    for source in (own, entries):
        for key, value in source.items():
            merged.setdefault(key, value)
    return merged


# ------------------------------------------------------------------------------ reading
def saved_value(saved, name: str, default=None):
    """Flag ``name`` (its dest) from a checkpoint's args, also from a checkpoint that holds it
    under its older dest (OLD_ARG_NAMES)."""
    if hasattr(saved, name):
        return getattr(saved, name)
    old = OLD_ARG_NAMES.get(name)
    return getattr(saved, old, default) if old is not None else default


def check_model_args(ckpt_args, args, model_arg_names, path: str) -> None:
    """Refuse a checkpoint whose model flags differ from this run's: a model with other heads or
    groups can have the very same tensor shapes, so loading it would train another model."""
    if ckpt_args is None:
        return
    for name in model_arg_names:
        ours, theirs = getattr(args, name, None), getattr(ckpt_args, name, None)
        if ours is not None and theirs is not None and ours != theirs:
            raise CheckpointError(
                f"checkpoint {path} was saved with --{name.replace('_', '-')} {theirs}, "
                f"but this run uses {ours}"
            )


def read_checkpoint_args(load_dir: str, ckpt_step=None):
    """The ``args`` stored in the checkpoint the tracker of ``load_dir`` (or ``ckpt_step``) names,
    from either format; None when there is no checkpoint."""
    if not os.path.isfile(tracker_path(load_dir)):
        return None
    iteration, release = read_tracker(load_dir)
    if ckpt_step is not None:
        iteration, release = ckpt_step, False
    directory = checkpoint_dir(load_dir, iteration, release)
    fmt = detect_format(directory)
    if fmt == "torch_dist":
        from megatron.core.dist_checkpointing import CheckpointingError, load_common

        try:
            return load_common(directory, safe_globals=[argparse.Namespace]).get("args")
        except CheckpointingError as exc:
            raise CheckpointError(str(exc)) from None
    if fmt == "fsdp_dtensor":  # its args are one plain object of the DCP directory
        from megatron.core.dist_checkpointing import CheckpointingError, PlainObject, load_shards

        request = PlainObject("args", None, read_back=True)
        try:
            load_shards({"args": request}, directory, bare_dcp=True)
        except CheckpointingError as exc:
            raise CheckpointError(str(exc)) from None
        return request.data
    if fmt == "torch":
        first = sorted(n for n in os.listdir(directory) if n.startswith("mp_rank_"))[0]
        return load_torch_file(os.path.join(directory, first, "model_optim_rng.pt")).get("args")
    format_to_load(
        argparse.Namespace(ckpt_format="torch_dist"), directory
    )  # raises the clear error
    return None


_MISSING = object()


def load_args_from_checkpoint(args, load_arg: str = "load"):
    """``--use-checkpoint-args``: take the model-shape flags from the checkpoint's saved args
    (before the args are validated), printing each change. ``--use-mp-args-from-checkpoint-args``
    also takes the parallel sizes. Returns ``args``."""
    load_dir = getattr(args, load_arg, None)
    if load_dir is None:
        raise CheckpointError("--use-checkpoint-args needs --load")
    # Runs before torch.distributed starts: every process reads the file, rank 0 reports.
    say = print if getattr(args, "rank", 0) == 0 else (lambda *a, **k: None)
    saved = read_checkpoint_args(load_dir, getattr(args, "ckpt_step", None))
    if saved is None:
        say(
            f"WARNING: no checkpoint in {load_dir} to read arguments from; using the command line's"
        )
        return args
    names = [(n, True) for n in _FORCED_CHECKPOINT_ARGS] + [
        (n, False) for n in _UNSET_CHECKPOINT_ARGS
    ]
    if getattr(args, "use_mp_args_from_checkpoint_args", False):
        names += [(n, True) for n in _PARALLEL_CHECKPOINT_ARGS]
    for name, forced in names:
        theirs = saved_value(saved, name, _MISSING)
        if theirs is _MISSING:
            continue
        ours = getattr(args, name, None)
        if theirs == ours:
            continue
        if not forced and ours is not None:
            say(
                f" > keeping --{name.replace('_', '-')} {ours} from the command line "
                f"(the checkpoint has {theirs})",
                flush=True,
            )
            continue
        say(f" > setting {name} to {theirs} from checkpoint (was {ours})", flush=True)
        setattr(args, name, theirs)
    return args
