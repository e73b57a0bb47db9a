"""Loader plugin ``hf_deepseek_v3``: a Hugging Face DeepSeek-V3 directory (``model_type``
deepseek_v3, e.g. DeepSeek-V3/R1, Kimi-K2): multi-latent attention (with or without q-LoRA,
default or YaRN RoPE), dense first layers (``first_k_dense_replace``), then MoE layers with the
sigmoid router and its expert bias (``e_score_correction_bias``), group-limited top-k
(``n_group`` / ``topk_group``), ``routed_scaling_factor`` and shared experts.

The tensors are mapped layer by layer by ``hf_deepseek_v3.layer_to_megatron`` (the RoPE rows
permuted from Hugging Face's interleaved layout to Megatron's) and sent as the core loader sends
a Megatron checkpoint. Multi-token prediction layers (``model.layers.<num_hidden_layers + k>.*``
in DeepSeek's files; transformers does not load them) become ``--mtp-num-layers`` depths: their
``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` (-> ``final_layernorm``) and transformer
layer; their ``embed_tokens`` / ``shared_head.head`` copies must equal the model's, which
Megatron shares.
"""

from __future__ import annotations

import sys

import hf_deepseek_v3
import torch
from hf_io import HFWeights, has_tokenizer, hf_metadata, read_config
from loader_core import send_model
from protocol import MTP_LAYER, ConversionError, put_metadata

from megatron.checkpointing.tp_shards import LAYER, MTP

# Outside the layers: Megatron name -> Hugging Face name.
_OUTER = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}


def add_arguments(parser):
    group = parser.add_argument_group(title="Hugging Face DeepSeek-V3 loader")
    group.add_argument(
        "--hf-dtype",
        default=None,
        choices=["fp32", "bf16", "fp16"],
        help="dtype of the converted weights (default: the dtype in config.json).",
    )


def _refuse(load_dir: str, field: str, value, why: str):
    raise ConversionError(f"{load_dir}/config.json: {field}={value!r} is not supported ({why})")


def check_config(config: dict, load_dir: str) -> None:
    """Refuse, in one line naming the field, what the Megatron model cannot compute."""
    if config.get("model_type") != "deepseek_v3":
        _refuse(load_dir, "model_type", config.get("model_type"), "this loader reads deepseek_v3")
    if config.get("hidden_act", "silu") != "silu":
        _refuse(load_dir, "hidden_act", config["hidden_act"], "SwiGLU needs silu")
    if config.get("attention_bias"):
        _refuse(load_dir, "attention_bias", True, "the MLA projections have no biases here")
    if config.get("mlp_bias"):
        _refuse(load_dir, "mlp_bias", True, "the MLPs have no biases here")
    if config.get("topk_method", "noaux_tc") != "noaux_tc":
        _refuse(load_dir, "topk_method", config["topk_method"], "only noaux_tc is mapped")
    if config.get("n_routed_experts") and not config.get("n_shared_experts"):
        _refuse(load_dir, "n_shared_experts", config.get("n_shared_experts"), "needs >= 1")


def metadata_from_config(config: dict, args, load_dir: str):
    check_config(config, load_dir)
    try:
        kw = hf_deepseek_v3.megatron_config_kwargs(config)
    except ValueError as exc:
        raise ConversionError(f"{load_dir}/config.json: {exc}") from None
    except KeyError as exc:
        raise ConversionError(f"{load_dir}/config.json lacks {exc}") from None
    mla = {
        "q_lora_rank": kw["q_lora_rank"],
        "kv_lora_rank": kw["kv_lora_rank"],
        "qk_head_dim": kw["qk_head_dim"],
        "qk_pos_emb_head_dim": kw["qk_pos_emb_head_dim"],
        "v_head_dim": kw["v_head_dim"],
        "rope_type": kw["rope_type"],
        "rotary_scaling_factor": kw["rotary_scaling_factor"],
        "mscale": kw.get("mscale"),
        "mscale_all_dim": kw.get("mscale_all_dim"),
        "yarn_original_max_position_embeddings": kw.get("original_max_position_embeddings"),
        "yarn_beta_fast": kw.get("beta_fast"),
        "yarn_beta_slow": kw.get("beta_slow"),
        "yarn_correction_range_round_to_int": kw.get("yarn_correction_range_round_to_int"),
        "latent_norms": True,
    }
    moe = None
    if "num_moe_experts" in kw:
        moe = {
            name: kw[name]
            for name in (
                "moe_layer_freq",
                "moe_ffn_hidden_size",
                "moe_shared_expert_intermediate_size",
                "moe_router_score_function",
                "moe_router_enable_expert_bias",
                "moe_router_topk_scaling_factor",
                "moe_router_num_groups",
                "moe_router_group_topk",
                "moe_router_dtype",
            )
        }
    if kw["layernorm_epsilon"] != hf_deepseek_v3.LATENT_NORM_EPS:
        print(
            f"WARNING: {hf_deepseek_v3.latent_eps_note(kw['layernorm_epsilon'])}",
            file=sys.stderr,
            flush=True,
        )
    h, heads = kw["hidden_size"], kw["num_attention_heads"]
    base = kw["rotary_base"]
    max_pos = config["max_position_embeddings"]
    return hf_metadata(
        config,
        args,
        load_dir if has_tokenizer(load_dir) else None,
        model_type="GPT",
        num_layers=kw["num_layers"],
        hidden_size=h,
        ffn_hidden_size=kw["ffn_hidden_size"],
        num_attention_heads=heads,
        num_query_groups=heads,
        kv_channels=h // heads,
        seq_length=max_pos,
        max_position_embeddings=max_pos,
        position_embedding_type="rope",
        rotary_base=int(base) if float(base).is_integer() else base,
        rotary_percent=1.0,
        use_rope_scaling=False,
        rope_scaling_factor=8.0,
        normalization="RMSNorm",
        norm_epsilon=kw["layernorm_epsilon"],
        norm_has_bias=False,
        linear_bias=False,
        qkv_bias=False,
        swiglu=True,
        activation="silu",
        output_layer=not config.get("tie_word_embeddings", False),
        hidden_dropout=0.0,
        attention_dropout=config.get("attention_dropout", 0.0),
        num_experts=kw.get("num_moe_experts"),
        moe_router_topk=kw.get("moe_router_topk"),
        mla=mla,
        moe=moe,
    )


class _HFTensors:
    """The Hugging Face tensors as ``hf_deepseek_v3`` reads them (``in`` and ``[]``), cast."""

    def __init__(self, weights: HFWeights, dtype):
        self.weights, self.dtype = weights, dtype

    def __contains__(self, name):
        return self.weights.has(name)

    def __getitem__(self, name):
        return self.weights.get(name).to(self.dtype)


# An MTP depth's own tensors in Hugging Face's layer model.layers.<num_hidden_layers + k>.
_MTP_OWN = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "final_layernorm.weight": "shared_head.norm.weight",
}


class MegatronView:
    """Full tensors by Megatron's global names (the core loader's reader interface), mapped from
    the Hugging Face files one layer at a time. MTP depth k is Hugging Face's layer
    ``num_hidden_layers + k``."""

    def __init__(self, weights: HFWeights, config: dict, dtype):
        self.hf, self.config = _HFTensors(weights, dtype), config
        self._layer, self._tensors = None, {}

    def _layer_tensors(self, index: int):
        if index != self._layer:
            self._layer = index
            self._tensors = hf_deepseek_v3.layer_to_megatron(self.hf, self.config, index)
        return self._tensors

    def tensor(self, name: str):
        m = LAYER.match(name)
        if m is not None:
            return self._layer_tensors(int(m.group(2)))[name]
        mtp = MTP.match(name)
        if mtp is not None:
            index = self.config["num_hidden_layers"] + int(mtp.group(1))
            rest = mtp.group(2)
            if name.startswith(f"mtp.layers.{mtp.group(1)}.{MTP_LAYER}"):
                return self._layer_tensors(index)[f"decoder.layers.{index}.{rest}"]
            return self.hf[f"model.layers.{index}.{_MTP_OWN[rest]}"]
        if name == "output_layer.weight" and "lm_head.weight" not in self.hf:
            raise ConversionError("lm_head.weight is missing (tie_word_embeddings is false)")
        return self.hf[_OUTER[name]]


def mtp_depths(weights: HFWeights, config: dict, load_dir: str) -> int:
    """How many MTP layers the files hold (``model.layers.<num_hidden_layers + k>.*``), after
    checking that their embedding and head copies equal the model's (Megatron shares them)."""
    layers, depths = config["num_hidden_layers"], 0
    head = "lm_head.weight" if weights.has("lm_head.weight") else "model.embed_tokens.weight"
    while any(n.startswith(f"model.layers.{layers + depths}.") for n in weights.keys()):
        p = f"model.layers.{layers + depths}."
        for copy, main in (("embed_tokens.weight", "model.embed_tokens.weight"),
                           ("shared_head.head.weight", head)):  # fmt: skip
            if weights.has(p + copy) and not torch.equal(weights.get(p + copy), weights.get(main)):
                raise ConversionError(
                    f"{load_dir}: {p}{copy} differs from {main}; Megatron's MTP layers share "
                    "the model's embedding and output layer"
                )
        depths += 1
    return depths


def load_checkpoint(queue, args, alive=None):
    config = read_config(args.load_dir)
    md = metadata_from_config(config, args, args.load_dir)
    weights = HFWeights(args.load_dir)
    md.mtp_num_layers = mtp_depths(weights, config, args.load_dir) or None
    put_metadata(queue, md, alive)
    try:
        send_model(queue, MegatronView(weights, config, md.params_dtype), md, alive)
    except KeyError as exc:  # a tensor the config promises is not in the files
        raise ConversionError(
            f"tensor {exc} is missing from the Hugging Face checkpoint in {args.load_dir}"
        ) from None
