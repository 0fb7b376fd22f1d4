"""Preference data (``prompt``/``chosen``/``rejected``): truncated or filtered to fit, not packed."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa

from ..core import ragged
from ..errors import PackingError
from .gather import ShardFolder
from .tokenize import output_columns


def fit_preference(
    prompt: ragged.Ragged,
    chosen: ragged.Ragged,
    rejected: ragged.Ragged,
    max_length: int,
    overlong: str,
    max_prompt_length: int | None = None,
) -> tuple[list[ragged.Ragged], np.ndarray, dict[str, int]]:
    """Make preference pairs fit ``max_length``: truncate or drop (``overlong``).

    ``truncate``: the prompt keeps its *last* ``max_prompt_length`` tokens (default ``max_length // 2``), then
    each completion keeps its *first* ``max_length - kept prompt`` tokens.  ``drop``: pairs whose prompt plus
    longer completion exceeds ``max_length`` are removed.  Returns the new columns, the kept-row mask and counts.

    >>> from packtools.core.ragged import from_lists, to_lists
    >>> cols, keep, counts = fit_preference(
    ...     from_lists([[1, 2, 3, 4]]), from_lists([[5, 6, 7]]), from_lists([[8]]), 5, "truncate", 2)
    >>> [to_lists(c) for c in cols], counts["prompts_truncated"], counts["chosen_truncated"]
    ([[[3, 4]], [[5, 6, 7]], [[8]]], 1, 0)
    """
    lp, lc, lr = prompt.lengths, chosen.lengths, rejected.lengths
    n = prompt.num_rows
    if overlong == "drop":
        keep = lp + np.maximum(lc, lr) <= max_length
        counts = {"pairs_dropped": int(n - keep.sum()), "tokens_dropped": int((lp + lc + lr)[~keep].sum())}
        return [ragged.select(r, keep) for r in (prompt, chosen, rejected)], keep, counts
    if overlong != "truncate":
        raise PackingError(
            f"overlong={overlong} does not apply to preference data; use truncate or drop.", param="overlong"
        )
    budget = max_prompt_length if max_prompt_length is not None else max_length // 2
    kp = np.minimum(lp, budget)
    room = max_length - kp
    kc, kr = np.minimum(lc, room), np.minimum(lr, room)
    cols = [
        ragged.window(prompt, lp - kp, kp),
        ragged.window(chosen, np.zeros(n, np.int64), kc),
        ragged.window(rejected, np.zeros(n, np.int64), kr),
    ]
    counts = {
        "prompts_truncated": int((kp < lp).sum()),
        "chosen_truncated": int((kc < lc).sum()),
        "rejected_truncated": int((kr < lr).sum()),
        "tokens_dropped": int((lp - kp).sum() + (lc - kc).sum() + (lr - kr).sum()),
    }
    return cols, np.ones(n, bool), counts


def write_preference(
    batches: Iterator[pa.Table], folder: str, config: Any, fingerprint: str = ""
) -> dict[str, Any]:
    """Write tokenized pairs (``batches`` of ``prompt_input_ids``/``chosen_input_ids``/``rejected_input_ids``,
    in order) to ``folder`` as shards of a ``save_to_disk`` folder, fitted by :func:`fit_preference`; returns
    the statistics.  A separate step of the engine (:func:`packtools.pipeline.run.run_pipeline`), which gives it
    the staged tables; ``fingerprint`` names the dataset in ``state.json``."""
    policy = config.overlong or "truncate"
    shards = ShardFolder(folder)
    pending: list[pa.Table] = []
    pending_tokens = 0
    totals: dict[str, int] = {}
    rows_in = rows_out = tokens_in = tokens_kept = 0
    names = output_columns("preference")
    for table in batches:
        parts = [ragged.from_arrow(table.column(n), n) for n in names]
        cols, keep, counts = fit_preference(*parts, config.max_length, policy, config.max_prompt_length)
        for k, v in counts.items():
            totals[k] = totals.get(k, 0) + v
        out = pa.table({n: ragged.to_arrow(c) for n, c in zip(names, cols)})
        rows_in += table.num_rows
        rows_out += out.num_rows
        tokens_in += sum(int(p.values.shape[0]) for p in parts)
        kept = sum(int(c.values.shape[0]) for c in cols)
        tokens_kept += kept
        pending.append(out)
        pending_tokens += kept
        if pending_tokens >= config.shard_tokens:
            shards.write(pa.concat_tables(pending).combine_chunks())
            pending, pending_tokens = [], 0
    if pending:
        shards.write(pa.concat_tables(pending).combine_chunks())
    schema = pa.schema([(n, pa.list_(pa.int32())) for n in names])
    shards.finish(schema, fingerprint)
    return {
        "rows_in": rows_in,
        **{
            k: totals.get(k, 0)
            for k in ("pairs_dropped", "prompts_truncated", "chosen_truncated", "rejected_truncated")
        },
        "rows_out": rows_out,
        "tokens_in": tokens_in,
        "tokens_kept": tokens_kept,
        "tokens_dropped": tokens_in - tokens_kept,
        "shards": len(shards.paths),
        "packed": False,
    }
