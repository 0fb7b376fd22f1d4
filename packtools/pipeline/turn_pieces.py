"""The rule that cuts one row with labels into pieces (:func:`plan_pieces`), on its label and id arrays alone:
turn ends, the carried head, tool chains kept together, exchanges longer than a piece.  The rules are stated in
:mod:`packtools.pipeline.turn_split`, which applies them to the staged rows and writes the pieces.

>>> import numpy as np
>>> ids = np.arange(100, 115); labels = np.array([-100, -100, -100] + list(range(103, 115)))
>>> plan_pieces(labels, head=2, max_length=8)  # head 2, a question of 1, a reply of 12
TurnCut(pieces=[(0, 0, 8), (0, 8, 15)], turns_cut=1, questions_dropped=0)
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..constants import IGNORE_INDEX
from ..errors import check_choice

#: ``turns``: cut at the ends of trained spans, carrying the head; ``tokens``: every ``max_length`` tokens.
SPLIT_AT = ("turns", "tokens")

Piece = tuple[int, int, int]  # (tokens of the head carried before it, start, end) in the row


def check_split_at(split_at: str) -> None:
    check_choice("split_at", split_at, SPLIT_AT)


def carried_head(head: int, max_length: int) -> int:
    """The head tokens each later piece carries: the head, or 0 when it is longer than half of ``max_length``."""
    return head if 0 < head and 2 * head <= max_length else 0


def turn_ends(labels: np.ndarray) -> np.ndarray:
    """Positions (0 < p < len) where a trained span ends: ``labels[p - 1]`` trained, ``labels[p]`` not."""
    trained = labels != IGNORE_INDEX
    return np.flatnonzero(trained[:-1] & ~trained[1:]) + 1


def cut_row(labels: np.ndarray, head: int, max_length: int, split_at: str = "turns") -> list[Piece]:
    """The pieces of one row (its ``labels``; the row is ``len(labels)`` tokens) as ``(carry, start, end)``:
    the piece is the row's first ``carry`` tokens (the head, unlabeled) followed by ``row[start:end]``;
    ``carry + end - start <= max_length``, and the ``[start, end)`` cover the row once, in order."""
    return plan_pieces(labels, head, max_length, split_at).pieces


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
    trained token ``r``).

    * A reply that fits a piece (with the head it carries): cut from the end, the last piece holding the reply
      and as much of the question as fits.
    * A longer reply: its first piece holds the head (where it is carried), the question (its end when it is
      longer than three quarters of the piece, so that a quarter is left to the reply) and the reply's start;
      the later pieces continue the reply **without a head**, each a plain window of the conversation whose
      first token is not trained (as every sequence's first token), so no trained token follows a context that
      never existed.  A question's start that does not fit goes into
      pieces before, which train nothing.
    """
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
    start a tool message (:func:`packtools.pipeline.tokenizer.chat.head.tool_opener_ids`); an exchange that starts with
    them (a tool result and the answer after it) stays with the exchange before it (the question and the
    call) where the whole fits a piece."""
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
    for unit in units:
        ua, ub = unit[0][0], unit[-1][1]
        if ub - start <= cap(start):  # the whole unit fits the open piece
            end = ub
            continue
        if end > start:
            pieces.append((carry if start else 0, start, end))
        start = end = ua
        if ub - ua <= cap(ua):
            end = ub
            continue
        if len(unit) > 1 and _tail_fits(labels, ua, ub, head, max_length):
            # a long question before a tool chain that fits a piece: the chain with the question's end
            cut += 1
            pieces.extend(_from_end(ua, ub, carry, max_length))
            start = end = ub
            continue
        for a, b in unit:  # longer than a piece: exchange by exchange
            if b - start <= cap(start):
                end = b
                continue
            if end > start:
                pieces.append((carry if start else 0, start, end))
            start = end = a
            if b - a <= cap(a):
                end = b
                continue
            cut += 1
            pieces.extend(long_exchange(labels, a, b, head, max_length))
            start = end = b
    if end > start:
        pieces.append((carry if start else 0, start, end))
    glued = {a for unit in units for a, _ in unit[1:]}
    # a piece that starts at a tool result and trains (after its first token): an answer without its question
    dropped = sum(1 for c, a, b in pieces if a in glued and (labels[a + (not c) : b] != IGNORE_INDEX).any())
    return TurnCut(pieces, cut, dropped)
