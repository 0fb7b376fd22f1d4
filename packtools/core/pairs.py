"""Preference pairs packed whole: ``[prompt + chosen][prompt + rejected]`` side by side in one row.

The packing unit is the pair: its two sequences sit next to each other, chosen first (the row columns:
:func:`pack_pairs`), and a pair is never split across rows; one global best-fit-decreasing plan places them.

Pairs longer than ``max_length`` are made to fit (:func:`fit_pairs`) or dropped, and counted in a
:class:`PairReport`; nothing else changes a pair.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
import pyarrow as pa

from ..constants import COMPLETION_MASK, SEQ_LENGTHS
from ..errors import PackingError, check_choice
from . import buffers
from .arrow import ListColumn, check_columns, copy_segments, list_array, ones_at, read_list_column
from .plan import PackPlan, check_max_length
from .plan import plan as make_plan
from .shared_pairs import SharedReport, _check_nonempty, _Units, per_unit_columns, unit_lengths
from .shared_pairs import _materialize as _materialize_shared

#: Input columns of a tokenized preference table (TRL's names).
PAIR_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")
#: Columns of a row of packed pairs, before the per-pair ``columns`` (``pack_preference``,
#: ``pack_reward_pairs``): what the DPO and reward trainers keep.
PAIR_ROW_COLUMNS = ("input_ids", COMPLETION_MASK, SEQ_LENGTHS)
#: What to do with a pair longer than ``max_length``.
OVERLONG = ("truncate", "drop")


@dataclass(frozen=True)
class PairReport:
    """What packing did to the pairs: how many were kept whole, truncated or dropped, and the rows made.

    ``tokens_*`` count the tokens of the packed layout, where the prompt appears twice (once per sequence).
    """

    max_length: int
    pairs_in: int
    pairs_out: int
    pairs_truncated: int
    prompts_truncated: int
    chosen_truncated: int
    rejected_truncated: int
    pairs_dropped: int
    tokens_in: int
    tokens_kept: int
    rows: int
    lower_bound: int

    @property
    def tokens_dropped(self) -> int:
        return self.tokens_in - self.tokens_kept

    @property
    def fill(self) -> float:
        return self.tokens_kept / (self.rows * self.max_length) if self.rows else 1.0

    def summary(self) -> dict[str, int | float]:
        return {**asdict(self), "tokens_dropped": self.tokens_dropped, "fill": self.fill}


@dataclass(frozen=True)
class UnitOptions:
    """How a packer of whole units (pairs, prompt-shared pairs, groups) fits and orders them: ``overlong``
    (``"truncate"`` or ``"drop"`` a unit longer than ``max_length``), ``max_prompt_length`` (the prompt's budget
    when truncating; ``None``: the packer's default) and ``shuffle`` / ``seed`` (the order of the rows).  One
    value, from the public packers (:func:`packtools.dpo.pack_preference`, ``pack_groups``, the pipeline) to
    the core ones."""

    overlong: str = "truncate"
    max_prompt_length: int | None = None
    shuffle: bool = False
    seed: int = 0


@dataclass(frozen=True)
class FittedPairs:
    """Kept part of every pair: the prompt keeps its last ``prompt_keep`` tokens, the completions their first."""

    keep: np.ndarray  # bool [n]: the pair is packed
    prompt_keep: np.ndarray  # int64 [n]
    chosen_keep: np.ndarray  # int64 [n]
    rejected_keep: np.ndarray  # int64 [n]

    @property
    def pair_lengths(self) -> np.ndarray:
        return 2 * self.prompt_keep + self.chosen_keep + self.rejected_keep


def check_overlong(overlong: str) -> str:
    use = "'truncate' (the prompt keeps its end, the completions their start) or 'drop'"
    return check_choice("overlong", overlong, OVERLONG, use)


def default_prompt_budget(max_length: int) -> int:
    """Tokens an over-long pair's prompt keeps at least (if it has them): a quarter of the row, so its two
    copies take at most half of it."""
    return max_length // 4


def fit_pairs(
    prompt: np.ndarray,
    chosen: np.ndarray,
    rejected: np.ndarray,
    max_length: int,
    overlong: str = "truncate",
    max_prompt_length: int | None = None,
    *,
    shared: bool = False,
) -> FittedPairs:
    """Decide what each pair keeps so that it fits ``max_length``: ``2 * prompt + chosen + rejected`` tokens, or
    with ``shared`` (the prompt written once, :mod:`packtools.core.shared_pairs`) ``prompt + 1 + chosen +
    rejected`` (``chosen + rejected`` without a prompt).

    Pairs that fit are untouched.  ``drop`` removes the others.  ``truncate`` keeps the *end* of the prompt
    and the *start* of each completion: the prompt keeps ``min(len, max(budget, longest))`` tokens, where
    ``longest`` is the longest prompt that fits beside the whole completions and ``budget`` is
    ``max_prompt_length`` (default ``max_length // 4``), so it is cut only as far as the whole completions need;
    the completions then share what is left, the shorter one whole if it fits in half, else both cut to half.

    >>> f = fit_pairs(np.array([2, 10]), np.array([3, 9]), np.array([1, 2]), 12)
    >>> f.prompt_keep.tolist(), f.chosen_keep.tolist(), f.rejected_keep.tolist(), f.pair_lengths.tolist()
    ([2, 3], [3, 4], [1, 2], [8, 12])
    """
    overlong = check_overlong(overlong)
    lp, lc, lr = (np.asarray(a, np.int64) for a in (prompt, chosen, rejected))

    def prompt_cost(
        kept: np.ndarray,
    ) -> np.ndarray:  # the tokens a prompt of `kept` tokens takes in the layout
        return np.where(kept > 0, kept + 1, 0) if shared else 2 * kept

    fits = prompt_cost(lp) + lc + lr <= max_length
    if overlong == "drop":
        return FittedPairs(fits, lp.copy(), lc.copy(), lr.copy())
    budget = default_prompt_budget(max_length) if max_prompt_length is None else max_prompt_length
    longest = max_length - lc - lr - 1 if shared else (max_length - lc - lr) // 2
    kp = np.where(fits, lp, np.minimum(lp, np.maximum(budget, longest)))
    room = max_length - prompt_cost(kp)
    cap = np.maximum(room // 2, room - np.minimum(lc, lr))
    kc = np.where(fits, lc, np.minimum(lc, cap))
    kr = np.where(fits, lr, np.minimum(lr, cap))
    return FittedPairs(np.ones(lp.shape[0], bool), kp, kc, kr)


def _check_prompt_budget(max_prompt_length: int | None, max_length: int) -> None:
    if max_prompt_length is None:
        return
    if (
        isinstance(max_prompt_length, bool)
        or not isinstance(max_prompt_length, (int, np.integer))
        or max_prompt_length < 0
        or 2 * max_prompt_length + 2 > max_length
    ):
        raise PackingError(
            f"max_prompt_length={max_prompt_length!r} must be an int with 2 * max_prompt_length + 2 <= "
            f"max_length ({max_length}): a truncated pair holds its prompt twice and at least one token of each "
            f"completion.",
            param="max_prompt_length",
        )


def _read_pairs(table: pa.Table) -> list[ListColumn]:
    fix = "Tokenize with TRL's DPOTrainer or `packtools pack --format preference`."
    check_columns(table, PAIR_COLUMNS, "preference tables", fix)
    cols = [read_list_column(table.column(c), c) for c in PAIR_COLUMNS]
    dtypes = {str(c.type.value_type) for c in cols}
    if len(dtypes) > 1 or not pa.types.is_integer(cols[0].type.value_type):
        raise PackingError(
            f"{list(PAIR_COLUMNS)} must all hold lists of one integer type, got {sorted(dtypes)}; cast them "
            f"(e.g. to list<int32>).",
            param="dataset",
        )
    return cols


def _read_pair_columns(table: pa.Table, names: Sequence[str]) -> list[tuple[str, pa.ChunkedArray]]:
    if isinstance(names, str):
        names = [names]
    out = []
    for name in names:
        if name not in table.column_names:
            raise PackingError(
                f"per-pair column {name!r} is not in the table; it has {table.column_names}.", param="columns"
            )
        if name in PAIR_COLUMNS or name in PAIR_ROW_COLUMNS:
            raise PackingError(
                f"{name!r} cannot be a per-pair column: packing builds it. Name only columns with one value "
                f"per pair (e.g. ref_chosen_logps).",
                param="columns",
            )
        column = table.column(name)
        t = column.type
        if not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)):
            raise PackingError(
                f"per-pair column {name!r} has type {t}; it must hold one number per pair (int, float or bool).",
                param="columns",
            )
        if column.null_count:
            row = int(np.flatnonzero(np.asarray(column.is_null()))[0])
            raise PackingError(
                f"per-pair column {name!r} is null at row {row}; fill or drop it.", param="columns"
            )
        out.append((name, column))
    return out


def check_unit_args(
    table: pa.Table, max_length: int, strategy: str, overlong: str, unit: str = "pair"
) -> tuple[int, str]:
    """The checks every packer of whole units (pairs, prompt-shared pairs and groups) makes on its arguments;
    returns ``(max_length, overlong)`` normalized."""
    if not isinstance(table, pa.Table):
        raise PackingError(f"table must be a pyarrow.Table, got {type(table).__name__}.", param="dataset")
    max_length = check_max_length(max_length)
    if strategy != "bfd":
        raise PackingError(
            f"strategy={strategy!r}: a {unit} is packed whole, so only 'bfd' applies ('bfd_split' and 'wrapped' "
            f"cut sequences, which would split a {unit} or a sequence's log-probability).",
            param="strategy",
        )
    if max_length < 4:
        raise PackingError(
            f"max_length={max_length} cannot hold a {unit} (at least 4 tokens).", param="max_length"
        )
    return max_length, check_overlong(overlong)


def plan_units(lengths: np.ndarray, max_length: int, options: UnitOptions) -> PackPlan:
    """The best-fit-decreasing plan of whole units (each fits: the fitting step made sure), shuffled on request."""
    p = make_plan(lengths, max_length, "bfd")
    if options.shuffle:
        p = p.shuffled(options.seed)
    if p.tokens_dropped:  # cannot happen: every unit fits; a guard against a planning bug
        raise PackingError("internal error: the plan of whole units cut a unit.")
    return p


def pack_pairs(
    table: pa.Table,
    max_length: int,
    strategy: str = "bfd",
    columns: Sequence[str] = (),
    *,
    options: UnitOptions | None = None,
    row_indices: np.ndarray | None = None,
    share_prompt: bool = False,
) -> tuple[pa.Table, PairReport | SharedReport]:
    """Pack the preference pairs of ``table`` whole into rows of at most ``max_length`` tokens.

    Input: list columns ``prompt_ids``, ``chosen_ids``, ``rejected_ids``, plus the per-pair columns named in
    ``columns`` (one number per pair, e.g. precomputed ``ref_chosen_logps``).  Output columns: ``input_ids``
    (``[prompt + chosen][prompt + rejected]`` for each pair of the row, in that order), ``completion_mask``
    (``list<int8>``, 1 on completion tokens), ``seq_lengths`` (``list<int32>``: ``2k`` is pair ``k``'s chosen,
    ``2k + 1`` its rejected) and each named column as a list with one value per pair of the row, in the same
    order.  ``options``: how over-long pairs are fitted and the rows ordered (:class:`UnitOptions`; its defaults
    when ``None``).  ``row_indices`` selects (and orders) the input rows, as a dataset's indices mapping does.

    >>> t = pa.table({"prompt_ids": [[1, 2], [3]], "chosen_ids": [[4], [5, 6]], "rejected_ids": [[7, 8], [9]],
    ...               "score": [0.5, 1.5]})
    >>> rows, report = pack_pairs(t, 16, columns=["score"])
    >>> rows.to_pydict()["input_ids"], rows.to_pydict()["seq_lengths"], rows.to_pydict()["score"]
    ([[1, 2, 4, 1, 2, 7, 8, 3, 5, 6, 3, 9]], [[3, 4, 3, 2]], [[0.5, 1.5]])
    >>> rows.to_pydict()["completion_mask"]
    [[0, 0, 1, 0, 0, 1, 1, 0, 1, 1, 0, 1]]

    ``share_prompt=True`` writes each pair as ``[prompt][chosen][rejected]``, the prompt once (layout:
    :mod:`packtools.core.shared_pairs`): a pair takes ``P + C + R + 1`` tokens, ``seq_lengths`` holds ``P + C,
    P + R`` per pair, ``prompt_lengths`` the kept ``P``, and the report is a
    :class:`~packtools.core.shared_pairs.SharedReport`.

    >>> t = pa.table({"prompt_ids": [[1, 2, 3]], "chosen_ids": [[4]], "rejected_ids": [[5, 6]]})
    >>> d = pack_pairs(t, 16, share_prompt=True)[0].to_pydict()
    >>> d["input_ids"], d["completion_mask"], d["seq_lengths"], d["prompt_lengths"]
    ([[1, 2, 3, 4, 3, 5, 6]], [[0, 0, 0, 1, 0, 1, 1]], [[4, 5]], [[3]])
    """
    options = options or UnitOptions()
    unit = "prompt-shared unit" if share_prompt else "pair"
    max_length, overlong = check_unit_args(table, max_length, strategy, options.overlong, unit)
    max_prompt_length = options.max_prompt_length
    _check_prompt_budget(max_prompt_length, max_length)
    cols = _read_pairs(table)
    extra = _read_pair_columns(table, columns)
    if row_indices is not None:
        row_indices = np.ascontiguousarray(row_indices, np.int64)
    if share_prompt:
        return _pack_shared(cols, extra, max_length, options, row_indices)
    lp, lc, lr = (c.lengths() for c in cols)
    if row_indices is not None:
        lp, lc, lr = lp[row_indices], lc[row_indices], lr[row_indices]
    fitted = fit_pairs(lp, lc, lr, max_length, overlong, max_prompt_length)
    kp, kc, kr = fitted.prompt_keep, fitted.chosen_keep, fitted.rejected_keep
    empty = np.flatnonzero(fitted.keep & ((kc == 0) | (kr == 0)))
    if empty.size:  # the same rule as share_prompt=True (core.shared_pairs): a completion needs a token
        i = int(empty[0])
        row = i if row_indices is None else int(row_indices[i])
        which = "chosen" if kc[i] == 0 else "rejected"
        raise PackingError(
            f"row {row}: the {which} completion would be empty (prompt {lp[i]}, chosen {lc[i]}, rejected "
            f"{lr[i]} tokens; kept {kp[i]}, {kc[i]}, {kr[i]}); every completion needs a token to have a "
            f"log-probability (an empty one would enter the loss as log-probability 0, with nothing learned "
            f"from it). Filter pairs with an empty completion out, or use overlong='drop' when the prompt "
            f"leaves it no room.",
            param="dataset",
        )
    kept = np.flatnonzero(fitted.keep)
    units = fitted.pair_lengths[kept]
    p = plan_units(units, max_length, options)
    out = _materialize(cols, extra, p, kept, fitted, row_indices)
    report = _report(max_length, lp, lc, lr, fitted, p)
    return out, report


def _materialize(
    cols: list[ListColumn],
    extra: list[tuple[str, pa.ChunkedArray]],
    p: PackPlan,
    kept: np.ndarray,
    fitted: FittedPairs,
    row_indices: np.ndarray | None,
) -> pa.Table:
    pair = kept[p.seg_source]  # index into the (selected) input pairs, in packed order
    source = pair if row_indices is None else row_indices[pair]
    kp, kc, kr = fitted.prompt_keep[pair], fitted.chosen_keep[pair], fitted.rejected_keep[pair]
    lp = cols[0].lengths()[source]
    pair_start = p.seg_dest  # start of each pair in the packed token stream
    chosen_len, rejected_len = kp + kc, kp + kr
    total = p.tokens_kept
    value_type = cols[0].type.value_type
    dtype = cols[0].value_dtype
    tokens = buffers.empty(total, dtype)  # written whole by the copies below (packtools.core.buffers)
    zero = np.zeros_like(source)
    prompt_from = lp - kp  # the prompt keeps its end
    copy_segments(
        cols[0],
        np.concatenate([source, source]),
        np.concatenate([prompt_from, prompt_from]),
        np.concatenate([kp, kp]),
        np.concatenate([pair_start, pair_start + chosen_len]),
        tokens,
    )
    copy_segments(cols[1], source, zero, kc, pair_start + kp, tokens)
    copy_segments(cols[2], source, zero, kr, pair_start + chosen_len + kp, tokens)
    mask = ones_at(
        total, np.concatenate([pair_start + kp, pair_start + chosen_len + kp]), np.concatenate([kc, kr])
    )
    token_offsets = p.token_offsets
    seq = np.empty(2 * pair.shape[0], np.int32)
    seq[0::2], seq[1::2] = chosen_len, rejected_len
    arrays = [
        list_array(token_offsets, tokens, False, value_type),
        list_array(token_offsets, mask, False, pa.int8()),
        pa.ListArray.from_arrays(pa.array((2 * p.row_offsets).astype(np.int32)), pa.array(seq)),
    ]
    names = list(PAIR_ROW_COLUMNS)
    for name, values in per_unit_columns(extra, source, p):
        arrays.append(values)
        names.append(name)
    return pa.Table.from_arrays(arrays, names=names)


def _report(max_length: int, lp, lc, lr, fitted: FittedPairs, p: PackPlan) -> PairReport:
    keep = fitted.keep
    cut_p = keep & (fitted.prompt_keep < lp)
    cut_c = keep & (fitted.chosen_keep < lc)
    cut_r = keep & (fitted.rejected_keep < lr)
    return PairReport(
        max_length=max_length,
        pairs_in=int(lp.shape[0]),
        pairs_out=int(keep.sum()),
        pairs_truncated=int((cut_p | cut_c | cut_r).sum()),
        prompts_truncated=int(cut_p.sum()),
        chosen_truncated=int(cut_c.sum()),
        rejected_truncated=int(cut_r.sum()),
        pairs_dropped=int((~keep).sum()),
        tokens_in=int((2 * lp + lc + lr).sum()),
        tokens_kept=p.tokens_kept,
        rows=p.num_rows,
        lower_bound=p.lower_bound,
    )


def _pack_shared(
    cols: list[ListColumn],
    extra: list[tuple[str, pa.ChunkedArray]],
    max_length: int,
    options: UnitOptions,
    row_indices: np.ndarray | None,
) -> tuple[pa.Table, SharedReport]:
    """:func:`pack_pairs` with ``share_prompt=True``, its arguments checked and its columns read."""
    lp, lc, lr = (c.lengths() for c in cols)
    rows = np.arange(lp.shape[0]) if row_indices is None else row_indices
    lp, lc, lr = lp[rows], lc[rows], lr[rows]
    fitted = fit_pairs(lp, lc, lr, max_length, options.overlong, options.max_prompt_length, shared=True)
    keep, kp, kc, kr = fitted.keep, fitted.prompt_keep, fitted.chosen_keep, fitted.rejected_keep
    n = lp.shape[0]
    _check_nonempty(keep, np.stack([kc, kr], 1).reshape(-1), np.repeat(np.arange(n), 2), rows)
    kept = np.flatnonzero(keep)
    lengths = unit_lengths(kp[kept], kc[kept] + kr[kept], np.full(kept.shape[0], 2))
    p = plan_units(lengths, max_length, options)
    order = kept[p.seg_source]
    source = rows[order]
    two = np.full(order.shape[0], 2, np.int64)
    units = _Units(
        source=source,
        prompt_from=lp[order] - kp[order],
        prompt_keep=kp[order],
        group=two,
        column=np.tile(np.array([0, 1], np.int64), order.shape[0]),
        row=np.repeat(source, 2),
        keep=np.stack([kc[order], kr[order]], 1).reshape(-1),
    )
    arrays = _materialize_shared(cols[0], cols[1:], units, p, with_groups=False) + per_unit_columns(
        extra, source, p
    )
    cut_p, cut_c = keep & (kp < lp), keep & ((kc < lc) | (kr < lr))
    report = SharedReport(
        max_length=max_length,
        units_in=n,
        units_out=int(keep.sum()),
        units_truncated=int((cut_p | cut_c).sum()),
        prompts_truncated=int(cut_p.sum()),
        completions_truncated=int((keep & (kc < lc)).sum() + (keep & (kr < lr)).sum()),
        units_dropped=int((~keep).sum()),
        tokens_in=int((lp + lc + lr).sum()),
        tokens_kept=p.tokens_kept,
        tokens_unshared=int((2 * kp[kept] + kc[kept] + kr[kept]).sum()),
        rows=p.num_rows,
        lower_bound=p.lower_bound,
        repeated=int((kp[kept] > 0).sum()),
    )
    return pa.Table.from_arrays([a for _, a in arrays], names=[n_ for n_, _ in arrays]), report
