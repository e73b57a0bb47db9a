"""T5 (span corruption): ``pretrain_t5.py``.

Data: sentence-level ``.bin/.idx`` files (``tools/preprocess_data.py --split-sentences``), a
WordPiece tokenizer with sentinels (``--vocab-extra-ids 100``), ``--encoder-seq-length`` (or
``--seq-length``) and ``--decoder-seq-length``. Tensor, sequence and data parallelism; pipeline
parallelism is refused as Megatron Core's T5 refuses it."""

from megatron.core.enums import ModelType
from megatron.training.model_families import TrainSpec
from megatron.training.model_families.gpt import SPEC as GPT

from .cost import count_parameters, num_floating_point_operations, t5_activation_components
from .data import train_valid_test_datasets_provider
from .model import model_provider
from .step import forward_step


def check_args(args) -> None:
    """Megatron's refusal of pipeline parallelism; the decoder length is required."""
    from megatron.training.flag_errors import ArgumentValidationError

    if args.pipeline_model_parallel_size > 1:
        raise ArgumentValidationError("Pipeline parallelism is not supported for T5.")
    if args.decoder_seq_length is None:
        raise ArgumentValidationError("T5 needs --decoder-seq-length")


SPEC = TrainSpec(
    name="t5",
    model_type=ModelType.encoder_and_decoder,
    args_defaults={"tokenizer_type": "BertWordPieceLowerCase"},
    model_provider=model_provider,
    forward_step=forward_step,
    train_valid_test_datasets_provider=train_valid_test_datasets_provider,
    num_floating_point_operations=num_floating_point_operations,
    count_parameters=count_parameters,
    activation_components=t5_activation_components,
    checkpoint_model_args=GPT.checkpoint_model_args + ("decoder_num_layers",),
    reads_flags=("mask_prob", "short_seq_prob", "decoder_num_layers", "decoder_seq_length"),
    check_own_args=check_args,
)
