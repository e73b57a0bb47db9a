"""The CPU benchmarks of benchmarks/ run to the end at tiny sizes, so that they cannot rot
between the sessions that quote their figures (text_generation_cpu.py once failed to load the
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


def test_cpu_throughput_benchmark_compares_the_three_trainers():
    out = _run(
        "bench_gpt_cpu.py",
        *"--layers 1 --hidden 32 --heads 2 --seq 16 --vocab 256 --micro-batch 2".split(),
        *"--rounds 1 --steps 1".split(),
    )
    rows = {line.split()[0] for line in out.splitlines() if line.strip()}
    assert {"ours", "hf", "plain", "ours/hf", "ours/plain"} <= rows, out
