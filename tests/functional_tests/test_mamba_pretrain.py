"""pretrain_mamba.py: a hybrid model (M*-M: Mamba, attention, MLP, Mamba) trained under
parallel layouts equals the one-process run over 10 iterations (loss 1e-6, grad norm 1e-5,
relative; no dropout, whose masks differ between layouts), and a torch_dist checkpoint
reshards across layouts.

Four runs: the one-process reference; TP=2 with sequence parallelism x PP=2 (4 processes,
both layouts in one run) saving a torch-format checkpoint whose files are checked; DP=2 with
the distributed optimizer saving a torch_dist checkpoint in Megatron's hybrid layout and
exiting at iteration 5; TP=2 resuming from it for iterations 6-10 (the checkpoint written at
TP=1 is read back as TP shards of Mamba's in_proj [z, x, B, C, dt] and conv1d [x, B, C]
parts)."""

import pytest
import torch

from tests.functional_tests.runner import (
    TINY_MODEL,
    assert_same_training,
    read_tensorboard_scalars,
    run_pretrain,
)

HYBRID = TINY_MODEL + [
    "--num-layers",
    "4",
    "--hybrid-override-pattern",
    "M*-M",
    "--mamba-state-dim",
    "16",
    "--mamba-head-dim",
    "16",
    "--mamba-num-groups",
    "2",
    "--normalization",
    "RMSNorm",
    "--hidden-dropout",
    "0.0",
    "--attention-dropout",
    "0.0",
    "--train-iters",
    "10",
]


def _train(args, nproc, tb):
    result = run_pretrain(
        list(args) + ["--tensorboard-dir", str(tb)], nproc=nproc, script="pretrain_mamba.py"
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return {
        "loss": read_tensorboard_scalars(tb, "lm loss"),
        "norm": read_tensorboard_scalars(tb, "grad-norm"),
    }


def _part(metrics, iterations):
    return {k: {i: v[i] for i in iterations if i in v} for k, v in metrics.items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The one-process run, shared by both tests."""
    ref = _train(HYBRID, None, tmp_path_factory.mktemp("mamba_ref"))
    assert ref["loss"][10] < ref["loss"][1]
    return ref


def test_tp2_sp_pp2_equals_one_process(reference, tmp_path):
    tp_pp = HYBRID + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    tp_pp += ["--pipeline-model-parallel-size", "2"]
    ckpt = tmp_path / "ckpt"
    tp_pp += ["--ckpt-format", "torch", "--save", str(ckpt), "--save-interval", "10"]
    assert_same_training(_train(tp_pp, 4, tmp_path / "tp_pp"), reference, range(1, 11))
    # The torch format: one file per TP x PP rank, Megatron's names, layers numbered per stage.
    for tp_rank, pp_rank, keys in (
        (
            0,
            0,
            ("decoder.layers.0.mixer.in_proj.weight", "decoder.layers.1.input_layernorm.weight"),
        ),
        (1, 1, ("decoder.layers.1.mixer.conv1d.weight", "decoder.final_norm.weight")),
    ):
        path = ckpt / "iter_0000010" / f"mp_rank_{tp_rank:02d}_{pp_rank:03d}" / "model_optim_rng.pt"
        model = torch.load(path, map_location="cpu", weights_only=False)["model"]
        for key in keys:
            assert key in model, (path, key)
        in_proj = next(v for k, v in model.items() if k.endswith("mixer.in_proj.weight"))
        # This rank's [z, x, B, C, dt]: (2 x 128 inner + 2 x 2 groups x 16 state + 8 heads) / TP.
        assert tuple(in_proj.shape) == ((2 * 128 + 2 * 2 * 16 + 8) // 2, 64)


def test_dp2_then_torch_dist_resume_at_tp2_equals_one_process(reference, tmp_path):
    ckpt = tmp_path / "ckpt"
    dp = HYBRID + ["--ckpt-format", "torch_dist", "--save", str(ckpt), "--save-interval", "5"]
    dp += ["--exit-interval", "5", "--use-distributed-optimizer"]
    first = _train(dp, 2, tmp_path / "dp")
    assert_same_training(first, _part(reference, range(1, 6)), range(1, 6))
    # Megatron's layout of a hybrid stack: layer by layer, the Mamba norm fused into in_proj.
    metadata = (ckpt / "iter_0000005" / ".metadata").read_bytes()
    for key in (
        b"decoder.layers.0.mixer.in_proj.layer_norm_weight",
        b"decoder.layers.3.mixer.A_log",
        b"decoder.layers.1.self_attention.linear_qkv.layer_norm_weight",
        b"decoder.layers.2.mlp.linear_fc1.layer_norm_weight",
        b"decoder.final_norm.weight",
    ):
        assert key in metadata, key

    resume = HYBRID + ["--tensor-model-parallel-size", "2", "--ckpt-format", "torch_dist"]
    resume += ["--load", str(ckpt)]
    second = _train(resume, 2, tmp_path / "resume")
    assert_same_training(second, _part(reference, range(6, 11)), range(6, 11))
    assert torch.isfinite(torch.tensor(list(second["loss"].values()))).all()
