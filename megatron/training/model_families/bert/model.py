"""BERT's model builder (Megatron's ``model_provider``)."""

from megatron.core.models.bert import BertModel
from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
from megatron.core.transformer.spec_utils import import_spec
from megatron.training import get_args, get_parallel_state, print_rank_0
from megatron.training.configs import core_transformer_config_from_args


def model_provider(pre_process=True, post_process=True, vp_stage=None):
    """BERT, or with pipeline parallelism this rank's stage (and virtual stage) of it."""
    args = get_args()
    print_rank_0("building BERT model ...")
    config = core_transformer_config_from_args(args)
    spec = import_spec(args.spec) if args.spec is not None else bert_layer_local_spec
    return BertModel(
        config=config,
        num_tokentypes=2 if args.bert_binary_head else 0,
        transformer_layer_spec=spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        add_binary_head=args.bert_binary_head,
        vp_stage=vp_stage,
        pg_collection=get_parallel_state(),
    )
