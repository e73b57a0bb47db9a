"""--use-megatron-fsdp with every --data-parallel-sharding-strategy (no_shard, optim, optim_grads,
optim_grads_params) equals the one-process run over 10 iterations (loss 1e-6, grad norm 1e-5,
relative) at DP2, at DP2 x TP2 and with EP2 (MoE), on CPU/gloo.

The one-process runs (a dense GPT with tied embeddings, a MoE GPT with untied ones) are in this
process; the layouts run in-process in two spawned worlds (one test each), each running every
strategy in turn:

* 2 ranks: each strategy at DP2 (dense) and at DP2 x EP2 (MoE: expert DP is 1 while DP is 2, so
  under optim_grads_params the expert gradients must be rescaled from FSDP's expert-DP average to
  Megatron's sum over DP; a missing rescale doubles their share of the grad norm). The
  optim_grads_params EP2 run saves a --ckpt-format fsdp_dtensor checkpoint at iteration 5, which
  then resumes at another strategy and EP size (optim, EP1: the distributed optimizer on DDP
  buffers instead of FSDP2 shards) with the one-process run's next losses.
* 4 ranks: each strategy at DP2 x TP2 (SP) (dense), with --overlap-grad-reduce, small buckets
  (--ddp-bucket-size) and, where there is something to gather, --overlap-param-gather; and
  optim_grads_params at DP2 x TP2 (SP) x EP2 x ETP1 (MoE: experts sharded over their expert
  data-parallel group of 2, the dense weights over DP2).

A third world of 2 ranks trains three of Megatron-LM's test configurations with Megatron-FSDP,
shrunk to CPU sizes (see megatron_configs_shrunk; their validation at their own 8 ranks is in
test_megatron_test_cases.py).

Gradient accumulation fusion stays on (the default): Megatron-FSDP turns it off itself with
Megatron's warning.
"""

import json
import os

import pytest

from tests.functional_tests.runner import TINY_MODEL
from tests.functional_tests.test_log_line_parity import _train
from tests.unit_tests.dist_utils import run_distributed

ITERATIONS = 10
SAVED_AT = 5
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
MODEL = list(TINY_MODEL)
del MODEL[MODEL.index("--ckpt-format") : MODEL.index("--ckpt-format") + 2]
MODEL += ["--hidden-dropout", "0.0", "--attention-dropout", "0.0"]
MODEL += ["--train-iters", str(ITERATIONS)]
DENSE = MODEL  # tied embeddings
MOE = MODEL + ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48"]
MOE += ["--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001"]
MOE += ["--moe-shared-expert-intermediate-size", "32", "--moe-shared-expert-gate"]
MOE += ["--untie-embeddings-and-output-weights"]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
EP2 = ["--expert-model-parallel-size", "2"]
RTOL = {"loss": 1e-6, "grad norm": 1e-5}


def megatron_fsdp(strategy):
    return [
        "--use-megatron-fsdp",
        "--ckpt-format",
        "fsdp_dtensor",
        "--data-parallel-sharding-strategy",
        strategy,
    ]


def _overlap(strategy):
    # 2,000 elements per bucket: several buckets per layer of the tiny model.
    flags = ["--overlap-grad-reduce", "--ddp-bucket-size", "2000"]
    return flags + ([] if strategy == "no_shard" else ["--overlap-param-gather"])


WORLDS = {"dp2": 2, "dp2-tp2": 4, "megatron-configs": 2}
"""The spawned worlds (one per test) and their sizes."""


def _runs_of_world(world, tmp):
    """{name: (reference model, argv)} of the runs of one world, in order (reference None: a
    Megatron configuration, which only has to train)."""
    runs = {}
    if world == "dp2":
        for strategy in STRATEGIES:
            runs[f"{strategy} dp2"] = ("dense", DENSE + megatron_fsdp(strategy))
            save = []
            if strategy == "optim_grads_params":
                save = ["--save", os.path.join(tmp, "ckpt"), "--save-interval", str(SAVED_AT)]
            runs[f"{strategy} dp2-ep2"] = ("moe", MOE + megatron_fsdp(strategy) + EP2 + save)
        load = ["--load", os.path.join(tmp, "ckpt"), "--ckpt-step", str(SAVED_AT)]
        runs["optim dp2 resumed from optim_grads_params dp2-ep2"] = (
            "moe",
            MOE + megatron_fsdp("optim") + load,
        )
    elif world == "dp2-tp2":
        for strategy in STRATEGIES:
            runs[f"{strategy} dp2-tp2-sp overlapped"] = (
                "dense",
                DENSE + megatron_fsdp(strategy) + TP2_SP + _overlap(strategy),
            )
        runs["optim_grads_params dp2-tp2-sp-ep2-etp1"] = (
            "moe",
            MOE
            + megatron_fsdp("optim_grads_params")
            + TP2_SP
            + EP2
            + ["--expert-tensor-parallel-size", "1"],
        )
    else:
        runs = {name: (None, argv) for name, argv in megatron_configs_shrunk(tmp).items()}
    return runs


def megatron_configs_shrunk(tmp):
    """Megatron-LM's test configurations with Megatron-FSDP that no torchrun launch trains, at
    CPU sizes on 2 ranks (3 iterations each):

    * gpt3_mcore_te_mfsdp_v2_cp2 (Megatron-FSDP with CP 2 at DP 4): CP 2, DP 1, so the FSDP
      shards are over the two CP ranks;
    * the DeepSeek proxy with EP overlap (deepseek_proxy_fsdp_ep2_fsdp2_ep_overlap): MLA, a
      dense then a MoE layer, EP 2 under optim_grads_params, --overlap-moe-expert-parallel-comm
      --delay-wgrad-compute. Its Megatron-FSDP v2 twin (deepseek_proxy_mfsdp_v2_ep2_ep_overlap)
      shrinks to the same command line but for --megatron-fsdp-version 2 (speed only here) and
      --use-distributed-optimizer (which the strategy decides): not run twice;
    * the DeepSeek proxy with per-token loss (deepseek_proxy_mfsdp_v2_ep2_mb2_per_token_loss):
      the same model with --calculate-per-token-loss and the sequence aux loss.
    """
    from tests.functional_tests.test_megatron_test_cases import (
        DEEPSEEK_CASES,
        MFSDP_V2_CP2,
        SHRUNK,
        argv_of,
    )

    proxy = {
        **SHRUNK,
        "num_layers": 2,
        "moe_layer_freq": "([0]*1+[1]*1)",
        "ffn_hidden_size": 128,
        "num_attention_heads": 4,
        "kv_channels": 16,
        "moe_ffn_hidden_size": 32,
        "moe_shared_expert_intermediate_size": 32,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_head_dim": 16,
        "qk_pos_emb_head_dim": 8,
        "v_head_dim": 16,
        "logging_level": None,  # 10 (debug): pages of debug output
    }
    configs = {"gpt3_mcore_te_mfsdp_v2_cp2": {**MFSDP_V2_CP2, **SHRUNK}}
    for name in ("deepseek_ep_overlap", "deepseek_per_token_loss"):
        configs[name] = {**DEEPSEEK_CASES[name], **proxy}
    return {
        f"Megatron's {name}, shrunk": argv_of(
            {**config, "tensorboard_dir": os.path.join(tmp, f"{name}_tb")}
        )
        for name, config in configs.items()
    }


def _layouts(rank, world_size, tmp, world):
    results = {}
    for name, (_, argv) in _runs_of_world(world, tmp).items():
        received, _ = _train(argv)
        results[name] = received
    if rank == world_size - 1:  # the rank that logs
        with open(os.path.join(tmp, f"{world}.json"), "w") as f:
            json.dump(results, f)


def _relative(got, want):
    return abs(got - want) / abs(want)


@pytest.fixture(scope="module")
def references():
    """The one-process runs of the dense and the MoE model, in this process."""
    runs = {model: _train(flags)[0] for model, flags in (("dense", DENSE), ("moe", MOE))}
    assert "load_balancing_loss" in runs["moe"][0]["losses"], runs["moe"][0]
    return runs


def _run_world(world, tmp_path):
    tmp = str(tmp_path)
    run_distributed(_layouts, WORLDS[world], tmp, world)
    with open(os.path.join(tmp, f"{world}.json")) as f:
        results = json.load(f)
    runs = _runs_of_world(world, tmp)
    assert set(results) == set(runs), (sorted(results), sorted(runs))
    return runs, results


@pytest.mark.parametrize("world", ["dp2", "dp2-tp2"])
def test_megatron_fsdp_strategies_equal_one_process(world, references, tmp_path):
    runs, results = _run_world(world, tmp_path)
    worst_seen = {}
    for name, received in results.items():
        ref = {r["iteration"]: r for r in references[runs[name][0]]}
        first = SAVED_AT + 1 if "resumed" in name else 1
        assert [r["iteration"] for r in received] == list(range(first, ITERATIONS + 1)), name
        worst = {"loss": 0.0, "grad norm": 0.0}
        for got in received:
            want = ref[got["iteration"]]
            assert set(got["losses"]) == set(want["losses"]), (name, got, want)
            for key, value in got["losses"].items():
                worst["loss"] = max(worst["loss"], _relative(value, want["losses"][key]))
            worst["grad norm"] = max(
                worst["grad norm"], _relative(got["grad norm"], want["grad norm"])
            )
        worst_seen[name] = worst
        for key, limit in RTOL.items():
            assert worst[key] <= limit, (name, key, worst[key], received, references)
    for name, worst in worst_seen.items():
        print(f"{name}: largest relative deviation {worst}")  # shown with pytest -s


def test_megatron_configurations_train_shrunk(tmp_path):
    _, results = _run_world("megatron-configs", tmp_path)
    for name, received in results.items():  # 3 iterations each (SHRUNK), none skipped
        assert [r["iteration"] for r in received] == [1, 2, 3], (name, received)
        assert all(r["skipped"] == 0 for r in received), (name, received)


MEGATRON_FSDP_TUNING = ["--suggested-communication-unit-size", "1000", "--fsdp-double-buffer"]
MEGATRON_FSDP_TUNING += ["--use-nccl-ub", "--keep-fp8-transpose-cache"]


def test_overlap_and_bucket_flags_are_honoured_or_named_at_start_up(monkeypatch):
    # The DDP buckets (no_shard, optim, optim_grads) honour the overlap and bucket flags (the
    # 4-rank runs above use them); FSDP2 (optim_grads_params) has no buckets, so the start-up
    # note names them, and Megatron-FSDP's own buffer settings under every strategy.
    from megatron.training.arguments import parse_args, validate_args

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    for strategy in STRATEGIES:
        argv = DENSE + megatron_fsdp(strategy) + _overlap(strategy) + MEGATRON_FSDP_TUNING
        note = validate_args(parse_args(argv=argv)).no_effect_note
        for flag in ("--use-nccl-ub", "--fsdp-double-buffer", "--keep-fp8-transpose-cache"):
            assert f"{flag} (" in note or f"{flag}, " in note, (strategy, flag, note)
        assert "--suggested-communication-unit-size 1000" in note, (strategy, note)
        fsdp2_line = "--overlap-grad-reduce, --overlap-param-gather, --ddp-bucket-size 2000 (FSDP2"
        assert (fsdp2_line in note) == (strategy == "optim_grads_params"), (strategy, note)
