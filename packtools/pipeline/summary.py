"""Text summaries of packing runs: plans side by side, and the final table of a pipeline run.

>>> from packtools import plan
>>> print(format_summary([(plan([5, 2, 3, 1], 4), 0.0012)]).splitlines()[5])
rows out               3
"""

from __future__ import annotations

import os
import time
from typing import Any

from .._format import text_table
from ..core.plan import PackPlan


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
    return text_table(cells)


#: The pipeline summary fits this many columns; longer values wrap under themselves.
WIDTH = 100


def label_value_table(rows: list[tuple[str, str]], width: int = WIDTH) -> str:
    """Two columns, labels left and values left-aligned after them; a value too long for ``width`` columns
    wraps onto the next lines, indented under the value column (paths and other unbreakable words stay whole).

    >>> print(label_value_table([("rows in", "3"), ("why", "alpha beta gamma delta epsilon")], width=30))
    rows in  3
    why      alpha beta gamma
             delta epsilon
    """
    import textwrap

    label_w = max((len(k) for k, _ in rows), default=0)
    room = max(20, width - label_w - 2)
    lines = []
    for label, value in rows:
        wrapped = textwrap.wrap(value, room, break_long_words=False, break_on_hyphens=False) or [""]
        lines.append(f"{label:<{label_w}}  {wrapped[0]}".rstrip())
        lines += [" " * (label_w + 2) + w for w in wrapped[1:]]
    return "\n".join(lines)


def _engine_rows(engine: dict[str, Any]) -> list[tuple[str, str]]:
    rows = [("tokenizer engine", f"{engine['engine']} (requested {engine.get('requested', 'auto')})")]
    rows.append(("engine reason", str(engine["reason"])))
    checked = engine.get("checked", {})
    if checked.get("rows_checked") or checked.get("adversarial_texts"):
        parts = engine.get("parts_by_engine", {})
        by = ", ".join(f"{k}: {v:,}" for k, v in parts.items())
        line = f"{checked.get('rows_checked', 0):,} rows compared with transformers"
        if "proof_rows" in checked:
            line += f" ({checked['proof_rows']:,} proof, {checked['rows_checked'] - checked['proof_rows']:,} audit)"
        if checked.get("batches_on_transformers"):
            line += f"; {checked['batches_on_transformers']:,} batches tokenized by transformers (first: "
            line += f"{engine.get('batches_on_transformers_why', '?')})"
        rows.append(("engine checks", line + (f"; parts by engine: {by}" if by else "")))
    dropped = engine.get("unencodable")
    if dropped:
        rows.append(("unencodable chars", unencodable_text(dropped)))
    return rows


def unencodable_text(dropped: dict[str, Any], stop: str = "--on-unencodable error stops instead.") -> str:
    """The characters the tokenizer could not encode (``char_drops`` report), as ``pack`` and ``profile`` say it."""
    chars = ", ".join(f"'{c}' x{n:,}" for c, n in list(dropped["chars"].items())[:8])
    return (
        f"{dropped['count']:,} characters in {dropped['rows']:,} rows left out of the ids, as transformers "
        f"does (the vocabulary has no token for bytes {', '.join(dropped['missing_bytes'][:6])}"
        f"{', ...' if len(dropped['missing_bytes']) > 6 else ''}): {chars}; first rows: "
        f"{'; '.join(dropped['first_rows'])}. {stop}"
    )


def seconds_since_process_start(at: float) -> float | None:
    """Seconds from the start of this process (interpreter start and imports included) to the wall-clock time
    ``at`` (``time.time()``); None where the start is unknown (it is read from ``/proc``, on Linux)."""
    try:
        with open("/proc/self/stat", encoding="ascii") as fh:
            start_ticks = int(fh.read().rsplit(")", 1)[1].split()[19])  # field 22: start time, after boot
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return at - (time.time() - age)


def _time_rows(timings: dict[str, Any]) -> list[tuple[str, str]]:
    """Every second of the run: setup, tokenizer load and engine proof, stage, plan, write, and the rest."""
    parts = f"{timings.get('parts', 0):,} parts"
    # where each part came from: this run, a killed run's work folder, the stage cache (`packtools profile`)
    if timings.get("parts_reused"):
        parts += f", {timings['parts_reused']:,} reused from an interrupted run"
    if timings.get("parts_from_stage_cache"):
        parts += f", {timings['parts_from_stage_cache']:,} from the stage cache"
    if timings.get("parts_restaged"):
        parts += f", {timings['parts_restaged']:,} staged again under the run's engine verdict"
    items = [
        ("setup", timings.get("setup_s")),
        ("tokenizer load", timings.get("tokenizer_load_s")),
        ("engine proof", timings.get("engine_proof_s")),
        (f"stage [{parts}]", timings.get("stage_s")),
        ("plan", timings.get("plan_s")),
        ("write", timings.get("write_s")),
    ]
    total = float(timings.get("time_s", 0.0))
    known = [(k, float(v)) for k, v in items if v is not None]
    rest = total - sum(v for _, v in known)
    if abs(rest) >= 0.005 and total:
        known.append(("install and other", rest))
    line = f"{total:.2f} s on {timings.get('executor')} = " + " + ".join(f"{k} {v:.2f} s" for k, v in known)
    if timings.get("tokenizer_preloaded"):
        line += " (tokenizer loaded earlier in this process)"
    rows = [("time", line)]
    if timings.get("first_part_s") is not None:
        rows.append(("first part", f"staged {timings['first_part_s']:.2f} s after the process started"))
    return rows


def tokenizer_timings(tok: Any, seconds: float) -> dict[str, Any]:
    """The tokenizer's part of a run's timings: its load and engine proof (``tok.seconds``), or, when it was
    loaded earlier in the process, the ``seconds`` it took to get it now."""
    load, proof = tok.seconds["load_s"], tok.seconds["proof_s"]
    if seconds + 1e-3 < load + proof:
        return {"tokenizer_load_s": round(seconds, 3), "tokenizer_preloaded": True}
    return {"tokenizer_load_s": round(load, 3), "engine_proof_s": round(proof, 3)}


def format_pipeline_summary(
    stats: dict[str, Any], out: str, cached: bool = False, timings: dict[str, Any] | None = None
) -> str:
    """The final summary of a pipeline run (or of the cached run the manifest describes): one label and one
    value per line, :data:`WIDTH` columns at most.  ``timings`` are the run's
    :attr:`~packtools.pipeline.run.PipelineResult.timings` (none for a cached run)."""

    def n(key: str) -> str:
        return f"{stats.get(key, 0):,}"

    cells: list[tuple[str, str]] = [
        ("", "packed dataset" + (" (cached: inputs and options unchanged)" if cached else "")),
        ("format", str(stats.get("format"))),
    ]
    if stats.get("tokenizer"):
        cells += _engine_rows(stats["tokenizer"])
    cells.append(
        ("strategy", f"{stats['strategy']}, overlong={stats['overlong']}, plan={stats.get('plan', 'global')}")
    )
    cells.append(("max_length", n("max_length")))
    cols = ", ".join(stats.get("columns", []))
    if stats.get("columns_left_out"):
        cols += f" (left out: {', '.join(stats['columns_left_out'])})"
    if cols:
        cells.append(("columns", cols))
    cells.append(("rows in", n("rows_in")))
    if "pairs_out" not in stats:
        dropped = stats["rows_dropped_overlong"] + stats.get("rows_dropped_unlabeled", 0)
        cells.append(
            (
                "rows dropped",
                f"{dropped:,} (over-long {stats['rows_dropped_overlong']:,}, without a label token "
                f"{stats.get('rows_dropped_unlabeled', 0):,})",
            )
        )
        if stats.get("rows_unlabeled") and not stats.get("rows_dropped_unlabeled"):
            cells.append(
                ("rows without labels", f"{stats['rows_unlabeled']:,} (kept; --drop-unlabeled drops them)")
            )
        cells.append(("empty rows", f"{stats['rows_empty']:,} (no tokens, nothing to pack)"))
        cells.append(("rows truncated", n("rows_truncated")))
        cells.append(("rows split", n("rows_split")))
        if stats.get("pieces"):
            cells.append(
                (
                    f"pieces (at {stats.get('split_at', 'turns')})",
                    f"{stats['pieces']:,}: {stats.get('turns_cut', 0):,} cut inside a turn longer than a piece, "
                    f"{stats.get('questions_dropped', 0):,} answers without their question (a tool chain longer "
                    f"than a piece), {stats.get('pieces_dropped_unlabeled', 0):,} without a trained token dropped "
                    f"({stats.get('tokens_dropped_unlabeled', 0):,} tokens; --keep-unlabeled keeps them)",
                )
            )
    else:
        cells.append(("pairs dropped", n("pairs_dropped")))
        cells.append(
            (
                "truncated",
                f"prompts {stats['prompts_truncated']:,}, chosen {stats['chosen_truncated']:,}, "
                f"rejected {stats['rejected_truncated']:,}",
            )
        )
        cells.append(("pairs out", n("pairs_out")))  # preference pairs packed whole
    cells.append(("rows out (packed)", f"{stats['rows_out']:,} (lower bound {stats['lower_bound']:,})"))
    cells.append(("tokens in", n("tokens_in")))
    carried = stats.get("tokens_carried", 0)
    cells.append(
        (
            "tokens kept",
            n("tokens_kept") + (f" (with {carried:,} copies of system prompts)" if carried else ""),
        )
    )
    cells.append(("tokens dropped", n("tokens_dropped")))
    if "tokens_trained_in" in stats:
        kept, given = stats["tokens_trained_kept"], stats["tokens_trained_in"]
        # under wrapped a packed row is one sequence: a document's first token trains after the one before it,
        # so the rows can hold more trained tokens than the input's sequences
        trained = (
            f"{kept:,} in the packed rows (each one sequence under wrapped), {given:,} in the input's sequences"
            if stats.get("strategy") == "wrapped"
            else f"{kept:,} kept of {given:,}"
        )
        cells.append(("trained tokens", trained))
        cells.append(
            (
                "training nothing",
                f"{stats['tokens_untrained']:,} tokens in {stats['sequences_untrained']:,} sequences without a "
                f"trained token",
            )
        )
    cells.append(("fill", f"{100 * stats['fill']:.2f}%"))
    if stats.get("context_parallel", 1) > 1:
        cells.append(
            (
                f"CP padding (N={stats['context_parallel']})",
                f"{stats['cp_padding_tokens']:,} tokens added at batch time: {100 * stats['cp_fill_lost']:.2f}% "
                f"of the rows' capacity lost, fill {100 * stats['fill_after_cp_padding']:.2f}% once padded",
            )
        )
        if "cp_worst_row_imbalance" in stats:
            cells.append(
                (
                    "CP work per rank",
                    f"worst row {100 * stats['cp_worst_row_imbalance']:.2f}% off its mean (chunk pairs balanced "
                    f"per document, as prepare_trainer trains; {100 * stats['cp_worst_row_imbalance_head_tail']:.2f}% "
                    f"head-tail), {100 * stats['cp_time_lost_to_imbalance']:.2f}% of attention time lost to "
                    f"the busiest rank, one row per batch",
                )
            )
    if timings:
        cells += _time_rows(timings)
    cells.append(("output", f"{out} ({stats['shards']} shard{'s' if stats['shards'] != 1 else ''})"))
    return label_value_table(cells)
