"""BERT (masked LM + sentence order): ``pretrain_bert.py``.

Data: sentence-level ``.bin/.idx`` files (``tools/preprocess_data.py --split-sentences``) and a
WordPiece tokenizer (``--tokenizer-type BertWordPieceLowerCase --vocab-file ...``)."""

from megatron.core.enums import ModelType
from megatron.training.model_families import TrainSpec
from megatron.training.model_families.gpt import SPEC as GPT

from .cost import bert_activation_components, count_parameters, num_floating_point_operations
from .data import train_valid_test_datasets_provider
from .model import model_provider
from .step import forward_step

SPEC = TrainSpec(
    name="bert",
    model_type=ModelType.encoder_or_decoder,
    args_defaults={"tokenizer_type": "BertWordPieceLowerCase"},
    model_provider=model_provider,
    forward_step=forward_step,
    train_valid_test_datasets_provider=train_valid_test_datasets_provider,
    num_floating_point_operations=num_floating_point_operations,
    count_parameters=count_parameters,
    activation_components=bert_activation_components,
    checkpoint_model_args=GPT.checkpoint_model_args + ("bert_binary_head",),
    reads_flags=("bert_binary_head", "mask_prob", "short_seq_prob"),
    checkpoint_converter="convert_bert",
)
