"""On NCCL, a collective that does not complete in time is found by PyTorch, not by us.

NCCL calls return as soon as they are queued on a CUDA stream, so timing them from Python (what
the collective watch does on gloo) measures nothing. PyTorch's own machinery is used instead:
ProcessGroupNCCL's watchdog thread checks every queued collective against the process group's
timeout (``--distributed-timeout-minutes``, or ``--distributed-timeout-seconds-after-init`` once
set up), and its flight recorder keeps the last collectives of each rank in a ring buffer that is
written to a file per rank when the watchdog sees a timeout; then the process is torn down
(``TORCH_NCCL_ASYNC_ERROR_HANDLING``, torch's default 3), so torchrun ends the job.

Before ``init_process_group`` the flight recorder is configured from Megatron-LM's flags, each
through the environment variable PyTorch reads, and only where the environment does not set that
variable already (the environment wins: Megatron-LM also leaves a variable that is set alone):

==========================================  ============================================  =======
flag                                        variable                                      default
==========================================  ============================================  =======
--flight-recorder-trace-buffer-size         TORCH_NCCL_TRACE_BUFFER_SIZE (TORCH_FR_...)   2000
--no-flight-recorder-dump-on-timeout        TORCH_NCCL_DUMP_ON_TIMEOUT                    1
--flight-recorder-dump-path                 TORCH_FR_DUMP_TEMP_FILE and
                                            TORCH_NCCL_DEBUG_INFO_TEMP_FILE               below
--flight-recorder-include-stack-trace       TORCH_INCLUDE_STACK_TRACE                     0
--no-flight-recorder-include-only-active    TORCH_INCLUDE_ONLY_ACTIVE                     1
--no-flight-recorder-extra-dump-on-exec     TORCH_NCCL_EXTRA_DUMP_ON_EXEC                 1
==========================================  ============================================  =======

The first three are set on every NCCL run: the recorder is then on with a known dump location on
any torch release (2.11's own defaults are the same: 2000 entries, dump on timeout). The last
three follow Megatron-LM, which sets them only when a dump path is given (the flag, or either
prefix variable): without one they are set only when their flag is given, and torch's defaults
apply otherwise (stack traces in the dump, every entry, no dump when an exception takes a process
group down). Those defaults are the values the flags can ask for, so a given flag is never lost.
``TORCH_NCCL_EXTRA_DUMP_ON_EXEC=1`` makes an exception that aborts a process group dump the
recorder on every rank and end them, which is why it waits for a dump path.

The dump path is a file prefix: each rank writes ``<prefix><global rank>``. A directory (one that
exists, or a path ending in ``/``) gets Megatron-LM's prefix ``<dir>/_dump_``. Without the flag
and the variables, torch's own default prefix is named explicitly,
``${XDG_CACHE_HOME:-~/.cache}/torch/comm_lib_trace_rank_``, so that the start-up line can say
where the dumps go whatever the torch release. The prefix's directory is created.
``torchfrtrace <dir> -p <file prefix>`` (PyTorch's analyser) reads the dumps of all ranks.
"""

from __future__ import annotations

import os
from typing import Callable, Dict, List, Mapping, MutableMapping, Optional, Tuple

# Each setting: (variable names PyTorch reads, the first taking precedence; the one set here).
BUFFER = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
DUMP_ON_TIMEOUT = ("TORCH_NCCL_DUMP_ON_TIMEOUT",)
DUMP_PREFIX = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
STACK_TRACE = ("TORCH_INCLUDE_STACK_TRACE",)
ONLY_ACTIVE = ("TORCH_INCLUDE_ONLY_ACTIVE",)
EXTRA_DUMP_ON_EXEC = ("TORCH_NCCL_EXTRA_DUMP_ON_EXEC",)
DIRECTORY_PREFIX = "_dump_"

_FLAG_DESTS = (
    "flight_recorder_dump_path",
    "flight_recorder_trace_buffer_size",
    "flight_recorder_dump_on_timeout",
    "flight_recorder_include_stack_trace",
    "flight_recorder_include_only_active",
    "flight_recorder_extra_dump_on_exec",
)
_FLAG_DEFAULTS = (None, 2000, True, False, True, True)


def _flag(args, dest: str, default):
    return getattr(args, dest, default)


def default_dump_prefix(environ: Mapping[str, str]) -> str:
    """torch's own default prefix (its DebugInfoWriter): the user's cache directory."""
    cache = environ.get("XDG_CACHE_HOME") or os.path.join(environ.get("HOME") or "/tmp", ".cache")
    return os.path.join(cache, "torch", "comm_lib_trace_rank_")


def dump_prefix_of(path: str) -> str:
    """The file prefix of ``--flight-recorder-dump-path``: a directory gets ``<dir>/_dump_``."""
    if path.endswith(os.sep) or os.path.isdir(path):
        return os.path.join(path, DIRECTORY_PREFIX)
    return path


def _first_set(environ: Mapping[str, str], names: Tuple[str, ...]) -> Optional[str]:
    for name in names:
        if environ.get(name):
            return environ[name]
    return None


def flight_recorder_settings(
    args, environ: Mapping[str, str]
) -> Tuple[Dict[str, str], Dict[str, str]]:
    """(variables to set, {setting: value in effect}) for an NCCL run; nothing the environment
    sets is overridden (a setting one of whose names is set is the environment's)."""
    path = _flag(args, "flight_recorder_dump_path", None)
    path_given = bool(path) or _first_set(environ, DUMP_PREFIX) is not None
    wanted = [
        ("buffer", BUFFER, str(_flag(args, "flight_recorder_trace_buffer_size", 2000))),
        ("dump on timeout", DUMP_ON_TIMEOUT, _bit(args, "flight_recorder_dump_on_timeout", True)),
        (
            "dump prefix",
            DUMP_PREFIX,
            dump_prefix_of(path) if path else default_dump_prefix(environ),
        ),
    ]
    # Megatron-LM's: with a dump path (else only a given flag; torch's defaults otherwise).
    for setting, names, dest, default in (
        ("stack traces", STACK_TRACE, "flight_recorder_include_stack_trace", False),
        ("only active", ONLY_ACTIVE, "flight_recorder_include_only_active", True),
        ("extra dump on exception", EXTRA_DUMP_ON_EXEC, "flight_recorder_extra_dump_on_exec", True),
    ):
        if path_given or _flag(args, dest, default) != default:
            wanted.append((setting, names, _bit(args, dest, default)))
    to_set: Dict[str, str] = {}
    effective: Dict[str, str] = {}
    for setting, names, value in wanted:
        given = _first_set(environ, names)
        if given is not None:
            effective[setting] = given
            if names is DUMP_PREFIX:  # one prefix under both names, the environment's
                to_set.update({name: given for name in names if not environ.get(name)})
            continue
        effective[setting] = value
        # The older name of a pair is the one every torch release reads; a prefix goes under both.
        to_set.update({name: value for name in (names if names is DUMP_PREFIX else names[-1:])})
    return to_set, effective


def _bit(args, dest: str, default: bool) -> str:
    return "1" if _flag(args, dest, default) else "0"


def flags_given(args) -> List[str]:
    """The --flight-recorder-* flags given away from their defaults (for the gloo note)."""
    return [
        "--" + dest.replace("_", "-")
        for dest, default in zip(_FLAG_DESTS, _FLAG_DEFAULTS)
        if _flag(args, dest, default) != default
    ]


def configure(
    args,
    backend: str,
    environ: MutableMapping[str, str] = os.environ,
    print_fn: Callable[[str], None] = print,
) -> Dict[str, str]:
    """Set the flight recorder's variables for ``backend`` (before ``init_process_group``) and
    print one line saying where the dumps go; returns the variables set. A gloo run sets nothing:
    its collective watch reports a timeout itself (a given --flight-recorder-* flag is noted)."""
    if backend != "nccl":
        given = flags_given(args)
        if given:
            print_fn(
                f" > {', '.join(given)}: NCCL's flight recorder only; this {backend} run names "
                "a collective that times out and dumps its last collectives itself"
            )
        return {}
    to_set, effective = flight_recorder_settings(args, environ)
    environ.update(to_set)
    prefix = effective["dump prefix"]
    try:
        os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
    except OSError as exc:  # the dump is a diagnosis aid: say so, and train anyway
        print_fn(f" > NCCL flight recorder: cannot create the directory of {prefix!r}: {exc}")
    dump = "on a timeout" if effective["dump on timeout"] not in ("0", "false") else "never"
    kept = sorted({name for names in _NAMES for name in names if environ.get(name)} - set(to_set))
    print_fn(
        f" > NCCL flight recorder: last {effective['buffer']} collectives per rank, dumped {dump} "
        f"to {prefix}<rank> (torchfrtrace {os.path.dirname(prefix) or '.'} -p "
        f"{os.path.basename(prefix)}); watchdog timeout --distributed-timeout-minutes "
        f"{_flag(args, 'distributed_timeout_minutes', 10)}"
        + (f"; from the environment: {', '.join(kept)}" if kept else "")
    )
    return to_set


_NAMES = (BUFFER, DUMP_ON_TIMEOUT, DUMP_PREFIX, STACK_TRACE, ONLY_ACTIVE, EXTRA_DUMP_ON_EXEC)
