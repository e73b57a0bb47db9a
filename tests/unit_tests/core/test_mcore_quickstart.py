"""Megatron Core's quickstart (Megatron-LM's examples/run_simple_mcore_train_loop.py), its run-side
logic written here against megatron-core's public names, in a spawned 2-rank gloo world at TP=2.

Mapped for CPU: ``torch.device("cuda")`` -> CPU, NCCL -> gloo (the world comes from
run_distributed). Where our model constructor still differs from megatron-core's (the models
side of issue 32), the model is built as it allows today: the config names its TP size and RNG
tracker and the model is given the current groups (``ProcessGroupCollection.use_mpu_process_groups
()``). Synthetic batches replace the mock dataset (the datasets side of the issue).

In the same world: the module-level ``parallel_state`` getters against the rank grid, at TP=2 and
after ``destroy_model_parallel()`` at PP=2 (with and without virtual stages), and the groups
``get_megatron_optimizer(config, model_chunks)`` takes from it.
"""

from functools import partial

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import schedules
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.core.tensor_parallel import ProcessGroupCollection
from megatron.core.tensor_parallel.random import (
    get_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.dist_utils import run_distributed

_SEQUENCE_LENGTH = 64
_MICRO_BATCH = 8
_VOCAB = 100
device = torch.device("cpu")  # the quickstart's torch.device("cuda")


def model_provider() -> GPTModel:
    transformer_config = TransformerConfig(
        num_layers=2,
        hidden_size=12,
        num_attention_heads=4,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
        tensor_model_parallel_size=2,  # megatron-core reads it from parallel_state
        rng_tracker=get_cuda_rng_tracker(),  # megatron-core's layers read it themselves
    )
    return GPTModel(
        config=transformer_config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=_VOCAB,
        max_sequence_length=_SEQUENCE_LENGTH,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )


def get_train_data_iterator():
    """One fixed batch, again and again (the same on both TP ranks): its loss must fall."""
    generator = torch.Generator(device="cpu").manual_seed(7)
    text = torch.randint(0, _VOCAB, (_MICRO_BATCH, _SEQUENCE_LENGTH + 1), generator=generator)
    batch = {
        "tokens": text[:, :-1].contiguous(),
        "labels": text[:, 1:].contiguous(),
        "loss_mask": torch.ones(_MICRO_BATCH, _SEQUENCE_LENGTH, dtype=torch.float32),
        "attention_mask": torch.tril(
            torch.ones(_SEQUENCE_LENGTH, _SEQUENCE_LENGTH, dtype=torch.bool, device="cpu")
        )
        .logical_not()
        .expand(_MICRO_BATCH, 1, _SEQUENCE_LENGTH, _SEQUENCE_LENGTH),
        "position_ids": torch.arange(_SEQUENCE_LENGTH, device="cpu").expand(_MICRO_BATCH, -1),
    }
    while True:
        yield batch


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


def _quickstart(rank):
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(2, 1)
    model_parallel_cuda_manual_seed(123)

    gpt_model = model_provider()
    gpt_model.to(device)
    config = gpt_model.config
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=False, overlap_grad_reduce=False, use_distributed_optimizer=False
    )
    gpt_model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=gpt_model)
    optim = torch.optim.Adam(gpt_model.parameters())
    train_iterator = get_train_data_iterator()
    forward_backward_func = get_forward_backward_func()
    assert forward_backward_func is schedules.forward_backward_no_pipelining

    losses = []
    for _ in range(5):
        optim.zero_grad()
        losses_reduced = forward_backward_func(
            forward_step_func=forward_step_func,
            data_iterator=train_iterator,
            model=gpt_model,
            num_microbatches=1,
            seq_length=_SEQUENCE_LENGTH,
            micro_batch_size=_MICRO_BATCH,
            decoder_seq_length=_SEQUENCE_LENGTH,
            forward_only=False,
        )
        finalize_model_grads([gpt_model])
        optim.step()
        losses.append(float(losses_reduced[0]["lm loss"]))

    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    # Both TP ranks computed the same loss, and the weights they both hold (norms, biases of the
    # row-parallel layers) took the same steps.
    both = [None, None]
    dist.all_gather_object(both, losses)
    assert both[0] == both[1]
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
    del gpt_model, optim


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
    with pytest.raises(ValueError, match="partial data parallelism"):
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


def _world(rank, world_size):
    _quickstart(rank)
    _module_level_getters(rank)


def test_mcore_quickstart_tp2_loss_falls_and_module_level_parallel_state():
    run_distributed(_world, 2)


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
