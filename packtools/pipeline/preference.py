"""Preference data (``prompt``/``chosen``/``rejected``): packed by pairs, each pair fitted to ``max_length``."""

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


def write_packed_preference(batches: Iterator[pa.Table], folder: str, config: Any) -> dict[str, Any]:
    """Tokenized preference batches to packed pair rows (:func:`packtools.core.pairs.pack_pairs`), in shards.

    The tokenized pairs are gathered in memory (pair data is small next to pre-training corpora), then packed
    with one global plan: ``max_length`` bounds each packed row, and each pair keeps ``2 * prompt + chosen +
    rejected <= max_length`` under ``overlong`` (truncate: the prompt keeps its end, the completions their
    start; drop).  Rows are written ``shard_tokens`` at a time.
    """
    from ..core.pairs import PAIR_COLUMNS, pack_pairs

    names = output_columns("preference")
    tables = [t.select(names).rename_columns(list(PAIR_COLUMNS)) for t in batches]
    schema = pa.schema([(n, pa.list_(pa.int32())) for n in PAIR_COLUMNS])
    table = pa.concat_tables(tables).combine_chunks() if tables else schema.empty_table()
    packed, report = pack_pairs(
        table,
        config.max_length,
        overlong=config.overlong or "truncate",
        max_prompt_length=config.max_prompt_length,
        shuffle=config.shuffle,
        seed=config.seed,
    )
    shards = ShardFolder(folder)
    lengths = np.diff(np.asarray(packed.column("input_ids").combine_chunks().offsets))
    bounds = np.concatenate(([0], np.cumsum(lengths)))
    start = 0
    while start < packed.num_rows:
        stop = max(
            int(np.searchsorted(bounds, bounds[start] + config.shard_tokens, side="right")) - 1, start + 1
        )
        shards.write(packed.slice(start, stop - start))
        start = stop
    shards.finish(packed.schema)
    return {
        "rows_in": report.pairs_in,
        "pairs_dropped": report.pairs_dropped,
        "pairs_truncated": report.pairs_truncated,
        "prompts_truncated": report.prompts_truncated,
        "chosen_truncated": report.chosen_truncated,
        "rejected_truncated": report.rejected_truncated,
        "pairs_out": report.pairs_out,
        "rows_out": report.rows,
        "lower_bound": report.lower_bound,
        "fill": report.fill,
        "tokens_in": report.tokens_in,
        "tokens_kept": report.tokens_kept,
        "tokens_dropped": report.tokens_dropped,
        "shards": len(shards.paths),
        "packed": True,
    }
