"""Batches of preference pairs: packed pair rows (or TRL's one-pair rows) to model inputs.

Two layouts, built with NumPy and wrapped as tensors at the end:

* ``padding_free=True``: one flat row of every sequence of the batch, exactly as
  :class:`~packtools.PaddingFreeCollator` builds it (``input_ids``, ``labels`` -100 outside completions and at
  every sequence start, ``position_ids``, ``cu_seq_lens_*``, ``max_length_*``), the sequences in pair order
  (chosen, rejected, chosen, ...), plus each per-pair column as a ``[n_pairs]`` tensor.  Feed it to the model,
  then :func:`packtools.dpo.sequence_logps` and ``.pairs()``.
* ``padding_free=False``: TRL's ``DPOTrainer`` layout (``input_ids``, ``attention_mask``, ``completion_mask``
  of shape ``[2 * n_pairs, T]``, right-padded, all chosen sequences then all rejected ones, and
  ``ref_chosen_logps`` / ``ref_rejected_logps`` as ``[n_pairs]``), for the trainer's own loss code;
  :func:`packtools.prepare_dpo_trainer` runs it through the model as one padding-free row.

A row is either a packed pair row (``input_ids``, ``completion_mask``, ``seq_lengths`` with an even count of
sequences, per-pair columns as lists) or one pair in TRL's tokenized format (``prompt_ids``, ``chosen_ids``,
``rejected_ids``, per-pair columns as scalars).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..core.ragged import offsets_of
from ..errors import PackingError
from .collate import assemble_padding_free, check_pad_args, to_tensors
from .flatten import FlatRows
from .labels import labels_of
from .tree import flat_ints, row_groups, tree_row, unshared_index

REF_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")


def _pair_row(row: Mapping[str, Any], i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, completion mask, sequence lengths) of one row, in pair order."""
    if row.get("prompt_lengths") is not None:  # prompt-shared: expand to [prompt + chosen][prompt + rejected]
        if (row_groups(row) != 2).any():
            raise PackingError(
                f"row {i} holds groups of completions, not preference pairs (group_sizes != 2)."
            )
        ids, mask, segments, is_branch = tree_row(row, i)
        index, lengths = unshared_index(segments, is_branch)
        return ids[index], mask[index], lengths
    if "seq_lengths" in row:
        ids = flat_ints(row["input_ids"], i, "input_ids")
        if row.get("completion_mask") is None:
            raise PackingError(
                f"row {i} has no 'completion_mask'; packed pair rows need it to tell completions from prompts "
                f"(packtools.dpo.pack_preference writes it; keep it through remove_unused_columns)."
            )
        mask = flat_ints(row["completion_mask"], i, "completion_mask")
        seq = flat_ints(row["seq_lengths"], i, "seq_lengths")
        if mask.shape != ids.shape or int(seq.sum()) != ids.shape[0] or (seq.size and seq.min() <= 0):
            raise PackingError(
                f"row {i}: input_ids ({ids.shape[0]}), completion_mask ({mask.shape[0]}) and seq_lengths "
                f"(sum {int(seq.sum())}) disagree; re-pack with packtools.dpo.pack_preference."
            )
        if seq.shape[0] % 2:
            raise PackingError(
                f"row {i} holds {seq.shape[0]} sequences, an odd count, so it does not hold whole pairs; a pair "
                f"row alternates chosen and rejected (packtools.dpo.pack_preference never splits a pair)."
            )
        return ids, mask, seq
    try:
        prompt, chosen, rejected = (row[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids"))
    except KeyError:
        raise PackingError(
            f"row {i} is neither a packed pair row (input_ids, completion_mask, seq_lengths) nor a pair "
            f"(prompt_ids, chosen_ids, rejected_ids); it has {sorted(row)}."
        ) from None
    p, c, r = (
        flat_ints(v, i, k)
        for v, k in ((prompt, "prompt_ids"), (chosen, "chosen_ids"), (rejected, "rejected_ids"))
    )
    ids = np.concatenate([p, c, p, r])
    mask = np.concatenate([np.zeros_like(p), np.ones_like(c), np.zeros_like(p), np.ones_like(r)])
    seq = np.array([p.size + c.size, p.size + r.size], np.int64)
    if seq.min() == 0:
        raise PackingError(f"row {i}: a pair with an empty sequence cannot be batched; drop it.")
    return ids, mask, seq


def _pair_values(row: Mapping[str, Any], i: int, key: str, n_pairs: int) -> np.ndarray:
    if key not in row or row[key] is None:
        raise PackingError(
            f"row {i} has no {key!r}; name it in pair_columns only if every row carries it (pack it with "
            f"pack_preference(..., columns=[{key!r}]))."
        )
    arr = np.asarray(row[key], np.float64 if np.asarray(row[key]).dtype.kind == "f" else None).reshape(-1)
    if arr.shape[0] != n_pairs:
        raise PackingError(
            f"row {i}: {key!r} has {arr.shape[0]} values for {n_pairs} pairs; give one per pair."
        )
    return arr


class PreferenceCollator:
    """Collate preference pairs, never splitting one (see the module docstring for both layouts).

    ``pair_columns`` names per-pair values to carry along (default: ``ref_chosen_logps`` and
    ``ref_rejected_logps`` when the first row has them).  Floats come back as float32 tensors.

    A padding-free batch also holds ``use_cache=False`` (``return_use_cache=False`` leaves it out), as
    :class:`~packtools.batches.PaddingFreeCollator`'s: with the cache Llama & co. default to, ``sdpa``/``eager``
    would let the packed sequences attend to each other under ``model(**batch)``.  TRL's layout
    (``padding_free=False``: one sequence per row, with ``attention_mask``) goes to TRL's own forward, which
    passes its own arguments, and does not hold it.

    >>> c = PreferenceCollator(pad_token_id=0, return_tensors="np")
    >>> b = c([{"input_ids": [1, 2, 1, 3, 3], "completion_mask": [0, 1, 0, 1, 1], "seq_lengths": [2, 3]}])
    >>> b["labels"].tolist(), b["cu_seq_lens_q"].tolist()
    ([[-100, 2, -100, 3, 3]], [0, 2, 5])
    >>> c.padding_free = False
    >>> t = c([{"prompt_ids": [1], "chosen_ids": [2], "rejected_ids": [3, 3]}])
    >>> t["input_ids"].tolist(), t["completion_mask"].tolist()
    ([[1, 2, 0], [1, 3, 3]], [[0, 1, 0], [0, 1, 1]])
    """

    def __init__(
        self,
        pad_token_id: int,
        pair_columns: Sequence[str] | None = None,
        padding_free: bool = True,
        return_tensors: str = "pt",
        return_use_cache: bool = True,
    ) -> None:
        self.pad_token_id, _ = check_pad_args(pad_token_id, None)
        self.return_use_cache = bool(return_use_cache)
        self.pair_columns = None if pair_columns is None else list(pair_columns)
        if return_tensors not in ("pt", "np"):
            raise PackingError(f"return_tensors must be 'pt' or 'np', got {return_tensors!r}.")
        self.padding_free = bool(padding_free)
        self.return_tensors = return_tensors

    def __repr__(self) -> str:
        return (
            f"PreferenceCollator(pad_token_id={self.pad_token_id}, pair_columns={self.pair_columns}, "
            f"padding_free={self.padding_free}, return_tensors={self.return_tensors!r}, "
            f"return_use_cache={self.return_use_cache})"
        )

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if isinstance(features, Mapping) or not isinstance(features, Sequence) or len(features) == 0:
            raise PackingError("features must be a non-empty list of rows.")
        rows = [_pair_row(row, i) for i, row in enumerate(features)]
        columns = self.pair_columns
        if columns is None:
            columns = [k for k in REF_COLUMNS if k in features[0]]
        extra = {
            key: np.concatenate(
                [_pair_values(f, i, key, r[2].shape[0] // 2) for i, (f, r) in enumerate(zip(features, rows))]
            )
            for key in columns
        }
        ids = np.concatenate([r[0] for r in rows])
        mask = np.concatenate([r[1] for r in rows])
        seq = np.concatenate([r[2] for r in rows])
        build = self._padding_free if self.padding_free else self._trl_layout
        out = build(ids, mask, seq)
        for key, values in extra.items():
            out[key] = values.astype(np.float32) if values.dtype.kind == "f" else values
        if self.padding_free and self.return_use_cache:
            out["use_cache"] = (
                False  # model(**batch) keeps the sequences apart (PaddingFreeCollator's docstring)
            )
        return to_tensors(out, self.return_tensors)

    def _padding_free(self, ids: np.ndarray, mask: np.ndarray, seq: np.ndarray) -> dict[str, Any]:
        """One row of every sequence, the batch ``PaddingFreeCollator`` makes of it, without ``seq_idx``."""
        flat = FlatRows(
            ids, labels_of(ids, None, [mask]), np.array([ids.shape[0]]), seq, np.array([seq.shape[0]])
        )
        batch = assemble_padding_free(flat, self.pad_token_id)
        del batch["seq_idx"]
        return batch

    def _trl_layout(self, ids: np.ndarray, mask: np.ndarray, seq: np.ndarray) -> dict[str, Any]:
        n = seq.shape[0]
        order = np.concatenate([np.arange(0, n, 2), np.arange(1, n, 2)])  # chosen sequences, then rejected
        starts = offsets_of(seq)[:-1]
        width = int(seq.max())
        lengths = seq[order]
        cols = np.arange(width)
        valid = cols[None, :] < lengths[:, None]
        src = (starts[order][:, None] + cols[None, :])[valid]
        input_ids = np.full((n, width), self.pad_token_id, np.int64)
        input_ids[valid] = ids[src]
        completion = np.zeros((n, width), np.int64)
        completion[valid] = mask[src]
        return {
            "input_ids": input_ids,
            "attention_mask": valid.astype(np.int64),
            "completion_mask": completion,
        }
