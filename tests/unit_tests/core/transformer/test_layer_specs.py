"""Layer specs: build_module, GPT's local spec (Megatron Core's names), per-layer block specs, the
cross-attention slot (T5's decoder layer), a padding-masked layer (BERT's) and ``--spec``."""

import sys

import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
)
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.spec_utils import (
    IdentityOp,
    ModuleSpec,
    build_module,
    import_module,
)
from megatron.core.transformer.transformer_block import (
    TransformerBlock,
    TransformerBlockSubmodules,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
)
from tests.harness.argv import megatron_argv


def cfg(**kw):
    base = dict(
        num_layers=4,
        hidden_size=32,
        num_attention_heads=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float64,
        init_seed=7,
    )
    base.update(kw)
    return TransformerConfig(**base)


def wide_mlp_layer_spec() -> ModuleSpec:
    """A dense layer whose MLP is 40 wide whatever the config says (a layer that differs)."""
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=build_norm,
            self_attention=SelfAttention,
            pre_mlp_layernorm=build_norm,
            mlp=ModuleSpec(module=MLP, params={"ffn_hidden_size": 40}),
        ),
    )


NOT_A_SPEC = 3


# ----------------------------------------------------------------------------- build_module
class _Recorder(torch.nn.Module):
    def __init__(self, *args, **kwargs):
        super().__init__()
        self.args, self.kwargs = args, kwargs


def test_build_module_merges_spec_params_and_caller_arguments():
    spec = ModuleSpec(module=_Recorder, params={"kind": "wide"}, submodules="parts")
    built = build_module(spec, 1, layer_number=3)
    assert built.args == (1,)
    assert built.kwargs == {"kind": "wide", "layer_number": 3, "submodules": "parts"}
    assert build_module(_Recorder, 2).kwargs == {}
    by_path = build_module(ModuleSpec(module=("torch.nn", "Linear"), params={"bias": False}), 3, 2)
    assert isinstance(by_path, torch.nn.Linear) and by_path.weight.shape == (2, 3)
    with pytest.raises(TypeError, match=r"\['kind'\] given both by the spec's params"):
        build_module(spec, kind="narrow")
    with pytest.raises(ImportError, match="cannot import module 'no_such_module'"):
        import_module(("no_such_module", "x"))
    with pytest.raises(ImportError, match="module 'torch.nn' has no 'NoSuchLayer'"):
        import_module(("torch.nn", "NoSuchLayer"))
    x = torch.randn(3)
    assert build_module(IdentityOp, config=None, hidden_size=3)(x, "ignored") is x


# ----------------------------------------------------------------------------- GPT's local spec
def test_gpt_local_spec_keeps_megatron_names_and_the_te_spec_is_the_local_one():
    config = cfg(num_layers=1, qk_layernorm=True, params_dtype=torch.float32)
    explicit = GPTModel(
        config,
        vocab_size=64,
        max_sequence_length=16,
        transformer_layer_spec=get_gpt_layer_local_spec(),
    )
    expected = {
        "embedding.word_embeddings.weight",
        "embedding.position_embeddings.weight",
        "decoder.final_layernorm.weight",
        "decoder.final_layernorm.bias",
        "output_layer.weight",  # untied: GPTModel's default
    }
    for module in (
        "input_layernorm",
        "self_attention.linear_qkv",
        "self_attention.q_layernorm",
        "self_attention.k_layernorm",
        "self_attention.linear_proj",
        "pre_mlp_layernorm",
        "mlp.linear_fc1",
        "mlp.linear_fc2",
    ):
        expected |= {f"decoder.layers.0.{module}.weight", f"decoder.layers.0.{module}.bias"}
    assert set(explicit.state_dict()) == expected
    attention = explicit.decoder.layers[0].self_attention
    assert attention.core_attention.attn_mask_type == AttnMaskType.causal
    default = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=16)
    for (name, a), (_, b) in zip(explicit.state_dict().items(), default.state_dict().items()):
        assert torch.equal(a, b), name


# ----------------------------------------------------------------------------- per-layer specs
def test_block_spec_can_differ_per_layer_and_a_stage_takes_its_slice():
    dense = get_gpt_layer_local_spec()
    spec = TransformerBlockSubmodules(
        layer_specs=[dense, wide_mlp_layer_spec(), dense, wide_mlp_layer_spec()],
        layer_norm=build_norm,
    )

    def widths(block):
        return [layer.mlp.linear_fc1.weight.shape[0] for layer in block.layers]

    assert widths(TransformerBlock(cfg(), spec)) == [128, 40, 128, 40]
    # A pipeline chunk holding layers 2 and 3 (0-based) from the whole model's list ...
    stage = TransformerBlock(cfg(), spec, pre_process=False, num_layers=2, layer_number_offset=2)
    assert widths(stage) == [128, 40]
    assert [layer.layer_number for layer in stage.layers] == [3, 4]
    assert stage.final_layernorm is not None
    # ... or from a list of its own layers (Megatron's per-stage lists).
    own = TransformerBlockSubmodules(layer_specs=[wide_mlp_layer_spec(), dense])
    stage = TransformerBlock(cfg(), own, num_layers=2, layer_number_offset=2)
    assert widths(stage) == [40, 128]
    assert stage.final_layernorm is None  # no layer_norm in the block spec: no final norm
    with pytest.raises(ValueError, match="has 3 layer specs; expected one per layer"):
        TransformerBlock(cfg(), TransformerBlockSubmodules(layer_specs=[dense] * 3))
    assert (
        widths(
            TransformerBlock(cfg(), get_gpt_decoder_block_spec(cfg(), use_transformer_engine=False))
        )
        == [128] * 4
    )


# ----------------------------------------------------------------------------- cross-attention
class _ContextAttention(MegatronModule):
    """Stands in for T5's cross-attention: a projection of the input plus the mean of the
    encoder output over its sequence; records what the layer handed it."""

    def __init__(self, config, layer_number, pg_collection=None, attn_mask_type=None):
        super().__init__(config)
        self.attn_mask_type = attn_mask_type
        self.proj = torch.nn.Linear(config.hidden_size, config.hidden_size, dtype=torch.float64)
        self.calls = []

    def forward(self, hidden_states, attention_mask=None, key_value_states=None):
        self.calls.append((attention_mask, key_value_states))
        return self.proj(hidden_states) + key_value_states.mean(0), None


def decoder_layer_spec() -> ModuleSpec:
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=build_norm,
            self_attention=SelfAttention,
            pre_cross_attn_layernorm=build_norm,
            cross_attention=ModuleSpec(
                module=_ContextAttention, params={"attn_mask_type": AttnMaskType.padding}
            ),
            pre_mlp_layernorm=build_norm,
            mlp=MLP,
        ),
    )


def test_cross_attention_slot_gets_the_context_after_its_own_norm():
    torch.manual_seed(0)
    layer = build_module(decoder_layer_spec(), config=cfg(), layer_number=1)
    with torch.no_grad():  # norms away from the identity, so a missing norm shows
        layer.pre_cross_attn_layernorm.weight.uniform_(0.5, 1.5)
        layer.pre_cross_attn_layernorm.bias.uniform_(-0.5, 0.5)
    names = set(layer.state_dict())
    assert {"pre_cross_attn_layernorm.weight", "cross_attention.proj.weight"} <= names
    x = torch.randn(6, 2, 32, dtype=torch.float64)
    context = torch.randn(5, 2, 32, dtype=torch.float64)
    context_mask = torch.zeros(2, 1, 6, 5, dtype=torch.bool)
    out, returned = layer(x, context=context, context_mask=context_mask)
    assert returned is context
    mask_seen, context_seen = layer.cross_attention.calls[-1]
    assert mask_seen is context_mask and context_seen is context

    # The same layer, written out: three residual blocks, each behind its own norm.
    with torch.no_grad():
        h = x + layer.self_attention(layer.input_layernorm(x))[0]
        normed = F.layer_norm(
            h,
            (32,),
            layer.pre_cross_attn_layernorm.weight,
            layer.pre_cross_attn_layernorm.bias,
            1e-5,
        )
        h = h + layer.cross_attention.proj(normed) + context.mean(0)
        mlp_out, bias = layer.mlp(layer.pre_mlp_layernorm(h))
        assert bias is None  # added inside linear_fc2
        expected = h + mlp_out
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)


def test_full_recompute_passes_the_context_through():
    def run(recompute):
        torch.manual_seed(0)
        extra = dict(recompute_granularity="full", recompute_method="uniform") if recompute else {}
        config = cfg(num_layers=2, recompute_num_layers=1 if recompute else None, **extra)
        block = TransformerBlock(config, decoder_layer_spec())
        context = torch.randn(5, 2, 32, dtype=torch.float64, requires_grad=True)
        x = torch.randn(6, 2, 32, dtype=torch.float64, requires_grad=True)
        block(x, context=context).square().sum().backward()
        return context.grad, block.layers[0].cross_attention.proj.weight.grad

    plain, recomputed = run(False), run(True)
    assert plain[0].abs().sum() > 0
    for a, b in zip(plain, recomputed):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------- padding mask
def test_padding_masked_self_attention_layer_is_bidirectional_and_ignores_padding():
    spec = ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=build_norm,
            self_attention=ModuleSpec(
                module=SelfAttention, params={"attn_mask_type": AttnMaskType.padding}
            ),
            pre_mlp_layernorm=build_norm,
            mlp=MLP,
        ),
    )
    torch.manual_seed(0)
    layer = build_module(spec, config=cfg(), layer_number=1)
    assert layer.self_attention.core_attention.attn_mask_type == AttnMaskType.padding
    s, pad = 6, 2
    mask = torch.zeros(1, 1, s, s, dtype=torch.bool)
    mask[..., s - pad :] = True  # no query attends to the last two (padding) keys
    x = torch.randn(s, 1, 32, dtype=torch.float64)

    def run(inputs):
        with torch.no_grad():
            return layer(inputs, attention_mask=mask)[0]

    base = run(x)
    changed_padding, changed_second = x.clone(), x.clone()
    changed_padding[s - pad :] += torch.randn(pad, 1, 32, dtype=torch.float64)
    changed_second[1] += torch.randn(32, dtype=torch.float64)
    torch.testing.assert_close(run(changed_padding)[: s - pad], base[: s - pad], rtol=0, atol=0)
    assert not torch.allclose(run(changed_second)[0], base[0])  # token 0 sees token 1


# ----------------------------------------------------------------------------- --spec
TINY_FLAGS = megatron_argv(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=16,
    max_position_embeddings=16,
    micro_batch_size=1,
    train_iters=1,
    vocab_size=60,
)


def _validated(*flags):
    from megatron.training.arguments import parse_args, validate_args

    args = parse_args(argv=TINY_FLAGS + list(flags))
    args.world_size, args.rank = 1, 0
    return validate_args(args, {})


def test_spec_flag_names_the_layers_pretrain_gpt_builds():
    from megatron.core.parallel_state import initialize_model_parallel
    from megatron.training import global_vars
    from tests.functional_tests.runner import REPO

    args = _validated("--spec", __name__, "wide_mlp_layer_spec")
    assert args.spec == [__name__, "wide_mlp_layer_spec"]
    args.padded_vocab_size = 64
    sys.path.insert(0, str(REPO))
    import pretrain_gpt

    global_vars.reset_globals()
    try:
        global_vars.set_args(args)
        initialize_model_parallel()
        model = pretrain_gpt.model_provider()
        assert [layer.mlp.linear_fc1.weight.shape[0] for layer in model.decoder.layers] == [40, 40]
        args.spec = None
        model = pretrain_gpt.model_provider()
        assert [layer.mlp.linear_fc1.weight.shape[0] for layer in model.decoder.layers] == [128] * 2
    finally:
        global_vars.reset_globals()
    assert _validated("--spec", "local").spec is None


@pytest.mark.parametrize(
    "flags, message",
    [
        (["no_such_module", "spec"], "--spec no_such_module spec: cannot import module"),
        (
            ["megatron.core.models.gpt.gpt_layer_specs", "nothing"],
            "has no 'nothing'",
        ),
        ([__name__, "NOT_A_SPEC"], "is not a layer spec: expected a ModuleSpec"),
        (["only_one"], "--spec takes <module> <name> \\(or local\\), got only_one"),
    ],
)
def test_spec_flag_errors_name_the_problem(flags, message):
    from megatron.training.arguments import ArgumentValidationError

    with pytest.raises(ArgumentValidationError, match=message):
        _validated("--spec", *flags)
