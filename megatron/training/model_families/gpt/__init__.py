"""GPT (and Llama-style) decoder-only models: ``pretrain_gpt.py``; Megatron's formulas for
decoder transformers (FLOPs in training/flops.py, memory in training/theoretical_memory.py)."""

from megatron.core.enums import ModelType
from megatron.training.flops import num_floating_point_operations
from megatron.training.model_families import TrainSpec
from megatron.training.theoretical_memory import activation_components, count_parameters

from .data import train_valid_test_datasets_provider
from .model import model_provider
from .step import forward_step

SPEC = TrainSpec(
    name="gpt",
    model_type=ModelType.encoder_or_decoder,
    args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
    model_provider=model_provider,
    forward_step=forward_step,
    train_valid_test_datasets_provider=train_valid_test_datasets_provider,
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
    checkpoint_converter="plugins",
)
