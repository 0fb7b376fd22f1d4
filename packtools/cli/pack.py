"""``packtools pack``: raw, chat, preference or tokenized files to a packed dataset folder, out of core.

``packtools pack INPUT... --out DIR --max-length N`` runs :func:`packtools.pipeline.run.pack_files` and prints a
summary.  Two older forms stay: ``--out FILE.parquet|.arrow`` packs one tokenized file in memory and writes one
file; without ``--out`` a tokenized file is only planned (the summary is printed).  Without INPUT, a built-in
sample (the standard library's sources, byte-level) is packed in memory with every strategy; ``packtools demo``
runs the whole pipeline on it.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from ..constants import INPUT_FORMATS
from ..core.pack import pack_table, read_columns
from ..core.plan import STRATEGIES, plan
from ..io.files import read_table, write_table
from ..pipeline.summary import format_pipeline_summary, format_summary
from .shards import add_executor_arguments, run_sharded, wants_sharding


def add_pipeline_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-length", type=int, default=None, help="tokens per packed row (default 4096)")
    p.add_argument("--strategy", choices=STRATEGIES, default="bfd", help="packing strategy (default bfd)")
    p.add_argument("--tokenizer", metavar="DIR", help="local transformers tokenizer folder (for text input)")
    p.add_argument(
        "--format",
        choices=INPUT_FORMATS,
        help="input format (default: from the columns: text | prompt+completion | messages | "
        "prompt+chosen+rejected | input_ids)",
    )
    p.add_argument("--num-proc", type=int, default=1, help="tokenizer processes (default 1)")
    p.add_argument(
        "--overlong",
        choices=("truncate", "drop", "split"),
        help="sequences longer than --max-length: keep the start, drop them, or split them (default: truncate "
        "for bfd and preference data, split for bfd_split/wrapped)",
    )
    p.add_argument(
        "--max-prompt-length",
        type=int,
        help="preference data, --overlong truncate: tokens an over-long pair's prompt keeps at least, from its end "
        "(default max_length // 4: its two copies fill at most half a row)",
    )
    p.add_argument(
        "--no-eos", action="store_true", help="do not append the tokenizer's EOS to text/completions"
    )
    p.add_argument(
        "--columns", help="comma-separated token columns to pack (tokenized input; default: all lists)"
    )
    p.add_argument("--shuffle", action="store_true", help="shuffle packed rows")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--shard-tokens",
        type=int,
        default=1 << 24,
        help="tokens per output shard / write slice (default 2**24)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars and no summary")


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "pack",
        help="tokenize, truncate and pack files into a dataset folder (no input: a built-in sample)",
        description="Tokenize (unless already tokenized), truncate or filter, and pack INPUT... (.jsonl/.json, "
        ".parquet, .arrow/.feather files, directories of them, datasets save_to_disk folders) into --out DIR, "
        "a folder datasets.load_from_disk opens, with a manifest; a rerun with the same inputs and options does "
        "nothing. Out of core: memory does not grow with the token count. --out FILE.parquet|.arrow packs one "
        "tokenized file in memory instead. Without INPUT, packs a built-in sample (the standard library's "
        "sources, byte-level) in memory with every strategy; `packtools demo` runs the whole pipeline on it.",
    )
    p.add_argument("input", nargs="*", help="input files, directories or save_to_disk folders")
    p.add_argument("--out", help="output folder (or a .parquet/.arrow file for tokenized input, in memory)")
    add_pipeline_arguments(p)
    add_executor_arguments(p)  # tokenized inputs, shard by shard (local, pool or Ray): packtools.cli.shards
    return p


def pipeline_config(args: argparse.Namespace, max_length: int) -> Any:
    from ..pipeline.run import PipelineConfig

    return PipelineConfig(
        max_length=max_length,
        strategy=args.strategy,
        format=args.format,
        tokenizer=os.path.abspath(args.tokenizer) if args.tokenizer else None,
        overlong=args.overlong,
        columns=tuple(args.columns.split(",")) if args.columns else None,
        add_eos=not args.no_eos,
        max_prompt_length=args.max_prompt_length,
        shuffle=args.shuffle,
        seed=args.seed,
        shard_tokens=args.shard_tokens,
    )


def _in_memory(args: argparse.Namespace, max_length: int) -> int:
    """The first form of the command: one tokenized file (or the built-in sample), packed in memory."""
    from ..errors import PackingError

    columns = args.columns.split(",") if args.columns else None
    if not args.input:
        from ..pipeline.sample import stdlib_table

        table = stdlib_table()
        print(f"built-in sample: {table.num_rows:,} standard-library source files, byte-level ids")
        strategies = list(STRATEGIES)
    else:
        if len(args.input) != 1 or not os.path.isfile(args.input[0]):
            raise PackingError(
                "--out FILE (or no --out) packs one tokenized .parquet/.arrow file in memory; for several inputs, "
                "directories or text, give --out DIR."
            )
        table = read_table(args.input[0])
        strategies = [args.strategy]
    _, lengths = read_columns(table, columns)
    results = []
    packed = None
    for strategy in strategies:
        start = time.perf_counter()
        p = plan(lengths, max_length, strategy)
        if args.shuffle:
            p = p.shuffled(args.seed)
        out = pack_table(table, max_length, strategy, columns, plan=p) if args.out else None
        results.append((p, time.perf_counter() - start))
        if strategy == args.strategy:
            packed = out
    print(format_summary(results))
    if not args.input:
        print(
            "\nrun `packtools demo` for the whole pipeline on this sample (profile, plot, packed dataset folder)."
        )
    if args.out and packed is not None:
        write_table(packed, args.out)
        print(f"wrote {packed.num_rows:,} packed rows ({args.strategy}) to {args.out}")
    return 0


def run(args: argparse.Namespace) -> int:
    max_length = args.max_length if args.max_length is not None else 4096
    if args.input and args.out and not args.out.endswith((".parquet", ".arrow")) and wants_sharding(args):
        columns = args.columns.split(",") if args.columns else None
        return run_sharded(args.input, args.out, max_length, args.strategy, columns, args)
    if not args.input or args.out is None or args.out.endswith((".parquet", ".arrow")):
        return _in_memory(args, max_length)
    from ..pipeline.run import run_pipeline

    result = run_pipeline(
        args.input, args.out, pipeline_config(args, max_length), num_proc=args.num_proc, quiet=args.quiet
    )
    if not args.quiet:
        print(format_pipeline_summary(result.stats, result.out, result.cached))
    return 0
