"""Greedy generation of tiny random GPT-2 and Llama models converted from Hugging Face by
tools/checkpoint/convert.py equals ``transformers``' ``generate`` token for token (fp32, CPU),
for a batch of prompts of different lengths; the log-probs equal transformers' log-softmax.
"""

import argparse
import os
import sys

import pytest
import torch
import transformers

from megatron.core.dist_checkpointing.megatron_layout import without_extra_state
from megatron.core.inference import InferenceModelForward, SamplingParams, SpecialTokens, generate
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.training.configs import core_transformer_config_from_args
from tests.harness import REPO

_TOOLS = str(REPO / "tools" / "checkpoint")
sys.path.insert(0, os.path.abspath(_TOOLS))
import convert  # noqa: E402

VOCAB = 100
NEW_TOKENS = 8


def hf_model(kind):
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64,
            initializer_range=0.2, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(config).eval()
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
        tie_word_embeddings=False, initializer_range=0.2,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


def converted(kind, model, tmp_path):
    model.save_pretrained(tmp_path / "hf")
    convert.convert(
        ["--model-type", "GPT", "--loader", f"hf_{kind}", "--saver", "core"]
        + ["--load-dir", str(tmp_path / "hf"), "--save-dir", str(tmp_path / "ours")],
        in_process=True,
    )
    path = tmp_path / "ours" / "release" / "mp_rank_00" / "model_optim_rng.pt"
    with torch.serialization.safe_globals([argparse.Namespace]):
        state = torch.load(path, weights_only=True)
    args = state["args"]
    ours = GPTModel(
        core_transformer_config_from_args(args),
        get_gpt_layer_local_spec(),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base,
    )
    ours.load_state_dict(without_extra_state(state["model"]), strict=True)
    return ours.eval(), args


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_greedy_generation_equals_transformers_generate(kind, tmp_path):
    model = hf_model(kind)
    ours, args = converted(kind, model, tmp_path)
    assert args.padded_vocab_size > VOCAB  # the padding rows must not be sampled
    torch.manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,)).tolist() for n in (5, 9, 2)]
    step = InferenceModelForward(ours, VOCAB, args.hidden_size, torch.float32)
    params = SamplingParams(num_tokens_to_generate=NEW_TOKENS, top_k=1, return_log_probs=True)
    got = generate(step, prompts, params, SpecialTokens(), args.max_position_embeddings)
    total = 9 + NEW_TOKENS
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            want = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=total - len(prompt),
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            logits = model(want).logits[0, :-1].double()
        assert got.tokens[i].tolist() == want[0].tolist()
        want_log_probs = logits.log_softmax(-1).gather(1, want[0, 1:, None]).squeeze(1)
        torch.testing.assert_close(got.log_probs[i].double(), want_log_probs, rtol=0, atol=1e-4)
    assert len(set(got.tokens[1, 9:].tolist())) > 1  # not a degenerate repetition
