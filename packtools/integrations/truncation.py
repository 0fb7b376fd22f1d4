"""Truncating Hugging Face ``datasets`` (extra ``packtools[datasets]``): :func:`truncate_dataset` cuts list columns
to ``max_length`` values, with the drops reported (never silent)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from ..core.pack import truncate_table
from ..core.plan import check_max_length
from ..errors import PackingError
from .compat.datasets import dataset_table
from .datasets import datasets_module, derived_fingerprint, restore_format
from .drops import DropReport, TokensDroppedWarning, warn_dropped


def truncate_dataset(
    dataset: Any, max_length: int, columns: Sequence[str] | None = None, *, return_report: bool = False
) -> Any:
    """Keep the first ``max_length`` values of each list column (all, or those named) of a dataset.

    Works on ``Dataset`` and ``DatasetDict`` (and on a ``pyarrow.Table``); the format is kept.  Tokens cut
    (counted on ``input_ids``, else the first truncated column) raise a
    :class:`~packtools.integrations.drops.TokensDroppedWarning`; ``return_report=True`` returns
    ``(truncated, report)``.

    >>> from datasets import Dataset
    >>> truncate_dataset(Dataset.from_dict({"input_ids": [[1, 2, 3], [4]]}), 2)[:]
    {'input_ids': [[1, 2], [4]]}
    """
    if isinstance(dataset, pa.Table):
        out = truncate_table(dataset, max_length, columns)
        report = _truncate_report(dataset, max_length, columns)
        warn_dropped(report, "truncate_dataset")
        return (out, report) if return_report else out
    ds_mod = datasets_module()
    max_length = check_max_length(max_length)
    if isinstance(dataset, ds_mod.DatasetDict):
        results = {}
        for k, v in dataset.items():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", TokensDroppedWarning)
                results[k] = truncate_dataset(v, max_length, columns, return_report=True)
            warn_dropped(results[k][1], "truncate_dataset", k)
        out = ds_mod.DatasetDict({k: r[0] for k, r in results.items()})
        return (out, {k: r[1] for k, r in results.items()}) if return_report else out
    if not isinstance(dataset, ds_mod.Dataset):
        raise PackingError(
            f"dataset must be a datasets.Dataset or DatasetDict, got {type(dataset).__name__}."
        )
    table, indices = dataset_table(dataset)
    if indices is not None:
        table = table.take(pa.array(indices))
    fingerprint = derived_fingerprint(dataset, "truncate", max_length=max_length, columns=columns)
    out = ds_mod.Dataset(
        truncate_table(table, max_length, columns), split=dataset.split, fingerprint=fingerprint
    )
    report = _truncate_report(table, max_length, columns)
    warn_dropped(report, "truncate_dataset")
    out = restore_format(out, dict(dataset.format), [])
    return (out, report) if return_report else out


def _truncate_report(table: pa.Table, max_length: int, columns: Sequence[str] | None) -> DropReport:
    from ..core.arrow import column_lengths, is_list_type

    names = [f.name for f in table.schema if is_list_type(f.type)] if columns is None else list(columns)
    name = "input_ids" if "input_ids" in names else (names[0] if names else None)
    lengths = column_lengths(table.column(name)) if name else np.zeros(0, np.int64)
    return DropReport.from_lengths(lengths, max_length, "truncate")
