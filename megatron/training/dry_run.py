"""Check a pretrain_gpt.py command line without training: parse, validate, print the layout.

    WORLD_SIZE=64 python -m megatron.training.dry_run <pretrain_gpt.py flags>
    python -m megatron.training.dry_run --dry-run-world-size 64 <pretrain_gpt.py flags>

The flags go through the real parser and ``validate_args`` as if ``WORLD_SIZE`` processes were
started (``--dry-run-world-size`` wins over the environment; default 1), with the argument
defaults of the model family named by ``--dry-run-model`` (default gpt: pretrain_gpt.py's;
see megatron/training/model_families/). The layout is printed:
parallel sizes, micro-batches per step, tokens per step, the parameter count computed from the
flags, and the memory the model states (weights, gradients, optimizer) need per GPU. Nothing
is trained and torch.distributed is never initialized. Exit status: 0 when the flags are
valid, 2 with ``error: <message>`` on stderr when they are not (the message a real run prints).
"""

import sys
from typing import List, Optional, Sequence, Tuple

from megatron.training.arguments import ArgumentValidationError, parse_args, validate_args
from megatron.training.model_families import ModelFamily, get_model_family
from megatron.training.theoretical_memory import bytes_per_parameter, compute_theoretical_memory

WORLD_SIZE_FLAG = "--dry-run-world-size"
MODEL_FLAG = "--dry-run-model"


def split_flag(argv: Sequence[str], flag: str) -> Tuple[Optional[str], List[str]]:
    """(value of ``flag`` (``flag V`` or ``flag=V``; the last one given) or None, the remaining
    flags)."""
    rest, value, index = [], None, 0
    argv = list(argv)
    while index < len(argv):
        item = argv[index]
        if item == flag or item.startswith(flag + "="):
            if "=" in item:
                value = item.split("=", 1)[1]
            elif index + 1 < len(argv):
                index += 1
                value = argv[index]
            else:
                raise ArgumentValidationError(f"{flag} needs a value")
        else:
            rest.append(item)
        index += 1
    return value, rest


def split_int_flag(argv: Sequence[str], flag: str) -> Tuple[Optional[int], List[str]]:
    """(integer value of ``flag`` (``flag N`` or ``flag=N``) or None, the remaining flags)."""
    text, rest = split_flag(argv, flag)
    if text is None:
        return None, rest
    try:
        return int(text), rest
    except ValueError:
        raise ArgumentValidationError(f"{flag} must be an integer (got {text!r})") from None


def split_own_flags(argv: Sequence[str]) -> Tuple[Optional[int], List[str]]:
    """(world size given by --dry-run-world-size or None, the remaining Megatron flags)."""
    return split_int_flag(argv, WORLD_SIZE_FLAG)


def split_model_flag(argv: Sequence[str]) -> Tuple[ModelFamily, List[str]]:
    """(the family named by --dry-run-model, default gpt; the remaining flags)."""
    name, rest = split_flag(argv, MODEL_FLAG)
    try:
        return get_model_family(name or "gpt"), rest
    except ValueError as exc:
        raise ArgumentValidationError(f"{MODEL_FLAG}: {exc}") from None


def _human(count: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(count) >= size:
            return f"{count / size:.2f}{unit}"
    return str(int(count))


def _padded_vocab(args):
    """Build the tokenizer like a real run does (it sets args.padded_vocab_size)."""
    from megatron.training.tokenizer import build_tokenizer

    try:
        build_tokenizer(args)
    except Exception as exc:  # a tokenizer file that only exists on the cluster
        return None, f"{type(exc).__name__}: {exc}"
    return args.padded_vocab_size, None


def layout_lines(
    args, padded_vocab: Optional[int], vocab_problem: Optional[str], family: ModelFamily = None
):
    """[(name, value)] describing the validated ``args`` (parameters counted by ``family``'s
    formula; default GPT's)."""
    family = family or get_model_family("gpt")
    tp, pp, cp = (
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.context_parallel_size,
    )
    dp, mbs, gbs = args.data_parallel_size, args.micro_batch_size, args.global_batch_size
    lines = [
        ("world size", args.world_size),
        ("tensor model parallel size (TP)", tp),
        ("pipeline model parallel size (PP)", pp),
        ("context parallel size (CP)", cp),
        ("data parallel size (DP)", dp),
        ("expert model parallel size (EP)", args.expert_model_parallel_size),
        ("expert tensor parallel size (ETP)", args.expert_tensor_parallel_size or tp),
        ("sequence parallel", "on" if args.sequence_parallel else "off"),
        ("micro batch size", mbs),
        ("global batch size", gbs),
        ("micro-batches per step", gbs // (mbs * dp)),
        ("sequence length", args.seq_length),
        ("tokens per step", gbs * args.seq_length),
    ]
    if args.rampup_batch_size is not None:
        lines.append(("batch size ramp-up", " ".join(str(v) for v in args.rampup_batch_size)))
    if args.train_iters is not None:
        lines.append(("training iterations", args.train_iters))
        lines.append(("training tokens", _human(args.train_iters * gbs * args.seq_length)))
    elif args.train_samples is not None:
        lines.append(("training samples", args.train_samples))
        lines.append(("training tokens", _human(args.train_samples * args.seq_length)))
    precision = "bf16" if args.bf16 else ("fp16" if args.fp16 else "fp32")
    lines.append(("precision", precision))
    count = family.count_parameters(args, padded_vocab)
    if padded_vocab is None:
        lines.append(("padded vocab size", f"unknown ({vocab_problem})"))
        lines.append(("parameters without embeddings", f"{count.total} ({_human(count.total)})"))
        return lines
    lines.append(("padded vocab size", padded_vocab))
    lines.append(("parameters", f"{count.total} ({_human(count.total)})"))
    if count.mtp_layers:
        main = count.total - count.mtp_total
        lines.append(("parameters of the main model", f"{main} ({_human(main)})"))
        lines.append(
            (
                "parameters of the MTP layers",
                f"{count.mtp_total} ({_human(count.mtp_total)}) in {count.mtp_layers} "
                "depth(s); the embedding and output layer are the main model's",
            )
        )
    if getattr(count, "num_moe_layers", 0):
        lines.append(_experts_line(args, count))
    largest = count.largest_rank(tp, pp)
    lines.append(
        ("parameters on the largest model-parallel rank", f"{largest} ({_human(largest)})")
    )
    per = bytes_per_parameter(args)
    # The routed experts' optimizer state (and ZeRO-2's gradients) are sharded over expert DP,
    # not DP x CP.
    expert_extra = per.expert_optimizer - per.optimizer + per.expert_grad - per.grad
    state, experts = max(
        (
            count.on_rank(tp, pp, rank, n) * per.total
            + count.experts_on_rank(n, rank, pp) * expert_extra,
            count.experts_on_rank(n, rank, pp),
        )
        for rank, n in enumerate(count.rank_layers(pp))
    )
    experts_note = (
        f"; routed experts' optimizer state over {per.expert_shards} expert-DP ranks"
        if experts and per.expert_shards != per.shards
        else ""
    )
    lines.append(
        (
            "model-state memory per GPU (GB)",
            f"{state / 2**30:.2f} ({per.total:g} bytes/param: weights, "
            f"grads, optimizer{experts_note}; activations not included)",
        )
    )
    return lines


def _experts_line(args, count):
    """The routed experts and the parameters one token activates: the main model's, and with
    MTP those of each MTP depth besides (DeepSeek quotes the main model's)."""
    inactive = 1 - args.moe_router_topk / args.num_experts
    experts = count.num_moe_layers * count.moe_experts
    main = count.total - count.mtp_total
    active = round(main - experts * inactive)
    text = (
        f"{args.num_experts} per MoE layer in {count.num_moe_layers} layers, top-"
        f"{args.moe_router_topk}: {experts} ({_human(experts)}) expert parameters, "
        f"{active} ({_human(active)}) active per token"
    )
    if count.mtp_layers:
        mtp_active = round(count.mtp_total - count.mtp_experts * inactive)
        text += f" in the main model, {mtp_active} ({_human(mtp_active)}) more in the MTP layers"
    return ("experts", text)


def format_lines(lines) -> str:
    body = [f"  {name} {'.' * max(1, 48 - len(name))} {value}" for name, value in lines]
    return "\n".join(
        [
            "------------------------ dry run: layout ------------------------",
            *body,
            "-------------------- end of dry run: layout ---------------------",
        ]
    )


def main(argv=None) -> int:
    import os

    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        world_size, megatron_argv = split_own_flags(argv)
        family, megatron_argv = split_model_flag(megatron_argv)
    except ArgumentValidationError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    args = parse_args(argv=megatron_argv)  # argparse exits with status 2 on unknown flags
    args.world_size, args.rank = world_size, 0
    try:
        validate_args(args, dict(family.args_defaults))
        family.check_args(args)
    except ArgumentValidationError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    if args.no_effect_note:
        print(f" > {args.no_effect_note}", flush=True)  # as a real run prints it at start-up
    padded_vocab, problem = _padded_vocab(args)
    print(format_lines(layout_lines(args, padded_vocab, problem, family)), flush=True)
    if padded_vocab is not None:
        # What rank 0 (first pipeline stage) prints at start-up; the breakdown per stage comes
        # from tools/report_theoretical_memory.py.
        print(compute_theoretical_memory(args, family=family).summary_line(), flush=True)
    print(
        f"dry run OK: the flags are valid for {world_size} processes "
        "(nothing was trained; torch.distributed was not initialized)",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
