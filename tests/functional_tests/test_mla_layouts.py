"""Multi-latent attention trains the same at every parallel layout (issue #30): the losses and
grad norms of 10 iterations at TP2+SP, PP2, PP2 with virtual stages, CP2, DP2 with the
distributed optimizer and full recompute, EP2 and TP2·EP2 (MoE) equal the one-process run's
(relative: loss 1e-6, grad norm 1e-5).

Every layout initializes the one-process model's weights, so each number is compared with the one
-process run's, per iteration (test_log_line_parity.py's scheme, whose helpers this reuses): the
one-process runs in this process, the layouts one after another in one spawned world of 2
processes. The MLA model exercises the low-rank query (--q-lora-rank), the latent norms
(--qk-layernorm), YaRN (the default --rope-type of MLA, with mscale) and values narrower than
queries/keys; TP2 splits the down projections' outputs too (Megatron's local spec). The same
world then generates at TP=2 with both KV caches (test_multi_latent_attention.py's check).
"""

import json
import os

import torch

from tests.functional_tests.runner import TINY_MODEL
from tests.functional_tests.test_log_line_parity import _train
from tests.unit_tests.core.transformer.test_multi_latent_attention import (
    tensor_parallel_generation_reference,
    tp2_generation,
)
from tests.unit_tests.dist_utils import run_distributed

ITERATIONS = 10
MLA = [
    "--multi-latent-attention",
    "--q-lora-rank", "16",
    "--kv-lora-rank", "24",
    "--qk-head-dim", "8",
    "--qk-pos-emb-head-dim", "8",
    "--v-head-dim", "12",
    "--qk-layernorm",
    "--normalization", "RMSNorm",
    "--swiglu",
    "--position-embedding-type", "rope",
    "--rotary-scaling-factor", "4",
    "--mscale", "0.7",
    "--mscale-all-dim", "0.7",
    "--yarn-original-max-position-embeddings", "16",
]  # fmt: skip
GPT = TINY_MODEL + MLA + [
    "--num-layers", "4",
    "--hidden-dropout", "0.0",
    "--attention-dropout", "0.0",
    "--train-iters", str(ITERATIONS),
    "--untie-embeddings-and-output-weights",
    "--disable-bias-linear",
]  # fmt: skip
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32"]
MOE += ["--moe-aux-loss-coeff", "0.01", "--moe-token-dispatcher-type", "alltoall"]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
PP2 = ["--pipeline-model-parallel-size", "2"]
EP2 = ["--expert-model-parallel-size", "2"]

CASES = {
    "mla": (
        GPT,
        {
            "tp2-sp": TP2_SP,
            "pp2": PP2,
            "pp2-vpp2": PP2 + ["--num-layers-per-virtual-pipeline-stage", "1"],
            "cp2": ["--context-parallel-size", "2"],
            "dp2-dist-opt-recompute": [
                "--use-distributed-optimizer",
                "--recompute-granularity", "full",
                "--recompute-method", "uniform",
                "--recompute-num-layers", "1",
            ],
        },
    ),
    "mla-moe": (
        GPT + MOE,
        {"ep2": EP2, "tp2-sp-ep2": TP2_SP + EP2 + ["--expert-tensor-parallel-size", "1"]},
    ),
}  # fmt: skip
RTOL = {"loss": 1e-6, "grad norm": 1e-5}


def _layouts(rank, world_size, path, generation_path):
    results = {}
    for model, (flags, layouts) in CASES.items():
        for layout, extra in layouts.items():
            received, _ = _train(flags + extra)
            results[f"{model} {layout}"] = received
    if rank == world_size - 1:  # the rank that logs
        with open(path, "w") as f:
            json.dump(results, f)
    tp2_generation(rank, world_size, generation_path)  # this world serves that check too


def test_mla_layouts_equal_the_one_process_run(tmp_path):
    references = {model: _train(flags)[0] for model, (flags, _) in CASES.items()}
    assert set(references["mla-moe"][0]["losses"]) == {"lm loss", "load_balancing_loss"}
    path = os.path.join(tmp_path, "layouts.json")
    generation_path = os.path.join(tmp_path, "generation.pt")
    run_distributed(_layouts, 2, path, generation_path)
    # Generation at TP=2 with either cache (keys/values, --cache-mla-latents) equals one process.
    reference = tensor_parallel_generation_reference()
    for latents, logits in torch.load(generation_path).items():
        assert (logits - reference).abs().max().item() < 1e-5, latents
    with open(path) as f:
        results = json.load(f)
    assert len(results) == sum(len(layouts) for _, layouts in CASES.values())
    for name, received in results.items():
        reference = references[name.split()[0]]
        assert len(received) == len(reference) == ITERATIONS, name
        for got, ref in zip(received, reference):
            where = (name, got["iteration"], got, ref)
            assert got["skipped"] == ref["skipped"] == 0, where
            for key, value in got["losses"].items():
                assert abs(value - ref["losses"][key]) <= RTOL["loss"] * abs(ref["losses"][key]), (
                    key,
                    where,
                )
            assert (
                abs(got["grad norm"] - ref["grad norm"]) <= RTOL["grad norm"] * ref["grad norm"]
            ), where
