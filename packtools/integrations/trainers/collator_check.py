"""Does the trainer's own collator keep packed sequences apart?  Checked on a real batch of its own dataset.

A trainer trains on whatever its ``data_collator`` returns.  Collators that do not read ``seq_lengths``
(transformers' ``DataCollatorForLanguageModeling`` and ``DataCollatorWithFlattening``, TRL's SFT collator with
``padding_free=False``) turn every packed row into one long sequence -- an all-ones ``attention_mask``, or
``position_ids`` restarting per row instead of per sequence -- and training runs on the wrong context with no
error.  :func:`check_trainer_collator` takes a few rows of the trainer's train dataset (packed rows first), feeds
them to the collator exactly as the trainer would (after its column removal), and checks the batch against the
rows' own ``seq_lengths``:

* every row's tokens are in the batch, in order, flat or one per row (nothing merged, cut or reordered);
* no 2-D ``attention_mask`` over a row holding several sequences (transformers then ignores ``position_ids``);
* ``position_ids`` restart at 0 at every sequence start and count up by 1 inside it;
* ``cu_seq_lens_q/k`` (when present) mark exactly the sequences' boundaries, ``max_length_q/k`` covers the
  longest, ``seq_idx`` changes exactly at the boundaries;
* ``labels`` are -100 at every sequence start inside a row and on padding.

It then returns a collator for :func:`packtools.integrations.check_isolation` that feeds the probe's rows,
shaped like the real ones, through the trainer's collator, so the probe measures the batches training will see.
A collator that passes is accepted as it is (judged by its batch, never by its class name); one that fails: refused.

:func:`check_preference_collator` does the same for a ``DPOTrainer``'s pairs.

A collator with side effects (counting batches) can tell these calls from training's with :func:`in_check`.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from ..._optional import is_instance
from ...batches.collate import PaddingFreeCollator
from ...compat.transformers import training_collator, training_rows
from ...constants import IGNORE_INDEX, MASK_COLUMNS, SEQ_LENGTHS
from ...errors import PackingError
from .rows import locate_rows, sequence_spans
from .sft import is_sft_trainer

#: Rows scanned from the start of the dataset for packed ones; rows collated for the check.
SCAN_ROWS = 64
MAX_BATCH_ROWS = 4
#: Whether the code running now is inside one of packtools' checks.  A context variable, not a process-wide
#: flag: each thread (and asyncio task) sees its own value, so a collator another thread calls for training
#: while this one checks is never told it is in a check; a check that ends restores the value it found.
_IN_CHECK: contextvars.ContextVar[bool] = contextvars.ContextVar("packtools_collator_check", default=False)


def in_check() -> bool:
    """True while packtools' trainer checks call the trainer's collator (not a training batch), in the thread
    running the check."""
    return _IN_CHECK.get()


@contextlib.contextmanager
def _checking() -> Iterator[None]:
    token = _IN_CHECK.set(True)
    try:
        yield
    finally:
        _IN_CHECK.reset(token)


def _array(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):
        value = value.detach().cpu()
    return np.asarray(value)


def _name(collator: Any) -> str:
    cls = type(collator)
    return f"{cls.__module__}.{cls.__qualname__}" if cls.__module__ != "builtins" else repr(collator)


def _head_rows(dataset: Any, count: int) -> list[Any]:
    if hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__"):
        return [dataset[i] for i in range(min(len(dataset), count))]
    return list(itertools.islice(iter(dataset), count))


def _batch_rows(trainer: Any) -> int:
    """The rows of a checked batch: the trainer's batch size, at least 2 and at most :data:`MAX_BATCH_ROWS`."""
    return min(max(2, int(getattr(trainer.args, "per_device_train_batch_size", 2) or 2)), MAX_BATCH_ROWS)


def _seq_lengths(row: Mapping[str, Any]) -> list[int]:
    n = len(_array(row["input_ids"]))
    value = row.get(SEQ_LENGTHS)
    return [n] if value is None else [int(x) for x in _array(value).reshape(-1)]


def sample_batch(
    trainer: Any, dataset: Any
) -> tuple[list[Any], list[Any], Callable[[list[Any]], Any]] | None:
    """``(raw_rows, fed_rows, collate)``: a few rows of ``dataset`` (packed ones first), as stored and as the
    trainer feeds them to ``collate`` (:func:`_as_trained`).  ``None`` when no row has ``input_ids``."""
    head = _head_rows(dataset, SCAN_ROWS)
    head = [(i, r) for i, r in enumerate(head) if isinstance(r, Mapping) and "input_ids" in r]
    if not head:
        return None
    packed = [i for i, r in head if len(_seq_lengths(r)) > 1]
    others = [i for i, r in head if len(_seq_lengths(r)) <= 1]
    picked = sorted((packed + others)[: _batch_rows(trainer)])
    raw = [dict(head)[i] for i in picked]
    return raw, *_as_trained(trainer, dataset, raw, picked)


def _as_trained(
    trainer: Any, dataset: Any, raw: list[Any], picked: Sequence[int]
) -> tuple[list[Any], Callable]:
    """``(fed_rows, collate)``: ``raw`` (rows ``picked`` of ``dataset``) as the trainer's training loader hands
    them to its collator, and that collator: a ``datasets.Dataset`` loses its unused columns first, any other
    dataset's rows go through the trainer's column-removing collator wrapper."""
    if is_instance(dataset, "datasets", "Dataset"):
        small = training_rows(trainer, dataset.select(picked))
        return [small[i] for i in range(len(small))], trainer.data_collator
    return raw, training_collator(trainer, trainer.data_collator)


def batch_problems(
    batch: Mapping[str, Any], rows: Sequence[Sequence[int]], seq_lengths: Sequence[Sequence[int]]
) -> list[str]:
    """What in ``batch`` (a collator's output for ``rows``) lets packed sequences see each other; ``[]`` if nothing.

    ``rows`` are the rows' token ids and ``seq_lengths`` their sequences' lengths, from the dataset itself.

    >>> rows, lengths = [[5, 6, 7, 8]], [[2, 2]]
    >>> ok = {"input_ids": np.array([[5, 6, 7, 8]]), "position_ids": np.array([[0, 1, 0, 1]]),
    ...       "labels": np.array([[-100, 6, -100, 8]])}
    >>> batch_problems(ok, rows, lengths)
    []
    >>> batch_problems({**ok, "attention_mask": np.ones((1, 4))}, rows, lengths)  # doctest: +ELLIPSIS
    ['it returns a 2-D attention_mask over batch row 0, which holds 2 sequences...']
    """
    if not isinstance(batch, Mapping) or "input_ids" not in batch:
        return [f"it returns no 'input_ids' (got {type(batch).__name__})"]
    ids = _array(batch["input_ids"])
    ids = ids[None] if ids.ndim == 1 else ids
    tokens = [np.asarray(_array(r), np.int64).reshape(-1) for r in rows]
    where = locate_rows(ids, tokens)
    if where is None:
        return [
            f"its input_ids (shape {tuple(ids.shape)}) do not hold the {len(rows)} rows it was given in order, "
            f"flat or one per row: it merges, cuts or reorders them"
        ]
    spans = sequence_spans(where, seq_lengths)
    per_row = np.bincount([b for b, _, _ in spans], minlength=ids.shape[0])
    problems: list[str] = []
    mask = batch.get("attention_mask")
    if mask is not None:
        mask = _array(mask)
        if mask.ndim == 2:
            crowded = np.flatnonzero(per_row > 1)
            if crowded.size:
                problems.append(
                    f"it returns a 2-D attention_mask over batch row {int(crowded[0])}, which holds "
                    f"{int(per_row[crowded[0]])} sequences: transformers then ignores position_ids and every "
                    f"token attends across the sequence boundaries of its row"
                )
            elif any(not mask[b, a:e].all() for b, a, e in spans):
                problems.append("its attention_mask hides real tokens of the rows")
    pos = batch.get("position_ids")
    if pos is not None:
        pos = _array(pos)
        pos = pos[None] if pos.ndim == 1 else pos
    if pos is None or pos.ndim != 2 or pos.shape != ids.shape:
        if per_row.max(initial=0) > 1 and batch.get("cu_seq_lens_q") is None:
            problems.append(
                "it returns no position_ids (and no cu_seq_lens) for rows that hold several sequences, so the "
                "model sees each row as one sequence"
            )
    else:
        for j, (b, a, e) in enumerate(spans):
            if not np.array_equal(pos[b, a:e], np.arange(e - a)):
                problems.append(
                    f"its position_ids for sequence {j} (batch row {b}, tokens {a}..{e - 1}) are "
                    f"{pos[b, a : min(e, a + 6)].tolist()}{'...' if e - a > 6 else ''}, not 0, 1, 2, ...: it "
                    f"does not restart them per packed sequence (seq_lengths), so the model sees the sequences "
                    f"of a row as one"
                )
                break
    problems += _varlen_problems(batch, spans, ids.shape)
    labels = batch.get("labels")
    if labels is not None:
        labels = _array(labels)
        labels = labels[None] if labels.ndim == 1 else labels
        if labels.shape == ids.shape:
            real = np.zeros(ids.shape, bool)
            for b, a, e in spans:
                real[b, a:e] = True
            # A start with another sequence's token before it is a target of that token unless it is -100.
            bad = [(b, a) for b, a, _ in spans if real[b, :a].any() and labels[b, a] != IGNORE_INDEX]
            if bad:
                problems.append(
                    f"its labels are not -100 at the first token of a packed sequence (batch row {bad[0][0]}, "
                    f"token {bad[0][1]}): the previous sequence's last token would learn to predict it"
                )
            if (labels[~real] != IGNORE_INDEX).any():
                problems.append("its labels are not -100 on padding: padding would be learned")
    return problems


def _varlen_problems(
    batch: Mapping[str, Any], spans: list[tuple[int, int, int]], shape: tuple[int, ...]
) -> list[str]:
    problems = []
    longest = max((e - a for _, a, e in spans), default=0)
    total = spans[-1][2] if spans else 0
    bounds = [a for _, a, _ in spans] + [total]
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        cu = batch.get(key)
        if cu is None:
            continue
        cu = _array(cu).reshape(-1).astype(np.int64)
        if shape[0] != 1:
            problems.append(f"it returns {key} with {shape[0]} batch rows; cu_seq_lens describe one flat row")
        elif (
            list(dict.fromkeys(int(c) for c in cu if c <= total)) != bounds  # empty segments repeat a value
            or (cu[1:] < cu[:-1]).any()
            or cu[-1] > shape[1]
        ):
            problems.append(
                f"its {key} {cu.tolist()[:8]}{'...' if cu.size > 8 else ''} do not mark the sequences' "
                f"boundaries {bounds[:8]}{'...' if len(bounds) > 8 else ''}"
            )
    for key in ("max_length_q", "max_length_k"):
        value = batch.get(key)
        if value is not None and int(_array(value).reshape(-1).max()) < longest:
            problems.append(
                f"its {key} ({int(_array(value).max())}) is below the longest sequence ({longest})"
            )
    seq_idx = batch.get("seq_idx")
    if seq_idx is not None:
        idx = _array(seq_idx)
        idx = idx[None] if idx.ndim == 1 else idx
        if idx.shape == shape:
            same = all(np.all(idx[b, a:e] == idx[b, a]) for b, a, e in spans)
            apart = all(
                idx[b1, a1] != idx[b2, a2] for (b1, a1, _), (b2, a2, _) in zip(spans, spans[1:]) if b1 == b2
            )
            if not (same and apart):
                problems.append("its seq_idx does not change exactly at the sequence boundaries")
    return problems


def _pad_token(trainer: Any) -> int | str:
    for owner in (getattr(trainer, "processing_class", None), getattr(trainer.model, "config", None)):
        pad = getattr(owner, "pad_token_id", None)
        if isinstance(pad, int):
            return pad
    return "tokenizer.pad_token_id"


def _refuse(trainer: Any, collator: Any, problems: Sequence[str]) -> PackingError:
    sft = is_sft_trainer(trainer)
    trl_own = sft and type(collator).__module__.startswith("trl.")
    own = " (TRL's own, which SFTTrainer builds when no data_collator is passed)" if trl_own else ""
    alt = " Or give SFTTrainer args=packed_sft_config(...) (padding_free=True) and no data_collator." * sft
    where = "SFTTrainer(..., args=packed_sft_config(..., padding_free=False), " if sft else "Trainer(..., "
    return PackingError(
        f"the trainer's data_collator {_name(collator)}{own} cannot keep packed sequences apart: on a batch of "
        f"the trainer's own packed rows, {problems[0]}"
        + (f" (also: {'; '.join(problems[1:3])})" if len(problems) > 1 else "")
        + f". Training would run on the wrong context with no error. Fix: build the trainer with "
        f"{where}data_collator=packtools.PaddingFreeCollator({_pad_token(trainer)})), which reads seq_lengths "
        f"and emits position_ids, cu_seq_lens and labels per packed sequence.{alt}"
        " (prepare_trainer(..., check_isolation=False) skips this check; training would then be silently wrong.)"
    )


class ProbeRows:
    """The trainer's collator, fed the isolation probe's rows with the keys the real rows carry.

    The probe builds ``input_ids`` (+ ``seq_lengths``); the 0/1 mask columns get ones, ``labels`` a copy of the
    tokens, ``position_ids`` and ``attention_mask`` what a correct row would hold; keys packtools cannot make up
    are left out.
    """

    def __init__(self, collate: Callable[[list[Any]], Any], keys: Sequence[str]) -> None:
        self.collate, self.keys = collate, tuple(keys)

    def _row(self, row: dict[str, Any]) -> dict[str, Any]:
        n = len(row["input_ids"])
        out = {"input_ids": row["input_ids"]}
        lengths = row.get(SEQ_LENGTHS) or [n]
        for key in self.keys:
            if key == SEQ_LENGTHS and SEQ_LENGTHS in row:
                out[key] = row[key]
            elif key in MASK_COLUMNS or key == "attention_mask":
                out[key] = [1] * n
            elif key == "labels":
                out[key] = list(row["input_ids"])
            elif key == "position_ids":
                out[key] = [p for m in lengths for p in range(m)]
        return out

    def __call__(self, rows: list[dict[str, Any]]) -> Any:
        with _checking():
            return self.collate([self._row(r) for r in rows])


def check_trainer_collator(trainer: Any) -> tuple[ProbeRows | None, bool]:
    """Check ``trainer.data_collator`` on a real batch of ``trainer.train_dataset``; raise :class:`PackingError`
    with the fix when it lets packed sequences see each other.

    Returns ``(probe_collator, packed)`` for :func:`packtools.integrations.check_isolation`: the trainer's collator fed rows
    shaped like the dataset's, and whether the dataset is packed (has ``seq_lengths``).  ``(None, True)`` when
    there is no dataset to sample (the probe then uses its own ``PaddingFreeCollator``).
    """
    dataset = getattr(trainer, "train_dataset", None)
    sample = None if dataset is None else sample_batch(trainer, dataset)
    if sample is None:
        return None, True
    raw, fed, collate = sample
    packed = any(SEQ_LENGTHS in r for r in raw)
    with _checking():
        try:
            batch = collate(list(fed))
        except PackingError:
            raise
        except Exception as err:  # noqa: BLE001 - any collator error, reported with the collator's name
            raise PackingError(
                f"the trainer's data_collator {_name(trainer.data_collator)} failed on {len(fed)} rows of the "
                f"trainer's train dataset ({type(err).__name__}: {err}); it must collate the dataset's rows "
                f"(for packed rows use data_collator=packtools.PaddingFreeCollator({_pad_token(trainer)}))."
            ) from err
    rows = [r["input_ids"] for r in raw]
    problems = batch_problems(batch, rows, [_seq_lengths(r) for r in raw])
    if problems:
        raise _refuse(trainer, trainer.data_collator, problems)
    keys = list(fed[0].keys()) if isinstance(fed[0], Mapping) else ["input_ids"]
    return ProbeRows(probe_collator(trainer.data_collator) or trainer.data_collator, keys), packed


def probe_collator(collator: Any) -> Any:
    """The trainer's PaddingFreeCollator (returning tensors), or None for the probe's default."""
    inner = getattr(collator, "collator", collator)
    if not isinstance(inner, PaddingFreeCollator):
        return None
    return inner if inner.return_tensors == "pt" else inner.replace(return_tensors="pt")


def check_preference_collator(trainer: Any) -> None:
    """Check a ``DPOTrainer``'s collator on a real batch of its (tokenized) pairs: each pair's chosen and rejected
    sequences must come out as their own right-padded rows (chosen rows first, as TRL's
    ``DataCollatorForPreference``); raise :class:`PackingError` if it merges pairs or sequences into one row."""
    dataset = getattr(trainer, "train_dataset", None)
    sample = None if dataset is None else _preference_sample(trainer, dataset)
    if sample is None:
        return
    raw, fed, collate = sample
    with _checking():
        batch = collate(list(fed))
    expected = [_pair_tokens(r, "chosen_ids") for r in raw] + [_pair_tokens(r, "rejected_ids") for r in raw]
    problem = _preference_problem(batch, expected)
    if problem:
        raise PackingError(
            f"the DPOTrainer's data_collator {_name(trainer.data_collator)} does not lay pairs out as "
            f"packtools.prepare_dpo_trainer needs: on {len(raw)} pairs of the trainer's dataset, {problem}. "
            f"prepare_dpo_trainer flattens TRL's layout (one right-padded row per chosen and per rejected "
            f"sequence, chosen rows first) into a padding-free row; a row holding several sequences would let "
            f"them attend to each other. Fix: leave data_collator unset (TRL's DataCollatorForPreference), and "
            f"for packed pairs pass prepare_dpo_trainer(trainer, train_dataset=packtools.dpo.pack_preference(...))."
        )


def _pair_tokens(row: Mapping[str, Any], key: str) -> np.ndarray:
    return np.concatenate([_array(row["prompt_ids"]).reshape(-1), _array(row[key]).reshape(-1)]).astype(
        np.int64
    )


def _preference_sample(trainer: Any, dataset: Any) -> tuple[list[Any], list[Any], Callable] | None:
    head = _head_rows(dataset, MAX_BATCH_ROWS)
    if not head or not all(
        isinstance(r, Mapping) and {"prompt_ids", "chosen_ids", "rejected_ids"} <= set(r) for r in head
    ):
        return None
    head = head[: _batch_rows(trainer)]
    return head, *_as_trained(trainer, dataset, head, range(len(head)))


def _preference_problem(batch: Any, expected: list[np.ndarray]) -> str | None:
    if not isinstance(batch, Mapping) or "input_ids" not in batch or "attention_mask" not in batch:
        return f"it returns {sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__}, not input_ids with an attention_mask"
    ids, mask = _array(batch["input_ids"]), _array(batch["attention_mask"])
    if ids.ndim != 2 or ids.shape[0] != len(expected) or mask.shape != ids.shape:
        return (
            f"its input_ids have shape {tuple(ids.shape)}, not one row per chosen and per rejected sequence "
            f"({len(expected)} rows): it merges sequences or pairs"
        )
    for i, want in enumerate(expected):
        n = int(mask[i].sum())
        if not mask[i, :n].all():
            return f"row {i} is not right-padded"
        got = ids[i, :n].astype(np.int64)
        # TRL's max_length cuts a sequence (keep_start or keep_end); anything else is not this pair's sequence.
        if not (np.array_equal(got, want[:n]) or np.array_equal(got, want[len(want) - n :])) or n > len(want):
            side = "chosen" if i < len(expected) // 2 else "rejected"
            return f"row {i} does not hold pair {i % (len(expected) // 2)}'s prompt + {side} tokens alone"
    return None
