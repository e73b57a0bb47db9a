"""Loader plugin ``hf_nemotron_h`` (``--model-type MAMBA``): a Hugging Face
``NemotronHForCausalLM`` directory (Mamba-2, attention, squared-ReLU MLP and MoE layers) sent as a
hybrid model (``protocol_hybrid.py``); names mapped by ``hf_nemotron_h.py``, which also refuses,
naming the config.json field, what this framework does not compute as transformers does."""

from __future__ import annotations

from hf_io import HFWeights, has_tokenizer, hf_metadata, read_config
from hf_nemotron_h import Shape, megatron_from_hf, trainer_args_from_config
from protocol import ConversionError, put_metadata
from protocol_hybrid import HYBRID_ARGS, send_hybrid_model

MEGATRON_MODEL_TYPES = ("MAMBA",)


def add_arguments(parser):
    group = parser.add_argument_group(title="Hugging Face NemotronH loader")
    group.add_argument(
        "--hf-dtype",
        default=None,
        choices=["fp32", "bf16", "fp16"],
        help="dtype of the converted weights (default: the dtype in config.json).",
    )


class _Tracked:
    """The checkpoint's tensors as a read-only mapping that remembers which were read."""

    def __init__(self, weights: HFWeights, dtype):
        self.weights, self.dtype, self.read = weights, dtype, set()

    def __contains__(self, name):
        return self.weights.has(name)

    def __getitem__(self, name):
        self.read.add(name)
        return self.weights.get(name).to(self.dtype)

    def get(self, name, default=None):
        return self[name] if name in self else default


def metadata_from_config(config: dict, args, load_dir: str):
    if config.get("model_type") != "nemotron_h":
        raise ConversionError(
            f"{load_dir}/config.json has model_type {config.get('model_type')!r}; the "
            "hf_nemotron_h loader reads nemotron_h"
        )
    a = trainer_args_from_config(config)
    max_pos = config.get("max_position_embeddings", 4096)
    return hf_metadata(
        config,
        args,
        load_dir if has_tokenizer(load_dir) else None,
        model_type="MAMBA",
        num_layers=a["num_layers"],
        hidden_size=a["hidden_size"],
        ffn_hidden_size=a["ffn_hidden_size"],
        num_attention_heads=a["num_attention_heads"],
        num_query_groups=a["num_query_groups"],
        kv_channels=a["kv_channels"],
        seq_length=max_pos,
        max_position_embeddings=max_pos,
        position_embedding_type="none",  # NemotronH's attention has no position embedding
        rotary_base=10000,
        rotary_percent=1.0,
        use_rope_scaling=False,
        normalization="RMSNorm",
        norm_epsilon=a["norm_epsilon"],
        norm_has_bias=False,
        linear_bias=False,
        qkv_bias=False,
        swiglu=False,
        activation="squared_relu",
        output_layer=a["untie_embeddings_and_output_weights"],
        hidden_dropout=config.get("hidden_dropout", 0.0),
        attention_dropout=config.get("attention_dropout", 0.0),
        num_experts=a.get("num_experts"),
        moe_router_topk=a.get("moe_router_topk"),
        hybrid_override_pattern=a["hybrid_override_pattern"],
        hybrid_args={n: a.get(n) for n in HYBRID_ARGS},
    )


def load_checkpoint(queue, args, alive=None):
    config = read_config(args.load_dir)
    md = metadata_from_config(config, args, args.load_dir)
    weights = HFWeights(args.load_dir)
    hf = _Tracked(weights, md.params_dtype)
    shape = Shape(
        md.hybrid_override_pattern,
        md.num_attention_heads,
        md.num_query_groups,
        md.kv_channels,
        md.num_experts or 0,
    )
    ours = megatron_from_hf(hf, shape)  # a missing tensor: ConversionError naming it
    if md.output_layer and "output_layer.weight" not in ours:
        raise ConversionError(
            f"{args.load_dir}: tie_word_embeddings is false but there is no lm_head.weight"
        )
    left = sorted(set(weights.keys()) - hf.read)
    if left and args.checking:
        raise ConversionError(
            f"{args.load_dir} has tensors the NemotronH mapping does not know: {left[:5]}"
            f"{' ...' if len(left) > 5 else ''} (pass --no-checking to drop them)"
        )
    put_metadata(queue, md, alive)

    def layer_names(i):
        prefix = f"decoder.layers.{i}."
        return [n[len(prefix) :] for n in ours if n.startswith(prefix)]

    send_hybrid_model(queue, md, ours.__getitem__, layer_names, alive)
