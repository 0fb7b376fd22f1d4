"""``packtools profile``: the length distribution of a dataset and what each max_length would do
(:func:`packtools.pipeline.profile.profile_files`; the parser's description says what is read and how).
"""

from __future__ import annotations

import argparse

from .._optional import require
from ..constants import INPUT_FORMATS
from ..errors import PackingError
from ..profiling.profile import LengthProfile, profile_lengths
from ..profiling.recommend import COMMON_CONTEXT


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
        help="choose max_length: length distribution and tradeoffs of raw, tokenized or packed data "
        "(no input: a built-in sample)",
        description="Profile the sequence lengths of one dataset made of PATH... (.jsonl/.json, .parquet, "
        ".arrow files, directories, save_to_disk or packtools output folders), then print the tradeoff table "
        "of every strategy at each candidate max_length and a recommended max_length with both rules side "
        "by side. Tokenized files are read from their list offsets; raw text, chat, prompt/completion and "
        "preference data are tokenized with --tokenizer through the same stage as `packtools pack`, kept in "
        "the stage cache ($PACKTOOLS_STAGE_CACHE, default ~/.cache/packtools/stage), so a following "
        "`packtools pack` of the same inputs with the same tokenizer does not tokenize again. Packed data "
        "(seq_lengths) is profiled by its sequences and its rows' fill. Without PATH, profiles a built-in "
        "sample (the standard library's sources, byte-level).",
    )
    p.add_argument(
        "paths", nargs="*", metavar="PATH", help="input files, directories or dataset folders (as for pack)"
    )
    p.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="local tokenizer folder: tokenizes raw input as `packtools pack --tokenizer DIR` would",
    )
    p.add_argument(
        "--format",
        choices=INPUT_FORMATS,
        help="input format, as for pack (default: from the columns)",
    )
    p.add_argument("--no-eos", action="store_true", help="as for pack: do not append EOS when tokenizing")
    p.add_argument(
        "--tokenizer-engine",
        choices=("auto", "fast", "transformers"),
        default="auto",
        help="as for pack (the ids are the same)",
    )
    p.add_argument(
        "--workers", type=int, help="tokenize on a pool of this many processes (default: this one)"
    )
    p.add_argument(
        "--no-stage-cache",
        action="store_true",
        help="do not keep the tokenized parts for a following pack (they are staged in a temporary folder)",
    )
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
        "--keep-sequences",
        type=float,
        help="the sequence rule (the default, at 0.99): the recommended max_length holds this share of the "
        "sequences whole; pack with bfd_split, which keeps every token and cuts only the longer ones",
    )
    keep.add_argument(
        "--keep-tokens",
        type=float,
        help="the token rule instead: bfd (which truncates) keeps this share of the tokens at the recommended "
        "max_length, e.g. 0.99 (on long-tailed data it asks for a much larger max_length)",
    )
    p.add_argument(
        "--multiple-of", type=int, default=64, help="the recommended max_length is a multiple of this"
    )
    p.add_argument(
        "--max-context",
        type=int,
        default=COMMON_CONTEXT,
        help=f"a recommended max_length above this is flagged (default {COMMON_CONTEXT}: the largest context "
        "most fine-tuning runs train with)",
    )
    p.add_argument(
        "--context-parallel",
        type=int,
        metavar="N",
        help="audit context parallelism over N ranks: the causal attention work each rank gets when the rows "
        "packed at the chosen max_length (recommended strategy) are cut per document into 2N chunks",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar while tokenizing")
    p.add_argument("--plot", help="write both plots to this .png / .svg / .pdf file")
    p.add_argument("--html", help="write a self-contained HTML report to this file")
    return p


def _vision_profile(args: argparse.Namespace) -> LengthProfile | None:
    """The profile of JSON-lines files in TRL's vision format: with a processor folder as ``--tokenizer``
    (it has ``preprocessor_config.json``), every sample's length counts its image tokens
    (:func:`packtools.pipeline.vision.vision_file_lengths`); with anything else the image tokens cannot be
    counted, and the run stops saying so rather than recommend a ``max_length`` too short for the images."""
    import os

    from ..pipeline.vision import is_vision_file, vision_file_lengths

    paths = [p for p in args.paths if os.path.isfile(p) and p.endswith((".jsonl", ".json"))]
    vision = [p for p in paths if is_vision_file(p)]
    if not vision:
        return None
    proc = args.tokenizer
    if not proc or not os.path.isfile(os.path.join(proc, "preprocessor_config.json")):
        raise PackingError(
            f"{vision[0]} holds vision rows (an 'images' key or image parts): their image tokens are counted only "
            f"with the model's processor folder (--tokenizer PROC, a folder with preprocessor_config.json, as "
            f"`packtools pack --processor PROC` takes); "
            + (f"{proc!r} has no image processor." if proc else "no --tokenizer was given."),
            param="tokenizer",
        )
    if len(vision) != len(args.paths):
        other = [p for p in args.paths if p not in vision]
        raise PackingError(
            f"{vision[0]} holds vision rows but {other[0]} does not: profile vision files on their own.",
            param="paths",
        )
    flags = (("--keep-sequences", args.keep_sequences), ("--keep-tokens", args.keep_tokens))
    given = [flag for flag, value in flags if value is not None]
    if given:
        raise PackingError(
            f"{given[0]}: vision samples are packed whole and `packtools pack --processor` refuses a sample longer "
            f"than --max-length, so the recommendation holds every sample; drop {given[0]}.",
            param=given[0][2:].replace("-", "_"),
        )
    args.keep_sequences = 1.0  # pack --processor refuses a longer sample: a share below 1 would fail the pack
    lengths, images = vision_file_lengths(vision, proc)
    args._stage_text = (
        f"vision samples: {len(lengths):,} ({images:,} images); each length counts its image tokens "
        f"(t*h*w / merge\u00b2 from the image's size, as processor {proc} resizes it) besides its text tokens; "
        f"they are packed whole (bfd) and a longer one is refused, so the recommendation holds every sample"
    )
    return profile_lengths(lengths, name=args.name or os.path.basename(vision[0]))


def load_profile(args: argparse.Namespace) -> LengthProfile:
    if args.paths:
        from ..pipeline.profile import profile_files

        found = _vision_profile(args)
        if found is not None:
            return found

        res = profile_files(
            args.paths,
            args.tokenizer,
            format=args.format,
            column=args.column,
            add_eos=not args.no_eos,
            tokenizer_engine=args.tokenizer_engine,
            stage_cache=False if args.no_stage_cache else None,
            executor="pool" if args.workers and args.workers > 1 else "local",
            workers=args.workers,
            quiet=args.quiet,
            name=args.name,
        )
        args._stage_text = res.to_text()
        if args.tokenizer and res.format == "tokenized":
            args._stage_text = "note: the input is already tokenized; --tokenizer was not used"
        return res.profile
    from ..pipeline.sample import stdlib_table

    table = stdlib_table()
    name = args.name or "built-in sample: standard library sources, byte-level"
    return profile_lengths(table, column="input_ids", name=name)


def run(args: argparse.Namespace) -> int:
    for flag, value in (
        ("--max-length", args.max_length),
        ("--max-context", args.max_context),
        ("--context-parallel", args.context_parallel),
        ("--batch-size", args.batch_size),
    ):
        if value is not None and value < 1:
            raise PackingError(f"{flag} must be >= 1, got {value}.")
    if args.plot or args.html:  # before the profile (which may tokenize for minutes), not after it
        from ..profiling.plot import plot_format

        require("matplotlib", "--plot and --html")
        if args.plot:
            try:
                plot_format(args.plot)
            except ValueError as exc:
                raise PackingError(f"--plot: {exc}") from None
    profile = load_profile(args)
    rec = profile.recommend(
        keep_tokens=args.keep_tokens,
        multiple_of=args.multiple_of,
        keep_sequences=args.keep_sequences,
        max_context=args.max_context,
    )
    chosen = args.max_length if args.max_length is not None else rec.max_length
    candidates = sorted(set(args.candidates or profile.default_candidates()) | {chosen})
    table = profile.tradeoffs(candidates, batch_size=args.batch_size)
    stage_text = getattr(args, "_stage_text", "")
    if stage_text:
        print(stage_text)
        print()
    print(profile.to_text())
    print()
    print(table.to_text())
    print()
    print(rec.to_text())
    if args.max_length is not None:
        print(f"chosen: --max-length {chosen:,} (its row is in the table; plots mark it)")
    if args.context_parallel is not None:
        from ..core.cp_budget import check_context_parallel, plan_for_cp
        from ..profiling.cp_audit import audit_plan

        n = args.context_parallel
        at = chosen
        if args.max_length is not None:  # the check pack makes: a document of max_length must fit once padded
            check_context_parallel(n, chosen)
        elif n > 1 and chosen % (2 * n):  # the recommendation is not a length pack takes for this CP size
            at = max(chosen // (2 * n), 1) * 2 * n
            print()
            print(
                f"note: the recommended max_length {chosen:,} is not a multiple of {2 * n} (pack "
                f"--context-parallel {n} needs one); the CP audit below is at --max-length {at:,}"
            )
        lengths = profile.lengths[profile.lengths > 0]
        packed = plan_for_cp(lengths, at, rec.strategy, n)  # the rows pack --context-parallel N writes
        audit = audit_plan(packed, n)
        thd = audit_plan(packed, n, balance=False)
        print()
        print(
            f"rows packed with {rec.strategy} at max_length {at:,} for --context-parallel {n}; "
            + audit.to_text()
        )
        print(
            f"the fixed head-tail layout (Megatron THD kernels, ContextParallelCollator(balance=False)): "
            f"worst row {thd.worst_row * 100:.2f}% off its mean, {thd.lost_to_imbalance * 100:.2f}% lost"
        )
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
            max_context=args.max_context,
        )
        print(f"wrote report to {args.html}")
    return 0
