#!/usr/bin/env python3
"""Causal attention forward + backward on CPU: torch's fused kernel against the unfused blocked
path.

    python benchmarks/attention_cpu.py                       # seq 256, 512, 1024, 2048
    python benchmarks/attention_cpu.py --seqs 256 --threads 1
    python benchmarks/attention_cpu.py --dropout 0.1          # Megatron's default attention dropout
    python benchmarks/attention_cpu.py --heads 8 --groups 2   # grouped-query attention

The two kernels ``--attention-backend`` chooses between, on the inputs the attention layer gives
them: q, k, v as strided views of one fused QKV projection [s, b, heads, 3, d] (with ``--groups``,
Megatron's grouped layout [s, b, groups, heads/groups + 2, d]), output [s, b, heads * d],
gradient flowing back into the projection.

  sdpa     F.scaled_dot_product_attention(is_causal=True) (what 'flash'/'fused', and 'auto' above
           UNFUSED_AUTO_MAX_SEQ, run)
  unfused  megatron.core.transformer.blocked_attention.blocked_attention (what 'auto' runs on
           CPU up to UNFUSED_AUTO_MAX_SEQ, and 'unfused'/'local' run)

With ``--dropout`` both apply attention dropout (SDPA then leaves its flash kernel for its math
path on CPU); their outputs then differ by the masks, so the difference column is left out.

Each sequence length keeps the tokens per batch at ``--tokens`` (batch = tokens / seq). The two
alternate call by call (``--rounds`` rounds of ``--reps`` forward + backward each, after a warm-up);
reported: median milliseconds per forward + backward of each, sdpa/unfused (above 1: the unfused
path is faster), the largest difference of output and input gradient between the two, and the
bytes the unfused path keeps for backward (its saved probabilities, and dropout masks) per layer.
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron.core.transformer.blocked_attention import (  # noqa: E402
    DEFAULT_BLOCK_ROWS,
    _row_blocks,
    blocked_attention,
)
from megatron.core.transformer.dot_product_attention import UNFUSED_AUTO_MAX_SEQ  # noqa: E402
from megatron.training.cpu_allocator import configure_cpu_allocator  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[256, 512, 1024, 2048])
    p.add_argument("--tokens", type=int, default=2048, help="sequence length x batch, kept fixed")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument(
        "--groups",
        type=int,
        default=None,
        help="key/value head groups (grouped-query attention); default: one per head",
    )
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument(
        "--dropout", type=float, default=0.0, help="attention dropout probability in both"
    )
    args = p.parse_args(argv)
    for name in ("tokens", "heads", "head_dim", "rounds", "reps", "threads"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.groups is None:
        args.groups = args.heads
    if args.groups <= 0 or args.heads % args.groups:
        p.error(f"--groups ({args.groups}) must be positive and divide --heads ({args.heads})")
    if not 0.0 <= args.dropout < 1.0:
        p.error(f"--dropout must be in [0, 1), got {args.dropout}")
    for seq in args.seqs:
        if seq <= 0 or args.tokens % seq:
            p.error(
                f"every --seqs value must be positive and divide --tokens ({args.tokens}); "
                f"got {seq}"
            )
    return args


def sdpa(q, k, v, scale, dropout):
    s, b, n, d = q.shape
    out = F.scaled_dot_product_attention(
        q.permute(1, 2, 0, 3),
        k.permute(1, 2, 0, 3),
        v.permute(1, 2, 0, 3),
        is_causal=True,
        scale=scale,
        dropout_p=dropout,
        enable_gqa=k.shape[2] != n,
    )
    return out.permute(2, 0, 1, 3).reshape(s, b, n * d)


def unfused(q, k, v, scale, dropout):
    return blocked_attention(q, k, v, scale, causal=True, dropout_p=dropout)


def measure(args, seq):
    batch, n, d, groups = args.tokens // seq, args.heads, args.head_dim, args.groups
    gen = torch.Generator().manual_seed(seq)
    per_group = n // groups
    mixed = torch.randn(seq, batch, groups, per_group + 2, d, generator=gen).requires_grad_()
    grad = torch.randn(seq, batch, n * d, generator=gen)
    scale = 1.0 / d**0.5
    kernels = {"sdpa": sdpa, "unfused": unfused}

    def run(kernel):
        mixed.grad = None
        query, key, value = torch.split(mixed, [per_group, 1, 1], dim=3)
        out = kernel(
            query.reshape(seq, batch, n, d), key.squeeze(3), value.squeeze(3), scale, args.dropout
        )
        out.backward(grad)
        return out.detach(), mixed.grad

    (out_a, grad_a), (out_b, grad_b) = run(sdpa), run(unfused)
    diff = (
        max((out_a - out_b).abs().max().item(), (grad_a - grad_b).abs().max().item())
        if not args.dropout
        else None
    )
    times = {name: [] for name in kernels}
    for _ in range(args.rounds):
        for name, kernel in kernels.items():
            start = time.perf_counter()
            for _ in range(args.reps):
                run(kernel)
            times[name].append((time.perf_counter() - start) / args.reps * 1e3)
    # fp32 probabilities, plus a one-byte keep mask each with dropout
    probabilities = sum(
        (r1 - r0) * keys for r0, r1, keys in _row_blocks(seq, seq, DEFAULT_BLOCK_ROWS, True)
    )
    saved = batch * n * probabilities * (5 if args.dropout else 4)
    return {name: statistics.median(t) for name, t in times.items()}, diff, saved


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    allocator = "on" if configure_cpu_allocator("cpu") else "off"
    print(
        f"torch {torch.__version__}, {args.threads} threads, allocator setting {allocator}, "
        f"{args.heads} heads x {args.head_dim}, {args.groups} key/value groups, "
        f"{args.tokens} tokens per batch, "
        f"fp32, causal, "
        f"attention dropout {args.dropout}; "
        f"'auto' takes the unfused path up to seq {UNFUSED_AUTO_MAX_SEQ}; "
        f"1-min load {os.getloadavg()[0]:.2f}"
    )
    print(
        f"{'seq':>5} {'batch':>5}  {'sdpa ms':>8}  {'unfused ms':>10}  {'sdpa/unfused':>12}  "
        f"{'max |diff|':>10}  {'unfused keeps MiB/layer':>23}"
    )
    for seq in args.seqs:
        ms, diff, saved = measure(args, seq)
        print(
            f"{seq:>5} {args.tokens // seq:>5}  {ms['sdpa']:>8.2f}  {ms['unfused']:>10.2f}  "
            f"{ms['sdpa'] / ms['unfused']:>12.2f}  {'-' if diff is None else f'{diff:.1e}':>10}  "
            f"{saved / 2**20:>23.1f}"
        )


if __name__ == "__main__":
    main()
