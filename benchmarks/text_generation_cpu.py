"""Greedy generation speed on CPU: our KV-cached loop, our loop without the cache (full
recompute), and transformers' ``generate`` on the same GPT-2 weights (converted with
tools/checkpoint/convert.py). Prints tokens/s (generated tokens only) and checks that the three
produce the same tokens.

    OMP_NUM_THREADS=1 python benchmarks/text_generation_cpu.py [--layers 4 --hidden 256 ...]
"""

import argparse
import os
import sys
import tempfile
import time

import torch
import transformers

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools", "checkpoint"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import convert  # noqa: E402

from megatron.core.dist_checkpointing.megatron_layout import without_extra_state  # noqa: E402
from megatron.core.inference import (  # noqa: E402
    InferenceModelForward,
    SamplingParams,
    SpecialTokens,
    generate,
)
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.training.configs import core_transformer_config_from_args  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    opts = parser.parse_args()
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=opts.layers, n_embd=opts.hidden, n_head=opts.heads, vocab_size=opts.vocab,
        n_positions=opts.prompt + opts.new, initializer_range=0.2,
        bos_token_id=opts.vocab - 1, eos_token_id=opts.vocab - 1,
    )  # fmt: skip
    hf = transformers.GPT2LMHeadModel(config).eval()
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(os.path.join(tmp, "hf"))
        convert.convert(
            ["--model-type", "GPT", "--loader", "hf_gpt2", "--saver", "core"]
            + ["--load-dir", os.path.join(tmp, "hf"), "--save-dir", os.path.join(tmp, "ours")],
            in_process=True,
        )
        path = os.path.join(tmp, "ours", "release", "mp_rank_00", "model_optim_rng.pt")
        with torch.serialization.safe_globals([argparse.Namespace]):
            state = torch.load(path, weights_only=True)
    args = state["args"]
    ours = GPTModel(
        core_transformer_config_from_args(args),
        get_gpt_layer_local_spec(),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        share_embeddings_and_output_weights=True,
    ).eval()
    ours.load_state_dict(without_extra_state(state["model"]), strict=True)
    step = InferenceModelForward(ours, opts.vocab, opts.hidden, torch.float32)
    prompts = torch.randint(0, opts.vocab, (opts.batch, opts.prompt))
    params = SamplingParams(num_tokens_to_generate=opts.new, top_k=1)

    def run_ours(cache):
        out = generate(step, prompts.tolist(), params, SpecialTokens(), 10**6, use_kv_cache=cache)
        return out.tokens

    def run_hf():
        with torch.no_grad():
            return hf.generate(
                prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=opts.new,
                do_sample=False, eos_token_id=None, pad_token_id=0,
            )  # fmt: skip

    runners = {"ours, KV cache": lambda: run_ours(True), "transformers generate": run_hf,
               "ours, full recompute": lambda: run_ours(False)}  # fmt: skip
    results, times = {}, {name: [] for name in runners}
    for _ in range(opts.rounds):
        for name, fn in runners.items():
            start = time.perf_counter()
            results[name] = fn()
            times[name].append(time.perf_counter() - start)
    reference = results["transformers generate"]
    for name in runners:
        best = min(times[name])
        same = torch.equal(results[name], reference)
        print(
            f"{name:24s} {opts.batch * opts.new / best:9.1f} tokens/s  (best of {opts.rounds}: "
            f"{best:.3f} s; same tokens as transformers: {same})"
        )


if __name__ == "__main__":
    main()
