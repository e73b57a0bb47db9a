"""ATen operations dispatched by one optimizer step of a tiny GPT (4 layers, 53 parameters), with
the optimizer's fast paths off and on (issue 29): a count, not a timing.

On a GPU nearly every non-view operation is a kernel launch, so the count stands in for the
launches per step (a multi-tensor operation counts once here; on CUDA it launches one kernel
per ~100 tensors, fewer than the parameters of GPT-2 large's 292 tensors only by that factor).
The CPU runs each multi-tensor operation's per-tensor fallback inside the one operation, so
the count is what matters here, not the time.

Also printed, for comparison: how far a grad norm whose per-tensor norms were accumulated in
fp32 (torch._foreach_norm without dtype=) would be from the float64 one that the optimizer
computes (it asks the multi-tensor kernel for float64, which accumulates in float64).

    OMP_NUM_THREADS=1 python benchmarks/optimizer_launches.py   (~20 s)
    python benchmarks/optimizer_launches.py --device cuda        (on a GPU: also ms per step)

With ``--device cuda`` each row also gives the median time of ``optimizer.step()`` (CUDA
events, over ``--timed-steps`` steps) and the norm check compares the multi-tensor float64
norms with the per-tensor ones on the GPU (a float64 accumulation shows as ~1e-16).
"""

import argparse
import collections
import math
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.core.distributed import (  # noqa: E402
    DistributedDataParallel,
    DistributedDataParallelConfig,
)
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.tensor_parallel import ProcessGroupCollection  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

VOCAB, SEQ = 61, 12
# Operations that launch no kernel on a GPU (views, metadata, allocation).
NO_KERNEL = {
    "view",
    "_unsafe_view",
    "detach",
    "alias",
    "as_strided",
    "empty",
    "empty_like",
    "empty_strided",
    "t",
    "slice",
    "select",
    "unsqueeze",
    "expand",
    "lift_fresh",
    "_to_copy_noop",
}
SETTINGS = {
    "plain": dict(optimizer_step_impl="for_loop", foreach_grad_norm_and_copies=False),
    # What a CUDA run did before issue 29: torch's default step there is foreach.
    "foreach step only": dict(optimizer_step_impl="foreach", foreach_grad_norm_and_copies=False),
    "foreach norm+copies": dict(optimizer_step_impl="for_loop", foreach_grad_norm_and_copies=True),
    "fused step": dict(optimizer_step_impl="fused", foreach_grad_norm_and_copies=False),
    "fused + foreach": dict(optimizer_step_impl="fused", foreach_grad_norm_and_copies=True),
    "foreach step + foreach": dict(
        optimizer_step_impl="foreach", foreach_grad_norm_and_copies=True
    ),
}


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _model(dtype, device):
    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=4, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0,
        attention_dropout=0.0,
    )  # fmt: skip
    return GPTModel(
        config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ
    ).to(device, dtype)


def _batch(step, device):
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    positions = torch.arange(SEQ).unsqueeze(0).expand(2, SEQ)
    return tokens.to(device), positions.to(device), labels.to(device)


def count_step(dtype, distributed, settings, device, timed_steps=0):
    """(params, ops, kernel ops, ops by name, median ms of a step or None)."""
    model = _model(dtype, device)
    ddp = DistributedDataParallel(
        None,
        DistributedDataParallelConfig(
            use_distributed_optimizer=distributed, grad_reduce_in_fp32=True
        ),
        model,
        pg_collection=ProcessGroupCollection(dp_cp=dist.group.WORLD),
    )
    config = OptimizerConfig(
        lr=1e-3,
        clip_grad=1.0,
        bf16=dtype == torch.bfloat16,
        use_distributed_optimizer=distributed,
        **settings,
    )
    opt = get_megatron_optimizer(config, [ddp])
    counter, times = None, []
    for step in range(2 + timed_steps):
        opt.zero_grad()
        ddp.zero_grad_buffer()
        tokens, pos, labels = _batch(step, device)
        ddp(tokens, pos, None, labels=labels).float().mean().backward()
        ddp.finish_grad_sync()
        if step == 1:
            counter = CountOps()
            with counter:
                opt.step()
        elif step > 1:
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            opt.step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            opt.step()
    params = sum(1 for _ in model.parameters())
    total = sum(counter.ops.values())
    kernels = sum(n for op, n in counter.ops.items() if op not in NO_KERNEL)
    return params, total, kernels, counter.ops, statistics.median(times) if times else None


def norm_check(device):
    """(float64 norm, relative difference of fp32-accumulated per-tensor norms, largest
    relative difference of the multi-tensor float64 norms from the per-tensor ones)."""
    model = _model(torch.float32, device)
    tokens, pos, labels = _batch(0, device)
    model(tokens, pos, None, labels=labels).mean().backward()
    grads = [p.grad for p in model.parameters()]
    exact = math.sqrt(math.fsum(float(x) ** 2 for g in grads for x in g.double().view(-1).cpu()))
    fp32_norms = torch.stack(torch._foreach_norm(grads, 2.0)).double()
    fp32 = float(fp32_norms.pow(2).sum()) ** 0.5
    foreach64 = torch._foreach_norm(grads, 2.0, dtype=torch.float64)
    worst = max(
        abs(float(a) - float(b)) / max(float(b), 1e-300)
        for a, b in zip(
            foreach64, (torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads)
        )
    )
    return exact, abs(fp32 - exact) / exact, worst


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--timed-steps", type=int, default=20, help="with --device cuda")
    parser.add_argument("--ops", action="store_true", help="list the ops of two settings")
    cli = parser.parse_args()
    device = torch.device(cli.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)  # set_device wants an index
    timed = cli.timed_steps if device.type == "cuda" else 0
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    print(f"torch {torch.__version__} on {device}; ATen ops in the 2nd optimizer.step()")
    header = f"{'optimizer':<24}{'precision':<10}{'settings':<26}{'params':>7}{'ops':>7}"
    print(header + f"{'kernel ops':>12}" + (f"{'ms/step':>10}" if timed else ""))
    for distributed in (False, True):
        for dtype in (torch.float32, torch.bfloat16):
            for name, settings in SETTINGS.items():
                params, total, kernels, _, ms = count_step(
                    dtype, distributed, settings, device, timed
                )
                kind = "DistributedOptimizer" if distributed else "(Float16|FP32)Optimizer"
                precision = "bf16" if dtype == torch.bfloat16 else "fp32"
                row = f"{kind:<24}{precision:<10}{name:<26}{params:>7}{total:>7}{kernels:>12}"
                print(row + (f"{ms:>10.3f}" if ms is not None else ""))
    if cli.ops:
        for name in ("plain", "fused + foreach"):
            ops = count_step(torch.bfloat16, False, SETTINGS[name], device)[3]
            print(name, dict(ops.most_common()))
    exact, fp32_rel, foreach_rel = norm_check(device)
    print(
        f"grad norm {exact:.17g}: fp32-accumulated per-tensor norms differ by {fp32_rel:.2e} "
        f"relative (fp32 unit roundoff {2.0**-24:.2e}); the float64 multi-tensor norms differ "
        f"from the per-tensor float64 norms by at most {foreach_rel:.2e} relative"
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
