"""What the tests share: where the checkout is, and the command lines they give the parser.

Fixtures are in tests/conftest.py (and tests/interop/conftest.py); importable helpers are here,
so that module-level constants and ``parametrize`` lists can use them too.
"""

from pathlib import Path

# The checkout's root, so that no test derives it from how deep its own file sits.
REPO = Path(__file__).resolve().parents[2]
