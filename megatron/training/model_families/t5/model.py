"""T5's model builder (Megatron's ``model_provider``)."""

import dataclasses

from megatron.core.models.T5 import T5Model
from megatron.core.models.T5.t5_spec import (
    get_t5_decoder_layer_local_spec,
    get_t5_encoder_layer_local_spec,
)
from megatron.training import get_args, get_parallel_state, print_rank_0
from megatron.training.configs import core_transformer_config_from_args


def model_provider(pre_process=True, post_process=True, vp_stage=None):
    """T5 with ``--encoder-num-layers`` (or ``--num-layers``) encoder layers and
    ``--decoder-num-layers`` (default: as many) decoder layers."""
    args = get_args()
    if args.pipeline_model_parallel_size > 1:
        raise ValueError("Pipeline parallelism is not supported for T5.")
    if args.spec is not None:
        raise ValueError("--spec is not supported by pretrain_t5.py (T5 has two layer specs)")
    print_rank_0("building T5 model ...")
    config = core_transformer_config_from_args(args)
    encoder_config = dataclasses.replace(config, num_layers=args.encoder_num_layers)
    if args.decoder_num_layers is not None:
        config = dataclasses.replace(config, num_layers=args.decoder_num_layers)
    return T5Model(
        config=config,
        encoder_config=encoder_config,
        transformer_encoder_layer_spec=get_t5_encoder_layer_local_spec(),
        transformer_decoder_layer_spec=get_t5_decoder_layer_local_spec(),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        pg_collection=get_parallel_state(),
    )
