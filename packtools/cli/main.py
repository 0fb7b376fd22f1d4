"""The ``packtools`` command line: thin subcommands over the public API.

Each subcommand lives in its own module exposing ``add_parser(subparsers)`` and ``run(args) -> int``; they
are imported only when listed here, and call only library code, so tests run ``main([...])`` in-process.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading
import traceback
from collections.abc import Sequence
from typing import NoReturn

from ..constants import __version__

# subcommand name -> module with add_parser(subparsers) and run(args)
SUBCOMMANDS: dict[str, str] = {
    "pack": "packtools.cli.pack",
    "demo": "packtools.cli.demo",
    "profile": "packtools.cli.profile",
}


class Terminated(BaseException):
    """Raised in the main thread on SIGTERM, so that cleanup runs as for Ctrl-C (not an ``Exception``: no
    ``except Exception`` on the way may swallow it)."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise Terminated()


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
        p.add_argument("--debug", action="store_true", help="on an error, show the Python traceback")
        p.set_defaults(_run=mod.run)
    return parser


#: Python argument names that are positional on the command line (shown as the metavar, not as a flag).
POSITIONAL = {"paths": "PATH", "inputs": "INPUT", "input": "INPUT"}
#: Python spellings the library's messages use for values a user passes, and the flag that passes them.
_PYTHON_WORDS = (
    ("tokenizer=DIR", "--tokenizer DIR"),
    ("column=...", "--column NAME"),
    ("columns=[...]", "--columns A,B"),
    ("format=", "--format "),
    ("tokenizer=", "--tokenizer "),
    ("columns=", "--columns "),
    ("column=", "--column "),
    ("keep_sequences=", "--keep-sequences "),
    ("keep_tokens=", "--keep-tokens "),
    ("multiple_of=", "--multiple-of "),
    ("max_context=", "--max-context "),
    ("drop_unlabeled=False (keep unlabeled)", "--keep-unlabeled"),
    ("drop_unlabeled=True", "--drop-unlabeled"),
    ("shuffle=True", "--shuffle"),
    ("add_eos=False", "--no-eos"),
    ("tokenizer_engine=", "--tokenizer-engine "),
    ("executor=", "--executor "),
)


def _flag(exc: BaseException) -> str:
    """`` (--flag)`` for an error about one argument (the library names Python arguments), else ``""``."""
    param = getattr(exc, "param", None)
    if not param:
        return ""
    return f" ({POSITIONAL[param]})" if param in POSITIONAL else f" (--{param.replace('_', '-')})"


def cli_words(message: str, param: str | None = None) -> str:
    """A library message in command-line words: ``pass tokenizer=DIR`` -> ``pass --tokenizer DIR``; a call
    written out in Python (``f(x, tokenizer=DIR)``) is left as it is.

    >>> cli_words("format='text' needs a tokenizer: pass tokenizer=DIR (a local tokenizer folder).")
    "--format 'text' needs a tokenizer: pass --tokenizer DIR (a local tokenizer folder)."
    >>> cli_words("max_prompt_length=9 must be in [1, max_length=8).", "max_prompt_length")
    '--max-prompt-length 9 must be in [1, max_length=8).'
    """
    import re

    for python, flag in _PYTHON_WORDS:
        message = re.sub(r"(?<![\w(-])(?<!, )" + re.escape(python), flag.replace("\\", r"\\"), message)
    if param and param not in POSITIONAL:
        message = re.sub(rf"(?<![\w-]){re.escape(param)}=", f"--{param.replace('_', '-')} ", message)
    return re.sub(r"  +", " ", message)


class _Unsaid(argparse.ArgumentParser):
    """A parser that raises ``ValueError`` where argparse would print an error and exit."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(message)


def packs_in_memory(inputs: Sequence[str], out: str | None) -> bool:
    """Whether ``packtools pack INPUT... --out OUT`` packs in memory (no INPUT: the built-in sample; no ``--out``:
    the summary alone; ``--out FILE.parquet|.arrow``: one file) rather than through the pipeline into a folder.
    The one rule: :mod:`packtools.cli.pack` runs by it, :func:`_check_ahead` reads it before the imports."""
    return not inputs or out is None or out.endswith((".parquet", ".arrow"))


def _check_ahead(argv: list[str]) -> str | None:
    """For ``packtools pack INPUT... --tokenizer DIR --out DIR`` on this process (the local executor): start a
    first run's check against transformers before the subcommands' imports (numpy, pyarrow, the kernels), so
    that its child imports transformers on the core those imports leave idle
    (:func:`~packtools.pipeline.tokenizer.reference_check.start_ahead`, which says when it is worth it).  Only a
    head start, read from the options by name (no abbreviations): the run's tokenizer decides, and the run stops a
    child it does not take.  Returns the tokenizer folder a child waits for (None: none), which :func:`main` stops
    as it returns where the command ended before its run took or stopped it (a missing input, ``--help``)."""
    if not argv or argv[0] != "pack":
        return None
    p = _Unsaid(add_help=False, allow_abbrev=False)
    for flag in ("--tokenizer", "--tokenizer-engine", "--out", "--processor", "--executor", "--num-proc"):
        p.add_argument(flag)
    p.add_argument("input", nargs="*")
    try:
        known, _ = p.parse_known_args(argv[1:])
    except ValueError:  # unparsable here: the real parser says why, once
        return None
    pool = known.executor not in (None, "local") or known.num_proc not in (None, "0", "1")
    if (
        known.tokenizer is None
        or packs_in_memory(known.input, known.out)
        or pool
        or known.processor is not None
    ):
        return None
    inputs = [os.path.getsize(i) if os.path.isfile(i) else None for i in known.input]
    from ..pipeline.tokenizer.reference_check import start_ahead

    size = None if None in inputs else sum(inputs)
    return known.tokenizer if start_ahead(known.tokenizer, known.tokenizer_engine or "auto", size) else None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``packtools`` console script; returns the exit status.

    Every failure is one line on stderr and a non-zero status (``--debug`` adds the traceback): 1 for an
    error, 130 for Ctrl-C, 143 for SIGTERM.  An interrupted ``pack`` leaves no output behind.
    """
    argv = list(argv) if argv is not None else sys.argv[1:]
    ahead = None
    try:
        ahead = _check_ahead(argv)
        return _command(argv)
    except KeyboardInterrupt:  # before the command's own handling began (its options, its imports)
        command = f" {argv[0]}" if argv and not argv[0].startswith("-") else ""
        print(f"packtools{command}: interrupted by Ctrl-C; stopped.", file=sys.stderr)
        return 130
    finally:  # a child started ahead that the command's run neither took nor stopped (it ended before)
        if ahead is not None:
            from ..pipeline.tokenizer.reference_check import stop_ahead

            stop_ahead(ahead)


def console() -> int:
    """The ``packtools`` console script and ``python -m packtools.cli``: :func:`main` on this process's arguments,
    then what the process holds frozen for the interpreter's shutdown (:func:`packtools._gc.freeze_at_exit`:
    its collections at exit took ~0.3 s of a ``pack``).  In-process callers use :func:`main`."""
    status = main()
    from .._gc import freeze_at_exit

    freeze_at_exit()
    return status


def _command(argv: list[str]) -> int:
    """:func:`main` once its early look at the options is done."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 2
    from ..errors import PackingError

    prog = f"packtools {args.command}"
    debug = getattr(args, "debug", False)
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return int(args._run(args) or 0)
    except (KeyboardInterrupt, Terminated) as exc:
        if debug:
            traceback.print_exc()
        what, status = ("Ctrl-C", 130) if isinstance(exc, KeyboardInterrupt) else ("SIGTERM", 143)
        note = getattr(exc, "packtools_note", None) or "stopped"
        print(f"{prog}: interrupted by {what}; {note}.", file=sys.stderr)
        return status
    except (PackingError, FileNotFoundError, ImportError) as exc:
        if debug:
            traceback.print_exc()
        print(
            f"{prog}: error{_flag(exc)}: {cli_words(str(exc), getattr(exc, 'param', None))}", file=sys.stderr
        )
        return 1
    except Exception as exc:  # noqa: BLE001 - anything else: still one line, the traceback on --debug
        if debug:
            traceback.print_exc()
        detail = str(exc).splitlines()[0] if str(exc) else ""
        print(
            f"{prog}: error: {type(exc).__name__}: {detail} (run again with --debug for the traceback)",
            file=sys.stderr,
        )
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(console())
