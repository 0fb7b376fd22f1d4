"""The ``packtools`` command line: thin subcommands over the public API.

Each subcommand lives in its own module exposing ``add_parser(subparsers)`` and ``run(args) -> int``; they
are imported only when listed here, and call only library code, so tests run ``main([...])`` in-process.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from ..constants import __version__

# subcommand name -> module with add_parser(subparsers) and run(args)
SUBCOMMANDS: dict[str, str] = {
    "pack": "packtools.cli.pack",
    "demo": "packtools.cli.demo",
    "profile": "packtools.cli.profile",
    "shard-pack": "packtools.cli.shards",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="packtools",
        description="Pack tokenized datasets for LLM fine-tuning (bfd, bfd_split, wrapped).",
    )
    parser.add_argument("--version", action="version", version=f"packtools {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in SUBCOMMANDS.values():
        mod = importlib.import_module(module)
        p = mod.add_parser(sub)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``packtools`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 2
    from ..errors import PackingError

    try:
        return int(args._run(args) or 0)
    except (PackingError, FileNotFoundError) as exc:
        # The library names Python arguments; an error about one of them also names its flag here.
        param = getattr(exc, "param", None)
        flag = f" (--{param.replace('_', '-')})" if param else ""
        print(f"packtools {args.command}: error{flag}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
