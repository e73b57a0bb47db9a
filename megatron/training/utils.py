"""Small helpers of the training side: rank-aware printing and environment facts.

torch is imported inside the functions so that ``import megatron.training`` stays cheap for
tools that do not train (tools/preprocess_data.py reads the tokenizer flags from here).
"""


def get_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def get_world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def is_last_rank() -> bool:
    return get_rank() == get_world_size() - 1


def print_rank_0(message: str) -> None:
    """Print on global rank 0 only."""
    if get_rank() == 0:
        print(message, flush=True)


def print_rank_last(message: str) -> None:
    """Print on the last global rank only (it holds the last pipeline stage and the loss)."""
    if is_last_rank():
        print(message, flush=True)


def print_datetime(message: str) -> None:
    """Megatron's ``[message] datetime: ...`` line on rank 0, once every rank got there."""
    from datetime import datetime

    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
    print_rank_0(f"[{message}] datetime: {datetime.now().strftime('%Y-%m-%d %H:%M:%S')} ")


def pipeline_schedule_kwargs(args, state) -> dict:
    """The pipeline schedules need the groups; the no-pipelining schedule takes none."""
    return {"pg_collection": state} if args.pipeline_model_parallel_size > 1 else {}
