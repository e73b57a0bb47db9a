"""--ckpt-format fsdp_dtensor in Megatron-LM's own layout (issue #35, item 2): a bare DCP
directory whose keys are Megatron-LM's (``model.module.<param>``,
``optimizer.state.module.module.module.<param>.exp_avg``, ``args``, ``iteration``,
``rng_state.(<pp>, <tp>).<i>.<field>``), read back at another strategy, DP size and EP size
with the straight run's next losses, and converted to and from torch_dist.

One spawned gloo world of 2 ranks saves (and resumes at DP2 with another strategy); the
one-process resumes run in the test process.
"""

import json
import os

import pytest
from torch.distributed.checkpoint import FileSystemReader

from tests.functional_tests.runner import TINY_MODEL
from tests.functional_tests.test_log_line_parity import _train
from tests.unit_tests.dist_utils import run_distributed
from tools.checkpoint import checkpoint_inspector

SAVED_AT = 3
ITERATIONS = 6
# Dropout off: a run at another DP size draws its dropout masks in another order.
GPT = TINY_MODEL + ["--hidden-dropout", "0.0", "--attention-dropout", "0.0"]
GPT += ["--train-iters", str(ITERATIONS)]
del GPT[GPT.index("--ckpt-format") : GPT.index("--ckpt-format") + 2]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48"]
MOE += ["--moe-aux-loss-coeff", "0.01"]
# Another layout sums in another order: float round-off only (test_mtp_checkpoint's bound).
RTOL = 1e-5


def _fsdp(strategy):
    return [
        "--use-megatron-fsdp",
        "--ckpt-format",
        "fsdp_dtensor",
        "--data-parallel-sharding-strategy",
        strategy,
    ]


def _save(ckpt):
    return ["--save", str(ckpt), "--save-interval", str(SAVED_AT)]


def _load(ckpt):
    return ["--load", str(ckpt), "--ckpt-step", str(SAVED_AT)]


def _losses(received, first=1):
    return {r["iteration"]: r["losses"]["lm loss"] for r in received if r["iteration"] >= first}


def _assert_same(got, want, rtol=RTOL):
    want = {it: loss for it, loss in want.items() if it > SAVED_AT}
    assert sorted(got) == sorted(want), (got, want)
    for it, loss in want.items():
        assert abs(got[it] - loss) <= rtol * abs(loss), (it, got, want)


def _in_world(rank, world_size, tmp):
    """Saves at DP2 (Megatron-FSDP optim_grads_params: FSDP2 shards; MoE at EP2) and a resume
    at DP2 with the distributed optimizer (optim)."""
    out = {}
    received, _ = _train(GPT + _fsdp("optim_grads_params") + _save(f"{tmp}/gpt"))
    out["gpt"] = _losses(received)
    received, _ = _train(GPT + _fsdp("optim") + _load(f"{tmp}/gpt"))
    out["gpt-optim-dp2"] = _losses(received)
    moe = GPT + MOE + ["--expert-model-parallel-size", "2"]
    received, _ = _train(moe + _fsdp("optim_grads_params") + _save(f"{tmp}/moe"))
    out["moe"] = _losses(received)
    if rank == 0:
        with open(f"{tmp}/world.json", "w") as f:
            json.dump(out, f)


def test_fsdp_dtensor_layout_resumes_at_other_strategies_and_sizes(tmp_path):
    run_distributed(_in_world, 2, str(tmp_path))
    with open(tmp_path / "world.json") as f:
        world = {k: {int(i): v for i, v in d.items()} for k, d in json.load(f).items()}

    # Megatron-LM's keys (megatron/training/checkpointing.py generate_state_dict and
    # get_rng_state; tools/checkpoint/checkpoint_inspector.py convert_checkpoint's prefixes
    # "model.module" and "optimizer.state.module.module.module").
    keys = set(
        FileSystemReader(str(tmp_path / "gpt" / "iter_0000003")).read_metadata().state_dict_metadata
    )
    for key in (
        "args",
        "iteration",
        "checkpoint_version",
        "model.module.embedding.word_embeddings.weight",
        "model.module.decoder.layers.1.self_attention.linear_qkv.weight",
        "optimizer.state.module.module.module.decoder.layers.1.mlp.linear_fc2.weight.exp_avg",
        "optimizer.state.module.module.module.decoder.final_layernorm.weight.exp_avg_sq",
        "rng_state.(0, 0).0.torch_rng_state",
    ):
        assert key in keys, (key, sorted(keys))
    assert not os.path.exists(tmp_path / "gpt" / "iter_0000003" / "metadata.json")
    moe_keys = FileSystemReader(str(tmp_path / "moe" / "iter_0000003")).read_metadata()
    # Experts by their global index (Megatron-LM's handle_experts_in_state_dict): EP rank 1's.
    assert "model.module.decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight" in (
        moe_keys.state_dict_metadata
    )

    _assert_same(world["gpt-optim-dp2"], world["gpt"])
    # One process (FSDP2, hence optim_grads_params, needs a launched world): DDP (no_shard).
    received, _ = _train(GPT + _fsdp("no_shard") + _load(tmp_path / "gpt"))
    _assert_same(_losses(received), world["gpt"])
    received, _ = _train(GPT + MOE + _fsdp("optim") + _load(tmp_path / "moe"))
    _assert_same(_losses(received), world["moe"])


def test_conversion_to_and_from_torch_dist_resumes(tmp_path, capfd):
    """torch_dist -> fsdp_dtensor with Megatron-LM's tool name (offline), fsdp_dtensor ->
    torch_dist with --ckpt-convert-format (a run); each resumes with the straight run's losses.
    Either format given to the other's --ckpt-format is refused in one line."""
    # bf16: the fp32 main weights (torch_dist's optimizer.state.fp32_param.*) become the
    # fsdp_dtensor model weights, as Megatron-FSDP's, and are read back into the main weights.
    gpt = GPT + ["--bf16"]
    received, _ = _train(gpt + ["--ckpt-format", "torch_dist"] + _save(tmp_path / "td"))
    straight = _losses(received)
    with pytest.raises(SystemExit, match="1"):
        _train(gpt + _fsdp("optim") + _load(tmp_path / "td"))
    assert (
        "is a torch_dist-format checkpoint but --ckpt-format is fsdp_dtensor: pass "
        "--ckpt-format torch_dist or --auto-detect-ckpt-format, or convert it"
    ) in capfd.readouterr().err

    converted = tmp_path / "fsdp" / "iter_0000003"
    assert (
        checkpoint_inspector.main(
            [
                "convert-torch-dist-to-fsdp-dtensor",
                str(tmp_path / "td" / "iter_0000003"),
                str(converted),
            ]
        )
        == 0
    )
    received, _ = _train(gpt + _fsdp("optim") + _load(tmp_path / "fsdp"))
    _assert_same(_losses(received), straight)

    back = ["--ckpt-convert-format", "torch_dist", "--ckpt-convert-save", str(tmp_path / "back")]
    with pytest.raises(SystemExit, match="0"):
        _train(gpt + _fsdp("optim") + _load(tmp_path / "fsdp") + back)
    # Converted by a run with the distributed optimizer (optim): read back by one.
    torch_dist = ["--ckpt-format", "torch_dist", "--use-distributed-optimizer"]
    received, _ = _train(gpt + torch_dist + _load(tmp_path / "back" / "torch_dist"))
    _assert_same(_losses(received), straight)
