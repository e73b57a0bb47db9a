"""benchmarks/text_generation_cpu.py runs to the end at tiny sizes and gives transformers' tokens,
so that it cannot rot between the sessions that quote its figures (it once failed to load the
checkpoint it had just converted, and nothing noticed)."""

import subprocess
import sys

from tests.functional_tests.runner import REPO, env_for_tests


def _run(script, *args):
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), *args],
        cwd=REPO,
        env=env_for_tests(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout


def test_text_generation_benchmark_gives_transformers_tokens():
    out = _run(
        "text_generation_cpu.py",
        *"--layers 1 --hidden 32 --heads 2 --vocab 256 --prompt 4 --new 4 --batch 1".split(),
        "--rounds",
        "1",
    )
    verdicts = [line for line in out.splitlines() if "same tokens as transformers:" in line]
    assert len(verdicts) == 3, out
    assert all(line.rstrip().endswith("True)") for line in verdicts), out
