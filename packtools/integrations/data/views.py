"""Packed rows of a Hugging Face ``datasets.Dataset`` without a copy: :func:`packed_view` and :class:`DatasetView`,
gathered on demand from the dataset's Arrow buffers (read through :mod:`packtools.compat.datasets`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from ...batches.view import PackedView
from ...compat.datasets import dataset_table
from ...core.pack import read_columns
from ...core.plan import Strategy, check_max_length, check_strategy
from ...errors import PackingError
from .datasets import datasets_module, pack_split
from .drops import DropReport, warn_dropped


class DatasetView(PackedView):
    """A :class:`~packtools.batches.view.PackedView` over a ``datasets.Dataset`` (made by :func:`packed_view`).

    It keeps the dataset for :meth:`materialize` and pickling (a memory-mapped one pickles as its file paths and
    row mapping)."""

    dataset: Any
    _args: dict[str, Any]

    def materialize(self, keep_in_memory: bool | None = None) -> Any:  # type: ignore[override]
        """Every packed row, as :func:`packtools.pack_dataset` with the same arguments returns them (same plan, same
        format, same cache file for a memory-mapped dataset; ``keep_in_memory`` as there)."""
        a = self._args
        packed, _ = pack_split(
            self.dataset,
            self.plan.max_length,
            self.plan.strategy,
            a["columns"],
            shuffle=a["shuffle"],
            seed=a["seed"],
            keep_in_memory=keep_in_memory,
            plan=self.plan,
        )
        return packed

    def __getstate__(self) -> dict[str, Any]:
        return {"dataset": self.dataset, "plan": self.plan, "args": self._args, "columns": self._names}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.dataset, self._args = state["dataset"], state["args"]
        table, indices = dataset_table(self.dataset)
        self._bind(table, *read_columns(table, state["columns"]), state["plan"], indices)


def packed_view(
    dataset: Any,
    max_length: int,
    strategy: Strategy | str = "bfd",
    *,
    shuffle: bool = False,
    seed: int = 0,
    columns: Sequence[str] | None = None,
    return_report: bool = False,
) -> Any:
    """Packed rows of ``dataset`` gathered on demand from its Arrow buffers: a :class:`PackedView`.

    Takes what :func:`pack_dataset` takes -- a ``datasets.Dataset`` (in memory or memory-mapped, with
    select/shuffle mappings; a ``DatasetDict`` gives a dict of views) or a ``pyarrow.Table`` -- and plans the
    same rows, but copies no token: ``view[i]`` gathers row ``i`` (a dict of NumPy arrays with
    ``seq_lengths``), :class:`~packtools.batches.ArrowCollator` gathers a whole batch, and ``view.materialize()``
    returns exactly what ``pack_dataset`` (``pack_table`` for a table) returns for the same arguments.

    >>> from datasets import Dataset
    >>> ds = Dataset.from_dict({"input_ids": [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10], [11]]})
    >>> view = packed_view(ds, 4)
    >>> len(view), view[1]["input_ids"].tolist(), view[1]["seq_lengths"].tolist()
    (3, [8, 9, 10, 11], [3, 1])
    >>> from packtools import pack_dataset
    >>> view.materialize()[:] == pack_dataset(ds, 4)[:]
    True

    Tokens the plan drops raise a :class:`~packtools.integrations.data.drops.TokensDroppedWarning`, as in
    :func:`pack_dataset`; ``return_report=True`` returns ``(view, report)``.
    """
    strategy = check_strategy(strategy)
    max_length = check_max_length(max_length)
    if isinstance(dataset, pa.Table):
        tview = PackedView.from_table(
            dataset, max_length, strategy, shuffle=shuffle, seed=seed, columns=columns
        )
        return _reported(tview, "packed_view", return_report)
    ds_mod = datasets_module()
    if isinstance(dataset, ds_mod.DatasetDict):
        views = {}
        for name, split in dataset.items():  # each split's drops warned by its own call
            views[name] = packed_view(
                split, max_length, strategy, shuffle=shuffle, seed=seed, columns=columns
            )
        reports = {name: DropReport.from_plan(v.plan) for name, v in views.items()}
        return (views, reports) if return_report else views
    if isinstance(dataset, ds_mod.IterableDataset):
        raise PackingError(
            "an IterableDataset has no random access, so it cannot be viewed by row; pack it as a stream with "
            "packtools.pack_dataset(dataset, max_length) (windows of rows), or load it as a Dataset.",
            param="dataset",
        )
    if not isinstance(dataset, ds_mod.Dataset):
        raise PackingError(
            f"dataset must be a datasets.Dataset, DatasetDict or pyarrow.Table, got {type(dataset).__name__}.",
            param="dataset",
        )
    table, indices = dataset_table(dataset)
    view = DatasetView.from_table(
        table, max_length, strategy, shuffle=shuffle, seed=seed, columns=columns, indices=indices
    )
    view.dataset = dataset
    view._args = {"columns": None if columns is None else list(columns), "shuffle": shuffle, "seed": seed}
    return _reported(view, "packed_view", return_report)


def _reported(view: Any, what: str, return_report: bool) -> Any:
    report = DropReport.from_plan(view.plan)
    warn_dropped(report, what, stacklevel=3)
    return (view, report) if return_report else view
