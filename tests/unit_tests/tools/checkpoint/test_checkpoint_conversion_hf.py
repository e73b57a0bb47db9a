"""Hugging Face <-> our torch-format checkpoints through tools/checkpoint/convert.py.

Tiny random transformers models are built from configs (no downloads). Round trips must give
identical tensors; our GPTModel built from the converted checkpoint (its saved args, the trainer's
config path) must give the Hugging Face model's logits within 1e-4 in fp32.
"""

import argparse
import json
import os
import sys

import pytest
import torch
import transformers  # a dependency (setup.py): missing, it must fail, not skip
from safetensors.torch import load_file, save_file  # noqa: E402

from megatron.core.dist_checkpointing.megatron_layout import (  # noqa: E402
    with_extra_state,
    without_extra_state,
)
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec  # noqa: E402
from megatron.training.configs import core_transformer_config_from_args  # noqa: E402
from tests.harness import REPO

_TOOLS = str(REPO / "tools" / "checkpoint")
sys.path.insert(0, os.path.abspath(_TOOLS))
import convert  # noqa: E402
from protocol import ConversionError  # noqa: E402

VOCAB = 100


def run(*argv):
    convert.convert(["--model-type", "GPT", *[str(a) for a in argv]], in_process=True)


def hf_tensors(path):
    return load_file(os.path.join(path, "model.safetensors"))


def load_shard(ckpt, tp=0, pp=0, pp_size=1, release=True):
    name = f"mp_rank_{tp:02d}" + (f"_{pp:03d}" if pp_size > 1 else "")
    with torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(
            os.path.join(
                ckpt, "release" if release else "iter_0000000", name, "model_optim_rng.pt"
            ),
            weights_only=True,
        )


def our_model(args):
    config = core_transformer_config_from_args(args)
    return GPTModel(
        config,
        get_gpt_decoder_block_spec(config, use_transformer_engine=False),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor,
    )


def check_logits(hf_model, ckpt, seq=12):
    state = load_shard(ckpt)
    args = state["args"]
    model = our_model(args)
    model.load_state_dict(without_extra_state(state["model"]), strict=True)
    # megatron-core's (empty) _extra_state entries, as the trainer writes them for this model.
    written = with_extra_state(model, model.state_dict())
    extra = {k: v for k, v in state["model"].items() if k.endswith("._extra_state")}
    assert extra == {k: v for k, v in written.items() if not torch.is_tensor(v)}
    model.eval()
    hf_model.eval()
    torch.manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2, seq))
    positions = torch.arange(seq).unsqueeze(0).expand(2, seq)
    with torch.no_grad():
        ours = model(tokens, positions, None)[..., :VOCAB]
        theirs = hf_model(input_ids=tokens).logits
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    # Sanity: the comparison is not vacuous.
    assert theirs.abs().max() > 1e-2
    return args


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=4,
        n_embd=32,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=32,
        bos_token_id=VOCAB - 1,
        eos_token_id=VOCAB - 1,
    )
    model = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():  # non-trivial norms and biases, so a swapped tensor shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("hf_gpt2")
    model.save_pretrained(path)
    return path, model


def _llama_like(tmp_path_factory, kind):
    torch.manual_seed(0)
    common = dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
    )
    if kind == "llama":
        config = transformers.LlamaConfig(
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
            **common,
        )
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.Qwen2Config(tie_word_embeddings=True, **common)
        model = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    path = tmp_path_factory.mktemp(f"hf_{kind}")
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return _llama_like(tmp_path_factory, "llama")


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    return _llama_like(tmp_path_factory, "qwen2")


def assert_same_tensors(a_dir, b_dir):
    a, b = hf_tensors(a_dir), hf_tensors(b_dir)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name


def test_gpt2_round_trip_tp1_and_tp2_pp2(gpt2_dir, tmp_path):
    src, _ = gpt2_dir
    for tp, pp in ((1, 1), (2, 2)):
        ours, back = tmp_path / f"ours_{tp}_{pp}", tmp_path / f"back_{tp}_{pp}"
        run(
            "--loader",
            "hf_gpt2",
            "--saver",
            "core",
            "--load-dir",
            src,
            "--save-dir",
            ours,
            "--target-tensor-parallel-size",
            tp,
            "--target-pipeline-parallel-size",
            pp,
        )
        assert (ours / "latest_checkpointed_iteration.txt").read_text() == "release"
        run("--loader", "core", "--saver", "hf_gpt2", "--load-dir", ours, "--save-dir", back)
        assert_same_tensors(src, back)
        reloaded = transformers.GPT2LMHeadModel.from_pretrained(back)
        assert (
            reloaded.config.vocab_size == VOCAB
            and reloaded.config.activation_function == "gelu_new"
        )


def test_gpt2_logits_match(gpt2_dir, tmp_path):
    src, model = gpt2_dir
    run(
        "--loader", "hf_gpt2", "--saver", "core", "--load-dir", src, "--save-dir", tmp_path / "ours"
    )
    args = check_logits(model, tmp_path / "ours")
    # GPT-2's gelu_new is the tanh GeLU, which our MLP runs through the fused bias-GeLU flag.
    assert (
        args.bias_gelu_fusion
        and args.add_bias_linear
        and not args.untie_embeddings_and_output_weights
    )
    assert args.padded_vocab_size == 128 and args.true_vocab_size == VOCAB


def test_llama_gqa_logits_and_round_trip(llama_dir, tmp_path):
    src, model = llama_dir
    run(
        "--loader",
        "hf_llama",
        "--saver",
        "core",
        "--load-dir",
        src,
        "--save-dir",
        tmp_path / "ours",
    )
    args = check_logits(model, tmp_path / "ours")
    assert args.group_query_attention and args.num_query_groups == 2 and args.swiglu
    assert args.normalization == "RMSNorm" and args.rotary_base == 5000
    run(
        "--loader",
        "hf_llama",
        "--saver",
        "core",
        "--load-dir",
        src,
        "--save-dir",
        tmp_path / "tp2",
        "--target-tensor-parallel-size",
        2,
        "--target-pipeline-parallel-size",
        2,
    )
    run(
        "--loader",
        "core",
        "--saver",
        "hf_llama",
        "--load-dir",
        tmp_path / "tp2",
        "--save-dir",
        tmp_path / "back",
    )
    assert_same_tensors(src, tmp_path / "back")
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_key_value_heads"] == 2
    transformers.LlamaForCausalLM.from_pretrained(tmp_path / "back")


def test_qwen2_qkv_bias_tied_logits_and_round_trip(qwen2_dir, tmp_path):
    src, model = qwen2_dir
    run(
        "--loader",
        "hf_llama",
        "--saver",
        "core",
        "--load-dir",
        src,
        "--save-dir",
        tmp_path / "ours",
        "--target-tensor-parallel-size",
        2,
    )
    run(
        "--loader",
        "core",
        "--saver",
        "core",
        "--load-dir",
        tmp_path / "ours",
        "--save-dir",
        tmp_path / "tp1",
        "--target-tensor-parallel-size",
        1,
    )
    args = check_logits(model, tmp_path / "tp1")
    assert (
        args.add_qkv_bias
        and not args.add_bias_linear
        and not args.untie_embeddings_and_output_weights
    )
    run(
        "--loader",
        "core",
        "--saver",
        "hf_llama",
        "--load-dir",
        tmp_path / "ours",
        "--save-dir",
        tmp_path / "back",
    )
    assert_same_tensors(src, tmp_path / "back")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["model_type"] == "qwen2"


def test_clear_errors(gpt2_dir, llama_dir, tmp_path):
    src, _ = gpt2_dir
    with pytest.raises(ConversionError, match="unknown --loader 'nope'"):
        run("--loader", "nope", "--saver", "core", "--load-dir", src, "--save-dir", tmp_path / "x")
    with pytest.raises(ConversionError, match="does not exist"):
        run(
            "--loader",
            "hf_gpt2",
            "--saver",
            "core",
            "--load-dir",
            tmp_path / "missing",
            "--save-dir",
            tmp_path / "x",
        )
    with pytest.raises(ConversionError, match="model_type 'gpt2'.*hf_llama loader"):
        run(
            "--loader",
            "hf_llama",
            "--saver",
            "core",
            "--load-dir",
            src,
            "--save-dir",
            tmp_path / "x",
        )
    with pytest.raises(ConversionError, match="latest_checkpointed_iteration.txt not found"):
        run(
            "--loader",
            "core",
            "--saver",
            "hf_gpt2",
            "--load-dir",
            src,
            "--save-dir",
            tmp_path / "x",
        )
    # A tensor of the wrong shape is named.
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((src / "config.json").read_text())
    tensors = hf_tensors(src)
    tensors["transformer.h.1.mlp.c_fc.weight"] = tensors["transformer.h.1.mlp.c_fc.weight"][
        :, :-1
    ].contiguous()
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        ConversionError, match=r"shape mismatch for 'transformer\.h\.1\.mlp\.c_fc\.weight'"
    ):
        run(
            "--loader",
            "hf_gpt2",
            "--saver",
            "core",
            "--load-dir",
            bad,
            "--save-dir",
            tmp_path / "x",
        )
    assert not (tmp_path / "x" / "latest_checkpointed_iteration.txt").exists()
    # A Llama cannot be written as GPT-2.
    with pytest.raises(ConversionError, match="cannot be written as GPT-2"):
        run(
            "--loader",
            "hf_llama",
            "--saver",
            "hf_gpt2",
            "--load-dir",
            llama_dir[0],
            "--save-dir",
            tmp_path / "y",
        )
