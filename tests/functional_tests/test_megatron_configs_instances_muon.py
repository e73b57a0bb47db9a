"""Megatron-LM's own pretraining test configurations that use --num-distributed-optimizer-instances
and Muon's distributed optimizer (--optimizer dist_muon) run here, shrunk to CPU sizes.

The flag sets are the MODEL_ARGS of Megatron-LM's tests/functional_tests/test_cases/moe/
gpt3_mcore_te_tp2_pp1_resume_torch_dist_te_8experts2parallel_multi_dist_optimizer_instances and
gpt3_moe_mcore_te_ep8_resume_torch_dist_dist_muon (both TEST_TYPE ckpt-resume), written out.
Shrinking changes only sizes (layers, widths, batch, experts, world size) and puts mock data
and a temporary directory in place of the cluster's paths; every other flag stays. Each runs
as its TEST_TYPE asks: train saving half-way, then resume from that checkpoint; the resumed
iterations reproduce the straight run's losses.
"""

import pytest

from tests.functional_tests.runner import read_tensorboard_scalars, run_pretrain
from tests.harness.argv import MOCK_DATA

MULTI_DIST_OPTIMIZER_INSTANCES = """
--num-layers 12 --hidden-size 512 --num-attention-heads 8 --log-params-norm
--log-num-zeros-in-grad --log-validation-ppl-to-tensorboard --log-timers-to-tensorboard
--tensorboard-dir TB --micro-batch-size 4 --global-batch-size 32 --seq-length 1024
--max-position-embeddings 1024 --train-iters 100 --timing-log-level 0 --lr-decay-iters 320000
--save CKPT --load CKPT --split 949,50,1 --distributed-backend nccl --lr 0.00015
--lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 1e-2 --clip-grad 1.0
--lr-warmup-fraction .01 --log-interval 1 --save-interval 50 --eval-interval 1000
--eval-iters 10 --transformer-impl transformer_engine --tensor-model-parallel-size 2
--pipeline-model-parallel-size 1 --expert-model-parallel-size 2 --sequence-parallel
--num-experts 8 --use-distributed-optimizer --moe-router-load-balancing-type sinkhorn
--moe-router-topk 1 --ckpt-fully-parallel-load --deterministic-mode
--no-gradient-accumulation-fusion --attention-softmax-in-fp32
--use-checkpoint-opt_param-scheduler --use-mcore-models --ckpt-format torch_dist
--dist-ckpt-strictness log_all --ckpt-assume-constant-structure --bf16 --disable-bias-linear
--no-bias-gelu-fusion --log-memory-to-tensorboard --num-distributed-optimizer-instances 2
--async-save --use-persistent-ckpt-worker
"""

DIST_MUON = """
--num-layers 12 --hidden-size 512 --num-attention-heads 8 --log-params-norm
--log-num-zeros-in-grad --log-validation-ppl-to-tensorboard --log-timers-to-tensorboard
--tensorboard-dir TB --micro-batch-size 4 --global-batch-size 32 --seq-length 1024
--max-position-embeddings 1024 --disable-bias-linear --train-iters 100 --timing-log-level 0
--lr-decay-iters 320000 --save CKPT --load CKPT --split 949,50,1 --distributed-backend nccl
--lr 0.00015 --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 1e-2 --clip-grad 1.0
--lr-warmup-fraction .01 --log-interval 1 --save-interval 50 --eval-interval 1000
--eval-iters 10 --transformer-impl transformer_engine --tensor-model-parallel-size 1
--pipeline-model-parallel-size 1 --expert-model-parallel-size 8 --num-experts 8
--moe-token-dispatcher-type allgather --moe-router-load-balancing-type aux_loss
--moe-router-topk 2 --moe-router-dtype fp32 --moe-ffn-hidden-size 1024 --moe-grouped-gemm
--ckpt-fully-parallel-load --deterministic-mode --no-gradient-accumulation-fusion
--attention-softmax-in-fp32 --use-checkpoint-opt_param-scheduler --use-mcore-models
--ckpt-format torch_dist --ckpt-assume-constant-structure --bf16 --no-bias-gelu-fusion
--log-memory-to-tensorboard --optimizer dist_muon --muon-momentum 0.9
--muon-extra-scale-factor 0.2 --muon-scale-mode spectral
"""

# CPU sizes: 2 layers of width 64, 4 iterations saving at 2; the world and expert sizes per
# configuration below.
SHRUNK = {
    "--num-layers": "2",
    "--hidden-size": "64",
    "--num-attention-heads": "4",
    "--micro-batch-size": "1",
    "--global-batch-size": "8",
    "--seq-length": "32",
    "--max-position-embeddings": "32",
    "--train-iters": "4",
    "--save-interval": "2",
    "--eval-iters": "1",
    "--moe-ffn-hidden-size": "64",
    "--lr": "5e-3",
}


def shrunk(flags: str, tmp_path, **sizes):
    """The configuration's flags with the sizes of SHRUNK (and ``sizes``), mock data and
    ``tmp_path`` for the cluster's paths."""
    words = flags.split()
    out, i = [], 0
    overrides = {**SHRUNK, **{f"--{k.replace('_', '-')}": v for k, v in sizes.items()}}
    while i < len(words):
        flag = words[i]
        takes_value = i + 1 < len(words) and not words[i + 1].startswith("--")
        value = words[i + 1] if takes_value else None
        i += 2 if takes_value else 1
        if flag in overrides and overrides[flag] is not None:
            value = overrides[flag]
        if value == "CKPT":
            value = str(tmp_path / "ckpt")
        elif value == "TB":
            value = str(tmp_path / "tb")
        out += [flag] + ([value] if value is not None else [])
    for dest, value in MOCK_DATA.items():
        flag = "--" + dest.replace("_", "-")
        out += [flag] if value is True else [flag, str(value)]
    return out + ["--vocab-size", "128"]


def _losses(tb):
    return read_tensorboard_scalars(tb, "lm loss")


@pytest.mark.parametrize(
    "flags, world, sizes",
    [
        # Its world of 8 (TP2 x DP4; EP2 x expert-DP2) shrunk to 4 at TP1 (DP4; EP2 x
        # expert-DP2), which its 2 instances still divide; 8 processes cost the suite a minute.
        (
            MULTI_DIST_OPTIMIZER_INSTANCES,
            4,
            {"num_experts": "4", "tensor_model_parallel_size": "1"},
        ),
        # EP8 x DP8 shrunk to EP4 x DP4.
        (DIST_MUON, 4, {"num_experts": "4", "expert_model_parallel_size": "4"}),
    ],
    ids=["multi_dist_optimizer_instances", "dist_muon"],
)
def test_megatron_ckpt_resume_configuration_runs_shrunk(flags, world, sizes, tmp_path):
    argv = shrunk(flags, tmp_path, **sizes)
    straight = run_pretrain(argv, nproc=world)
    output = straight.stdout + straight.stderr
    assert straight.returncode == 0, straight.stdout[-2000:] + straight.stderr[-3000:]
    assert "not supported yet" not in output
    losses = _losses(tmp_path / "tb")
    assert sorted(losses) == list(range(1, 5))
    resumed_tb = tmp_path / "tb_resumed"
    argv = shrunk(flags, tmp_path, **sizes)
    argv[argv.index("--tensorboard-dir") + 1] = str(resumed_tb)
    resumed = run_pretrain(argv + ["--ckpt-step", "2"], nproc=world)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    again = _losses(resumed_tb)
    assert sorted(again) == [3, 4]
    for it in (3, 4):
        assert abs(again[it] - losses[it]) <= 1e-6 * abs(losses[it]), (it, again, losses)
