"""``packtools pack --processor DIR``: TRL-format vision JSON lines packed offline
(:func:`packtools.pipeline.vision.pack_vision_files`).

The text pipeline's options (tokenizer, format, columns, overlong, executor, ...) do nothing here, so each one
given a value other than its default is refused by name rather than ignored.
"""

from __future__ import annotations

import argparse

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
    from ..errors import PackingError
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
    return 0
