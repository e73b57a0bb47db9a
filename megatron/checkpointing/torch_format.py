"""Our ``torch``-format checkpoints seen offline as one unsharded model with global tensor names.

Both directions speak *global* names and *full* tensors: ``embedding.word_embeddings.weight``,
``decoder.layers.<global index>.self_attention.linear_qkv.weight``, ``output_layer.weight``...
(with SwiGLU the full ``mlp.linear_fc1.weight`` is [gate; up]). That is also how a
``torch_dist`` checkpoint names its tensors, so :mod:`.dist_format` reads one with the same
methods (``names()`` / ``has(name)`` / ``tensor(name)``); the converter plugins above do not
change.

Layout handled here: ``<dir>/{iter_XXXXXXX|release}/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt``
with a ``model`` entry (or ``model0``, ``model1``... with virtual stages); TP shards split as the
layers split them (:mod:`.tp_shards`); each pipeline chunk numbers its layers from 0 (Megatron's
state dicts), the global index being ``PipelineLayerSplit.offset_for(pp_rank, chunk) + local``.
"""

from __future__ import annotations

import argparse
import os
import re
from typing import Dict, List, Optional, Tuple

import torch

from megatron.core.dist_checkpointing.megatron_layout import EMPTY_EXTRA_STATE, extra_state_names
from megatron.core.dist_checkpointing.safe_objects import megatron_state_globals
from megatron.core.pipeline_parallel.layer_split import compute_layer_split

from .errors import ConversionError
from .layout import (
    CHECKPOINT_VERSION,
    checkpoint_name,
    commit_tracker,
    detect_format,
    find_iteration_dir,
)
from .saved_args import checkpoint_args
from .tp_shards import EXPERT, LAYER, mamba_part_sizes, merge_shards, split_full


def layer_split_from_args(args, num_layers: int, pp: int, vpp: Optional[int]):
    return compute_layer_split(
        num_layers,
        pp,
        vpp,
        getattr(args, "decoder_first_pipeline_num_layers", None),
        getattr(args, "decoder_last_pipeline_num_layers", None),
        bool(getattr(args, "account_for_embedding_in_pipeline_split", False)),
        bool(getattr(args, "account_for_loss_in_pipeline_split", False)),
        getattr(args, "pipeline_model_parallel_layout", None),
    )


def _load(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConversionError(f"checkpoint file {path} does not exist")
    try:
        # numpy arrays (Megatron-LM's numpy RNG state) and the rerun machine's records, as the
        # trainer reads them (layout.load_torch_file)
        with torch.serialization.safe_globals([argparse.Namespace, *megatron_state_globals()]):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # truncated or foreign files raise several types
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ConversionError(
            f"cannot read checkpoint file {path}: {type(exc).__name__}: {first}"
        ) from None


class TorchCheckpointReader:
    """Every shard of one torch-format checkpoint (memory-mapped), read back as full tensors."""

    def __init__(self, load_dir: str):
        self.iteration_dir, self.iteration, self.release = find_iteration_dir(load_dir)
        fmt = detect_format(self.iteration_dir)
        if fmt is None:
            raise ConversionError(
                f"{self.iteration_dir} holds neither a torch-format (mp_rank_*) nor a torch_dist "
                "(metadata.json) checkpoint"
            )
        if fmt != "torch":
            raise ConversionError(
                f"{self.iteration_dir} is a {fmt} checkpoint; only --ckpt-format torch "
                "checkpoints can be converted so far"
            )
        names = sorted(n for n in os.listdir(self.iteration_dir) if n.startswith("mp_rank_"))
        parts = []
        for n in names:
            numbers = n[len("mp_rank_") :].split("_")
            if not all(p.isdigit() for p in numbers) or len(numbers) > 3:
                raise ConversionError(f"unexpected entry {n} in {self.iteration_dir}")
            parts.append([int(p) for p in numbers])
        # mp_rank_TT[_PPP][_EEE]: with two numbers the args tell whether the second is PP or EP.
        some = _load(os.path.join(self.iteration_dir, names[0], "model_optim_rng.pt"))
        saved = some.get("args")
        pp_size = getattr(saved, "pipeline_model_parallel_size", 1) or 1
        ep_size = getattr(saved, "expert_model_parallel_size", 1) or 1
        ranks = []
        for numbers in parts:
            t = numbers[0]
            p = numbers[1] if pp_size > 1 and len(numbers) > 1 else 0
            e = numbers[-1] if ep_size > 1 and len(numbers) > 1 else 0
            ranks.append((t, p, e))
        self.tp = max(r[0] for r in ranks) + 1
        self.pp = max(r[1] for r in ranks) + 1
        self.ep = max(r[2] for r in ranks) + 1
        if len(set(ranks)) != self.tp * self.pp * self.ep or len(ranks) != len(set(ranks)):
            raise ConversionError(
                f"{self.iteration_dir} holds {len(ranks)} mp_rank_* entries, expected "
                f"TP x PP x EP = {self.tp} x {self.pp} x {self.ep}; the checkpoint is incomplete"
            )
        self.files = {}
        for t, p, e in ranks:
            path = checkpoint_name(
                os.path.dirname(self.iteration_dir),
                self.iteration,
                self.release,
                tp_rank=t,
                pp_rank=p,
                pp_size=self.pp,
                ep_rank=e,
                ep_size=self.ep,
            )
            self.files[(t, p, e)] = _load(path)
        first = self.files[(0, 0, 0)]
        self.args = first.get("args")
        if self.args is None:
            raise ConversionError(
                f"{self.iteration_dir}: the checkpoint holds no 'args'; cannot tell the model shape"
            )
        self.checkpoint_iteration = first.get("iteration", self.iteration)
        for flag, ours in (
            ("tensor_model_parallel_size", self.tp),
            ("pipeline_model_parallel_size", self.pp),
            ("expert_model_parallel_size", self.ep),
        ):
            saved = getattr(self.args, flag, ours)
            if saved != ours:
                raise ConversionError(
                    f"{self.iteration_dir}: args say {flag}={saved} but the directory has "
                    f"{ours} ranks in that dimension"
                )
        self.swiglu = bool(getattr(self.args, "swiglu", False))
        self.parts = mamba_part_sizes(self.args)
        chunk_keys = sorted(k for k in first if re.fullmatch(r"model\d*", k))
        if chunk_keys == ["model"]:
            self.chunk_keys = ["model"]
        else:
            self.chunk_keys = [f"model{i}" for i in range(len(chunk_keys))]
            if sorted(chunk_keys) != sorted(self.chunk_keys):
                raise ConversionError(
                    f"{self.iteration_dir}: unexpected model entries {chunk_keys}"
                )
        vpp = len(self.chunk_keys) if self.chunk_keys != ["model"] else None
        self.split = layer_split_from_args(self.args, self.args.num_layers, self.pp, vpp)
        self._index = self._build_index()

    def _build_index(self) -> Dict[str, List[Tuple[Tuple[int, int, int], str, str]]]:
        """global name -> [(file key, chunk key, local name) for each TP rank]. Experts are
        read from the file of their EP rank and numbered globally; the rest from EP rank 0."""
        index: Dict[str, list] = {}
        experts = getattr(self.args, "num_experts", None) or 0
        per_rank = experts // self.ep if experts else 0
        for p in range(self.pp):
            for c, chunk_key in enumerate(self.chunk_keys):
                offset = self.split.offset_for(p, c)
                count = self.split.num_layers_for(p, c)
                for t in range(self.tp):
                    for e in range(self.ep):
                        state = self.files[(t, p, e)].get(chunk_key)
                        if state is None:
                            raise ConversionError(
                                f"mp_rank {t:02d}_{p:03d}_{e:03d} has no '{chunk_key}' entry"
                            )
                        for local, tensor in state.items():
                            if local.endswith("_extra_state"):
                                continue
                            name = self._global_name(local, offset, count, p, c)
                            expert = EXPERT.match(name)
                            if expert:
                                g = e * per_rank + int(expert.group(2))
                                name = f"{expert.group(1)}{g}{expert.group(3)}"
                            elif e != 0:
                                continue
                            index.setdefault(name, [None] * self.tp)
                            if index[name][t] is None:  # tied copy on the last stage: first's
                                index[name][t] = ((t, p, e), chunk_key, local)
        return index

    def _global_name(self, local: str, offset: int, count: int, p: int, c: int) -> str:
        m = LAYER.match(local)
        if not m:
            return local
        i = int(m.group(2))
        if i >= count:
            raise ConversionError(
                f"pipeline stage {p} chunk {c} holds layer {i} but the layer split of the "
                f"checkpoint's args gives it {count} layers"
            )
        return f"{m.group(1)}.layers.{offset + i}.{m.group(3)}"

    def names(self) -> List[str]:
        return list(self._index)

    def has(self, name: str) -> bool:
        return name in self._index

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self._index:
            raise ConversionError(f"{self.iteration_dir}: no tensor '{name}' in the checkpoint")
        shards = [self.files[f][c][local] for f, c, local in self._index[name]]
        return merge_shards(name, shards, self.swiglu, self.parts)


class TorchCheckpointWriter:
    """Collects full tensors by global name, then writes every (TP, PP) shard file and the
    tracker."""

    def __init__(
        self,
        save_dir: str,
        args: argparse.Namespace,
        iteration: int,
        release: bool,
        dtype: torch.dtype,
        swiglu: bool,
    ):
        self.save_dir = save_dir
        self.args = args
        self.iteration = iteration
        self.release = release
        self.dtype = dtype
        self.swiglu = swiglu
        self.parts = mamba_part_sizes(args)
        self.tp = args.tensor_model_parallel_size
        self.pp = args.pipeline_model_parallel_size
        vpp = args.virtual_pipeline_model_parallel_size
        self.split = layer_split_from_args(args, args.num_layers, self.pp, vpp)
        self.num_chunks = self.split.num_chunks
        self.states = {
            (t, p, c): {}
            for t in range(self.tp)
            for p in range(self.pp)
            for c in range(self.num_chunks)
        }
        self.tied = not args.untie_embeddings_and_output_weights
        self.ep = getattr(args, "expert_model_parallel_size", 1) or 1
        experts = getattr(args, "num_experts", None) or 0
        if experts % self.ep:
            raise ConversionError(
                f"{experts} experts cannot be split over --target-expert-parallel-size {self.ep}"
            )
        self.experts_per_rank = experts // self.ep if experts else 0
        # Expert tensors by (TP, PP, chunk, EP rank); everything else is in every EP rank's file.
        self.expert_states = {key + (e,): {} for key in self.states for e in range(self.ep)}

    def _where_layer(self, index: int) -> Tuple[int, int, int]:
        for p in range(self.pp):
            for c in range(self.num_chunks):
                offset = self.split.offset_for(p, c)
                if offset <= index < offset + self.split.num_layers_for(p, c):
                    return p, c, index - offset
        raise ConversionError(f"layer {index} is outside the {self.args.num_layers} layers")

    def add(self, name: str, tensor: torch.Tensor) -> None:
        tensor = tensor.to(self.dtype)
        m = LAYER.match(name)
        last = (self.pp - 1, self.num_chunks - 1)
        if m:
            p, c, local = self._where_layer(int(m.group(2)))
            places = [(p, c, f"{m.group(1)}.layers.{local}.{m.group(3)}")]
        elif name.startswith("embedding."):
            places = [(0, 0, name)]
            if name == "embedding.word_embeddings.weight" and self.tied and last != (0, 0):
                # The last stage keeps its own copy of the tied weight as its output layer.
                places.append((last[0], last[1], "output_layer.weight"))
            if getattr(self.args, "mtp_num_layers", None) and last != (0, 0):
                # The MTP depths on the last stage embed the shifted tokens: its own copy.
                places.append((last[0], last[1], name))
        else:  # the final norm, the output layer and any head: the last stage's
            places = [(last[0], last[1], name)]
        shards = split_full(name, tensor, self.tp, self.swiglu, self.parts)
        expert = EXPERT.match(places[0][2])
        for p, c, local in places:
            for t in range(self.tp):
                if expert:
                    # Expert e lives on EP rank e // experts_per_rank as its local index there.
                    index = int(expert.group(2))
                    rank, index = divmod(index, self.experts_per_rank)
                    local = f"{expert.group(1)}{index}{expert.group(3)}"
                    self.expert_states[(t, p, c, rank)][local] = shards[t]
                else:
                    self.states[(t, p, c)][local] = shards[t]

    def write(self) -> List[str]:
        os.makedirs(self.save_dir, exist_ok=True)
        saved_args = checkpoint_args(self.args)
        paths = []
        for t, p, e in (
            (t, p, e) for t in range(self.tp) for p in range(self.pp) for e in range(self.ep)
        ):
            state = {
                "args": saved_args,
                "checkpoint_version": CHECKPOINT_VERSION,
                "iteration": self.iteration,
                "num_floating_point_operations_so_far": 0.0,
            }
            models = []
            for c in range(self.num_chunks):
                model = {**self.states[(t, p, c)], **self.expert_states[(t, p, c, e)]}
                # megatron-core's (empty) _extra_state entries: Megatron-LM loads strictly.
                last = (p, c) == (self.pp - 1, self.num_chunks - 1)
                for name in extra_state_names(list(model), output_layer=last):
                    model[name] = EMPTY_EXTRA_STATE
                models.append(model)
            if self.num_chunks == 1:
                state["model"] = models[0]
            else:
                for c in range(self.num_chunks):
                    state[f"model{c}"] = models[c]
            path = checkpoint_name(
                self.save_dir,
                self.iteration,
                self.release,
                tp_rank=t,
                pp_rank=p,
                pp_size=self.pp,
                ep_rank=e,
                ep_size=self.ep,
            )
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = path + ".tmp"
            torch.save(state, tmp)
            os.replace(tmp, path)
            paths.append(path)
        # The tracker goes last, so an interrupted conversion never looks complete.
        commit_tracker(self.save_dir, self.iteration, self.release)
        return paths
