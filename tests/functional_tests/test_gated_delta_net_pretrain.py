"""pretrain_gpt.py with gated delta net layers: Megatron-LM's Qwen3-Next-like test model (the
``gdn_hybrid`` family of its checkpoint-converter tests: gated delta net layers every
--linear-attention-freq, gated softmax attention with grouped queries and partial RoPE,
zero-centred norms, an MoE with a gated shared expert in every layer), shrunk, trained under
TP=2 with sequence parallelism x PP=2 (4 processes) equals the one-process run over 10
iterations (loss 1e-6, grad norm 1e-5, relative; no dropout, whose masks differ between
layouts), and its torch_dist checkpoint is keyed layer by layer with the input norms fused
(``self_attention.in_proj.layer_norm_weight`` in a gated delta net layer)."""

from tests.functional_tests.runner import TINY_MODEL, assert_same_training, train_metrics

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


def test_tp2_sp_pp2_equals_one_process(tmp_path):
    reference = train_metrics(GDN_HYBRID, None, tmp_path / "one")
    assert reference["loss"][10] < reference["loss"][1]
    layout = GDN_HYBRID + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    layout += ["--pipeline-model-parallel-size", "2"]
    ckpt = tmp_path / "ckpt"
    layout += ["--ckpt-format", "torch_dist", "--save", str(ckpt), "--save-interval", "10"]
    got = train_metrics(layout, 4, tmp_path / "tp_pp")
    for name in ("loss", "norm"):  # the measured differences, shown with -s
        worst = max(abs(got[name][i] / reference[name][i] - 1) for i in range(1, 11))
        print(f"gated delta net TP2+SP x PP2 vs one process: {name} relative {worst:.2e}")
    assert_same_training(got, reference, range(1, 11))
    metadata = (ckpt / "iter_0000010" / ".metadata").read_bytes()
    # Layer by layer, the input norms fused as Megatron's Transformer Engine spec names them.
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
