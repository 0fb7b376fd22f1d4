"""Preference data (``prompt``/``chosen``/``rejected``) in the pipeline: packed by pairs (:mod:`packtools.core.pairs`)."""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from ..errors import PackingError
from .formats import output_columns
from .gather import ShardFolder, shard_rows


def write_packed_preference(
    batches: Iterator[pa.Table],
    folder: str,
    config: Any,
    fingerprint: str = "",
    parts: Sequence[tuple[str, int]] | None = None,
) -> dict[str, Any]:
    """Tokenized preference batches to packed pair rows (:func:`packtools.core.pairs.pack_pairs`), in shards.

    The tokenized pairs are gathered in memory (pair data is small next to pre-training corpora), then packed
    with one global plan: ``max_length`` bounds each packed row, and each pair keeps ``2 * prompt + chosen +
    rejected <= max_length`` under ``overlong`` (truncate: the prompt keeps its end, the completions their
    start; drop).  Rows are written ``shard_tokens`` at a time; ``fingerprint`` names the dataset in
    ``state.json``.  A separate step of the engine (:func:`packtools.pipeline.run.run_pipeline`).
    """
    from ..core.pairs import PAIR_COLUMNS, UnitOptions, pack_pairs

    names = output_columns("preference")
    tables = [t.select(names).rename_columns(list(PAIR_COLUMNS)) for t in batches]
    schema = pa.schema([(n, pa.list_(pa.int32())) for n in PAIR_COLUMNS])
    table = pa.concat_tables(tables).combine_chunks() if tables else schema.empty_table()
    try:
        overlong = config.overlong or "truncate"
        options = UnitOptions(overlong, config.max_prompt_length, config.shuffle, config.seed)
        packed, report = pack_pairs(table, config.max_length, options=options)
    except PackingError as exc:
        raise _in_input(exc, parts) from None
    shards = ShardFolder(folder)
    lengths = np.diff(np.asarray(packed.column("input_ids").combine_chunks().offsets))
    for start, stop in shard_rows(lengths, config.shard_tokens):
        shards.write(packed.slice(start, stop - start))
    shards.finish(packed.schema, fingerprint)
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
        "columns": packed.column_names,
        "shard_sums": shards.sums,  # for the manifest's ``shards`` (taken out of the stats by the run)
    }


def _in_input(exc: PackingError, parts: Sequence[tuple[str, int]] | None) -> PackingError:
    """``pack_pairs``' error about row N of all pairs, as one about the input file (and its row) holding it."""
    found = re.match(r"row (\d+): ", str(exc))
    if not found or not parts:
        return PackingError(str(exc))
    row = int(found.group(1))
    for where, rows in parts:
        if row < rows:
            return PackingError(f"input {where!r} pair {row}: {str(exc)[found.end() :]}")
        row -= rows
    return PackingError(str(exc))
