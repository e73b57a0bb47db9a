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


@pytest.fixture(scope="session")
def bert_corpus(tmp_path_factory):
    """The shipped corpus, sentence-split and WordPiece-tokenized by preprocess_data.py (the
    prefix of its ``_text_sentence`` .bin/.idx pair), as BERT and T5 read it."""
    import subprocess
    import sys

    from tests.functional_tests.runner import REPO, env_for_tests

    out = tmp_path_factory.mktemp("bert_corpus") / "corpus"
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "preprocess_data.py"),
            "--input",
            str(REPO / "tests" / "data" / "corpus.jsonl"),
            "--output-prefix",
            str(out),
            "--tokenizer-type",
            "BertWordPieceLowerCase",
            "--vocab-file",
            str(REPO / "tests" / "data" / "bert-vocab.txt"),
            "--split-sentences",
            "--workers",
            "1",
        ],
        env=env_for_tests(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return f"{out}_text_sentence"
