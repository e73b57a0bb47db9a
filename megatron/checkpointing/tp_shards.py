"""How each tensor of a model splits over tensor-parallel ranks, by its global name.

The trainer learns it from the layers: every tensor-parallel parameter carries ``partition_dim``
and ``partition_stride``, which ``megatron.core.dist_checkpointing.model_state`` reads. The
offline converters have only names and take it from here;
tests/unit_tests/checkpointing/test_tp_shards.py checks that both agree on tiny GPT, MoE, BERT
and T5 models.

A split is ``(dim, stride)``: the global tensor is cut along ``dim`` into ``stride * TP`` equal
blocks and rank r holds blocks r, r + TP, ... (``megatron.core.tensor_parallel.layers.shard_of``):
column-parallel layers and the vocab-parallel embedding and output layer split dim 0,
row-parallel layers dim 1, SwiGLU's fc1 ([gate; up]) dim 0 with stride 2 (rank r holds
[gate_r; up_r]). Norms, row-parallel biases, position embeddings, routers and the heads built
from plain layers (each model class names them in its ``TP_REPLICATED_PREFIXES``) are held
whole by every rank. An MoE expert's linear layers split like the dense MLP's, over its
expert-tensor-parallel ranks; the shared expert like the dense MLP.

A Mamba mixer (``megatron.core.ssm.mamba_mixer``) splits its heads and groups: ``dt_bias``,
``A_log``, ``D``, ``norm.weight`` along dim 0, ``out_proj`` along dim 1, and ``in_proj`` ([z, x, B,
C, dt]) and ``conv1d`` ([x, B, C]) part by part (:data:`PARTED`: rank r holds its piece of every
part, ``mamba_mixer.shard_parts``), which needs the part sizes of the model
(:func:`mamba_part_sizes` of its args).
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
import re
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch

from megatron.core.tensor_parallel.layers import full_from_shards, shard_of

from .errors import ConversionError

# A layer tensor of a layer stack: "decoder" or "encoder", then the layer's global index.
LAYER = re.compile(r"^(decoder|encoder)\.layers\.(\d+)\.(.+)$")
# A multi-token-prediction depth's tensor (on the last stage, numbered from 0 by depth): its own
# norms and eh_proj, or its transformer layer's tensors under "transformer_layer.".
MTP = re.compile(r"^mtp\.layers\.(\d+)\.(?:transformer_layer\.)?(.+)$")
# An MoE expert's tensor (a decoder layer's or an MTP depth's): the layer, the expert's index,
# then its name inside the expert.
EXPERT = re.compile(
    r"^((?:decoder\.layers\.\d+|mtp\.layers\.\d+\.transformer_layer)"
    r"\.mlp\.experts\.local_experts\.)(\d+)(\..+)$"
)


class TPSplit(NamedTuple):
    dim: Optional[int]  # None: every tensor-parallel rank holds the whole tensor
    stride: int = 1
    parted: bool = False  # parts of different sizes, each split over TP (Mamba's in_proj)


REPLICATED = TPSplit(None)
COLUMN = TPSplit(0)
ROW = TPSplit(1)
GATED_COLUMN = TPSplit(0, 2)
PARTED = TPSplit(0, 1, True)

# Inside a layer (or an expert, as "mlp.<name>"), or outside the layers: the split by name.
_SPLITS = {
    "embedding.word_embeddings.weight": COLUMN,
    "self_attention.linear_qkv.weight": COLUMN,
    "self_attention.linear_qkv.bias": COLUMN,
    "self_attention.linear_proj.weight": ROW,
    # Multi-latent attention: every projection but linear_proj is column-parallel.
    "self_attention.linear_q_proj.weight": COLUMN,
    "self_attention.linear_q_down_proj.weight": COLUMN,
    "self_attention.linear_q_up_proj.weight": COLUMN,
    "self_attention.linear_kv_down_proj.weight": COLUMN,
    "self_attention.linear_kv_up_proj.weight": COLUMN,
    "mlp.linear_fc2.weight": ROW,
    "embedding.position_embeddings.weight": REPLICATED,
    "mlp.router.weight": REPLICATED,
    "mlp.router.expert_bias": REPLICATED,
    "mlp.shared_experts.linear_fc2.weight": ROW,
    # A Mamba layer: its pre-norm and mixer.
    "norm.weight": REPLICATED,
    "norm.bias": REPLICATED,
    "mixer.in_proj.weight": PARTED,
    "mixer.conv1d.weight": PARTED,
    "mixer.conv1d.bias": PARTED,
    "mixer.dt_bias": COLUMN,
    "mixer.A_log": COLUMN,
    "mixer.D": COLUMN,
    "mixer.norm.weight": COLUMN,
    "mixer.out_proj.weight": ROW,
    "decoder.final_norm.weight": REPLICATED,  # the hybrid stack's final norm
    "decoder.final_norm.bias": REPLICATED,
    # An MTP depth's projection of [embedding; hidden] (column-parallel) and its input norms.
    "eh_proj.weight": COLUMN,
    "enorm.weight": REPLICATED,
    "enorm.bias": REPLICATED,
    "hnorm.weight": REPLICATED,
    "hnorm.bias": REPLICATED,
}
_GATED = ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.shared_experts.linear_fc1.weight")
# The vocab-parallel output layer, also inside a head (T5's lm_head.output_layer).
_OUTPUT_LAYER = ("output_layer.weight", "output_layer.bias")
_REPLICATED_SUFFIXES = ("layernorm.weight", "layernorm.bias", "linear_proj.bias", "linear_fc2.bias")


@functools.lru_cache(maxsize=None)
def tp_replicated_prefixes() -> Tuple[str, ...]:
    """Every model class's ``TP_REPLICATED_PREFIXES``: the modules outside the layers built from
    plain (not tensor-parallel) layers. The model classes are those the packages of
    ``megatron.core.models`` export (imported on the first name that needs them)."""
    import megatron.core.models as models
    from megatron.core.models.common.language_module import LanguageModule

    prefixes = {}
    for info in pkgutil.iter_modules(models.__path__, models.__name__ + "."):
        for value in vars(importlib.import_module(info.name)).values():
            if isinstance(value, type) and issubclass(value, LanguageModule):
                prefixes.update(dict.fromkeys(value.TP_REPLICATED_PREFIXES))
    return tuple(prefixes)


def tp_split(name: str, swiglu: bool) -> TPSplit:
    """How the tensor of global name ``name`` splits over TP; ConversionError for a tensor the
    converters do not know (their layouts are checked against the trainer's, see above)."""
    expert = EXPERT.match(name)
    mtp = MTP.match(name)
    if expert:
        local = "mlp" + expert.group(3)
    elif mtp:
        local = mtp.group(2)
    else:
        local = LAYER.sub(r"\3", name)
    if local in _SPLITS:
        return _SPLITS[local]
    if local in _GATED:
        return GATED_COLUMN if swiglu else COLUMN
    if local.endswith(_OUTPUT_LAYER):
        return COLUMN
    if local.endswith(_REPLICATED_SUFFIXES) or local.startswith(tp_replicated_prefixes()):
        return REPLICATED
    raise ConversionError(
        f"tensor '{name}' is not one the converter knows how to reshard "
        "(cross-attention layers are not supported yet)"
    )


def mamba_part_sizes(args) -> Optional[Dict[str, List[int]]]:
    """{mixer tensor name: its full part sizes} of a hybrid model's args (None without Mamba
    settings), as the mixer builds them: in_proj [z, x, B, C, dt], conv1d [x, B, C]."""
    head_dim = getattr(args, "mamba_head_dim", None)
    if head_dim is None or getattr(args, "mamba_state_dim", None) is None:
        return None
    heads = getattr(args, "mamba_num_heads", None)
    d_inner = heads * head_dim if heads else 2 * args.hidden_size
    heads = heads or d_inner // head_dim
    gn = args.mamba_num_groups * args.mamba_state_dim
    conv = [d_inner, gn, gn]
    return {
        "mixer.in_proj.weight": [d_inner, d_inner, gn, gn, heads],
        "mixer.conv1d.weight": conv,
        "mixer.conv1d.bias": conv,
    }


def _part_sizes(name: str, parts: Optional[Dict[str, List[int]]]) -> List[int]:
    local = LAYER.sub(r"\3", name)
    if not parts or local not in parts:
        raise ConversionError(
            f"'{name}' is split part by part over TP, but the checkpoint's args give no Mamba "
            "sizes (--mamba-state-dim / --mamba-head-dim ...)"
        )
    return parts[local]


def merge_shards(
    name: str,
    shards: List[torch.Tensor],
    swiglu: bool,
    parts: Optional[Dict[str, List[int]]] = None,
) -> torch.Tensor:
    """The global tensor from every TP rank's shard (in rank order); ``parts``: the model's
    :func:`mamba_part_sizes`."""
    split = tp_split(name, swiglu)
    if split.dim is None or len(shards) == 1 and split.stride == 1:
        return shards[0]
    if split.parted:
        local = [size // len(shards) for size in _part_sizes(name, parts)]
        pieces = [torch.split(shard, local, dim=split.dim) for shard in shards]
        return torch.cat(
            [torch.cat([p[i] for p in pieces], dim=split.dim) for i in range(len(local))],
            dim=split.dim,
        )
    return full_from_shards(shards, split.dim, split.stride)


def split_full(
    name: str,
    tensor: torch.Tensor,
    tp: int,
    swiglu: bool,
    parts: Optional[Dict[str, List[int]]] = None,
) -> List[torch.Tensor]:
    """Every TP rank's shard of the global tensor (new tensors, except where held whole)."""
    split = tp_split(name, swiglu)
    if split.dim is None:
        return [tensor] * tp
    if tp == 1:
        return [tensor]
    if split.parted:
        from megatron.core.ssm.mamba_mixer import shard_parts

        sizes = _part_sizes(name, parts)
        if sum(sizes) != tensor.shape[split.dim] or any(s % tp for s in sizes):
            raise ConversionError(
                f"'{name}' of shape {tuple(tensor.shape)} cannot be split part by part "
                f"({sizes}) into {tp} tensor-parallel shards"
            )
        return [shard_parts(tensor, split.dim, sizes, rank, tp) for rank in range(tp)]
    if tensor.shape[split.dim] % (tp * split.stride) != 0:
        raise ConversionError(
            f"'{name}' of shape {tuple(tensor.shape)} cannot be split into "
            f"{tp} tensor-parallel shards along dim {split.dim}"
        )
    return [shard_of(tensor, split.dim, rank, tp, split.stride) for rank in range(tp)]
