"""Megatron's per-interval log line, the TensorBoard/W&B scalars and the validation report."""

from __future__ import annotations

import math
from datetime import datetime
from typing import Dict, Optional

import torch

from megatron.core.device import compute_device, computes_on_cuda

from . import global_vars
from .flops import peak_tflops_per_device
from .memory_stats import memory_scalars
from .run import Run
from .utils import print_rank_last

ADVANCED_KEY = "advanced iterations"
SKIPPED_KEY = "skipped iterations"
NAN_KEY = "nan iterations"


def format_log_line(
    *,
    timestamp: str,
    iteration: int,
    train_iters: int,
    consumed_samples: int,
    skipped_samples: int,
    elapsed_ms: float,
    throughput: Optional[float],
    learning_rate: float,
    batch_size: int,
    losses: Dict[str, float],
    loss_scale: float,
    grad_norm: Optional[float],
    num_zeros: Optional[int],
    params_norm: Optional[float],
    skipped_iters: int,
    nan_iters: int,
) -> str:
    """Megatron's line, field for field: each field ends with ' |'."""
    line = f" [{timestamp}]"
    line += " iteration {:8d}/{:8d} |".format(iteration, train_iters)
    line += " consumed samples: {:12d} |".format(consumed_samples)
    if skipped_samples > 0:
        line += " skipped samples: {:12d} |".format(skipped_samples)
    line += " elapsed time per iteration (ms): {:.1f} |".format(elapsed_ms)
    if throughput is not None:
        line += " throughput per GPU (TFLOP/s/GPU): {:.1f} |".format(throughput)
    line += " learning rate: {:.6E} |".format(learning_rate)
    line += " global batch size: {:5d} |".format(batch_size)
    for key, value in losses.items():
        line += " {}: {:.6E} |".format(key, value)
    line += " loss scale: {:.1f} |".format(loss_scale)
    if grad_norm is not None:
        line += " grad norm: {:.3f} |".format(grad_norm)
    if num_zeros is not None:
        line += " num zeros: {} |".format(num_zeros)
    if params_norm is not None:
        line += " params norm: {:.3f} |".format(params_norm)
    line += " number of skipped iterations: {:3d} |".format(skipped_iters)
    line += " number of nan iterations: {:3d} |".format(nan_iters)
    return line


def _scalar(value) -> float:
    return value.item() if torch.is_tensor(value) else float(value)


def _as_float64(value) -> torch.Tensor:
    """A loss value as a 0-d float64 tensor, where it is: a device tensor stays on the device.
    The sums over a log interval are then those of the Python floats they were summed as before,
    without reading each value on the host (which waits for the device) every iteration."""
    if torch.is_tensor(value):
        return value.detach().reshape(()).double()
    return torch.tensor(float(value), dtype=torch.float64, device="cpu")  # host: a Python number


def training_log(
    loss_dict,
    total_loss_dict,
    learning_rate,
    iteration,
    loss_scale,
    report_memory_flag,
    skipped_iter,
    grad_norm,
    params_norm,
    num_zeros_in_grad,
    *,
    run: Run,
) -> bool:
    """Accumulate this iteration's losses; every --log-interval print the line and reset.
    ``run`` gives the flags, progress, timers and writers.

    Returns the updated ``report_memory_flag`` (the CUDA memory line is printed once).
    """
    args, state, timers = run.args, run.state, run.timers
    writer, wandb_writer = run.tensorboard, run.wandb

    total_loss_dict[ADVANCED_KEY] = total_loss_dict.get(ADVANCED_KEY, 0) + (
        0 if skipped_iter else 1
    )
    total_loss_dict[SKIPPED_KEY] = total_loss_dict.get(SKIPPED_KEY, 0) + skipped_iter
    values = {key: _as_float64(value) for key, value in loss_dict.items()}
    if not skipped_iter:
        for key, value in values.items():
            total_loss_dict[key] = total_loss_dict.get(key, 0.0) + value
    got_nan = 0
    if values:  # counted on the device; read when the line is printed
        device = next(iter(values.values())).device
        flags = [~torch.isfinite(value).to(device) for value in values.values()]
        got_nan = torch.stack(flags).any().int()
    total_loss_dict[NAN_KEY] = total_loss_dict.get(NAN_KEY, 0) + got_nan

    batch_size = args.micro_batch_size * args.data_parallel_size * run.num_microbatches
    samples = state.consumed_train_samples
    timers_to_log = [
        "forward-backward",
        "forward-compute",
        "backward-compute",
        "batch-generator",
        "forward-recv",
        "forward-send",
        "backward-recv",
        "backward-send",
        "forward-send-forward-recv",
        "forward-send-backward-recv",
        "backward-send-forward-recv",
        "backward-send-backward-recv",
        "forward-backward-send-forward-backward-recv",
        "layernorm-grads-all-reduce",
        "embedding-grads-all-reduce",
        "all-grads-sync",
        "params-all-gather",
        "optimizer-copy-to-main-grad",
        "optimizer-unscale-and-check-inf",
        "optimizer-clip-main-grad",
        "optimizer-count-zeros",
        "optimizer-inner-step",
        "optimizer-copy-main-to-model-params",
        "optimizer",
    ]

    if iteration % args.tensorboard_log_interval == 0:
        scalars, memory = {}, {}
        if writer is not None or wandb_writer is not None:  # the values are read on the host
            scalars = {
                "learning-rate": learning_rate,
                "batch-size": batch_size,
            }
            for key, value in loss_dict.items():
                scalars[key] = _scalar(value)
            if getattr(args, "log_loss_scale_to_tensorboard", True):
                scalars["loss-scale"] = loss_scale
            if getattr(args, "log_world_size_to_tensorboard", False):
                scalars["world-size"] = args.world_size
            if grad_norm is not None:
                scalars["grad-norm"] = grad_norm
            if num_zeros_in_grad is not None:
                scalars["num-zeros"] = num_zeros_in_grad
            if params_norm is not None:
                scalars["params-norm"] = params_norm
            memory = memory_scalars(compute_device()) if args.log_memory_to_tensorboard else {}
            scalars.update(memory)
        if writer is not None:
            for name, value in scalars.items():
                writer.add_scalar(name, value, iteration)
                if name not in ("world-size", "num-zeros") and name not in memory:
                    writer.add_scalar(f"{name} vs samples", value, samples)
            if state.skipped_train_samples:
                writer.add_scalar("skipped-train-samples", state.skipped_train_samples, iteration)
        if getattr(args, "log_timers_to_tensorboard", False) and args.tensorboard_dir:
            # A gather over every rank: all ranks call it, only the one with the writer writes
            # (called on the writer's rank alone, it waited for ever for the others).
            timers.write(timers_to_log, writer, iteration, normalizer=1.0)
        if wandb_writer is not None:
            wandb_writer.log({**scalars, "samples": samples}, iteration)

    if iteration % args.log_interval != 0:
        return report_memory_flag

    elapsed = timers("interval-time").elapsed(barrier=True)
    total_iterations = total_loss_dict[ADVANCED_KEY] + total_loss_dict[SKIPPED_KEY]
    elapsed_per_iteration = elapsed / max(1, total_iterations)
    if writer is not None and getattr(args, "log_timers_to_tensorboard", False):
        writer.add_scalar("iteration-time", elapsed_per_iteration, iteration)
    if wandb_writer is not None:
        wandb_writer.log({"iteration-time": elapsed_per_iteration}, iteration)
    advanced = max(1, total_loss_dict[ADVANCED_KEY])
    losses = {}
    for key, value in total_loss_dict.items():
        if key in (ADVANCED_KEY, SKIPPED_KEY, NAN_KEY):
            continue
        avg = _scalar(value) / float(advanced)
        if avg > 0.0:
            losses[key] = avg
    throughput = None
    if getattr(args, "log_throughput", False):
        throughput = _log_throughput(
            args,
            run.model_family,
            batch_size,
            elapsed_per_iteration,
            iteration,
            writer,
            wandb_writer,
        )
    line = format_log_line(
        timestamp=datetime.now().strftime("%Y-%m-%d %H:%M:%S"),
        iteration=iteration,
        train_iters=args.train_iters,
        consumed_samples=state.consumed_train_samples,
        skipped_samples=state.skipped_train_samples,
        elapsed_ms=elapsed_per_iteration * 1000.0,
        throughput=throughput,
        learning_rate=learning_rate,
        batch_size=batch_size,
        losses=losses,
        loss_scale=loss_scale,
        grad_norm=grad_norm,
        num_zeros=num_zeros_in_grad,
        params_norm=params_norm,
        skipped_iters=total_loss_dict[SKIPPED_KEY],
        nan_iters=int(total_loss_dict[NAN_KEY]),
    )
    print_rank_last(line)
    if throughput is not None:
        tokens_per_sec = batch_size * args.seq_length / max(elapsed_per_iteration, 1e-12)
        peak = peak_tflops_per_device()
        extra = (
            f" tokens per second: {tokens_per_sec:.1f} | tokens per second per GPU: "
            f"{tokens_per_sec / args.world_size:.1f} |"
        )
        if peak:
            extra += f" MFU: {100.0 * throughput / peak:.1f}% of {peak:g} TFLOP/s |"
        print_rank_last(extra)
    for key in list(total_loss_dict):
        total_loss_dict[key] = 0 if key in (ADVANCED_KEY, SKIPPED_KEY, NAN_KEY) else 0.0
    if report_memory_flag and computes_on_cuda():
        report_memory(f"(after {iteration} iterations)", run.parallel_state)
        report_memory_flag = False
    timers.log(timers_to_log, normalizer=args.log_interval)
    return report_memory_flag


def _log_throughput(
    args, family, batch_size, elapsed_per_iteration, iteration, writer, wandb_writer
) -> float:
    """TFLOP/s per GPU with the family's FLOP count (Megatron's for GPT); also tokens/s and MFU
    to TensorBoard / W&B."""
    flops = family.num_floating_point_operations(args, batch_size)
    tflops_per_gpu = flops / (max(elapsed_per_iteration, 1e-12) * 1e12 * args.world_size)
    tokens_per_sec = batch_size * args.seq_length / max(elapsed_per_iteration, 1e-12)
    scalars = {"throughput": tflops_per_gpu, "tokens-per-sec": tokens_per_sec}
    peak = peak_tflops_per_device()
    if peak:
        scalars["mfu"] = tflops_per_gpu / peak
    if writer is not None:
        for name, value in scalars.items():
            writer.add_scalar(name, value, iteration)
    if wandb_writer is not None:
        wandb_writer.log(scalars, iteration)
    return tflops_per_gpu


def report_memory(name: str, state=None) -> None:
    """Megatron's CUDA memory line, printed by data-parallel rank 0 of each model-parallel rank
    (``state``: the process groups, default the current run's)."""
    state = state if state is not None else global_vars.get_parallel_state()
    if state.get_data_parallel_rank() != 0:
        return
    mb = 1024.0 * 1024.0
    line = (
        "[Rank {}] {} memory (MB) | allocated: {:.2f} | max allocated: {:.2f} | reserved: {:.2f} | "
        "max reserved: {:.2f}".format(
            state.rank,
            name,
            torch.cuda.memory_allocated() / mb,
            torch.cuda.max_memory_allocated() / mb,
            torch.cuda.memory_reserved() / mb,
            torch.cuda.max_memory_reserved() / mb,
        )
    )
    print(line, flush=True)


def print_evaluation(
    prefix: str,
    total_loss_dict: Dict[str, float],
    iteration: int,
    samples: int,
    test: bool = False,
    *,
    run: Run,
) -> str:
    """Megatron's validation/test block; also writes the scalars to ``run``'s TensorBoard and
    W&B writers."""
    args, writer, wandb_writer = run.args, run.tensorboard, run.wandb
    string = f" validation loss at {prefix} | "
    label = "test" if test else "validation"
    scalars = {}
    for key, value in total_loss_dict.items():
        string += "{} value: {:.6E} | ".format(key, value)
        ppl = math.exp(min(20.0, value))
        string += "{} PPL: {:.6E} | ".format(key, ppl)
        scalars[f"{key} {label}"] = value
        if getattr(args, "log_validation_ppl_to_tensorboard", False):
            scalars[f"{key} {label} ppl"] = ppl
    if writer is not None:
        for name, value in scalars.items():
            writer.add_scalar(name, value, iteration)
            writer.add_scalar(f"{name} vs samples", value, samples)
    if wandb_writer is not None:
        wandb_writer.log(scalars, iteration)
    length = len(string) + 1
    print_rank_last("-" * length)
    print_rank_last(string)
    print_rank_last("-" * length)
    return string
