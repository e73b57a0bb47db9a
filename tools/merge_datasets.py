#!/usr/bin/env python3
"""Concatenate every ``.bin/.idx`` dataset in a directory into one dataset.

    python tools/merge_datasets.py --input data/shards --output-prefix data/merged

Every prefix in ``--input`` that has both a ``.bin`` and an ``.idx`` is appended, in sorted name
order (a ``.bin`` or ``.idx`` without its partner is reported and skipped; the output prefix
itself is skipped if it lies in that directory). All inputs must share one token dtype; a
mismatch stops with an error naming both files. The output is written under temporary names
and renamed at the end, so a failed merge leaves nothing that looks complete.
"""

import argparse
import os
import sys
from typing import List, Optional

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

PARTIAL = ".partial"


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Merge the .bin/.idx datasets of a directory.", allow_abbrev=False
    )
    g = parser.add_argument_group("input data")
    g.add_argument(
        "--input",
        type=str,
        required=True,
        help="Directory holding <prefix>.bin/<prefix>.idx pairs.",
    )
    g = parser.add_argument_group("output data")
    g.add_argument(
        "--output-prefix", type=str, required=True, help="Prefix of the merged .bin/.idx."
    )
    g = parser.add_argument_group("miscellaneous")
    g.add_argument(
        "--multimodal", action="store_true", help="The datasets carry per-sequence modes."
    )
    return parser.parse_args(argv)


def find_prefixes(directory: str, exclude: Optional[str] = None) -> List[str]:
    """Sorted prefixes with both files; warns about unpaired files."""
    if not os.path.isdir(directory):
        raise ValueError(f"--input {directory}: not a directory")
    stems = {}
    for name in os.listdir(directory):
        stem, ext = os.path.splitext(name)
        if ext in (".bin", ".idx") and os.path.isfile(os.path.join(directory, name)):
            stems.setdefault(stem, set()).add(ext)
    prefixes = []
    for stem in sorted(stems):
        prefix = os.path.join(directory, stem)
        if exclude is not None and os.path.abspath(prefix) == os.path.abspath(exclude):
            continue
        if stems[stem] == {".bin", ".idx"}:
            prefixes.append(prefix)
        else:
            missing = ({".bin", ".idx"} - stems[stem]).pop()
            print(
                f"warning: skipping {prefix}{stems[stem].pop()}: no {prefix}{missing}",
                file=sys.stderr,
            )
    if not prefixes:
        raise ValueError(f"--input {directory}: no <prefix>.bin/<prefix>.idx pairs found")
    return prefixes


def merge(prefixes: List[str], output_prefix: str, multimodal: bool = False) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

    dtypes = [(p, IndexedDataset(p, multimodal=multimodal).dtype) for p in prefixes]
    first, dtype = dtypes[0]
    for prefix, other in dtypes[1:]:
        if other != dtype:
            raise ValueError(
                f"dtype mismatch: {prefix}.idx holds {other.__name__} tokens but {first}.idx holds "
                f"{dtype.__name__}; re-run preprocess_data.py on one of them "
                "with the same tokenizer"
            )
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    for ext in (".bin", ".idx"):
        if os.path.exists(output_prefix + ext):
            os.remove(output_prefix + ext)
    builder = IndexedDatasetBuilder(
        output_prefix + ".bin" + PARTIAL, dtype=dtype, multimodal=multimodal
    )
    try:
        for prefix in prefixes:
            builder.add_index(prefix)
        builder.finalize(output_prefix + ".idx" + PARTIAL)
        os.replace(output_prefix + ".bin" + PARTIAL, output_prefix + ".bin")
        os.replace(output_prefix + ".idx" + PARTIAL, output_prefix + ".idx")
    except BaseException:
        builder.abort()
        for ext in (".bin", ".idx"):
            if os.path.exists(output_prefix + ext + PARTIAL):
                os.remove(output_prefix + ext + PARTIAL)
        raise


def main(argv: Optional[List[str]] = None) -> int:
    args = get_args(argv)
    try:
        prefixes = find_prefixes(args.input, exclude=args.output_prefix)
        merge(prefixes, args.output_prefix, multimodal=args.multimodal)
    except (ValueError, FileNotFoundError) as e:
        print(str(e), file=sys.stderr)
        return 1
    print(f"Merged {len(prefixes)} datasets into {args.output_prefix}.bin/.idx", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
