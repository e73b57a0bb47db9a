"""Megatron-LM's hybrid test configuration hybrid_mr_mcore_te_tp2_pp1_cp1 (its flags as written,
no --num-layers: the depth comes from --hybrid-layer-pattern; --spec names megatron-core's
mamba_stack_spec), shrunk to a tiny model on mock data and CPU processes, trains at TP=2 with the
distributed optimizer, bf16 and an async torch_dist save."""

from tests.functional_tests.runner import parse_log_lines, run_pretrain

SHRUNK = {"--hidden-size": "64", "--num-attention-heads": "4", "--num-query-groups": "2"}
SHRUNK.update({"--micro-batch-size": "2", "--global-batch-size": "4", "--seq-length": "32"})
SHRUNK.update({"--max-position-embeddings": "32", "--train-iters": "3"})

# The configuration's MODEL_ARGS; data, paths and the NCCL backend replaced below.
MEGATRON_FLAGS = """
--hidden-size 1024 --num-attention-heads 16 --group-query-attention --num-query-groups 8
--hybrid-layer-pattern M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M-
--spec megatron.core.models.mamba.mamba_layer_specs mamba_stack_spec
--log-params-norm --log-num-zeros-in-grad --log-validation-ppl-to-tensorboard
--log-timers-to-tensorboard --micro-batch-size 4 --global-batch-size 32 --seq-length 1024
--max-position-embeddings 1024 --train-iters 50 --timing-log-level 0 --lr-decay-iters 320000
--split 949,50,1 --lr 0.00015 --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 1e-2
--clip-grad 1.0 --lr-warmup-fraction .01 --log-interval 1 --save-interval 10000
--eval-interval 1000 --eval-iters 10 --transformer-impl transformer_engine
--tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --use-distributed-optimizer
--overlap-grad-reduce --overlap-param-gather --check-weight-hash-across-dp-replicas-interval 10
--ckpt-fully-parallel-load --no-gradient-accumulation-fusion --attention-softmax-in-fp32
--use-mcore-models --ckpt-format torch_dist --bf16 --attention-backend unfused
--log-memory-to-tensorboard --async-save --use-persistent-ckpt-worker
""".split()


def _shrunk(flags):
    out = list(flags)
    for i, flag in enumerate(out[:-1]):
        if flag in SHRUNK:
            out[i + 1] = SHRUNK[flag]
    i = out.index("--hybrid-layer-pattern")
    out[i + 1] = "M-M*-M-"
    return out + ["--mamba-state-dim", "16", "--mamba-head-dim", "16", "--mamba-num-groups", "2"]


def test_megatron_hybrid_tp2_configuration_runs_shrunk(tmp_path):
    args = _shrunk(MEGATRON_FLAGS) + ["--mock-data", "--tokenizer-type", "NullTokenizer"]
    args += ["--vocab-size", "500", "--num-workers", "0", "--eval-iters", "0"]
    args += ["--save", str(tmp_path / "ckpt"), "--save-interval", "3"]
    args += ["--tensorboard-dir", str(tmp_path / "tb")]
    result = run_pretrain(args, nproc=2, script="pretrain_mamba.py")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    lines = parse_log_lines(result.stdout)
    assert sorted(lines) == [1, 2, 3]
    assert lines[3]["params_norm"] is not None and lines[3]["num_zeros"] is not None
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
