"""Preference data for Hugging Face ``datasets``: pairs packed whole (:func:`pack_preference`; reward-model
pairs, :func:`pack_reward_pairs`) and groups of one prompt with several completions (:func:`pack_groups`), the
prompt written once.

Both take a ``datasets.Dataset`` (its select/shuffle mapping honoured, read through
:mod:`packtools.compat.datasets`) or a ``pyarrow.Table``; the layouts are
:mod:`packtools.core.pairs`, :mod:`packtools.core.shared_pairs` and :mod:`packtools.core.shared_groups`.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ...compat.datasets import dataset_table
from ...constants import MEDIA_COLUMNS
from ...core.arrow import check_columns
from ...errors import PackingError
from ..data.datasets import datasets_module, derived_fingerprint, each_split
from ..data.drops import TokensDroppedWarning


def refuse_media(table: pa.Table, what: str) -> None:
    """Refuse rows holding image, video or audio columns (:data:`~packtools.constants.MEDIA_COLUMNS`: TRL's tokenized
    vision-language preference rows carry ``pixel_values`` beside ``prompt_ids``) in ``what``, which packs token
    columns only: packed without them (whatever ``columns=`` names), their placeholder tokens would stay in the
    rows with no pixels or audio and train with no error.  Raw ``images`` / ``image`` columns (TRL's vision
    format, the images its collator processes) are refused where any row holds one.

    >>> refuse_media(pa.table({"prompt_ids": [[1]], "pixel_values": [[0.5]]}), "pack_preference")
    Traceback (most recent call last):
    ...
    packtools.errors.PackingError: pack_preference: the rows hold the media column(s) ['pixel_values'] ...
    """
    found = [c for c in table.column_names if c in MEDIA_COLUMNS]
    found += [c for c in ("images", "image") if c in table.column_names and _any_set(table.column(c))]
    if found:
        raise PackingError(
            f"{what}: the rows hold the media column(s) {found} (images, videos or audio), and packtools packs "
            f"preference pairs and groups as text only: packed without them (whatever columns= names), each "
            f"sample's placeholder tokens would stay in its token ids with no pixels or audio. Train these rows "
            f"unpacked, or remove the media samples (their columns and placeholder tokens) first.",
            param="dataset",
        )


def _any_set(column: pa.ChunkedArray) -> bool:
    """Whether any row of ``column`` holds a value (a non-empty list, for a list column)."""
    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
        return bool(pc.any(pc.greater(pc.list_value_length(column), 0)).as_py())
    return column.null_count < len(column)


def _warn_fitted(
    what: str,
    units: str,
    counts: tuple[int, int, int],
    tokens_dropped: int,
    max_length: int,
    *,
    stacklevel: int,
) -> None:
    """Never silent: the warning of ``what`` (the call) when it truncated or dropped ``units`` to fit
    ``max_length``, with the fix (a larger ``max_length``); ``counts``: units in, truncated, dropped.  A
    :class:`~packtools.integrations.data.drops.TokensDroppedWarning`, as ``pack_dataset``'s, to filter by class."""
    total, truncated, dropped = counts
    if truncated or dropped:
        warnings.warn(
            f"{what}: {truncated} of {total} {units} truncated and {dropped} dropped to fit max_length={max_length} "
            f"({tokens_dropped} tokens left out); raise max_length to keep them whole, or pass return_report=True "
            f"for the details.",
            TokensDroppedWarning,
            stacklevel=stacklevel,
        )


def pack_preference(
    dataset: Any,
    max_length: int,
    strategy: str = "bfd",
    columns: Sequence[str] = (),
    *,
    overlong: str = "truncate",
    max_prompt_length: int | None = None,
    shuffle: bool = False,
    seed: int = 0,
    return_report: bool = False,
    share_prompt: bool = False,
) -> Any:
    """Pack preference pairs whole: each pair's ``[prompt + chosen][prompt + rejected]`` side by side in a row.

    ``dataset``: a ``datasets.Dataset`` (select/shuffle mappings honoured), ``DatasetDict`` or
    ``pyarrow.Table`` with ``prompt_ids``, ``chosen_ids`` and ``rejected_ids`` (TRL's tokenized format).
    Output (same type): ``input_ids``, ``completion_mask``, ``seq_lengths`` (sequence ``2k`` of a row is pair
    ``k``'s chosen, ``2k + 1`` its rejected) and each per-pair column named in ``columns`` (e.g.
    ``ref_chosen_logps``) as a list aligned with the row's pairs.  One global best-fit-decreasing plan over
    the pair lengths; a pair is never split.  Pairs longer than ``max_length`` are truncated (``overlong=
    "truncate"``: the prompt keeps its end, the completions their start, see
    :func:`packtools.core.pairs.fit_pairs`) or dropped (``"drop"``); a warning says how many, and
    ``return_report=True`` also returns the :class:`~packtools.core.pairs.PairReport` (a dict of them for a
    ``DatasetDict``).

    ``share_prompt=True`` writes each pair as ``[prompt][chosen][rejected]``, the prompt once, with
    ``prompt_lengths`` beside the columns above (layout: :mod:`packtools.core.shared_pairs`; the report is a
    :class:`~packtools.core.shared_pairs.SharedReport`); train on it with the tree attention
    (:func:`packtools.prepare_dpo_trainer` selects it, or :class:`~packtools.batches.tree.TreeCollator`).

    >>> from datasets import Dataset
    >>> ds = Dataset.from_dict({"prompt_ids": [[1, 2], [3]], "chosen_ids": [[4], [5]], "rejected_ids": [[6], [7, 8]]})
    >>> pack_preference(ds, 8)[:]["seq_lengths"]
    [[3, 3], [2, 3]]
    """
    from ...core.pairs import UnitOptions, pack_pairs

    options = UnitOptions(overlong, max_prompt_length, shuffle, seed)
    how = {
        "share_prompt": bool(share_prompt),
        "max_length": max_length,
        "columns": list(columns),
        **asdict(options),
    }

    def one(split: Any) -> tuple[Any, Any]:
        table, indices = (split, None) if isinstance(split, pa.Table) else dataset_table(split)
        refuse_media(table, "pack_preference")
        packed, report = pack_pairs(
            table,
            max_length,
            strategy,
            columns,
            options=options,
            row_indices=indices,
            share_prompt=share_prompt,
        )
        if isinstance(split, pa.Table):
            return packed, report
        fingerprint = derived_fingerprint(split, "pack_preference", **how)
        return datasets_module().Dataset(packed, split=split.split, fingerprint=fingerprint), report

    def warn(report: Any, name: str) -> None:
        # a SharedReport (share_prompt) counts its units, here pairs; a PairReport its pairs
        counts = (
            (report.units_in, report.units_truncated, report.units_dropped)
            if share_prompt
            else (report.pairs_in, report.pairs_truncated, report.pairs_dropped)
        )
        where = f" in split {name!r}" if name else ""
        _warn_fitted(
            f"pack_preference{where}", "pairs", counts, report.tokens_dropped, max_length, stacklevel=5
        )

    if not isinstance(dataset, pa.Table):
        ds_mod = datasets_module()
        if not isinstance(dataset, (ds_mod.Dataset, ds_mod.DatasetDict)):
            raise PackingError(
                f"dataset must be a datasets.Dataset, DatasetDict or pyarrow.Table, got {type(dataset).__name__}.",
                param="dataset",
            )
    return each_split(dataset, one, warn, return_report)


def pack_reward_pairs(
    dataset: Any,
    max_length: int,
    *,
    shuffle: bool = False,
    seed: int = 0,
    return_report: bool = False,
) -> Any:
    """Pack reward-model pairs whole: each pair's ``[chosen][rejected]`` side by side in a row.

    ``dataset``: a ``datasets.Dataset`` or ``pyarrow.Table`` with ``chosen_ids`` and ``rejected_ids`` (TRL's
    ``RewardTrainer`` tokenized format: the prompt is already part of both), and optionally ``margin``, which
    is kept as a per-pair list.  Output columns as :func:`pack_preference` (``input_ids``,
    ``completion_mask``, ``seq_lengths`` with sequence ``2k`` pair ``k``'s chosen, ``2k + 1`` its rejected).
    A reward model scores a sequence at its last token, so a pair longer than ``max_length`` is never
    truncated: it is dropped, with a warning that counts it (``return_report=True`` also returns the
    :class:`~packtools.core.pairs.PairReport`).  Train on the rows with
    :func:`packtools.integrations.preference.reward.prepare_reward_trainer`.

    >>> import pyarrow as pa
    >>> t = pa.table({"chosen_ids": [[1, 2, 3], [4]], "rejected_ids": [[5], [6, 7]], "margin": [0.5, 1.0]})
    >>> rows = pack_reward_pairs(t, 8).to_pydict()
    >>> rows["input_ids"], rows["seq_lengths"], rows["margin"]
    ([[1, 2, 3, 5, 4, 6, 7]], [[3, 1, 1, 2]], [[0.5, 1.0]])
    """
    from ...core.pairs import UnitOptions, pack_pairs

    table, indices = (dataset, None) if isinstance(dataset, pa.Table) else dataset_table(dataset)
    what = "reward pairs (TRL's RewardTrainer format)"
    refuse_media(table, "pack_reward_pairs")
    check_columns(
        table, ("chosen_ids", "rejected_ids"), what, "Pack trainer.train_dataset, which TRL tokenized."
    )
    if "prompt_ids" in table.column_names:
        raise PackingError(
            "the dataset has prompt_ids: RewardTrainer's tokenized pairs hold the prompt inside chosen_ids and "
            "rejected_ids. Pack trainer.train_dataset, or use pack_preference for DPO pairs.",
            param="dataset",
        )
    chosen = table.column("chosen_ids").type
    empty = pa.array(np.zeros(table.num_rows + 1, np.int32))
    prompts = pa.ListArray.from_arrays(empty, pa.array([], chosen.value_type)).cast(chosen)
    table = table.append_column("prompt_ids", prompts)
    columns = ["margin"] if "margin" in table.column_names else []
    options = UnitOptions(overlong="drop", shuffle=shuffle, seed=seed)
    packed, report = pack_pairs(table, max_length, "bfd", columns, options=options, row_indices=indices)
    if report.pairs_dropped:
        warnings.warn(
            f"pack_reward_pairs: {report.pairs_dropped} of {report.pairs_in} pairs are longer than "
            f"max_length={max_length} (chosen + rejected) and were dropped ({report.tokens_dropped} tokens); a "
            f"reward model scores the last token, so packtools does not truncate them. Raise max_length to keep them.",
            stacklevel=2,
        )
    if not isinstance(dataset, pa.Table):
        fingerprint = derived_fingerprint(
            dataset, "pack_reward_pairs", max_length=max_length, shuffle=shuffle, seed=seed
        )
        packed = datasets_module().Dataset(packed, split=dataset.split, fingerprint=fingerprint)
    return (packed, report) if return_report else packed


def pack_groups(
    dataset: Any,
    max_length: int,
    columns: Sequence[str] = (),
    completion_columns: Sequence[str] = (),
    *,
    overlong: str = "truncate",
    shuffle: bool = False,
    seed: int = 0,
    return_report: bool = False,
) -> Any:
    """Pack groups of one prompt and ``G`` completions as ``[P][C_1]...[C_G]``, the prompt once.

    ``dataset``: a ``datasets.Dataset`` or ``pyarrow.Table`` with ``prompt_ids`` and ``completion_ids`` (a
    list of token lists per row); per-group ``columns`` and per-completion ``completion_columns`` (e.g.
    ``rewards``, ``advantages``) are kept aligned (see :func:`packtools.core.shared_groups.pack_groups`).  Groups
    longer than ``max_length`` are truncated (``overlong="truncate"``) or dropped (``"drop"``); a warning says how
    many, and ``return_report=True`` also returns the :class:`~packtools.core.shared_pairs.SharedReport`.
    """
    from ...core.pairs import UnitOptions
    from ...core.shared_groups import pack_groups as pack_table_groups

    options = UnitOptions(overlong=overlong, shuffle=shuffle, seed=seed)
    table, indices = (dataset, None) if isinstance(dataset, pa.Table) else dataset_table(dataset)
    refuse_media(table, "pack_groups")
    packed, report = pack_table_groups(
        table, max_length, columns, completion_columns, options=options, row_indices=indices
    )
    counts = (report.units_in, report.units_truncated, report.units_dropped)
    _warn_fitted("pack_groups", "groups", counts, report.tokens_dropped, max_length, stacklevel=3)
    if not isinstance(dataset, pa.Table):
        how = {
            "max_length": max_length,
            "columns": list(columns),
            "completion_columns": list(completion_columns),
        }
        fingerprint = derived_fingerprint(dataset, "pack_groups", **how, **asdict(options))
        packed = datasets_module().Dataset(packed, split=dataset.split, fingerprint=fingerprint)
    return (packed, report) if return_report else packed
