"""Megatron command lines with the numerics flags train through pretrain_gpt.py.

* A bf16 command line with --attention-softmax-in-fp32, --apply-query-key-layer-scaling,
  --attention-backend unfused, --fp32-residual-connection, --recompute-modules core_attn
  layernorm mlp, --init-method-xavier-uniform, --embedding-init-method-std, --openai-gelu,
  --use-mup --mup-base-hidden-size and --optimizer muon trains 4 iterations with finite,
  falling losses.
* --fp32-residual-connection (bf16, no dropout) end to end: with PP=2 (untied embeddings) the
  stages exchange the fp32 residual stream, so every iteration's loss and grad norm equal the
  one-process run's bit for bit (with bf16 activations between the stages they do not); TP=2
  with sequence parallelism stays within 1e-4 (loss) and 5e-3 (grad norm).
* --optimizer dist_muon (Muon with the layer-wise distributed optimizer) at TP=2 x DP=2, fp32:
  the losses and grad norms of the one-process --optimizer muon run; the deprecation line.
"""

import math

from tests.functional_tests.runner import (
    TINY_MODEL,
    assert_same_training,
    parse_log_lines,
    read_tensorboard_scalars,
    run_pretrain,
    train_in_one_world,
    train_metrics,
)

ITERS = ["--train-iters", "4"]
NO_DROPOUT = ["--hidden-dropout", "0.0", "--attention-dropout", "0.0"]


def test_numerics_command_line_trains():
    args = TINY_MODEL + ITERS + [
        "--bf16", "--attention-softmax-in-fp32", "--apply-query-key-layer-scaling",
        "--attention-backend", "unfused", "--fp32-residual-connection",
        "--recompute-activations", "--recompute-modules", "core_attn", "layernorm", "mlp",
        "--init-method-xavier-uniform", "--embedding-init-method-std", "0.01", "--openai-gelu",
        "--use-mup", "--mup-base-hidden-size", "32",
        "--optimizer", "muon", "--muon-fp32-matmul-prec", "high",
    ]  # fmt: skip
    result = run_pretrain(args)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "not supported" not in result.stdout + result.stderr
    lines = parse_log_lines(result.stdout)
    losses = [lines[it]["losses"]["lm loss"] for it in sorted(lines)]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses), lines
    assert losses[-1] < losses[0]


FP32_RESIDUAL = TINY_MODEL + ITERS + NO_DROPOUT + ["--bf16", "--fp32-residual-connection"]


def _metrics(tb):
    return {
        "loss": read_tensorboard_scalars(tb, "lm loss"),
        "norm": read_tensorboard_scalars(tb, "grad-norm"),
    }


def test_fp32_residual_connection_through_the_pipeline_and_with_sequence_parallelism(tmp_path):
    # PP=2 with untied embeddings: tied, the pipeline sums the word embedding's two gradients in
    # another order than autograd does in one process, and bf16 training carries that fp32
    # rounding into the losses (6.7e-6 to 1.03e-5 apart by iteration 4, depending on the
    # kernels the CPU dispatches); untied, nothing is summed in another order. TP=2 with
    # sequence parallelism (tied). Both layouts train in one spawned world of 2 ranks (a start
    # costs seconds of CPU per rank), each compared with its own one-process run.
    untied = FP32_RESIDUAL + ["--untie-embeddings-and-output-weights"]
    pp2 = untied + ["--pipeline-model-parallel-size", "2"]
    tp2_sp = FP32_RESIDUAL + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    train_in_one_world(
        [
            (pp2 + ["--tensorboard-dir", str(tmp_path / "pp2")], tmp_path / "pp2"),
            (tp2_sp + ["--tensorboard-dir", str(tmp_path / "tp2_sp")], tmp_path / "tp2_sp"),
        ],
        2,
    )
    reference = train_metrics(untied, None, tmp_path / "one_process_untied")
    # The same operations on the same values in the same order, stage by stage: bit for bit.
    got = _metrics(tmp_path / "pp2")
    assert got == reference, (got, reference)
    reference = train_metrics(FP32_RESIDUAL, None, tmp_path / "one_process")
    got = _metrics(tmp_path / "tp2_sp")
    assert_same_training(got, reference, range(1, 5), loss_rtol=1e-4, norm_rtol=5e-3)


def test_dist_muon_tp2_dp2_matches_one_process(tmp_path):
    args = TINY_MODEL + ITERS + NO_DROPOUT + ["--muon-fp32-matmul-prec", "high"]
    reference = train_metrics(args + ["--optimizer", "muon"], None, tmp_path / "ref")
    extra = ["--optimizer", "dist_muon", "--tensor-model-parallel-size", "2"]
    result = run_pretrain(args + extra + ["--tensorboard-dir", str(tmp_path / "tp2dp2")], nproc=4)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "--optimizer dist_muon is deprecated" in result.stdout
    got = {
        "loss": read_tensorboard_scalars(tmp_path / "tp2dp2", "lm loss"),
        "norm": read_tensorboard_scalars(tmp_path / "tp2dp2", "grad-norm"),
    }
    assert_same_training(got, reference, range(1, 5), loss_rtol=1e-4, norm_rtol=1e-3)
