"""Fixtures shared by the test suite. A test asks for one by name (or, for a whole module,
``pytestmark = pytest.mark.usefixtures(...)``); none is autouse, so no test gets one it did
not ask for. Importable helpers (the checkout's root, command lines) are in tests/harness/."""

import pytest


@pytest.fixture(scope="module")
def single_thread():
    """One intra-op thread for a module of tiny tensors: faster, and immune to contention from
    the suite's other processes. Module scope, so that it is set before the module's other
    module-scoped fixtures (references computed once) and restored after them."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def single_process_env(monkeypatch):
    """The launcher's variables of a one-process run, whatever the caller's environment:
    validate_args reads the world size and rank from WORLD_SIZE and RANK, and --local-rank
    defaults to $LOCAL_RANK."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("LOCAL_RANK", raising=False)


@pytest.fixture
def fresh_globals():
    """Megatron's process globals (args, tokenizer, timers, parallel state, ...) empty when the
    test starts and again when it ends, so that no test sees another's run."""
    from megatron.training import global_vars

    global_vars.reset_globals()
    yield
    global_vars.reset_globals()
