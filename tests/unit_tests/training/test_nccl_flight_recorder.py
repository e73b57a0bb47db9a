"""NCCL's flight recorder is configured from Megatron-LM's --flight-recorder-* flags through the
environment variables PyTorch reads, before init_process_group, never over what the user set;
gloo runs keep the collective watch instead. (No GPU here: the variables are what is checked,
and the start-up path with the process-group calls stubbed.)"""

import inspect
import os
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch

from megatron.training import initialize, nccl_flight_recorder
from tests.unit_tests.tiny_configs import tiny_args

NAMES = [name for names in nccl_flight_recorder._NAMES for name in names]


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A clean environment for the variables, HOME in tmp_path and no XDG cache."""
    for name in NAMES + ["XDG_CACHE_HOME"]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _configure(args, backend="nccl", environ=None):
    lines = []
    environ = dict(os.environ) if environ is None else environ
    to_set = nccl_flight_recorder.configure(args, backend, environ, print_fn=lines.append)
    return to_set, environ, lines


def test_defaults_turn_the_recorder_on_and_name_where_it_dumps(home):
    to_set, environ, lines = _configure(tiny_args())
    prefix = str(home / ".cache" / "torch" / "comm_lib_trace_rank_")
    # Without a dump path the other three keep torch's defaults: Megatron-LM sets them only when
    # a dump path is given.
    assert to_set == {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": prefix,
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
    }
    assert all(environ[name] == value for name, value in to_set.items())
    assert (home / ".cache" / "torch").is_dir()  # the writer does not create it
    assert lines == [
        f" > NCCL flight recorder: last 2000 collectives per rank, dumped on a timeout to "
        f"{prefix}<rank> (torchfrtrace {home / '.cache' / 'torch'} -p comm_lib_trace_rank_); "
        "watchdog timeout --distributed-timeout-minutes 10"
    ]


def test_flags_go_to_their_variables(home, tmp_path):
    existing = tmp_path / "fr"
    existing.mkdir()
    flags = [
        "--flight-recorder-trace-buffer-size",
        "64",
        "--no-flight-recorder-dump-on-timeout",
        "--flight-recorder-include-stack-trace",
        "--no-flight-recorder-include-only-active",
        "--no-flight-recorder-extra-dump-on-exec",
        "--distributed-timeout-minutes",
        "3",
    ]
    to_set, _, lines = _configure(tiny_args(*flags, "--flight-recorder-dump-path", existing))
    prefix = str(existing / "_dump_")  # a directory gets Megatron-LM's per-rank prefix
    assert to_set == {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "64",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
        "TORCH_FR_DUMP_TEMP_FILE": prefix,
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
        "TORCH_INCLUDE_STACK_TRACE": "1",
        "TORCH_INCLUDE_ONLY_ACTIVE": "0",
        "TORCH_NCCL_EXTRA_DUMP_ON_EXEC": "0",
    }
    assert "last 64 collectives per rank, dumped never" in lines[0]
    assert lines[0].endswith("--distributed-timeout-minutes 3")
    # A path ending in / is a directory to make; any other path is a file prefix.
    new_dir = str(tmp_path / "new" / "dir") + os.sep
    to_set, _, _ = _configure(tiny_args("--flight-recorder-dump-path", new_dir))
    assert to_set["TORCH_FR_DUMP_TEMP_FILE"] == new_dir + "_dump_"
    assert (tmp_path / "new" / "dir").is_dir()
    prefix = str(tmp_path / "traces" / "job7_rank")
    to_set, _, _ = _configure(tiny_args("--flight-recorder-dump-path", prefix))
    assert to_set["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == prefix
    assert to_set["TORCH_NCCL_EXTRA_DUMP_ON_EXEC"] == "1"  # Megatron-LM's, with a path
    assert (tmp_path / "traces").is_dir() and not (tmp_path / "traces" / "job7_rank").exists()
    # Without a path a given flag is still set (the others keep torch's defaults).
    to_set, _, _ = _configure(tiny_args("--flight-recorder-include-stack-trace"))
    assert to_set["TORCH_INCLUDE_STACK_TRACE"] == "1"
    assert "TORCH_NCCL_EXTRA_DUMP_ON_EXEC" not in to_set
    assert "TORCH_INCLUDE_ONLY_ACTIVE" not in to_set


def test_the_environment_wins(home, tmp_path):
    environ = {
        "HOME": str(home),
        "TORCH_FR_BUFFER_SIZE": "123",  # torch's newer name of the buffer size
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(tmp_path / "user" / "t_"),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
    }
    args = tiny_args(
        "--flight-recorder-dump-path", tmp_path / "flag_", "--flight-recorder-trace-buffer-size", 9
    )
    to_set, environ, lines = _configure(args, environ=environ)
    assert to_set == {
        # the user's prefix under its other name too, so that both say the same
        "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "user" / "t_"),
        "TORCH_INCLUDE_STACK_TRACE": "0",
        "TORCH_INCLUDE_ONLY_ACTIVE": "1",
        "TORCH_NCCL_EXTRA_DUMP_ON_EXEC": "1",
    }
    assert (
        environ["TORCH_FR_BUFFER_SIZE"] == "123" and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in environ
    )
    assert environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"
    assert (
        "last 123 collectives per rank, dumped never to " + str(tmp_path / "user" / "t_")
        in (lines[0])
    )
    assert lines[0].endswith(
        "from the environment: TORCH_FR_BUFFER_SIZE, TORCH_NCCL_DEBUG_INFO_TEMP_FILE, "
        "TORCH_NCCL_DUMP_ON_TIMEOUT"
    )


def test_gloo_sets_nothing_and_notes_given_flags(home):
    to_set, environ, lines = _configure(tiny_args(), backend="gloo")
    assert to_set == {} and lines == [] and not any(name in environ for name in NAMES)
    args = tiny_args(
        "--flight-recorder-trace-buffer-size", "10", "--flight-recorder-dump-path", "x"
    )
    to_set, _, lines = _configure(args, backend="gloo")
    assert to_set == {}
    assert lines == [
        " > --flight-recorder-dump-path, --flight-recorder-trace-buffer-size: NCCL's flight "
        "recorder only; this gloo run names a collective that times out and dumps its last "
        "collectives itself"
    ]


def _start_up(monkeypatch, backend, cuda, **kwargs):
    """initialize._initialize_distributed with the process-group calls recorded: (what
    init_process_group saw of the environment, whether the collective watch was installed).
    The watch is asked for, as pretrain asks, unless ``kwargs`` say otherwise."""
    seen = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(initialize.dist, "is_initialized", lambda: False)

    def init_process_group(backend, world_size, rank, timeout, **kwargs):
        seen["init"] = (backend, timeout, {n: os.environ.get(n) for n in NAMES})

    monkeypatch.setattr(initialize.dist, "init_process_group", init_process_group)
    monkeypatch.setattr(
        initialize.collective_watch, "install", lambda timeout: seen.setdefault("watch", timeout)
    )
    for name in NAMES:
        monkeypatch.setenv(name, "")  # restored after the test: configure() writes os.environ
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "77")
    args = SimpleNamespace(
        distributed_backend=backend,
        local_rank=0,
        world_size=2,
        rank=0,
        distributed_timeout_minutes=7,
    )
    initialize._initialize_distributed(args, **{"watch_collectives": True, **kwargs})
    return seen


def test_start_up_configures_nccl_before_the_process_group_and_watches_gloo(home, monkeypatch):
    seen = _start_up(monkeypatch, "nccl", cuda=True)
    backend, timeout, env = seen["init"]
    assert (backend, timeout) == ("nccl", timedelta(minutes=7))
    assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "77"  # the user's
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"  # set before init_process_group
    assert "watch" not in seen  # NCCL calls return when queued: nothing to time in Python
    seen = _start_up(monkeypatch, "nccl", cuda=False)  # no GPU: gloo, watched
    assert seen["init"][0] == "gloo" and seen["watch"] == timedelta(minutes=7)
    assert seen["init"][2]["TORCH_NCCL_DUMP_ON_TIMEOUT"] == ""


def test_the_collective_watch_is_off_unless_asked_for(home, monkeypatch):
    # Tools, the text-generation server and library callers of initialize_megatron keep
    # torch.distributed's own functions; pretrain passes watch_collectives=True.
    assert _start_up(monkeypatch, "gloo", cuda=False, watch_collectives=False).keys() == {"init"}
    for function in (initialize.initialize_megatron, initialize._initialize_distributed):
        assert inspect.signature(function).parameters["watch_collectives"].default is False
