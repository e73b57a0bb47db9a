"""ModelParallelConfig / TransformerConfig: defaults, derived fields, validation, field docs."""

import ast
import dataclasses
import inspect
import math

import pytest
import torch
import torch.nn.functional as F

from megatron.core import model_parallel_config
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.transformer import feature_fields, transformer_config
from megatron.core.transformer.feature_fields import UnsupportedFeatureFields
from megatron.core.transformer.moe import moe_config
from megatron.core.transformer.moe.moe_config import MoEConfig
from megatron.core.transformer.transformer_config import TransformerConfig


def cfg(**kw):
    base = dict(num_layers=4, hidden_size=64, num_attention_heads=8)
    base.update(kw)
    return TransformerConfig(**base)


def test_model_parallel_defaults():
    c = ModelParallelConfig()
    assert (
        c.tensor_model_parallel_size,
        c.pipeline_model_parallel_size,
        c.context_parallel_size,
    ) == (1, 1, 1)
    assert c.virtual_pipeline_model_parallel_size is None and c.sequence_parallel is False
    assert c.expert_model_parallel_size == 1 and c.expert_tensor_parallel_size == 1
    assert c.perform_initialization is True and c.use_cpu_initialization is False
    assert c.fp16 is False and c.bf16 is False and c.params_dtype == torch.float32
    assert c.gradient_accumulation_fusion is False
    assert c.pipeline_dtype == torch.float32
    assert ModelParallelConfig(tensor_model_parallel_size=2).expert_tensor_parallel_size == 2
    assert ModelParallelConfig(params_dtype=torch.bfloat16).pipeline_dtype == torch.bfloat16


def test_transformer_defaults_and_derived_fields():
    c = cfg()
    assert c.ffn_hidden_size == 4 * 64
    assert c.kv_channels == 8
    assert c.num_query_groups == 8
    assert c.hidden_dropout == 0.1 and c.attention_dropout == 0.1
    assert c.layernorm_epsilon == 1e-5 and c.normalization == "LayerNorm"
    assert c.add_bias_linear is True and c.add_qkv_bias is False
    assert c.gated_linear_unit is False and c.activation_func is F.gelu
    assert c.init_method_std == 0.02
    assert c.init_method.std == pytest.approx(0.02)
    assert c.output_layer_init_method.std == pytest.approx(0.02 / math.sqrt(2 * 4))
    # megatron-core's rule for hybrid models: one residual branch per layer, sqrt(num_layers).
    hybrid = cfg(is_hybrid_model=True)
    assert hybrid.output_layer_init_method.std == pytest.approx(0.02 / math.sqrt(4))
    assert c.recompute_granularity is None
    explicit = cfg(ffn_hidden_size=100, kv_channels=16, num_query_groups=2)
    assert (explicit.ffn_hidden_size, explicit.kv_channels, explicit.num_query_groups) == (
        100,
        16,
        2,
    )


def test_init_methods_draw_with_their_std():
    c = cfg(init_method_std=0.1)
    torch.manual_seed(0)
    w = torch.empty(200, 200)
    c.init_method(w)
    assert abs(w.std().item() - 0.1) < 0.005
    c.output_layer_init_method(w)
    assert abs(w.std().item() - 0.1 / math.sqrt(8)) < 0.002


def test_query_key_layer_scaling_forces_fp32_softmax():
    assert cfg(
        apply_query_key_layer_scaling=True, attention_softmax_in_fp32=False
    ).attention_softmax_in_fp32


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_layers=0), "--num-layers"),
        (dict(hidden_size=-1), "--hidden-size"),
        (dict(num_attention_heads=6), "divisible by num_attention_heads"),
        (dict(num_query_groups=3), "--num-query-groups"),
        (dict(normalization="BatchNorm"), "--normalization"),
        (dict(hidden_dropout=1.0), "--hidden-dropout"),
        (dict(attention_dropout=-0.1), "--attention-dropout"),
        (dict(layernorm_epsilon=0.0), "--norm-epsilon"),
        (dict(init_method_std=0.0), "--init-method-std"),
        (dict(tensor_model_parallel_size=3), "tensor_model_parallel_size"),
        (dict(sequence_parallel=True), "--sequence-parallel"),
        (dict(fp16=True, bf16=True), "--fp16"),
        (dict(recompute_granularity="some"), "--recompute-granularity"),
        (dict(recompute_granularity="full"), "--recompute-method"),
        (dict(recompute_granularity="full", recompute_method="uniform"), "--recompute-num-layers"),
        (dict(recompute_granularity="selective", recompute_method="block"), "--recompute-method"),
        (dict(recompute_granularity="selective", recompute_modules=["mla"]), "--recompute-modules"),
    ],
)
def test_validation_errors_name_the_flag(kwargs, match):
    with pytest.raises(ValueError, match=match):
        cfg(**kwargs)


def test_recompute_settings_at_the_edge_of_the_rules():
    # 'block' may recompute no layer of the stage; 'uniform' chunks need at least one layer.
    c = cfg(recompute_granularity="full", recompute_method="block", recompute_num_layers=0)
    assert (c.recompute_granularity, c.recompute_method, c.recompute_num_layers) == (
        "full",
        "block",
        0,
    )
    with pytest.raises(ValueError, match="'uniform' needs recompute_num_layers >= 1"):
        cfg(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=0)
    c = cfg(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    assert (c.recompute_method, c.recompute_num_layers) == ("uniform", 1)
    # Selective recompute takes megatron-core's modules (mla_up_proj needs MLA: see
    # test_recompute_modules.py) and nothing else.
    modules = ["core_attn", "moe_act", "layernorm", "mlp", "moe", "shared_experts"]
    c = cfg(recompute_granularity="selective", recompute_modules=modules)
    assert c.recompute_modules == modules
    with pytest.raises(ValueError, match=r"recompute_modules \['attn'\] are not supported"):
        cfg(recompute_granularity="selective", recompute_modules=["core_attn", "attn"])


@pytest.mark.parametrize(
    "module, cls",
    [
        (model_parallel_config, ModelParallelConfig),
        (transformer_config, TransformerConfig),
        (moe_config, MoEConfig),
        (feature_fields, UnsupportedFeatureFields),
    ],
)
def test_every_field_has_a_docstring(module, cls):
    tree = ast.parse(inspect.getsource(module))
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    documented = set()
    for stmt, following in zip(node.body, node.body[1:]):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            documented.add(stmt.target.id)
    own = {f.name for f in dataclasses.fields(cls)} - (
        {f.name for f in dataclasses.fields(ModelParallelConfig)}
        | {f.name for f in dataclasses.fields(MoEConfig)}
        | {f.name for f in dataclasses.fields(UnsupportedFeatureFields)}
        if cls is TransformerConfig
        else set()
    )
    assert own and own <= documented, sorted(own - documented)
