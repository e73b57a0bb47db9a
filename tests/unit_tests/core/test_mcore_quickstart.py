"""Megatron Core's quickstart (Megatron-LM's examples/run_simple_mcore_train_loop.py), its whole
logic written here against megatron-core's public names, in a spawned 2-rank gloo world at TP=2.

Mapped for CPU, and nothing else changed: ``torch.device("cuda")`` -> CPU; the example's
``initialize_distributed`` -> ``torch.cuda.set_device`` dropped and ``init_process_group("nccl")``
replaced by "already initialized" (run_distributed starts each rank with a gloo world);
``destroy_model_parallel()`` and ``initialize_model_parallel(2, 1)`` run as written. The model,
the config, DDP, Adam, the mock dataset and its tokenizer, the schedule, finalize_model_grads
and the checkpoint calls are the example's, keywords included (the config names no TP size and
no RNG tracker; the model is given no groups: they come from parallel_state, as in
megatron-core). Asserted beyond the example: the loss falls, both TP ranks see the same losses,
and the loaded weights are those saved.

In the same world: the module-level ``parallel_state`` getters against the rank grid, at TP=2 and
after ``destroy_model_parallel()`` at PP=2 (with and without virtual stages), and the groups
``get_megatron_optimizer(config, model_chunks)`` takes from it.
"""

import os
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.optim import Adam
from torch.utils.data import DataLoader

from megatron.core import dist_checkpointing, parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.utils import compile_helpers
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import schedules
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.core.tensor_parallel.random import (
    get_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
)
from megatron.core.tokenizers import MegatronTokenizer
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import rng_tracker_of
from tests.unit_tests.dist_utils import run_distributed

_SEQUENCE_LENGTH = 64
device = torch.device("cpu")  # the example's torch.device("cuda")


def initialize_distributed(tensor_model_parallel_size=1, pipeline_model_parallel_size=1):
    parallel_state.destroy_model_parallel()
    # The example's torch.cuda.set_device(LOCAL_RANK) and init_process_group("nccl", ...):
    # run_distributed has already initialized torch.distributed (gloo) with RANK/WORLD_SIZE.
    assert dist.is_initialized()
    assert dist.get_rank() == int(os.environ["RANK"])
    assert dist.get_world_size() == int(os.environ["WORLD_SIZE"])
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size, pipeline_model_parallel_size
    )


def model_provider():
    transformer_config = TransformerConfig(
        num_layers=2,
        hidden_size=12,
        num_attention_heads=4,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
    )
    gpt_model = GPTModel(
        config=transformer_config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=100,
        max_sequence_length=_SEQUENCE_LENGTH,
    )
    return gpt_model


def get_train_data_iterator():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        if torch.distributed.get_rank() == 0:
            compile_helpers()
        torch.distributed.barrier()
    else:
        compile_helpers()

    config = GPTDatasetConfig(
        random_seed=0,
        sequence_length=_SEQUENCE_LENGTH,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        tokenizer=MegatronTokenizer.from_pretrained(
            metdata_path={"library": "null-text"}, vocab_size=_SEQUENCE_LENGTH
        ),
        mid_level_dataset_surplus=0.005,
    )
    datasets = BlendedMegatronDatasetBuilder(
        MockGPTDataset, [1000, None, None], lambda: True, config
    ).build()
    train_dataloader = DataLoader(datasets[0], batch_size=8, shuffle=True)
    train_iterator = iter(train_dataloader)
    return train_iterator


def forward_step_func(data_iterator, model):
    def loss_func(loss_mask, output_tensor):
        losses = output_tensor.float()
        loss_mask = loss_mask.view(-1).float()
        loss = torch.sum(losses.view(-1) * loss_mask) / loss_mask.sum()
        return loss, {"lm loss": loss}

    data = next(data_iterator)
    tokens = data["tokens"].to(device)
    attention_mask = data["attention_mask"].to(device)
    position_ids = data["position_ids"].to(device)
    labels = data["labels"].to(device)
    loss_mask = data["loss_mask"].to(device)
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels)
    return output_tensor, partial(loss_func, loss_mask)


def save_distributed_checkpoint(checkpoint_path, gpt_model):
    model = gpt_model.module if hasattr(gpt_model, "module") else gpt_model
    sharded_state_dict = model.sharded_state_dict(prefix="")
    dist_checkpointing.save(sharded_state_dict=sharded_state_dict, checkpoint_dir=checkpoint_path)


def load_distributed_checkpoint(checkpoint_path, gpt_model):
    model = gpt_model.module if hasattr(gpt_model, "module") else gpt_model
    sharded_state_dict = model.sharded_state_dict(prefix="")
    checkpoint = dist_checkpointing.load(
        sharded_state_dict=sharded_state_dict, checkpoint_dir=checkpoint_path
    )
    model.load_state_dict(checkpoint)
    return gpt_model


# How far the loss must fall over the 5 iterations. The mock documents count 1, 2, 3, ... (mod 64)
# then EOD, so every batch is the same easy task and Adam (lr 1e-3) lowers the loss by a steady
# ~0.015 per step from ln(100) ~ 4.60 (measured: 4.6018, 4.5885, 4.5736, 4.5585, 4.5425). What
# the shuffle changes, which slices of the documents a batch holds, moves the initial model's loss
# by little: over 20 batches std 0.0028, max - min 0.011 (measured). A model that did not learn
# (e.g. an optimizer that stepped no parameter) stays within that spread, far above this margin.
_LOSS_DROP = 0.03


def _quickstart(rank, checkpoint_root):
    """The example's ``__main__``, with the checks interleaved (marked "Checked")."""
    initialize_distributed(tensor_model_parallel_size=2, pipeline_model_parallel_size=1)
    model_parallel_cuda_manual_seed(123)

    gpt_model = model_provider()
    # Checked: the model took TP=2 from parallel_state and its layers' tracker is the one just
    # seeded (megatron-core's layers read get_cuda_rng_tracker()).
    assert gpt_model.config.tensor_model_parallel_size == 2
    assert gpt_model.config.rng_tracker is None
    assert gpt_model.embedding.word_embeddings.weight.shape == (50, 12)
    assert rng_tracker_of(gpt_model.config) is get_cuda_rng_tracker()
    assert "model-parallel-rng" in get_cuda_rng_tracker().get_states()
    gpt_model.to(device)

    config = gpt_model.config
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=False, overlap_grad_reduce=False, use_distributed_optimizer=False
    )
    gpt_model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=gpt_model)

    optim = Adam(gpt_model.parameters())

    train_iterator = get_train_data_iterator()

    forward_backward_func = get_forward_backward_func()
    assert forward_backward_func is schedules.forward_backward_no_pipelining  # Checked

    losses = []
    for iteration in range(5):
        optim.zero_grad()

        losses_reduced = forward_backward_func(
            forward_step_func=forward_step_func,
            data_iterator=train_iterator,
            model=gpt_model,
            num_microbatches=1,
            seq_length=_SEQUENCE_LENGTH,
            micro_batch_size=8,
            decoder_seq_length=_SEQUENCE_LENGTH,
            forward_only=False,
        )

        finalize_model_grads([gpt_model])

        optim.step()

        print(f"Iteration {iteration}: Losses reduced: {losses_reduced}")
        losses.append(losses_reduced[0]["lm loss"].item())

    # Checked: the loss falls (_LOSS_DROP says why this margin must hold).
    assert losses[-1] < losses[0] - _LOSS_DROP, losses
    # Checked: both TP ranks computed the same losses (they read the same batches: the shuffle
    # draws from the CPU generator that model_parallel_cuda_manual_seed seeded on both).
    both = [None, None]
    dist.all_gather_object(both, losses)
    assert both[0] == both[1], both
    # Checked: the weights both TP ranks hold (norms, biases of the row-parallel layers) took the
    # same steps.
    replicated = {
        name: p.detach().clone()
        for name, p in gpt_model.module.named_parameters()
        if not getattr(p, "tensor_model_parallel", False)
    }
    assert any("norm" in name for name in replicated)
    assert len(replicated) < len(list(gpt_model.module.parameters()))  # some are split over TP
    for name, value in replicated.items():
        other = value.clone()
        dist.broadcast(other, src=0)
        assert torch.equal(value, other), name

    # Saving the model (the example uses os.getcwd() + "/ckpt"; here a test directory).
    ckpt_path = str(Path(checkpoint_root) / "ckpt")
    Path(ckpt_path).mkdir(exist_ok=True)
    save_distributed_checkpoint(gpt_model=gpt_model, checkpoint_path=ckpt_path)
    # Checked: the load has to restore every weight: each is moved off its saved value first.
    saved = {k: v.detach().clone() for k, v in gpt_model.module.state_dict().items()}
    with torch.no_grad():
        for param in gpt_model.parameters():
            param.add_(1.0)
    assert not any(
        torch.equal(v, saved[k])
        for k, v in gpt_model.module.state_dict().items()
        if v.is_floating_point()
    )

    # Loading the model
    gpt_model = load_distributed_checkpoint(gpt_model=gpt_model, checkpoint_path=ckpt_path)
    gpt_model.to(device)
    print("Successfully loaded the model")
    loaded = gpt_model.module.state_dict()
    assert loaded.keys() == saved.keys()
    for key, value in saved.items():
        assert torch.equal(loaded[key], value), key
    del gpt_model, optim, train_iterator


def _module_level_getters(rank):
    ps = parallel_state
    assert ps.model_parallel_is_initialized()
    assert ps.get_tensor_model_parallel_world_size() == 2
    assert ps.get_tensor_model_parallel_rank() == rank
    assert ps.get_tensor_model_parallel_src_rank() == 0
    assert ps.get_pipeline_model_parallel_world_size() == 1
    assert ps.is_pipeline_first_stage() and ps.is_pipeline_last_stage()
    assert ps.get_data_parallel_world_size() == 1
    assert ps.get_data_parallel_world_size(with_context_parallel=True) == 1
    assert ps.get_data_parallel_rank() == 0
    assert ps.get_context_parallel_world_size() == 1
    assert ps.get_expert_model_parallel_world_size() == 1
    assert ps.get_expert_data_parallel_world_size() == 1
    assert ps.get_virtual_pipeline_model_parallel_world_size() is None
    assert dist.get_world_size(ps.get_model_parallel_group()) == 2
    assert ps.get_tensor_model_parallel_group() is ps.get_model_parallel_group()
    # get_megatron_optimizer(config, model_chunks): the groups come from parallel_state.
    chunk = torch.nn.Linear(2, 2)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-3), [chunk])
    assert optimizer.model_parallel_group is ps.get_model_parallel_group()
    assert optimizer.tp_rank == rank
    # One distributed-optimizer instance: its DP x CP ranks are the whole DP x CP group.
    assert ps.get_data_parallel_group(
        with_context_parallel=True, partial_data_parallel=True
    ) is ps.get_data_parallel_group(with_context_parallel=True)
    with pytest.raises(ValueError, match="includes context parallelism"):
        ps.get_data_parallel_group(partial_data_parallel=True)

    ps.destroy_model_parallel()
    assert not ps.model_parallel_is_initialized()
    with pytest.raises(RuntimeError, match="not initialized"):
        ps.get_tensor_model_parallel_rank()

    ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    assert ps.get_pipeline_model_parallel_rank() == rank
    assert ps.get_pipeline_model_parallel_first_rank() == 0
    assert ps.get_pipeline_model_parallel_last_rank() == 1
    assert ps.get_pipeline_model_parallel_next_rank() == 1 - rank
    assert ps.get_pipeline_model_parallel_prev_rank() == 1 - rank
    assert ps.is_pipeline_first_stage() == (rank == 0)
    assert ps.is_pipeline_last_stage() == (rank == 1)
    assert ps.is_rank_in_embedding_group()
    assert ps.get_tensor_model_parallel_world_size() == 1
    assert get_forward_backward_func() is schedules.forward_backward_pipelining_without_interleaving
    ps.destroy_model_parallel()

    ps.initialize_model_parallel(
        pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2
    )
    assert get_forward_backward_func() is schedules.forward_backward_pipelining_with_interleaving
    assert ps.get_virtual_pipeline_model_parallel_rank() == 0
    ps.set_virtual_pipeline_model_parallel_rank(1)
    assert ps.get_virtual_pipeline_model_parallel_rank() == 1
    assert ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=1) is False
    assert ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=1) == (rank == 1)
    ps.destroy_model_parallel()


def _world(rank, world_size, checkpoint_root):
    _quickstart(rank, checkpoint_root)
    _module_level_getters(rank)


def test_mcore_quickstart_tp2_loss_falls_and_checkpoint_round_trips(tmp_path):
    run_distributed(_world, 2, str(tmp_path))


def test_schedules_without_pipelining_refuse_adjusted_tensor_shapes():
    for schedule in (
        schedules.forward_backward_no_pipelining,
        schedules.forward_backward_pipelining_with_interleaving,
    ):
        with pytest.raises(ValueError, match="adjust_tensor_shapes_fn is not supported"):
            schedule(
                forward_step_func=forward_step_func,
                data_iterator=None,
                model=None,
                num_microbatches=1,
                adjust_tensor_shapes_fn=lambda recv, send: (recv, send),
            )
