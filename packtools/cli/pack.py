"""``packtools pack``: raw, chat, preference or tokenized files to a packed dataset folder, out of core
(:func:`packtools.pipeline.run.pack_files`; the parser's description says the forms).  The small forms pack
one tokenized file (or, without INPUT, a built-in sample) in memory.  ``--processor DIR`` packs TRL-format
vision JSON lines (:func:`packtools.pipeline.vision.pack_vision_files`) and refuses by name each text-pipeline
option given a value other than its default, rather than ignore it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from typing import Any

from ..constants import INPUT_FORMATS, __version__
from ..core.pack import pack_table, read_columns, warmup
from ..core.plan import STRATEGIES, plan
from ..errors import PackingError
from ..io.discover import discover
from ..io.files import read_schema, read_table, write_table
from ..pipeline.executors import EXECUTORS
from ..pipeline.summary import format_pipeline_summary, format_summary, seconds_since_process_start
from .main import packs_in_memory

#: Schema metadata key marking a file written by ``packtools pack --out FILE`` (so a rerun may replace it).
FILE_MARK = b"packtools"


def add_pipeline_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-length", type=int, default=None, help="tokens per packed row (default 4096)")
    p.add_argument("--strategy", choices=STRATEGIES, default="bfd", help="packing strategy (default bfd)")
    p.add_argument("--tokenizer", metavar="DIR", help="local transformers tokenizer folder (for text input)")
    p.add_argument(
        "--tokenizer-engine",
        choices=("auto", "fast", "transformers"),
        default="auto",
        help="auto (default): the fast exact engine (packtools[fast]) for byte-level BPE tokenizers once it gives "
        "transformers' ids on a built-in adversarial set and the first rows of the data, else transformers; "
        "fast: the fast engine or an error; transformers: never the fast engine",
    )
    p.add_argument(
        "--tokenizer-audit",
        type=float,
        default=0.001,
        metavar="RATE",
        help="fast engine: after the first 256 rows of each column of each part, compare this random share of "
        "the rows with transformers (seeded; default 0.001; 1 compares every row)",
    )
    p.add_argument(
        "--on-unencodable",
        choices=("report", "error"),
        default="report",
        help="characters the tokenizer has no token for (transformers leaves them out of the ids): report "
        "(default; counted in the summary and the manifest) or error",
    )
    p.add_argument(
        "--format",
        choices=INPUT_FORMATS,
        help="input format (default: from the columns: text | prompt+completion | messages | "
        "prompt+chosen+rejected | input_ids)",
    )
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
        "--columns",
        help="comma-separated token columns to pack (tokenized input; default: every list column, the others "
        "are left out and listed in the summary)",
    )
    unlabeled = p.add_mutually_exclusive_group()
    unlabeled.add_argument(
        "--drop-unlabeled",
        action="store_const",
        const=True,
        dest="drop_unlabeled",
        help="drop rows with no label token (labels all -100 after truncation) too; by default they are kept and "
        "counted, while the pieces of split rows that hold none are dropped and counted",
    )
    unlabeled.add_argument(
        "--keep-unlabeled",
        action="store_const",
        const=False,
        dest="drop_unlabeled",
        help="keep every row and every piece without a label token (every token kept; they train nothing)",
    )
    p.add_argument(
        "--split-at",
        choices=("turns", "tokens"),
        default="turns",
        help="bfd_split on rows with labels (chat, prompt/completion): cut over-long rows where an assistant turn "
        "ends, each piece carrying the system prompt unlabeled (turns, default), or every max_length tokens",
    )
    p.add_argument(
        "--context-parallel",
        type=int,
        default=1,
        metavar="N",
        help="CP size the rows are for: every document planned at its length padded to a multiple of 2N (the "
        "padding ContextParallelCollator adds at batch time), so a row still fits --max-length once padded; the "
        "padding is reported as fill lost (default 1: no context parallelism)",
    )
    p.add_argument("--shuffle", action="store_true", help="shuffle packed rows")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--plan",
        choices=("global", "shards"),
        default="global",
        help="global: one plan over all rows (default, fewest rows); shards: each input part planned on its own "
        "and the plans put one after the other (costs a few rows per part: < 0.01%% with parts of >= 100k rows)",
    )
    p.add_argument(
        "--part-rows",
        type=int,
        default=1 << 17,
        help="parquet files are read in parts of about this many rows (default 131072); with --plan shards, the "
        "planning unit",
    )
    p.add_argument(
        "--shard-tokens",
        type=int,
        default=1 << 24,
        help="tokens per output shard / write block (default 2**24)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars and no summary")


def add_executor_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("where the read/tokenize and gather/write stages run (the output is the same)")
    g.add_argument(
        "--executor",
        choices=EXECUTORS,
        default="local",
        help="this process (local, default), a process pool (pool) or Ray tasks (ray)",
    )
    g.add_argument(
        "--workers", type=int, help="processes for pool / CPUs for a local Ray (default: all cores)"
    )
    g.add_argument("--address", help="Ray cluster address for --executor ray (default: start Ray locally)")
    g.add_argument(
        "--retries", type=int, default=2, help="tries again per job whose worker was lost (default 2)"
    )
    g.add_argument("--num-proc", type=int, default=None, help="same as --executor pool --workers N")


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "pack",
        help="tokenize, truncate and pack files into a dataset folder (no input: a built-in sample)",
        description="Tokenize (unless already tokenized), truncate or filter, and pack INPUT... (.jsonl/.json, "
        ".parquet, .arrow/.feather files, directories of them, datasets save_to_disk folders) into --out DIR, "
        "a folder datasets.load_from_disk opens, with a manifest; a rerun with the same inputs and options does "
        "nothing. Out of core: memory holds the row lengths and one block of rows, whatever the token count "
        "(JSON is read in blocks too). One run at a time per --out; an interrupted run leaves no output, and "
        "the next run reuses the parts it had finished. --out FILE.parquet|.arrow packs one tokenized file in "
        "memory instead. Without INPUT, packs a built-in sample (the standard library's sources, byte-level) in "
        "memory with every strategy; `packtools demo` runs the whole pipeline on it.",
    )
    p.add_argument("input", nargs="*", help="input files, directories or save_to_disk folders")
    p.add_argument(
        "--out",
        help="output folder (or a .parquet/.arrow file for tokenized input, in memory); without it, one tokenized "
        "file is planned and its summary printed, and nothing is written",
    )
    p.add_argument(
        "--processor",
        metavar="DIR",
        help="local processor folder of a Qwen2-VL/2.5-VL/3-VL model: INPUT is JSON lines in TRL's vision format "
        "(messages with image parts + images), packed whole with their images (bfd, out of core)",
    )
    add_pipeline_arguments(p)
    add_executor_arguments(p)
    return p


def pipeline_config(args: argparse.Namespace, max_length: int) -> Any:
    """The :class:`PipelineConfig` of ``args``: a flag named as a config field (``--shard-tokens``,
    ``shard_tokens``) gives its value as parsed; ``--tokenizer``, ``--columns`` and ``--no-eos`` are converted."""
    from dataclasses import fields

    from ..pipeline.config import PipelineConfig

    given = {f.name: getattr(args, f.name) for f in fields(PipelineConfig) if hasattr(args, f.name)}
    return PipelineConfig(
        **{
            **given,
            "max_length": max_length,
            "tokenizer": os.path.abspath(args.tokenizer) if args.tokenizer else None,
            "columns": tuple(args.columns.split(",")) if args.columns else None,
            "add_eos": not args.no_eos,
        }
    )


def _check_file_out(path: str) -> None:
    """Refuse to replace an existing file that ``packtools pack --out FILE`` did not write."""
    if not os.path.exists(path):
        return
    if os.path.isdir(path):
        raise PackingError(
            f"--out {path!r} is a folder; name a .parquet/.arrow file, or drop the suffix.", param="out"
        )
    try:
        if path.endswith(".parquet"):
            import pyarrow.parquet as pq

            meta = pq.read_schema(path).metadata or {}
        else:
            meta = read_table(path).schema.metadata or {}
    except Exception:  # noqa: BLE001 - unreadable: certainly not ours
        meta = {}
    if FILE_MARK not in meta:
        raise PackingError(
            f"--out {path!r} exists and was not written by packtools pack; remove it or choose another name.",
            param="out",
        )


def _check_tokenized(path: str, args: argparse.Namespace) -> None:
    """The in-memory forms take tokenized input only: raw input is told to use ``--out DIR``."""
    from ..pipeline.formats import detect_format

    try:
        fmt = args.format or detect_format(read_schema(discover([path])[0]).names)
    except PackingError:
        return  # read_columns says what is wrong with the columns
    if fmt != "tokenized":
        what = f"--out {args.out}" if args.out else "no --out"
        raise PackingError(
            f"INPUT {path!r} holds {fmt} data, and {what} packs tokenized input in memory only; use --out DIR (a "
            f"folder) with --tokenizer DIR to tokenize and pack it.",
            param="out",
        )


def _in_memory(args: argparse.Namespace, max_length: int) -> int:
    """The small forms of the command: one tokenized file (or the built-in sample), packed in memory."""
    others = [i for i in args.input or [] if not str(i).endswith((".parquet", ".arrow", ".feather", ".ipc"))]
    if args.out is not None and others:
        raise PackingError(
            f"--out {args.out!r} is a file: that packs one tokenized .parquet/.arrow file in memory, and "
            f"{others[0]!r} is not one; give --out a folder (e.g. --out {os.path.splitext(args.out)[0]!r}) to run "
            f"the full pipeline (text, chat, JSON, folders, many files).",
            param="out",
        )
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
        _check_tokenized(args.input[0], args)
        if args.out:
            _check_file_out(args.out)
        table = read_table(args.input[0])
        strategies = [args.strategy]
    _, lengths = read_columns(table, columns)
    t0 = time.perf_counter()
    warmup()  # compile (or load) the kernels first: the timings below are the strategies' own
    print(f"kernels compiled or loaded in {time.perf_counter() - t0:.2f} s (not in the timings below)")
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
    if (
        args.input and not args.out
    ):  # the summary alone reads like a finished pack: say that nothing was written
        print(
            "\nnothing written (no --out): these are the plan's numbers; --out DIR writes a dataset folder, "
            "--out FILE.parquet one packed file."
        )
    if args.out and packed is not None:
        mark = json.dumps({"version": __version__, "max_length": max_length, "strategy": args.strategy})
        write_table(packed.replace_schema_metadata({FILE_MARK: mark.encode()}), args.out)
        print(f"wrote {packed.num_rows:,} packed rows ({args.strategy}) to {args.out}")
    return 0


def run(args: argparse.Namespace) -> int:
    max_length = args.max_length if args.max_length is not None else 4096
    in_memory = packs_in_memory(args.input, args.out)
    if args.context_parallel != 1 and (args.processor is not None or in_memory):
        raise PackingError(
            f"--context-parallel {args.context_parallel} packs text through the pipeline only (INPUT... --out DIR, "
            f"no --processor): vision-language samples and the in-memory forms are packed without it.",
            param="context_parallel",
        )
    if args.processor is not None:
        return run_vision(args, max_length, add_parser(argparse.ArgumentParser().add_subparsers()))
    if in_memory:
        return _in_memory(args, max_length)
    from ..integrations.data.drops import TokensDroppedWarning
    from ..pipeline.run import run_pipeline

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", TokensDroppedWarning)
        result = run_pipeline(
            args.input,
            args.out,
            pipeline_config(args, max_length),
            executor=args.executor,
            workers=args.workers,
            address=args.address,
            retries=args.retries,
            num_proc=args.num_proc,
            quiet=args.quiet,
        )
    for w in caught:  # the API's warnings, said by the command (the others as Python would show them)
        if issubclass(w.category, TokensDroppedWarning):
            print(f"packtools pack: warning: {w.message}", file=sys.stderr)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if not args.quiet:
        timings = dict(result.timings)
        since = seconds_since_process_start(timings["first_part_at"]) if "first_part_at" in timings else None
        # this process is the run: say how long after its start the first part was ready
        if since is not None:
            timings["first_part_s"] = round(since, 3)
        print(format_pipeline_summary(result.stats, result.out, result.cached, timings))
        reused = result.timings.get("parts_from_stage_cache", 0)
        if reused:
            print(
                f"stage cache: {reused} of {result.timings['parts']} part(s) were tokenized by an earlier "
                f"`packtools profile` and reused, not tokenized again"
            )
    for note in result.notes:
        print(f"packtools pack: note: {note}", file=sys.stderr)
    return 0


# -- pack vision ---------------------------------------------------------------------------------------------
#: The options of ``pack`` that ``--processor`` reads; every other one is refused when not at its default.
VISION_OPTIONS = ("help", "input", "out", "processor", "max_length", "strategy", "shuffle", "seed", "quiet")


def text_only_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """The flags given ``pack --processor`` that only the text pipeline reads (a value other than the default),
    found from the ``pack`` parser's own defaults, so an option added to it later is refused too until this
    path reads it."""
    given = []
    for dest, default in vars(parser.parse_args([])).items():
        if dest in VISION_OPTIONS or getattr(args, dest, default) == default:
            continue
        flag = "--" + dest.replace("_", "-")
        if dest == "drop_unlabeled":  # two flags, one destination
            flag = "--drop-unlabeled" if args.drop_unlabeled else "--keep-unlabeled"
        given.append(flag)
    return given


def run_vision(args: argparse.Namespace, max_length: int, parser: argparse.ArgumentParser) -> int:
    """``packtools pack --processor DIR``: :func:`packtools.pipeline.vision.pack_vision_files`."""
    from ..pipeline.vision import pack_vision_files

    if not args.input or args.out is None:
        raise PackingError("--processor needs INPUT files (.jsonl) and --out DIR.", param="processor")
    if args.strategy != "bfd":
        raise PackingError(
            f"--strategy {args.strategy}: vision-language samples are packed whole (--strategy bfd).",
            param="strategy",
        )
    ignored = text_only_options(args, parser)
    if ignored:
        raise PackingError(
            f"{', '.join(ignored)}: not used with --processor (the processor folder tokenizes, rows are packed "
            f"whole with bfd in this process; only --max-length, --shuffle, --seed and --quiet apply). Drop them.",
            param="processor",
        )
    from ..pipeline.vision_stage import RowKeysError, row_keys_message

    try:
        r = pack_vision_files(
            args.input,
            args.out,
            processor=args.processor,
            max_length=max_length,
            shuffle=args.shuffle,
            seed=args.seed,
        )
    except RowKeysError as err:  # the fix the command line offers: there is no --leave-out
        raise PackingError(row_keys_message(err.where, err.keys, cli=True)) from None
    if not args.quiet:
        print(
            f"packed {r.rows_in} samples ({r.images} images, {r.tokens} tokens) into {r.rows_out} rows in {r.out}"
            + (
                " (already there: same inputs and options)"
                if r.cached
                else f" ({r.reused_blocks} of {r.staged_blocks} staged blocks reused)"
            )
        )
    if r.samples_untrained:  # said even with --quiet: these samples cost compute and train nothing
        print(
            f"note: {r.samples_untrained} sample(s) have no assistant turn: MultimodalCollator trains the assistant "
            f"turns only (assistant_only_loss=True, the default), so they train nothing; remove them, or pass "
            f"MultimodalCollator(..., assistant_only_loss=False) to train every text token."
        )
    for note in r.notes:
        print(f"packtools pack: note: {note}", file=sys.stderr)
    return 0
