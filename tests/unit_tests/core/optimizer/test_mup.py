"""--use-mup and the --mup-* flags (Megatron's muP).

* Derivation: width multiplier hidden / base, attention scale sqrt(base_head_dim) / d^power
  (1/d by default), logit multiplier 1/width unless given; contradicting or stray flags fail.
* Init (measured stds of a hidden-64 model with base 16, width 4): QKV/fc1 0.02/2, proj/fc2
  0.02/2/sqrt(2L), embeddings and the untied output layer the embedding std, not width-scaled.
* Forward: the muP model's logits equal ``mup_output_mult`` times the logits of a plain model
  with the same weights, the embedding tables multiplied by ``mup_embedding_mult`` and
  ``softmax_scale`` set to the muP attention scale (the reference knows nothing of muP).
* Optimizer groups: with Adam the hidden matrices take lr / width and eps / width, the
  embedding class (embeddings, output layer) and 1-D params the base values; with SGD the
  vector-like params take lr * width; Muon's matrices keep theirs; the scheduler applies them.
"""

import math

import pytest
import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.arguments import ArgumentValidationError, parse_args, validate_args
from tests.harness.argv import megatron_argv

HIDDEN, BASE, LAYERS, VOCAB, SEQ = 64, 16, 2, 512, 16


def config(**kw):
    kw.setdefault("num_layers", LAYERS)
    kw.setdefault("hidden_size", HIDDEN)
    kw.setdefault("num_attention_heads", 4)
    return TransformerConfig(hidden_dropout=0.0, attention_dropout=0.0, **kw)


def test_mup_derives_width_attention_scale_and_output_multiplier():
    c = config(use_mup=True, mup_base_hidden_size=BASE)
    assert c.mup_width_mult == 4.0 and c.mup_output_mult == 0.25
    assert c.softmax_scale == 1.0 / 16  # kv_channels 16, power 1
    c = config(use_mup=True, mup_base_head_dim=4.0, mup_attn_scale_power=0.5, mup_output_mult=2.0)
    assert c.mup_width_mult == 1.0 and c.mup_output_mult == 2.0
    assert c.softmax_scale == pytest.approx(math.sqrt(4.0) / math.sqrt(16))
    assert config(use_mup=True).mup_base_hidden_size == HIDDEN
    with pytest.raises(ValueError, match=r"--mup-width-mult 2.0 does not match .* = 4"):
        config(use_mup=True, mup_base_hidden_size=BASE, mup_width_mult=2.0)
    with pytest.raises(ValueError, match="--mup-base-hidden-size only take effect with --use-mup"):
        config(mup_base_hidden_size=BASE)


COMMAND_LINE = megatron_argv(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    max_position_embeddings=16,
    seq_length=16,
    micro_batch_size=1,
    train_iters=1,
    vocab_size=128,
)


def start_up_error(*flags):
    with pytest.raises(ArgumentValidationError) as info:
        validate_args(parse_args(argv=COMMAND_LINE + [str(f) for f in flags]))
    return str(info.value)


def test_mup_flags_are_checked_at_start_up(single_process_env):
    message = start_up_error("--mup-output-mult", 0.5)
    assert message == "--mup-output-mult only take effect with --use-mup"
    message = start_up_error("--use-mup", "--mup-base-hidden-size", 16, "--mup-width-mult", 3)
    assert message == (
        "--mup-width-mult 3.0 does not match --hidden-size 64 / --mup-base-hidden-size 16 = 4"
    )


def build(untie=True, **kw):
    c = config(init_seed=5, **kw)
    return GPTModel(
        c,
        get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        share_embeddings_and_output_weights=not untie,
    )


def test_mup_init_scales_the_hidden_matrices_only():
    model = build(use_mup=True, mup_base_hidden_size=BASE, embedding_init_method_std=0.05)
    stds = {n: p.detach().std().item() for n, p in model.named_parameters() if p.dim() == 2}
    expected = {
        "embedding.word_embeddings.weight": 0.05,
        "embedding.position_embeddings.weight": 0.05,
        "output_layer.weight": 0.05,
        "decoder.layers.0.self_attention.linear_qkv.weight": 0.01,
        "decoder.layers.1.mlp.linear_fc1.weight": 0.01,
        "decoder.layers.0.self_attention.linear_proj.weight": 0.01 / math.sqrt(2 * LAYERS),
        "decoder.layers.1.mlp.linear_fc2.weight": 0.01 / math.sqrt(2 * LAYERS),
    }
    for name, std in expected.items():
        assert stds[name] == pytest.approx(std, rel=0.06), name


def test_mup_forward_equals_a_plain_model_with_the_multipliers_folded_in():
    flags = dict(use_mup=True, mup_base_hidden_size=BASE, mup_embedding_mult=2.0)
    flags.update(mup_base_head_dim=4.0, mup_attn_scale_power=0.75)
    mup = build(**flags)
    plain = build(softmax_scale=2.0 / 16**0.75)
    state = mup.state_dict()
    for key in ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight"):
        state[key] = state[key] * 2.0
    plain.load_state_dict(state)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    for fused in (False, True):
        mup.config.cross_entropy_loss_fusion = plain.config.cross_entropy_loss_fusion = fused
        expected = 0.25 * plain(tokens, None, None)
        torch.testing.assert_close(mup(tokens, None, None), expected, rtol=1e-5, atol=1e-6)
    # with labels (the fused output layer + cross entropy takes the multiplier too)
    labels = tokens.roll(-1, 1)
    reference = torch.nn.functional.cross_entropy(
        expected.reshape(-1, VOCAB), labels.reshape(-1), reduction="none"
    ).view(2, SEQ)
    torch.testing.assert_close(
        mup(tokens, None, None, labels=labels), reference, rtol=1e-5, atol=1e-5
    )


def _groups_by_param(optimizer, model):
    names = {id(p): n for n, p in model.named_parameters()}
    found = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            found[names.get(id(p), None)] = group
    return found


@pytest.mark.parametrize("kind", ["adam", "sgd", "muon"])
def test_mup_learning_rates_per_parameter_class(kind):
    model = build(use_mup=True, mup_base_hidden_size=BASE)
    opt_config = OptimizerConfig(
        optimizer=kind, lr=1e-2, min_lr=1e-3, adam_eps=1e-8, mup_width_mult=4.0
    )
    optimizer = get_megatron_optimizer(opt_config, [model])
    groups = _groups_by_param(optimizer, model)  # fp32: the groups hold the params themselves
    hidden = "decoder.layers.0.self_attention.linear_qkv.weight"
    vector_like = ["decoder.layers.0.input_layernorm.weight", "embedding.word_embeddings.weight"]
    vector_like.append("output_layer.weight")
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=0, lr_decay_steps=10,
        lr_decay_style="constant", start_wd=0.0, end_wd=0.0, wd_incr_steps=10,
        wd_incr_style="constant",
    )  # fmt: skip
    scheduler.step(1)
    if kind == "adam":
        assert groups[hidden]["lr"] == pytest.approx(2.5e-3)
        assert groups[hidden]["eps"] == pytest.approx(2.5e-9)
        scheduler.lr_decay_style, scheduler.num_steps = "linear", 100  # the floor scales too
        assert scheduler.get_lr(groups[hidden]) * groups[hidden]["lr_mult"] == pytest.approx(2.5e-4)
    else:
        assert groups[hidden]["lr"] == pytest.approx(1e-2)
        assert "eps" not in groups[hidden] or groups[hidden]["eps"] == pytest.approx(1e-8)
    for name in vector_like:
        expected = 4e-2 if kind == "sgd" else 1e-2
        assert groups[name]["lr"] == pytest.approx(expected), name
