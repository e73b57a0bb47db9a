"""Resilience flags: in-process restart after a failure, and the fault injector that tests it."""

import os

from .builder import ArgGroup


def _add_inprocess_restart_args(parser):
    g = ArgGroup(parser, "In-process restart")
    g.true("--inprocess-restart", "Restart the training function in-process after a fault.")
    g.int("--inprocess-max-iterations", None, "Restarts allowed at most (None: unlimited).")
    g.float("--inprocess-monitor-thread-interval", 1.0, "Seconds between monitor-thread checks.")
    g.float(
        "--inprocess-monitor-process-interval",
        1.0,
        "Seconds between monitor-process checks.",
    )
    g.float(
        "--inprocess-progress-watchdog-interval",
        1.0,
        "Seconds between progress-watchdog timestamps.",
    )
    # Megatron's defaults of these five are integers although the flags parse floats.
    g.float("--inprocess-heartbeat-interval", 30, "Seconds between heartbeats.")
    g.float("--inprocess-soft-timeout", 60, "Seconds without progress before a soft restart.")
    g.float("--inprocess-hard-timeout", 90, "Seconds without progress before a hard kill.")
    g.float("--inprocess-heartbeat-timeout", 60, "Seconds without a heartbeat before a restart.")
    g.float("--inprocess-barrier-timeout", 120, "Timeout of the restart barrier (seconds).")
    g.float("--inprocess-completion-timeout", 120, "Timeout of the completion barrier (seconds).")
    g.float("--inprocess-last-call-wait", 1, "Seconds to wait for the last ranks to fail.")
    g.float(
        "--inprocess-termination-grace-time",
        1,
        "Seconds between SIGTERM and SIGKILL of a hung rank.",
    )
    g.str(
        "--inprocess-granularity",
        "node",
        "What is restarted: a node or a single rank.",
        choices=["node", "rank"],
    )
    g.int(
        "--inprocess-active-world-size",
        int(os.getenv("WORLD_SIZE", "1")),
        "Ranks that train; the others are spares (default: $WORLD_SIZE).",
    )
    g.true("--inprocess-empty-cuda-cache", "Empty the CUDA cache on restart.")
    return parser


def _add_fault_injector_args(parser):
    g = ArgGroup(parser, "fault injector")
    g.str("--fault-injector-ranks", None, "Comma-separated ranks that may be faulted.")
    g.int("--fault-injector-num-ranks", None, "Ranks faulted at a time.")
    g.str("--fault-injector-fault-types", None, "Comma-separated kinds of injected faults.")
    g.str(
        "--fault-injector-fault-probabilities",
        None,
        "Comma-separated probability of each fault kind.",
    )
    g.float("--fault-injector-fault-delay", None, "Seconds before the fault is injected.")
    g.int("--fault-injector-delay-start-iteration", None, "Iteration after which faults start.")
    g.float("--fault-injector-mtti-seconds", None, "Mean time to interruption (seconds).")
    g.float("--fault-injector-offset-seconds", None, "Offset of the first fault (seconds).")
    g.int("--fault-injector-seed", None, "Seed of the fault injector.")
    return parser
