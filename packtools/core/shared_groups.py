"""Prompt-shared packing of groups: one prompt and ``G`` completions as ``[P][C_1]...[C_G]``, the prompt once.

The layout, row columns and plan are those of :mod:`packtools.core.shared_pairs` (a preference pair is a group
of two); this module reads the nested ``completion_ids`` column, fits over-long groups and keeps per-group and
per-completion columns aligned.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from ..errors import PackingError
from .arrow import ListColumn, check_columns, is_list_type, read_list_column
from .pairs import (
    UnitOptions,
    _read_pair_columns,
    check_overlong,
    check_unit_args,
    default_prompt_budget,
    plan_units,
)
from .ragged import offsets_of
from .shared_pairs import (
    SharedReport,
    _check_nonempty,
    _materialize,
    _Units,
    per_unit_columns,
    unit_lengths,
)

GROUP_COLUMNS = ("prompt_ids", "completion_ids")


def _water_fill(lengths: np.ndarray, room: int) -> np.ndarray:
    """Largest caps ``min(len, cap)`` with a sum of at most ``room``, the shorter completions whole first."""
    if lengths.sum() <= room:
        return lengths.copy()
    order = np.sort(lengths)
    g = lengths.shape[0]
    used = 0
    cap = 0
    for i, length in enumerate(order):  # G is small: a loop over the completions of one unit
        rest = g - i
        if used + length * rest > room:
            cap = (room - used) // rest
            break
        used += length
    return np.minimum(lengths, cap)


def fit_units(
    prompt: np.ndarray,
    completions: list[np.ndarray],
    max_length: int,
    overlong: str = "truncate",
    max_prompt_length: int | None = None,
) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """``(keep, prompt_keep, completion_keep)`` so every kept unit fits ``max_length`` in the shared layout.

    Units that fit are untouched; ``drop`` removes the others.  ``truncate`` keeps the *end* of the prompt
    (at least ``max_prompt_length`` tokens, default ``max_length // 4``, cut only as far as the whole
    completions need) and the *start* of each completion: the completions share what is left, the shorter
    ones whole first (equal caps on the longer ones).
    """
    overlong = check_overlong(overlong)
    lp = np.asarray(prompt, np.int64)
    comps = [np.asarray(c, np.int64) for c in completions]
    g = np.array([c.shape[0] for c in comps], np.int64)
    sums = np.array([int(c.sum()) for c in comps], np.int64)
    fits = unit_lengths(lp, sums, g) <= max_length
    kp = lp.copy()
    kc = [c.copy() for c in comps]
    if overlong == "drop":
        return fits, kp, kc
    budget = default_prompt_budget(max_length) if max_prompt_length is None else max_prompt_length
    for i in np.flatnonzero(~fits):
        need = int(sums[i]) + int(g[i]) - 1  # tokens beside the prompt when the completions stay whole
        kp[i] = min(int(lp[i]), max(budget, max_length - need))
        room = max_length - (kp[i] + int(g[i]) - 1 if kp[i] > 0 else 0)
        kc[i] = _water_fill(comps[i], room)
    return np.ones(lp.shape[0], bool), kp, kc


def refuse_empty_groups(sizes: np.ndarray) -> None:
    """Refuse a group without a completion (``sizes``: the completions of each row, in the dataset's order)."""
    empty = np.flatnonzero(sizes < 1)
    if empty.size:
        raise PackingError(
            f"row {int(empty[0])}: completion_ids holds no completion; a group needs one.", param="dataset"
        )


def _read_groups(
    table: pa.Table, completion_columns: Sequence[str], rows: np.ndarray
) -> tuple[ListColumn, ListColumn, np.ndarray]:
    """The prompts, the completions and each row's group size; ``rows``: the table rows the dataset holds, in
    its order (an empty group outside them is not refused; a refused row is named by its place in the dataset).
    A per-completion column must match its completions in every row: its values are read by their offsets."""
    check_columns(table, GROUP_COLUMNS, "group tables (a prompt and a list of completions per row)")
    prompt = read_list_column(table.column("prompt_ids"), "prompt_ids")
    nested = table.column("completion_ids").combine_chunks()
    if not is_list_type(nested.type) or not is_list_type(nested.type.value_type):
        raise PackingError(
            f"completion_ids must be a list of token lists per row (list<list<int>>), got {nested.type}.",
            param="dataset",
        )
    if nested.null_count or nested.flatten().null_count:
        raise PackingError("completion_ids has a null group or completion; fill or drop it.", param="dataset")
    sizes = np.diff(np.asarray(nested.offsets, np.int64))
    refuse_empty_groups(sizes[rows])
    comps = read_list_column(nested.flatten(), "completion_ids")
    if str(comps.type.value_type) != str(prompt.type.value_type):
        raise PackingError(
            f"prompt_ids ({prompt.type.value_type}) and completion_ids ({comps.type.value_type}) must hold one "
            f"integer type; cast them.",
            param="dataset",
        )
    for name in completion_columns:
        if name not in table.column_names:
            raise PackingError(
                f"per-completion column {name!r} is not in the table.", param="completion_columns"
            )
        arr = table.column(name).combine_chunks()
        if not is_list_type(arr.type):
            raise PackingError(
                f"per-completion column {name!r} must hold a list per row (one value per completion), got "
                f"{arr.type}.",
                param="completion_columns",
            )
        own = np.diff(np.asarray(arr.offsets, np.int64))
        bad = np.flatnonzero(own != sizes)  # every row: the values are taken by the completions' offsets
        if bad.size:
            at = int(bad[0])
            place = np.flatnonzero(rows == at)
            row = (
                f"row {int(place[0])}"
                if place.size
                else f"row {at} of the table under the dataset (not selected)"
            )
            raise PackingError(
                f"{row}: {name!r} has {own[at]} values for {sizes[at]} completions; give one per completion.",
                param="completion_columns",
            )
    return prompt, comps, sizes


def pack_groups(
    table: pa.Table,
    max_length: int,
    columns: Sequence[str] = (),
    completion_columns: Sequence[str] = (),
    *,
    options: UnitOptions | None = None,
    row_indices: np.ndarray | None = None,
) -> tuple[pa.Table, SharedReport]:
    """Pack groups of one prompt and ``G`` completions as ``[P][C_1]...[C_G]``, the prompt once.

    Input: ``prompt_ids`` (a token list per row), ``completion_ids`` (a list of token lists per row; ``G``
    may differ between rows), per-group ``columns`` (one number per row) and per-completion
    ``completion_columns`` (a list per row, one value per completion, e.g. ``rewards`` or ``advantages``).
    Output: the rows of the module docstring; per-group columns become lists aligned with the row's units,
    per-completion columns lists aligned with its completions (the order of ``seq_lengths``).

    >>> t = pa.table({"prompt_ids": [[1, 2]], "completion_ids": [[[3], [4, 5], [6]]], "adv": [[0.5, -1.0, 0.5]]})
    >>> rows, _ = pack_groups(t, 16, completion_columns=["adv"])
    >>> d = rows.to_pydict()
    >>> d["input_ids"], d["seq_lengths"], d["group_sizes"], d["adv"]
    ([[1, 2, 3, 2, 4, 5, 2, 6]], [[3, 4, 3]], [[3]], [[0.5, -1.0, 0.5]])
    """
    options = options or UnitOptions()
    max_length, overlong = check_unit_args(table, max_length, "bfd", options.overlong, "prompt-shared unit")
    max_prompt_length = options.max_prompt_length
    if max_prompt_length is not None and (
        isinstance(max_prompt_length, bool)
        or not isinstance(max_prompt_length, (int, np.integer))
        or not 0 <= max_prompt_length < max_length
    ):
        raise PackingError(
            f"max_prompt_length={max_prompt_length!r} must be an int in [0, max_length).",
            param="max_prompt_length",
        )
    if isinstance(completion_columns, str):
        completion_columns = [completion_columns]
    n_all = table.num_rows
    rows = np.arange(n_all) if row_indices is None else np.ascontiguousarray(row_indices, np.int64)
    prompt, comps, sizes = _read_groups(table, completion_columns, rows)
    extra = _read_pair_columns(table, columns) if columns else []
    first = offsets_of(sizes)
    lp, g = prompt.lengths()[rows], sizes[rows]
    comp_len = comps.lengths()
    branch_rows = [np.arange(first[r], first[r + 1]) for r in rows]
    per_unit = [comp_len[b] for b in branch_rows]
    keep, kp, kc = fit_units(lp, per_unit, max_length, overlong, max_prompt_length)
    branch_unit = np.repeat(np.arange(rows.shape[0]), g)
    kc_flat = np.concatenate(kc) if kc else np.zeros(0, np.int64)
    _check_nonempty(keep, kc_flat, branch_unit, rows)
    kept = np.flatnonzero(keep)
    sums = np.array([int(kc[i].sum()) for i in kept], np.int64)
    p = plan_units(unit_lengths(kp[kept], sums, g[kept]), max_length, options)
    order = kept[p.seg_source]
    source = rows[order]
    units = _Units(
        source=source,
        prompt_from=lp[order] - kp[order],
        prompt_keep=kp[order],
        group=g[order],
        column=np.zeros(int(g[order].sum()), np.int64),
        row=np.concatenate([branch_rows[i] for i in order]) if order.size else np.zeros(0, np.int64),
        keep=np.concatenate([kc[i] for i in order]) if order.size else np.zeros(0, np.int64),
    )
    arrays = _materialize(prompt, [comps], units, p, with_groups=True) + per_unit_columns(extra, source, p)
    first_branch = offsets_of(units.group)
    branch_offsets = pa.array(first_branch[p.row_offsets].astype(np.int32))
    for name in completion_columns:
        flat = table.column(name).combine_chunks().flatten()
        arrays.append((name, pa.ListArray.from_arrays(branch_offsets, flat.take(pa.array(units.row)))))
    cut_p = keep & (kp < lp)
    cut_c = np.array([bool((kc[i] < per_unit[i]).any()) for i in range(rows.shape[0])], bool) & keep
    report = SharedReport(
        max_length=max_length,
        units_in=int(rows.shape[0]),
        units_out=int(keep.sum()),
        units_truncated=int((cut_p | cut_c).sum()),
        prompts_truncated=int(cut_p.sum()),
        completions_truncated=int(sum(int((kc[i] < per_unit[i]).sum()) for i in kept)),
        units_dropped=int((~keep).sum()),
        tokens_in=int(lp.sum() + sum(int(c.sum()) for c in per_unit)),
        tokens_kept=p.tokens_kept,
        tokens_unshared=int((g[kept] * kp[kept]).sum() + sums.sum()),
        rows=p.num_rows,
        lower_bound=p.lower_bound,
        repeated=int((g[kept] - 1)[kp[kept] > 0].sum()),
    )
    return pa.Table.from_arrays([a for _, a in arrays], names=[n_ for n_, _ in arrays]), report
