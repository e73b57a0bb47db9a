"""GPU check of ``--cuda-graph-impl local`` and ``--gradient-accumulation-fusion`` (what the CPU
tests cannot prove: the CUDA capture, the mixed-dtype addmm into fp32 ``main_grad``, the speed).

    PYTHONPATH=. python benchmarks/layer_graphs_check.py            # on a GPU (about a minute)
    PYTHONPATH=. python benchmarks/layer_graphs_check.py --cpu      # the same, tiny, on the CPU
                                                                    # (graphs replayed eagerly)

Trains one GPT (bf16 params, fp32 main grads through DDP, no dropout, two micro-batches per
iteration, SGD on ``main_grad``) four times: fusion off/on x graphs off/on, from the same weights
and batches. Checks, and prints as JSON with the ms per iteration of each run:

* graphs on = graphs off, for each fusion setting: the replay runs the kernels of the eager
  layer on the same values, so the losses agree to 1e-6 relative (0 expected);
* fusion on ~ fusion off: on CUDA the weight gradients are accumulated in fp32 without a bf16
  rounding first, so the losses differ by bf16 rounding only (1e-2 relative).

Exit status 1 when a check fails.

Like training, it runs on the default stream and keeps no micro-batch's autograd graph past its
backward (see ``del loss`` in ``_train``).
"""

import argparse
import contextlib
import json
import sys
import time

import torch
import torch.nn.functional as F

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.tensor_parallel import ProcessGroupCollection
from megatron.core.transformer.cuda_graphs import EagerReplay
from megatron.core.transformer.transformer_config import TransformerConfig


def _model(args, graphs, fusion, device):
    config = TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.bfloat16,
        bf16=True,
        activation_func=F.gelu,
        gradient_accumulation_fusion=fusion,
        cuda_graph_impl="local" if graphs else "none",
        cuda_graph_warmup_steps=2,
    )
    torch.manual_seed(1234)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    model = GPTModel(
        config,
        spec,
        vocab_size=args.vocab,
        max_sequence_length=args.seq,
        pg_collection=ProcessGroupCollection(),
    ).to(device)
    if graphs and device.type != "cuda":
        model.decoder.layer_graphs.backend = EagerReplay
    return model


def _train(args, model, device):
    ddp = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model
    )
    g = torch.Generator().manual_seed(7)
    losses, times = [], []
    for _ in range(args.iters):
        start = time.perf_counter()
        ddp.zero_grad_buffer()
        for m in range(2):
            tokens = torch.randint(0, args.vocab, (args.mbs, args.seq), generator=g).to(device)
            labels = torch.randint(0, args.vocab, (args.mbs, args.seq), generator=g).to(device)
            position_ids = torch.arange(args.seq, device=device).unsqueeze(0).expand_as(tokens)
            with ddp.no_sync() if m == 0 else contextlib.nullcontext():
                loss = model(tokens, position_ids, None, labels=labels).float().mean()
                loss.backward()
            losses.append(loss.detach())
            # Free this micro-batch's autograd graph before the next forward, as the training
            # schedule does: a live graph hands its AccumulateGrad nodes, made on the default
            # (legacy) stream, to the next forward; when that forward is the capture, the
            # captured backward would make the legacy stream wait on the capturing one
            # (cudaErrorStreamCaptureImplicit).
            del loss
        ddp.finish_grad_sync()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.main_grad.to(p.dtype), alpha=-0.05)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1000)
    steady = times[args.iters // 2 :]
    return torch.stack(losses).double().cpu(), sum(steady) / len(steady)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="tiny run on the CPU (eager replay)")
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    big = device.type == "cuda"
    args.layers, args.hidden, args.heads = (12, 768, 12) if big else (2, 32, 4)
    args.seq, args.mbs, args.vocab = (1024, 8, 50304) if big else (16, 2, 64)
    runs, ok = {}, True
    for fusion in (False, True):
        for graphs in (False, True):
            name = f"fusion={'on' if fusion else 'off'} graphs={'on' if graphs else 'off'}"
            runs[name] = _train(args, _model(args, graphs, fusion, device), device)
    report = {"device": str(torch.cuda.get_device_name() if big else "cpu"), "checks": []}
    report["ms_per_iteration"] = {name: round(ms, 2) for name, (_, ms) in runs.items()}
    for fusion in ("off", "on"):
        a, b = runs[f"fusion={fusion} graphs=off"][0], runs[f"fusion={fusion} graphs=on"][0]
        err = ((a - b).abs() / a.abs()).max().item()
        report["checks"].append([f"graphs on = off, fusion {fusion}", err, err <= 1e-6])
    a, b = runs["fusion=off graphs=off"][0], runs["fusion=on graphs=off"][0]
    err = ((a - b).abs() / a.abs()).max().item()
    report["checks"].append(["fusion on ~ off (bf16 rounding)", err, err <= 1e-2])
    ok = all(passed for _, _, passed in report["checks"])
    print(json.dumps(report, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
