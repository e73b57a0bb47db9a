"""The theoretical memory report (megatron/training/theoretical_memory.py) for DeepSeek-V3-class
models: multi-latent attention (MLA), multi-token prediction (MTP) and the dense/MoE layer mix.

* Parameters: the report's count per pipeline stage equals the sum of numel of the stage built in
  this process (embedding on the first stage; MTP depth, output layer and the word-embedding copy
  on the last), for a tiny DeepSeek-like model (MLA with and without q LoRA, a dense first layer
  then MoE layers with a shared expert, one MoE MTP depth) at PP=1 and PP=2. At PP=2 the stages
  hold different numbers of MoE layers, which an even spread would get wrong.
* Activations: the bytes one MLA layer's attention part (input norm + self_attention) saves for
  backward, measured with saved_tensors_hooks (distinct storages, parameters excluded), against
  ``theoretical_memory_mla.mla_attention_elements`` x element size, float32 and bf16, with and
  without q LoRA, with selective recompute (the only way q/k/v are kept as themselves when the
  value heads are narrower: CPU's SDPA math fallback keeps copies) and without (equal widths). A
  saved storage is attributed to the formula when it is a tensor the layer's modules pass around
  (an input or output of one of its modules); what a kernel keeps of its own (a norm's rstd and
  fp32 intermediates, RoPE's cos/sin tables, SDPA's row statistics, the unfused path's
  probabilities, which the score term counts) is not in the formula, as in Megatron's. Tolerance
  0: the same measurement of a standard-attention layer equals the standard formula's attention
  terms exactly (the bar), and so must MLA's. Full recompute of an MLA block keeps the layer
  inputs only; the MTP depth on the last stage counts an MLA layer.
"""

import contextlib
import io

import pytest
import torch

from megatron.training.theoretical_memory import (
    activation_components,
    compute_theoretical_memory,
    layer_activation_bytes,
)
from megatron.training.theoretical_memory_mla import mla_attention_elements
from tests.harness.argv import megatron_argv
from tests.unit_tests.tiny_configs import validated_args

pytestmark = pytest.mark.usefixtures("single_thread")

S, B, H, HEADS = 16, 2, 64, 4
BASE = megatron_argv(
    num_layers=4,
    hidden_size=H,
    ffn_hidden_size=96,
    num_attention_heads=HEADS,
    seq_length=S,
    max_position_embeddings=S,
    micro_batch_size=B,
    vocab_size=200,
    make_vocab_size_divisible_by=8,
    train_iters=1,
    lr=1e-3,
    attention_dropout=0,
    hidden_dropout=0,
    position_embedding_type="rope",
    swiglu=True,
    disable_bias_linear=True,
    untie_embeddings_and_output_weights=True,
)
# q/k heads 8 + 6 = 14 wide, value heads 10: a formula using the wrong width fails.
MLA = ["--multi-latent-attention", "--qk-layernorm", "--kv-lora-rank", "24"]
MLA += ["--qk-head-dim", "8", "--qk-pos-emb-head-dim", "6", "--v-head-dim", "10"]
Q_LORA = ["--q-lora-rank", "16"]
MOE = ["--num-experts", "4", "--moe-ffn-hidden-size", "16", "--moe-router-topk", "2"]
MOE += ["--moe-shared-expert-intermediate-size", "32", "--moe-layer-freq", "([0]*1+[1]*3)"]
MTP = ["--mtp-num-layers", "1"]


def make_args(argv, world_size=1):
    from megatron.training.tokenizer import build_tokenizer

    args = validated_args(argv, world_size, defaults={"tokenizer_type": "GPT2BPETokenizer"})
    with contextlib.redirect_stdout(io.StringIO()):
        build_tokenizer(args)
    return args


# ----------------------------------------------------------------------------- parameters
def _stage_parameters(args, pp_rank, layers, offset):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.multi_token_prediction import mtp_layer_spec
    from megatron.training.configs import core_transformer_config_from_args

    pp = args.pipeline_model_parallel_size
    config = core_transformer_config_from_args(args)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    post = pp_rank == pp - 1
    model = GPTModel(
        config,
        spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pp_rank == 0,
        post_process=post,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        num_layers=layers,
        layer_number_offset=offset,
        mtp_block_spec=mtp_layer_spec(spec) if post else None,
    )
    moe = sum(1 for layer in model.decoder.layers if hasattr(layer.mlp, "router"))
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return sum(p.numel() for p in model.parameters()), experts, moe


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("q_lora", [True, False], ids=["q_lora", "full_q"])
def test_parameters_per_stage_equal_the_built_stages(pp, q_lora):
    """Each stage's count (MLA layers, dense first layer then MoE layers with a shared expert,
    the MoE MTP depth and the word-embedding copy on the last stage) and its routed-expert part
    are the built stage's."""
    argv = BASE + MLA + (Q_LORA if q_lora else []) + MOE + MTP
    args = make_args(argv + ["--pipeline-model-parallel-size", str(pp)], world_size=pp)
    offset, moe_by_stage = 0, []
    for rank in range(pp):
        report = compute_theoretical_memory(args, pp_rank=rank)
        layers = 4 // pp
        built, experts, moe = _stage_parameters(args, rank, layers, offset)
        assert report.parameters == built, (rank, report.parameters, built)
        # The routed experts (the MTP depth's included), whose optimizer state is sharded
        # over expert data parallel.
        assert report.expert_parameters == experts, (rank, report.expert_parameters, experts)
        moe_by_stage.append(moe)
        offset += layers
    assert moe_by_stage == ([3] if pp == 1 else [1, 2])


# ----------------------------------------------------------------------------- activations
def _saved_bytes(module, inputs, counted):
    """(bytes of the formula-modelled tensors, bytes kept by kernels) that ``module(*inputs)``
    saves for backward in one forward, of what the submodules whose names pass ``counted`` (the
    module's own ops: "") save. Modelled: a tensor some submodule takes or gives."""
    stack, passed, saved = [], set(), {}

    def tensors(values):
        for value in values if isinstance(values, (tuple, list)) else (values,):
            if torch.is_tensor(value):
                passed.add(value.untyped_storage().data_ptr())

    def enter(module, inputs, name):
        stack.append(name)
        tensors(inputs)

    def leave(module, inputs, output):
        stack.pop()
        tensors(output)

    for name, sub in module.named_modules():
        sub.register_forward_pre_hook(lambda m, i, name=name: enter(m, i, name))
        sub.register_forward_hook(leave)
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}

    def pack(tensor):
        ptr = tensor.untyped_storage().data_ptr()
        if counted(stack[-1] if stack else "") and ptr not in params and ptr not in saved:
            saved[ptr] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(*inputs)
    out = out[0] if isinstance(out, tuple) else out
    out.float().sum().backward()  # the graph is whole
    modelled = sum(n for ptr, n in saved.items() if ptr in passed)
    return modelled, sum(saved.values()) - modelled


def _layer_spec_and_config(args):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.training.configs import core_transformer_config_from_args

    config = core_transformer_config_from_args(args)
    return get_gpt_decoder_block_spec(config, use_transformer_engine=False), config


def _attention_block_saved(args):
    """_saved_bytes of one layer's attention part (input_layernorm and self_attention)."""
    from megatron.core.transformer.transformer_block import TransformerBlock

    spec, config = _layer_spec_and_config(args)
    layer = TransformerBlock(config, spec, post_layer_norm=False).layers[0].train()
    x = torch.randn(S, B, H, dtype=config.params_dtype, requires_grad=True)
    return _saved_bytes(
        layer, (x,), lambda name: name.startswith(("input_layernorm", "self_attention"))
    )


def _formula_attention_bytes(args):
    """The formula's attention terms of one layer (no dropout masks: the test runs without
    dropout), per the standard formula or ``mla_attention_elements``."""
    element = 2 if args.bf16 else 4
    if args.multi_latent_attention:
        outside, inside = mla_attention_elements(args)
    else:
        outside, inside = 2 * H, 4 * H  # norm and QKV inputs; Q, K, V and projection input
    return element * S * B * (outside + inside)


# The flags of each measured case (on top of BASE and RMSNorm).
CASES = {
    "standard fp32": [],
    "standard bf16 LayerNorm": ["--bf16", "--normalization", "LayerNorm"],
    "mla fp32 selective": MLA + ["--recompute-activations"],
    "mla+q_lora fp32 selective": MLA + Q_LORA + ["--recompute-activations"],
    "mla+q_lora bf16 LayerNorm selective": MLA
    + Q_LORA
    + ["--bf16", "--normalization", "LayerNorm", "--recompute-activations"],
    "mla bf16 LayerNorm selective": MLA
    + ["--bf16", "--normalization", "LayerNorm", "--recompute-activations"],
    # Equal q/k and value widths (8 + 4 = 12): the attention itself (unfused fp32 path, SDPA's
    # CPU flash kernel in bf16) keeps q, k and v without recompute.
    "mla+q_lora fp32 equal heads": [
        a if a not in ("6", "10") else {"6": "4", "10": "12"}[a] for a in MLA + Q_LORA
    ],
    "mla+q_lora bf16 LayerNorm equal heads": [
        a if a not in ("6", "10") else {"6": "4", "10": "12"}[a] for a in MLA + Q_LORA
    ]
    + ["--bf16", "--normalization", "LayerNorm"],
}


@pytest.mark.parametrize("case", list(CASES))
def test_attention_activations_equal_the_saved_tensors(case):
    """fp32 runs RMSNorm, bf16 LayerNorm: CPU's rms_norm keeps fp32 copies in place of a 16-bit
    input, layer_norm keeps the input itself (the tensor the formula counts)."""
    args = make_args(BASE + ["--normalization", "RMSNorm"] + CASES[case])
    modelled, kernels = _attention_block_saved(args)
    assert modelled == _formula_attention_bytes(args), (case, modelled, kernels)


def test_mla_layer_formula_replaces_only_the_attention_terms():
    """The MLA layer = the standard layer with its attention tensors swapped for MLA's, the MLP
    and masks unchanged, under selective recompute too; TP splits the inside part."""
    std = make_args(BASE + ["--bf16"])
    mla = make_args(BASE + ["--bf16"] + MLA + Q_LORA)
    outside, inside = mla_attention_elements(mla)
    # q LoRA: 2h + 2 x 16 (q latent, its norm output) + (24 + 6) + 24 (kv latent, norm output).
    assert (outside, inside) == (2 * H + 32 + 30 + 24, HEADS * (14 + 14 + 18 + 10))
    delta = 2 * S * B * (outside + inside - 6 * H)
    assert layer_activation_bytes(mla).total == layer_activation_bytes(std).total + delta
    sel = ["--recompute-granularity", "selective", "--recompute-modules", "core_attn", "mlp"]
    assert layer_activation_bytes(make_args(BASE + ["--bf16"] + MLA + Q_LORA + sel)).total == (
        layer_activation_bytes(make_args(BASE + ["--bf16"] + sel)).total + delta
    )
    tp2 = ["--tensor-model-parallel-size", "2"]
    split = layer_activation_bytes(make_args(BASE + ["--bf16"] + MLA + Q_LORA + tp2, 2))
    assert split.inside_tp == layer_activation_bytes(mla).inside_tp / 2
    assert split.outside_tp == layer_activation_bytes(mla).outside_tp
    # Sequence parallelism: the kv latent reaches its norm as an r_kv-wide chunk, all / TP.
    sp = make_args(BASE + ["--bf16"] + MLA + Q_LORA + tp2 + ["--sequence-parallel"], 2)
    assert mla_attention_elements(sp, True)[0] == outside - 6


def test_mla_scores_follow_the_attention_that_runs():
    """Value heads narrower than q/k heads take SDPA: a GPU kernel keeps no scores, CPU's math
    fallback keeps fp32 probabilities (measured: a tensor of heads x s x s fp32 is saved)."""
    bf16 = make_args(BASE + ["--bf16"] + MLA)
    assert layer_activation_bytes(bf16, "cuda").attention_scores == 0
    assert layer_activation_bytes(bf16, "cpu").attention_scores == 9 * HEADS * S * S * B
    unfused = make_args(BASE + MLA + ["--attention-backend", "unfused"])
    assert layer_activation_bytes(unfused, "cuda").attention_scores == 0
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from tests.unit_tests.tiny_configs import tiny_transformer_config

    attention = DotProductAttention(tiny_transformer_config(num_layers=1), layer_number=1)
    q, k = (torch.randn(S, B, HEADS, 14, dtype=torch.bfloat16, requires_grad=True) for _ in "qk")
    v = torch.randn(S, B, HEADS, 10, dtype=torch.bfloat16, requires_grad=True)
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: shapes.append((tuple(t.shape), t.dtype)) or t, lambda t: t
    ):
        attention(q, k, v, None)
    assert ((B, HEADS, S, S), torch.float32) in shapes


def test_full_recompute_of_an_mla_layer_keeps_its_input():
    """Full recompute (uniform, one layer per chunk) of a 2-layer MLA block saves each layer's
    input only: the formula's checkpointed inputs."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.training.configs import core_transformer_config_from_args

    full = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
    args = make_args(BASE + MLA + Q_LORA + full + ["--recompute-num-layers", "1"])
    args.num_layers = 2
    config = core_transformer_config_from_args(args)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    block = TransformerBlock(config, spec, post_layer_norm=False).train()
    x = torch.randn(S, B, H, requires_grad=True)
    saved = {}

    def pack(tensor):
        saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    parts = activation_components(args, 1, 0, 2)
    assert sum(saved.values()) == parts["transformer layers (checkpointed inputs)"]


def test_mtp_depth_counts_an_mla_layer_and_its_recompute():
    """The last stage's MTP depth is one MLA layer's activations plus its enorm/hnorm/eh_proj
    inputs (4h) and a second output layer; with full uniform recompute, its two inputs."""
    argv = BASE + ["--bf16"] + MLA + Q_LORA + MTP
    args = make_args(argv)
    parts = activation_components(args, 1, 0, 4)
    logits = parts["output layer and loss (input, fp32 logits)"]
    layer = layer_activation_bytes(args).total
    key = "multi-token prediction (layers, eh_proj inputs, logits)"
    assert parts[key] == layer + 4 * 2 * S * B * H + logits
    full = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
    recomputed = activation_components(make_args(argv + full + ["--recompute-num-layers", "1"]))
    assert recomputed[key] == 2 * 2 * S * B * H + logits
    assert recomputed["recompute working set (one chunk)"] == layer + 4 * 2 * S * B * H


@pytest.mark.parametrize("precision", [[], ["--bf16", "--normalization", "LayerNorm"]])
def test_mtp_depth_saves_its_norm_and_eh_proj_inputs(precision):
    """One MTP depth, around its transformer layer (measured above) and its final norm (in the
    output layer's term): enorm's and hnorm's inputs and eh_proj's [s, b, 2h] input, the 4h
    elements per token that the formula adds."""
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionLayer,
        mtp_layer_spec,
    )

    args = make_args(BASE + ["--normalization", "RMSNorm"] + MLA + Q_LORA + MTP + precision)
    spec, config = _layer_spec_and_config(args)
    depth = MultiTokenPredictionLayer(config, mtp_layer_spec(spec), depth=1).train()
    hidden, embedded = (
        torch.randn(S, B, H, dtype=config.params_dtype, requires_grad=True) for _ in "he"
    )
    modelled, _ = _saved_bytes(
        depth,
        (hidden, embedded),
        lambda name: not name.startswith(("transformer_layer", "final_layernorm")),
    )
    assert modelled == 4 * H * S * B * (2 if args.bf16 else 4)
