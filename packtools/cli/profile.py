"""``packtools profile``: the length distribution of tokenized files and what each max_length would do."""

from __future__ import annotations

import argparse

from ..errors import PackingError
from ..profiling.profile import LengthProfile, profile_lengths


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v.replace("_", "")) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of ints, e.g. 512,1024,2048"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive ints, e.g. 512,1024,2048")
    return values


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "profile",
        help="length distribution and max_length tradeoffs of tokenized files (no input: a built-in sample)",
        description="Profile sequence lengths of one dataset made of PATH... (.parquet / .arrow files or "
        "directories), reading list offsets only, then print the tradeoff table of every strategy at each "
        "candidate max_length and a recommended max_length. Without PATH, profiles a built-in sample "
        "(the standard library's sources, byte-level).",
    )
    p.add_argument("paths", nargs="*", metavar="PATH", help=".parquet / .arrow files or directories")
    p.add_argument(
        "--column", default="input_ids", help="list column holding the token ids (default input_ids)"
    )
    p.add_argument("--name", help="dataset name for titles (default: the file name)")
    p.add_argument(
        "--max-length", type=int, help="max_length to mark in the plots (default: the recommended one)"
    )
    p.add_argument(
        "--candidates",
        type=_int_list,
        help="comma-separated max_length values for the table (default: powers of two)",
    )
    p.add_argument(
        "--batch-size", type=int, default=8, help="batch size of the padded-batches column (default 8)"
    )
    keep = p.add_mutually_exclusive_group()
    keep.add_argument(
        "--keep-tokens",
        type=float,
        default=0.99,
        help="share of tokens bfd must keep at the recommended max_length (default 0.99)",
    )
    keep.add_argument(
        "--keep-sequences",
        type=float,
        help="recommend for bfd_split instead: the share of sequences the recommended max_length holds whole "
        "(bfd_split keeps every token and cuts only the longer ones), e.g. 0.99",
    )
    p.add_argument(
        "--multiple-of", type=int, default=64, help="the recommended max_length is a multiple of this"
    )
    p.add_argument("--plot", help="write both plots to this .png / .svg / .pdf file")
    p.add_argument("--html", help="write a self-contained HTML report to this file")
    return p


def load_profile(args: argparse.Namespace) -> LengthProfile:
    if args.paths:
        return profile_lengths(args.paths, column=args.column, name=args.name)
    from ..pipeline.sample import stdlib_table

    table = stdlib_table()
    name = args.name or "built-in sample: standard library sources, byte-level"
    return profile_lengths(table, column="input_ids", name=name)


def run(args: argparse.Namespace) -> int:
    if args.max_length is not None and args.max_length < 1:
        raise PackingError(f"--max-length must be >= 1, got {args.max_length}.")
    profile = load_profile(args)
    rec = profile.recommend(
        keep_tokens=args.keep_tokens, multiple_of=args.multiple_of, keep_sequences=args.keep_sequences
    )
    chosen = args.max_length if args.max_length is not None else rec.max_length
    candidates = sorted(set(args.candidates or profile.default_candidates()) | {chosen})
    table = profile.tradeoffs(candidates, batch_size=args.batch_size)
    print(profile.to_text())
    print()
    print(table.to_text())
    print()
    print(f"recommended: {rec.reason}")
    if args.max_length is not None:
        print(f"chosen: --max-length {chosen:,} (its row is in the table; plots mark it)")
    if args.plot:
        from ..profiling.plot import profile_figure, save_figure

        fig = profile_figure(profile, candidates, max_length=chosen, batch_size=args.batch_size, table=table)
        try:
            save_figure(fig, args.plot)
        except ValueError as exc:
            raise PackingError(f"--plot: {exc}") from None
        print(f"wrote plots to {args.plot}")
    if args.html:
        from ..profiling.plot import write_report

        write_report(
            profile,
            args.html,
            candidates,
            chosen,
            batch_size=args.batch_size,
            keep_tokens=args.keep_tokens,
            multiple_of=args.multiple_of,
            keep_sequences=args.keep_sequences,
        )
        print(f"wrote report to {args.html}")
    return 0
