"""Planning on the driver, from the staged parts' row lengths alone (O(rows) memory, no token touched): the
``overlong`` policy, rows without a label token, one global plan (or one per part, ``plan="shards"``), the plan
cut into write jobs of at most ``shard_tokens`` tokens, and the statistics of the packed output.

>>> import numpy as np
>>> from packtools.pipeline.config import PipelineConfig
>>> rows = row_plan([(np.array([5, 2, 9]), np.zeros(3))], [], PipelineConfig(max_length=4, overlong="drop"))
>>> rows.eff.tolist(), rows.bounds
([0, 2, 0], [0, 3])
>>> p = plan_parts(rows.eff, rows.bounds, PipelineConfig(max_length=4, overlong="drop"))
>>> p.num_rows, rows.stats(p, 1, PipelineConfig(max_length=4, overlong="drop"))["tokens_dropped"]
(1, 14)
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from ..constants import IGNORE_INDEX
from ..core.arrow import numeric_array
from ..core.cp_budget import budgets, cp_padded_lengths, cp_stats, to_real_plan
from ..core.pack import pack_columns, read_columns
from ..core.plan import PackPlan
from ..core.plan import plan as make_plan
from ..errors import PackingError
from .gather import WriteJob, shard_name

if TYPE_CHECKING:
    from .config import PipelineConfig


def apply_overlong(lengths: np.ndarray, max_length: int, policy: str) -> tuple[np.ndarray, dict[str, int]]:
    """Lengths to plan with under ``policy``, and what it cut.

    >>> eff, counts = apply_overlong(np.array([5, 2, 9]), 4, "drop")
    >>> eff.tolist(), counts["rows_dropped_overlong"], counts["tokens_dropped_overlong"]
    ([0, 2, 0], 2, 14)
    """
    over = lengths > max_length
    excess = np.maximum(lengths - max_length, 0)
    counts = {
        "rows_truncated": 0,
        "tokens_truncated": 0,
        "rows_dropped_overlong": 0,
        "tokens_dropped_overlong": 0,
        "rows_split": 0,
    }
    if policy == "truncate":
        counts["rows_truncated"] = int(over.sum())
        counts["tokens_truncated"] = int(excess.sum())
        return np.minimum(lengths, max_length), counts
    if policy == "drop":
        counts["rows_dropped_overlong"] = int(over.sum())
        counts["tokens_dropped_overlong"] = int(lengths[over].sum())
        return np.where(over, 0, lengths), counts
    counts["rows_split"] = int(over.sum())
    return lengths, counts


def plan_parts(eff: np.ndarray, bounds: Sequence[int], config: PipelineConfig) -> PackPlan:
    """One global plan of ``eff`` or, with ``config.plan == "shards"``, one plan per part
    (rows ``bounds[i]:bounds[i + 1]``) put one after the other.  With ``config.context_parallel > 1`` the rows
    are planned at their CP-padded lengths and the plan then holds their real tokens
    (:mod:`packtools.core.cp_budget`)."""
    real = eff
    budgeted = budgets(config.strategy, config.context_parallel)
    if budgeted:  # every row planned at its CP-padded length, cut back below
        eff = cp_padded_lengths(real, config.context_parallel)
    if config.plan == "global" or len(bounds) <= 2:
        p = make_plan(eff, config.max_length, config.strategy)
    else:
        plans = [
            make_plan(eff[a:b], config.max_length, config.strategy) for a, b in zip(bounds[:-1], bounds[1:])
        ]
        seg_offsets = np.cumsum([0] + [q.num_segments for q in plans])
        p = PackPlan(
            config.max_length,
            config.strategy,
            np.concatenate([q.seg_source + a for q, a in zip(plans, bounds[:-1])]),
            np.concatenate([q.seg_start for q in plans]),
            np.concatenate([q.seg_length for q in plans]),
            np.concatenate([[0]] + [q.row_offsets[1:] + s for q, s in zip(plans, seg_offsets[:-1])]).astype(
                np.int64
            ),
            eff,
        )
    if budgeted:
        p = to_real_plan(p, real)
    return p.shuffled(config.seed) if config.shuffle else p


def load_kernels_ahead(strategy: str, value_types: Sequence[str]) -> KernelLoad:
    """Start loading Numba and the kernels that planning and writing columns of ``value_types`` call
    (:func:`warmup_packing`) in a daemon thread, so that the run stages meanwhile
    instead of paying it before its plan.  Join the thread before planning (:func:`join_kernels`): the plan calls
    the kernels it loads.  A failure is ignored: the plan then loads or compiles the kernels itself, as without
    it."""
    thread = KernelLoad(strategy, tuple(value_types))
    thread.start()
    return thread


class KernelLoad(threading.Thread):
    """The daemon thread of :func:`load_kernels_ahead`.  :attr:`unwanted` set (a failed or interrupted run), it
    ends after the step it is in (Numba's import, the kernels module's, the plan's kernels, the writer's)
    instead of loading the rest: a compile cannot be cut short, and a process that exits while this thread
    compiles can abort in its exit (status -6) instead of exiting with its own status."""

    def __init__(self, strategy: str, value_types: tuple[str, ...]) -> None:
        super().__init__(name="packtools-kernels", daemon=True)
        self.strategy, self.value_types = strategy, value_types
        self.unwanted = threading.Event()

    def run(self) -> None:
        try:
            import numba  # noqa: F401 - first, so that a missing Numba leaves the lazy kernels module untouched

            from .._lazy import load_now

            if not self.unwanted.is_set():
                load_now("packtools.core.kernels")  # beside a thread reading tokenized JSON (io.json_ints)
                warmup_packing(self.strategy, self.value_types, self.unwanted)
        except Exception:  # noqa: BLE001, S110 - the plan loads the kernels itself
            pass


def join_kernels(thread: KernelLoad | None, unwanted: bool = False) -> None:
    """Wait for the thread of :func:`load_kernels_ahead` (None: none was started); ``unwanted``: the run will
    not plan (it failed or was interrupted), so the thread stops after its current step.  Waits in short
    turns: a signal that another thread of the process received reaches the main thread's handler only when
    that thread runs Python, which an untimed wait never does, so a second Ctrl-C or a SIGTERM still ends the
    wait at once."""
    if thread is None:
        return
    if unwanted:
        thread.unwanted.set()
    while thread.is_alive():
        thread.join(0.1)


def warmup_packing(
    strategy: str, value_types: Sequence[str], unwanted: threading.Event | None = None
) -> None:
    """Load (or compile) the kernels that planning with ``strategy`` and gathering list columns of
    ``value_types`` (``"int32"``, ...) from staged Arrow files call, with their argument types, on a tiny
    input; :func:`packtools.core.warmup` loads every kernel.  Stops between steps once ``unwanted`` is set."""
    p = make_plan(np.array([3, 0, 1], np.int64), 2, strategy)
    if unwanted is not None and unwanted.is_set():
        return
    PackPlan(p.max_length, strategy, p.seg_source, p.seg_start, p.seg_length, p.row_offsets, p.source_lengths)
    if not value_types or (unwanted is not None and unwanted.is_set()):
        return
    # not pa.array: it imports pandas (~0.25 CPU seconds, beside the stage) to look at what it is given
    offsets = numeric_array(np.array([0, 3, 3, 4], np.int32), pa.int32())
    one = numeric_array(np.array([1, 2, 3, 4], np.int64), pa.int64())
    lists = [pa.ListArray.from_arrays(offsets, one.cast(pa.type_for_alias(t))) for t in value_types]
    table = pa.table({f"c{i}": a for i, a in enumerate(lists)})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    from ..io.files import IpcReader

    stored_bytes = pa.BufferReader(pa.py_buffer(sink.getvalue().to_pybytes()))
    stored = IpcReader(stored_bytes).read_all()  # read-only, as mapped
    pack_columns(read_columns(stored)[0], p)


def write_jobs(
    p: PackPlan,
    data: Sequence[str],
    bounds: Sequence[int],
    config: PipelineConfig,
    columns: Sequence[str],
    folder: str,
    *,
    run: str = "",
) -> list[WriteJob]:
    """The plan cut into blocks of at most ``shard_tokens`` tokens, one :class:`WriteJob` each, its shard in
    ``folder`` (named with ``run``, :func:`packtools.pipeline.gather.run_token`)."""
    blocks = p.row_blocks(config.shard_tokens) or [(0, 0)]
    starts = np.asarray(bounds[:-1], np.int64)
    jobs = []
    for i, (r0, r1) in enumerate(blocks):
        s0, s1 = int(p.row_offsets[r0]), int(p.row_offsets[r1])
        src = p.seg_source[s0:s1]
        parts = np.unique(np.searchsorted(starts, src, side="right") - 1) if s1 > s0 else np.array([0])
        jobs.append(
            WriteJob(
                os.path.join(folder, shard_name(i, len(blocks), run)),
                config.max_length,
                config.strategy,
                tuple(columns),
                tuple((data[k], int(bounds[k]), int(bounds[k + 1] - bounds[k])) for k in parts),
                src,
                p.seg_start[s0:s1],
                p.seg_length[s0:s1],
                p.row_offsets[r0 : r1 + 1] - s0,
            )
        )
    return jobs


@dataclass
class RowPlan:
    """The row lengths of every staged part, in input order, and what the driver plans with.  After
    :meth:`split_labelled`, the pieces of the split rows follow as one more part (their own rows)."""

    lengths: np.ndarray  # tokens per input row
    bounds: list[int]  # first row of each part, then the row count (the pieces' part last, once split)
    eff: np.ndarray  # lengths to plan with: after the overlong policy and drop_unlabeled (0: not packed)
    counts: dict[str, int]  # what the overlong policy cut (apply_overlong), then what the split made
    rows_unlabeled: int  # rows kept whose labels are all -100
    trained: np.ndarray | None = None  # per input row, its tokens that train (None: the rows have no labels)
    trained_eff: np.ndarray | None = None  # per planned row, its trained tokens in what is packed (eff)
    whole_split: np.ndarray | None = None  # rows the plan itself splits (split_at="tokens", every piece kept)
    idle_pieces: tuple[int, int] = (0, 0)  # their pieces without a trained token, and the tokens in those
    first: np.ndarray | None = None  # per input row, its first trained position (labels; load_sidecar)
    by_packed_row: tuple[int, int, int] | None = None  # wrapped: trained, untrained rows and their tokens

    def split_labelled(  # noqa: PLR0913
        self,
        data: Sequence[str],
        columns: Sequence[str],
        config: PipelineConfig,
        heads: np.ndarray,
        folder: str,
        key: str,
        *,
        closing: np.ndarray | None = None,
        tool_opener: np.ndarray | None = None,
    ) -> list[str]:
        """Under ``overlong="split"``, cut the over-long rows with labels into pieces
        (:func:`packtools.pipeline.turn_split.split_rows`, at turns or every ``max_length`` tokens;
        ``closing`` and ``tool_opener`` as for :func:`~packtools.pipeline.turn_split.plan_pieces`), write them
        to a file in ``folder`` and plan the pieces instead of the rows (pieces without a trained token dropped
        unless ``drop_unlabeled=False``); under ``truncate``, count the trained tokens the cut keeps.  Returns
        the data files to gather from (``data``, then the pieces' file when there is one)."""
        from .turn_split import split_rows, trained_prefix

        if self.trained is None:
            return list(data)
        # over-long rows still planned; a row without any trained token is a row of the input (kept or dropped
        # whole by drop_unlabeled, split by the plan like text), not a source of pieces
        over = np.flatnonzero((self.lengths > config.max_length) & (self.eff > 0))
        self.trained_eff = np.where(self.eff > 0, self.trained, 0)
        if config.overlong_policy == "truncate" and over.size:
            self.trained_eff[over] = trained_prefix(data, self.bounds, over, config.max_length)
        over = over[self.trained[over] > 0]
        if config.overlong_policy != "split" or config.strategy != "bfd_split" or over.size == 0:
            return list(data)  # wrapped cuts one stream: it keeps every token, and no piece is a sequence
        path = os.path.join(folder, f"pieces-{key}.arrow")
        drop = config.drop_unlabeled is not False  # None (the default) drops pieces without a trained token
        got = split_rows(
            data, self.bounds, over, heads, columns, config.max_length,
            split_at=config.split_at, drop_unlabeled=drop, path=path, closing=closing, tool_opener=tool_opener,
        )  # fmt: skip
        self.counts.update(got.counts)
        self.counts["split_at"] = config.split_at  # type: ignore[assignment]
        if got.path is None:  # the fixed cut, every piece kept: the plan splits the rows itself
            per_row = -(-self.lengths[over] // config.max_length)  # pieces of each row, in order
            first = np.concatenate([[0], np.cumsum(per_row)[:-1]])
            self.trained_eff[over] = np.add.reduceat(got.trained, first)
            self.whole_split = over  # planned whole (the plan cuts them): their pieces counted here
            idle = got.trained == 0
            self.idle_pieces = (int(idle.sum()), int(got.lengths[idle].sum()))
            return list(data)
        self.eff = self.eff.copy()
        self.eff[over] = 0  # planned as their pieces
        self.trained_eff[over] = 0
        self.eff = np.concatenate([self.eff, np.where(got.kept, got.lengths, 0)])
        self.trained_eff = np.concatenate([self.trained_eff, np.where(got.kept, got.trained, 0)])
        self.bounds = [*self.bounds, self.bounds[-1] + int(got.lengths.shape[0])]
        return [*data, path]

    def count_wrapped(self, p: PackPlan, data: Sequence[str]) -> None:
        """Under ``wrapped``, count what trains by the packed rows: each row is one sequence as the model sees it
        (no ``seq_lengths``; the collator masks its first label), so a document's first token trains where it
        falls inside a row and a row's first token does not, and a row cut from a long prompt trains nothing.
        Documents the plan keeps whole are counted from their sidecars; those it cuts are read (their labels
        only, one staged part at a time)."""
        from .turn_split import staged_parts

        if self.trained is None or self.first is None or p.num_rows == 0:
            return
        src = np.asarray(p.seg_source, np.int64)
        start = np.asarray(p.seg_start, np.int64)
        length = np.asarray(p.seg_length, np.int64)
        whole = (start == 0) & (length == self.lengths[src])
        head_trained = (self.first == 0) & (self.lengths > 0)  # a document's first token trains
        seg = np.where(whole, self.trained[src] + head_trained[src], 0)
        row_first = np.asarray(p.row_offsets[:-1], np.int64)
        lead = np.where(start[row_first] == 0, head_trained[src[row_first]], False).astype(np.int64)
        row_of = np.full(src.shape[0], -1, np.int64)  # segment -> the packed row it starts (-1: none)
        row_of[row_first] = np.arange(row_first.shape[0])
        cut = np.flatnonzero(~whole)
        cut = cut[np.argsort(src[cut], kind="stable")]
        for mine, flat in staged_parts(data, self.bounds, np.unique(src[cut]), ["labels"]):
            labels, offsets = flat["labels"]
            trains = labels != IGNORE_INDEX
            csum = np.concatenate([[0], np.cumsum(trains, dtype=np.int64)])
            segs = cut[np.isin(src[cut], mine)]
            at = (
                offsets[np.searchsorted(mine, src[segs])] + start[segs]
            )  # where each segment starts in labels
            seg[segs] = csum[at + length[segs]] - csum[at]
            leads = (row_of[segs] >= 0) & (length[segs] > 0)
            lead[row_of[segs[leads]]] = trains[at[leads]]
        per_row = np.add.reduceat(seg, row_first) - lead if seg.size else np.zeros(0, np.int64)
        empty = np.diff(np.asarray(p.row_offsets, np.int64)) == 0
        per_row[empty] = 0
        idle = per_row == 0
        row_tokens = np.add.reduceat(length, row_first) if length.size else np.zeros(0, np.int64)
        self.by_packed_row = (int(per_row.sum()), int(idle.sum()), int(row_tokens[idle].sum()))

    def stats(self, p: PackPlan, shards: int, config: PipelineConfig) -> dict[str, Any]:
        """The statistics of the output packed by ``p`` in ``shards`` shards (the manifest's ``stats``)."""
        lengths, tokens_in = self.lengths, int(self.lengths.sum())
        carried = int(self.counts.get("tokens_carried", 0))
        out = {
            "rows_in": int(lengths.shape[0]),
            "rows_empty": int(np.count_nonzero(lengths == 0)),
            "rows_unlabeled": self.rows_unlabeled,
            "rows_dropped_unlabeled": self.rows_unlabeled if config.drop_unlabeled else 0,
            **self.counts,
            "rows_out": p.num_rows,
            # what the model sees as sequences: the segments of seq_lengths (a bfd_split piece is one), or under
            # wrapped (no seq_lengths: the stream is cut, documents run together) the packed rows themselves
            "sequences_packed": int(
                np.count_nonzero(p.row_lengths)
                if config.strategy == "wrapped"
                else np.count_nonzero(p.seg_length)
            ),
            # the input rows (or, cut at turns, their pieces) that put tokens in the output, whole or in part
            "documents_packed": int(np.count_nonzero(self.eff)),
            "lower_bound": p.lower_bound,
            "tokens_in": tokens_in,
            "tokens_kept": p.tokens_kept,
            "tokens_dropped": tokens_in - (p.tokens_kept - carried),
            "fill": p.fill,
            "shards": shards,
            "packed": True,
            "strategy": config.strategy,
            "overlong": config.overlong_policy,
            "plan": config.plan,
        }
        if config.context_parallel > 1:  # the padding the CP collator adds to these rows: fill lost
            from ..profiling.cp_audit import work_stats

            out.update(cp_stats(p, config.context_parallel))
            out.update(work_stats(p, config.context_parallel))  # the ranks' attention work, row by row
        if self.trained is not None and self.trained_eff is not None:
            idle = (self.eff > 0) & (self.trained_eff == 0)
            segments = np.bincount(np.asarray(p.seg_source, np.int64), minlength=idle.shape[0])[
                : idle.shape[0]
            ]
            if self.whole_split is not None:
                idle[self.whole_split] = False  # counted by piece
            out.update(
                {
                    "tokens_trained_in": int(self.trained.sum()),
                    "tokens_trained_kept": int(self.trained_eff.sum()),
                    # each sequence of the plan: a row without a trained token that bfd_split cuts (it is not
                    # a source of pieces) is as many sequences as the plan cuts it into
                    "sequences_untrained": int(segments[idle].sum()) + self.idle_pieces[0],
                    "tokens_untrained": int(self.eff[idle].sum()) + self.idle_pieces[1],
                }
            )
            if self.by_packed_row is not None:  # wrapped: its packed rows are the sequences
                kept, rows, tokens = self.by_packed_row
                out.update(tokens_trained_kept=kept, sequences_untrained=rows, tokens_untrained=tokens)
        return out


def check_something_trains(rows: RowPlan, fmt: str) -> None:
    """Refuse input with labels in which no row has a trained token: the output would train nothing, and a run
    that ends with status 0 says so only in a summary line.  Rows without one are kept and counted when others
    train (a conversation without an assistant turn); all of them is a mistake upstream, named with its usual
    cause."""
    if rows.first is None:
        return
    has_tokens = rows.lengths > 0
    if not has_tokens.any() or (rows.first[has_tokens] < rows.lengths[has_tokens]).any():
        return
    why = {
        "messages": "the loss is on the assistant messages (role 'assistant'), and no row has one: check the "
        "roles (ShareGPT's 'human' / 'gpt' are 'user' / 'assistant' to a chat template)",
        "prompt_completion": "the loss is on the completions, and every one is empty",
    }.get(fmt, "every label is -100")
    raise PackingError(
        f"no row of the input ({int(has_tokens.sum()):,} rows with tokens) has a trained token (a label other "
        f"than -100), so the packed output would train nothing: {why}. Fix the data; rows without one are "
        f"kept and counted when others train."
    )


def row_plan(
    sidecars: Sequence[tuple[np.ndarray, np.ndarray]],
    columns: Sequence[str],
    config: PipelineConfig,
    trained: Sequence[np.ndarray] | None = None,
) -> RowPlan:
    """The :class:`RowPlan` of the parts whose sidecars (row lengths, first label position;
    :func:`packtools.pipeline.staged.load_sidecar`) are ``sidecars``; ``trained``: each part's trained tokens per
    row (:func:`packtools.pipeline.staged.sidecar_turns`).

    Rows without a trained token are dropped with ``drop_unlabeled=True`` and kept otherwise (``None``, the
    default, and ``False``): they are the input's own rows, counted (``rows_unlabeled``).  Pieces of a split
    row without one are another matter (:meth:`RowPlan.split_labelled`)."""
    bounds = np.cumsum([0] + [s[0].shape[0] for s in sidecars]).tolist()
    lengths = np.concatenate([s[0] for s in sidecars]).astype(np.int64)
    eff, counts = apply_overlong(lengths, config.max_length, config.overlong_policy)
    rows_unlabeled = 0
    per_row = first = None
    if "labels" in columns:
        first = np.concatenate([s[1] for s in sidecars])
        kept_len = lengths if config.overlong_policy == "split" else eff
        unlabeled = (eff > 0) & (first >= kept_len)
        rows_unlabeled = int(unlabeled.sum())
        if config.drop_unlabeled:
            eff = np.where(unlabeled, 0, eff)
        if trained is not None and all(t.shape[0] == s[0].shape[0] for t, s in zip(trained, sidecars)):
            per_row = (
                np.concatenate(list(trained)).astype(np.int64) if len(trained) else np.zeros(0, np.int64)
            )
    return RowPlan(lengths, bounds, eff, counts, rows_unlabeled, per_row, first=first)
