"""The cross-flag rules of validate_args (megatron/training/arguments.py): one ordered pass.

Each step checks a family of flags, fills in the values derived from them and raises
ArgumentValidationError with a message naming the flags and values at fault. The steps run in
the order of ``RULES``, which is Megatron's: a command line with several errors reports the
first one this order meets, and a later step may read what an earlier one derived (the
data-parallel size, the virtual pipeline size, ...). Each module holds consecutive steps, so
the pass visits each module once. Importing the rules does not import torch (the steps that
need it import it when they run).
"""

from megatron.training.flags.rules import (
    batch,
    checkpoint,
    data,
    deprecated,
    dp_strategy,
    layer,
    moe,
    monitoring,
    numerics,
    parallel,
    pipeline,
    precision,
    recompute,
    rerun,
    schedule,
    shape,
)

RULES = (
    deprecated.translate_deprecated,
    parallel.validate_parallel_sizes,
    shape.validate_model_shape,
    shape.validate_moe_shape,
    moe.validate_moe,
    batch.validate_batch_size,
    pipeline.validate_pipeline,
    numerics.validate_optimizer,
    numerics.validate_numerics,
    dp_strategy.validate_data_parallel_strategy,
    precision.validate_precision,
    checkpoint.validate_checkpointing,
    schedule.validate_schedule,
    recompute.validate_recompute,
    recompute.validate_activation_offloading,
    data.validate_data,
    monitoring.validate_logging,
    layer.validate_layer,
    rerun.validate_rerun,
)


def run_rules(args) -> None:
    """Every step of RULES on ``args``, in order (the first violation raises)."""
    for rule in RULES:
        rule(args)
