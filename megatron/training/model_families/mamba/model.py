"""The hybrid model's builder (Megatron's ``pretrain_mamba.model_provider``)."""

from megatron.core.models.mamba import MambaModel
from megatron.core.transformer.spec_utils import import_spec
from megatron.training import get_args, get_parallel_state, print_rank_0
from megatron.training.configs import core_transformer_config_from_args

from .cost import hybrid_pattern


def model_provider(pre_process=True, post_process=True, vp_stage=None):
    """This rank's chunk of the hybrid model of ``--hybrid-override-pattern``."""
    args = get_args()
    print_rank_0("building Mamba model ...")
    config = core_transformer_config_from_args(args)
    # --spec: megatron-core's mamba_stack_spec (or a TransformerBlockSubmodules of its own).
    stack_spec = import_spec(args.spec) if args.spec is not None else None
    return MambaModel(
        config=config,
        mamba_stack_spec=stack_spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        hybrid_override_pattern=hybrid_pattern(args),
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        pg_collection=get_parallel_state(),
        vp_stage=vp_stage,
    )
