"""The guard's length-dependent RoPE rule (:func:`~packtools.integrations.trainers.guard.rope_mismatch`) applied to
a training dataset's row lengths before training starts.

transformers picks ``longrope`` and ``dynamic`` NTK frequencies from the longest sequence of a forward, so the
guard refuses a packed forward whose sequences would be rotated otherwise than alone -- but only at the batch
that holds them, which may come late in training.  Where the dataset's lengths can be read up front (its
``seq_lengths`` column, or the ``input_ids`` of unpacked rows, TRL's preference pairs), :func:`check_rope_rows`
refuses before training, naming the rows:

* a row whose own sequences the rule refuses (they are always in one forward: refused at every batch holding it);
* with a fixed number of rows per forward over 1 (``rows_per_forward``: ``per_device_train_batch_size`` rows
  flattened into one padding-free row), a row holding a sequence over the threshold and another row that the guard
  would refuse in the same forward: for ``dynamic`` any other row (every batch holding the long row is refused),
  for ``longrope`` a row holding a sequence under it (refused whenever the two meet in a micro-batch).

Token-budget batches (``max_tokens``) put a varying number of rows in a forward: only the first rule is applied
up front; the guard's per-batch check stays for the rest.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..._optional import is_instance, require
from ...errors import PackingError
from .guard import length_dependent_rope, rope_mismatch
from .loader import row_lengths_and_segments


def rows_and_sequences(dataset: Any) -> tuple[np.ndarray, np.ndarray] | None:
    """``(offsets, lengths)``: the sequence lengths of every row of ``dataset`` (row ``i``'s are
    ``lengths[offsets[i]:offsets[i + 1]]``), or ``None`` when they cannot be read up front (a stream, a dataset
    of another kind).

    >>> import datasets
    >>> rows = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5]], "seq_lengths": [[2, 1], [2]]})
    >>> [a.tolist() for a in rows_and_sequences(rows)]
    [[0, 2, 3], [2, 1, 2]]
    """
    try:
        rows, segments = row_lengths_and_segments(dataset)
    except PackingError:
        return None
    if segments is None:  # one sequence per row
        return np.arange(len(rows) + 1, dtype=np.int64), np.asarray(rows, np.int64)
    pc = require("pyarrow.compute", "packtools.integrations.trainers.rope_rows")
    from ...core.arrow import column_lengths

    counts = column_lengths(segments)
    values = pc.list_flatten(segments).to_numpy(zero_copy_only=False).astype(np.int64)
    return np.concatenate([[0], np.cumsum(counts)]), values


def check_rope_rows(
    model: Any,
    dataset: Any,
    *,
    rows_per_forward: int = 1,
    caller: str = "prepare_trainer",
    truncated_to: int | None = None,
) -> None:
    """Raise :class:`PackingError` naming the first row of ``dataset`` that a length-dependent rotary embedding of
    ``model`` (:func:`~packtools.integrations.trainers.guard.length_dependent_rope`) is sure to have refused in
    training (see the module docstring); nothing for other models or datasets whose lengths cannot be read.
    ``truncated_to``: the length the collator cuts each sequence to before the forward (TRL's
    ``DataCollatorForPreference(max_length=...)``): the forward sees those lengths, not the dataset's."""
    if not length_dependent_rope(model) or dataset is None:
        return
    found = rows_and_sequences(dataset)
    if found is None:
        return
    offsets, lengths = found
    if truncated_to is not None:
        lengths = np.minimum(lengths, int(truncated_to))
    check_rope_sequences(model, offsets, lengths, rows_per_forward=rows_per_forward, caller=caller)


def check_rope_sequences(
    model: Any,
    offsets: np.ndarray,
    lengths: np.ndarray,
    *,
    rows_per_forward: int = 1,
    caller: str = "prepare_trainer",
) -> None:
    """:func:`check_rope_rows` on lengths already read: row ``i`` of the training dataset puts sequences of
    ``lengths[offsets[i]:offsets[i + 1]]`` tokens into a forward (a trainer whose rows are no ``seq_lengths`` or
    ``input_ids`` column: KTO's prompt + completion).  Vectorized over the rows (two cumulative sums per rotary
    embedding): no row is walked in Python.

    >>> import numpy as np, transformers
    >>> config = transformers.LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
    ...     num_attention_heads=2, max_position_embeddings=10, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    >>> model = transformers.LlamaForCausalLM(config)
    >>> check_rope_sequences(model, np.array([0, 1, 2]), np.array([12, 4]))  # each row alone: fine
    >>> check_rope_sequences(model, np.array([0, 1, 2]), np.array([12, 4]), rows_per_forward=2)
    Traceback (most recent call last):
    ...
    packtools.errors.PackingError: prepare_trainer: LlamaForCausalLM's packed sequences would train with wrong positions, refused before training: rows 0 and 1 of the training dataset (sequences of [12, 4] tokens) would share a forward (2 rows per micro-batch, flattened into one padding-free row), and its 'dynamic' rotary embedding rescales its frequencies for max(position_ids) + 1 of a forward once it exceeds max_position_embeddings=10: this forward's positions reach 12 and its longest sequence holds 12 tokens, so its sequences would be rotated for another length than their own. Pack with max_length <= 10 (pack_dataset(..., max_length=10)) so that no sequence crosses it, or train the longer sequences unpacked, in batches of their own (per_device_train_batch_size=1).
    """
    rope = length_dependent_rope(model)
    if not rope:
        return
    offsets = np.asarray(offsets, np.int64)
    lengths = np.asarray(lengths, np.int64)
    counts = np.diff(offsets)
    for _, kind, limit in rope:
        over = np.concatenate([[0], np.cumsum(lengths > limit)])
        under = np.concatenate([[0], np.cumsum((lengths > 0) & (lengths <= limit))])
        n_over = over[offsets[1:]] - over[offsets[:-1]]
        n_under = under[offsets[1:]] - under[offsets[:-1]]
        if kind == "longrope":
            own = (n_over > 0) & (n_under > 0)
        else:
            own = (n_over > 0) & (counts >= 2)
        bad = np.flatnonzero(own)
        if bad.size:
            row = int(bad[0])
            _refuse(rope, caller, [row], lengths[offsets[row] : offsets[row + 1]])
        if rows_per_forward < 2 or len(counts) < 2:
            continue
        long_rows = np.flatnonzero(n_over > 0)
        if not long_rows.size:
            continue
        others = np.flatnonzero(n_under > 0) if kind == "longrope" else np.flatnonzero(counts > 0)
        others = others[others != long_rows[0]]
        if others.size:
            rows = [int(long_rows[0]), int(others[0])]
            seqs = np.concatenate([lengths[offsets[r] : offsets[r + 1]] for r in rows])
            _refuse(rope, caller, rows, seqs, rows_per_forward)


def _refuse(
    rope: tuple[tuple[str, str, int], ...],
    caller: str,
    rows: list[int],
    seqs: np.ndarray,
    rows_per_forward: int = 1,
) -> None:
    seqs = [int(n) for n in seqs if n > 0]
    found = rope_mismatch(rope, seqs, max(seqs))
    assert found is not None  # the rows were chosen by the same rule
    name, limit, why = found
    where = (
        f"row {rows[0]} of the training dataset holds sequences of {seqs} tokens"
        if len(rows) == 1
        else f"rows {rows[0]} and {rows[1]} of the training dataset (sequences of {seqs} tokens) would share a "
        f"forward ({rows_per_forward} rows per micro-batch, flattened into one padding-free row)"
    )
    raise PackingError(
        f"{caller}: {name}'s packed sequences would train with wrong positions, refused before training: {where}, "
        f"and {why}. Pack with max_length <= {limit} (pack_dataset(..., max_length={limit})) so that no sequence "
        f"crosses it, or train the longer sequences unpacked, in batches of their own (per_device_train_batch_size=1).",
        param="train_dataset",
    )


def rows_per_forward(trainer: Any, max_tokens: int | None) -> int:
    """How many rows of the training dataset each forward of ``trainer`` surely holds together: its
    ``per_device_train_batch_size`` when its collator is known to flatten them into one padding-free row
    (:func:`flattens_rows`) and no token budget (``max_tokens``) decides the count, else 1."""
    if max_tokens is not None or not flattens_rows(trainer.data_collator):
        return 1
    return int(getattr(trainer.args, "per_device_train_batch_size", 1) or 1)


def flattens_rows(collator: Any) -> bool:
    """Whether ``collator`` is known to put a batch's rows into one padding-free row: one with a true
    ``padding_free`` attribute (packtools' collators, TRL's), or transformers' ``DataCollatorWithFlattening``.
    Any other collator (a padding one: each row its own, the guard's per-batch check stays) counts as not.

    >>> from packtools import PaddingFreeCollator
    >>> flattens_rows(PaddingFreeCollator(0)), flattens_rows(PaddingFreeCollator(0, padding_free=False))
    (True, False)
    >>> flattens_rows(lambda rows: rows)
    False
    """
    inner = getattr(collator, "collator", collator)  # packtools' wrappers keep the user's collator here
    if is_instance(inner, "transformers", "DataCollatorWithFlattening"):
        return True
    return getattr(inner, "padding_free", False) is True
