"""benchmarks/gpu/check.sh in its CPU mode: the same steps as on a GPU with tiny sizes, so that
the script a GPU session runs once cannot rot. Every step must pass and the table come last."""

import json
import os
import subprocess

import pytest

from tests.functional_tests.runner import REPO, env_for_tests


@pytest.mark.timeout(600)
def test_gpu_check_passes_every_step_in_cpu_mode(tmp_path):
    env = env_for_tests()
    env["OUT"] = str(tmp_path)
    env.pop("CHECK_MODE", None)
    result = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu" / "check.sh"), "--cpu"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=560,  # the steps' limits add up to 470 s
    )
    table = (tmp_path / "summary.txt").read_text()
    assert result.stdout.rstrip().endswith(table.rstrip()), result.stdout[-3000:]  # printed last
    # Columns: step (4), check (36), result (8), seconds (7), figures.
    rows = {
        line[:4].strip(): line for line in table.splitlines() if line[:4].strip() in set("abcdef")
    }
    assert sorted(rows) == list("abcdef"), table
    failed = {step: row for step, row in rows.items() if row[42:50].strip() != "PASS"}
    assert not failed, table + "\n" + result.stderr[-2000:]
    assert result.returncode == 0, table
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["b"]["max_abs_difference"] == 0.0  # both runs are CPU runs here
    assert results["d"]["seconds_to_end"] <= 30
    assert results["e"]["tflops"] > 0 and results["e"]["peak_allocated_mb"] > 0
    assert results["f"]["time_ratio_ours_over_hf"] > 0
    for step in "abcdef":
        assert os.path.getsize(tmp_path / f"{step}.log") > 0


def test_the_gpu_runs_flags_pass_the_parser_and_validation(tmp_path, capsys, monkeypatch):
    """The flag sets of the GPU mode (its sizes are not run here) through the dry run: the real
    parser, validate_args and each model's checks, as if on one GPU."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks" / "gpu"))
    import steps

    from megatron.training import dry_run

    step = steps.Step("x", "gpu", tmp_path, 90)
    runs = {"b": ("gpt", steps.parity_flags(step)), "d": ("gpt", steps.crash_flags(step))}
    for name, (script, flags) in steps._model_runs(step, str(tmp_path / "corpus")).items():
        runs[f"c-{name}"] = (script[len("pretrain_") : -len(".py")], flags)
    runs["e"] = ("gpt", steps.gpt2_flags(step, 32, tmp_path / "tb"))
    for name, (model, flags) in runs.items():
        code = dry_run.main(["--dry-run-world-size", "1", "--dry-run-model", model] + flags)
        out = capsys.readouterr()
        assert code == 0, f"{name}: {out.err[-2000:]}"
    # GPT-2 large as the issue gives it: 774M parameters, GPT-2's vocabulary padded to 50,304.
    assert "parameters ...................................... 774090240" in out.out
    assert "padded vocab size ............................... 50304" in out.out
