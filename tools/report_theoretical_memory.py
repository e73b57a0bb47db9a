"""Print the theoretical memory per GPU of a pretrain_gpt.py flag set, without launching anything.

    python tools/report_theoretical_memory.py --world-size 8 <pretrain_gpt.py flags>

The flags go through the real parser and ``validate_args`` as if ``--world-size`` processes
(default: the WORLD_SIZE environment variable, else 1) were started; the tokenizer is built to
learn the padded vocabulary (a tokenizer file missing here leaves the embedding terms at 0, with
a note). Then, for every pipeline stage, Megatron's line

    Theoretical memory footprints: weight and optimizer=X MB, activation=Y MB, total=Z MB

and its breakdown (weights, gradients, optimizer state, activations by component) are printed.
Stage 0's line is the one rank 0 prints when training starts. Memory features that this code
base does not run yet (``--overlap-param-gather-with-optimizer-step``) are accounted as Megatron
would and noted on stderr, so a plan can be checked before the feature lands; other refused flags
are errors. Exit status 0, or 2 with ``error: <message>`` on stderr.
"""

import os
import sys
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.training import flag_policy  # noqa: E402
from megatron.training.arguments import (  # noqa: E402
    ArgumentValidationError,
    parse_args,
    validate_args,
)
from megatron.training.dry_run import split_int_flag  # noqa: E402
from megatron.training.model_families import get_model_family  # noqa: E402
from megatron.training.theoretical_memory import (  # noqa: E402
    compute_theoretical_memory,
    num_microbatches_from_args,
)

WORLD_SIZE_FLAG = "--world-size"
GPT = get_model_family("gpt")  # the flags are pretrain_gpt.py's
# The trainer refuses these, but the memory model describes them fully (Megatron's report
# accounts for them), so a planned run can be checked.
ACCOUNTED_BEFORE_THEY_RUN = frozenset(
    {
        "overlap_param_gather_with_optimizer_step",
    }
)


def split_world_size(argv: Sequence[str]) -> Tuple[Optional[int], List[str]]:
    """(value of --world-size or None, the remaining pretrain_gpt.py flags)."""
    world_size, rest = split_int_flag(argv, WORLD_SIZE_FLAG)
    if world_size is not None and world_size < 1:
        raise ArgumentValidationError(f"{WORLD_SIZE_FLAG} must be >= 1 (got {world_size})")
    return world_size, rest


def _not_yet_supported(args) -> List[Tuple[str, str]]:
    """(dest, flag as given) of every refused flag the args give."""
    return [(dest, flag) for dest, flag, _ in flag_policy.given_flags(args, flag_policy.REFUSED)]


def validated_args(argv: Sequence[str], world_size: int):
    """Parse and validate like a run of ``world_size`` processes; returns (args, notes).
    Raises ArgumentValidationError for flags a run refuses, except the memory features that the
    report accounts before they run (returned as notes)."""
    args = parse_args(argv=list(argv))  # argparse exits with status 2 on unknown flags
    args.world_size, args.rank = world_size, 0
    try:
        validate_args(args, dict(GPT.args_defaults))
        return args, []
    except ArgumentValidationError as exc:
        # The refusal of unimplemented features is validate_args' last step: every rule before
        # it has passed and filled in the derived values.
        refused = _not_yet_supported(args)
        if (
            not str(exc).startswith("not supported yet")
            or not refused
            or not {dest for dest, _ in refused} <= ACCOUNTED_BEFORE_THEY_RUN
        ):
            raise
        flags = ", ".join(flag for _, flag in refused)
        return args, [
            f"note: {flags} not supported by this code base yet (a run stops at start-up); "
            "accounted here as in Megatron"
        ]


def _padded_vocab(args) -> Optional[str]:
    from megatron.training.tokenizer import build_tokenizer

    try:
        build_tokenizer(args)
    except Exception as exc:  # a tokenizer file that only exists on the cluster
        args.padded_vocab_size = None
        return (
            f"note: the tokenizer could not be built here ({type(exc).__name__}: {exc}); "
            "embedding and output layer counted as 0"
        )
    return None


def report_lines(args) -> List[str]:
    """The report for validated ``args`` with ``padded_vocab_size`` set."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    cp, dp = args.context_parallel_size, args.data_parallel_size
    m = num_microbatches_from_args(args)
    precision = "bf16" if args.bf16 else ("fp16" if args.fp16 else "fp32")
    recompute = args.recompute_granularity or "none"
    if recompute == "full":
        recompute += f" ({args.recompute_method}, {args.recompute_num_layers} layers)"
    elif recompute == "selective":
        recompute += f" ({', '.join(args.recompute_modules or ['core_attn'])})"
    lines = [
        f"theoretical memory per GPU: world size {args.world_size} = "
        f"TP {tp} x PP {pp} x CP {cp} x DP {dp}"
        f"{' (sequence parallel)' if args.sequence_parallel else ''}, {precision}, "
        f"optimizer {args.optimizer}{' (distributed)' if args.use_distributed_optimizer else ''}, "
        f"recompute {recompute}, {m} micro-batches of "
        f"{args.micro_batch_size} x {args.seq_length} tokens"
    ]
    for rank in range(pp):
        memory = compute_theoretical_memory(args, m, pp_rank=rank, family=GPT)
        if pp > 1:
            lines.append(f"pipeline stage {rank} of {pp}:")
        lines.append(memory.summary_line())
        lines.extend(memory.breakdown_lines())
    return lines


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        world_size, megatron_argv = split_world_size(argv)
        if world_size is None:
            world_size = int(os.environ.get("WORLD_SIZE", "1"))
        args, notes = validated_args(megatron_argv, world_size)
    except ArgumentValidationError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    vocab_note = _padded_vocab(args)
    for note in notes + ([vocab_note] if vocab_note else []):
        print(note, file=sys.stderr, flush=True)
    print("\n".join(report_lines(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
