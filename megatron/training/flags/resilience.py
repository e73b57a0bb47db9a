"""Resilience flags: autoresume, in-process restart, the fault injector and NVIDIA's
fault-tolerance package."""

from typing import Optional

from megatron.training.flags.spec import FromEnv, flag, flag_group, switch


@flag_group("autoresume")
class AutoresumeFlags:
    adlr_autoresume: bool = switch("Enable autoresume on the ADLR cluster.")
    adlr_autoresume_interval: int = flag(1000, "Iterations between autoresume checks.")


@flag_group("In-process restart")
class InProcessRestartFlags:
    inprocess_restart: bool = switch("Restart the training function in-process after a fault.")
    inprocess_max_iterations: Optional[int] = flag(
        None, "Restarts allowed at most (None: unlimited)."
    )
    inprocess_monitor_thread_interval: float = flag(1.0, "Seconds between monitor-thread checks.")
    inprocess_monitor_process_interval: float = flag(1.0, "Seconds between monitor-process checks.")
    inprocess_progress_watchdog_interval: float = flag(
        1.0, "Seconds between progress-watchdog timestamps."
    )
    # Megatron's defaults of these five are integers although the flags parse floats.
    inprocess_heartbeat_interval: float = flag(30, "Seconds between heartbeats.")
    inprocess_soft_timeout: float = flag(60, "Seconds without progress before a soft restart.")
    inprocess_hard_timeout: float = flag(90, "Seconds without progress before a hard kill.")
    inprocess_heartbeat_timeout: float = flag(60, "Seconds without a heartbeat before a restart.")
    inprocess_barrier_timeout: float = flag(120, "Timeout of the restart barrier (seconds).")
    inprocess_completion_timeout: float = flag(120, "Timeout of the completion barrier (seconds).")
    inprocess_last_call_wait: float = flag(1, "Seconds to wait for the last ranks to fail.")
    inprocess_termination_grace_time: float = flag(
        1, "Seconds between SIGTERM and SIGKILL of a hung rank."
    )
    inprocess_granularity: str = flag(
        "node", "What is restarted: a node or a single rank.", choices=["node", "rank"]
    )
    inprocess_active_world_size: int = flag(
        FromEnv("WORLD_SIZE", 1), "Ranks that train; the others are spares (default: $WORLD_SIZE)."
    )
    inprocess_empty_cuda_cache: bool = switch("Empty the CUDA cache on restart.")


@flag_group("fault injector")
class FaultInjectorFlags:
    fault_injector_ranks: Optional[str] = flag(None, "Comma-separated ranks that may be faulted.")
    fault_injector_num_ranks: Optional[int] = flag(None, "Ranks faulted at a time.")
    fault_injector_fault_types: Optional[str] = flag(
        None, "Comma-separated kinds of injected faults."
    )
    fault_injector_fault_probabilities: Optional[str] = flag(
        None, "Comma-separated probability of each fault kind."
    )
    fault_injector_fault_delay: Optional[float] = flag(
        None, "Seconds before the fault is injected."
    )
    fault_injector_delay_start_iteration: Optional[int] = flag(
        None, "Iteration after which faults start."
    )
    fault_injector_mtti_seconds: Optional[float] = flag(
        None, "Mean time to interruption (seconds)."
    )
    fault_injector_offset_seconds: Optional[float] = flag(
        None, "Offset of the first fault (seconds)."
    )
    fault_injector_seed: Optional[int] = flag(None, "Seed of the fault injector.")


@flag_group("ft_package")
class FTPackageFlags:
    enable_ft_package: bool = switch("Enable the NVIDIA fault-tolerance package.")
    calc_ft_timeouts: bool = switch("Let the fault-tolerance package compute its timeouts.")
    ft_num_warmup_iters: int = flag(5, "Iterations before the fault-tolerance timeouts apply.")
