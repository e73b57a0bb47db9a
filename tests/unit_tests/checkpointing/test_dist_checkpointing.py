"""torch_dist checkpoints in one process: layout, exact resume, crash safety, bad input,
strictness, async save, retention, format detection, --use-checkpoint-args.

Multi-process resharding (TP/DP layouts) is in test_dist_checkpointing_parallel.py and,
end to end, in tests/functional_tests/test_checkpoint_torch_dist.py.
"""

import argparse
import json
import os
import pickle
import re

import pytest
import torch

from megatron.core import dist_checkpointing as dc
from megatron.core.dist_checkpointing import serialization
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.layers import shard_of
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training import checkpointing, checkpointing_dist, global_vars
from tests.unit_tests.checkpoint_utils import (
    check_saved_run_state,
    checkpoint_args,
    make_scheduler,
    setup_training_state,
)


def _args(tmp_path, **kw):
    return checkpoint_args(tmp_path, **{"ckpt_format": "torch_dist", **kw})


def _model(seed, width=8, extra=None, dtype=torch.float32):
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(8, width), torch.nn.LayerNorm(width), torch.nn.Linear(width, 2)]
    if extra is not None:
        layers = layers[:extra] if extra < len(layers) else layers + [torch.nn.Linear(2, 2)]
    return torch.nn.Sequential(*layers).to(dtype)


def _setup(tmp_path, seed=0, dtype=torch.float32, model=None, **kw):
    return setup_training_state(
        _args(tmp_path, **kw),
        lambda: model if model is not None else _model(seed, dtype=dtype),
        bf16=dtype == torch.bfloat16,
    )


def _train(model, opt, sched, steps, seed=7):
    g = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        x = torch.randn(4, 8, generator=g).to(dtype)
        loss = (
            torch.nn.functional.dropout(model(x).float(), 0.5).pow(2).mean()
        )  # dropout uses the global RNG
        loss.backward()
        opt.step()
        sched.step(4)
        losses.append(loss.item())
    return losses


def _iter_dir(tmp_path, it):
    return tmp_path / "ckpt" / f"iter_{it:07d}"


# ------------------------------------------------------------------ sharding metadata
def test_strided_tensor_parallel_shard_maps_to_global_blocks():
    full = torch.arange(8 * 3).view(8, 3)
    for rank in range(2):
        local = shard_of(full, 0, rank, 2, stride=2)  # [gate_r; up_r] as the TP layers build it
        entry = dc.tensor_parallel_sharded("w", local, 0, rank, 2, stride=2)
        assert entry.global_shape == (8, 3)
        for chunk in entry.chunks:
            rows = slice(chunk.global_offset[0], chunk.global_offset[0] + chunk.shape[0])
            assert torch.equal(entry.view(chunk), full[rows])
    assert [
        c.global_offset for c in dc.tensor_parallel_sharded("w", local, 0, 1, 2, stride=2).chunks
    ] == [(2, 0), (6, 0)]


def _last_stage_of_four_layers():
    cfg = TransformerConfig(
        num_layers=4, hidden_size=16, num_attention_heads=4, use_cpu_initialization=True
    )
    return GPTModel(
        cfg,
        get_gpt_layer_local_spec(),
        vocab_size=64,
        max_sequence_length=8,
        pre_process=False,
        post_process=True,
        share_embeddings_and_output_weights=True,
        num_layers=2,
        layer_number_offset=2,
    )


def test_global_names_of_a_later_pipeline_stage_with_tied_embeddings():
    last = _last_stage_of_four_layers()
    entries, by_param = dc.model_sharded_state_dict([last], megatron_layout=False)
    layers = sorted({k.split(".")[2] for k in entries if k.startswith("decoder.layers.")})
    assert layers == ["2", "3"]
    assert "output_layer.weight" not in entries
    tied = entries["embedding.word_embeddings.weight"]
    assert tied.replica and tied.data.data_ptr() == last.output_layer.weight.data_ptr()
    assert not entries["decoder.layers.3.mlp.linear_fc1.weight"].replica
    assert (
        by_param[id(last.decoder.layers[1].mlp.linear_fc1.weight)].key
        == "decoder.layers.3.mlp.linear_fc1.weight"
    )


def test_megatron_layout_stacks_layers_with_te_norm_names_and_extra_state():
    # Megatron-LM's keys as megatron-core 0.16.1 writes them for a 4-layer local-spec GPT: one
    # key per parameter kind with a leading layer axis; the input norm under linear_qkv's
    # layer_norm_*, the pre-MLP norm under linear_fc1's; an _extra_state object per linear
    # module and layer, keyed <name>/shard_<layer>_<num_layers>.
    last = _last_stage_of_four_layers()
    entries, by_param = dc.model_sharded_state_dict([last])
    tensors = {e.key: e for e in entries.values() if isinstance(e, dc.ShardedTensor)}
    objects = {e.name for e in entries.values() if isinstance(e, dc.ShardedObject)}
    layer_keys = {k for k in tensors if k.startswith("decoder.layers.")}
    assert layer_keys == {
        "decoder.layers." + k
        for k in (
            "self_attention.linear_qkv.layer_norm_weight",
            "self_attention.linear_qkv.layer_norm_bias",
            "self_attention.linear_qkv.weight",
            "self_attention.linear_qkv.bias",
            "self_attention.linear_proj.weight",
            "self_attention.linear_proj.bias",
            "mlp.linear_fc1.layer_norm_weight",
            "mlp.linear_fc1.layer_norm_bias",
            "mlp.linear_fc1.weight",
            "mlp.linear_fc1.bias",
            "mlp.linear_fc2.weight",
            "mlp.linear_fc2.bias",
        )
    }
    assert objects == {
        f"decoder.layers.{m}._extra_state/shard_{layer}_4"
        for m in ("self_attention.linear_qkv", "self_attention.linear_proj")
        + ("mlp.linear_fc1", "mlp.linear_fc2")
        for layer in (2, 3)
    }
    # This stage's two layers are slices 2 and 3 of the [4, 3h, h] tensor, views of the weights.
    qkv = [
        e for e in entries.values() if e.key == "decoder.layers.self_attention.linear_qkv.weight"
    ]
    assert sorted(c.global_offset for e in qkv for c in e.chunks) == [(2, 0, 0), (3, 0, 0)]
    assert all(e.global_shape == (4, 48, 16) for e in qkv)
    layer3 = by_param[id(last.decoder.layers[1].self_attention.linear_qkv.weight)]
    assert layer3.chunks[0].global_offset == (3, 0, 0)
    assert (
        layer3.data.data_ptr() == last.decoder.layers[1].self_attention.linear_qkv.weight.data_ptr()
    )
    norm = by_param[id(last.decoder.layers[0].input_layernorm.weight)]
    assert norm.key == "decoder.layers.self_attention.linear_qkv.layer_norm_weight"
    assert norm.global_shape == (4, 16) and norm.chunks[0].global_offset == (2, 0)
    assert tensors["decoder.final_layernorm.weight"].global_shape == (16,)


@pytest.mark.parametrize("fully_parallel", [True, False])
def test_each_replicated_entry_has_exactly_one_writer(fully_parallel):
    def entries():
        return {
            f"t{i}": dc.replicated(f"t{i}", torch.zeros(i + 1), replica=i == 3) for i in range(6)
        }

    per_rank = []
    for dp_rank in range(3):
        e = entries()
        dc.spread_writes(e, dp_rank, 3, fully_parallel=fully_parallel)
        per_rank.append({k for k, v in e.items() if not v.replica})
    assert sorted(k for keys in per_rank for k in keys) == [
        "t0",
        "t1",
        "t2",
        "t4",
        "t5",
    ]  # once each; t3 is a replica
    if fully_parallel:
        assert all(per_rank)  # the writes are spread over the replicas
    else:
        assert per_rank[1] == per_rank[2] == set()


# ------------------------------------------------------------------ round trip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-masters"])
def test_round_trip_resumes_exactly(tmp_path, dtype):
    model, opt, sched = _setup(tmp_path, dtype=dtype)
    _train(model, opt, sched, 3)
    checkpointing.save_checkpoint(3, model, opt, sched, 12.5)
    straight = _train(model, opt, sched, 3, seed=8)

    directory = _iter_dir(tmp_path, 3)
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert json.loads((directory / "metadata.json").read_text()) == {
        "sharded_backend": "torch_dist",
        "sharded_backend_version": 1,
        "common_backend": "torch",
        "common_backend_version": 1,
    }
    assert {".metadata", "__0_0.distcp", "common.pt", "metadata.json"} == set(os.listdir(directory))
    with torch.serialization.safe_globals([argparse.Namespace]):
        common = torch.load(directory / "common.pt", weights_only=True)
    assert common["iteration"] == 3 and common["num_floating_point_operations_so_far"] == 12.5
    assert not hasattr(common["args"], "some_callable")
    keys = set(dc.tensor_shapes(dc.read_dcp_metadata(str(directory))))
    assert {
        "0.weight",
        "optimizer.state.exp_avg.0.weight",
        "optimizer.state.exp_avg_sq.2.bias",
    } <= keys
    assert ("optimizer.state.fp32_param.0.weight" in keys) == (dtype == torch.bfloat16)
    # The optimizer's common state as megatron-core 0.16.1's optimizers write it (read from a
    # checkpoint it wrote): FP32Optimizer {"state": {"common_step"}, "param_groups"},
    # Float16OptimizerWithFloat16Params the same under "optimizer" (+ "grad_scaler" if any);
    # groups without "params", keyed by Megatron's group identifiers.
    optim = common["optimizer"]
    inner = optim["optimizer"] if dtype == torch.bfloat16 else optim
    assert set(inner) == {"state", "param_groups"} and set(optim) == (
        {"optimizer"} if dtype == torch.bfloat16 else {"state", "param_groups"}
    )
    assert torch.equal(inner["state"]["common_step"], torch.tensor(3.0))
    assert [(g["wd_mult"], "params" in g) for g in inner["param_groups"]] == [
        (1.0, False),
        (0.0, False),
    ]
    assert {"lr_mult", "is_expert_parallel", "is_decoupled_lr"} <= set(inner["param_groups"][0])
    assert common["content_metadata"] == {
        "distrib_optim_sharding_type": "fully_reshardable",
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
    }

    model2, opt2, sched2 = _setup(tmp_path, seed=99, dtype=dtype)
    torch.manual_seed(12345)  # the checkpoint must restore the RNG
    assert checkpointing.load_checkpoint(model2, opt2, sched2) == (3, 12.5)
    assert _train(model2, opt2, sched2, 3, seed=8) == straight
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def _train_gpt(model, opt, sched, steps, seed):
    from tests.unit_tests.tiny_configs import TINY_SEQ, TINY_VOCAB

    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, TINY_VOCAB, (2, TINY_SEQ), generator=g)
        positions = torch.arange(TINY_SEQ).unsqueeze(0).expand_as(tokens)
        opt.zero_grad()
        if hasattr(model, "zero_grad_buffer"):  # DistributedDataParallel
            model.zero_grad_buffer()
        loss = model(tokens, positions, None, labels=tokens.roll(-1, 1)).mean()
        loss.backward()
        if hasattr(model, "finish_grad_sync"):
            model.finish_grad_sync()
        opt.step()
        sched.step(2)
        losses.append(loss.item())
    return losses


def test_gpt_distributed_optimizer_state_is_megatron_cores_dp_reshardable_by_default(tmp_path):
    # Megatron-LM's default with the distributed optimizer: flat per-bucket tensors in
    # megatron-core's grad-buffer layout, its param groups and bucket sizes as objects beside
    # them (the layout itself is checked against megatron-core in tests/interop).
    from megatron.core.dist_checkpointing import dp_reshardable as dpr
    from tests.unit_tests.tiny_configs import tiny_gpt_model

    ddp, opt, sched = _distributed_setup(tmp_path, seed=0, model=tiny_gpt_model(seed=0))
    _train_gpt(ddp, opt, sched, 2, seed=1)
    checkpointing.save_checkpoint(2, ddp, opt, sched, 0.0)
    saved_weights = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    straight = _train_gpt(ddp, opt, sched, 2, seed=2)

    directory = str(_iter_dir(tmp_path, 2))
    metadata = dc.read_dcp_metadata(directory)
    fp32 = (torch.float32, torch.float32)
    assert {k for k in dc.tensor_shapes(metadata) if k.startswith("optimizer.")} == {
        dpr.bucket_key(0, 0, fp32, 0, name) for name in ("param", "exp_avg", "exp_avg_sq")
    }
    with torch.serialization.safe_globals([argparse.Namespace]):
        common = torch.load(_iter_dir(tmp_path, 2) / "common.pt", weights_only=True)
    assert common["optimizer"] == {"param_state_sharding_type": "dp_reshardable"}
    assert common["content_metadata"]["distrib_optim_sharding_type"] == "dp_reshardable"
    groups = dpr.read_object(directory, metadata, dpr.object_key(0, "optimizer"))["param_groups"]
    assert [(g["wd_mult"], g["step"]) for g in groups] == [(1.0, 2.0), (0.0, 2.0)]
    numel = dpr.read_object(directory, metadata, dpr.object_key(0, "per_bucket_numel_unpadded"))
    # One bucket holding every parameter, each starting at a multiple of 64 elements.
    assert list(numel[0]) == [fp32] and len(numel[0][fp32]) == 1
    total = sum(p.numel() for p in ddp.parameters())
    assert total <= numel[0][fp32][0] < total + 64 * len(list(ddp.parameters()))

    ddp2, opt2, sched2 = _distributed_setup(tmp_path, seed=5, model=tiny_gpt_model(seed=5))
    assert checkpointing.load_checkpoint(ddp2, opt2, sched2)[0] == 2
    assert _train_gpt(ddp2, opt2, sched2, 2, seed=2) == straight

    # Without the distributed optimizer that state has no place: one line, then the model alone.
    model3, opt3, sched3 = _setup(tmp_path, model=tiny_gpt_model(seed=5))
    with pytest.raises(
        checkpointing.CheckpointError,
        match=r"dp_reshardable layout, which cannot be placed in this run \(rank 0: this run does "
        r"not use --use-distributed-optimizer\); the optimizer state was not loaded: pass "
        "--no-load-optim or --finetune to load the model only",
    ):
        checkpointing.load_checkpoint(model3, opt3, sched3)
    global_vars.get_args().no_load_optim = True
    assert checkpointing.load_checkpoint(model3, opt3, sched3)[0] == 2
    for name, param in model3.named_parameters():
        assert torch.equal(param, saved_weights[name]), name


def _distributed_setup(tmp_path, seed, model=None, **kw):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    model, _opt, _sched = _setup(
        tmp_path, seed=seed, model=model, use_distributed_optimizer=True, **kw
    )
    ddp = DistributedDataParallel(
        None,
        DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True),
        model,
    )
    opt = get_megatron_optimizer(
        OptimizerConfig(lr=1e-2, weight_decay=0.1, use_distributed_optimizer=True), [ddp]
    )
    sched = make_scheduler(opt)
    return ddp, opt, sched


def _train_ddp(ddp, opt, sched, steps, seed):
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        ddp.zero_grad_buffer()
        loss = ddp(torch.randn(4, 8, generator=g)).pow(2).mean()
        loss.backward()
        ddp.finish_grad_sync()
        opt.step()
        sched.step(4)
        losses.append(loss.item())
    return losses


def test_distributed_optimizer_state_in_megatron_core_fully_reshardable_keys(tmp_path):
    # megatron-core's fully_reshardable layout (read from a checkpoint it wrote): per parameter
    # optimizer.state.{param,exp_avg,exp_avg_sq}.<key>, "param" being the fp32 main weight (for
    # fp32 weights too); common state {"optimizer": {"param_groups": [.., "step"]},
    # "param_state_sharding_type": "fully_reshardable"}.
    ddp, opt, sched = _distributed_setup(tmp_path, seed=0, dist_ckpt_optim_fully_reshardable=True)
    _train_ddp(ddp, opt, sched, 3, seed=7)
    checkpointing.save_checkpoint(3, ddp, opt, sched, 0.0)
    straight = _train_ddp(ddp, opt, sched, 2, seed=8)

    directory = _iter_dir(tmp_path, 3)
    keys = set(dc.tensor_shapes(dc.read_dcp_metadata(str(directory))))
    params = {"0.weight", "0.bias", "1.weight", "1.bias", "2.weight", "2.bias"}
    assert {k for k in keys if not k.startswith("optimizer.")} == params
    assert {k for k in keys if k.startswith("optimizer.")} == {
        f"optimizer.state.{name}.{p}" for name in ("param", "exp_avg", "exp_avg_sq") for p in params
    }
    with torch.serialization.safe_globals([argparse.Namespace]):
        common = torch.load(directory / "common.pt", weights_only=True)
    optim = common["optimizer"]
    assert set(optim) == {"optimizer", "param_state_sharding_type"}
    assert optim["param_state_sharding_type"] == "fully_reshardable"
    assert [
        (g["wd_mult"], g["step"], "params" in g) for g in optim["optimizer"]["param_groups"]
    ] == [
        (1.0, 3.0, False),
        (0.0, 3.0, False),
    ]

    # Layout-free: it resumes with the distributed optimizer and without it alike.
    ddp2, opt2, sched2 = _distributed_setup(tmp_path, seed=5)
    assert checkpointing.load_checkpoint(ddp2, opt2, sched2)[0] == 3
    assert _train_ddp(ddp2, opt2, sched2, 2, seed=8) == straight
    model3, opt3, sched3 = _setup(tmp_path, seed=5)
    assert checkpointing.load_checkpoint(model3, opt3, sched3)[0] == 3
    losses = []
    g = torch.Generator().manual_seed(8)
    for _ in range(2):
        opt3.zero_grad()
        loss = model3(torch.randn(4, 8, generator=g)).pow(2).mean()
        loss.backward()
        opt3.step()
        sched3.step(4)
        losses.append(loss.item())
    assert losses == pytest.approx(straight, rel=1e-6)


def test_optimizer_common_state_of_megatron_core_and_of_earlier_checkpoints_is_read():
    from megatron.core.dist_checkpointing.optimizer_state import normalized_common_state

    group = {"wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False, "lr": 3e-4}
    group = {**group, "is_decoupled_lr": False, "weight_decay": 0.1}
    # The three structures megatron-core 0.16.1 writes (seen in checkpoints it saved).
    fp32 = {"state": {"common_step": torch.tensor(7.0)}, "param_groups": [group]}
    mixed = {"optimizer": fp32, "grad_scaler": {"scale": 8.0}}
    distributed = {
        "optimizer": {"param_groups": [{**group, "step": 7.0}]},
        "param_state_sharding_type": "fully_reshardable",
    }
    for common, scaler in ((fp32, None), (mixed, {"scale": 8.0}), (distributed, None)):
        read = normalized_common_state(common)
        assert read["step"] == 7 and read["grad_scaler"] == scaler
        assert read["param_groups"] == [{**group, "step": 7}]
    # Not yet stepped: megatron-core writes no common_step.
    assert normalized_common_state({"state": {}, "param_groups": [group]})["step"] == 0
    # This code base's earlier structure.
    earlier = {"param_groups": [{**group, "step": 4}], "grad_scaler": None, "has_state": True}
    assert normalized_common_state(earlier)["step"] == 4
    # megatron-core's default distributed-optimizer layout keeps its param groups beside the
    # tensors (the checkpoint loader reads them in): without them it cannot be read.
    with pytest.raises(dc.UnreadableOptimizerState, match="Megatron-LM's dp_reshardable layout"):
        normalized_common_state({"param_state_sharding_type": "dp_reshardable"})


def test_loaded_common_state_keeps_how_this_run_steps():
    # A checkpoint written on CPU (foreach, fused off) resumed where the run steps fused: the
    # hyperparameters come from the checkpoint, the step implementation stays this run's.
    from megatron.core.dist_checkpointing.optimizer_state import (
        load_optimizer_common_state,
        optimizer_common_state,
    )
    from megatron.core.optimizer import FP32Optimizer, OptimizerConfig

    def optimizer(**impl):
        param = torch.nn.Parameter(torch.ones(2))
        inner = torch.optim.AdamW([{"params": [param], "wd_mult": 1.0}], lr=0.1, **impl)
        return FP32Optimizer(inner, OptimizerConfig(lr=0.1), None, 0)

    saved = optimizer(foreach=True)
    saved.param_groups[0]["betas"] = (0.5, 0.6)
    running = optimizer(foreach=False, fused=None)
    running.param_groups[0]["fused"] = True  # as torch.optim keeps it on a fused device
    load_optimizer_common_state(running, optimizer_common_state(saved))
    group = running.param_groups[0]
    assert group["betas"] == (0.5, 0.6)
    assert group["fused"] is True and group["foreach"] is False


def test_torch_format_model_entries_carry_megatron_extra_state(tmp_path):
    # megatron-core 0.16.1's local-spec GPT state_dict() holds an _extra_state (None) for each
    # layer's linear_qkv, linear_proj, linear_fc1, linear_fc2 and for output_layer (even tied);
    # Megatron-LM loads the torch format strictly, so ours writes them and ignores them on load.
    from megatron.core.dist_checkpointing.megatron_layout import with_extra_state
    from tests.unit_tests.tiny_configs import tiny_gpt_model

    model = tiny_gpt_model(seed=0, share_embeddings_and_output_weights=True)
    state = with_extra_state(model, model.state_dict())
    extra = {k: v for k, v in state.items() if not torch.is_tensor(v)}
    assert extra == {
        f"decoder.layers.{layer}.{module}._extra_state": None
        for layer in (0, 1)
        for module in ("self_attention.linear_qkv", "self_attention.linear_proj")
        + ("mlp.linear_fc1", "mlp.linear_fc2")
    } | {"output_layer._extra_state": None}

    args = _args(tmp_path, ckpt_format="torch")
    model, opt, sched = setup_training_state(args, lambda: tiny_gpt_model(seed=0))
    checkpointing.save_checkpoint(1, model, opt, sched, 0.0)
    path = _iter_dir(tmp_path, 1) / "mp_rank_00" / "model_optim_rng.pt"
    with torch.serialization.safe_globals([argparse.Namespace]):
        saved = torch.load(path, weights_only=True)["model"]
    assert "decoder.layers.1.mlp.linear_fc2._extra_state" in saved
    model2, opt2, sched2 = setup_training_state(args, lambda: tiny_gpt_model(seed=3))
    assert checkpointing.load_checkpoint(model2, opt2, sched2)[0] == 1
    for (name, a), b in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(a, b), name


def test_torch_format_still_works_and_formats_are_told_apart(tmp_path):
    model, opt, sched = _setup(tmp_path, ckpt_format="torch")
    checkpointing.save_checkpoint(2, model, opt, sched)
    assert (_iter_dir(tmp_path, 2) / "mp_rank_00" / "model_optim_rng.pt").is_file()
    assert checkpointing.detect_checkpoint_format(str(_iter_dir(tmp_path, 2))) == "torch"
    model2, opt2, sched2 = _setup(tmp_path, seed=4)  # --ckpt-format torch_dist
    with pytest.raises(checkpointing.CheckpointError, match="is a torch-format checkpoint") as err:
        checkpointing.load_checkpoint(model2, opt2, sched2)
    assert "is a torch-format checkpoint but --ckpt-format is torch_dist" in str(err.value)
    assert "--auto-detect-ckpt-format" in str(err.value)
    global_vars.get_args().auto_detect_ckpt_format = True
    assert checkpointing.load_checkpoint(model2, opt2, sched2)[0] == 2
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


# ------------------------------------------------------------------ crash safety and bad input
def test_interrupted_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    model, opt, sched = _setup(tmp_path)
    _train(model, opt, sched, 1)
    checkpointing.save_checkpoint(1, model, opt, sched)
    saved = [p.detach().clone() for p in model.parameters()]
    real_save = serialization.dcp.save

    def crash(*a, **k):
        real_save(*a, **k)
        raise KeyboardInterrupt("killed after writing the data files")

    monkeypatch.setattr(serialization.dcp, "save", crash)
    _train(model, opt, sched, 1)
    with pytest.raises(KeyboardInterrupt, match="killed after writing the data files"):
        checkpointing.save_checkpoint(2, model, opt, sched)
    monkeypatch.setattr(serialization.dcp, "save", real_save)

    root = tmp_path / "ckpt"
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert not _iter_dir(tmp_path, 2).exists()
    partial = root / "iter_0000002.tmp"
    assert (partial / "__0_0.distcp").is_file() and not (partial / "metadata.json").exists()

    model2, opt2, sched2 = _setup(tmp_path, seed=5)
    assert checkpointing.load_checkpoint(model2, opt2, sched2)[0] == 1
    assert all(torch.equal(a, b) for a, b in zip(saved, model2.parameters()))
    global_vars.get_args().ckpt_step = 2
    with pytest.raises(checkpointing.CheckpointError, match="iter_0000002 does not exist"):
        checkpointing.load_checkpoint(model2, opt2, sched2)
    # The next successful save clears the unfinished one.
    global_vars.get_args().ckpt_step = None
    checkpointing.save_checkpoint(3, model2, opt2, sched2)
    assert sorted(os.listdir(root)) == [
        "iter_0000001",
        "iter_0000003",
        "latest_checkpointed_iteration.txt",
    ]


@pytest.mark.parametrize(
    "damage, words",
    [
        ("no-metadata-json", ["iter_0000001 has no metadata.json", "did not finish"]),
        ("no-data-file", ["__0_0.distcp is missing", "damaged"]),
        ("truncated-data-file", ["__0_0.distcp is truncated"]),
        ("no-common", ["common.pt is missing"]),
        ("no-dcp-metadata", [".metadata is missing"]),
    ],
)
def test_damaged_checkpoint_names_the_file(tmp_path, damage, words):
    model, opt, sched = _setup(tmp_path)
    _train(model, opt, sched, 1)
    checkpointing.save_checkpoint(1, model, opt, sched)
    directory = _iter_dir(tmp_path, 1)
    if damage == "no-metadata-json":
        (directory / "metadata.json").unlink()
    elif damage == "no-data-file":
        (directory / "__0_0.distcp").unlink()
    elif damage == "truncated-data-file":
        data = (directory / "__0_0.distcp").read_bytes()
        (directory / "__0_0.distcp").write_bytes(data[: len(data) // 2])
    elif damage == "no-common":
        (directory / "common.pt").unlink()
    else:
        (directory / ".metadata").unlink()
    model2, opt2, sched2 = _setup(tmp_path, seed=5)
    with pytest.raises(checkpointing.CheckpointError, match=re.escape(words[0])) as err:
        checkpointing.load_checkpoint(model2, opt2, sched2)
    for w in words:
        assert w in str(err.value), str(err.value)


def test_checkpoint_of_another_model_lists_the_mismatches(tmp_path):
    model, opt, sched = _setup(tmp_path)
    checkpointing.save_checkpoint(1, model, opt, sched)
    # The model flags differ: named before any tensor is read (as Megatron checks them).
    other, opt2, sched2 = _setup(tmp_path, model=_model(3, width=16), hidden_size=16)
    with pytest.raises(
        checkpointing.CheckpointError, match="was saved with --hidden-size 8, but this run uses 16"
    ):
        checkpointing.load_checkpoint(other, opt2, sched2)
    # Same flags, another model (the flags do not describe every shape): the tensors are listed.
    other, opt2, sched2 = _setup(tmp_path, model=_model(3, width=16))
    with pytest.raises(checkpointing.CheckpointError, match="does not fit this model") as err:
        checkpointing.load_checkpoint(other, opt2, sched2)
    assert "0.weight: checkpoint (8, 8) vs model (16, 8)" in str(err.value)


def test_metadata_that_would_run_code_is_refused(tmp_path):
    model, opt, sched = _setup(tmp_path)
    checkpointing.save_checkpoint(1, model, opt, sched)
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (_iter_dir(tmp_path, 1) / ".metadata").write_bytes(pickle.dumps(Payload()))
    model2, opt2, sched2 = _setup(tmp_path, seed=5)
    with pytest.raises(
        checkpointing.CheckpointError, match="is not allowed in checkpoint metadata"
    ):
        checkpointing.load_checkpoint(model2, opt2, sched2)
    assert not marker.exists()


# ------------------------------------------------------------------ --dist-ckpt-strictness
def _load_with(tmp_path, strictness, extra):
    model, _, _ = _setup(
        tmp_path, model=_model(5, extra=extra), dist_ckpt_strictness=strictness, no_load_optim=True
    )
    before = [p.detach().clone() for p in model.parameters()]
    checkpointing.load_checkpoint(model, None, None)
    return model, before


def test_strictness_for_missing_and_unexpected_keys(tmp_path, capsys):
    model, opt, sched = _setup(tmp_path)
    checkpointing.save_checkpoint(1, model, opt, sched)
    reference = dict(model.state_dict())

    # The model has a layer the checkpoint lacks (missing keys).
    for strictness in ("assume_ok_unexpected", "raise_all"):
        with pytest.raises(
            checkpointing.CheckpointError, match=r"missing in checkpoint: 3\.bias, 3\.weight"
        ):
            _load_with(tmp_path, strictness, extra=4)
    loaded, before = _load_with(tmp_path, "log_all", extra=4)
    assert torch.equal(loaded[0].weight, reference["0.weight"]) and torch.equal(
        loaded[3].weight, before[-2]
    )
    assert (
        "missing in checkpoint (kept their current values): 3.bias, 3.weight"
        in capsys.readouterr().out
    )

    # The checkpoint has a layer the model lacks (unexpected keys).
    for strictness in ("raise_unexpected", "raise_all"):
        with pytest.raises(
            checkpointing.CheckpointError, match=r"unexpected in checkpoint: 2\.bias, 2\.weight"
        ):
            _load_with(tmp_path, strictness, extra=2)
    for strictness in ("assume_ok_unexpected", "log_unexpected", "ignore_all"):
        loaded, _ = _load_with(tmp_path, strictness, extra=2)
        assert torch.equal(loaded[0].weight, reference["0.weight"])
    out = capsys.readouterr().out
    assert (
        out.count("unexpected in checkpoint (not loaded): 2.bias, 2.weight") == 1
    )  # log_unexpected only


# ------------------------------------------------------------------ --async-save
def test_async_save_writes_the_state_of_its_iteration(tmp_path):
    model, opt, sched = _setup(tmp_path)
    _train(model, opt, sched, 2)
    global_vars.get_args().save = str(tmp_path / "sync")
    checkpointing.save_checkpoint(2, model, opt, sched)
    args = global_vars.get_args()
    args.save, args.async_save = str(tmp_path / "ckpt"), True
    checkpointing.save_checkpoint(2, model, opt, sched)
    with torch.no_grad():  # training goes on while the writer runs
        for p in model.parameters():
            p.add_(1.0)
    assert checkpointing_dist.maybe_finalize_async_save(blocking=True)
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "2"

    sync_dir, async_dir = str(tmp_path / "sync" / "iter_0000002"), str(_iter_dir(tmp_path, 2))
    shapes = dc.tensor_shapes(dc.read_dcp_metadata(sync_dir))
    assert shapes == dc.tensor_shapes(dc.read_dcp_metadata(async_dir))
    for directory_pair in [(sync_dir, async_dir)]:
        values = []
        for directory in directory_pair:
            targets = {k: dc.replicated(k, torch.empty(s, dtype=t)) for k, (s, t) in shapes.items()}
            dc.load_shards(targets, directory)
            values.append(targets)
        for key in shapes:
            assert torch.equal(values[0][key].data, values[1][key].data), key
    assert not torch.equal(values[1]["0.weight"].data, model[0].weight.detach())


def test_async_staging_copies_every_written_chunk():
    from megatron.core.dist_checkpointing.async_save import stage

    full = torch.arange(8 * 3, dtype=torch.float32).view(8, 3)
    local = shard_of(full, 0, 1, 2, stride=2)
    staged = stage(
        {
            "w": dc.tensor_parallel_sharded("w", local, 0, 1, 2, stride=2),
            "r": dc.replicated("r", torch.ones(2), replica=True),
        }
    )
    # Replicas are not written, so not copied; each written chunk is one compact copy.
    assert sorted(staged) == ["w@(2, 0)", "w@(6, 0)"]
    local.zero_()
    for entry in staged.values():
        assert entry.key == "w" and entry.global_shape == (8, 3) and len(entry.chunks) == 1
        (chunk,) = entry.chunks
        rows = full[chunk.global_offset[0] : chunk.global_offset[0] + chunk.shape[0]]
        assert torch.equal(entry.view(chunk), rows)
        assert entry.data.untyped_storage().nbytes() == rows.numel() * rows.element_size()


# ------------------------------------------------------------------ --save-retain-interval
def test_retention_keeps_multiples_the_newest_and_the_tracked(tmp_path):
    root = tmp_path / "ckpt"
    for it in (2, 4, 6, 8, 10, 12):
        (root / f"iter_{it:07d}").mkdir(parents=True)
    (root / "iter_0000005.tmp").mkdir()
    (root / "latest_checkpointed_iteration.txt").write_text("6")
    args = argparse.Namespace(save_retain_interval=4)
    checkpointing.remove_unretained(args, str(root), 10)
    assert sorted(os.listdir(root)) == [
        "iter_0000004",
        "iter_0000006",
        "iter_0000008",
        "iter_0000010",
        "iter_0000012",
        "latest_checkpointed_iteration.txt",
    ]


def test_save_with_retention_interval(tmp_path):
    model, opt, sched = _setup(tmp_path, save_retain_interval=2)
    for it in (1, 2, 3, 4, 5):
        checkpointing.save_checkpoint(it, model, opt, sched)
    assert sorted(n for n in os.listdir(tmp_path / "ckpt") if n.startswith("iter_")) == [
        "iter_0000002",
        "iter_0000004",
        "iter_0000005",
    ]


# ------------------------------------------------------------------ --use-checkpoint-args
def test_use_checkpoint_args_reads_model_flags(tmp_path, capsys):
    from megatron.training.arguments import parse_and_validate_args

    directory = tmp_path / "ckpt" / "iter_0000007"
    directory.mkdir(parents=True)
    saved = argparse.Namespace(
        num_layers=6,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=256,
        swiglu=True,
        seq_length=32,
        max_position_embeddings=64,
        kv_channels=16,
    )
    dc.save_common({"args": saved, "iteration": 7}, str(directory))
    dc.write_metadata_json(str(directory))
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("7")
    args = parse_and_validate_args(
        argv=[
            "--use-checkpoint-args",
            "--load",
            str(tmp_path / "ckpt"),
            "--num-layers",
            "2",
            "--micro-batch-size",
            "1",
            "--lr",
            "1e-3",
            "--train-iters",
            "1",
            "--mock-data",
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            "100",
        ]
    )
    assert (
        args.num_layers,
        args.hidden_size,
        args.num_attention_heads,
        args.swiglu,
        args.ffn_hidden_size,
    ) == (2, 64, 4, True, 256)
    out = capsys.readouterr().out
    assert (
        "setting hidden_size to 64 from checkpoint" in out
        and "setting swiglu to True from checkpoint" in out
    )
    assert "keeping --num-layers 2 from the command line (the checkpoint has 6)" in out


def _next_draws():
    """The next numbers of the four streams a checkpoint's RNG state restores."""
    import random

    import numpy as np

    with global_vars.get_rng_tracker().fork():
        tracked = torch.rand(3)
    return random.random(), float(np.random.random()), torch.rand(3), tracked


def _reseed_everything(seed):
    import random

    import numpy as np

    from megatron.core.tensor_parallel.random import RNGStatesTracker, model_parallel_manual_seed

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tracker = RNGStatesTracker("cpu")
    model_parallel_manual_seed(tracker, seed)
    global_vars.set_rng_tracker(tracker)


def _assert_same_draws(got, expected):
    assert got[:2] == expected[:2]
    assert torch.equal(got[2], expected[2]) and torch.equal(got[3], expected[3])


def test_rng_state_is_megatron_lms_object_and_the_earlier_list_form_still_loads(tmp_path):
    import numpy as np

    from megatron.training.checkpointing_common import rng_state

    model, opt, sched = _setup(tmp_path)
    _train(model, opt, sched, 2)
    with global_vars.get_rng_tracker().fork():
        torch.rand(5)  # the tracked stream is no longer at its seed
    checkpointing.save_checkpoint(2, model, opt, sched, 0.0)
    expected = _next_draws()
    directory = _iter_dir(tmp_path, 2)
    with torch.serialization.safe_globals([argparse.Namespace]):
        common = torch.load(directory / "common.pt", weights_only=True)
    assert "rng_state" not in common

    # Megatron-LM's rng_state: an object on the (PP, TP) = (1, 1) grid holding a list of one
    # per-rank dict, numpy's state as numpy.random.get_state() gives it; no CUDA state on CPU
    # (none to save: Megatron-LM then asks for --no-load-rng in its own line).
    entry = dc.ShardedObject("rng_state", None, (1, 1), (0, 0), read_back=True)
    dc.load_shards({entry.name: entry}, str(directory))
    [saved] = entry.data
    assert set(saved) == {
        "random_rng_state",
        "np_rng_state",
        "torch_rng_state",
        "rng_tracker_states",
    }
    name, keys, position, has_gauss, cached_gaussian = saved["np_rng_state"]
    assert name == "MT19937" and keys.dtype == np.uint32 and keys.shape == (624,)
    assert isinstance(position, int) and isinstance(cached_gaussian, float)
    assert saved["torch_rng_state"].dtype == torch.uint8
    assert set(saved["rng_tracker_states"]) == set(global_vars.get_rng_tracker().get_states())

    model2, opt2, sched2 = _setup(tmp_path, seed=99)
    _reseed_everything(4321)
    assert checkpointing.load_checkpoint(model2, opt2, sched2)[0] == 2
    _assert_same_draws(_next_draws(), expected)

    # The form written here before: every rank's state with its (pp, tp, dp, cp) in common.pt.
    args = global_vars.get_args()
    args.no_save_rng = True
    checkpointing.save_checkpoint(3, model2, opt2, sched2, 0.0)
    args.no_save_rng = False
    earlier = [{"coordinates": (0, 0, 0, 0), "state": rng_state(global_vars.get_rng_tracker())}]
    expected = _next_draws()
    old = _iter_dir(tmp_path, 3)
    assert not any(
        k.startswith("rng_state") for k in dc.read_dcp_metadata(str(old)).state_dict_metadata
    )
    with torch.serialization.safe_globals([argparse.Namespace]):
        common = torch.load(old / "common.pt", weights_only=True)
    torch.save({**common, "rng_state": earlier}, old / "common.pt")
    _reseed_everything(55)
    assert checkpointing.load_checkpoint(model2, opt2, sched2)[0] == 3
    _assert_same_draws(_next_draws(), expected)


def test_a_training_run_saves_megatrons_run_state_entries(tmp_path, capsys):
    # The saved args Namespace and the top-level entries, key for key and value for value,
    # and those of a --ckpt-convert-format conversion of the run.
    check_saved_run_state(tmp_path, "torch_dist", capsys)
