"""``packtools demo``: the whole pipeline on the standard library's sources (no download)."""

from __future__ import annotations

import argparse
import os

from ..core.plan import STRATEGIES


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "demo",
        help="profile, plot and pack a built-in corpus (the standard library's sources) end to end",
        description="Cut the running interpreter's standard library into functions, methods and classes "
        "(byte-level ids, or --tokenizer DIR), print the length profile, the recommended max_length and the "
        "three strategies side by side, write the length plot, and pack the corpus into OUT/packed (a "
        "datasets.load_from_disk folder with a manifest; a second run finds it and does nothing).",
    )
    p.add_argument(
        "--out",
        default=None,
        help="working folder (default: packtools-demo in the system's temporary folder, e.g. /tmp/packtools-demo; "
        "a folder in a clone of this repository named packtools-demo is ignored by git)",
    )
    p.add_argument("--max-length", type=int, help="max_length to pack with (default: the recommended one)")
    p.add_argument(
        "--strategy",
        choices=STRATEGIES,
        default="bfd_split",
        help="strategy of the packed output (default bfd_split: every token kept; bfd drops the ends of "
        "sequences over max_length and says how many tokens)",
    )
    p.add_argument(
        "--keep",
        type=float,
        default=0.99,
        help="the recommended max_length holds this share of the sequences whole (bfd_split, wrapped) or "
        "keeps this share of the tokens (bfd); default 0.99",
    )
    p.add_argument("--tokenizer", metavar="DIR", help="tokenize with this local tokenizer instead of bytes")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def run(args: argparse.Namespace) -> int:
    import tempfile

    from ..errors import PackingError
    from ..pipeline.demo import run_demo

    # said in the demo's own flags, before the corpus is built and profiled
    if not 0 < args.keep <= 1:
        raise PackingError(f"--keep {args.keep} must be a share in (0, 1], e.g. 0.99.", param="keep")
    if args.max_length is not None and args.max_length < 1:
        raise PackingError(f"--max-length must be >= 1, got {args.max_length}.", param="max_length")

    run_demo(
        args.out if args.out is not None else os.path.join(tempfile.gettempdir(), "packtools-demo"),
        max_length=args.max_length,
        strategy=args.strategy,
        keep=args.keep,
        tokenizer=args.tokenizer,
        quiet=args.quiet,
    )
    return 0
