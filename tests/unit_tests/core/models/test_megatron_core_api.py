"""Megatron Core 0.16's public model API: the constructors' arguments (names and order, as
megatron-core 0.16.1 / Megatron-LM define them), the GPT layer specs, TransformerConfig's
megatron-core fields, and the quickstart's checkpoint calls (``model.sharded_state_dict`` with
``dist_checkpointing.save`` / ``load``) at TP=2."""

import inspect
import os

import pytest
import torch

from megatron.core import dist_checkpointing
from megatron.core.models.bert import BertModel
from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.models.T5 import T5Model
from megatron.core.models.T5.t5_spec import (
    get_t5_decoder_with_local_block_spec,
    get_t5_encoder_with_local_block_spec,
)
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
from tests.unit_tests.dist_utils import run_distributed

# megatron-core 0.16's parameter lists (megatron/core/models/*/..._model.py, gpt_layer_specs.py).
MCORE_GPT_MODEL = [
    "config",
    "transformer_layer_spec",
    "vocab_size",
    "max_sequence_length",
    "pre_process",
    "post_process",
    "fp16_lm_cross_entropy",
    "parallel_output",
    "share_embeddings_and_output_weights",
    "position_embedding_type",
    "rotary_percent",
    "rotary_base",
    "rope_scaling",
    "rope_scaling_factor",
    "scatter_embedding_sequence_parallel",
    "seq_len_interpolation_factor",
    "mtp_block_spec",
    "pg_collection",
    "vp_stage",
]
MCORE_BERT_MODEL = [
    "config",
    "num_tokentypes",
    "transformer_layer_spec",
    "vocab_size",
    "max_sequence_length",
    "pre_process",
    "post_process",
    "fp16_lm_cross_entropy",
    "parallel_output",
    "share_embeddings_and_output_weights",
    "position_embedding_type",
    "rotary_percent",
    "seq_len_interpolation_factor",
    "add_binary_head",
    "return_embeddings",
    "vp_stage",
    "pg_collection",
]
MCORE_T5_MODEL = [
    "config",
    "encoder_config",
    "transformer_encoder_layer_spec",
    "transformer_decoder_layer_spec",
    "vocab_size",
    "max_sequence_length",
    "pre_process",
    "post_process",
    "fp16_lm_cross_entropy",
    "parallel_output",
    "share_embeddings_and_output_weights",
    "position_embedding_type",
    "rotary_percent",
    "seq_len_interpolation_factor",
    "relative_attention_num_buckets",
    "relative_attention_max_distance",
    "add_encoder",
    "add_decoder",
    "pg_collection",
]
MCORE_GPT_LAYER_LOCAL_SPEC = [
    "num_experts",
    "moe_grouped_gemm",
    "qk_layernorm",
    "multi_latent_attention",
    "fp8",
    "moe_use_legacy_grouped_gemm",
    "normalization",
    "qk_l2_norm",
    "use_kitchen",
    "use_kitchen_attention",
    "kitchen_attention_backend",
]
MCORE_GPT_LAYER_TE_SPEC = [
    "num_experts",
    "moe_grouped_gemm",
    "qk_layernorm",
    "multi_latent_attention",
    "fp8",
    "moe_use_legacy_grouped_gemm",
    "qk_l2_norm",
    "use_te_op_fuser",
    "use_kitchen",
    "use_te_activation_func",
    "use_kitchen_attention",
    "kitchen_attention_backend",
]
MCORE_GPT_DECODER_BLOCK_SPEC = [
    "config",
    "use_transformer_engine",
    "normalization",
    "qk_l2_norm",
    "vp_stage",
    "pp_rank",
]
# The defaults megatron-core gives (a sample, including the ones whose value decides a model).
MCORE_DEFAULTS = {
    (GPTModel, "share_embeddings_and_output_weights"): False,
    (BertModel, "share_embeddings_and_output_weights"): False,
    (T5Model, "share_embeddings_and_output_weights"): False,
    (GPTModel, "position_embedding_type"): "learned_absolute",
    (GPTModel, "rotary_base"): 10000,
    (GPTModel, "rope_scaling_factor"): 8.0,
    (BertModel, "add_binary_head"): True,
}

QUICKSTART_CONFIG = dict(
    num_layers=2,
    hidden_size=12,
    num_attention_heads=4,
    use_cpu_initialization=True,
    pipeline_dtype=torch.float32,
)


def _parameters(function):
    return [p for p in inspect.signature(function).parameters.values() if p.name != "self"]


def test_constructors_and_specs_take_megatron_core_arguments_in_its_order():
    for function, expected in (
        (BertModel.__init__, MCORE_BERT_MODEL),
        (T5Model.__init__, MCORE_T5_MODEL),
        (get_gpt_layer_local_spec, MCORE_GPT_LAYER_LOCAL_SPEC),
        (get_gpt_layer_with_transformer_engine_spec, MCORE_GPT_LAYER_TE_SPEC),
        (get_gpt_decoder_block_spec, MCORE_GPT_DECODER_BLOCK_SPEC),
    ):
        assert [p.name for p in _parameters(function)] == expected, function.__qualname__
    # GPTModel adds two keyword-only arguments of its own after megatron-core's (a pipeline
    # chunk built by hand); they cannot shift a positional argument.
    gpt = _parameters(GPTModel.__init__)
    assert [p.name for p in gpt] == MCORE_GPT_MODEL + ["num_layers", "layer_number_offset"]
    assert [p.kind for p in gpt[len(MCORE_GPT_MODEL) :]] == [inspect.Parameter.KEYWORD_ONLY] * 2
    # The specs are required, as in megatron-core.
    for cls, spec_names in (
        (GPTModel, ["transformer_layer_spec"]),
        (BertModel, ["transformer_layer_spec"]),
        (T5Model, ["transformer_encoder_layer_spec", "transformer_decoder_layer_spec"]),
    ):
        params = inspect.signature(cls.__init__).parameters
        assert all(params[n].default is inspect.Parameter.empty for n in spec_names)
    for (cls, name), default in MCORE_DEFAULTS.items():
        assert inspect.signature(cls.__init__).parameters[name].default == default, (cls, name)


def test_transformer_engine_spec_is_the_local_one_and_missing_features_are_refused():
    assert get_gpt_layer_with_transformer_engine_spec() == get_gpt_layer_local_spec()
    assert get_gpt_layer_with_transformer_engine_spec(
        num_experts=4, qk_layernorm=True
    ) == get_gpt_layer_local_spec(num_experts=4, qk_layernorm=True)
    assert get_gpt_layer_local_spec(
        multi_latent_attention=True
    ).submodules.self_attention.module.__name__ == ("MLASelfAttention")
    with pytest.raises(ValueError, match="qk_l2_norm not supported here"):
        get_gpt_layer_with_transformer_engine_spec(qk_l2_norm=True)
    with pytest.raises(ValueError, match="use_te_op_fuser not supported here"):
        get_gpt_layer_with_transformer_engine_spec(use_te_op_fuser=True)
    # QK-norm follows the config here: a spec asking for it with a config without it is refused
    # (megatron-core would build the norms), never silently built without them.
    config = TransformerConfig(**QUICKSTART_CONFIG)
    with pytest.raises(ValueError, match="config.qk_layernorm is False"):
        GPTModel(config, get_gpt_layer_local_spec(qk_layernorm=True), 100, 64)
    with pytest.raises(ValueError, match="multi-token prediction"):
        GPTModel(config, get_gpt_layer_local_spec(), 100, 64, mtp_block_spec=object())


def test_quickstart_config_constructs_with_megatron_core_fields_and_refuses_absent_features():
    from megatron.core.transformer.enums import AttnBackend

    config = TransformerConfig(**QUICKSTART_CONFIG)
    # megatron-core's defaults of fields whose feature does not exist here (0.16.1's values).
    assert (config.fp8, config.window_size, config.mtp_num_layers) == (None, None, None)
    assert (config.multi_latent_attention, config.cpu_offloading) == (False, False)
    assert (config.transformer_impl, config.fp8_recipe, config.softmax_type) == (
        "transformer_engine",
        "delayed",
        "vanilla",
    )
    assert config.distribute_saved_activations is False
    # Settings of an absent feature are inert: any value is accepted.
    TransformerConfig(**QUICKSTART_CONFIG, fp8_margin=3, tp_comm_overlap_ag=False)
    assert (
        TransformerConfig(
            **QUICKSTART_CONFIG, attention_backend=AttnBackend.local
        ).attention_backend
        == "local"
    )
    with pytest.raises(ValueError, match=r"fp8='hybrid' is not supported here"):
        TransformerConfig(**QUICKSTART_CONFIG, fp8="hybrid")
    with pytest.raises(ValueError, match=r"window_size=\(4, 0\) is not supported here"):
        TransformerConfig(**QUICKSTART_CONFIG, window_size=(4, 0))
    with pytest.raises(
        ValueError, match="multi_latent_attention=True needs an MLATransformerConfig"
    ):
        TransformerConfig(**QUICKSTART_CONFIG, multi_latent_attention=True)
    assert MLATransformerConfig(**QUICKSTART_CONFIG).multi_latent_attention


def _perturb(model):
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param))


def _assert_equal(model, saved):
    current = model.state_dict()
    assert sorted(current) == sorted(saved)
    for key, value in saved.items():
        assert torch.equal(current[key], value), key


def _round_trip(build, directory):
    """save(model.sharded_state_dict()), perturb, load + load_state_dict: the saved weights;
    then a second model's sharded state dict loads them too (the returned dict carries them)."""
    torch.manual_seed(1)
    model = build()
    dist_checkpointing.save(
        sharded_state_dict=model.sharded_state_dict(prefix=""), checkpoint_dir=directory
    )
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    _perturb(model)
    checkpoint = dist_checkpointing.load(
        sharded_state_dict=model.sharded_state_dict(prefix=""), checkpoint_dir=directory
    )
    model.load_state_dict(checkpoint)
    _assert_equal(model, saved)

    _perturb(model)
    torch.manual_seed(2)
    other = build()
    assert not torch.equal(
        other.state_dict()["embedding.word_embeddings.weight"],
        saved["embedding.word_embeddings.weight"],
    )
    checkpoint = dist_checkpointing.load(
        sharded_state_dict=other.sharded_state_dict(prefix=""), checkpoint_dir=directory
    )
    model.load_state_dict(checkpoint)
    _assert_equal(model, saved)
    return model


def _quickstart_worker(rank, world_size, directory):
    from megatron.core.parallel_state import initialize_model_parallel

    state = initialize_model_parallel(tensor_model_parallel_size=2)
    config = TransformerConfig(**QUICKSTART_CONFIG)

    def build():
        # The quickstart's call, plus the groups (megatron-core takes them from its module-level
        # parallel_state when pg_collection is None).
        return GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(),
            vocab_size=100,
            max_sequence_length=64,
            pg_collection=state,
        )

    model = _round_trip(build, directory)
    # Split over the two ranks although the config left tensor_model_parallel_size at 1.
    assert model.config.tensor_model_parallel_size == 2 and config.tensor_model_parallel_size == 1
    assert model.decoder.layers[0].self_attention.linear_qkv.weight.shape == (18, 12)
    assert model.embedding.word_embeddings.weight.shape[0] == 50
    if rank == 0:
        files = sorted(os.listdir(directory))
        assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "common.pt", "metadata.json"]


def test_quickstart_checkpoint_saves_and_loads_at_tp2(tmp_path):
    run_distributed(_quickstart_worker, 2, str(tmp_path / "ckpt"))


def test_bert_and_t5_checkpoints_save_and_load_through_the_public_calls(tmp_path):
    config = TransformerConfig(**QUICKSTART_CONFIG)
    _round_trip(
        lambda: BertModel(config, 2, bert_layer_local_spec, 100, 64),
        str(tmp_path / "bert"),
    )
    # T5 writes megatron-core's second keys of two tensors; they are not returned to the model.
    _round_trip(
        lambda: T5Model(
            config,
            config,
            get_t5_encoder_with_local_block_spec(2),
            get_t5_decoder_with_local_block_spec(2),
            100,
            64,
        ),
        str(tmp_path / "t5"),
    )
