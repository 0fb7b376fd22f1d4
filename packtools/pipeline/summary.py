"""Text summaries of packing runs: plans side by side, and the final table of a pipeline run.

>>> from packtools import plan
>>> print(format_summary([(plan([5, 2, 3, 1], 4), 0.0012)]).splitlines()[5])
rows out               3
"""

from __future__ import annotations

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


def format_pipeline_summary(
    stats: dict[str, Any], out: str, cached: bool = False, timings: dict[str, Any] | None = None
) -> str:
    """The final table of a pipeline run (or of the cached run the manifest describes); ``timings`` are the
    run's :attr:`~packtools.pipeline.run.PipelineResult.timings` (none for a cached run)."""

    def n(key: str) -> str:
        return f"{stats.get(key, 0):,}"

    head = "packed dataset" if stats.get("packed") else "preference dataset (not packed)"
    cells = [["", head + (" (cached: inputs and options unchanged)" if cached else "")]]
    cells.append(["format", str(stats.get("format"))])
    if stats.get("tokenizer"):
        engine = stats["tokenizer"]
        cells.append(["tokenizer engine", f"{engine['engine']} ({engine['reason']})"])
    if stats.get("packed"):
        cells.append(
            [
                "strategy",
                f"{stats['strategy']}, overlong={stats['overlong']}, plan={stats.get('plan', 'global')}",
            ]
        )
    else:
        cells.append(["overlong", str(stats.get("overlong"))])
    cells.append(["max_length", n("max_length")])
    cols = ", ".join(stats.get("columns", []))
    if stats.get("columns_left_out"):
        cols += f" (left out: {', '.join(stats['columns_left_out'])})"
    if cols:
        cells.append(["columns", cols])
    cells.append(["rows in", n("rows_in")])
    if stats.get("packed") and "pairs_out" not in stats:
        dropped = stats["rows_dropped_overlong"] + stats.get("rows_dropped_unlabeled", 0)
        cells.append(
            [
                "rows dropped",
                f"{dropped:,} (over-long {stats['rows_dropped_overlong']:,}, without a label token "
                f"{stats.get('rows_dropped_unlabeled', 0):,})",
            ]
        )
        if stats.get("rows_unlabeled") and not stats.get("rows_dropped_unlabeled"):
            cells.append(
                ["rows without labels", f"{stats['rows_unlabeled']:,} (kept; --drop-unlabeled drops them)"]
            )
        cells.append(["empty rows", f"{stats['rows_empty']:,} (no tokens, nothing to pack)"])
        cells.append(["rows truncated", n("rows_truncated")])
        cells.append(["rows split", n("rows_split")])
        cells.append(["rows out (packed)", f"{stats['rows_out']:,} (lower bound {stats['lower_bound']:,})"])
    else:
        cells.append(["pairs dropped", n("pairs_dropped")])
        cells.append(
            [
                "truncated",
                f"prompts {stats['prompts_truncated']:,}, chosen {stats['chosen_truncated']:,}, "
                f"rejected {stats['rejected_truncated']:,}",
            ]
        )
        if "pairs_out" in stats:  # preference pairs packed whole
            cells.append(["pairs out", n("pairs_out")])
            cells.append(
                ["rows out (packed)", f"{stats['rows_out']:,} (lower bound {stats['lower_bound']:,})"]
            )
        else:
            cells.append(["rows out", n("rows_out")])
    cells.append(["tokens in", n("tokens_in")])
    cells.append(["tokens kept", n("tokens_kept")])
    cells.append(["tokens dropped", n("tokens_dropped")])
    if stats.get("packed"):
        cells.append(["fill", f"{100 * stats['fill']:.2f}%"])
    if timings:
        parts = f"{timings.get('parts', 0):,} parts"
        if timings.get("parts_reused"):
            parts += f", {timings['parts_reused']:,} reused from an interrupted run"
        cells.append(
            [
                "time",
                f"{timings.get('time_s', 0):.2f} s on {timings.get('executor')} (stage {timings.get('stage_s', 0):.2f} s"
                f" [{parts}], plan {timings.get('plan_s', 0):.2f} s, write {timings.get('write_s', 0):.2f} s)",
            ]
        )
    cells.append(["output", f"{out} ({stats['shards']} shard{'s' if stats['shards'] != 1 else ''})"])
    return text_table(cells)
