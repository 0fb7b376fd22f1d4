"""``packtools pack``: pack an already-tokenized parquet/arrow file, or a built-in sample."""

from __future__ import annotations

import argparse
import time

from .io import read_table, write_table
from .packing import pack_table, read_columns
from .planning import STRATEGIES, PackPlan, plan


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "pack",
        help="pack a tokenized .parquet/.arrow file (no input: a built-in sample, all strategies)",
        description="Pack list columns of a tokenized file into rows of --max-length tokens. Without INPUT, "
        "packs a built-in sample (the standard library's sources, byte-level) with every strategy.",
    )
    p.add_argument("input", nargs="?", help="tokenized .parquet or .arrow file")
    p.add_argument("--out", help="output .parquet or .arrow file (written atomically)")
    p.add_argument("--max-length", type=int, default=4096, help="tokens per packed row (default 4096)")
    p.add_argument("--strategy", choices=STRATEGIES, default="bfd", help="packing strategy (default bfd)")
    p.add_argument("--columns", help="comma-separated list columns to pack (default: all columns)")
    p.add_argument("--shuffle", action="store_true", help="shuffle packed rows")
    p.add_argument("--seed", type=int, default=0)
    return p


def format_summary(results: list[tuple[PackPlan, float]]) -> str:
    """A text table with one column per plan."""
    rows = [
        ("strategy", lambda p: p.strategy),
        ("max_length", lambda p: f"{p.max_length:,}"),
        ("rows in", lambda p: f"{p.num_sequences:,}"),
        ("empty rows", lambda p: f"{p.num_empty:,}"),
        ("rows out", lambda p: f"{p.num_rows:,}"),
        ("lower bound", lambda p: f"{p.lower_bound:,}"),
        ("rows over bound", lambda p: f"{p.num_rows - p.lower_bound:,}"),
        ("tokens in", lambda p: f"{p.tokens_in:,}"),
        ("tokens kept", lambda p: f"{p.tokens_kept:,}"),
        ("tokens dropped", lambda p: f"{p.tokens_dropped:,}"),
        ("fill", lambda p: f"{100 * p.fill:.2f}%"),
    ]
    cells = [[label] + [fn(p) for p, _ in results] for label, fn in rows]
    cells.append(["time"] + [f"{t:.3f} s" for _, t in results])
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    columns = args.columns.split(",") if args.columns else None
    if args.input is None:
        from .sample import stdlib_table

        table = stdlib_table()
        print(f"built-in sample: {table.num_rows:,} standard-library source files, byte-level ids")
        strategies = list(STRATEGIES)
    else:
        table = read_table(args.input)
        strategies = [args.strategy]
    _, lengths = read_columns(table, columns)
    results = []
    packed = None
    for strategy in strategies:
        start = time.perf_counter()
        p = plan(lengths, args.max_length, strategy)
        if args.shuffle:
            p = p.shuffled(args.seed)
        out = pack_table(table, args.max_length, strategy, columns, plan=p)
        results.append((p, time.perf_counter() - start))
        if strategy == args.strategy:
            packed = out
    print(format_summary(results))
    if args.out and packed is not None:
        write_table(packed, args.out)
        print(f"wrote {packed.num_rows:,} packed rows ({args.strategy}) to {args.out}")
    return 0
