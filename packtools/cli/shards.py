"""``packtools shard-pack``: pack tokenized files shard by shard (local, process pool or Ray) into a folder.

Also the pieces other subcommands reuse: :func:`add_executor_arguments` adds ``--executor/--workers/--address/
--shard-rows/--retries`` to a parser, and :func:`run_sharded` runs :func:`packtools.pack_shards` from them.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ..core.plan import STRATEGIES
from ..errors import PackingError
from ..pipeline.executors import EXECUTORS
from ..pipeline.shards import DEFAULT_SHARD_ROWS, format_report, pack_shards

# options of `packtools pack` that only its full pipeline honours: flag -> argparse dest
PIPELINE_ONLY = {
    "--tokenizer": "tokenizer",
    "--format": "format",
    "--overlong": "overlong",
    "--max-prompt-length": "max_prompt_length",
    "--shuffle": "shuffle",
}


def add_executor_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the sharding and executor options (``args.executor``, ``workers``, ``address``, ``shard_rows``,
    ``retries``)."""
    g = parser.add_argument_group("sharding and executors")
    g.add_argument(
        "--executor",
        choices=EXECUTORS,
        default="local",
        help="run shards in this process (local, default), a process pool (pool) or as Ray tasks (ray)",
    )
    g.add_argument(
        "--workers", type=int, help="processes for pool / CPUs for a local Ray (default: all cores)"
    )
    g.add_argument("--address", help="Ray cluster address for --executor ray (default: start Ray locally)")
    g.add_argument(
        "--shard-rows",
        type=int,
        help=f"cut each file into row ranges of at least this many rows (default {DEFAULT_SHARD_ROWS:,}; "
        "0: one shard per file)",
    )
    g.add_argument("--retries", type=int, default=2, help="tries again per failing shard (default 2)")


def wants_sharding(args: argparse.Namespace) -> bool:
    """True when the user asked for sharded packing (an executor other than local, an address, --shard-rows)."""
    return args.executor != "local" or args.address is not None or args.shard_rows is not None


def run_sharded(
    inputs: Sequence[str],
    out_dir: str,
    max_length: int,
    strategy: str,
    columns: Sequence[str] | None,
    args: argparse.Namespace,
) -> int:
    """Pack ``inputs`` into ``out_dir`` with the options of :func:`add_executor_arguments`; print the report;
    return the exit status (1 if a shard failed)."""
    unsupported = [
        flag
        for flag, name in PIPELINE_ONLY.items()
        if getattr(args, name, None) not in (None, False)
        and not (name == "format" and args.format == "tokenized")
    ]
    if unsupported:
        raise PackingError(
            f"{', '.join(unsupported)} cannot be used with sharded packing (--executor/--address/--shard-rows), "
            "which packs already-tokenized files shard by shard as they are; drop them, or drop the sharding "
            "options to run the full pipeline."
        )
    report = pack_shards(
        inputs,
        out_dir,
        max_length,
        strategy,
        columns,
        shard_rows=DEFAULT_SHARD_ROWS if args.shard_rows is None else args.shard_rows or None,
        executor=args.executor,
        workers=args.workers,
        address=args.address,
        retries=args.retries,
    )
    print(format_report(report))
    return 0 if report.ok else 1


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "shard-pack",
        help="pack tokenized files shard by shard into a folder (local, pool or Ray), with a manifest",
        description="Pack tokenized .parquet/.arrow files shard by shard: each shard (a row range of one file) "
        "is packed on its own and written to OUT/<shard id>.parquet, with OUT/manifest.json listing shards and "
        "stats. A rerun skips shards already done with the same settings.",
    )
    p.add_argument("input", nargs="+", help="tokenized .parquet or .arrow files")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--max-length", type=int, default=4096, help="tokens per packed row (default 4096)")
    p.add_argument("--strategy", choices=STRATEGIES, default="bfd", help="packing strategy (default bfd)")
    p.add_argument("--columns", help="comma-separated list columns to pack (default: all columns)")
    add_executor_arguments(p)
    return p


def run(args: argparse.Namespace) -> int:
    columns = args.columns.split(",") if args.columns else None
    return run_sharded(args.input, args.out, args.max_length, args.strategy, columns, args)
