"""Splitting rows with labels (chat, prompt/completion, tokenized rows with ``labels``) longer than
``max_length`` under ``bfd_split``, at turn boundaries (``split_at="turns"``, the default) or every
``max_length`` tokens (``split_at="tokens"``).

**Turn boundaries.**  A row is cut only where a trained span ends (a label that is not -100 followed by one that
is): the end of an assistant reply, where the chat template starts the next message (the incremental rule of
:mod:`packtools.pipeline.formats` makes an assistant span end exactly at the next message's first token; a
prompt/completion row has one such point, its end).  The row is thereby made of *exchanges* (the question and
everything before the reply, then the reply), and a piece is one or more whole exchanges, greedily, in order.

**Tool calls stay with their question.**  An exchange that starts with a tool message (the template's tool
opener, :func:`packtools.pipeline.tokenizer.chat.head.tool_opener_ids`: ``<|im_start|>tool`` in ChatML) is glued to the
exchange before it, so the user's question, the assistant's call, the tool result and the answer go into one
piece whenever they fit one; only a chain longer than a piece is cut at a tool result, and each such piece,
whose answer trains without the question, is counted (``questions_dropped``).  A template that renders a
tool message as it renders a user message gives no opener: its tool exchanges are cut as any other.

**What a piece carries before its first turn.**  The row's *head* (for ``messages`` rows: the leading system
message(s) as the template renders them, BOS included; 0 for other formats) is copied, unlabeled (-100), before
every piece that starts at an exchange but the first (which starts with it), so that a piece reads as a
conversation with its system prompt.  A head longer than half of ``max_length`` is not carried (it would crowd
out the turns).  Carried tokens are counted (``tokens_carried``): they are copies, not input tokens.

**An exchange longer than a piece** (it does not fit ``max_length`` minus the head) is counted (``turns_cut``)
and cut so that the reply keeps its question:

* a reply that fits a piece is cut from its end: the last piece holds the reply and as much of the question
  before it as fits (the question's start, in the pieces before, trains nothing);
* a longer reply: its first piece holds the head (where carried), the question (its end when longer than
  three quarters of what the piece holds besides the head: a quarter is left to the reply) and the reply's
  start; the later pieces continue the reply *without the head*: each is a plain window of the conversation,
  and its first token is not trained (the first token of every sequence is masked in a padding-free batch,
  contract 3), so no trained token follows a head or a context it was not answering.

**Pieces without a trained token** (a label other than -100 after the piece's first token: the first token's
label is masked in every padding-free batch, contract 3) train nothing; they are dropped unless
``drop_unlabeled=False`` and counted (``pieces_dropped_unlabeled``, ``tokens_dropped_unlabeled``).

>>> import numpy as np
>>> lab = np.array([-100, -100, -100, 7, 7, -100, -100, -100, 8, 8, -100, -100, 9], np.int64)
>>> plan_pieces(lab, head=2, max_length=7).pieces  # (carried head, start, end)
[(0, 0, 5), (2, 5, 10), (2, 10, 13)]
>>> plan_pieces(lab, head=0, max_length=4, split_at="tokens").pieces
[(0, 0, 4), (0, 4, 8), (0, 8, 12), (0, 12, 13)]
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import pyarrow as pa

from .._atomic import removed_on_error
from ..constants import IGNORE_INDEX, MASK_COLUMNS
from ..core.arrow import read_list_column

#: ``turns``: cut at the ends of trained spans, carrying the head; ``tokens``: every ``max_length`` tokens.
SPLIT_AT = ("turns", "tokens")

Piece = tuple[int, int, int]  # (tokens of the head carried before it, start, end) in the row


def carried_head(head: int, max_length: int) -> int:
    """The head tokens each later piece carries: the head, or 0 when it is longer than half of ``max_length``."""
    return head if 0 < head and 2 * head <= max_length else 0


def turn_ends(labels: np.ndarray) -> np.ndarray:
    """Positions (0 < p < len) where a trained span ends: ``labels[p - 1]`` trained, ``labels[p]`` not."""
    trained = labels != IGNORE_INDEX
    return np.flatnonzero(trained[:-1] & ~trained[1:]) + 1


class TurnCut(NamedTuple):
    """The pieces of one row, the exchanges cut inside a turn, and the pieces whose first reply trains without
    the question it answers (a piece that starts at a tool result: the exchange did not fit one piece)."""

    pieces: list[Piece]
    turns_cut: int
    questions_dropped: int


def _matches(ids: np.ndarray | None, at: int, marker: np.ndarray | None) -> bool:
    if ids is None or marker is None or not marker.size:
        return False
    return at + marker.size <= ids.shape[0] and np.array_equal(ids[at : at + marker.size], marker)


def _from_end(a: int, b: int, carry: int, max_length: int) -> list[Piece]:
    """``row[a:b]`` as pieces cut from its end (each later piece carries the head; the row's start its own)."""
    room, chunks, hi = max_length - carry, [], b
    while hi > a:
        lo = 0 if a == 0 and hi <= max_length else max(a, hi - room)
        chunks.append((carry if lo else 0, lo, hi))
        hi = lo
    return chunks[::-1]


def _reply_start(labels: np.ndarray, a: int, b: int, head: int) -> int:
    """The first trained token of ``row[a:b]`` (a span inside the head, where no boundary is, left out), or
    ``b``."""
    lo = max(a, head)
    trained = np.flatnonzero(labels[lo:b] != IGNORE_INDEX)
    return lo + int(trained[0]) if trained.size else b


def _tail_fits(labels: np.ndarray, a: int, b: int, head: int, max_length: int) -> bool:
    """Whether ``row[a:b]`` from its first reply on fits one piece after at least one token of its question."""
    r = _reply_start(labels, a, b, head)
    return r >= b or b - r <= max_length - carried_head(head, max_length) - 1 or (a == 0 and b <= max_length)


def long_exchange(labels: np.ndarray, a: int, b: int, head: int, max_length: int) -> list[Piece]:
    """The pieces of one exchange ``row[a:b]`` longer than a piece (the question, then the reply from its first
    trained token ``r``), cut as the module docstring's "An exchange longer than a piece" says."""
    carry = carried_head(head, max_length)
    r = _reply_start(labels, a, b, head)
    if _tail_fits(labels, a, b, head, max_length):
        return _from_end(a, b, carry, max_length)  # the last piece: the whole reply after some question
    c = carry if (max_length - carry) // 4 else 0  # the head where it fits beside question and reply
    room = max_length - c
    q0 = max(a, head)  # where the question starts (after the row's own head)
    s = r - min(r - q0, room - max(1, room // 4))  # the question, up to three quarters of the piece
    if a == 0 and s == q0 and r < max_length:
        s, c = 0, 0  # the whole question fits: the row's start, with its own head
    pieces = _from_end(a, s, carry, max_length) if s > a else []
    e = min(s + max_length - c, b)
    pieces.append((c, s, e))
    while e < b:
        pieces.append((0, e, min(e + max_length, b)))
        e += max_length
    return pieces


def plan_pieces(  # noqa: PLR0913 - the row and the markers of its turns
    labels: np.ndarray,
    head: int,
    max_length: int,
    split_at: str = "turns",
    *,
    ids: np.ndarray | None = None,
    closing: np.ndarray | None = None,
    tool_opener: np.ndarray | None = None,
) -> TurnCut:
    """The pieces of one row (see the module docstring).  ``closing`` (with the row's ``ids``): the tokens a
    template writes after an assistant's labelled span and before the next message; a turn end followed by
    them moves past them, so the next piece starts at the next message.  ``tool_opener``: the tokens that
    start a tool message, which glue an exchange to the one before it (the module docstring's "Tool calls").

    >>> labels = np.array([-100, -100, -100] + list(range(103, 115)))
    >>> plan_pieces(labels, head=2, max_length=8)  # head 2, a question of 1, a reply of 12
    TurnCut(pieces=[(0, 0, 8), (0, 8, 15)], turns_cut=1, questions_dropped=0)
    """
    n = int(labels.shape[0])
    if split_at == "tokens":
        return TurnCut([(0, s, min(s + max_length, n)) for s in range(0, n, max_length)], 0, 0)
    carry = carried_head(head, max_length)
    room = max_length - carry  # what a later piece holds besides the head
    ends = [int(e) for e in turn_ends(labels)]
    if closing is not None and closing.size and ids is not None:
        ends = [e + int(closing.size) if _matches(ids, e, closing) else e for e in ends]
    bounds = [0, *sorted({e for e in ends if head < e < n}), n]
    units: list[list[tuple[int, int]]] = []  # exchanges glued by tool results
    for a, b in zip(bounds[:-1], bounds[1:]):
        if units and _matches(ids, a, tool_opener):
            units[-1].append((a, b))
        else:
            units.append([(a, b)])

    def cap(at: int) -> int:
        return max_length if at == 0 else room

    pieces: list[Piece] = []
    cut = 0
    start = end = 0  # the piece being filled: row[start:end], carrying the head unless start == 0

    def fill(a: int, b: int) -> bool:
        """Put ``row[a:b]`` in the open piece, else close it and open one at ``a``; whether it fitted."""
        nonlocal start, end
        if b - start <= cap(start):
            end = b
            return True
        if end > start:
            pieces.append((carry if start else 0, start, end))
        start = end = a
        if b - a <= cap(a):
            end = b
            return True
        return False

    for unit in units:
        ua, ub = unit[0][0], unit[-1][1]
        if fill(ua, ub):  # the whole unit
            continue
        if len(unit) > 1 and _tail_fits(labels, ua, ub, head, max_length):
            # a long question before a tool chain that fits a piece: the chain with the question's end
            cut += 1
            pieces.extend(_from_end(ua, ub, carry, max_length))
            start = end = ub
            continue
        for a, b in unit:  # longer than a piece: exchange by exchange
            if not fill(a, b):
                cut += 1
                pieces.extend(long_exchange(labels, a, b, head, max_length))
                start = end = b
    if end > start:
        pieces.append((carry if start else 0, start, end))
    glued = {a for unit in units for a, _ in unit[1:]}
    # a piece that starts at a tool result and trains (after its first token): an answer without its question
    dropped = sum(1 for c, a, b in pieces if a in glued and (labels[a + (not c) : b] != IGNORE_INDEX).any())
    return TurnCut(pieces, cut, dropped)


def trained_tokens(labels: np.ndarray) -> int:
    """Tokens of a sequence that train: labels other than -100 after its first token (the first is masked in
    every padding-free batch)."""
    return int(np.count_nonzero(labels[1:] != IGNORE_INDEX))


@dataclass
class SplitResult:
    """What splitting the over-long rows made: the pieces file (rows in order), each piece's length and trained
    tokens, whether it is kept, and the counts for the manifest."""

    path: str | None
    lengths: np.ndarray
    trained: np.ndarray
    kept: np.ndarray
    counts: dict[str, int] = field(default_factory=dict)


def piece_columns(
    cols: dict[str, np.ndarray], pieces: Sequence[Piece], lengths: list[int]
) -> dict[str, list[np.ndarray]]:
    """Per column, the values of each piece of a row whose columns are ``cols`` (the carried head: -100 in
    ``labels``, 0 in a mask column, the row's own values elsewhere)."""
    out: dict[str, list[np.ndarray]] = {name: [] for name in cols}
    for carry, a, b in pieces:
        for name, values in cols.items():
            if carry:
                if name == "labels":
                    pre = np.full(carry, IGNORE_INDEX, values.dtype)
                elif name in MASK_COLUMNS:
                    pre = np.zeros(carry, values.dtype)
                else:
                    pre = values[:carry]
                out[name].append(np.concatenate([pre, values[a:b]]))
            else:
                out[name].append(values[a:b])
        lengths.append(carry + b - a)
    return out


def staged_parts(data: Sequence[str], bounds: Sequence[int], rows: np.ndarray, columns: Sequence[str]):
    """``(rows_of_part, {column: (flat values, offsets)})`` of the rows ``rows`` (global row numbers, sorted) of
    the staged files ``data`` (part ``k`` holds rows ``bounds[k]:bounds[k + 1]``), one part mapped at a time:
    row ``i`` of the part's ``rows_of_part`` is ``values[offsets[i]:offsets[i + 1]]``."""
    from .gather import MappedArrow

    part_of = np.searchsorted(np.asarray(bounds[1:], np.int64), rows, side="right")
    for k in np.unique(part_of):
        mine = rows[part_of == k]
        mapped = MappedArrow([data[k]], list(columns))
        try:
            table = mapped.table.take(pa.array(mine - int(bounds[k])))
        finally:
            mapped.close()
        flat = {}
        for c in columns:
            col = read_list_column(table.column(c), c)
            flat[c] = (col.flat_values(), np.concatenate([[0], np.cumsum(col.lengths())]))
        yield mine, flat


def staged_rows(data: Sequence[str], bounds: Sequence[int], rows: np.ndarray, columns: Sequence[str]):
    """``(row, {column: values})`` of the rows ``rows`` (global row numbers, sorted) of the staged files ``data``,
    one row at a time (:func:`staged_parts`)."""
    for mine, flat in staged_parts(data, bounds, rows, columns):
        for i, row in enumerate(mine):
            yield int(row), {c: v[o[i] : o[i + 1]] for c, (v, o) in flat.items()}


def trained_prefix(
    data: Sequence[str], bounds: Sequence[int], rows: np.ndarray, max_length: int
) -> np.ndarray:
    """The trained tokens of the first ``max_length`` tokens of each row of ``rows`` (what truncation keeps)."""
    return np.array(
        [trained_tokens(c["labels"][:max_length]) for _, c in staged_rows(data, bounds, rows, ["labels"])],
        np.int64,
    )


#: pieces' tokens held before they are written as one record batch
WRITE_TOKENS = 1 << 22


def _write(sink: pa.OSFile, writer: pa.ipc.RecordBatchFileWriter | None, out: dict, columns, types):
    """Write the pieces held in ``out`` as one record batch (opening the file's writer on the first)."""
    batch = pa.table(
        {
            c: pa.ListArray.from_arrays(
                pa.array(np.concatenate([[0], np.cumsum([len(v) for v in out[c]])]).astype(np.int32)),
                pa.array(np.concatenate(out[c]) if out[c] else np.zeros(0, types[c])),
            )
            for c in columns
        }
    )
    if writer is None:
        writer = pa.ipc.new_file(sink, batch.schema)
    writer.write_table(batch)
    return writer


def split_rows(  # noqa: PLR0913 - the staged parts and the options that decide the cut
    data: Sequence[str],
    bounds: Sequence[int],
    rows: np.ndarray,
    heads: np.ndarray,
    columns: Sequence[str],
    max_length: int,
    *,
    split_at: str,
    drop_unlabeled: bool,
    path: str,
    closing: np.ndarray | None = None,
    tool_opener: np.ndarray | None = None,
) -> SplitResult:
    """Cut the rows ``rows`` (global row numbers, sorted) of the staged files ``data`` (part ``k`` holds rows
    ``bounds[k]:bounds[k + 1]``) into pieces (:func:`plan_pieces`) and write them, in order, to the Arrow file
    ``path`` (written aside and renamed).  ``heads``: every row's head length.  Under ``split_at="tokens"``
    with no piece dropped the file is removed (``path`` None): the plan's own split of the rows is the same
    cut, and the rows are planned as they are."""
    counts = {
        "pieces": 0,
        "turns_cut": 0,
        "questions_dropped": 0,
        "tokens_carried": 0,
        "pieces_dropped_unlabeled": 0,
        "tokens_dropped_unlabeled": 0,
    }
    lengths: list[int] = []
    trained: list[int] = []
    carries: list[int] = []
    if rows.size == 0:
        return SplitResult(None, np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, bool), counts)
    tmp = f"{path}.tmp-{os.getpid()}"
    types = None
    out: dict[str, list[np.ndarray]] = {c: [] for c in columns}
    held = 0
    with removed_on_error(tmp):
        with pa.OSFile(tmp, "wb") as sink:
            writer = None
            for row, cols in staged_rows(data, bounds, rows, columns):
                if types is None:
                    types = {c: v.dtype for c, v in cols.items()}
                pieces, cut, dropped = plan_pieces(
                    cols["labels"],
                    int(heads[row]),
                    max_length,
                    split_at,
                    ids=cols["input_ids"],
                    closing=closing,
                    tool_opener=tool_opener,
                )
                counts["turns_cut"] += cut
                counts["questions_dropped"] += dropped
                counts["pieces"] += len(pieces)
                carries.extend(p[0] for p in pieces)
                for name, values in piece_columns(cols, pieces, lengths).items():
                    out[name].extend(values)
                trained.extend(trained_tokens(v) for v in out["labels"][-len(pieces) :])
                held += sum(p[2] - p[1] + p[0] for p in pieces)
                if held >= WRITE_TOKENS:
                    writer = _write(sink, writer, out, columns, types)
                    out, held = {c: [] for c in columns}, 0
            writer = _write(sink, writer, out, columns, types)
            writer.close()
        os.replace(tmp, path)
    lengths_a = np.asarray(lengths, np.int64)
    trained_a = np.asarray(trained, np.int64)
    kept = trained_a > 0 if drop_unlabeled else np.ones(lengths_a.shape[0], bool)
    counts["pieces_dropped_unlabeled"] = int((~kept).sum())
    carries_a = np.asarray(carries, np.int64)
    counts["tokens_carried"] = int(carries_a[kept].sum())  # copies of the head in the output
    own = lengths_a - carries_a  # a piece's tokens that came from the input (not the head copy)
    counts["tokens_dropped_unlabeled"] = int(own[~kept].sum())
    if split_at == "tokens" and kept.all():
        os.unlink(path)  # the plan's own split makes the same pieces: nothing to gather from here
        return SplitResult(None, lengths_a, trained_a, kept, counts)
    return SplitResult(path, lengths_a, trained_a, kept, counts)
