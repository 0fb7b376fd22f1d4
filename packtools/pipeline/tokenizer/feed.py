"""How batches reach a :class:`~packtools.pipeline.tokenizer.batch.BatchTokenizer` in the pipeline's stage: with their
Python half (:meth:`~packtools.pipeline.tokenizer.batch.BatchTokenizer.prepare`) done in the reading thread for raw
text, or, for chat, rendered while the fast engine still loads and finished by it once it has loaded.

>>> class Tok:
...     loading = [True, True, False]
...     def engine_loading(self): return self.loading.pop(0) if self.loading else False
...     def prepare(self, table, where): return ("held", table)
...     def finish(self, prepared): return prepared[1] * 10
...     def __call__(self, table, where): return table * 10
>>> list(render_while_loading(Tok(), iter([(0, 1), (1, 2), (2, 3), (3, 4)])))
[(0, 10), (1, 20), (2, 30), (3, 40)]
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any

import pyarrow as pa

#: chat batches rendered while the fast engine loads (:func:`render_while_loading`), at most
AHEAD_BATCHES = 32


def prepared_batches(tok: Any, read: Any) -> Iterator[tuple[Any, tuple[Any, ...]]]:
    """``(where, tok.prepare(table, where))`` of every batch ``read`` gives (closing it when closed early)."""
    try:
        for where, table in read:
            yield where, tok.prepare(table, where)
    finally:
        read.close()


def called(tok: Any, batches: Iterator[tuple[Any, pa.Table]]) -> Iterator[tuple[Any, pa.Table]]:
    """``(where, tok(table, where))`` for every batch, in order."""
    for where, table in batches:
        yield where, tok(table, where)


def render_while_loading(tok: Any, batches: Iterator[tuple[Any, pa.Table]]) -> Iterator[tuple[Any, pa.Table]]:
    """``(where, tok(table, where))`` for every batch, in order; while the fast engine still loads, up to
    :data:`AHEAD_BATCHES` batches are rendered (:meth:`BatchTokenizer.prepare`, most of chat's Python work)
    and held, then finished by the engine once it has loaded, instead of the thread waiting for it."""
    held: collections.deque = collections.deque()
    for where, table in batches:
        if tok.engine_loading() and len(held) < AHEAD_BATCHES:
            held.append((where, tok.prepare(table, where)))
            continue
        while held:
            w, prepared = held.popleft()
            yield w, tok.finish(prepared)
        yield where, tok(table, where)
    while held:
        w, prepared = held.popleft()
        yield w, tok.finish(prepared)
