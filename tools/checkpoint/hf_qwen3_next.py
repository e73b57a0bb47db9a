"""GPT models with gated delta net layers <-> Hugging Face ``Qwen3NextForCausalLM`` state dicts
(TP=1, PP=1; dense MLPs or Qwen3-Next's mixture of experts).

Megatron's model is the one ``--experimental-attention-variant gated_delta_net
--linear-attention-freq ... --attention-output-gate --qk-layernorm --apply-layernorm-1p
--normalization RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights``
builds (Qwen3-Next's norms scale by 1 + weight, as ``--apply-layernorm-1p`` does, so they map
unchanged). Names, ours <-> transformers' (``model.`` prefix):

* ``embedding.word_embeddings.weight`` <-> ``embed_tokens.weight``; ``decoder.final_layernorm``
  <-> ``norm``; ``output_layer.weight`` <-> ``lm_head.weight``;
* every layer: ``input_layernorm`` <-> ``input_layernorm``, ``pre_mlp_layernorm`` <->
  ``post_attention_layernorm``, ``mlp.linear_fc1`` [gate; up] <-> ``mlp.{gate,up}_proj``,
  ``mlp.linear_fc2`` <-> ``mlp.down_proj``;
* a gated delta net layer: ``self_attention.in_proj.weight`` [q, k, v, z, beta, alpha] (each part
  whole) <-> ``linear_attn.in_proj_qkvz.weight`` (grouped per key head: [q, k, v, z] of the head
  and its value heads) and ``linear_attn.in_proj_ba.weight`` (per key head [b, a]);
  ``conv1d.weight``, ``dt_bias``, ``A_log``, ``out_proj.weight`` under the same names;
  ``self_attention.out_norm.weight`` <-> ``linear_attn.norm.weight``, the latter being
  1 + ours when the model's norms are zero-centred (transformers' gated norm is not);
* a softmax-attention layer: the grouped ``self_attention.linear_qkv.weight`` (per query group
  [queries, gates, key, value]) <-> ``self_attn.q_proj`` (per head [query, gate]), ``k_proj``,
  ``v_proj``; ``linear_proj`` <-> ``o_proj``; ``q_layernorm``/``k_layernorm`` <->
  ``q_norm``/``k_norm``.

* a mixture-of-experts layer (``--num-experts``, ``--moe-shared-expert-gate``; the local
  experts, not grouped GEMM): ``mlp.router.weight`` <-> ``mlp.gate.weight``,
  ``mlp.experts.local_experts.<e>.linear_fc1`` [gate; up] <-> ``mlp.experts.gate_up_proj[e]``,
  ``...linear_fc2`` <-> ``mlp.experts.down_proj[e]``, ``mlp.shared_experts.linear_fc1``
  [gate; up] <-> ``mlp.shared_expert.{gate,up}_proj``, ``linear_fc2`` <-> ``down_proj``,
  ``mlp.shared_experts.gate_weight`` <-> ``mlp.shared_expert_gate.weight``. Qwen3-Next's router
  (softmax over all experts, top-k, renormalized) equals Megatron's default (top-k of the
  logits, softmax over them).
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple

import torch
from protocol import ConversionError

Tensors = Dict[str, torch.Tensor]


class Shape(NamedTuple):
    """The sizes the conversion needs; ``pattern`` is Megatron's linear-attention pattern (1:
    gated delta net, 0: softmax attention)."""

    pattern: List[int]
    num_heads: int
    num_query_groups: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    zero_centered_out_norm: bool = True


def _gdn_parts(shape: Shape):
    nk, nv = shape.linear_num_key_heads, shape.linear_num_value_heads
    dk, dv = shape.linear_key_head_dim, shape.linear_value_head_dim
    return nk, nv // nk, dk, dv


def _in_proj_from_hf(qkvz: torch.Tensor, ba: torch.Tensor, shape: Shape) -> torch.Tensor:
    nk, r, dk, dv = _gdn_parts(shape)
    grouped = qkvz.reshape(nk, 2 * dk + 2 * r * dv, -1)
    q, k, v, z = torch.split(grouped, [dk, dk, r * dv, r * dv], dim=1)
    b, a = torch.split(ba.reshape(nk, 2 * r, -1), [r, r], dim=1)
    hidden = qkvz.shape[-1]
    return torch.cat([t.reshape(-1, hidden) for t in (q, k, v, z, b, a)], dim=0)


def _in_proj_to_hf(in_proj: torch.Tensor, shape: Shape):
    nk, r, dk, dv = _gdn_parts(shape)
    hidden = in_proj.shape[-1]
    q, k, v, z, b, a = torch.split(
        in_proj, [nk * dk, nk * dk, nk * r * dv, nk * r * dv, nk * r, nk * r], dim=0
    )
    qkvz = torch.cat([t.reshape(nk, -1, hidden) for t in (q, k, v, z)], dim=1).reshape(-1, hidden)
    ba = torch.cat([t.reshape(nk, r, hidden) for t in (b, a)], dim=1).reshape(-1, hidden)
    return qkvz.contiguous(), ba.contiguous()


def _qkv_from_hf(q_gate: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: Shape):
    ng, d = shape.num_query_groups, shape.head_dim
    per_group = shape.num_heads // ng
    hidden = q_gate.shape[-1]
    q, gate = q_gate.reshape(shape.num_heads, 2, d, hidden).unbind(1)
    parts = [
        q.reshape(ng, per_group * d, hidden),
        gate.reshape(ng, per_group * d, hidden),
        k.reshape(ng, d, hidden),
        v.reshape(ng, d, hidden),
    ]
    return torch.cat(parts, dim=1).reshape(-1, hidden)


def _qkv_to_hf(qkv: torch.Tensor, shape: Shape):
    ng, d = shape.num_query_groups, shape.head_dim
    per_group = shape.num_heads // ng
    hidden = qkv.shape[-1]
    q, gate, k, v = torch.split(
        qkv.reshape(ng, (2 * per_group + 2) * d, hidden),
        [per_group * d, per_group * d, d, d],
        dim=1,
    )
    q_gate = torch.stack(
        [q.reshape(shape.num_heads, d, hidden), gate.reshape(shape.num_heads, d, hidden)], dim=1
    )
    return (
        q_gate.reshape(-1, hidden).contiguous(),
        k.reshape(-1, hidden).contiguous(),
        v.reshape(-1, hidden).contiguous(),
    )


def _moe_from_hf(hf: Tensors, src: str, dst: str) -> Tensors:
    out = {dst + "router.weight": hf[src + "gate.weight"]}
    for e, (fc1, fc2) in enumerate(
        zip(hf[src + "experts.gate_up_proj"], hf[src + "experts.down_proj"])
    ):
        out[f"{dst}experts.local_experts.{e}.linear_fc1.weight"] = fc1
        out[f"{dst}experts.local_experts.{e}.linear_fc2.weight"] = fc2
    if src + "shared_expert.gate_proj.weight" in hf:
        shared = src + "shared_expert."
        out[dst + "shared_experts.linear_fc1.weight"] = torch.cat(
            [hf[shared + "gate_proj.weight"], hf[shared + "up_proj.weight"]]
        )
        out[dst + "shared_experts.linear_fc2.weight"] = hf[shared + "down_proj.weight"]
        out[dst + "shared_experts.gate_weight"] = hf[src + "shared_expert_gate.weight"]
    return out


def _moe_to_hf(ours: Tensors, src: str, dst: str) -> Tensors:
    out = {dst + "gate.weight": ours[src + "router.weight"]}
    experts = ours[src + "router.weight"].shape[0]
    local = src + "experts.local_experts."
    out[dst + "experts.gate_up_proj"] = torch.stack(
        [ours[f"{local}{e}.linear_fc1.weight"] for e in range(experts)]
    )
    out[dst + "experts.down_proj"] = torch.stack(
        [ours[f"{local}{e}.linear_fc2.weight"] for e in range(experts)]
    )
    if src + "shared_experts.linear_fc1.weight" in ours:
        if src + "shared_experts.gate_weight" not in ours:
            raise ConversionError(
                "Qwen3-Next's shared expert is gated: the model needs --moe-shared-expert-gate"
            )
        gate, up = torch.chunk(ours[src + "shared_experts.linear_fc1.weight"], 2, dim=0)
        out[dst + "shared_expert.gate_proj.weight"] = gate
        out[dst + "shared_expert.up_proj.weight"] = up
        out[dst + "shared_expert.down_proj.weight"] = ours[src + "shared_experts.linear_fc2.weight"]
        out[dst + "shared_expert_gate.weight"] = ours[src + "shared_experts.gate_weight"]
    return out


_SAME_GDN = ("conv1d.weight", "dt_bias", "A_log", "out_proj.weight")


def megatron_from_hf(hf: Tensors, shape: Shape) -> Tensors:
    """transformers' ``Qwen3NextForCausalLM`` state dict -> ours."""
    hf = {k[len("model.") :] if k.startswith("model.") else k: v for k, v in hf.items()}
    out = {
        "embedding.word_embeddings.weight": hf["embed_tokens.weight"],
        "decoder.final_layernorm.weight": hf["norm.weight"],
        "output_layer.weight": hf["lm_head.weight"],
    }
    for i, linear in enumerate(shape.pattern):
        src, dst = f"layers.{i}.", f"decoder.layers.{i}."
        out[dst + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"]
        out[dst + "pre_mlp_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"]
        if src + "mlp.gate.weight" in hf:
            out.update(_moe_from_hf(hf, src + "mlp.", dst + "mlp."))
        else:
            out[dst + "mlp.linear_fc1.weight"] = torch.cat(
                [hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"]]
            )
            out[dst + "mlp.linear_fc2.weight"] = hf[src + "mlp.down_proj.weight"]
        if linear:
            la, sa = src + "linear_attn.", dst + "self_attention."
            out[sa + "in_proj.weight"] = _in_proj_from_hf(
                hf[la + "in_proj_qkvz.weight"], hf[la + "in_proj_ba.weight"], shape
            )
            for name in _SAME_GDN:
                out[sa + name] = hf[la + name]
            norm = hf[la + "norm.weight"]
            out[sa + "out_norm.weight"] = norm - 1 if shape.zero_centered_out_norm else norm
        else:
            at, sa = src + "self_attn.", dst + "self_attention."
            out[sa + "linear_qkv.weight"] = _qkv_from_hf(
                hf[at + "q_proj.weight"], hf[at + "k_proj.weight"], hf[at + "v_proj.weight"], shape
            )
            out[sa + "linear_proj.weight"] = hf[at + "o_proj.weight"]
            out[sa + "q_layernorm.weight"] = hf[at + "q_norm.weight"]
            out[sa + "k_layernorm.weight"] = hf[at + "k_norm.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def hf_from_megatron(ours: Tensors, shape: Shape) -> Tensors:
    """Ours -> transformers' ``Qwen3NextForCausalLM`` state dict."""
    if any(".mlp.experts.linear_fc" in k for k in ours):
        raise ConversionError(
            "grouped-GEMM experts (--moe-grouped-gemm) are not converted to Qwen3-Next here"
        )
    out = {
        "model.embed_tokens.weight": ours["embedding.word_embeddings.weight"],
        "model.norm.weight": ours["decoder.final_layernorm.weight"],
        "lm_head.weight": ours["output_layer.weight"],
    }
    for i, linear in enumerate(shape.pattern):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[dst + "input_layernorm.weight"] = ours[src + "input_layernorm.weight"]
        out[dst + "post_attention_layernorm.weight"] = ours[src + "pre_mlp_layernorm.weight"]
        if src + "mlp.router.weight" in ours:
            out.update(_moe_to_hf(ours, src + "mlp.", dst + "mlp."))
        else:
            gate, up = torch.chunk(ours[src + "mlp.linear_fc1.weight"], 2, dim=0)
            out[dst + "mlp.gate_proj.weight"] = gate
            out[dst + "mlp.up_proj.weight"] = up
            out[dst + "mlp.down_proj.weight"] = ours[src + "mlp.linear_fc2.weight"]
        sa = src + "self_attention."
        if linear:
            la = dst + "linear_attn."
            qkvz, ba = _in_proj_to_hf(ours[sa + "in_proj.weight"], shape)
            out[la + "in_proj_qkvz.weight"] = qkvz
            out[la + "in_proj_ba.weight"] = ba
            for name in _SAME_GDN:
                out[la + name] = ours[sa + name]
            norm = ours[sa + "out_norm.weight"]
            out[la + "norm.weight"] = norm + 1 if shape.zero_centered_out_norm else norm
        else:
            at = dst + "self_attn."
            q_gate, k, v = _qkv_to_hf(ours[sa + "linear_qkv.weight"], shape)
            out[at + "q_proj.weight"], out[at + "k_proj.weight"], out[at + "v_proj.weight"] = (
                q_gate,
                k,
                v,
            )
            out[at + "o_proj.weight"] = ours[sa + "linear_proj.weight"]
            out[at + "q_norm.weight"] = ours[sa + "q_layernorm.weight"]
            out[at + "k_norm.weight"] = ours[sa + "k_layernorm.weight"]
    return {k: v.contiguous() for k, v in out.items()}
