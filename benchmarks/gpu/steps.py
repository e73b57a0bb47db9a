"""The steps of benchmarks/gpu/check.sh, one per call:

    python benchmarks/gpu/steps.py <a|b|c|d|e|f> --mode gpu|cpu --log-dir DIR --limit SECONDS

a  the environment, and the matrix-product rate MFU is measured against (bf16 8192^3 on a GPU)
b  a 2-layer GPT in fp32 with --use-cpu-initialization: the GPU run's losses equal the CPU run's
   (gloo, the same flags, launched at the same time) within 1e-5 at every iteration
c  GPT, BERT, T5 and MoE in bf16 (launched together): losses finite and falling
d  an exception raised in the 3rd iteration's forward ends the job within 30 s, with its traceback
e  GPT-2 large (36 x 1280, 20 heads, seq 1024, micro-batch 32 = global batch, bf16, mock data,
   GPT-2's vocabulary): ms per iteration, TFLOP/s by Megatron's formula, MFU, peak memory
f  the same model in transformers (hf_peer.py), and the ratios ours / transformers

Every run is a real entry point (``torchrun pretrain_*.py``) with its log in DIR; the step
prints one ``RESULT: ...`` line last (the figures of check.sh's table), keeps its figures in
DIR/results.json and exits 0 when it passed. ``--mode cpu`` runs the same steps with tiny
sizes on CPU processes (gloo), so that ``make test`` keeps the script working.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))

import runs  # noqa: E402
from runs import REPO, Launch, Results  # noqa: E402

PARITY_TOLERANCE = 1e-5
CRASH_ITERATION = 3
CRASH_BOUND_S = 30.0
GPT2_LARGE_VOCAB = 50256  # NullTokenizer adds the end-of-document token: GPT-2's 50,257


def rate(tflops: float) -> str:
    """TFLOP/s to read at a glance: one decimal on a GPU, three digits for CPU's small rates."""
    return f"{tflops:.1f}" if tflops >= 10 else f"{tflops:.3g}"


def _flags(**values) -> List[str]:
    """--name value pairs from keyword arguments (True: the flag alone)."""
    out: List[str] = []
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is not None and value is not False:
            out += [flag, str(value)]
    return out


def training_values(
    layers, hidden, heads, seq, micro_batch, global_batch, iterations, lr=1e-3
) -> Dict[str, object]:
    """Shape and schedule of a run (flag name -> value): no dropout, a log line per iteration,
    no evaluation and no checkpoint; the data flags are the caller's."""
    return dict(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        seq_length=seq,
        max_position_embeddings=seq,
        micro_batch_size=micro_batch,
        global_batch_size=global_batch,
        train_iters=iterations,
        lr=lr,
        min_lr=lr / 10,
        lr_decay_style="cosine",
        lr_warmup_iters=1,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        log_interval=1,
        eval_iters=0,
        seed=1234,
    )


def gpt_flags(
    layers, hidden, heads, seq, micro_batch, global_batch, iterations, vocab, lr=1e-3, **extra
) -> List[str]:
    """A GPT on mock data (NullTokenizer with ``vocab`` tokens plus the end-of-document one)."""
    values = training_values(layers, hidden, heads, seq, micro_batch, global_batch, iterations, lr)
    values.update(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=vocab, **extra)
    return _flags(**values)


# Sizes per mode. GPU: what the issue asks; CPU: the smallest runs that still exercise each path.
SIZES = {
    "gpu": {
        "matmul": (8192, 20),
        "parity": dict(layers=2, hidden=256, heads=4, seq=256, micro_batch=4, global_batch=8),
        "parity_iterations": 10,
        "model": dict(layers=4, hidden=256, heads=8, seq=256, micro_batch=4, global_batch=16),
        "model_iterations": 10,
        "crash": dict(layers=2, hidden=256, heads=4, seq=256, micro_batch=4, global_batch=8),
        "gpt2": dict(layers=36, hidden=1280, heads=20, seq=1024, micro_batch=32, global_batch=32),
        "gpt2_iterations": 10,
        "gpt2_vocab": GPT2_LARGE_VOCAB,
    },
    "cpu": {
        "matmul": (256, 5),
        "parity": dict(layers=2, hidden=64, heads=4, seq=32, micro_batch=2, global_batch=4),
        "parity_iterations": 4,
        "model": dict(layers=2, hidden=64, heads=4, seq=32, micro_batch=2, global_batch=8),
        "model_iterations": 6,
        "crash": dict(layers=2, hidden=64, heads=4, seq=32, micro_batch=2, global_batch=4),
        "gpt2": dict(layers=2, hidden=64, heads=4, seq=64, micro_batch=4, global_batch=8),
        "gpt2_iterations": 5,
        "gpt2_vocab": 999,
    },
}


class Step:
    """What a step function gets: its mode, sizes, log directory, deadline and results."""

    def __init__(self, name: str, mode: str, log_dir: Path, limit_s: float):
        self.name, self.mode, self.log_dir = name, mode, Path(log_dir)
        self.sizes = SIZES[mode]
        self.gpu = mode == "gpu"
        # The step's own deadline, before check.sh's `timeout` fires: it kills its runs itself.
        self.deadline = time.monotonic() + max(5.0, limit_s - 8.0)
        self.results = Results(self.log_dir)

    def log(self, name: str) -> Path:
        return self.log_dir / f"{self.name}-{name}.log"

    def device_env(self) -> Dict[str, str]:
        """The environment of a run on this mode's device (no GPU in CPU mode)."""
        return {} if self.gpu else {"CUDA_VISIBLE_DEVICES": ""}


# ----------------------------------------------------------------------------- a: environment
def _driver_version() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 else "unknown"
    except (OSError, subprocess.TimeoutExpired, IndexError):
        return "unknown"


def matmul_tflops(n: int, repeats: int, device, dtype) -> float:
    """Best rate of ``repeats`` timed n x n x n products (after two untimed ones)."""
    import torch

    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = math.inf
    for i in range(repeats + 2):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 2:
            best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 / best / 1e12


def step_a(step: Step) -> Tuple[bool, str, dict]:
    import torch
    import torch.distributed as dist

    problems = []
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for module in ("transformers", "tensorboard", "numpy"):
        try:
            versions[module] = __import__(module).__version__
        except ImportError:
            problems.append(f"{module} missing")
    import megatron.training  # noqa: F401  (the checkout imports with these packages)

    figures = {"versions": versions, "cpus": os.cpu_count()}
    if step.gpu:
        if not torch.cuda.is_available():
            return False, "no CUDA device visible to torch", figures
        device = torch.device("cuda", 0)
        properties = torch.cuda.get_device_properties(device)
        nccl = torch.cuda.nccl.version() if dist.is_nccl_available() else None
        if nccl is None:
            problems.append("NCCL not available")
        figures.update(
            card=properties.name,
            memory_mib=properties.total_memory // 2**20,
            driver=_driver_version(),
            cuda=torch.version.cuda,
            nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
            devices=torch.cuda.device_count(),
        )
        where = (
            f"{properties.name} ({figures['memory_mib']} MiB), driver {figures['driver']}, "
            f"CUDA {torch.version.cuda}, NCCL {figures['nccl']}"
        )
    else:
        device = torch.device("cpu")
        figures.update(card="cpu", memory_mib=0)
        where = f"CPU ({os.cpu_count()} cores)"
    n, repeats = step.sizes["matmul"]
    tflops = matmul_tflops(n, repeats, device, torch.bfloat16)
    figures.update(matmul_n=n, matmul_tflops=tflops)
    summary = (
        f"{where}; torch {torch.__version__}, transformers {versions.get('transformers')}; "
        f"bf16 {n}^3 {rate(tflops)} TFLOP/s"
    )
    if problems:
        return False, summary + "; " + ", ".join(problems), figures
    return True, summary, figures


# ----------------------------------------------------------------------------- b: parity
def parity_flags(step: Step) -> List[str]:
    """Step b's run: a 2-layer GPT in fp32 initialised on the CPU."""
    return gpt_flags(
        **step.sizes["parity"],
        iterations=step.sizes["parity_iterations"],
        vocab=1000,
        lr=3e-4,
        use_cpu_initialization=True,
    )


def step_b(step: Step) -> Tuple[bool, str, dict]:
    iterations = step.sizes["parity_iterations"]
    flags = parity_flags(step)
    launches = {}
    for name, env in (("device", step.device_env()), ("cpu", {"CUDA_VISIBLE_DEVICES": ""})):
        tb = step.log_dir / f"{step.name}-{name}-tensorboard"
        launches[name] = Launch(
            "pretrain_gpt.py", flags + ["--tensorboard-dir", tb], step.log(name), env=env
        )
    codes = runs.wait_all(list(launches.values()), step.deadline)
    for (name, launch), code in zip(launches.items(), codes):
        if code != 0:
            return False, runs.failure_reason(launch, code), {}
    if step.gpu and "NCCL flight recorder" not in launches["device"].text():
        return False, "the device run did not start NCCL (no flight recorder line)", {}
    series = {
        name: runs.tensorboard_scalars(step.log_dir / f"{step.name}-{name}-tensorboard", "lm loss")
        for name in launches
    }
    wanted = list(range(1, iterations + 1))
    if any(sorted(s) != wanted for s in series.values()):
        return False, f"losses of iterations {wanted} not all logged: {series}", {}
    differences = [abs(series["device"][i] - series["cpu"][i]) for i in wanted]
    worst = max(differences)
    figures = {
        "losses_device": series["device"],
        "losses_cpu": series["cpu"],
        "max_abs_difference": worst,
    }
    summary = (
        f"max |loss difference| {worst:.2e} over {iterations} iterations "
        f"(bound {PARITY_TOLERANCE:g}); loss {series['cpu'][1]:.5f} -> "
        f"{series['cpu'][iterations]:.5f}"
    )
    return worst <= PARITY_TOLERANCE, summary, figures


# ----------------------------------------------------------------------------- c: four models
def _sentence_corpus(step: Step) -> str:
    """The shipped corpus, sentence-split and WordPiece-tokenized (BERT and T5 have no mock
    data)."""
    prefix = step.log_dir / "data" / "corpus"
    prefix.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(REPO / "tools" / "preprocess_data.py")]
    cmd += _flags(
        input=REPO / "tests" / "data" / "corpus.jsonl",
        output_prefix=prefix,
        tokenizer_type="BertWordPieceLowerCase",
        vocab_file=REPO / "tests" / "data" / "bert-vocab.txt",
        split_sentences=True,
        workers=2,
    )
    timeout = max(1.0, step.deadline - time.monotonic())
    with open(step.log("data"), "w") as log:
        subprocess.run(
            cmd, env=runs.run_env(), stdout=log, stderr=subprocess.STDOUT, timeout=timeout
        )
    if not Path(f"{prefix}_text_sentence.idx").exists():
        raise RuntimeError(f"preprocess_data.py wrote no {prefix}_text_sentence.idx")
    return f"{prefix}_text_sentence"


def _model_runs(step: Step, corpus: str) -> Dict[str, Tuple[str, List[str]]]:
    """name -> (entry point, flags) of the four bf16 runs."""
    sizes, iterations = step.sizes["model"], step.sizes["model_iterations"]
    gpt = gpt_flags(**sizes, iterations=iterations, vocab=1000, bf16=True)
    moe = gpt + _flags(
        num_experts=4,
        moe_router_topk=2,
        moe_token_dispatcher_type="alltoall",
        moe_aux_loss_coeff=0.01,
    )
    # BERT and T5: the same shape on the sentence corpus, with their WordPiece tokenizer.
    bert = training_values(**sizes, iterations=iterations)
    bert.update(
        bf16=True,
        data_path=corpus,
        vocab_file=REPO / "tests" / "data" / "bert-vocab.txt",
        split="98,2,0",
        data_cache_path=step.log_dir / "data" / "cache",
    )
    t5 = dict(bert)
    del t5["num_layers"], t5["seq_length"]
    t5.update(
        encoder_num_layers=sizes["layers"],
        decoder_num_layers=sizes["layers"],
        encoder_seq_length=sizes["seq"],
        decoder_seq_length=sizes["seq"] // 2,
        vocab_extra_ids=100,
    )
    return {
        "gpt": ("pretrain_gpt.py", gpt),
        "bert": ("pretrain_bert.py", _flags(**bert)),
        "t5": ("pretrain_t5.py", _flags(**t5)),
        "moe": ("pretrain_gpt.py", moe),
    }


def step_c(step: Step) -> Tuple[bool, str, dict]:
    corpus = _sentence_corpus(step)
    iterations = step.sizes["model_iterations"]
    launches = {
        name: Launch(script, flags, step.log(name), env=step.device_env())
        for name, (script, flags) in _model_runs(step, corpus).items()
    }
    codes = runs.wait_all(list(launches.values()), step.deadline)
    figures, parts, ok = {}, [], True
    for (name, launch), code in zip(launches.items(), codes):
        if code != 0:
            return False, runs.failure_reason(launch, code), figures
        series = runs.losses(launch)
        problem = runs.loss_falls(series, iterations)
        figures[name] = series
        if problem:
            ok = False
            parts.append(f"{name}: {problem}")
        else:
            parts.append(f"{name} {series[1]:.3f}->{series[iterations]:.3f}")
    return ok, f"bf16, {iterations} iterations, lm loss: " + ", ".join(parts), figures


# ----------------------------------------------------------------------------- d: a crash
def crash_flags(step: Step) -> List[str]:
    """Step d's run, a user's command line: the default --num-workers (data-loader worker
    processes) included."""
    return gpt_flags(**step.sizes["crash"], iterations=20, vocab=1000, bf16=step.gpu)


def step_d(step: Step) -> Tuple[bool, str, dict]:
    sizes = step.sizes["crash"]
    micro_batches = sizes["global_batch"] // sizes["micro_batch"]
    marker = step.log_dir / f"{step.name}-raised-at.txt"
    marker.unlink(missing_ok=True)
    message = f"gpu-check: injected failure at iteration {CRASH_ITERATION}"
    env = dict(step.device_env())
    env.update(
        PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parent / "inject"), str(REPO)]),
        GPU_CHECK_RAISE_AT_CALL=str((CRASH_ITERATION - 1) * micro_batches + 1),
        GPU_CHECK_RAISED_AT_FILE=str(marker),
        GPU_CHECK_MESSAGE=message,
    )
    launch = Launch("pretrain_gpt.py", crash_flags(step), step.log("run"), env=env)
    while launch.proc.poll() is None and not marker.exists():
        if time.monotonic() > step.deadline:
            launch.kill()
            return False, "the injected exception was never raised", {}
        time.sleep(0.1)
    bound = min(step.deadline, time.monotonic() + CRASH_BOUND_S + 1.0)
    code = launch.wait(bound)
    ended = time.time()
    raised_at = float(marker.read_text() or "nan") if marker.exists() else math.nan
    ended_after = ended - raised_at
    text = launch.text()
    figures = {"seconds_to_end": ended_after, "returncode": code}
    if code is None:
        return False, f"still running {ended_after:.0f} s after the exception (killed)", figures
    if math.isnan(raised_at):
        return False, runs.failure_reason(launch, code), figures
    traceback = "Traceback (most recent call last)" in text and f"RuntimeError: {message}" in text
    summary = (
        f"job ended {ended_after:.1f} s after the exception (bound {CRASH_BOUND_S:g} s), "
        f"exit {code}, traceback {'printed' if traceback else 'MISSING'}"
    )
    return code != 0 and ended_after <= CRASH_BOUND_S and traceback, summary, figures


# ----------------------------------------------------------------------------- e: GPT-2 large
def gpt2_micro_batch(step: Step) -> int:
    """The issue's micro-batch (32), or 16 on a card under 100 GiB, where transformers' run of
    the model (step f) is estimated not to fit at 32; GPU_CHECK_MBS overrides. The global batch
    stays."""
    if os.environ.get("GPU_CHECK_MBS"):
        return int(os.environ["GPU_CHECK_MBS"])
    memory = step.results.step("a").get("memory_mib", 0)
    wanted = step.sizes["gpt2"]["micro_batch"]
    return wanted if not step.gpu or memory >= 100 * 1024 else wanted // 2


def megatron_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """FLOPs of one iteration by Megatron's formula for GPT (forward + backward):
    72 B s l h^2 (1 + s / (6 h) + V / (12 h l))."""
    return (
        72.0
        * batch
        * seq
        * layers
        * hidden**2
        * (1 + seq / (6 * hidden) + vocab / (12 * hidden * layers))
    )


def _padded_vocab(text: str) -> int:
    for line in text.splitlines():
        if "padded vocab" in line and "new size:" in line:
            return int(line.rsplit("new size:", 1)[1].strip(" )"))
    raise ValueError("no 'padded vocab' line in the log")


def gpt2_flags(step: Step, micro_batch: int, tensorboard_dir: Path) -> List[str]:
    """Step e's run: GPT-2 (large on a GPU) in bf16 on mock data, GPT-2's hyper-parameters."""
    return gpt_flags(
        **dict(step.sizes["gpt2"], micro_batch=micro_batch),
        iterations=step.sizes["gpt2_iterations"],
        vocab=step.sizes["gpt2_vocab"],
        lr=2.5e-4,
        bf16=True,
        log_throughput=True,
        log_memory_to_tensorboard=True,
        tensorboard_dir=tensorboard_dir,
        init_method_std=0.02,
        weight_decay=0.1,
        adam_beta2=0.95,
    )


def step_e(step: Step) -> Tuple[bool, str, dict]:
    micro_batch = gpt2_micro_batch(step)
    tb = step.log_dir / f"{step.name}-tensorboard"
    flags = gpt2_flags(step, micro_batch, tb)
    return measure_gpt2(step, flags, tb, micro_batch, step.sizes["gpt2_iterations"])


def measure_gpt2(
    step: Step,
    flags: List[str],
    tb: Path,
    micro_batch: int,
    iterations: int,
    timed_last: int = 0,
    env: Optional[Dict[str, str]] = None,
) -> Tuple[bool, str, dict]:
    """Run pretrain_gpt.py with step e's ``flags`` (``iterations`` of them) and read back ms per
    iteration (median of iterations 3..``timed_last``, default the last), TFLOP/s, MFU against
    step a's rate and peak memory."""
    sizes = dict(step.sizes["gpt2"], micro_batch=micro_batch)
    launch = Launch("pretrain_gpt.py", flags, step.log("run"), env=env or step.device_env())
    code = launch.wait(step.deadline)
    if code != 0:
        return False, runs.failure_reason(launch, code), {}
    text = launch.text()
    metrics = launch.metrics()
    losses = metrics.get("lm loss")
    problem = runs.all_finite(losses, iterations)
    timed_last = timed_last or iterations
    ms = runs.median_ms(metrics.get("elapsed_ms"), 3, timed_last)
    vocab = _padded_vocab(text)
    flops = megatron_flops(
        sizes["global_batch"], sizes["seq"], sizes["layers"], sizes["hidden"], vocab
    )
    tflops = flops / (ms / 1000.0) / 1e12
    ceiling = step.results.step("a").get("matmul_tflops")
    peak = max(runs.tensorboard_scalars(tb, "mem-max-allocated-bytes").values(), default=0.0)
    reserved = max(runs.tensorboard_scalars(tb, "mem-reserved-bytes").values(), default=0.0)
    theoretical = next(
        (
            line.rsplit("total=", 1)[1]
            for line in text.splitlines()
            if line.startswith("Theoretical memory footprints:")
        ),
        "?",
    )
    figures = {
        "micro_batch": sizes["micro_batch"],
        "global_batch": sizes["global_batch"],
        "padded_vocab": vocab,
        "median_ms": ms,
        "elapsed_ms": metrics.get("elapsed_ms"),
        "losses": losses,
        "flops_per_iteration": flops,
        "tflops": tflops,
        "mfu": tflops / ceiling if ceiling else None,
        "peak_allocated_mb": peak / 2**20,
        "peak_reserved_mb": reserved / 2**20,
        "theoretical_total": theoretical,
        "log_tflops": runs.median_ms(metrics.get("tflops_per_gpu"), 3, timed_last)
        if metrics.get("tflops_per_gpu")
        else None,
    }
    mfu = f"{100 * figures['mfu']:.1f} % of step a" if figures["mfu"] else "no ceiling"
    summary = (
        f"micro-batch {sizes['micro_batch']}, global batch {sizes['global_batch']}: "
        f"{ms:.1f} ms/iteration, {rate(tflops)} TFLOP/s ({mfu}), peak allocated "
        f"{figures['peak_allocated_mb']:.0f} MB, reserved {figures['peak_reserved_mb']:.0f} MB "
        f"(theoretical {theoretical})"
    )
    if problem:
        return False, f"{summary}; {problem}", figures
    return True, summary, figures


# ----------------------------------------------------------------------------- f: transformers
def step_f(step: Step) -> Tuple[bool, str, dict]:
    import torch
    from hf_peer import PeerShape, train

    ours = step.results.step("e")
    if not ours.get("median_ms"):
        return False, "no figures from step e to compare with", {}
    sizes = step.sizes["gpt2"]
    shape = PeerShape(
        layers=sizes["layers"],
        hidden=sizes["hidden"],
        heads=sizes["heads"],
        seq=sizes["seq"],
        vocab=step.sizes["gpt2_vocab"] + 1,  # GPT-2's 50,257 (NullTokenizer's V + 1)
        micro_batch=ours["micro_batch"],
        global_batch=ours["global_batch"],
        iterations=step.sizes["gpt2_iterations"],
    )
    device = torch.device("cuda", 0) if step.gpu else torch.device("cpu")
    with open(step.log("run"), "w") as log:

        def note(line):
            print(line, file=log, flush=True)

        peer = train(shape, device, print_fn=note)
    flops = megatron_flops(shape.global_batch, shape.seq, shape.layers, shape.hidden, shape.vocab)
    peer["tflops"] = flops / (peer["median_ms"] / 1000.0) / 1e12
    ratio_time = ours["median_ms"] / peer["median_ms"]
    ratio_memory = ours["peak_allocated_mb"] / peer["peak_allocated_mb"]
    peer.update(time_ratio_ours_over_hf=ratio_time, memory_ratio_ours_over_hf=ratio_memory)
    finite = all(math.isfinite(v) for v in peer["losses"])
    summary = (
        f"transformers {peer['median_ms']:.1f} ms/iteration, {rate(peer['tflops'])} TFLOP/s, peak "
        f"allocated {peer['peak_allocated_mb']:.0f} MB; ours/transformers: time "
        f"{ratio_time:.2f}, peak memory {ratio_memory:.2f}"
    )
    return finite, summary + ("" if finite else "; non-finite loss"), peer


STEPS: Dict[str, Callable[[Step], Tuple[bool, str, dict]]] = {
    "a": step_a,
    "b": step_b,
    "c": step_c,
    "d": step_d,
    "e": step_e,
    "f": step_f,
}


def main(argv=None, table=None, description=None, add_arguments=None, record_as=None) -> int:
    """Run one step of ``table`` (default: check.sh's) and record its figures. A step function
    takes the Step (and, with ``add_arguments``, the parsed options as well); ``record_as(options)``
    names the Step (its logs and its figures' key) when that is not the step's own name."""
    table = table or STEPS
    parser = argparse.ArgumentParser(description=description or __doc__.split("\n\n")[0])
    parser.add_argument("step", choices=sorted(table))
    parser.add_argument("--mode", choices=("gpu", "cpu"), default="gpu")
    parser.add_argument("--log-dir", type=Path, required=True)
    parser.add_argument("--limit", type=float, default=90.0, help="the step's time limit (s)")
    if add_arguments:
        add_arguments(parser)
    options = parser.parse_args(argv)
    options.log_dir.mkdir(parents=True, exist_ok=True)
    runs.kill_all_on_sigterm()
    name = record_as(options) if record_as else options.step
    step = Step(name, options.mode, options.log_dir, options.limit)
    start = time.monotonic()
    try:
        function = table[options.step]
        ok, summary, figures = function(step, options) if add_arguments else function(step)
    except Exception as exc:  # the step's bug or the machine's: the table says which, briefly
        import traceback

        traceback.print_exc()
        ok, summary, figures = False, f"{type(exc).__name__}: {exc}"[:200], {}
    figures = dict(figures, ok=ok, summary=summary, seconds=time.monotonic() - start)
    step.results.write(name, figures)
    print(f"RESULT: {summary}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
