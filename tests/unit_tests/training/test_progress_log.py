"""progress.txt (--log-progress): where the cumulative throughput starts counting.

Megatron's rule, from its description: the count starts at the first 'Starting job' of the
latest run of jobs with this world size (a job with another world size starts it again), with
the floating-point operations of the last 'Saved checkpoint' line written before that job.
"""

from datetime import datetime

import pytest

from megatron.training.progress_log import start_of_this_world_size

LINES = [
    "2024-01-01 10:00:00\tJob ID: 1\t# GPUs: 8\tStarting job",
    "2024-01-01 11:00:00\tJob ID: 1\t# GPUs: 8\tSaved checkpoint\tIteration: 10\t"
    "Job throughput: 1.0 TFLOP/s/GPU\tCumulative throughput: 1.0 TFLOP/s/GPU\t"
    "Floating-point operations: 1.00e+15\tTokens (in billions): 0.01",
    "2024-01-02 09:00:00\tJob ID: 2\t# GPUs: 4\tStarting job",
    "2024-01-02 10:00:00\tJob ID: 2\t# GPUs: 4\tSaved checkpoint\tIteration: 20\t"
    "Job throughput: 1.0 TFLOP/s/GPU\tCumulative throughput: 1.0 TFLOP/s/GPU\t"
    "Floating-point operations: 2.00e+15\tTokens (in billions): 0.02",
    "2024-01-03 08:00:00\tJob ID: 3\t# GPUs: 8\tStarting job",
    "2024-01-03 09:00:00\tJob ID: 3\t# GPUs: 8\tSaved async checkpoint\tIteration: 30",
    "2024-01-04 08:00:00\tJob ID: 4\t# GPUs: 8\tStarting job",
]


def _write(tmp_path, lines):
    (tmp_path / "progress.txt").write_text("\n".join(lines) + "\n")
    return str(tmp_path)


def test_the_count_restarts_after_a_job_of_another_world_size(tmp_path):
    save = _write(tmp_path, LINES)
    # 8 GPUs: the 4-GPU job broke the run, so job 3 starts it, after 2.00e15 operations.
    assert start_of_this_world_size(save, 8) == (datetime(2024, 1, 3, 8, 0, 0), 2.0e15)
    # 4 GPUs: job 2 was followed by 8-GPU jobs, so no 4-GPU run is current.
    with pytest.raises(ValueError, match="no 'Starting job' line for world size 4"):
        start_of_this_world_size(save, 4)


def test_a_malformed_line_is_named(tmp_path):
    save = _write(tmp_path, LINES[:2] + ["2024-01-02 nonsense"])
    with pytest.raises(ValueError, match=r"progress\.txt line 3 is not a progress line"):
        start_of_this_world_size(save, 8)
