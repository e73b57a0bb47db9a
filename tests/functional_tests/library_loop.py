"""A GPT training loop written as a library user writes one: only megatron-core's public API
(``megatron.core``), never ``megatron.training``.

It trains at any TP x PP that divides the world, with the distributed optimizer, on mock data,
in fp32. torch.distributed must be initialized already (any backend; the device is the CPU for
gloo, the local GPU for NCCL). ``train(hp)`` returns the 'lm loss' of every iteration on the last
pipeline stage (averaged over micro-batches and data-parallel ranks, per token), None elsewhere.

The values it sets by hand are those ``pretrain_gpt.py`` derives from its flags (see
``Hyperparameters``); tests/functional_tests/test_library_loop.py checks that both give the same
losses. What pretrain does that a user must repeat: the seeds (seed + 100 x pipeline rank for the
default generator and the tensor-parallel streams), the config fields Megatron's argument
parser derives (``add_qkv_bias`` from the biases, the fusions, ``deallocate_pipeline_outputs``),
``init_seed`` (this project's layout-independent initialization: every layout builds the weights
of the one-process model; pretrain sets it to --seed), the padded vocabulary, the data order (each
data-parallel rank takes its micro-batch-sized slice of consecutive samples) and the
learning-rate schedule in samples.
"""

import dataclasses
from functools import partial
from typing import List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.core.tensor_parallel.random import (
    get_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
)
from megatron.core.tokenizers import MegatronTokenizer
from megatron.core.transformer.transformer_config import TransformerConfig


@dataclasses.dataclass
class Hyperparameters:
    """What the flags of one pretrain_gpt.py run say (its command line: ``as_flags``)."""

    tensor_model_parallel_size: int = 2
    pipeline_model_parallel_size: int = 2
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    seq_length: int = 32
    vocab_size: int = 500
    micro_batch_size: int = 2
    global_batch_size: int = 8
    train_iters: int = 10
    lr: float = 5e-3
    min_lr: float = 5e-4
    lr_warmup_iters: int = 2
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    dropout: float = 0.1
    seed: int = 1234

    def as_flags(self) -> List[str]:
        """The pretrain_gpt.py command line of the same run (mock data, the null tokenizer)."""
        return [
            *("--tensor-model-parallel-size", str(self.tensor_model_parallel_size)),
            *("--pipeline-model-parallel-size", str(self.pipeline_model_parallel_size)),
            "--use-distributed-optimizer",
            *("--num-layers", str(self.num_layers)),
            *("--hidden-size", str(self.hidden_size)),
            *("--num-attention-heads", str(self.num_attention_heads)),
            *("--seq-length", str(self.seq_length)),
            *("--max-position-embeddings", str(self.seq_length)),
            *("--micro-batch-size", str(self.micro_batch_size)),
            *("--global-batch-size", str(self.global_batch_size)),
            *("--train-iters", str(self.train_iters)),
            *("--lr", str(self.lr)),
            *("--min-lr", str(self.min_lr)),
            *("--lr-decay-style", "cosine"),
            *("--lr-warmup-iters", str(self.lr_warmup_iters)),
            *("--weight-decay", str(self.weight_decay)),
            *("--clip-grad", str(self.clip_grad)),
            *("--hidden-dropout", str(self.dropout)),
            *("--attention-dropout", str(self.dropout)),
            *("--seed", str(self.seed)),
            "--mock-data",
            *("--tokenizer-type", "NullTokenizer"),
            *("--vocab-size", str(self.vocab_size)),
            *("--num-workers", "0"),
            *("--log-interval", "1"),
            *("--eval-iters", "0"),
        ]


def padded_vocab_size(vocab_size: int, tp_size: int, divisible_by: int = 128) -> int:
    """Megatron pads the vocabulary to a multiple of 128 x TP (--make-vocab-size-divisible-by)."""
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


def model_provider(hp: Hyperparameters, vocab_size: int) -> GPTModel:
    config = TransformerConfig(
        num_layers=hp.num_layers,
        hidden_size=hp.hidden_size,
        num_attention_heads=hp.num_attention_heads,
        hidden_dropout=hp.dropout,
        attention_dropout=hp.dropout,
        tensor_model_parallel_size=hp.tensor_model_parallel_size,
        pipeline_model_parallel_size=hp.pipeline_model_parallel_size,
        pipeline_dtype=torch.float32,
        # What Megatron's argument parser makes of the defaults of pretrain_gpt.py.
        add_qkv_bias=True,
        attention_softmax_in_fp32=False,
        activation_func=F.gelu,
        bias_activation_fusion=True,
        masked_softmax_fusion=True,
        bias_dropout_fusion=True,
        deallocate_pipeline_outputs=True,
        # This project's layout-independent initialization (pretrain sets it to --seed).
        init_seed=hp.seed,
        rng_tracker=get_cuda_rng_tracker(),
    )
    state = parallel_state
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=vocab_size,
        max_sequence_length=hp.seq_length,
        pre_process=state.is_pipeline_first_stage(),
        post_process=state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=True,
        pg_collection=parallel_state.current_parallel_state(),
    )


def build_train_dataset(hp: Hyperparameters, tokenizer) -> MockGPTDataset:
    """The mock training split. Every rank builds it before training: the builder waits at
    barriers for the others (inside the pipeline schedule that would deadlock)."""
    config = GPTDatasetConfig(
        random_seed=hp.seed,
        sequence_length=hp.seq_length,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    num_samples = [hp.train_iters * hp.global_batch_size, 0, 0]
    train_ds, _, _ = BlendedMegatronDatasetBuilder(
        MockGPTDataset, num_samples, lambda: True, config
    ).build()
    return train_ds


def train_data_iterator(hp: Hyperparameters, train_ds):
    """This data-parallel rank's micro-batches, in Megatron's order: of each block of
    micro_batch_size x DP consecutive samples, DP rank r takes the r-th slice."""
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    block = hp.micro_batch_size * dp_size
    for start in range(0, len(train_ds) - block + 1, block):
        first = start + dp_rank * hp.micro_batch_size
        samples = [train_ds[i] for i in range(first, first + hp.micro_batch_size)]
        yield torch.utils.data.default_collate(samples)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Summed masked loss and its token count: the schedule divides one by the other."""
    losses = output_tensor.float().view(-1)
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.stack([loss.clone().detach(), loss_mask.sum()])}


def forward_step_func(device, data_iterator, model):
    batch = next(data_iterator)
    tokens = batch["tokens"].to(device)
    labels = batch["labels"].to(device)
    position_ids = batch["position_ids"].to(device)
    output_tensor = model(tokens, position_ids, None, labels=labels)
    return output_tensor, partial(loss_func, batch["loss_mask"].to(device))


def train(hp: Hyperparameters, device: torch.device) -> Optional[List[float]]:
    parallel_state.initialize_model_parallel(
        hp.tensor_model_parallel_size, hp.pipeline_model_parallel_size
    )
    # Megatron's seeds: the pipeline stages draw their dropout from different streams.
    seed = hp.seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)

    tokenizer = MegatronTokenizer.from_pretrained(
        metadata_path={"library": "null-text"}, vocab_size=hp.vocab_size
    )
    vocab_size = padded_vocab_size(tokenizer.vocab_size, hp.tensor_model_parallel_size)
    model = model_provider(hp, vocab_size).to(device)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True)
    model = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=hp.lr,
            min_lr=hp.min_lr,
            weight_decay=hp.weight_decay,
            clip_grad=hp.clip_grad,
            use_distributed_optimizer=True,
        ),
        [model],
    )
    # The schedule counts samples.
    samples_per_iter = hp.global_batch_size
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=hp.lr,
        min_lr=hp.min_lr,
        lr_warmup_steps=hp.lr_warmup_iters * samples_per_iter,
        lr_decay_steps=hp.train_iters * samples_per_iter,
        lr_decay_style="cosine",
        start_wd=hp.weight_decay,
        end_wd=hp.weight_decay,
        wd_incr_steps=hp.train_iters * samples_per_iter,
        wd_incr_style="constant",
    )

    dp_size = parallel_state.get_data_parallel_world_size()
    num_microbatches = hp.global_batch_size // (hp.micro_batch_size * dp_size)
    data_iterator = train_data_iterator(hp, build_train_dataset(hp, tokenizer))
    forward_backward_func = get_forward_backward_func()
    losses = []
    for _ in range(hp.train_iters):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses_reduced = forward_backward_func(
            forward_step_func=partial(forward_step_func, device),
            data_iterator=data_iterator,
            model=[model],
            num_microbatches=num_microbatches,
            seq_length=hp.seq_length,
            micro_batch_size=hp.micro_batch_size,
            forward_only=False,
        )
        finalize_model_grads([model])
        update_successful, _, _ = optimizer.step()
        if update_successful:
            scheduler.step(increment=samples_per_iter)
        if parallel_state.is_pipeline_last_stage():
            total = torch.stack([x["lm loss"] for x in losses_reduced]).sum(0)
            dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
            losses.append((total[0] / total[1]).item())
    parallel_state.destroy_model_parallel()
    return losses if losses else None
