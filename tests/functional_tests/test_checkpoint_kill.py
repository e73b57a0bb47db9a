"""A training process killed with SIGKILL in the middle of a checkpoint save (both formats).

The child runs ``pretrain_gpt.py`` with a ``sitecustomize`` on its path (test code only) that
wraps one step of the save, so the process kills itself with SIGKILL during the second save
(iteration 4): for ``torch_dist`` after every data file is written and before the directory
is marked complete; for ``torch`` as the shard starts to be written. Afterwards the tracker
still names iteration 2, nothing named iteration 4 looks complete, and a resumed run trains
iterations 3..6 with the straight run's losses.
"""

import os
import textwrap
import time

import pytest

from tests.functional_tests.runner import REPO, TINY_MODEL, read_tensorboard_scalars, run_pretrain

MODEL = list(TINY_MODEL)
del MODEL[MODEL.index("--ckpt-format") : MODEL.index("--ckpt-format") + 2]
BASE = MODEL + ["--hidden-dropout", "0.0", "--attention-dropout", "0.0", "--train-iters", "6"]

KILLER = textwrap.dedent("""
    import os, signal
    import {module} as target
    _real = target.{function}
    _calls = [0]

    def _dies_on_second_save(*args, **kwargs):
        _calls[0] += 1
        if _calls[0] == {nth}:
            os.kill(os.getpid(), signal.SIGKILL)
        return _real(*args, **kwargs)

    target.{function} = _dies_on_second_save
""")


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    tb = tmp_path_factory.mktemp("kill_ref")
    result = run_pretrain(BASE + ["--ckpt-format", "torch", "--tensorboard-dir", str(tb)])
    assert result.returncode == 0, result.stderr[-3000:]
    return read_tensorboard_scalars(tb, "lm loss")


# (format, module and function wrapped, which call belongs to the second save)
CASES = {
    # torch_dist: every data file of iteration 4 is on disk, the directory is not marked complete.
    "torch_dist": ("megatron.core.dist_checkpointing", "write_metadata_json", 2),
    # torch: one torch.save per save here (one process); the second dies before writing
    # model_optim_rng.pt.tmp, so iteration 4's directory exists without a complete shard.
    "torch": ("torch", "save", 2),
    # --async-save: iteration 4's files were written by the background save; the kill comes as
    # the training thread commits it.
    "torch_dist_async": ("megatron.core.dist_checkpointing", "write_metadata_json", 2),
}


@pytest.mark.parametrize("ckpt_format", sorted(CASES))
def test_sigkill_mid_save_keeps_previous_checkpoint(straight, ckpt_format, tmp_path):
    module, function, nth = CASES[ckpt_format]
    hook_dir = tmp_path / "hook"
    hook_dir.mkdir()
    (hook_dir / "sitecustomize.py").write_text(
        KILLER.format(module=module, function=function, nth=nth)
    )
    ckpt = tmp_path / "ckpt"
    asynchronous = ckpt_format.endswith("_async")
    ckpt_format = ckpt_format.removesuffix("_async")
    flags = BASE + ["--ckpt-format", ckpt_format, "--save", str(ckpt), "--save-interval", "2"]
    flags += ["--async-save"] if asynchronous else []

    env = {"PYTHONPATH": os.pathsep.join([str(hook_dir), str(REPO)])}
    killed = run_pretrain(flags, extra_env=env)
    assert killed.returncode == -9, (killed.returncode, killed.stderr[-3000:])
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert (ckpt / "iter_0000002").is_dir()
    complete_4 = (ckpt / "iter_0000004" / "metadata.json").exists() or (
        ckpt / "iter_0000004" / "mp_rank_00" / "model_optim_rng.pt"
    ).exists()
    assert not complete_4
    if ckpt_format == "torch_dist":  # the kill came after iteration 4's data files were written
        assert list(ckpt.glob("iter_0000004*/*.distcp")), sorted(p.name for p in ckpt.iterdir())

    tb = tmp_path / "tb"
    resumed = run_pretrain(flags + ["--load", str(ckpt), "--tensorboard-dir", str(tb)])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    losses = read_tensorboard_scalars(tb, "lm loss")
    assert sorted(losses) == [3, 4, 5, 6]
    for it in losses:
        assert abs(losses[it] - straight[it]) <= 1e-6 * abs(straight[it]), (it, losses, straight)
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "6"


FILLS_DISK = textwrap.dedent("""
    import resource
    import {module} as target
    _real = target.{function}
    _calls = [0]

    def _disk_full_on_second_save(*args, **kwargs):
        _calls[0] += 1
        if _calls[0] == {nth}:  # no file may grow past 64 KiB from now on: a full disk
            resource.setrlimit(resource.RLIMIT_FSIZE, (65536, resource.RLIM_INFINITY))
        return _real(*args, **kwargs)

    target.{function} = _disk_full_on_second_save
""")
# The call that writes the shards of the second save (iteration 4).
FILL_CASES = {
    "torch_dist": ("megatron.core.dist_checkpointing", "save_shards", 2),
    "torch": ("torch", "save", 2),
}


@pytest.mark.faults
@pytest.mark.parametrize("ckpt_format", sorted(FILL_CASES))
def test_full_disk_during_save_fails_clearly_and_keeps_previous(straight, ckpt_format, tmp_path):
    # Before: "unexpected pos 704 vs 598" and a partial iter_0000004.tmp that kept the disk full.
    module, function, nth = FILL_CASES[ckpt_format]
    hook_dir = tmp_path / "hook"
    hook_dir.mkdir()
    (hook_dir / "sitecustomize.py").write_text(
        FILLS_DISK.format(module=module, function=function, nth=nth)
    )
    ckpt = tmp_path / "ckpt"
    flags = BASE + ["--ckpt-format", ckpt_format, "--save", str(ckpt), "--save-interval", "2"]
    env = {"PYTHONPATH": os.pathsep.join([str(hook_dir), str(REPO)])}
    failed = run_pretrain(flags, extra_env=env, timeout=120)
    assert failed.returncode == 1, failed.stderr[-3000:]
    assert "Traceback" not in failed.stderr, failed.stderr[-3000:]
    line = [text for text in failed.stderr.splitlines() if text.startswith("error: ")][-1]
    assert f"cannot write checkpoint {'file ' if ckpt_format == 'torch' else ''}{ckpt}" in line
    assert "the disk is full or a file-size limit was reached" in line, line
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    # Nothing partial of iteration 4 is left holding the space.
    leftovers = [p for p in ckpt.rglob("*") if "0000004" in str(p) and p.is_file()]
    assert leftovers == [], leftovers

    tb = tmp_path / "tb"
    resumed = run_pretrain(flags + ["--load", str(ckpt), "--tensorboard-dir", str(tb)])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    losses = read_tensorboard_scalars(tb, "lm loss")
    assert sorted(losses) == [3, 4, 5, 6]
    for it in losses:
        assert abs(losses[it] - straight[it]) <= 1e-6 * abs(straight[it]), (it, losses, straight)


KILLS_RANK_1 = textwrap.dedent("""
    import os, signal
    import megatron.core.models.gpt.gpt_model as target
    _real = target.GPTModel.forward
    _calls = [0]

    def _killed_mid_iteration_5(self, *args, **kwargs):
        _calls[0] += 1
        if os.environ.get("RANK") == "1" and _calls[0] == 9:  # 2 micro-batches per iteration
            os.kill(os.getpid(), signal.SIGKILL)
        return _real(self, *args, **kwargs)

    target.GPTModel.forward = _killed_mid_iteration_5
""")


@pytest.mark.faults
def test_kill_9_of_one_rank_mid_iteration_ends_the_job_and_resumes(straight, tmp_path):
    hook_dir = tmp_path / "hook"
    hook_dir.mkdir()
    (hook_dir / "sitecustomize.py").write_text(KILLS_RANK_1)
    ckpt = tmp_path / "ckpt"
    flags = BASE + ["--ckpt-format", "torch_dist", "--save", str(ckpt), "--save-interval", "2"]
    env = {"PYTHONPATH": os.pathsep.join([str(hook_dir), str(REPO)])}
    start = time.monotonic()
    killed = run_pretrain(flags, nproc=2, extra_env=env, timeout=120)
    seconds = time.monotonic() - start
    assert killed.returncode != 0, killed.stdout[-2000:]
    # torchrun names the rank that died and how; the job ends instead of waiting for it.
    assert "Signal 9 (SIGKILL) received by PID" in killed.stderr, killed.stderr[-3000:]
    assert "iteration        4/" in killed.stdout and "iteration        5/" not in killed.stdout
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    print(f"kill -9 of rank 1: the job ended after {seconds:.1f} s")

    tb = tmp_path / "tb"
    resumed = run_pretrain(flags + ["--load", str(ckpt), "--tensorboard-dir", str(tb)], nproc=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    losses = read_tensorboard_scalars(tb, "lm loss")
    assert sorted(losses) == [5, 6]
    for it in losses:
        assert abs(losses[it] - straight[it]) <= 1e-6 * abs(straight[it]), (it, losses, straight)
