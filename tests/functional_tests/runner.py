"""Launch pretrain_gpt.py (through torchrun or a plain process) and read back its results."""

import os
import re
import signal
import subprocess
import sys
import threading
import time

from tests.harness import REPO
from tests.harness.argv import TINY_RUN, megatron_argv

# Megatron's per-iteration log line (printed every --log-interval iterations), written from
# Megatron's format (not from our code).
LOG_LINE = re.compile(
    r"^ \[\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}(?:\.\d+)?\]"
    r" iteration +(?P<iteration>\d+)/ +(?P<train_iters>\d+) \|"
    r" consumed samples: +(?P<consumed>\d+) \|"
    r"(?: skipped samples: +\d+ \|)?"
    r" elapsed time per iteration \(ms\): (?P<elapsed>\d+\.\d) \|"
    r"(?: throughput per GPU \(TFLOP/s/GPU\): \d+\.\d \|)?"
    r" learning rate: (?P<lr>\d\.\d{6}E[+-]\d{2}) \|"
    r" global batch size: +(?P<gbs>\d+) \|"
    r"(?P<losses>(?: [a-z][a-z0-9 _-]*: \d\.\d{6}E[+-]\d{2} \|)*)"
    r" loss scale: (?P<loss_scale>\d+\.\d) \|"
    r"(?: grad norm: (?P<grad_norm>\d+\.\d{3}) \|)?"
    r"(?: num zeros: (?P<num_zeros>\d+) \|)?"
    r"(?: params norm: (?P<params_norm>\d+\.\d{3}) \|)?"
    r" number of skipped iterations: +(?P<skipped>\d+) \|"
    r" number of nan iterations: +(?P<nan>\d+) \|$"
)

# A short training run (the flags are in tests/harness/argv.py); each test adds --train-iters.
TINY_MODEL = megatron_argv(base=TINY_RUN)


def env_for_tests():
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["WANDB_MODE"] = "offline"
    env["HF_HUB_OFFLINE"] = "1"
    return env


def run_pretrain(args, nproc=None, timeout=240, script="pretrain_gpt.py", extra_env=None):
    """Run training; ``nproc=None`` runs a plain single process (no torchrun). ``timeout`` stays
    below pytest-timeout's 300 s so that a hang is reported here, with the run's output."""
    if nproc is None:
        cmd = [sys.executable, str(REPO / script)] + list(args)
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(nproc),
            # A rendezvous on localhost:0: the launcher binds a free port and keeps it, so two
            # runs cannot race for one port (as a port picked here and bound later could).
            "--standalone",
            str(REPO / script),
        ] + list(args)
    env = env_for_tests()
    env.update(extra_env or {})
    # A session of its own, so that killing it never reaches pytest. torchrun starts each worker
    # in yet another session, so killpg alone would orphan them: _stop asks torchrun first
    # (SIGTERM, which it forwards to its workers), then kills whatever is left of its session.
    with subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stdout, stderr = _stop(proc)
            raise AssertionError(
                f"{' '.join(cmd)} did not finish within {timeout} s and was killed (a hang?)\n"
                f"stdout:\n{stdout[-2000:]}\nstderr:\n{stderr[-3000:]}"
            ) from None
        except BaseException:
            # pytest-timeout or ^C: take torchrun's workers down too, or leaving the `with`
            # (which waits for the launcher) would hang.
            _stop(proc)
            raise
    # A leaked process group can abort a rank at exit, intermittently: fail every time instead.
    assert "outlived the process-group teardown" not in stderr, stderr[-3000:]
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


class Launched:
    """torchrun in a session of its own, its output collected by threads while it runs (for
    tests that act on a run while it runs: signals, faults)."""

    def __init__(self, args, nproc=2, extra_env=None, timeout=240):
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
        # A watchdog under pytest-timeout's 300 s: whatever happens, the launcher's group dies.
        self._watchdog = threading.Timer(timeout, self.kill)
        self._watchdog.daemon = True
        self._watchdog.start()

    @staticmethod
    def _read(stream, lines):
        for line in stream:
            lines.append(line)

    def output(self):
        return "".join(self.stdout) + "\n--- stderr ---\n" + "".join(self.stderr)

    def wait_for(self, text, timeout=90, stream="stdout"):
        lines = self.stdout if stream == "stdout" else self.stderr
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(text in line for line in lines):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.kill()
        raise AssertionError(f"{text!r} never printed\n{self.output()[-4000:]}")

    def finish(self, timeout=90):
        """(return code, seconds it took to end); ``ended_at`` is the launcher's end
        (``time.time()``), ``output_closed_at`` the end of its output (see below)."""
        start = time.monotonic()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"did not end within {timeout} s\n{self.output()[-4000:]}")
        self.ended_at = time.time()
        self._watchdog.cancel()
        for reader in self._readers:
            reader.join(10)
        # When every process holding the output pipes (the launcher, the ranks and their
        # children) had ended; None if one still held them 10 s after the launcher ended.
        closed = not any(reader.is_alive() for reader in self._readers)
        self.output_closed_at = time.time() if closed else None
        return self.proc.returncode, time.monotonic() - start

    def kill(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def _stop(proc):
    """SIGTERM to the launcher (torchrun passes it to its workers), SIGKILL after 15 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.communicate()


def parse_log_lines(stdout):
    """{iteration: match groupdict + 'losses' dict} for every log line."""
    result = {}
    for line in stdout.splitlines():
        m = LOG_LINE.match(line)
        if m:
            d = m.groupdict()
            d["losses"] = {
                k.strip(): float(v)
                for k, v in re.findall(r" ([a-z][a-z0-9 _-]*): (\S+) \|", d["losses"])
            }
            result[int(d["iteration"])] = d
    return result


def read_tensorboard_scalars(logdir, tag):
    """{step: value} of one scalar tag from TensorBoard event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)}


def train_metrics(args, nproc, tb_dir):
    """Run training with TensorBoard in ``tb_dir``; returns
    {'loss': {iteration: lm loss}, 'norm': {iteration: grad norm}}."""
    result = run_pretrain(list(args) + ["--tensorboard-dir", str(tb_dir)], nproc=nproc)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return {
        "loss": read_tensorboard_scalars(tb_dir, "lm loss"),
        "norm": read_tensorboard_scalars(tb_dir, "grad-norm"),
    }


def _train_one_after_another(rank, world_size, runs):
    """A rank of :func:`train_in_one_world`: each run of ``runs`` ((argv, directory)) trains
    in this process, its stdout saved as ``directory/stdout.rank<rank>``."""
    import contextlib
    import io

    import torch

    # As the ranks of run_pretrain's torchrun (OMP_NUM_THREADS=1): the tolerances below were
    # measured there.
    torch.set_num_threads(1)
    sys.path.insert(0, str(REPO))
    import pretrain_gpt
    from megatron.training import global_vars

    for argv, directory in runs:
        out = io.StringIO()
        global_vars.reset_globals()
        try:
            with contextlib.redirect_stdout(out):
                pretrain_gpt.pretrain(
                    pretrain_gpt.train_valid_test_datasets_provider,
                    pretrain_gpt.model_provider,
                    pretrain_gpt.ModelType.encoder_or_decoder,
                    pretrain_gpt.forward_step,
                    argv=list(argv),
                )
        finally:
            global_vars.reset_globals()
            with open(os.path.join(directory, f"stdout.rank{rank}"), "w") as f:
                f.write(out.getvalue())


def train_in_one_world(runs, world_size):
    """Train each (argv, directory) of ``runs`` one after another in ONE spawned gloo world of
    ``world_size`` ranks (tests/unit_tests/dist_utils.py) instead of one torchrun each: a rank
    starts (torch, megatron, torch._dynamo: seconds of CPU) once for all of them. Each run's
    TensorBoard events (if its argv names ``directory`` as ``--tensorboard-dir``) and ranks'
    stdout (``stdout.rank<r>``, see :func:`world_stdout`) land in its directory; a failing run
    fails the world with the rank's traceback."""
    from tests.unit_tests.dist_utils import run_distributed

    runs = [(list(argv), str(directory)) for argv, directory in runs]
    for _, directory in runs:
        os.makedirs(directory, exist_ok=True)
    run_distributed(_train_one_after_another, world_size, runs)


def world_stdout(directory):
    """The stdout of every rank of one run of :func:`train_in_one_world`, rank by rank."""
    names = sorted(n for n in os.listdir(directory) if n.startswith("stdout.rank"))
    return "".join(open(os.path.join(directory, n)).read() for n in names)


def train_layouts_in_one_world(base, layouts, world_size, tmp_path):
    """{name: TensorBoard directory} of ``base + layout`` for each layout of ``layouts``
    ({name: extra argv}), all trained in one spawned world (:func:`train_in_one_world`)."""
    dirs = {name: tmp_path / name for name in layouts}
    train_in_one_world(
        [
            (list(base) + extra + ["--tensorboard-dir", str(dirs[name])], dirs[name])
            for name, extra in layouts.items()
        ],
        world_size,
    )
    return dirs


def world_metrics(base, layouts, world_size, tmp_path):
    """{name: train_metrics-like dict} of :func:`train_layouts_in_one_world`."""
    return {
        name: {
            "loss": read_tensorboard_scalars(d, "lm loss"),
            "norm": read_tensorboard_scalars(d, "grad-norm"),
        }
        for name, d in train_layouts_in_one_world(base, layouts, world_size, tmp_path).items()
    }


_ONE_PROCESS_RUNS = {}


def one_process_metrics(args, tmp_path_factory):
    """``train_metrics(args, None, ...)``, run once per pytest session for each distinct
    ``args``: several test modules compare their layouts with the very same one-process run
    (a start costs seconds; the run is deterministic, so sharing it changes no check)."""
    key = tuple(args)
    if key not in _ONE_PROCESS_RUNS:
        _ONE_PROCESS_RUNS[key] = train_metrics(args, None, tmp_path_factory.mktemp("one_process"))
    return {name: dict(values) for name, values in _ONE_PROCESS_RUNS[key].items()}


# A parallel layout sums in another order than one process: float32 round-off, grown over 10
# Adam steps. Measured over every layout these tests run (TP, SP, CP, PP, VPP, uneven PP, DP,
# distributed optimizer, buckets, FSDP2, resumes): at most 1.6e-7 (loss) and 1.6e-6 (grad
# norm, TP2 x PP2 x DP2). A real bug is far above: dropping the all-reduce of the
# sequence-parallel norm gradients moves the first grad norm by 12 %.
LOSS_RTOL = 1e-6
GRAD_NORM_RTOL = 1e-5


def assert_same_training(got, ref, iterations, loss_rtol=LOSS_RTOL, norm_rtol=GRAD_NORM_RTOL):
    """Per iteration, loss and grad norm of ``got`` equal ``ref`` within relative tolerances.
    Adam and clipping hide a wrongly scaled gradient from the loss; the norm does not."""
    assert sorted(got["loss"]) == list(iterations), got
    for it in iterations:
        assert abs(got["loss"][it] - ref["loss"][it]) <= loss_rtol * abs(ref["loss"][it]), (
            it,
            got,
            ref,
        )
        assert abs(got["norm"][it] - ref["norm"][it]) <= norm_rtol * abs(ref["norm"][it]), (
            it,
            got["norm"],
            ref["norm"],
        )
