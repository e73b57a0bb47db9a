"""GPT (and Llama-style) decoder-only models: Megatron's formulas for decoder transformers."""

from megatron.training.flops import num_floating_point_operations
from megatron.training.model_families import ModelFamily, refuse_other_models_flags
from megatron.training.theoretical_memory import activation_components, count_parameters

MODEL_FAMILY = ModelFamily(
    name="gpt",
    args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
    num_floating_point_operations=num_floating_point_operations,
    count_parameters=count_parameters,
    activation_components=activation_components,
    checkpoint_model_args=(
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "ffn_hidden_size",
        "padded_vocab_size",
        "max_position_embeddings",
        "num_query_groups",
        "kv_channels",
        "swiglu",
        "untie_embeddings_and_output_weights",
        "add_bias_linear",
        "normalization",
    ),
    check_args=lambda args: refuse_other_models_flags(args, "gpt"),
)
