#!/usr/bin/env python3
"""GPT training throughput on CPU: this project against Hugging Face ``transformers`` and a
minimal plain-PyTorch loop, on the same GPT-2 model, data and optimizer.

    python benchmarks/bench_gpt_cpu.py  # defaults below, ~1-2 min on a quiet 2-core machine
    python benchmarks/bench_gpt_cpu.py --rounds 20 --steps 2 --threads 1
    python benchmarks/bench_gpt_cpu.py --no-ce-fusion  # ours without --cross-entropy-loss-fusion
    MEGATRON_CPU_MALLOPT=0 python benchmarks/bench_gpt_cpu.py   # ours without the allocator setting
    python benchmarks/bench_gpt_cpu.py --profile ours  # torch.profiler table of one trainer

Model (default): 4 layers, hidden 256, 4 heads, seq 256, vocab 8192, micro batch 8, fp32, one
process, dropout 0, GPT-2 architecture (learned absolute positions, pre-LayerNorm, GELU MLP 4h,
tied input/output embedding). Optimizer: AdamW lr 1e-4, betas (0.9, 0.999), eps 1e-8, weight
decay 0.01 on matrices and embeddings only (Megatron's grouping, used by all three), gradient
clipping at global L2 norm 1.0. Every trainer predicts all ``seq`` next tokens of a batch.

  ours   megatron.core GPTModel built from TransformerConfig, wrapped in megatron.core
         DistributedDataParallel (single process, contiguous grad buffer), get_megatron_optimizer
         with OptimizerConfig; forward with labels returns per-token losses [b, s], loss = mean.
         Each step: optimizer.zero_grad(), ddp.zero_grad_buffer(), forward, backward,
         ddp.finish_grad_sync(), optimizer.step() (which clips). Set up as ``pretrain_gpt.py
         --cross-entropy-loss-fusion`` would: TransformerConfig(cross_entropy_loss_fusion=True)
         (output layer + loss in one Function; ``--no-ce-fusion`` turns it off), Megatron's
         default ``--bias-gelu-fusion`` (bias_activation_fusion=True: the project's tanh GELU),
         ``--attention-backend auto`` (Megatron's default flag value; on CPU up to seq 1024 it
         selects the unfused attention of megatron/core/transformer/blocked_attention.py;
         ``--attention-backend flash`` here runs torch's SDPA kernel instead, as hf and plain do),
         and at start-up the project's megatron.training.cpu_allocator.configure_cpu_allocator
         (what initialize_megatron calls; ``MEGATRON_CPU_MALLOPT=0`` in the environment skips it).
         Only project code runs: nothing is patched.
  hf     transformers GPT2LMHeadModel (attn_implementation 'sdpa', dropouts 0) + torch.optim.AdamW
         + torch.nn.utils.clip_grad_norm_; loss = model(input_ids, labels, shift_labels).loss.
  plain  a ~60-line GPT-2 written below (nn.Embedding, fused-qkv nn.Linear,
         F.scaled_dot_product_attention(is_causal=True), nn.LayerNorm, F.cross_entropy, tied
         head) + torch.optim.AdamW + clip_grad_norm_.

GELU (``--gelu``): 'tanh' (default) is GPT-2's activation: HF's default ``gelu_new``, ours with
``bias_activation_fusion`` (Megatron's default ``--bias-gelu-fusion``, which selects the tanh
form), plain ``F.gelu(approximate='tanh')``; 'exact' uses the erf GELU in all three.

Fairness: HF and plain are loaded with *our* initial weights (N(0, 0.02), residual projections
N(0, 0.02/sqrt(2*layers)), zero biases, unit norms), so the three are the same function: the
script checks that parameter counts and first-batch losses agree, and prints each trainer's loss
after the last step (equal up to fp32 rounding). All see the same fixed random token batches.
torch's default AdamW implementation is used everywhere; ``--adam-impl`` changes it for hf and
plain (ours uses what get_megatron_optimizer builds).

Timing: each trainer lives in its own worker process (so allocator state and process-wide
settings of one cannot help or hurt another); the parent lets one worker at a time run
``--steps`` timed steps, alternating ours, hf, plain, ... for ``--rounds`` rounds (the starting
trainer rotates), after ``--warmup`` untimed steps each. Reported per trainer: tokens/s as the
median over rounds (with min-max), the best single step, tokens per CPU-second of the worker
(steadier than wall time on a shared machine), minor page faults per step and the worker's peak
RSS; then ours/hf and ours/plain as the median of the per-round ratios.

hf and plain run with glibc's default allocator settings, as their users get them;
``--mallopt-baselines`` gives them the project's setting too (an allocator-neutral comparison).
"""

import argparse
import gc
import math
import multiprocessing as mp
import os
import resource
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
sys.path.insert(0, ROOT)

FRAMEWORKS = ("ours", "hf", "plain")


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument(
        "--warmup", type=int, default=2, help="untimed steps per trainer, once at the start"
    )
    p.add_argument("--steps", type=int, default=2, help="timed steps per trainer per round")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument(
        "--time-limit",
        type=float,
        default=240.0,
        help="stop after the round that passes this many seconds of timed rounds (a shared "
        "machine can be slow); the rounds done so far are reported",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count(),
        help="torch.set_num_threads in every worker (default: all cores)",
    )
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument(
        "--gelu",
        choices=("tanh", "exact"),
        default="tanh",
        help="tanh: GPT-2's GELU in its native form per framework; exact: erf GELU in all three",
    )
    p.add_argument("--frameworks", nargs="+", choices=FRAMEWORKS, default=list(FRAMEWORKS))
    p.add_argument(
        "--adam-impl",
        choices=("default", "foreach", "fused"),
        default="default",
        help="AdamW implementation for hf and plain (torch's default on CPU is the per-tensor "
        "loop); ours uses what get_megatron_optimizer builds",
    )
    p.add_argument(
        "--no-ce-fusion",
        action="store_true",
        help="ours without cross_entropy_loss_fusion (--cross-entropy-loss-fusion off)",
    )
    p.add_argument(
        "--attention-backend",
        choices=("auto", "flash", "unfused"),
        default="auto",
        help="ours' --attention-backend: auto (the default; the unfused blocked attention on "
        "CPU at these lengths), flash (torch's SDPA kernel, what hf and plain run)",
    )
    p.add_argument(
        "--mallopt-baselines",
        action="store_true",
        help="apply the project's allocator setting (configure_cpu_allocator) to hf and plain too",
    )
    p.add_argument(
        "--profile",
        choices=FRAMEWORKS,
        default=None,
        help="instead of the benchmark, profile this trainer in-process with torch.profiler "
        "and print the top ops by self CPU time",
    )
    p.add_argument("--profile-steps", type=int, default=3)
    args = p.parse_args(argv)
    for name in (
        "layers",
        "hidden",
        "heads",
        "seq",
        "vocab",
        "micro_batch",
        "steps",
        "rounds",
        "threads",
    ):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    if args.hidden % args.heads:
        p.error(f"--hidden ({args.hidden}) must be divisible by --heads ({args.heads})")
    if "ours" not in args.frameworks:
        args.frameworks = ["ours"] + args.frameworks  # ours provides the shared initial weights
    return args


# ----------------------------------------------------------------------------- shared pieces


def make_batches(args, count=4):
    """``count`` fixed [b, s+1] token batches; every trainer cycles through the same ones."""
    gen = torch.Generator().manual_seed(args.seed)
    return [
        torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), generator=gen)
        for _ in range(count)
    ]


def split(batch):
    return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()


def adamw_kwargs(args):
    """The baselines' AdamW implementation (--adam-impl)."""
    if args.adam_impl == "fused":
        return {"fused": True}
    if args.adam_impl == "foreach":
        return {"foreach": True}
    return {}


def decay_groups(model, args):
    """Weight decay on matrices/embeddings only (what get_megatron_optimizer does)."""
    decay, no_decay, seen = [], [], set()
    for param in model.parameters():
        if id(param) not in seen:
            seen.add(id(param))
            (decay if param.dim() > 1 else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": args.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def count_params(model):
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def configure_allocator():
    """The project's allocator setting (what initialize_megatron does on a CPU): 'on', or why
    not."""
    from megatron.training.cpu_allocator import ENV_VAR, configure_cpu_allocator

    if configure_cpu_allocator("cpu"):
        return "on"
    return (
        f"off ({ENV_VAR}={os.environ[ENV_VAR]})" if ENV_VAR in os.environ else "off (not applied)"
    )


# ----------------------------------------------------------------------------- ours


class OursTrainer:
    name = "ours"

    def __init__(self, args):
        from megatron.core.distributed.distributed_data_parallel import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
        )
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.transformer.transformer_config import TransformerConfig

        config = TransformerConfig(
            num_layers=args.layers,
            hidden_size=args.hidden,
            num_attention_heads=args.heads,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            init_method_std=0.02,
            normalization="LayerNorm",
            activation_func=F.gelu,
            add_bias_linear=True,
            bias_activation_fusion=args.gelu == "tanh",  # Megatron's default --bias-gelu-fusion
            cross_entropy_loss_fusion=not args.no_ce_fusion,  # --cross-entropy-loss-fusion
            attention_backend=args.attention_backend,  # --attention-backend (default auto)
        )
        torch.manual_seed(args.seed)
        self.model = GPTModel(
            config,
            get_gpt_layer_local_spec(),
            vocab_size=args.vocab,
            max_sequence_length=args.seq,
            share_embeddings_and_output_weights=True,
            position_embedding_type="learned_absolute",
        )
        self.ddp = DistributedDataParallel(
            self.model.config, DistributedDataParallelConfig(), self.model
        )
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=args.lr,
            weight_decay=args.weight_decay,
            adam_beta1=0.9,
            adam_beta2=0.999,
            adam_eps=1e-8,
            clip_grad=args.clip_grad,
        )
        self.optimizer = get_megatron_optimizer(opt_config, [self.ddp])
        self.position_ids = torch.arange(args.seq).unsqueeze(0).expand(args.micro_batch, -1)

    def loss(self, tokens, labels):
        losses = self.ddp(tokens, self.position_ids, None, labels=labels)  # None: causal mask
        return losses.mean()

    def step(self, tokens, labels):
        self.optimizer.zero_grad()
        self.ddp.zero_grad_buffer()
        loss = self.loss(tokens, labels)
        loss.backward()
        self.ddp.finish_grad_sync()
        self.optimizer.step()
        return loss.item()


def qkv_to_blocks(w, heads):
    """Our fused QKV rows are grouped per head [q_h; k_h; v_h]; GPT-2's are [q; k; v]."""
    rest = w.shape[1:]
    d = w.shape[0] // (3 * heads)
    return w.reshape(heads, 3, d, *rest).transpose(0, 1).reshape(3 * heads * d, *rest)


def reference_weights(ours, args):
    """Our model's weights under neutral names, in [out, in] (nn.Linear) layout."""
    sd = {k: v.detach().clone() for k, v in ours.model.state_dict().items()}
    out = {
        "wte": sd["embedding.word_embeddings.weight"],
        "wpe": sd["embedding.position_embeddings.weight"],
        "ln_f.weight": sd["decoder.final_layernorm.weight"],
        "ln_f.bias": sd["decoder.final_layernorm.bias"],
    }
    names = {
        "ln_1": "input_layernorm",
        "proj": "self_attention.linear_proj",
        "ln_2": "pre_mlp_layernorm",
        "fc1": "mlp.linear_fc1",
        "fc2": "mlp.linear_fc2",
    }
    for i in range(args.layers):
        p = f"decoder.layers.{i}."
        for kind in ("weight", "bias"):
            for short, long in names.items():
                out[f"{i}.{short}.{kind}"] = sd[f"{p}{long}.{kind}"]
            out[f"{i}.qkv.{kind}"] = qkv_to_blocks(
                sd[f"{p}self_attention.linear_qkv.{kind}"], args.heads
            )
    return out


def load_exact(model, sd, skip=()):
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if k not in skip and not k.endswith("attn.bias")]
    if missing or unexpected:
        raise RuntimeError(f"{type(model).__name__}: missing {missing}, unexpected {unexpected}")


class PeerTrainer:
    """A peer's plain training step: torch AdamW, norm clipping, no framework around it."""

    def set_optimizer(self, args):
        self.optimizer = torch.optim.AdamW(
            decay_groups(self.model, args),
            lr=args.lr,
            betas=(0.9, 0.999),
            eps=1e-8,
            **adamw_kwargs(args),
        )
        self.clip = args.clip_grad

    def step(self, tokens, labels):
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss(tokens, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        return loss.item()


# ----------------------------------------------------------------------------- transformers


class HFTrainer(PeerTrainer):
    name = "hf"

    def __init__(self, args, ref):
        import transformers
        from transformers import GPT2Config, GPT2LMHeadModel

        transformers.logging.set_verbosity_error()
        cfg = GPT2Config(
            vocab_size=args.vocab,
            n_positions=args.seq,
            n_embd=args.hidden,
            n_layer=args.layers,
            n_head=args.heads,
            activation_function="gelu_new" if args.gelu == "tanh" else "gelu",
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            initializer_range=0.02,
            layer_norm_epsilon=1e-5,
            tie_word_embeddings=True,
            use_cache=False,
            bos_token_id=None,
            eos_token_id=None,
        )
        try:
            self.model = GPT2LMHeadModel(cfg, attn_implementation="sdpa")
        except (TypeError, ValueError):
            cfg._attn_implementation = "sdpa"
            self.model = GPT2LMHeadModel(cfg)
        self.info = (
            f"transformers {transformers.__version__}, attn_implementation "
            f"{getattr(self.model.config, '_attn_implementation', '?')}, "
            f"activation {self.model.config.activation_function}"
        )
        self.model.train()
        # Conv1D stores [in, out]: transpose our [out, in] matrices.
        sd = {
            "transformer.wte.weight": ref["wte"],
            "transformer.wpe.weight": ref["wpe"],
            "transformer.ln_f.weight": ref["ln_f.weight"],
            "transformer.ln_f.bias": ref["ln_f.bias"],
        }
        names = {
            "ln_1": "ln_1",
            "ln_2": "ln_2",
            "qkv": "attn.c_attn",
            "proj": "attn.c_proj",
            "fc1": "mlp.c_fc",
            "fc2": "mlp.c_proj",
        }
        for i in range(args.layers):
            for short, long in names.items():
                weight = ref[f"{i}.{short}.weight"]
                sd[f"transformer.h.{i}.{long}.weight"] = (
                    weight if weight.dim() == 1 else weight.t().contiguous()
                )
                sd[f"transformer.h.{i}.{long}.bias"] = ref[f"{i}.{short}.bias"]
        load_exact(self.model, sd, skip=("lm_head.weight",))
        if self.model.lm_head.weight.data_ptr() != self.model.transformer.wte.weight.data_ptr():
            raise RuntimeError("transformers did not tie lm_head to wte")
        self.set_optimizer(args)

    def loss(self, tokens, labels):
        # shift_labels: the labels already are the next tokens (else HF drops the last position).
        return self.model(input_ids=tokens, labels=labels, shift_labels=labels).loss


# ----------------------------------------------------------------------------- plain PyTorch


class Block(nn.Module):
    def __init__(self, h, heads, approximate):
        super().__init__()
        self.heads, self.approximate = heads, approximate
        self.ln_1, self.ln_2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):  # [b, s, h]
        b, s, h = x.shape
        q, k, v = (
            self.qkv(self.ln_1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        )
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln_2(x)), approximate=self.approximate))


class PlainGPT(nn.Module):
    def __init__(self, args):
        super().__init__()
        approximate = "tanh" if args.gelu == "tanh" else "none"
        self.wte = nn.Embedding(args.vocab, args.hidden)
        self.wpe = nn.Embedding(args.seq, args.hidden)
        self.blocks = nn.ModuleList(
            Block(args.hidden, args.heads, approximate) for _ in range(args.layers)
        )
        self.ln_f = nn.LayerNorm(args.hidden)

    def forward(self, tokens, labels):
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # tied head
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


class PlainTrainer(PeerTrainer):
    name = "plain"

    def __init__(self, args, ref):
        self.model = PlainGPT(args)
        sd = {
            "wte.weight": ref["wte"],
            "wpe.weight": ref["wpe"],
            "ln_f.weight": ref["ln_f.weight"],
            "ln_f.bias": ref["ln_f.bias"],
        }
        for i in range(args.layers):
            for key in ("ln_1", "ln_2", "qkv", "proj", "fc1", "fc2"):
                for kind in ("weight", "bias"):
                    sd[f"blocks.{i}.{key}.{kind}"] = ref[f"{i}.{key}.{kind}"]
        load_exact(self.model, sd)
        self.set_optimizer(args)

    def loss(self, tokens, labels):
        return self.model(tokens, labels)


# ----------------------------------------------------------------------------- workers


def build_trainer(name, args):
    """Every process builds our model from the seed: it is the source of the shared weights."""
    ours = OursTrainer(args)
    if name == "ours":
        return ours
    ref = reference_weights(ours, args)
    del ours
    return HFTrainer(args, ref) if name == "hf" else PlainTrainer(args, ref)


def worker(name, args, conn):
    """One trainer in its own process; runs steps when the parent says so."""
    try:
        torch.set_num_threads(args.threads)
        allocator = "glibc default"
        if name == "ours" or args.mallopt_baselines:
            allocator = "project setting " + configure_allocator()
        batches = make_batches(args)
        trainer = build_trainer(name, args)
        tokens, labels = split(batches[0])
        with torch.no_grad():
            first_loss = trainer.loss(tokens, labels).item()
        info = getattr(trainer, "info", "")
        info = (info + ", " if info else "") + f"allocator: {allocator}"
        conn.send(("ready", count_params(trainer.model), first_loss, info))
        step = 0
        while True:
            cmd, n = conn.recv()
            if cmd == "stop":
                break
            gc.collect()
            gc.disable()
            faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            wall0, cpu0 = time.perf_counter(), time.process_time()
            best, loss = math.inf, float("nan")
            for _ in range(n):
                s0 = time.perf_counter()
                tokens, labels = split(batches[step % len(batches)])
                loss = trainer.step(tokens, labels)
                best = min(best, time.perf_counter() - s0)
                step += 1
            wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
            usage = resource.getrusage(resource.RUSAGE_SELF)
            faults, peak_mib = (
                usage.ru_minflt - faults0,
                usage.ru_maxrss / 1024,
            )  # ru_maxrss: KiB on Linux
            gc.enable()
            conn.send((wall, cpu, best, loss, faults, peak_mib))
    except BaseException as exc:  # report, do not hang the parent
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        raise


def start_workers(args):
    ctx = mp.get_context("spawn")
    workers = {}
    for name in args.frameworks:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=worker, args=(name, args, child), daemon=True)
        proc.start()
        workers[name] = (proc, parent)
    ready = {}
    for name, (proc, conn) in workers.items():
        msg = conn.recv()
        if msg[0] == "error":
            raise SystemExit(f"{name} worker failed: {msg[1]}")
        ready[name] = msg[1:]
    return workers, ready


def ask(workers, name, n):
    proc, conn = workers[name]
    conn.send(("run", n))
    msg = conn.recv()
    if msg[0] == "error":
        raise SystemExit(f"{name} worker failed: {msg[1]}")
    return msg


def check_same_model(ready):
    """Same parameter count and the same first-batch loss (up to fp32 rounding)."""
    print("parameters: " + ", ".join(f"{n} {r[0]:,}" for n, r in ready.items()))
    print("first-batch loss: " + ", ".join(f"{n} {r[1]:.6f}" for n, r in ready.items()))
    if len({r[0] for r in ready.values()}) != 1:
        raise SystemExit("parameter counts differ: the comparison would not be fair")
    losses = [r[1] for r in ready.values()]
    if max(losses) - min(losses) > 1e-3:
        raise SystemExit(
            f"first-batch losses differ by {max(losses) - min(losses):.2e}: "
            "the models are not the same function"
        )


def profile(args):
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch.set_num_threads(args.threads)
    if args.profile == "ours" or args.mallopt_baselines:
        print(f"allocator: project setting {configure_allocator()}")
    batches = make_batches(args)
    trainer = build_trainer(args.profile, args)
    for i in range(max(args.warmup, 1)):
        trainer.step(*split(batches[i % len(batches)]))
    with torch_profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for i in range(args.profile_steps):
            trainer.step(*split(batches[i % len(batches)]))
    print(
        prof.key_averages(group_by_input_shape=True).table(
            sort_by="self_cpu_time_total",
            row_limit=30,
            max_name_column_width=45,
            max_shapes_column_width=60,
        )
    )


def run_rounds(args, workers):
    """Warm-up, then alternate the workers round by round; returns the per-round figures."""
    names = list(workers)
    tokens_per_step = args.micro_batch * args.seq
    if args.warmup:
        for name in names:
            ask(workers, name, args.warmup)
    res = {
        "rate": {n: [] for n in names},
        "cpu_rate": {n: [] for n in names},
        "best": {n: math.inf for n in names},
        "faults": {n: [] for n in names},
        "last_loss": {},
        "peak_mib": {},
    }
    t_start = time.perf_counter()
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            wall, cpu, step_best, loss, nfaults, peak_mib = ask(workers, name, args.steps)
            res["rate"][name].append(args.steps * tokens_per_step / wall)
            res["cpu_rate"][name].append(args.steps * tokens_per_step / cpu)
            res["best"][name] = min(res["best"][name], step_best)
            res["faults"][name].append(nfaults / args.steps)
            res["last_loss"][name] = loss
            res["peak_mib"][name] = peak_mib
        print(
            f"round {r + 1}/{args.rounds}: "
            + "  ".join(f"{n} {res['rate'][n][-1]:6.0f}" for n in names)
            + " tok/s",
            flush=True,
        )
        res["rounds"] = r + 1
        if time.perf_counter() - t_start > args.time_limit and r + 1 < args.rounds:
            print(f"time limit of {args.time_limit:.0f} s reached: stopping after {r + 1} rounds")
            break
    res["seconds"] = time.perf_counter() - t_start
    return res


def report(args, res, load_start):
    rate, cpu_rate, best, faults, last_loss, peak = (
        res[k] for k in ("rate", "cpu_rate", "best", "faults", "last_loss", "peak_mib")
    )
    tokens_per_step = args.micro_batch * args.seq
    # Same init, data, step count and optimizer: the runs must also train alike.
    print("loss after the last step: " + ", ".join(f"{n} {v:.4f}" for n, v in last_loss.items()))
    load_end = os.getloadavg()[0]
    print(
        f"\n{res['rounds']} rounds x {args.steps} timed steps per trainer "
        f"in {res['seconds']:.0f} s "
        f"({tokens_per_step} tokens/step, {args.threads} threads; "
        f"1-min load average {load_start:.2f} "
        f"before, {load_end:.2f} after (this run adds about {args.threads}), "
        f"on {os.cpu_count()} CPUs)"
    )
    if load_start > 0.5 * os.cpu_count() or load_end > args.threads + 0.5 * os.cpu_count():
        print(
            "  note: other processes were using the CPUs; wall-clock figures are noisy, the "
            "tok/CPU-s column (at --threads 1 especially) and the best-step ratio are the "
            "steadier figures"
        )
    print(
        f"  {'':6s} {'tok/s median':>12s} {'[min-max] over rounds':>22s} {'best step':>10s} "
        f"{'tok/CPU-s':>10s} {'faults/step':>12s} {'peak RSS MiB':>13s}"
    )
    for n in rate:
        spread = f"[{min(rate[n]):.0f}-{max(rate[n]):.0f}]"
        print(
            f"  {n:6s} {statistics.median(rate[n]):12.0f} {spread:>22s} "
            f"{tokens_per_step / best[n]:10.0f} "
            f"{statistics.median(cpu_rate[n]):10.0f} {statistics.median(faults[n]):12.0f} "
            f"{peak[n]:13.0f}"
        )
    for other in ("hf", "plain"):
        if other in rate:
            per_round = [a / b for a, b in zip(rate["ours"], rate[other])]
            cpu_ratio = statistics.median(cpu_rate["ours"]) / statistics.median(cpu_rate[other])
            print(
                f"  ours/{other:<5s} {statistics.median(per_round):.3f}  "
                f"(median of per-round ratios: "
                f"{', '.join(f'{x:.2f}' for x in per_round)}; "
                f"best-step ratio {best[other] / best['ours']:.3f}, "
                f"CPU-time ratio {cpu_ratio:.3f})"
            )
    spread = max(last_loss.values()) - min(last_loss.values())
    if spread > 5e-3:
        raise SystemExit(
            f"FAIL: the trainers' last losses differ by {spread:.2e}: they did not train the same "
            "model, so the figures above are not comparable"
        )


def main(argv=None):
    args = parse_args(argv)
    print(
        f"torch {torch.__version__}, {args.threads} threads per worker, cpu_count {os.cpu_count()}"
    )
    print(
        f"model: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, seq {args.seq}, "
        f"vocab {args.vocab}, micro batch {args.micro_batch}, fp32, GELU {args.gelu}, "
        f"baselines' AdamW impl {args.adam_impl}, ours cross_entropy_loss_fusion "
        f"{'off' if args.no_ce_fusion else 'on'}, ours attention backend {args.attention_backend}"
        f"{', project allocator setting for baselines' if args.mallopt_baselines else ''}"
    )
    if args.profile:
        profile(args)
        return
    load_start = os.getloadavg()[0]
    workers, ready = start_workers(args)
    try:
        for name, r in ready.items():
            if r[2]:
                print(f"{name}: {r[2]}")
        check_same_model(ready)
        res = run_rounds(args, workers)
    finally:
        for proc, conn in workers.values():
            try:
                conn.send(("stop", 0))
            except (BrokenPipeError, OSError):
                pass
        for proc, _ in workers.values():
            proc.join(timeout=30)
    report(args, res, load_start)


if __name__ == "__main__":
    main()
