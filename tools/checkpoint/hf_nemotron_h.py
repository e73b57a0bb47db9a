"""Hybrid Mamba models <-> Hugging Face ``NemotronHForCausalLM`` state dicts (TP=1, PP=1).

Megatron's names (``MambaModel``) against transformers' (``model.`` prefix; older checkpoints
use ``backbone.``, read too):

* ``embedding.word_embeddings.weight`` <-> ``model.embeddings.weight``;
* a Mamba layer (``M``): ``norm.weight`` <-> ``norm.weight``, and the mixer's tensors under the
  same names on both sides (``mixer.in_proj.weight`` [z, x, B, C, dt], ``mixer.conv1d.*``,
  ``mixer.dt_bias``, ``mixer.A_log``, ``mixer.D``, ``mixer.norm.weight``,
  ``mixer.out_proj.weight``);
* an attention layer (``*``): ``input_layernorm.weight`` <-> ``norm.weight``, Megatron's grouped
  ``self_attention.linear_qkv.weight`` <-> ``mixer.{q,k,v}_proj.weight``,
  ``self_attention.linear_proj.weight`` <-> ``mixer.o_proj.weight``;
* an MLP layer (``-``, squared ReLU, no gate): ``pre_mlp_layernorm.weight`` <-> ``norm.weight``,
  ``mlp.linear_fc1.weight`` <-> ``mixer.up_proj.weight``, ``mlp.linear_fc2.weight`` <->
  ``mixer.down_proj.weight``;
* an MoE layer (``E``, NemotronH's ``NemotronHMoE``): ``pre_mlp_layernorm.weight`` <->
  ``norm.weight``, ``mlp.router.weight`` <-> ``mixer.gate.weight``, ``mlp.router.expert_bias``
  <-> ``mixer.gate.e_score_correction_bias``, expert e's ``mlp.experts.local_experts.<e>.
  linear_fc1/linear_fc2.weight`` <-> ``mixer.experts.up_proj[e]`` / ``down_proj[e]`` (the model's
  stacked [E, ...] parameters; the files on the Hub and those ``save_pretrained`` writes name them
  ``mixer.experts.<e>.up_proj.weight`` / ``down_proj.weight``, read too, written with
  ``per_expert_files``), ``mlp.shared_experts.linear_fc1/linear_fc2.weight`` <->
  ``mixer.shared_experts.up_proj/down_proj.weight``;
* ``decoder.final_norm.weight`` <-> ``model.norm_f.weight``, ``output_layer.weight`` <->
  ``lm_head.weight``.

:func:`trainer_args_from_config` maps a ``config.json`` to the trainer's flags (``--mamba-*``,
``--squared-relu``, the MoE router's) and refuses, one field named, what this framework does not
compute like transformers (latent MoE, biases, a clamped dt, ...); :func:`config_from_trainer_args`
is its inverse.
"""

from __future__ import annotations

from typing import Dict, NamedTuple

import torch
from protocol import ConversionError, qkv_from_separate, qkv_to_separate

from megatron.core.ssm.mamba_hybrid_layer_allocation import layer_symbols

_MAMBA_TENSORS = (
    "mixer.in_proj.weight",
    "mixer.conv1d.weight",
    "mixer.conv1d.bias",
    "mixer.dt_bias",
    "mixer.A_log",
    "mixer.D",
    "mixer.norm.weight",
    "mixer.out_proj.weight",
)


# An MoE layer's tensors other than the routed experts': (ours within the layer, NemotronH's).
_MOE_TENSORS = (
    ("mlp.router.weight", "mixer.gate.weight"),
    ("mlp.router.expert_bias", "mixer.gate.e_score_correction_bias"),
    ("mlp.shared_experts.linear_fc1.weight", "mixer.shared_experts.up_proj.weight"),
    ("mlp.shared_experts.linear_fc2.weight", "mixer.shared_experts.down_proj.weight"),
)


class Shape(NamedTuple):
    """What the attention layers' QKV layout and the MoE layers need."""

    pattern: str
    num_heads: int
    num_groups: int
    head_dim: int
    num_experts: int = 0
    per_expert_files: bool = False  # experts as mixer.experts.<e>.*.weight (the files' names)


def _hf_prefix(hf: Dict[str, torch.Tensor]) -> str:
    return "backbone." if "backbone.embeddings.weight" in hf else "model."


def megatron_from_hf(hf: Dict[str, torch.Tensor], shape: Shape) -> Dict[str, torch.Tensor]:
    """Our MambaModel state dict from a NemotronH one."""
    p = _hf_prefix(hf)
    out = {"embedding.word_embeddings.weight": hf[p + "embeddings.weight"]}
    for i, symbol in enumerate(layer_symbols(shape.pattern)):
        src, dst = f"{p}layers.{i}.", f"decoder.layers.{i}."
        if symbol == "M":
            out[dst + "norm.weight"] = hf[src + "norm.weight"]
            for name in _MAMBA_TENSORS:
                out[dst + name] = hf[src + name]
        elif symbol == "*":
            out[dst + "input_layernorm.weight"] = hf[src + "norm.weight"]
            out[dst + "self_attention.linear_qkv.weight"] = qkv_from_separate(
                hf[src + "mixer.q_proj.weight"],
                hf[src + "mixer.k_proj.weight"],
                hf[src + "mixer.v_proj.weight"],
                shape.num_heads,
                shape.num_groups,
                shape.head_dim,
            )
            out[dst + "self_attention.linear_proj.weight"] = hf[src + "mixer.o_proj.weight"]
        elif symbol == "-":
            out[dst + "pre_mlp_layernorm.weight"] = hf[src + "norm.weight"]
            out[dst + "mlp.linear_fc1.weight"] = hf[src + "mixer.up_proj.weight"]
            out[dst + "mlp.linear_fc2.weight"] = hf[src + "mixer.down_proj.weight"]
        else:
            out[dst + "pre_mlp_layernorm.weight"] = hf[src + "norm.weight"]
            for ours, theirs in _MOE_TENSORS:
                out[dst + ours] = hf[src + theirs]
            for ours, theirs in (("linear_fc1", "up_proj"), ("linear_fc2", "down_proj")):
                stacked = hf.get(src + "mixer.experts." + theirs)
                for e in range(shape.num_experts):
                    name = f"{dst}mlp.experts.local_experts.{e}.{ours}.weight"
                    if stacked is not None:
                        out[name] = stacked[e]
                    else:
                        out[name] = hf[f"{src}mixer.experts.{e}.{theirs}.weight"]
    out["decoder.final_norm.weight"] = hf[p + "norm_f.weight"]
    if "lm_head.weight" in hf:  # absent with tie_word_embeddings
        out["output_layer.weight"] = hf["lm_head.weight"]
    return out


def hf_from_megatron(ours: Dict[str, torch.Tensor], shape: Shape) -> Dict[str, torch.Tensor]:
    """A NemotronH state dict (``model.`` names) from our MambaModel's."""
    out = {"model.embeddings.weight": ours["embedding.word_embeddings.weight"]}
    for i, symbol in enumerate(layer_symbols(shape.pattern)):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        if symbol == "M":
            out[dst + "norm.weight"] = ours[src + "norm.weight"]
            for name in _MAMBA_TENSORS:
                out[dst + name] = ours[src + name]
        elif symbol == "*":
            out[dst + "norm.weight"] = ours[src + "input_layernorm.weight"]
            q, k, v = qkv_to_separate(
                ours[src + "self_attention.linear_qkv.weight"],
                shape.num_heads,
                shape.num_groups,
                shape.head_dim,
            )
            out[dst + "mixer.q_proj.weight"] = q
            out[dst + "mixer.k_proj.weight"] = k
            out[dst + "mixer.v_proj.weight"] = v
            out[dst + "mixer.o_proj.weight"] = ours[src + "self_attention.linear_proj.weight"]
        elif symbol == "-":
            out[dst + "norm.weight"] = ours[src + "pre_mlp_layernorm.weight"]
            out[dst + "mixer.up_proj.weight"] = ours[src + "mlp.linear_fc1.weight"]
            out[dst + "mixer.down_proj.weight"] = ours[src + "mlp.linear_fc2.weight"]
        else:
            out[dst + "norm.weight"] = ours[src + "pre_mlp_layernorm.weight"]
            for mine, theirs in _MOE_TENSORS:
                out[dst + theirs] = ours[src + mine]
            for mine, theirs in (("linear_fc1", "up_proj"), ("linear_fc2", "down_proj")):
                experts = [
                    ours[f"{src}mlp.experts.local_experts.{e}.{mine}.weight"]
                    for e in range(shape.num_experts)
                ]
                if shape.per_expert_files:
                    for e, weight in enumerate(experts):
                        out[f"{dst}mixer.experts.{e}.{theirs}.weight"] = weight
                else:
                    out[dst + "mixer.experts." + theirs] = torch.stack(experts)
    out["model.norm_f.weight"] = ours["decoder.final_norm.weight"]
    if "output_layer.weight" in ours:
        out["lm_head.weight"] = ours["output_layer.weight"]
    return out


def _pattern_of(config: dict) -> str:
    """The layer pattern of a NemotronH config (``hybrid_override_pattern`` in older files,
    ``layers_block_type`` in transformers 5)."""
    if config.get("hybrid_override_pattern"):
        return config["hybrid_override_pattern"]
    kinds = config.get("layers_block_type") or config.get("layer_types")
    symbols = {"mamba": "M", "attention": "*", "mlp": "-", "moe": "E"}
    symbols.update({"linear_attention": "M", "full_attention": "*"})
    if not kinds or any(k not in symbols for k in kinds):
        raise ConversionError(f"config.json: unknown or missing layers_block_type {kinds!r}")
    return "".join(symbols[k] for k in kinds)


# config.json fields this framework computes only at the value given (transformers' default where
# it differs from ours, a missing field is the default).
_FIXED = {
    "mlp_hidden_act": "relu2",  # --squared-relu; the experts use the same activation
    "mamba_hidden_act": "silu",
    "conv_kernel": 4,  # the mixer's d_conv
    "use_conv_bias": True,
    "mamba_proj_bias": False,
    "attention_bias": False,
    "mlp_bias": False,
    "use_bias": False,
    "moe_latent_size": None,  # latent MoE (fc1/fc2_latent_proj) has no counterpart here
    "sliding_window": None,
    "num_nextn_predict_layers": 0,  # NemotronH's MTP layers are not converted
    "layer_norm_epsilon": 1e-5,  # the mixer's gated RMSNorm has Megatron's fixed 1e-5
}


def trainer_args_from_config(config: dict) -> dict:
    """The trainer's settings (argument names) of a NemotronH ``config.json``; ConversionError
    naming the first field this framework does not compute as transformers does."""
    for field, want in _FIXED.items():
        value = config.get(field, want)
        if value != want:
            raise ConversionError(
                f"config.json: {field}={value!r} is not supported by the NemotronH converter "
                f"(only {want!r})"
            )
    # transformers writes infinity as {"__float__": "Infinity"}
    limit = [
        float(v["__float__"]) if isinstance(v, dict) else float(v)
        for v in config.get("time_step_limit", (0.0, float("inf")))
    ]
    if limit != [0.0, float("inf")]:
        raise ConversionError(
            f"config.json: time_step_limit={limit} is not supported (dt is not clamped here)"
        )
    pattern = _pattern_of(config)
    heads_width = config["hidden_size"]
    args = dict(
        hybrid_override_pattern=pattern,
        num_layers=len(pattern),
        hidden_size=config["hidden_size"],
        ffn_hidden_size=config.get("intermediate_size", 21504),
        num_attention_heads=config["num_attention_heads"],
        num_query_groups=config.get("num_key_value_heads") or config["num_attention_heads"],
        kv_channels=config.get("head_dim") or heads_width // config["num_attention_heads"],
        mamba_state_dim=config.get("ssm_state_size", 128),
        mamba_head_dim=config.get("mamba_head_dim", 64),
        mamba_num_groups=config.get("n_groups", 8),
        mamba_num_heads=config.get("mamba_num_heads", 128),
        norm_epsilon=config.get("layer_norm_epsilon", 1e-5),
        untie_embeddings_and_output_weights=not config.get("tie_word_embeddings", False),
    )
    if "E" not in pattern:
        return args
    topk = config.get("num_experts_per_tok", 2)
    groups, group_topk = config.get("n_group", 1), config.get("topk_group", 1)
    if bool(config.get("norm_topk_prob", True)) != (topk > 1):
        raise ConversionError(
            f"config.json: norm_topk_prob={config.get('norm_topk_prob', True)} with "
            f"num_experts_per_tok={topk} is not supported (the sigmoid router here normalizes "
            "the chosen scores exactly when it picks more than one)"
        )
    if groups > 1 and topk // group_topk != 2:
        raise ConversionError(
            f"config.json: n_group={groups} needs num_experts_per_tok // topk_group == 2 (a "
            "group's score is the sum of its top-2 experts in NemotronH, of its top "
            "topk/group_topk here)"
        )
    scaling = float(config.get("routed_scaling_factor", 1.0))
    args.update(
        num_experts=config.get("n_routed_experts", 8),
        moe_router_topk=topk,
        moe_ffn_hidden_size=config.get("moe_intermediate_size", 7688),
        moe_shared_expert_intermediate_size=config.get("moe_shared_expert_intermediate_size", 7688),
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_num_groups=groups if groups > 1 else None,
        moe_router_group_topk=group_topk if groups > 1 else None,
        moe_router_topk_scaling_factor=scaling if scaling != 1.0 else None,
    )
    return args


def config_from_trainer_args(args: dict) -> dict:
    """NemotronH ``config.json`` fields of the trainer's settings (inverse of
    :func:`trainer_args_from_config`)."""
    config = dict(
        model_type="nemotron_h",
        architectures=["NemotronHForCausalLM"],
        # NemotronH has no pipeline-stage boundaries (|)
        hybrid_override_pattern=args["hybrid_override_pattern"].replace("|", ""),
        hidden_size=args["hidden_size"],
        intermediate_size=args["ffn_hidden_size"],
        num_attention_heads=args["num_attention_heads"],
        num_key_value_heads=args["num_query_groups"],
        head_dim=args["kv_channels"],
        ssm_state_size=args["mamba_state_dim"],
        mamba_head_dim=args["mamba_head_dim"],
        n_groups=args["mamba_num_groups"],
        mamba_num_heads=args["mamba_num_heads"],
        layer_norm_epsilon=args["norm_epsilon"],
        tie_word_embeddings=not args["untie_embeddings_and_output_weights"],
        mlp_hidden_act="relu2",
    )
    if args.get("num_experts"):
        groups = args.get("moe_router_num_groups") or 1
        config.update(
            n_routed_experts=args["num_experts"],
            num_experts_per_tok=args["moe_router_topk"],
            moe_intermediate_size=args["moe_ffn_hidden_size"],
            moe_shared_expert_intermediate_size=args["moe_shared_expert_intermediate_size"],
            n_group=groups,
            topk_group=args.get("moe_router_group_topk") or 1,
            norm_topk_prob=args["moe_router_topk"] > 1,
            routed_scaling_factor=args.get("moe_router_topk_scaling_factor") or 1.0,
        )
    return config
