"""pretrain_gpt.py with gated delta net layers: Megatron-LM's Qwen3-Next-like test model (the
``gdn_hybrid`` family of its checkpoint-converter tests: gated delta net layers every
--linear-attention-freq, gated softmax attention with grouped queries and partial RoPE,
zero-centred norms, an MoE with a gated shared expert in every layer), shrunk, trains the same at
every parallel layout as the one-process run (loss 1e-6, grad norm 1e-5, relative; no dropout,
whose masks differ between layouts), and its torch_dist checkpoint reshards across TP.

The one-process run is in this process. One spawned world of 4 processes runs, in-process:

* TP=2 with sequence parallelism x PP=2, iterations 1-10, saving a torch_dist checkpoint at
  iteration 5 (keyed layer by layer with the input norms fused, as Megatron's Transformer Engine
  spec names them: ``self_attention.in_proj.layer_norm_weight`` in a gated delta net layer);
* DP=2 x PP=2 (TP=1) with the distributed optimizer, resuming from that checkpoint for
  iterations 6-10: the gated delta net's in_proj [q, k, v, z, beta, alpha] and conv1d [q, k, v],
  written as TP shards part by part, are read back whole, and the optimizer state (saved
  without the distributed optimizer) is read back sharded over DP."""

import json

from tests.functional_tests.runner import TINY_MODEL, assert_same_training
from tests.functional_tests.test_log_line_parity import _train
from tests.unit_tests.dist_utils import run_distributed

# The family's flags in its order; sizes shrunk (the original value in a comment). Left out:
# --apply-wd-to-qk-layernorm (refused here; the family has no --qk-layernorm, so it changes
# nothing there).
GDN_HYBRID = TINY_MODEL + [
    "--num-layers", "4",  # 6
    "--group-query-attention",
    "--num-query-groups", "2",
    "--swiglu",
    "--disable-bias-linear",
    "--position-embedding-type", "rope",
    "--rotary-percent", "0.5",
    "--no-rope-fusion",
    "--normalization", "RMSNorm",
    "--apply-layernorm-1p",
    "--attention-output-gate",
    "--experimental-attention-variant", "gated_delta_net",
    "--linear-attention-freq", "2",  # 3
    "--linear-conv-kernel-dim", "4",
    "--linear-key-head-dim", "16",  # 64
    "--linear-value-head-dim", "16",  # 64
    "--linear-num-key-heads", "2",  # 4
    "--linear-num-value-heads", "4",  # 8
    "--untie-embeddings-and-output-weights",
    "--num-experts", "4",  # 32
    "--moe-ffn-hidden-size", "32",  # 64
    "--moe-shared-expert-intermediate-size", "32",  # 64
    "--moe-shared-expert-gate",
    "--moe-router-load-balancing-type", "aux_loss",
    "--moe-router-topk", "2",  # 8
    "--moe-router-dtype", "fp32",
    "--attention-softmax-in-fp32",
    "--attention-backend", "unfused",
    "--hidden-dropout", "0.0",
    "--attention-dropout", "0.0",
    "--global-batch-size", "4",  # the tests' 8: two micro-batches keep both stages busy
    "--train-iters", "10",
]  # fmt: skip


TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
PP2 = ["--pipeline-model-parallel-size", "2"]
DIST_OPT = ["--use-distributed-optimizer", "--ckpt-format", "torch_dist"]
# The spawned world's runs, in order, and the iterations each compares; "{ckpt}" is replaced by
# a directory of the test's.
WORLD_LAYOUTS = {
    "tp2-sp-pp2-save": (
        TP2_SP + PP2 + ["--ckpt-format", "torch_dist", "--save", "{ckpt}", "--save-interval", "5"],
        range(1, 11),
    ),
    "dp2-pp2-dist-opt-resume": (
        PP2 + DIST_OPT + ["--load", "{ckpt}", "--ckpt-step", "5"],
        range(6, 11),
    ),
}


def _metrics(argv):
    """{'loss': {iteration: lm loss}, 'norm': {iteration: grad norm}} of an in-process run, as
    training_log receives them on this rank."""
    received = [r for r in _train(argv)[0] if "lm loss" in r["losses"]]  # the last stage's
    return {
        "loss": {r["iteration"]: r["losses"]["lm loss"] for r in received},
        "norm": {r["iteration"]: r["grad norm"] for r in received},
    }


def _world(rank, world_size, tmp):
    results = {}
    for name, (flags, _) in WORLD_LAYOUTS.items():
        results[name] = _metrics([f.replace("{ckpt}", f"{tmp}/ckpt") for f in GDN_HYBRID + flags])
    if rank == world_size - 1:  # a rank of the last stage: it has the loss
        with open(f"{tmp}/layouts.json", "w") as f:
            json.dump(results, f)


def test_layouts_and_torch_dist_resume_across_tp_equal_one_process(tmp_path):
    reference = _metrics(GDN_HYBRID)
    assert reference["loss"][10] < reference["loss"][1]
    run_distributed(_world, 4, str(tmp_path))
    results = json.loads((tmp_path / "layouts.json").read_text())
    assert set(results) == set(WORLD_LAYOUTS)
    for name, (_, iterations) in WORLD_LAYOUTS.items():
        got = {k: {int(i): v for i, v in values.items()} for k, values in results[name].items()}
        for key in ("loss", "norm"):  # the measured differences, shown with -s
            worst = max(abs(got[key][i] / reference[key][i] - 1) for i in iterations)
            print(f"gated delta net {name} vs one process: {key} relative {worst:.2e}")
        assert_same_training(got, reference, iterations)
    metadata = (tmp_path / "ckpt" / "iter_0000005" / ".metadata").read_bytes()
    # Layer by layer (numbered over both stages), the input norms fused.
    for key in (
        b"decoder.layers.0.self_attention.in_proj.layer_norm_weight",
        b"decoder.layers.1.self_attention.linear_qkv.layer_norm_weight",
        b"decoder.layers.0.self_attention.in_proj.weight",
        b"decoder.layers.0.self_attention.conv1d.weight",
        b"decoder.layers.2.self_attention.A_log",
        b"decoder.layers.1.self_attention.linear_qkv.weight",
        b"decoder.layers.3.self_attention.linear_proj.weight",
    ):
        assert key in metadata, key
