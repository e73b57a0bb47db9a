"""Start-up: arguments, torch.distributed, process groups, seeds, and the training globals."""

from __future__ import annotations

import gc
import logging
import os
import random
import signal
import sys
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from megatron.core.device import collective_device, compute_device, computes_on_cuda
from megatron.core.num_microbatches_calculator import build_num_microbatches_calculator
from megatron.core.parallel_state import (
    DEFAULT_ORDER,
    TP_PP_DP_ORDER,
    forget_model_parallel,
    initialize_model_parallel,
    live_gloo_worker_threads,
)
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.timers import Timers

from . import collective_watch, global_vars, nccl_flight_recorder
from .cpu_allocator import configure_cpu_allocator
from .flag_errors import building
from .frozen_args import freeze_args
from .utils import print_rank_0


def initialize_megatron(
    extra_args_provider=None,
    args_defaults=None,
    ignore_unknown_args=False,
    argv=None,
    parsed_args=None,
    watch_collectives=False,
):
    """Parse and validate flags, start torch.distributed, build groups, seed RNGs, set globals;
    returns the args, read-only from then on (frozen_args.py; the run's progress is its
    TrainState, ``global_vars.get_run().state``).

    ``watch_collectives``: on gloo, watch torch.distributed's collectives so that one that
    times out ends the run with a line naming it (:mod:`.collective_watch`; ``pretrain`` asks
    for it; tools and library callers keep torch.distributed as it is).
    Bad flags end the process with one ``error: ...`` line and exit code 2.
    """
    from .arguments import parse_and_validate_args, print_args

    configure_logging()
    args = (
        parsed_args
        if parsed_args is not None
        else parse_and_validate_args(
            extra_args_provider=extra_args_provider,
            args_defaults=args_defaults or {},
            ignore_unknown_args=ignore_unknown_args,
            argv=argv,
        )
    )
    global_vars.set_args(args)
    print_args("arguments", args)
    note = getattr(args, "no_effect_note", None)
    if note:
        print_rank_0(f" > {note}")
    _apply_process_settings(args)
    check_flags_against_the_machine(args)

    _initialize_distributed(args, watch_collectives=watch_collectives)
    _note_cpu_memory_statistics(args)
    # heap reuse for large CPU tensors; MEGATRON_CPU_MALLOPT=0 skips
    configure_cpu_allocator(compute_device())
    state = initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=getattr(
            args, "virtual_pipeline_model_parallel_size", None
        ),
        context_parallel_size=args.context_parallel_size,
        hierarchical_context_parallel_sizes=getattr(
            args, "hierarchical_context_parallel_sizes", None
        ),
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=getattr(args, "expert_tensor_parallel_size", None),
        order=TP_PP_DP_ORDER if getattr(args, "use_tp_pp_dp_mapping", False) else DEFAULT_ORDER,
        num_distributed_optimizer_instances=getattr(args, "num_distributed_optimizer_instances", 1),
    )
    _set_random_seed(args, state)

    global_vars.set_timers(Timers(args.timing_log_level, args.timing_log_option))
    from .tokenizer import build_tokenizer

    with building("tokenizer", args):  # a vocabulary file that is not one: one error line
        global_vars.set_tokenizer(build_tokenizer(args))
    global_vars.set_num_microbatches_calculator(
        build_num_microbatches_calculator(
            rank=args.rank,
            rampup_batch_size=args.rampup_batch_size,
            global_batch_size=args.global_batch_size,
            micro_batch_size=args.micro_batch_size,
            data_parallel_size=args.data_parallel_size,
            decrease_batch_size_if_needed=getattr(args, "decrease_batch_size_if_needed", False),
        )
    )
    _update_train_iters(args)
    from .writers import build_tensorboard_writer, build_wandb_writer

    global_vars.set_tensorboard_writer(build_tensorboard_writer(args))
    global_vars.set_wandb_writer(build_wandb_writer(args))
    if args.exit_signal_handler:
        global_vars.set_signal_handler(
            DistributedSignalHandler(getattr(args, "exit_signal", signal.SIGTERM))
        )
    # Validated, derived (backend, train_iters, padded_vocab_size) and printed: read-only now.
    args = freeze_args(args, global_vars.get_run().state)
    global_vars.set_args(args)
    return args


def check_flags_against_the_machine(args) -> None:
    """Flags that are valid but need hardware this process lacks: one ``error:`` line and exit
    code 2, as for bad flags (validation itself stays machine-independent, so that the dry run
    validates a GPU command line on a laptop)."""
    if getattr(args, "cuda_graph_impl", "none") == "local" and not torch.cuda.is_available():
        print(
            "error: --cuda-graph-impl local needs CUDA (no GPU is visible here)",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(2)


def configure_logging() -> None:
    """Megatron-LM's processes log through Python's ``logging`` with its default format on
    stderr, ``LEVEL:logger.name:message`` (``WARNING:megatron.core.rerun_state_machine:Result
    validation enabled``), from INFO up: the lines Megatron's own log checks, and its users'
    monitoring, grep for. A process that configured logging itself (a handler on the root
    logger) keeps its configuration."""
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=logging.INFO)
    level = os.environ.get("MEGATRON_LOGGING_LEVEL")
    if level is not None:
        if not level.strip().lstrip("-").isdigit():
            print(f"error: MEGATRON_LOGGING_LEVEL={level!r} is not a number", file=sys.stderr)
            sys.exit(2)
        root.setLevel(int(level))


def _apply_process_settings(args):
    """Flags that set process-wide library state."""
    if getattr(args, "logging_level", None) is not None:  # over MEGATRON_LOGGING_LEVEL
        logging.getLogger().setLevel(args.logging_level)
    if getattr(args, "disable_bf16_reduced_precision_matmul", False):
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False


def _note_cpu_memory_statistics(args):
    """--log-memory-to-tensorboard without CUDA logs the process's memory instead: say so."""
    if getattr(args, "log_memory_to_tensorboard", False) and not computes_on_cuda():
        from .memory_stats import CPU_NOTE

        print_rank_0(f" > {CPU_NOTE}")


def import_torch_dynamo_before_process_groups():
    """Import ``torch._dynamo`` now, before any process group exists.

    Why: the first ``torch.optim`` optimizer imports it lazily, and an import that happens while a
    process group exists keeps that group referenced from C++ for ever (seen with torch 2.13), so
    ``destroy_process_group()`` cannot join gloo's worker threads, and a worker left running at
    interpreter shutdown can abort the process ("terminate called without an active exception").
    """
    try:
        import torch._dynamo  # noqa: F401
    except ImportError:  # a torch build without dynamo cannot import it later either
        pass


def _clear_dtensor_caches():
    """Empty torch's DTensor caches (sharding propagation, redistribution plans): they keep the
    FSDP2 device mesh, and with it its process group, alive after the model is gone."""
    if "torch.distributed.tensor" not in sys.modules:
        return
    try:
        from torch.distributed.tensor import _redistribute
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache

        _clear_sharding_prop_cache()
        _redistribute.clear_redistribute_planner_cache()
        _redistribute._gen_transform_infos.cache_clear()
    except (ImportError, AttributeError):  # another torch release: the caches moved
        pass


def teardown_process_groups() -> int:
    """Destroy every process group so that gloo's worker threads are joined now, not at shutdown.

    Call it once the models, optimizers and iterators of the run are released. Returns the number
    of gloo worker threads still alive afterwards (0 unless something still references a group).
    """
    forget_model_parallel()  # the current parallel state holds every model-parallel group
    gc.collect()  # reference cycles (models with hooks) may still hold groups
    _clear_dtensor_caches()
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
    return live_gloo_worker_threads()


def _initialize_distributed(args, watch_collectives=False):
    """Join the torchrun world: NCCL on GPUs, gloo on CPUs (chosen automatically without a GPU).
    ``watch_collectives``: see :func:`initialize_megatron`.

    A process that has a GPU computes on it (``torch.cuda.set_device`` initialises CUDA, which
    makes it megatron.core.device's compute device) whatever the backend.
    """
    use_cuda = torch.cuda.is_available()
    backend = args.distributed_backend
    if backend == "nccl" and not use_cuda:
        backend = "gloo"
    args.distributed_backend = backend
    if use_cuda:
        local_rank = int(os.getenv("LOCAL_RANK", args.local_rank or 0))
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    if dist.is_initialized():
        return
    if args.world_size == 1 and "MASTER_ADDR" not in os.environ:
        return  # plain `python pretrain_gpt.py`: a single process needs no process group
    import_torch_dynamo_before_process_groups()
    # NCCL's watchdog and flight recorder report a collective that times out (its calls return
    # once queued, so Python cannot time them); on gloo the collective watch does.
    nccl_flight_recorder.configure(
        args, backend, print_fn=lambda line: print(line, flush=True) if args.rank == 0 else None
    )
    dist.init_process_group(
        backend=backend,
        world_size=args.world_size,
        rank=args.rank,
        timeout=timedelta(minutes=args.distributed_timeout_minutes),
        # Binds NCCL to this GPU: its communicator forms now (an error shows at start-up),
        # subgroups are split from it, and barriers know their device. gloo has no use for it.
        device_id=compute_device() if backend == "nccl" else None,
    )
    if backend == "gloo" and watch_collectives:
        collective_watch.install(timedelta(minutes=args.distributed_timeout_minutes))


def _set_random_seed(args, state):
    """Seeds of Megatron: seed + 100*pp_rank (+ 10*dp_rank with --data-parallel-random-init)."""
    seed = args.seed + 100 * state.get_pipeline_model_parallel_rank()
    if getattr(args, "data_parallel_random_init", False):
        seed += 10 * state.get_data_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if computes_on_cuda():
        torch.cuda.manual_seed(seed)
    model_parallel_cuda_manual_seed(
        seed,
        tp_rank=state.get_tensor_model_parallel_rank(),
        ep_rank=state.get_expert_model_parallel_rank(),
        etp_rank=state.get_expert_tensor_parallel_rank(),
    )


def _update_train_iters(args):
    """Derive --train-iters in sample-based training (simulating a batch-size ramp-up if any)."""
    if args.train_iters is not None or args.train_samples is None:
        return
    if args.rampup_batch_size is None:
        args.train_iters = args.train_samples // args.global_batch_size
    else:
        from megatron.core.num_microbatches_calculator import simulate_rampup_train_iters

        args.train_iters = simulate_rampup_train_iters(
            train_samples=args.train_samples,
            global_batch_size=args.global_batch_size,
            micro_batch_size=args.micro_batch_size,
            data_parallel_size=args.data_parallel_size,
            rampup_batch_size=args.rampup_batch_size,
        )
    print_rank_0(f"setting training iterations to {args.train_iters}")


class DistributedSignalHandler:
    """Records a signal (SIGTERM by default) so the loop can save and exit cleanly.

    ``signals_received()`` is a collective: every rank learns whether any rank got the signal.
    """

    def __init__(self, sig=signal.SIGTERM):
        if isinstance(sig, str):
            sig = getattr(signal, sig)
        self.sig = sig
        self._received = False
        self._previous = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self._received = True

    def signals_received(self) -> bool:
        flag = torch.tensor(
            [1 if self._received else 0], dtype=torch.int32, device=collective_device()
        )
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self):
        signal.signal(self.sig, self._previous)
