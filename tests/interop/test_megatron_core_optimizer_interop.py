"""Resume across the two code bases with the optimizer state: megatron-core (0.16.1, from PyPI,
its own DDP, optimizer and scheduler, driven on CPU by ``tools/interop/mcore_gpt.py train``) and
this code base's training-side save/load (``checkpointing.save_checkpoint`` /
``load_checkpoint``, torch_dist, in this process), fp32. The driver works around two faults of
megatron-core's distributed optimizer on its torch-AdamW path (see its
``_keep_adamw_step_on_distributed_load``); with them megatron-core's own resume from its
fully_reshardable checkpoint equals its straight run.

* megatron-core trains iterations 1-4 and saves after 2; we load that checkpoint (model,
  optimizer, scheduler, iteration) and train 3 and 4 on the same batches: both losses equal
  megatron-core's own (1e-5 relative). Iteration 4 is the check of the optimizer state: its
  weights come from the step of iteration 3, which uses the loaded Adam moments and step count
  (a load without them gives another loss: checked too). Without the distributed optimizer on
  both sides, and with it: megatron-core's in its ``fully_reshardable`` sharding type at DP=2
  (two processes on gloo, each training on half of the batch), ours at DP=1. And
  ``pretrain_gpt.py --load`` resumes from megatron-core's checkpoint with its optimizer state.
* The other way: we train 1-4 and save after 2; megatron-core loads model + optimizer +
  scheduler + iteration from it as Megatron-LM does and trains 3 and 4: its losses equal ours
  (without the distributed optimizer; with it, ours at DP=1 and megatron-core's at DP=2).
* The same both ways in the ``torch`` format (``model_optim_rng.pt``), whose optimizer state
  is paired with the parameters by position: our registration order is megatron-core's.
* Its default distributed-optimizer layout (``dp_reshardable``): see
  test_megatron_core_dp_reshardable.py.

Run by ``make interop`` (needs $MCORE_PYTHON), not by ``make test``.
"""

import argparse
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from megatron.core import dist_checkpointing as dc
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.training import checkpointing
from tests.functional_tests.runner import run_pretrain
from tests.harness import REPO
from tests.harness.argv import megatron_argv
from tests.unit_tests.checkpoint_utils import checkpoint_args, set_training_globals

DRIVER = REPO / "tools" / "interop" / "mcore_gpt.py"
MCORE_PYTHON = os.environ.get("MCORE_PYTHON")
RTOL = 1e-5

# The model (megatron-core's defaults for the rest) and the training both sides run.
LAYERS, HIDDEN, HEADS, VOCAB, SEQ = 2, 32, 4, 64, 16
LR, WEIGHT_DECAY, BATCH_SEED = 1e-3, 0.1, 7
SAVED_AT, LAST = 2, 4


def _mcore_train(out, *extra, processes=1):
    launcher = [MCORE_PYTHON]
    if processes > 1:  # data parallel, on gloo
        launcher += ["-m", "torch.distributed.run", "--standalone"]
        launcher += ["--nproc-per-node", str(processes)]
    command = launcher + [str(DRIVER), "train", *[str(e) for e in extra], "--out", str(out)]
    command += ["--num-layers", LAYERS, "--hidden-size", HIDDEN, "--num-attention-heads", HEADS]
    command += ["--vocab-size", VOCAB, "--seq-length", SEQ, "--batch-seed", BATCH_SEED]
    command += ["--lr", LR, "--weight-decay", WEIGHT_DECAY, "--iters", LAST]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # their `megatron`
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(
        [str(c) for c in command], capture_output=True, text=True, timeout=240, env=env
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return {int(k): v for k, v in json.loads(Path(out).read_text())["losses"].items()}


def _train_batch(iteration):
    # The driver's train_batch (the same generator calls).
    g = torch.Generator().manual_seed(1000 * BATCH_SEED + iteration)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    return tokens, labels


class _Ours:
    """This code base's model, optimizer and scheduler as the training loop builds them, with the
    globals its checkpoint save/load reads."""

    def __init__(
        self,
        tmp_path,
        distributed,
        load=None,
        save=None,
        fmt="torch_dist",
        ddp_bucket_size=None,
        bf16=False,
        **arg_overrides,
    ):
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.module import Float16Module
        from megatron.core.transformer.transformer_config import TransformerConfig

        dtype = torch.bfloat16 if bf16 else torch.float32
        if bf16:
            arg_overrides.update(bf16=True, params_dtype=dtype)

        args = checkpoint_args(
            tmp_path,
            fmt,
            num_layers=LAYERS,
            hidden_size=HIDDEN,
            num_attention_heads=HEADS,
            use_distributed_optimizer=distributed,
            **arg_overrides,
        )
        args.load, args.save = str(load), str(save)
        set_training_globals(args)
        torch.manual_seed(99)  # not megatron-core's weights: a load must replace every one
        config = TransformerConfig(
            num_layers=LAYERS,
            hidden_size=HIDDEN,
            num_attention_heads=HEADS,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            bf16=bf16,
            params_dtype=dtype,
        )
        self.model = GPTModel(
            config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ
        )
        if bf16:  # as the training loop wraps it: bf16 weights, fp32 outputs
            self.model = Float16Module(config, self.model)
        self.ddp = None
        if distributed:
            self.ddp = DistributedDataParallel(
                config,
                DistributedDataParallelConfig(
                    use_distributed_optimizer=True,
                    grad_reduce_in_fp32=True,
                    overlap_grad_reduce=ddp_bucket_size is not None,
                    bucket_size=ddp_bucket_size,
                ),
                self.model,
            )
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                lr=LR,
                weight_decay=WEIGHT_DECAY,
                clip_grad=1.0,
                use_distributed_optimizer=distributed,
                bf16=bf16,
                params_dtype=dtype,
            ),
            [self.ddp or self.model],
        )
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=LR,
            max_lr=LR,
            min_lr=LR,
            lr_warmup_steps=0,
            lr_decay_steps=1000,
            lr_decay_style="constant",
            start_wd=WEIGHT_DECAY,
            end_wd=WEIGHT_DECAY,
            wd_incr_steps=1000,
            wd_incr_style="constant",
        )

    def step(self, iteration):
        tokens, labels = _train_batch(iteration)
        positions = torch.arange(SEQ).unsqueeze(0).expand_as(tokens)
        self.model.train()
        self.optimizer.zero_grad()
        if self.ddp is not None:
            self.ddp.zero_grad_buffer()
        loss = (self.ddp or self.model)(tokens, positions, None, labels=labels).float().mean()
        loss.backward()
        if self.ddp is not None:
            self.ddp.finish_grad_sync()
        applied, _grad_norm, _zeros = self.optimizer.step()
        assert applied, iteration
        self.scheduler.step(tokens.shape[0])
        return loss.item()

    def load(self):
        iteration, _flops = checkpointing.load_checkpoint(
            self.ddp or self.model, self.optimizer, self.scheduler
        )
        return iteration

    def save(self, iteration):
        checkpointing.save_checkpoint(
            iteration, self.ddp or self.model, self.optimizer, self.scheduler, 0.0
        )


def _close(ours, theirs, what):
    for it in range(SAVED_AT + 1, LAST + 1):
        assert abs(ours[it] - theirs[it]) <= RTOL * abs(theirs[it]), (what, it, ours, theirs)


@pytest.mark.parametrize(
    "sharding, processes, distributed, fmt",
    [
        ("none", 1, False, "torch_dist"),
        ("fully_reshardable", 2, True, "torch_dist"),
        ("none", 1, False, "torch"),
    ],
    ids=[
        "fp32-optimizer",
        "distributed-optimizer-fully-reshardable-dp2-to-dp1",
        "torch-format-fp32-optimizer",
    ],
)
def test_megatron_core_training_resumes_here_with_its_optimizer_state(
    tmp_path, sharding, processes, distributed, fmt
):
    saved = tmp_path / "mcore"
    theirs = _mcore_train(
        tmp_path / "mc.json",
        saved,
        "--save-at",
        SAVED_AT,
        "--optimizer-sharding",
        sharding,
        "--ckpt-format",
        fmt,
        processes=processes,
    )
    if fmt == "torch_dist":
        keys = set(dc.tensor_shapes(dc.read_dcp_metadata(str(saved / f"iter_{SAVED_AT:07d}"))))
        assert "optimizer.state.exp_avg.decoder.layers.self_attention.linear_qkv.weight" in keys
        assert ("optimizer.state.param.output_layer.weight" in keys) == distributed

    ours = _Ours(tmp_path, distributed, load=saved, save=tmp_path / "unused", fmt=fmt)
    assert ours.load() == SAVED_AT
    resumed = {it: ours.step(it) for it in range(SAVED_AT + 1, LAST + 1)}
    _close(resumed, theirs, f"megatron-core {sharding} -> here")

    # The check can fail for the right reason: the same load without the optimizer state
    # (fresh Adam moments and step count) gives another iteration-4 loss.
    fresh = _Ours(
        tmp_path, distributed, load=saved, save=tmp_path / "unused", fmt=fmt, no_load_optim=True
    )
    assert fresh.load() == SAVED_AT
    without = {it: fresh.step(it) for it in range(SAVED_AT + 1, LAST + 1)}
    assert abs(without[LAST] - theirs[LAST]) > 100 * RTOL * abs(theirs[LAST]), (without, theirs)

    if sharding == "none" and fmt == "torch_dist":
        # Through pretrain_gpt.py: its loader takes model, optimizer, scheduler and iteration
        # from megatron-core's checkpoint (no --no-load-optim) and trains on from iteration 3.
        flags = megatron_argv(
            "--use-checkpoint-opt_param-scheduler",
            num_layers=LAYERS,
            hidden_size=HIDDEN,
            num_attention_heads=HEADS,
            seq_length=SEQ,
            max_position_embeddings=SEQ,
            vocab_size=VOCAB - 1,
            make_vocab_size_divisible_by=1,
            untie_embeddings_and_output_weights=True,
            micro_batch_size=2,
            train_iters=SAVED_AT + 1,
            lr=LR,
            lr_decay_style="constant",
            weight_decay=WEIGHT_DECAY,
            log_interval=1,
            load=saved,
        )
        resumed = run_pretrain(flags)
        assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
        assert f"successfully loaded checkpoint from {saved}" in resumed.stdout
        assert "iteration        3/       3" in resumed.stdout
        assert "iteration        2/       3" not in resumed.stdout


@pytest.mark.parametrize(
    "distributed, sharding, processes, fmt",
    [
        (False, "none", 1, "torch_dist"),
        (True, "fully_reshardable", 2, "torch_dist"),
        (False, "none", 1, "torch"),
    ],
    ids=["fp32-optimizer", "distributed-optimizer-dp1-to-dp2", "torch-format-fp32-optimizer"],
)
def test_training_saved_here_resumes_in_megatron_core_with_our_optimizer_state(
    tmp_path, distributed, sharding, processes, fmt
):
    # fully_reshardable asked for (the default with the distributed optimizer is megatron-core's
    # dp_reshardable: test_megatron_core_dp_reshardable.py).
    ours = _Ours(
        tmp_path,
        distributed,
        load=tmp_path / "unused",
        save=tmp_path / "ours",
        fmt=fmt,
        dist_ckpt_optim_fully_reshardable=True,
    )
    for it in range(1, SAVED_AT + 1):
        ours.step(it)
    ours.save(SAVED_AT)
    if fmt == "torch_dist":
        directory = str(tmp_path / "ours" / f"iter_{SAVED_AT:07d}")
        common = dc.load_common(directory, safe_globals=[argparse.Namespace])
        assert common["content_metadata"]["distrib_optim_sharding_type"] == "fully_reshardable"
    straight = {it: ours.step(it) for it in range(SAVED_AT + 1, LAST + 1)}

    theirs = _mcore_train(
        tmp_path / "mc.json",
        tmp_path / "unused_mcore",
        "--load",
        tmp_path / "ours",
        "--optimizer-sharding",
        sharding,
        "--ckpt-format",
        fmt,
        processes=processes,
    )
    assert sorted(theirs) == list(range(SAVED_AT + 1, LAST + 1))  # resumed after iteration 2
    _close(theirs, straight, f"here -> megatron-core {sharding}")
