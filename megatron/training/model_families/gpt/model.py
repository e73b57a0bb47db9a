"""GPT's model builder (Megatron's ``model_provider``)."""

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
    get_transformer_block_with_experimental_attention_variant_spec,
)
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
)
from megatron.core.transformer.multi_token_prediction import mtp_layer_spec
from megatron.core.transformer.spec_utils import import_spec
from megatron.training import get_args, get_parallel_state, print_rank_0
from megatron.training.configs import core_transformer_config_from_args


def model_provider(pre_process=True, post_process=True, vp_stage=None):
    """Build the GPT model, or with pipeline parallelism the chunk of pipeline stage (and virtual
    stage ``vp_stage``) of this rank, from the flags: local PyTorch layers, or the spec named by
    ``--spec``."""
    args = get_args()
    print_rank_0("building GPT model ...")
    config = core_transformer_config_from_args(args)
    if args.spec is not None:
        transformer_layer_spec = import_spec(args.spec)
    elif config.experimental_attention_variant is not None:
        transformer_layer_spec = get_transformer_block_with_experimental_attention_variant_spec(
            config, vp_stage=vp_stage
        )
    elif config.num_moe_experts:
        transformer_layer_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    else:
        transformer_layer_spec = get_gpt_layer_local_spec(
            multi_latent_attention=config.multi_latent_attention
        )
    mtp_block_spec = mtp_layer_spec(transformer_layer_spec) if args.mtp_num_layers else None
    return GPTModel(
        config=config,
        transformer_layer_spec=transformer_layer_spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor,
        mtp_block_spec=mtp_block_spec,
        vp_stage=vp_stage,
        pg_collection=get_parallel_state(),
    )
