"""Every Megatron argument group, in the order of Megatron's parser."""

from megatron.training.argument_groups.data import (
    _add_data_args,
    _add_sft_args,
    _add_tokenizer_args,
)
from megatron.training.argument_groups.inference import _add_inference_args
from megatron.training.argument_groups.legacy import _add_biencoder_args, _add_vision_args
from megatron.training.argument_groups.misc import (
    _add_autoresume_args,
    _add_experimental_args,
    _add_ft_package_args,
    _add_logging_args,
    _add_msc_args,
    _add_one_logger_args,
    _add_opentelemetry_args,
    _add_profiling_args,
    _add_straggler_detector_args,
    _add_workload_inspector_args,
)
from megatron.training.argument_groups.model import (
    _add_mla_args,
    _add_network_size_args,
    _add_transformer_engine_args,
)
from megatron.training.argument_groups.moe import _add_moe_args
from megatron.training.argument_groups.resilience import (
    _add_fault_injector_args,
    _add_inprocess_restart_args,
)
from megatron.training.argument_groups.rl import _add_logits_distillation_args, _add_rl_args
from megatron.training.argument_groups.system import (
    _add_checkpointing_args,
    _add_distributed_args,
    _add_mixed_precision_args,
)
from megatron.training.argument_groups.training import (
    _add_initialization_args,
    _add_learning_rate_args,
    _add_regularization_args,
    _add_rerun_machine_args,
    _add_training_args,
    _add_validation_args,
)
from megatron.training.argument_groups.variants import (
    _add_experimental_attention_variant_args,
    _add_heterogeneous_args,
    _add_hybrid_model_args,
    _add_hyper_connection_args,
)

GROUP_FUNCTIONS = (
    _add_network_size_args,
    _add_regularization_args,
    _add_training_args,
    _add_profiling_args,
    _add_rl_args,
    _add_logits_distillation_args,
    _add_initialization_args,
    _add_learning_rate_args,
    _add_checkpointing_args,
    _add_mixed_precision_args,
    _add_distributed_args,
    _add_validation_args,
    _add_data_args,
    _add_tokenizer_args,
    _add_autoresume_args,
    _add_biencoder_args,
    _add_vision_args,
    _add_moe_args,
    _add_mla_args,
    _add_experimental_attention_variant_args,
    _add_hybrid_model_args,
    _add_hyper_connection_args,
    _add_heterogeneous_args,
    _add_logging_args,
    _add_one_logger_args,
    _add_opentelemetry_args,
    _add_straggler_detector_args,
    _add_workload_inspector_args,
    _add_inference_args,
    _add_transformer_engine_args,
    _add_experimental_args,
    _add_inprocess_restart_args,
    _add_fault_injector_args,
    _add_ft_package_args,
    _add_rerun_machine_args,
    _add_msc_args,
    _add_sft_args,
)


def add_argument_groups(parser):
    """Add every group's flags to `parser`; returns it."""
    for add_group in GROUP_FUNCTIONS:
        parser = add_group(parser)
    return parser
