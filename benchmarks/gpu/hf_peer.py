"""Step f of benchmarks/gpu/check.sh: the GPT-2 of step e trained in Hugging Face transformers,
as a user of transformers would train it: ``GPT2LMHeadModel`` built from a config (nothing is
downloaded) with SDPA attention, fp32 weights under bf16 autocast, ``torch.optim.AdamW(fused=
True)``, gradient clipping at 1.0, the same micro-batch, global batch and sequence length.

Differences from our run, on purpose: transformers keeps fp32 weights and casts per operation
(autocast), ours keeps bf16 weights with fp32 main copies (Megatron's mixed precision); its
vocabulary is GPT-2's 50,257 rows, ours is padded to 50,304; its GELU is transformers'
``gelu_pytorch_tanh`` (GPT-2's tanh GELU in one kernel; the config's default ``gelu_new`` computes
the same function in several). Data: random tokens (throughput does not depend on them).
"""

from __future__ import annotations

import resource
import statistics
import time
from dataclasses import dataclass

import torch


@dataclass
class PeerShape:
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    micro_batch: int
    global_batch: int
    iterations: int
    lr: float = 2.5e-4


def _peak_memory_mb(device: torch.device):
    """(peak allocated, peak reserved) in MB; on CPU the process's peak resident set twice."""
    if device.type == "cuda":
        mb = 1024.0 * 1024.0
        return torch.cuda.max_memory_allocated(device) / mb, torch.cuda.max_memory_reserved(
            device
        ) / mb
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux
    return peak, peak


def train(shape: PeerShape, device: torch.device, print_fn=print, compile_backend=None) -> dict:
    """Train ``shape.iterations`` iterations; ms per iteration (each), losses, peak memory.

    ``compile_backend``: the model under ``torch.compile(backend=...)`` ("inductor" as a user
    compiles it; "eager" only traces, for the CPU smoke run); the first iterations compile and
    are left out of the median."""
    from transformers import AutoModelForCausalLM, GPT2Config

    config = GPT2Config(
        n_layer=shape.layers,
        n_embd=shape.hidden,
        n_head=shape.heads,
        n_positions=shape.seq,
        vocab_size=shape.vocab,
        bos_token_id=shape.vocab - 1,
        eos_token_id=shape.vocab - 1,
        activation_function="gelu_pytorch_tanh",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
    )
    torch.manual_seed(1234)
    with torch.device(device):  # built in place: no 3 GB copy from the host
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    if model.config._attn_implementation != "sdpa":
        raise RuntimeError(f"attention is {model.config._attn_implementation!r}, not sdpa")
    model.train()
    parameters = sum(p.numel() for p in model.parameters())
    print_fn(f"transformers {type(model).__name__}: {parameters:,} parameters on {device}")
    forward = model if compile_backend is None else torch.compile(model, backend=compile_backend)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=shape.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True
    )
    if shape.global_batch % shape.micro_batch:
        raise ValueError("the global batch must be a multiple of the micro-batch")
    accumulation = shape.global_batch // shape.micro_batch
    generator = torch.Generator(device=device).manual_seed(1234)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times_ms, losses = [], []
    for iteration in range(1, shape.iterations + 1):
        batches = [
            torch.randint(
                0, shape.vocab, (shape.micro_batch, shape.seq), device=device, generator=generator
            )
            for _ in range(accumulation)
        ]
        _synchronize(device)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=device)
        for tokens in batches:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = forward(input_ids=tokens, labels=tokens).loss / accumulation
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(total.item())  # synchronizes, as our per-iteration log line does
        times_ms.append((time.perf_counter() - start) * 1000.0)
        print_fn(
            f"transformers iteration {iteration}/{shape.iterations}: loss {losses[-1]:.6f}, "
            f"{times_ms[-1]:.1f} ms"
        )
    allocated, reserved = _peak_memory_mb(device)
    return {
        "parameters": parameters,
        "ms_per_iteration": times_ms,
        "median_ms": statistics.median(times_ms[2:] or times_ms),
        "losses": losses,
        "peak_allocated_mb": allocated,
        "peak_reserved_mb": reserved,
        "accumulation": accumulation,
    }


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
