"""pretrain_mamba.py: a hybrid model (M*-M: Mamba, attention, MLP, Mamba; 8 Mamba heads in 2
groups) trained under parallel layouts equals the one-process run over 10 iterations (loss 1e-6,
grad norm 1e-5, relative; no dropout, whose masks differ between layouts), and a torch_dist
checkpoint reshards across layouts.

The one-process run is in this process. One spawned world of 4 processes runs, in-process:

* the context-parallel layout change of a Mamba layer alone (CP=4 over the whole world, with
  both ways Megatron deals groups: 4 groups, one per CP rank, and 2 groups each shared by 2 CP
  ranks): a rank's head-sharded sequence is exactly the matching heads of the whole sequence in
  global order, and the way back returns the load-balanced sequence shard it started from, bit
  for bit;
* the model at TP=2 with sequence parallelism x PP=2, saving a torch-format checkpoint whose
  files are checked; at DP=2 x CP=2 (2 groups: one per CP rank); at TP=2 with sequence
  parallelism x CP=2 (one group per TP rank, shared by its 2 CP ranks).

Two torchrun runs: DP=2 with the distributed optimizer saving a torch_dist checkpoint in
Megatron's hybrid layout and exiting at iteration 5; TP=2 resuming from it for iterations 6-10
(the checkpoint written at TP=1 is read back as TP shards of Mamba's in_proj [z, x, B, C, dt]
and conv1d [x, B, C] parts)."""

import contextlib
import inspect
import io
import json
import math
import sys

import pytest
import torch

from tests.functional_tests.runner import (
    REPO,
    TINY_MODEL,
    assert_same_training,
    read_tensorboard_scalars,
    run_pretrain,
)
from tests.unit_tests.dist_utils import run_distributed

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
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
CP2 = ["--context-parallel-size", "2"]
# The layouts of the spawned world; "{ckpt}" is replaced by a directory of the test's.
WORLD_LAYOUTS = {
    "tp2-sp-pp2": TP2_SP
    + ["--pipeline-model-parallel-size", "2", "--ckpt-format", "torch", "--save", "{ckpt}"]
    + ["--save-interval", "10"],
    "dp2-cp2": CP2,
    "tp2-sp-cp2": TP2_SP + CP2,
}

# Megatron-LM's hybrid test configuration hybrid_mr_mcore_te_tp2_pp1_cp4 (its MODEL_ARGS as
# written; data, paths, --load and the NCCL backend left out), shrunk below to run in the world.
MEGATRON_CP4 = """
--num-layers 44 --hidden-size 1024 --num-attention-heads 16 --group-query-attention
--num-query-groups 8 --hybrid-override-pattern M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M-
--spec megatron.core.models.mamba.mamba_layer_specs mamba_stack_spec --is-hybrid-model
--log-params-norm --log-num-zeros-in-grad --log-validation-ppl-to-tensorboard
--log-timers-to-tensorboard --micro-batch-size 4 --global-batch-size 32 --seq-length 1024
--max-position-embeddings 1024 --train-iters 50 --timing-log-level 2 --lr-decay-iters 320000
--split 949,50,1 --lr 0.00015 --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 1e-2
--clip-grad 1.0 --lr-warmup-fraction .01 --log-interval 1 --save-interval 10000
--eval-interval 1000 --eval-iters 10 --transformer-impl transformer_engine
--tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --context-parallel-size 4
--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
--check-weight-hash-across-dp-replicas-interval 10 --ckpt-fully-parallel-load
--no-gradient-accumulation-fusion --attention-softmax-in-fp32 --use-mcore-models
--ckpt-format torch_dist --dist-ckpt-optim-fully-reshardable --bf16 --attention-backend fused
--log-memory-to-tensorboard
""".split()
# A tiny model, 3 iterations, and CP 2 instead of 4: TP2 x CP2 fills the world of 4 processes.
MEGATRON_SHRUNK = {"--num-layers": "7", "--hybrid-override-pattern": "M-M*-M-"}
MEGATRON_SHRUNK.update({"--hidden-size": "64", "--num-attention-heads": "4"})
MEGATRON_SHRUNK.update({"--num-query-groups": "2", "--micro-batch-size": "2"})
MEGATRON_SHRUNK.update({"--global-batch-size": "4", "--seq-length": "32"})
MEGATRON_SHRUNK.update({"--max-position-embeddings": "32", "--train-iters": "3"})
MEGATRON_SHRUNK.update({"--context-parallel-size": "2", "--eval-iters": "0"})
MEGATRON_SHRUNK.update({"--save-interval": "3"})


def _megatron_cp_config(tmp):
    argv = list(MEGATRON_CP4)
    for i, flag in enumerate(argv[:-1]):
        argv[i + 1] = MEGATRON_SHRUNK.get(flag, argv[i + 1])
    argv += ["--mamba-state-dim", "16", "--mamba-head-dim", "16", "--mamba-num-groups", "2"]
    argv += ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "500"]
    return argv + ["--num-workers", "0", "--save", f"{tmp}/megatron_ckpt"]


def _train_in_process(argv):
    """{'loss': {iteration: lm loss}, 'norm': {iteration: grad norm}} of an in-process
    pretrain_mamba.py run, as training_log receives them on this rank."""
    sys.path.insert(0, str(REPO))
    import pretrain_mamba
    from megatron.training import global_vars, training

    metrics = {"loss": {}, "norm": {}}
    real = training.training_log
    names = list(inspect.signature(real).parameters)

    def spy(*args, **kwargs):
        given = {**dict(zip(names, args)), **kwargs}
        if "lm loss" in given["loss_dict"]:  # only the last pipeline stage has the loss
            metrics["loss"][given["iteration"]] = float(given["loss_dict"]["lm loss"])
            metrics["norm"][given["iteration"]] = given["grad_norm"]
        return real(*args, **kwargs)

    training.training_log = spy
    global_vars.reset_globals()
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            training.pretrain(
                pretrain_mamba.train_valid_test_datasets_provider,
                pretrain_mamba.model_provider,
                pretrain_mamba.SPEC.model_type,
                pretrain_mamba.forward_step,
                argv=argv,
                model_family=pretrain_mamba.SPEC,
            )
    finally:
        training.training_log = real
        global_vars.reset_globals()
    return metrics


def _tensorboard(tb):
    return {
        "loss": read_tensorboard_scalars(tb, "lm loss"),
        "norm": read_tensorboard_scalars(tb, "grad-norm"),
    }


def _train(args, nproc, tb):
    result = run_pretrain(
        list(args) + ["--tensorboard-dir", str(tb)], nproc=nproc, script="pretrain_mamba.py"
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return _tensorboard(tb)


def _part(metrics, iterations):
    return {k: {i: v[i] for i in iterations if i in v} for k, v in metrics.items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The one-process run (in this process), shared by both tests: what training_log received
    and what TensorBoard holds."""
    tb = tmp_path_factory.mktemp("mamba_ref")
    received = _train_in_process(HYBRID + ["--tensorboard-dir", str(tb)])
    assert received["loss"][10] < received["loss"][1]
    return {"received": received, "tensorboard": _tensorboard(tb)}


def _check_cp_layout_change(rank, world_size):
    """CP = the world: to_head_sharded gives this rank's heads of the global tensor in global
    order; to_sequence_sharded returns x exactly."""
    from megatron.core.ssm.mamba_context_parallel import MambaContextParallel
    from megatron.core.transformer.context_parallel import cp_chunk_indices

    cp, group = world_size, torch.distributed.group.WORLD
    heads, headdim, d_state, length, batch = 8, 3, 5, 4 * world_size, 2
    for groups in (4, 2):
        mcp = MambaContextParallel(group, heads, groups, headdim, d_state)
        gn = groups * d_state
        gen = torch.Generator().manual_seed(groups)
        xbc = torch.randn(length, batch, heads * headdim + 2 * gn, generator=gen)
        dt = torch.randn(length, batch, heads, generator=gen)
        mine = cp_chunk_indices(length // cp, cp, rank)  # this rank's load-balanced positions
        got_xbc, got_dt = mcp.to_head_sharded(xbc[mine], dt[mine])
        # Expected: this rank's heads, and its group's B and C, over the whole sequence.
        x, B, C = torch.split(xbc, [heads * headdim, gn, gn], dim=-1)
        per_rank, group_of_rank = heads // cp, rank * groups // cp
        g_width = max(1, groups // cp) * d_state
        want_xbc = torch.cat(
            [
                x[..., rank * per_rank * headdim : (rank + 1) * per_rank * headdim],
                B[..., group_of_rank * d_state :][..., :g_width],
                C[..., group_of_rank * d_state :][..., :g_width],
            ],
            dim=-1,
        )
        assert torch.equal(got_xbc, want_xbc), (groups, rank)
        assert torch.equal(got_dt, dt[..., rank * per_rank : (rank + 1) * per_rank]), groups
        back = mcp.to_sequence_sharded(got_xbc[..., : per_rank * headdim])
        assert torch.equal(back, x[mine]), (groups, rank)
    # Generation keeps whole-sequence states: a Mamba layer refuses it under CP.
    from megatron.core.ssm.mamba_mixer import MambaMixer
    from megatron.core.tensor_parallel.process_groups import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1, hidden_size=32, num_attention_heads=4, context_parallel_size=cp
    )
    config.mamba_state_dim, config.mamba_head_dim, config.mamba_num_groups = 4, 8, 2
    mixer = MambaMixer(config, layer_number=1, pg_collection=ProcessGroupCollection(cp=group))
    with pytest.raises(ValueError, match="generate at --context-parallel-size 1 only"):
        mixer(torch.zeros(4, 1, 32), inference_context=object())


def _world(rank, world_size, tmp):
    _check_cp_layout_change(rank, world_size)
    results = {}
    for name, flags in WORLD_LAYOUTS.items():
        argv = [f.replace("{ckpt}", f"{tmp}/ckpt") for f in HYBRID + flags]
        results[name] = _train_in_process(argv)
    results["megatron-tp2-cp2"] = _train_in_process(_megatron_cp_config(tmp))
    if rank == world_size - 1:  # the rank that logs
        with open(f"{tmp}/layouts.json", "w") as f:
            json.dump(results, f)


def test_tp2_sp_pp2_and_context_parallel_layouts_equal_one_process(reference, tmp_path):
    run_distributed(_world, 4, str(tmp_path))
    results = json.loads((tmp_path / "layouts.json").read_text())
    # Megatron's configuration (bf16, another model) trains and saves its checkpoint.
    megatron = results.pop("megatron-tp2-cp2")
    assert sorted(megatron["loss"]) == ["1", "2", "3"], megatron
    assert all(math.isfinite(v) for v in megatron["loss"].values()), megatron
    saved = (tmp_path / "megatron_ckpt" / "latest_checkpointed_iteration.txt").read_text()
    assert saved.strip() == "3"
    assert set(results) == set(WORLD_LAYOUTS)
    for name, got in results.items():
        got = {k: {int(i): v for i, v in values.items()} for k, values in got.items()}
        assert_same_training(got, reference["received"], range(1, 11))
        worst = {
            k: max(abs(got[k][i] - ref) / abs(ref) for i, ref in reference["received"][k].items())
            for k in got
        }
        print(f"{name}: largest relative deviation {worst}")  # shown with pytest -s
    # The torch format: one file per TP x PP rank, Megatron's names, layers numbered per stage.
    ckpt = tmp_path / "ckpt"
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
    reference = reference["tensorboard"]
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
