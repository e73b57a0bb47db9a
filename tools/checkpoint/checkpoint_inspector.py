"""Megatron-LM's checkpoint inspector, for the conversion into the fsdp_dtensor format (its
``tools/checkpoint/checkpoint_inspector.py``; same command name and arguments):

    python tools/checkpoint/checkpoint_inspector.py convert-torch-dist-to-fsdp-dtensor \\
        ckpt/iter_0000100 ckpt_fsdp/iter_0000100

INPUT is one iteration directory of a torch_dist checkpoint, OUTPUT the fsdp_dtensor iteration
directory to write (one process, CPU; Megatron-LM's tool runs under torchrun on GPUs). The
tracker next to OUTPUT is written too, so ``--load ckpt_fsdp`` resumes from it. SwiGLU's fc1
stays whole (Megatron-LM's ``--swiglu`` split is not written by this code base's fsdp_dtensor
format either). The other direction is a run: ``--use-megatron-fsdp --ckpt-format fsdp_dtensor
--load DIR --ckpt-convert-format torch_dist --ckpt-convert-save OUT``.
"""

from __future__ import annotations

import argparse
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from megatron.checkpointing.errors import ConversionError  # noqa: E402
from megatron.checkpointing.fsdp_dtensor import convert_torch_dist_to_fsdp_dtensor  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    convert = commands.add_parser(
        "convert-torch-dist-to-fsdp-dtensor",
        help="Convert a torch_dist checkpoint to the fsdp_dtensor format.",
    )
    convert.add_argument("input_dir")
    convert.add_argument("output_dir")
    convert.add_argument(
        "--no-optimizer",
        action="store_true",
        help="Convert the model weights only (needed for a distributed-optimizer state saved "
        "in megatron-core's dp_reshardable layout).",
    )
    args = parser.parse_args(argv)
    try:
        keys = convert_torch_dist_to_fsdp_dtensor(
            args.input_dir, args.output_dir, optimizer=not args.no_optimizer
        )
    except ConversionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"Converted checkpoint saved to {args.output_dir} ({len(keys)} items).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
