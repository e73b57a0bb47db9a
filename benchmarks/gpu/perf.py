"""The steps of benchmarks/gpu/perf.sh, one per call:

    python benchmarks/gpu/perf.py <a|o|h|c|report> --mode gpu|cpu --log-dir DIR --limit SECONDS
                                  [--ours optimised|plain] [--variant NAME --switches FLAGS]

a       the environment and the bf16 matrix-product rate MFU is measured against (check.sh's a)
o       ours: GPT-2 large as check.sh's step e (36 x 1280, 20 heads, seq 1024, micro-batch 32 =
        global batch, bf16, mock data, GPT-2's vocabulary) with the issue-29 switches on
        (``--ours optimised``, OPTIMISED_FLAGS) or off (``--ours plain``, PLAIN_FLAGS):
        ms/iteration (median of iterations 3-10; 3-4 on CPU), TFLOP/s by Megatron's formula,
        MFU, peak memory; two more iterations run under torch.profiler: kernel time by family
        and the largest elementwise, copy and optimizer kernels (kernels.py). With
        ``--variant NAME --switches FLAGS`` the same run with FLAGS instead, recorded as
        ``o.NAME`` (perf.sh's GPU_PERF_VARIANTS)
h       transformers' GPT-2 large (hf_peer.py), eager
c       the same under torch.compile (inductor; the CPU smoke run only traces: backend "eager")
report  the comparison table of the steps that ran (also DIR/perf.txt)

Each step prints one ``RESULT: ...`` line last and keeps its figures in DIR/results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
import time
from pathlib import Path
from typing import List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))

import kernels  # noqa: E402
import steps  # noqa: E402
from steps import Step  # noqa: E402

# The issue-29 switches, in one place. The optimised run adds OPTIMISED_FLAGS to step e's flags,
# the plain run PLAIN_FLAGS; GPU_PERF_OURS_FLAGS (a shell-quoted list) replaces the chosen list.
# The optimised run is Megatron's defaults: its fusions (bias-GELU, bias-dropout-add, gradient
# accumulation) are on by default, and the H200 run of benchmarks/RESULTS.md ("GPT-2 large on
# one GPU, issue 29", 2026-11-28) found nothing faster under 80 GB: defaults 378.4 ms/iteration
# in 75.6 GB; + --cuda-graph-impl local 381.4 ms in 84.3 GB; + chunked cross entropy
# (--cross-entropy-loss-fusion --cross-entropy-fusion-impl native) and graphs 400.2 ms in 70.1 GB.
# Other switches are compared as perf.sh variants (GPU_PERF_VARIANTS).
OPTIMISED_FLAGS: List[str] = []
PLAIN_FLAGS = [
    "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion",
    "--no-gradient-accumulation-fusion",
]
# Flags (with their value) that only mean something on CUDA, left out of the CPU smoke run.
CUDA_ONLY_FLAGS = {"--cuda-graph-impl": 1}

TIMED_ITERATIONS = {"gpu": 10, "cpu": 4}  # iterations 3..N are timed (1-2 warm up)
PROFILED_ITERATIONS = 2  # then two more run under the profiler


def ours_flags(choice: str, gpu: bool, override: Optional[str] = None) -> List[str]:
    """The switches of ``choice`` (optimised | plain) for this mode's device; ``override`` (a
    variant's switches, shell-quoted), else GPU_PERF_OURS_FLAGS, replaces the list."""
    if override is None:
        override = os.environ.get("GPU_PERF_OURS_FLAGS")
    flags = (
        shlex.split(override)
        if override is not None
        else list(OPTIMISED_FLAGS if choice == "optimised" else PLAIN_FLAGS)
    )
    if gpu:
        return flags
    kept, skip = [], 0
    for flag in flags:
        if skip:
            skip -= 1
        elif flag in CUDA_ONLY_FLAGS:
            skip = CUDA_ONLY_FLAGS[flag]
        else:
            kept.append(flag)
    return kept


def step_ours(step: Step, options) -> Tuple[bool, str, dict]:
    micro_batch = steps.gpt2_micro_batch(step)
    timed = TIMED_ITERATIONS[step.mode]
    total = timed + PROFILED_ITERATIONS
    tb = step.log_dir / f"{step.name}-tensorboard"
    switches = ours_flags(options.ours, step.gpu, options.switches)
    flags = steps.gpt2_flags(step, micro_batch, tb) + ["--train-iters", str(total)] + switches
    profile = step.log_dir / f"{step.name}-kernels.json"
    profile.unlink(missing_ok=True)
    inject = Path(__file__).resolve().parent / "inject"
    env = dict(step.device_env())
    env.update(
        PYTHONPATH=os.pathsep.join([str(inject), str(steps.REPO)]),
        GPU_PERF_PROFILE_FIRST=str(timed + 1),
        GPU_PERF_PROFILE_COUNT=str(PROFILED_ITERATIONS),
        GPU_PERF_PROFILE_OUT=str(profile),
    )
    ok, summary, figures = steps.measure_gpt2(
        step, flags, tb, micro_batch, total, timed_last=timed, env=env
    )
    run = f"variant {options.variant}" if options.variant else options.ours
    figures.update(
        ours=options.ours,
        variant=options.variant,
        switches=switches,
        profiled=[timed + 1, total],
        started=time.time(),
    )
    summary = f"{run} ({' '.join(switches) or 'defaults'}): {summary}"
    if not ok:
        return False, summary, figures
    if not profile.exists():
        return False, f"{summary}; no kernel profile written ({profile.name})", figures
    report = json.loads(profile.read_text())
    per_iteration = {
        family: us / 1000.0 / report["iterations"] for family, us in report["families_us"].items()
    }
    busy = sum(report["families_us"].values())
    figures.update(
        kernel_ms_per_iteration=per_iteration,
        kernel_busy_fraction=busy / report["wall_us"] if report["wall_us"] else None,
        profiled_ms_per_iteration=report["wall_us"] / 1000.0 / report["iterations"],
        kernel_top_other=report["top_other"],
        kernel_top=report["top_kernels"],
        kernel_device=report["device"],
    )
    print("\n".join(kernels.top_kernel_lines(report["top_kernels"])), flush=True)
    if busy <= 0:
        return False, f"{summary}; the profile holds no kernel time", figures
    shares = ", ".join(
        f"{family} {100 * us / busy:.0f} %" for family, us in report["families_us"].items() if us
    )
    busy_share = f"kernels busy {100 * figures['kernel_busy_fraction']:.0f} % of the profiled time"
    return True, f"{summary}; kernel time: {shares}; {busy_share}", figures


def _peer(step: Step, compile_backend) -> Tuple[bool, str, dict]:
    import torch
    from hf_peer import PeerShape, train

    sizes = step.sizes["gpt2"]
    ours = step.results.step("o")
    micro_batch = ours.get("micro_batch") or steps.gpt2_micro_batch(step)
    shape = PeerShape(
        layers=sizes["layers"],
        hidden=sizes["hidden"],
        heads=sizes["heads"],
        seq=sizes["seq"],
        vocab=step.sizes["gpt2_vocab"] + 1,  # GPT-2's 50,257 (NullTokenizer's V + 1)
        micro_batch=micro_batch,
        global_batch=sizes["global_batch"],
        iterations=TIMED_ITERATIONS[step.mode],
    )
    device = torch.device("cuda", 0) if step.gpu else torch.device("cpu")
    with open(step.log("run"), "w") as log:
        peer = train(
            shape,
            device,
            print_fn=lambda line: print(line, file=log, flush=True),
            compile_backend=compile_backend,
        )
    flops = steps.megatron_flops(
        shape.global_batch, shape.seq, shape.layers, shape.hidden, shape.vocab
    )
    peer["tflops"] = flops / (peer["median_ms"] / 1000.0) / 1e12
    ceiling = step.results.step("a").get("matmul_tflops")
    peer.update(
        micro_batch=micro_batch,
        global_batch=shape.global_batch,
        mfu=peer["tflops"] / ceiling if ceiling else None,
        compile_backend=compile_backend,
    )
    finite = all(v == v and abs(v) != float("inf") for v in peer["losses"])
    summary = (
        f"{'compiled (' + compile_backend + ')' if compile_backend else 'eager'}: "
        f"{peer['median_ms']:.1f} ms/iteration, {steps.rate(peer['tflops'])} TFLOP/s, peak "
        f"allocated {peer['peak_allocated_mb']:.0f} MB"
    )
    return finite, summary + ("" if finite else "; non-finite loss"), peer


def step_hf_eager(step: Step, options) -> Tuple[bool, str, dict]:
    return _peer(step, None)


def step_hf_compiled(step: Step, options) -> Tuple[bool, str, dict]:
    return _peer(step, "inductor" if step.gpu else "eager")


def comparison(results: dict, mode: str) -> str:
    """The table perf.sh prints last: each run's figures, ours against the peers, and our
    kernel time by family."""
    env = results.get("a", {})
    ours = results.get("o", {})
    shape = steps.SIZES[mode]["gpt2"]
    lines = [
        f"GPT-2 {'large' if mode == 'gpu' else '(tiny, CPU smoke run)'}: {shape['layers']} x "
        f"{shape['hidden']}, seq {shape['seq']}, micro-batch {ours.get('micro_batch', '?')}, "
        f"global batch {shape['global_batch']}, bf16; card {env.get('card', '?')}, driver "
        f"{env.get('driver', '-')}, torch {env.get('versions', {}).get('torch', '?')}; "
        f"MFU against {steps.rate(env.get('matmul_tflops', 0.0))} TFLOP/s (step a)",
        f"{'run':<34} {'ms/iter':>9} {'TFLOP/s':>8} {'MFU':>7} {'peak MB':>9} "
        f"{'ours faster by':>15}",
    ]
    runs_ = (
        ("o", f"ours ({ours.get('ours', '?')})"),
        ("h", "transformers eager"),
        ("c", "transformers torch.compile"),
    )
    variants = sorted(
        (key for key in results if key.startswith("o.")),
        key=lambda key: results[key].get("started") or float("inf"),
    )
    runs_ += tuple((key, f"ours + {key[2:]}") for key in variants)
    for key, name in runs_:
        figures = results.get(key, {})
        if not figures.get("median_ms"):
            lines.append(f"{name:<34} {'-':>9} (not measured: {figures.get('summary', 'not run')})")
            continue
        mfu = f"{100 * figures['mfu']:.1f} %" if figures.get("mfu") else "-"
        speedup = (
            f"{figures['median_ms'] / ours['median_ms']:.2f}x"
            if key != "o" and ours.get("median_ms")
            else ""
        )
        lines.append(
            f"{name:<34} {figures['median_ms']:>9.1f} {steps.rate(figures['tflops']):>8} "
            f"{mfu:>7} {figures['peak_allocated_mb']:>9.0f} {speedup:>15}"
        )
    per_iteration = ours.get("kernel_ms_per_iteration")
    if per_iteration:
        busy = sum(per_iteration.values())
        where = "GPU kernel" if ours.get("kernel_device") == "cuda" else "CPU operator (self)"
        lines.append(
            f"ours: {where} time by family, per iteration (profiled iterations "
            f"{ours['profiled'][0]}-{ours['profiled'][1]}: "
            f"{ours['profiled_ms_per_iteration']:.1f} ms each, kernels busy "
            f"{100 * (ours.get('kernel_busy_fraction') or 0):.0f} % of it)"
        )
        for family in kernels.FAMILIES:
            ms = per_iteration.get(family, 0.0)
            lines.append(f"  {family:<18} {ms:>9.2f} ms {100 * ms / busy:>6.1f} %")
        for name, us in ours.get("kernel_top_other") or []:
            lines.append(f"  other: {us / 1000.0:.2f} ms in {name[:100]}")
        lines.extend(kernels.top_kernel_lines(ours.get("kernel_top") or {}))
    for key in variants:
        switches = " ".join(results[key].get("switches") or []) or "(none)"
        families = results[key].get("kernel_ms_per_iteration") or {}
        spent = ", ".join(f"{family} {ms:.1f}" for family, ms in families.items() if ms)
        lines.append(
            f"variant {key[2:]}: {switches}"
            + (f"; kernel ms per iteration: {spent}" if spent else "")
        )
    return "\n".join(lines)


def step_report(step: Step, options) -> Tuple[bool, str, dict]:
    table = comparison(step.results.read(), step.mode)
    (step.log_dir / "perf.txt").write_text(table + "\n")
    print(table, flush=True)
    return True, "comparison table in perf.txt", {}


STEPS = {
    "a": lambda step, options: steps.step_a(step),
    "o": step_ours,
    "h": step_hf_eager,
    "c": step_hf_compiled,
    "report": step_report,
}


def _arguments(parser) -> None:
    parser.add_argument(
        "--ours",
        choices=("optimised", "plain"),
        default="optimised",
        help="our run with the issue-29 switches on (OPTIMISED_FLAGS) or off (PLAIN_FLAGS)",
    )
    parser.add_argument(
        "--variant",
        type=_variant_name,
        help="step o only: record the run as o.NAME (its logs o.NAME-*), with --switches",
    )
    parser.add_argument("--switches", help="a variant's switches, shell-quoted")


def _variant_name(name: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_-]+", name):
        raise argparse.ArgumentTypeError(f"letters, digits, - and _ only (got '{name}')")
    return name


def record_as(options) -> str:
    """The name a step's figures and logs go under: o.NAME for a variant."""
    if options.variant is None:
        return options.step
    if options.step != "o" or options.switches is None:
        raise SystemExit("error: --variant is for step o, with --switches")
    return f"o.{options.variant}"


if __name__ == "__main__":
    sys.exit(
        steps.main(
            table=STEPS,
            description=__doc__.split("\n\n")[0],
            add_arguments=_arguments,
            record_as=record_as,
        )
    )
