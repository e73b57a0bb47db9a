"""Batch samplers that resume exactly from a consumed-samples count.

``MegatronPretrainingSampler`` walks the dataset in order: for each block of
``micro_batch_size * data_parallel_size`` consecutive indices, DP rank r takes the r-th
micro-batch-sized slice. ``MegatronPretrainingRandomSampler`` ("cyclic") splits each epoch into
one contiguous bucket per DP rank and walks a permutation of the bucket seeded by the epoch.
"""

from __future__ import annotations

import signal

import torch

from megatron.core.device import computes_on_cuda


class MegatronPretrainingSampler:
    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        drop_last: bool = True,
    ):
        if total_samples <= 0:
            raise ValueError(f"no samples to consume (dataset has {total_samples})")
        if consumed_samples >= total_samples:
            raise ValueError(
                f"consumed samples ({consumed_samples}) >= dataset size ({total_samples}); "
                "the dataset is exhausted"
            )
        if micro_batch_size <= 0 or not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError("bad micro batch size or data-parallel rank")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.block = micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self):
        return self.total_samples

    def _slice(self, block):
        start = self.data_parallel_rank * self.micro_batch_size
        return block[start : start + self.micro_batch_size]

    def __iter__(self):
        block = []
        for idx in range(self.consumed_samples, self.total_samples):
            block.append(idx)
            if len(block) == self.block:
                yield self._slice(block)
                block = []
        if block and not self.drop_last:
            part = self._slice(block)
            if part:
                yield part


class MegatronPretrainingRandomSampler:
    def __init__(
        self,
        dataset,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        data_sharding: bool = True,
    ):
        if total_samples <= 0:
            raise ValueError(f"no samples to consume (dataset has {total_samples})")
        self.dataset = dataset
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.data_sharding = data_sharding
        self.block = micro_batch_size * data_parallel_size
        self.last_batch_size = total_samples % self.block

    def __len__(self):
        return self.total_samples

    def __iter__(self):
        active_total = self.total_samples - self.last_batch_size
        epoch = self.consumed_samples // active_total
        current_epoch_samples = self.consumed_samples % active_total
        generator = torch.Generator(device="cpu")  # host: sample indices
        generator.manual_seed(epoch)  # Megatron seeds each epoch's permutation with the epoch
        if self.data_sharding:
            bucket_size = (self.total_samples // self.block) * self.micro_batch_size
            bucket_offset = current_epoch_samples // self.data_parallel_size
            start = self.data_parallel_rank * bucket_size
            order = torch.randperm(
                bucket_size, generator=generator, device=generator.device
            ).tolist()
            indices = [start + x for x in order[bucket_offset:]]
        else:
            full = (self.total_samples // self.micro_batch_size) * self.micro_batch_size
            order = torch.randperm(full, generator=generator, device=generator.device).tolist()
            indices = order[self.data_parallel_rank :: self.data_parallel_size][
                current_epoch_samples // self.data_parallel_size :
            ]
        batch = []
        for idx in indices:
            batch.append(idx)
            if len(batch) == self.micro_batch_size:
                self.consumed_samples += self.block
                yield batch
                batch = []


def _leave_signals_to_the_trainer(_worker_id: int) -> None:
    """torchrun forwards SIGTERM to the whole process group: a data-loader worker that died of
    it first made the trainer fail before --exit-signal-handler could save. The trainer alone
    decides; its workers stop when it closes the loader, when it dies (torch's worker loop
    checks its parent every 5 s) or when it fails (failed_run kills them)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.set_wakeup_fd(-1)  # the trainer's SIGINT watchdog reads that pipe, not for a worker


def build_pretraining_data_loader(
    dataset, consumed_samples: int, args, data_parallel_rank: int, data_parallel_size: int
):
    """A DataLoader over ``dataset`` that starts after ``consumed_samples`` samples."""
    if dataset is None or len(dataset) == 0:
        return None
    if args.dataloader_type == "single":
        sampler = MegatronPretrainingSampler(
            len(dataset),
            consumed_samples,
            args.micro_batch_size,
            data_parallel_rank,
            data_parallel_size,
        )
    elif args.dataloader_type == "cyclic":
        sampler = MegatronPretrainingRandomSampler(
            dataset,
            len(dataset),
            consumed_samples,
            args.micro_batch_size,
            data_parallel_rank,
            data_parallel_size,
            data_sharding=getattr(args, "data_sharding", True),  # --no-data-sharding
        )
    else:
        raise ValueError(f"not supported yet: --dataloader-type {args.dataloader_type}")
    # A private generator keeps DataLoader start-up from consuming the global torch RNG, so a
    # resumed run draws exactly the same dropout masks as an uninterrupted one.
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=args.num_workers,
        pin_memory=computes_on_cuda(),  # pinned batches copy to the GPU asynchronously
        persistent_workers=args.num_workers > 0,
        worker_init_fn=_leave_signals_to_the_trainer if args.num_workers > 0 else None,
        generator=torch.Generator(device="cpu"),  # host: the loader's seeds
    )
