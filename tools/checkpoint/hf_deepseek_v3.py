"""Hugging Face DeepSeek-V3 (``DeepseekV3ForCausalLM``) <-> Megatron state dicts, for the
multi-latent attention and dense SwiGLU layers (one TP/PP rank: full tensors).

Names: ``self_attn.q_proj`` / ``q_a_proj``, ``q_a_layernorm``, ``q_b_proj`` ->
``self_attention.linear_q_proj`` / ``linear_q_down_proj``, ``q_layernorm``, ``linear_q_up_proj``;
``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj`` -> ``linear_kv_down_proj``,
``kv_layernorm``, ``linear_kv_up_proj``, ``linear_proj``; ``mlp.gate_proj``/``up_proj`` ->
``mlp.linear_fc1`` = [gate; up], ``down_proj`` -> ``linear_fc2``.

RoPE layout: with ``rope_interleave`` (Hugging Face's default, the layout of DeepSeek's released
weights) the positional dims of each query head and of the shared positional key rotate in
adjacent pairs (2i, 2i+1); Megatron rotates pairs (i, i + p/2). The rows producing those dims are
permuted ([0, 2, 4, ..., 1, 3, 5, ...]) on the way in and back on the way out, so q.k is the
same and the round trip is exact.

MoE layers (from ``first_k_dense_replace`` on): ``mlp.gate.weight`` / ``e_score_correction_bias``
-> ``mlp.router.weight`` / ``expert_bias``; transformers 5's fused experts ``gate_up_proj[e]`` /
``down_proj[e]`` (or, in the files on disk, ``experts.<e>.gate_proj`` / ``up_proj`` /
``down_proj``) -> ``mlp.experts.local_experts.<e>.linear_fc1`` / ``linear_fc2``; the shared
experts like a dense MLP under ``mlp.shared_experts``. Not covered: multi-token prediction layers.

``loader_hf_deepseek_v3`` / ``saver_hf_deepseek_v3`` use it layer by layer for convert.py.
"""

from __future__ import annotations

from typing import Dict

import torch

# transformers' DeepseekV3Attention builds q_a_layernorm / kv_a_layernorm with RMSNorm's default
# epsilon whatever rms_norm_eps says; Megatron's latent norms take --norm-epsilon.
LATENT_NORM_EPS = 1e-6


def latent_eps_note(eps) -> str:
    return (
        f"norm epsilon {eps}: transformers' DeepSeek-V3 latent norms (q_a_layernorm, "
        f"kv_a_layernorm) always use {LATENT_NORM_EPS}, Megatron's use this epsilon; the "
        "logits differ slightly (about 1e-5 relative)"
    )


def _rope_rows(p: int) -> torch.Tensor:
    """Megatron row j of a p-row positional block = Hugging Face (interleaved) row perm[j]."""
    return torch.cat([torch.arange(0, p, 2), torch.arange(1, p, 2)])


def _permute_heads(weight: torch.Tensor, heads: int, nope: int, rope: int, order: torch.Tensor):
    w = weight.view(heads, nope + rope, -1)
    return torch.cat([w[:, :nope], w[:, nope:][:, order]], dim=1).reshape(weight.shape)


def _permute_kv_down(weight: torch.Tensor, rank: int, order: torch.Tensor) -> torch.Tensor:
    return torch.cat([weight[:rank], weight[rank:][order]], dim=0)


def _rope_orders(config: dict, to_megatron: bool):
    if not config.get("rope_interleave", True):
        return None
    order = _rope_rows(config["qk_rope_head_dim"])
    return order if to_megatron else torch.argsort(order)


def is_moe(config: dict, layer: int) -> bool:
    return bool(config.get("n_routed_experts")) and layer >= config.get("first_k_dense_replace", 0)


def _dense_mlp_in(hf, src: str, dst: str, out: dict) -> None:
    out[dst + "linear_fc1.weight"] = torch.cat(
        [hf[src + "gate_proj.weight"], hf[src + "up_proj.weight"]]
    )
    out[dst + "linear_fc2.weight"] = hf[src + "down_proj.weight"]


def _dense_mlp_out(state, src: str, dst: str, out: dict) -> None:
    gate, up = torch.chunk(state[src + "linear_fc1.weight"], 2)
    out[dst + "gate_proj.weight"] = gate
    out[dst + "up_proj.weight"] = up
    out[dst + "down_proj.weight"] = state[src + "linear_fc2.weight"]


def _moe_in(hf, src: str, dst: str, out: dict, experts: int) -> None:
    """``hf``: a mapping (or anything with ``in`` and ``[]``) holding either transformers 5's
    fused experts (a model's state dict) or the per-expert tensors of the files on disk."""
    out[dst + "router.weight"] = hf[src + "gate.weight"]
    out[dst + "router.expert_bias"] = hf[src + "gate.e_score_correction_bias"]
    fused = src + "experts.gate_up_proj" in hf
    for e in range(experts):
        expert = f"{dst}experts.local_experts.{e}."
        if fused:
            out[expert + "linear_fc1.weight"] = hf[src + "experts.gate_up_proj"][e]
            out[expert + "linear_fc2.weight"] = hf[src + "experts.down_proj"][e]
        else:
            _dense_mlp_in(hf, f"{src}experts.{e}.", expert, out)
    _dense_mlp_in(hf, src + "shared_experts.", dst + "shared_experts.", out)


def _moe_out(state, src: str, dst: str, out: dict, experts: int, fused: bool) -> None:
    out[dst + "gate.weight"] = state[src + "router.weight"]
    out[dst + "gate.e_score_correction_bias"] = state[src + "router.expert_bias"]
    local = [f"{src}experts.local_experts.{e}." for e in range(experts)]
    if fused:
        out[dst + "experts.gate_up_proj"] = torch.stack(
            [state[x + "linear_fc1.weight"] for x in local]
        )
        out[dst + "experts.down_proj"] = torch.stack(
            [state[x + "linear_fc2.weight"] for x in local]
        )
    else:
        for e, x in enumerate(local):
            _dense_mlp_out(state, x, f"{dst}experts.{e}.", out)
    _dense_mlp_out(state, src + "shared_experts.", dst + "shared_experts.", out)


def layer_to_megatron(hf, config: dict, i: int) -> Dict[str, torch.Tensor]:
    """Layer ``i``'s tensors under Megatron's global names ``decoder.layers.<i>.*``."""
    heads, nope, rope = (
        config["num_attention_heads"],
        config["qk_nope_head_dim"],
        config["qk_rope_head_dim"],
    )
    order = _rope_orders(config, to_megatron=True)
    out = {}
    src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
    att, mla = src + "self_attn.", dst + "self_attention."
    q_key = "q_proj" if config.get("q_lora_rank") is None else "q_b_proj"
    q_weight = hf[att + q_key + ".weight"]
    kv_down = hf[att + "kv_a_proj_with_mqa.weight"]
    if order is not None:
        q_weight = _permute_heads(q_weight, heads, nope, rope, order)
        kv_down = _permute_kv_down(kv_down, config["kv_lora_rank"], order)
    if config.get("q_lora_rank") is None:
        out[mla + "linear_q_proj.weight"] = q_weight
    else:
        out[mla + "linear_q_down_proj.weight"] = hf[att + "q_a_proj.weight"]
        out[mla + "q_layernorm.weight"] = hf[att + "q_a_layernorm.weight"]
        out[mla + "linear_q_up_proj.weight"] = q_weight
    out[mla + "linear_kv_down_proj.weight"] = kv_down
    out[mla + "kv_layernorm.weight"] = hf[att + "kv_a_layernorm.weight"]
    out[mla + "linear_kv_up_proj.weight"] = hf[att + "kv_b_proj.weight"]
    out[mla + "linear_proj.weight"] = hf[att + "o_proj.weight"]
    out[dst + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"]
    out[dst + "pre_mlp_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"]
    if is_moe(config, i):
        _moe_in(hf, src + "mlp.", dst + "mlp.", out, config["n_routed_experts"])
    else:
        _dense_mlp_in(hf, src + "mlp.", dst + "mlp.", out)
    return out


def layer_to_hf(state, config: dict, i: int, fused_experts: bool = True) -> Dict[str, torch.Tensor]:
    """The inverse of :func:`layer_to_megatron`; ``fused_experts=False`` gives the per-expert
    tensors that Hugging Face's files hold (``mlp.experts.<e>.gate_proj.weight``...)."""
    heads, nope, rope = (
        config["num_attention_heads"],
        config["qk_nope_head_dim"],
        config["qk_rope_head_dim"],
    )
    order = _rope_orders(config, to_megatron=False)
    out = {}
    src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
    mla, att = src + "self_attention.", dst + "self_attn."
    full_q = config.get("q_lora_rank") is None
    q_weight = state[mla + ("linear_q_proj" if full_q else "linear_q_up_proj") + ".weight"]
    kv_down = state[mla + "linear_kv_down_proj.weight"]
    if order is not None:
        q_weight = _permute_heads(q_weight, heads, nope, rope, order)
        kv_down = _permute_kv_down(kv_down, config["kv_lora_rank"], order)
    if full_q:
        out[att + "q_proj.weight"] = q_weight
    else:
        out[att + "q_a_proj.weight"] = state[mla + "linear_q_down_proj.weight"]
        out[att + "q_a_layernorm.weight"] = state[mla + "q_layernorm.weight"]
        out[att + "q_b_proj.weight"] = q_weight
    out[att + "kv_a_proj_with_mqa.weight"] = kv_down
    out[att + "kv_a_layernorm.weight"] = state[mla + "kv_layernorm.weight"]
    out[att + "kv_b_proj.weight"] = state[mla + "linear_kv_up_proj.weight"]
    out[att + "o_proj.weight"] = state[mla + "linear_proj.weight"]
    out[dst + "input_layernorm.weight"] = state[src + "input_layernorm.weight"]
    out[dst + "post_attention_layernorm.weight"] = state[src + "pre_mlp_layernorm.weight"]
    if is_moe(config, i):
        experts = config["n_routed_experts"]
        _moe_out(state, src + "mlp.", dst + "mlp.", out, experts, fused_experts)
    else:
        _dense_mlp_out(state, src + "mlp.", dst + "mlp.", out)
    return out


def hf_to_megatron(hf: Dict[str, torch.Tensor], config: dict) -> Dict[str, torch.Tensor]:
    """Megatron's GPTModel state dict (multi-latent attention, --qk-layernorm, SwiGLU, RMSNorm,
    untied output) from a Hugging Face DeepSeek-V3 state dict."""
    out = {
        "embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
        "output_layer.weight": hf.get("lm_head.weight", hf["model.embed_tokens.weight"]),
    }
    for i in range(config["num_hidden_layers"]):
        out.update(layer_to_megatron(hf, config, i))
    return out


def megatron_to_hf(
    state: Dict[str, torch.Tensor], config: dict, fused_experts: bool = True
) -> Dict[str, torch.Tensor]:
    """The inverse of :func:`hf_to_megatron`."""
    out = {
        "model.embed_tokens.weight": state["embedding.word_embeddings.weight"],
        "model.norm.weight": state["decoder.final_layernorm.weight"],
        "lm_head.weight": state["output_layer.weight"],
    }
    for i in range(config["num_hidden_layers"]):
        out.update(layer_to_hf(state, config, i, fused_experts))
    return out


def megatron_config_kwargs(config: dict) -> dict:
    """MLATransformerConfig fields (and GPTModel's rope choice) of a Hugging Face config."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    kind = params.get("rope_type", params.get("type", "default"))
    kwargs = dict(
        num_layers=config["num_hidden_layers"],
        hidden_size=config["hidden_size"],
        ffn_hidden_size=config["intermediate_size"],
        num_attention_heads=config["num_attention_heads"],
        q_lora_rank=config.get("q_lora_rank"),
        kv_lora_rank=config["kv_lora_rank"],
        qk_head_dim=config["qk_nope_head_dim"],
        qk_pos_emb_head_dim=config["qk_rope_head_dim"],
        v_head_dim=config["v_head_dim"],
        qk_layernorm=True,
        normalization="RMSNorm",
        layernorm_epsilon=config.get("rms_norm_eps", 1e-6),
        gated_linear_unit=True,
        add_bias_linear=False,
        rotary_base=params.get("rope_theta", config.get("rope_theta", 10000.0)),
    )
    if (
        config.get("n_routed_experts")
        and config.get("first_k_dense_replace", 0) < kwargs["num_layers"]
    ):
        if config.get("scoring_func", "sigmoid") != "sigmoid" or not config.get(
            "norm_topk_prob", True
        ):
            raise ValueError(
                "hf_deepseek_v3: only the sigmoid router with norm_topk_prob is mapped"
            )
        experts, topk = config["n_routed_experts"], config["num_experts_per_tok"]
        group_topk = config.get("topk_group")
        if group_topk and topk // group_topk != 2:
            raise ValueError(
                "hf_deepseek_v3: Hugging Face scores a group by its best 2 experts, Megatron "
                f"by its best topk // topk_group = {topk // group_topk}"
            )
        kwargs.update(
            num_moe_experts=experts,
            moe_router_topk=topk,
            moe_ffn_hidden_size=config["moe_intermediate_size"],
            moe_shared_expert_intermediate_size=config["moe_intermediate_size"]
            * config.get("n_shared_experts", 1),
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_topk_scaling_factor=config.get("routed_scaling_factor", 1.0),
            moe_router_num_groups=config.get("n_group"),
            moe_router_group_topk=group_topk,
            moe_router_dtype="fp32",
            moe_layer_freq=[int(is_moe(config, i)) for i in range(kwargs["num_layers"])],
        )
    if kind == "yarn":
        kwargs.update(
            rope_type="yarn",
            rotary_scaling_factor=params["factor"],
            original_max_position_embeddings=params["original_max_position_embeddings"],
            beta_fast=params.get("beta_fast", 32.0),
            beta_slow=params.get("beta_slow", 1.0),
            mscale=params.get("mscale", 1.0),
            mscale_all_dim=params.get("mscale_all_dim", 0.0),
            yarn_correction_range_round_to_int=params.get("truncate", True),
        )
    else:
        kwargs.update(rope_type="rope", rotary_scaling_factor=1.0)
    return kwargs
