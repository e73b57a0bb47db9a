"""The interop tests drive megatron-core through ``$MCORE_PYTHON``, a Python of its own
(megatron-core's import name ``megatron`` is ours too); ``make interop`` builds it.

pyproject.toml keeps ``make test`` out of this directory, so these tests run only by name, and
there a missing megatron-core is a failure, never a skip.
"""

import os

import pytest


@pytest.fixture(scope="module", autouse=True)
def _megatron_core_python():
    """The interpreter that has megatron-core; every test here fails without one."""
    python = os.environ.get("MCORE_PYTHON")
    if not python:
        pytest.fail("set MCORE_PYTHON to a Python that has megatron-core (make interop does)")
    return python
