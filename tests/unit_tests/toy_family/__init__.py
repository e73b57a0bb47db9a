"""A model family that lives outside megatron/:
tests/unit_tests/training/model_families/test_toy_family.py trains it to show that a family is
its spec and its modules, with no loop, registry or shared file edited.

"Successor" language modelling: each sample is a run of consecutive token ids and the target of
each position is the next id. The model is megatron.core's GPTModel built from the flags; the
datasets, the forward step and the FLOPs formula are the family's own; the loss is the masked
token loss the GPT and T5 families share. ``CALLS`` counts what the trainer called."""

from megatron.core.enums import ModelType
from megatron.training.model_families import TrainSpec
from megatron.training.theoretical_memory import activation_components, count_parameters

from . import parts

CALLS = parts.CALLS


def check_own_args(args) -> None:
    from megatron.training.flag_errors import ArgumentValidationError

    if args.pipeline_model_parallel_size > 1:
        raise ArgumentValidationError("the toy family keeps its model on one pipeline stage")


SPEC = TrainSpec(
    name="toy",
    model_type=ModelType.encoder_or_decoder,
    args_defaults={"tokenizer_type": "NullTokenizer"},
    model_provider=parts.model_provider,
    forward_step=parts.forward_step,
    train_valid_test_datasets_provider=parts.train_valid_test_datasets_provider,
    num_floating_point_operations=parts.num_floating_point_operations,
    count_parameters=count_parameters,
    activation_components=activation_components,
    checkpoint_model_args=("num_layers", "hidden_size", "padded_vocab_size"),
    check_own_args=check_own_args,
)
