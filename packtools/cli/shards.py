"""``packtools shard-pack``, deprecated: it is ``packtools pack --plan shards``.

Kept so that scripts using it go on working; it takes ``pack``'s options, says on stderr that it is
deprecated and which command to use, and writes the same output folder (a ``datasets.load_from_disk`` folder
with ``manifest.json``).  ``--shard-rows`` is ``--part-rows``.
"""

from __future__ import annotations

import argparse
import sys

from .pack import add_executor_arguments, add_pipeline_arguments


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "shard-pack",
        help="deprecated: use `packtools pack --plan shards` (the same engine and output)",
        description="Deprecated: use `packtools pack --plan shards --part-rows N`. Runs exactly that: every "
        "input part (a parquet row-group range, a JSON-lines byte range or a file) is planned on its own, and "
        "the plans are put one after the other. Same options and output as `packtools pack`.",
    )
    p.add_argument("input", nargs="+", help="input files, directories or save_to_disk folders")
    p.add_argument("--out", required=True, help="output folder")
    add_pipeline_arguments(p)
    add_executor_arguments(p)
    p.add_argument("--shard-rows", type=int, dest="part_rows", help=argparse.SUPPRESS)
    p.set_defaults(plan="shards")
    return p


def run(args: argparse.Namespace) -> int:
    from . import pack

    if args.part_rows is None:
        args.part_rows = 1 << 17
    print(
        "packtools shard-pack is deprecated: use `packtools pack --plan shards --part-rows N` "
        "(the same engine and output); running it now.",
        file=sys.stderr,
    )
    return pack.run(args)
