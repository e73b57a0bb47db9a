"""--use-megatron-fsdp with expert parallelism through torchrun on CPU/gloo equals the one-process
run over 10 iterations (loss 1e-6, grad norm 1e-5 relative; MoE model with tied embeddings).

One grouped test, one one-process reference:

* optim_grads_params (FSDP2 here) at DP2 x TP2 (SP) with EP2 and ETP1: the experts are sharded
  over their expert data-parallel group of 2, the dense weights over DP2;
* optim_grads_params at DP2 with EP2: expert DP is 1 while DP is 2, so the expert gradients must
  be rescaled from FSDP's expert-DP average to Megatron's sum over DP (a missing rescale doubles
  their share of the grad norm);
* its --ckpt-format fsdp_dtensor checkpoint (saved there at iteration 5) resumes at another
  strategy and EP size (optim, EP1, the distributed optimizer on DDP buffers instead of FSDP2
  shards) with the one-process run's next losses.

The other strategies run machinery whose EP layouts are proven elsewhere: optim and optim_grads
are the distributed optimizer (test_moe_e2e.py: ep2-dist-opt, expert state sharded over expert
DP), no_shard is plain DDP (test_moe_e2e.py: ep2); tests/unit_tests/core/distributed/test_fsdp.py
checks that mapping with EP and the gradient-accumulation-fusion warning. (A run per strategy
here would cost ~25 s each of the suite's budget and repeat those.)
"""

from tests.functional_tests.runner import (
    LOSS_RTOL,
    TINY_MODEL,
    assert_same_training,
    read_tensorboard_scalars,
    run_pretrain,
    train_metrics,
)
from tests.functional_tests.test_moe_e2e import MOE

MODEL = list(TINY_MODEL)
del MODEL[MODEL.index("--ckpt-format") : MODEL.index("--ckpt-format") + 2]
TP2_EP2 = [
    "--tensor-model-parallel-size",
    "2",
    "--sequence-parallel",
    "--expert-model-parallel-size",
    "2",
    "--expert-tensor-parallel-size",
    "1",
]


def _megatron_fsdp(strategy):
    # Gradient accumulation fusion stays on (the default): Megatron-FSDP turns it off itself.
    return [
        "--use-megatron-fsdp",
        "--ckpt-format",
        "fsdp_dtensor",
        "--data-parallel-sharding-strategy",
        strategy,
    ]


def test_megatron_fsdp_strategies_with_expert_parallelism_match_one_process(tmp_path):
    reference = train_metrics(MODEL + MOE, None, tmp_path / "one")
    for name, nproc, extra in (
        ("ogp-dp2-tp2-ep2", 4, _megatron_fsdp("optim_grads_params") + TP2_EP2),
        (
            "ogp-dp2-ep2",
            2,
            _megatron_fsdp("optim_grads_params")
            + ["--expert-model-parallel-size", "2"]
            + ["--save", str(tmp_path / "ckpt"), "--save-interval", "5"],
        ),
    ):
        got = train_metrics(MODEL + MOE + extra, nproc, tmp_path / name)
        assert_same_training(got, reference, range(1, 11))

    tb = tmp_path / "resumed"
    load = ["--load", str(tmp_path / "ckpt"), "--ckpt-step", "5", "--tensorboard-dir", str(tb)]
    result = run_pretrain(MODEL + MOE + _megatron_fsdp("optim") + load, nproc=2)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "successfully loaded checkpoint from" in result.stdout, result.stdout[-2000:]
    resumed = read_tensorboard_scalars(tb, "lm loss")
    assert sorted(resumed) == list(range(6, 11)), resumed
    for it, loss in resumed.items():
        want = reference["loss"][it]
        assert abs(loss - want) <= LOSS_RTOL * want, (it, resumed, reference["loss"])
