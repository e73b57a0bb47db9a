"""Faults injected into real runs (CPU, gloo, 2 processes), each bounded in time: the run ends
with a clear message, and what it saved is complete."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.functional_tests.runner import REPO, TINY_MODEL, env_for_tests

LONG_RUN = TINY_MODEL + ["--train-iters", "10000", "--lr-decay-iters", "100"]


class Launched:
    """torchrun in a session of its own, its output collected by threads while it runs."""

    def __init__(self, args, nproc=2, extra_env=None):
        env = env_for_tests()
        env["PYTHONUNBUFFERED"] = "1"  # lines arrive as they are printed
        env.update(extra_env or {})
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
        cmd += ["--standalone", str(REPO / "pretrain_gpt.py")] + list(args)
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.stdout, self.stderr = [], []
        self._readers = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self.stdout), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, self.stderr), daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(stream, lines):
        for line in stream:
            lines.append(line)

    def output(self):
        return "".join(self.stdout) + "\n--- stderr ---\n" + "".join(self.stderr)

    def wait_for(self, text, timeout=90):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(text in line for line in self.stdout):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.kill()
        raise AssertionError(f"{text!r} never printed\n{self.output()[-4000:]}")

    def finish(self, timeout=90):
        """(return code, seconds it took to end)."""
        start = time.monotonic()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"did not end within {timeout} s\n{self.output()[-4000:]}")
        for reader in self._readers:
            reader.join(10)
        return self.proc.returncode, time.monotonic() - start

    def kill(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


@pytest.mark.parametrize("num_workers", ["0", "2"])
def test_sigterm_to_the_launcher_saves_and_exits(tmp_path, num_workers):
    # Before: with data-loader workers, the run died in 1.3 s with "worker killed by signal:
    # Terminated" and saved nothing.
    ckpt = tmp_path / "ckpt"
    args = list(LONG_RUN)
    args[args.index("--num-workers") + 1] = num_workers
    run = Launched(
        args + ["--exit-signal-handler", "--save", str(ckpt), "--save-interval", "10000"]
    )
    run.wait_for("iteration        3/")
    os.killpg(run.proc.pid, signal.SIGTERM)  # as a scheduler does: the launcher's whole group
    _, seconds = run.finish(timeout=60)
    out = run.output()
    # torchrun itself ends with its own SignalException (exit 1); the workers must exit cleanly.
    assert "exiting program after receiving SIGTERM" in out, out[-4000:]
    assert "ChildFailedError" not in out, out[-4000:]
    for chunk in out.split("Traceback (most recent call last):")[1:]:
        assert "SignalException: Process" in chunk, out[-4000:]
    saved = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert (
        saved >= 3 and (ckpt / f"iter_{saved:07d}" / "mp_rank_00" / "model_optim_rng.pt").exists()
    ), out[-3000:]
