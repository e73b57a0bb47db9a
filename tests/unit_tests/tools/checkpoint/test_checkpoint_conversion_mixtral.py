"""Mixtral (Hugging Face) -> our torch-format checkpoint through tools/checkpoint/convert.py.

A tiny random ``MixtralForCausalLM`` (4 experts, top-2, GQA) is converted at TP=PP=EP=1: our
GPTModel built from the checkpoint's saved args gives transformers' logits within 1e-4 (fp32).
Converted at TP=2 x PP=2 x EP=2, every file ``mp_rank_TT_PPP_EEE`` holds exactly its slices of
the one-file checkpoint: layers of its stage, its EP rank's experts (renumbered locally), TP
shards (fc1 as [gate_t; up_t])."""

import json
import os

import torch
from transformers import MixtralConfig, MixtralForCausalLM

from tests.unit_tests.tools.checkpoint.test_checkpoint_conversion_hf import (
    VOCAB,
    assert_same_tensors,
    check_logits,
    run,
)

EXPERTS = 4


def _mixtral_dir(tmp_path):
    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=EXPERTS,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = MixtralForCausalLM(config)
    src = tmp_path / "hf"
    model.save_pretrained(src)
    return src, model


def _load(path):
    import argparse

    with torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(path, weights_only=True)["model"]


def test_mixtral_logits_and_expert_parallel_shards(tmp_path):
    src, model = _mixtral_dir(tmp_path)
    run(
        "--loader", "hf_llama", "--saver", "core", "--load-dir", src, "--save-dir", tmp_path / "one"
    )
    args = check_logits(model, tmp_path / "one")
    assert args.num_experts == EXPERTS and args.moe_router_topk == 2

    run(
        "--loader",
        "hf_llama",
        "--saver",
        "core",
        "--load-dir",
        src,
        "--save-dir",
        tmp_path / "split",
        "--target-tensor-parallel-size",
        2,
        "--target-pipeline-parallel-size",
        2,
        "--target-expert-parallel-size",
        2,
    )
    full = _load(tmp_path / "one" / "release" / "mp_rank_00" / "model_optim_rng.pt")
    release = tmp_path / "split" / "release"
    assert sorted(os.listdir(release)) == [
        f"mp_rank_{t:02d}_{p:03d}_{e:03d}" for t in range(2) for p in range(2) for e in range(2)
    ]
    for t in range(2):
        for p in range(2):
            for e in range(2):
                shard = _load(release / f"mp_rank_{t:02d}_{p:03d}_{e:03d}" / "model_optim_rng.pt")
                # Stage p holds global layer p as its layer 0; EP rank e experts 2e, 2e + 1.
                layer = f"decoder.layers.{p}."
                expected_router = full[layer + "mlp.router.weight"]
                assert torch.equal(shard["decoder.layers.0.mlp.router.weight"], expected_router)
                local_names = [n for n in shard if ".local_experts." in n]
                # Two local experts, fc1 and fc2, and megatron-core's _extra_state of each.
                assert sorted(n for n in local_names if n.endswith("._extra_state")) == [
                    f"decoder.layers.0.mlp.experts.local_experts.{i}.linear_fc{j}._extra_state"
                    for i in range(2)
                    for j in (1, 2)
                ]
                assert len(local_names) == 2 * 2 * 2
                for i in range(2):
                    g = 2 * e + i
                    fc1 = full[f"{layer}mlp.experts.local_experts.{g}.linear_fc1.weight"]
                    gate, up = fc1.chunk(2)
                    expected_fc1 = torch.cat([gate.chunk(2)[t], up.chunk(2)[t]])
                    fc2 = full[f"{layer}mlp.experts.local_experts.{g}.linear_fc2.weight"]
                    ours = "decoder.layers.0.mlp.experts.local_experts."
                    assert torch.equal(shard[f"{ours}{i}.linear_fc1.weight"], expected_fc1)
                    assert torch.equal(shard[f"{ours}{i}.linear_fc2.weight"], fc2.chunk(2, 1)[t])


def test_mixtral_round_trip_through_expert_parallel_checkpoint(tmp_path):
    """HF -> ours at TP=2 x PP=2 x EP=2 -> ours at EP=1 -> HF: the same tensors as the source."""
    src, model = _mixtral_dir(tmp_path)
    split, one, back = tmp_path / "split", tmp_path / "one", tmp_path / "back"
    run(
        "--loader",
        "hf_llama",
        "--saver",
        "core",
        "--load-dir",
        src,
        "--save-dir",
        split,
        "--target-tensor-parallel-size",
        2,
        "--target-pipeline-parallel-size",
        2,
        "--target-expert-parallel-size",
        2,
    )
    run(
        "--loader",
        "core",
        "--saver",
        "core",
        "--load-dir",
        split,
        "--save-dir",
        one,
        "--target-tensor-parallel-size",
        1,
        "--target-pipeline-parallel-size",
        1,
    )
    check_logits(model, one)
    run("--loader", "core", "--saver", "hf_llama", "--load-dir", split, "--save-dir", back)
    assert_same_tensors(src, back)
    with open(back / "config.json") as f:
        config = json.load(f)
    assert config["model_type"] == "mixtral" and config["num_local_experts"] == EXPERTS


def test_expert_parallel_checkpoint_without_pipeline_parallelism(tmp_path):
    """HF -> ours at EP=2 alone (PP=1: one file per EP rank, Megatron's ``mp_rank_TT_EEE``) ->
    ours at EP=1: transformers' logits."""
    src, model = _mixtral_dir(tmp_path)
    split, one = tmp_path / "ep2", tmp_path / "one"
    common = ["--target-tensor-parallel-size", 1, "--target-pipeline-parallel-size", 1]
    run("--loader", "hf_llama", "--saver", "core", "--load-dir", src, "--save-dir", split,
        *common, "--target-expert-parallel-size", 2)  # fmt: skip
    assert sorted(os.listdir(split / "release")) == ["mp_rank_00_000", "mp_rank_00_001"]
    run("--loader", "core", "--saver", "core", "--load-dir", split, "--save-dir", one, *common)
    check_logits(model, one)
