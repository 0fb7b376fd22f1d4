"""Prompt-shared packing: a preference pair or a group of completions with its prompt written once.

A *unit* is one prompt with ``G`` completions (a preference pair is a unit of two: chosen, then rejected).
In a row a unit of a kept prompt ``p`` (``P`` tokens) and completions ``c_1 .. c_G`` is laid out as::

    [p_0 .. p_{P-2}] [p_{P-1} c_1] [p_{P-1} c_2] ... [p_{P-1} c_G]
     shared prefix    branch 1      branch 2          branch G

The last prompt token heads each branch, so every position of a branch predicts the next token of the same
branch (the first completion token is predicted from the prompt's last token, once per completion); the unit
takes ``P + sum(C_g) + G - 1`` tokens instead of the ``G * P + sum(C_g)`` of ``[p c_1][p c_2]...``.
Position ids run ``0 .. P-2`` on the prefix and ``P-1, P, ...`` on every branch, so each completion continues
at ``P`` as it does after its own prompt.  A unit with an empty prompt has no prefix and no branch heads.

Rows carry ``input_ids``, ``completion_mask`` (1 on completion tokens), ``seq_lengths`` (one per completion:
the length ``P + C_g`` of the sequence ``prompt + completion`` the unit stands for, in unit order),
``prompt_lengths`` (one per unit: the kept ``P``) and, for groups, ``group_sizes`` (one per unit: ``G``).
:mod:`packtools.batches.tree` turns a row into the batch the tree attention needs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import pyarrow as pa

from ..constants import COMPLETION_MASK, SEQ_LENGTHS
from ..errors import PackingError
from . import buffers
from .arrow import ListColumn, copy_segments, list_array, ones_at
from .plan import PackPlan
from .ragged import offsets_of

PROMPT_LENGTHS = "prompt_lengths"
GROUP_SIZES = "group_sizes"


@dataclass(frozen=True)
class SharedReport:
    """What prompt-shared packing did: units (pairs or groups) kept whole, truncated, dropped; rows made.

    ``tokens_in`` counts the input (each prompt once), ``tokens_kept`` the packed layout, ``tokens_unshared``
    what the kept units would take with the prompt repeated per completion (``G * P + sum(C)``).
    """

    max_length: int
    units_in: int
    units_out: int
    units_truncated: int
    prompts_truncated: int
    completions_truncated: int
    units_dropped: int
    tokens_in: int
    tokens_kept: int
    tokens_unshared: int
    rows: int
    lower_bound: int
    repeated: int = 0  # branch heads beyond a unit's first: the prompt's last token, once more per completion

    @property
    def tokens_dropped(self) -> int:
        """Input tokens left out (the repeated branch heads are not input tokens)."""
        return self.tokens_in - self.tokens_kept + self.repeated

    @property
    def saved(self) -> float:
        """Share of the unshared layout's tokens that sharing the prompt saves."""
        return 1.0 - self.tokens_kept / self.tokens_unshared if self.tokens_unshared else 0.0

    @property
    def fill(self) -> float:
        return self.tokens_kept / (self.rows * self.max_length) if self.rows else 1.0

    def summary(self) -> dict[str, int | float]:
        return {**asdict(self), "tokens_dropped": self.tokens_dropped, "saved": self.saved, "fill": self.fill}


def unit_lengths(prompt: np.ndarray, completion_sums: np.ndarray, group_sizes: np.ndarray) -> np.ndarray:
    """Tokens a unit takes: ``P + sum(C) + G - 1`` (``sum(C)`` without a prompt).

    >>> unit_lengths(np.array([5, 0]), np.array([7, 3]), np.array([2, 2])).tolist()
    [13, 3]
    """
    p = np.asarray(prompt, np.int64)
    return np.where(p > 0, p + completion_sums + group_sizes - 1, completion_sums)


@dataclass(frozen=True)
class _Units:
    """The kept units in packed order, and each branch's completion source."""

    source: np.ndarray  # int64 [U]: input row of each unit
    prompt_from: np.ndarray  # int64 [U]: first kept prompt token
    prompt_keep: np.ndarray  # int64 [U]
    group: np.ndarray  # int64 [U]: completions per unit
    column: np.ndarray  # int64 [B]: which completion column a branch reads
    row: np.ndarray  # int64 [B]: the row of that column
    keep: np.ndarray  # int64 [B]: kept completion tokens


def _materialize(
    prompt: ListColumn,
    completion_cols: list[ListColumn],
    units: _Units,
    p: PackPlan,
    with_groups: bool,
) -> list[tuple[str, pa.Array]]:
    kp, g = units.prompt_keep, units.group
    head = (kp > 0).astype(np.int64)
    prefix = np.maximum(kp - 1, 0)
    unit_start = p.seg_dest
    branch_unit = np.repeat(np.arange(kp.shape[0]), g)
    branch_len = head[branch_unit] + units.keep
    first_branch = offsets_of(g)
    within = offsets_of(branch_len)
    branch_start = (
        unit_start[branch_unit] + prefix[branch_unit] + within[:-1] - within[first_branch[:-1]][branch_unit]
    )
    total = p.tokens_kept
    tokens = buffers.empty(total, prompt.value_dtype)  # written whole by the copies below
    # The prompt: the shared prefix once, then its last token at the head of every branch.
    last = units.prompt_from + kp - 1
    bsrc = units.source[branch_unit]
    copy_segments(
        prompt,
        np.concatenate([units.source, bsrc]),
        np.concatenate([units.prompt_from, last[branch_unit]]),
        np.concatenate([prefix, head[branch_unit]]),
        np.concatenate([unit_start, branch_start]),
        tokens,
    )
    comp_dest = branch_start + head[branch_unit]
    for c, col in enumerate(completion_cols):
        sel = units.column == c
        copy_segments(
            col, units.row[sel], np.zeros(int(sel.sum()), np.int64), units.keep[sel], comp_dest[sel], tokens
        )
    mask = ones_at(total, comp_dest, units.keep)
    branch_offsets = pa.array(first_branch[p.row_offsets].astype(np.int32))
    unit_offsets = pa.array(p.row_offsets.astype(np.int32))
    seq = (kp[branch_unit] + units.keep).astype(np.int32)
    out = [
        ("input_ids", list_array(p.token_offsets, tokens, False, prompt.type.value_type)),
        (COMPLETION_MASK, list_array(p.token_offsets, mask, False, pa.int8())),
        (SEQ_LENGTHS, pa.ListArray.from_arrays(branch_offsets, pa.array(seq))),
        (PROMPT_LENGTHS, pa.ListArray.from_arrays(unit_offsets, pa.array(kp.astype(np.int32)))),
    ]
    if with_groups:
        out.append((GROUP_SIZES, pa.ListArray.from_arrays(unit_offsets, pa.array(g.astype(np.int32)))))
    return out


def per_unit_columns(
    extra: list[tuple[str, pa.ChunkedArray]], source: np.ndarray, p: PackPlan
) -> list[tuple[str, pa.Array]]:
    """Each per-unit column of ``extra`` (one value per input row) as a list per packed row of ``p``: the values
    of the input rows ``source`` (one per unit, in packed order)."""
    unit_offsets = pa.array(p.row_offsets.astype(np.int32))
    return [
        (name, pa.ListArray.from_arrays(unit_offsets, column.take(pa.array(source)).combine_chunks()))
        for name, column in extra
    ]


def _check_nonempty(
    keep: np.ndarray, comp_keep: np.ndarray, branch_unit: np.ndarray, rows: np.ndarray
) -> None:
    empty = np.flatnonzero(keep[branch_unit] & (comp_keep == 0))
    if empty.size:
        row = int(rows[branch_unit[empty[0]]])
        raise PackingError(
            f"row {row}: a completion would be empty (kept 0 tokens); every completion needs a token to have a "
            f"log-probability (an empty one would enter the loss as log-probability 0, with nothing learned "
            f"from it). Filter pairs with an empty completion out, or use overlong='drop' when the prompt "
            f"leaves it no room.",
            param="dataset",
        )
