"""Prompt-shared rows as batches: the segments, positions and key/value gather the tree attention needs.

A prompt-shared row (:mod:`packtools.core.shared_pairs`) holds units ``[prefix][branch_1]...[branch_G]``.
Flattened, a batch is one row of *segments*: each unit's prefix (if not empty), then its branches.  A
segment's queries are its own tokens; its keys are the unit's prefix followed by its own tokens (a prefix
segment has only its own), causal with the queries aligned to the end of the keys (bottom-right).  So a
completion sees its prompt and the tokens before it in its own branch, never a sibling or another unit.

:class:`TreeLayout` carries this for the attention and for :func:`packtools.dpo.sequence_logps`;
:class:`TreeCollator` builds it from packed rows; :func:`unshared_index` maps the tree row back to
``prompt + completion`` sequences one after the other (what TRL's padded layout holds).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from .._optional import require
from ..compat.torch import in_backward
from ..core.pairs import PAIR_ROW_COLUMNS
from ..core.ragged import offsets_of
from ..errors import PackingError
from .flatten import restart_positions
from .labels import ignore_starts, labels_of

#: The keyword the model's forward passes down to the attention function.
TREE_KEY = "packtools_tree"
TREE_ROW_COLUMNS = (*PAIR_ROW_COLUMNS, "prompt_lengths")


def tree_segments(
    prompt_lengths: np.ndarray, group_sizes: np.ndarray, completion_lengths: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """``(segments, is_branch)``: per segment ``[q_start, q_len, prefix_start, prefix_len]`` in the flat row.

    >>> seg, branch = tree_segments(np.array([3]), np.array([2]), np.array([1, 2]))
    >>> seg.tolist(), branch.tolist()
    ([[0, 2, 0, 0], [2, 2, 0, 2], [4, 3, 0, 2]], [False, True, True])
    """
    p = np.asarray(prompt_lengths, np.int64)
    g = np.asarray(group_sizes, np.int64)
    c = np.asarray(completion_lengths, np.int64)
    if g.sum() != c.shape[0]:
        raise PackingError(f"group sizes sum to {int(g.sum())} but there are {c.shape[0]} completions.")
    prefix = np.maximum(p - 1, 0)
    head = (p > 0).astype(np.int64)
    unit = np.repeat(np.arange(p.shape[0]), g)
    branch_len = head[unit] + c
    # Segments in order: per unit, its prefix (dropped when empty), then its branches.
    counts = 1 + g
    n = int(counts.sum())
    first = offsets_of(counts)
    length = np.zeros(n, np.int64)
    length[first[:-1]] = prefix
    is_branch = np.ones(n, bool)
    is_branch[first[:-1]] = False
    length[is_branch] = branch_len
    seg_unit = np.repeat(np.arange(p.shape[0]), counts)
    start = offsets_of(length)[:-1]
    pre_start = start[first[:-1]][seg_unit]
    pre_len = np.where(is_branch, prefix[seg_unit], 0)
    seg = np.stack([start, length, pre_start, pre_len], 1)
    keep = length > 0
    return np.ascontiguousarray(seg[keep]), is_branch[keep]


def key_positions(segments: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(index, lengths)``: each segment's keys (its prefix, then its own tokens) as positions of the flat row,
    segment after segment, and how many keys each has."""
    q_start, q_len, pre_start, pre_len = segments.T
    lengths = pre_len + q_len
    which = np.repeat(np.arange(segments.shape[0]), lengths)
    j = restart_positions(lengths)
    index = np.where(j < pre_len[which], pre_start[which] + j, q_start[which] + j - pre_len[which])
    return index, lengths


def unshared_index(segments: np.ndarray, is_branch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(index, lengths)``: the flat-row positions of every branch's ``prompt + completion`` sequence.

    >>> seg, branch = tree_segments(np.array([3]), np.array([2]), np.array([1, 2]))
    >>> index, lengths = unshared_index(seg, branch)
    >>> index.tolist(), lengths.tolist()
    ([0, 1, 2, 3, 0, 1, 4, 5, 6], [4, 5])
    """
    return key_positions(segments[is_branch])


FIX_HINT = (
    "switch every model that runs this batch with packtools.integrations.attention.tree.use_tree_attention(model) "
    "(prepare_dpo_trainer does it for TRL)"
)


class TreeReads:
    """Forwards that ran a layout through the tree attention, and the outputs read from it since.

    Shared by a layout and its ``.to(device)`` copies.  The tree attention calls :meth:`consumed` once per
    layer; a forward is counted at its first attention layer (the lowest ``layer_idx`` seen, or every call
    of a layer without one).  A reader (:func:`packtools.dpo.sequence_logps`) calls :meth:`take`: each read of a
    new output needs a forward not yet read, so a model that ignored the tree (any other attention backend)
    cannot hand over its output unnoticed, while one model used twice (reference and policy) reads twice.
    Recomputation in the backward pass (gradient checkpointing) is not a forward.
    """

    __slots__ = ("forwards", "layers", "_low", "_read")

    def __init__(self) -> None:
        self.forwards = 0
        self.layers = 0
        self._low: int | None = None
        self._read: list[Any] = []

    def consumed(self, module: Any) -> None:
        torch = require("torch", "packtools tree attention")
        if in_backward(torch):  # recomputed inside backward (checkpointing)
            return
        self.layers += 1
        idx = getattr(module, "layer_idx", None)
        if not isinstance(idx, int):
            self.forwards += 1
        elif self._low is None or idx <= self._low:
            self._low = idx
            self.forwards += 1

    def take(self, output: Any, reader: str) -> None:
        """Account for ``reader`` reading ``output``; raise if no unread forward ran the tree attention."""
        where = _address(output)
        if where is not None and any(_address(ref()) == where for ref in self._read):
            return  # the same forward's output (or a view of it) read again
        if self.forwards <= 0:
            seen = (
                "no model ran this prompt-shared batch through the packtools_tree attention"
                if self.layers == 0
                else "this prompt-shared batch was read more often than a model ran it through the "
                "packtools_tree attention (one of the models that ran it is on another attention)"
            )
            raise PackingError(
                f"{reader}: {seen}; any other attention ignores the tree (a completion would lose its prompt or "
                f"see its sibling), so the result would be silently wrong. Fix: {FIX_HINT}.",
                param="packtools_tree",
            )
        self.forwards -= 1
        if where is not None:
            self._read.append(weakref.ref(output))  # alive: its storage's address is not reused


def _address(output: Any) -> Any:
    """The address of ``output``'s storage (a tensor), else None."""
    if output is None:
        return None
    try:
        return output.untyped_storage().data_ptr()
    except (AttributeError, RuntimeError):
        return None


@dataclass(frozen=True)
class TreeLayout:
    """One flat row's tree: host ``segments`` and ``is_branch``, device tensors for kernels and log-probs.

    ``cu_q``: int32 ``[S + 1]`` query segment boundaries (= ``cu_seq_lens`` of the flat row); ``cu_k``:
    int32 ``[S + 1]`` boundaries of the gathered keys; ``kv_index``: int64 positions of the flat row whose
    keys and values, gathered, form each segment's keys (its prefix, then itself); ``branches``: int64 index
    of the branch segments (one per completion, in order); ``group_sizes``: completions per unit (host).
    ``.to(device)`` moves the tensors (``Trainer`` and accelerate call it on batch values).
    """

    segments: np.ndarray
    is_branch: np.ndarray
    group_sizes: np.ndarray
    cu_q: Any
    cu_k: Any
    kv_index: Any
    branches: Any
    max_q: int
    max_k: int
    #: Bottom-right causal masks by (queries, prefix, device, dtype), built once for all layers of a forward.
    masks: dict = field(default_factory=dict, compare=False, repr=False)
    #: Forwards through the tree attention and reads since (shared with ``.to`` copies): :class:`TreeReads`.
    reads: TreeReads = field(default_factory=TreeReads, compare=False, repr=False)

    def mask(self, q_len: int, pre_len: int, device: Any, dtype: Any) -> Any:
        """Additive mask of a segment: query ``i`` sees the ``pre_len`` prefix keys and its own first ``i + 1``."""
        key = (q_len, pre_len, str(device), dtype)
        found = self.masks.get(key)
        if found is None:
            torch = require("torch", "packtools tree attention")
            rows = torch.arange(q_len, device=device)[:, None]
            cols = torch.arange(pre_len + q_len, device=device)[None, :]
            found = torch.zeros((q_len, pre_len + q_len), dtype=dtype, device=device)
            found.masked_fill_(cols > rows + pre_len, float("-inf"))
            self.masks[key] = found
        return found

    @classmethod
    def build(cls, segments: np.ndarray, is_branch: np.ndarray, group_sizes: np.ndarray) -> TreeLayout:
        torch = require("torch", "packtools tree batches")
        q_len = segments[:, 1]
        kv, k_len = key_positions(segments)
        cu_q = offsets_of(q_len)
        cu_k = offsets_of(k_len)
        return cls(
            segments=segments,
            is_branch=is_branch,
            group_sizes=np.asarray(group_sizes, np.int64),
            cu_q=torch.from_numpy(cu_q.astype(np.int32)),
            cu_k=torch.from_numpy(cu_k.astype(np.int32)),
            kv_index=torch.from_numpy(kv),
            branches=torch.from_numpy(np.flatnonzero(is_branch)),
            max_q=int(q_len.max()) if q_len.size else 0,
            max_k=int(k_len.max()) if k_len.size else 0,
        )

    @property
    def cu_seq_lens(self) -> Any:
        return self.cu_q

    @property
    def total(self) -> int:
        return int(self.segments[-1, 0] + self.segments[-1, 1]) if self.segments.size else 0

    def positions(self) -> np.ndarray:
        """Position ids of the flat row: ``prefix_len + 0, 1, ...`` on every segment."""
        q_len, pre_len = self.segments[:, 1], self.segments[:, 3]
        return restart_positions(q_len) + np.repeat(pre_len, q_len)

    def to(self, device: Any, *args: Any, **kwargs: Any) -> TreeLayout:
        return replace(
            self,
            cu_q=self.cu_q.to(device),
            cu_k=self.cu_k.to(device),
            kv_index=self.kv_index.to(device),
            branches=self.branches.to(device),
            masks={},
        )


def _ints(row: Mapping[str, Any], key: str, i: int) -> np.ndarray:
    if row.get(key) is None:
        raise PackingError(
            f"row {i} has no {key!r}: prompt-shared rows carry {list(TREE_ROW_COLUMNS)} (packtools."
            f"pack_preference(..., share_prompt=True) or pack_groups write them; keep them through "
            f"remove_unused_columns)."
        )
    return flat_ints(row[key], i, key)


def flat_ints(value: Any, row: int, key: str) -> np.ndarray:
    """Column ``key`` of row ``row`` as int64, refused unless a flat list of integers (or booleans)."""
    arr = np.asarray(value)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iub"):
        raise PackingError(
            f"row {row}: {key!r} must be a flat list of integers, got {arr.dtype} {arr.shape}."
        )
    return arr.astype(np.int64, copy=False)


def tree_row(row: Mapping[str, Any], i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(tokens, completion_mask, segments, is_branch)`` of one prompt-shared row, its sizes checked."""
    ids, mask = _ints(row, "input_ids", i), _ints(row, "completion_mask", i)
    seq, prompts = _ints(row, "seq_lengths", i), _ints(row, "prompt_lengths", i)
    groups = (
        _ints(row, "group_sizes", i) if row.get("group_sizes") is not None else np.full(prompts.shape[0], 2)
    )
    if groups.sum() != seq.shape[0] or (groups.size and groups.min() < 1):
        raise PackingError(
            f"row {i}: group_sizes {groups.tolist()[:8]} do not account for its {seq.shape[0]} sequences (a "
            f"pair row without group_sizes holds two per prompt)."
        )
    unit = np.repeat(np.arange(prompts.shape[0]), groups)
    completion = seq - prompts[unit]
    segments, is_branch = tree_segments(prompts, groups, completion)
    total = int(segments[-1, 0] + segments[-1, 1]) if segments.size else 0
    if (completion.size and completion.min() < 1) or total != ids.shape[0] or mask.shape != ids.shape:
        raise PackingError(
            f"row {i}: input_ids ({ids.shape[0]}), completion_mask ({mask.shape[0]}), seq_lengths and "
            f"prompt_lengths (a tree of {total} tokens) disagree; re-pack with share_prompt=True."
        )
    return ids, mask, segments, is_branch


def row_groups(row: Mapping[str, Any]) -> np.ndarray:
    n = len(row["prompt_lengths"])
    return np.asarray(row["group_sizes"], np.int64) if row.get("group_sizes") is not None else np.full(n, 2)


def concat_trees(parts: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]) -> tuple:
    """Rows side by side in one flat row: ``(ids, mask, segments, is_branch)``."""
    segments = np.concatenate([p[2] for p in parts])
    row_start = offsets_of([p[0].shape[0] for p in parts])[:-1]
    segments[:, [0, 2]] += np.repeat(row_start, [p[2].shape[0] for p in parts])[:, None]
    return (
        np.concatenate([p[0] for p in parts]),
        np.concatenate([p[1] for p in parts]),
        segments,
        np.concatenate([p[3] for p in parts]),
    )


class TreeCollator:
    """Prompt-shared rows to one flat row for the tree attention (torch tensors).

    Returns ``input_ids``, ``labels`` (completion tokens; -100 on prompts and at every segment start),
    ``position_ids`` (``[1, T]``), ``packtools_tree`` (a :class:`TreeLayout`: pass it to the model's forward,
    which hands it to the attention, and to :func:`packtools.dpo.sequence_logps` as ``cu_seq_lens``), each
    per-unit column of ``unit_columns`` as ``[n_units]`` and each per-completion column of
    ``completion_columns`` as ``[n_completions]`` (floats as float32), and ``use_cache=False``
    (``return_use_cache=False`` leaves it out), as every packtools collator whose batch goes to ``model(**batch)``:
    the tree attention builds its own mask, so a cache would let nothing attend across the tree, but it would
    be built and filled for nothing (and a model whose attention was not switched is refused by the tree key).
    """

    def __init__(
        self,
        unit_columns: Sequence[str] = (),
        completion_columns: Sequence[str] = (),
        *,
        return_use_cache: bool = True,
    ) -> None:
        self.unit_columns = list(unit_columns)
        self.completion_columns = list(completion_columns)
        self.return_use_cache = bool(return_use_cache)

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        torch = require("torch", "packtools.batches.tree.TreeCollator")
        if isinstance(features, Mapping) or not isinstance(features, Sequence) or not features:
            raise PackingError("features must be a non-empty list of prompt-shared rows.")
        parts = [tree_row(row, i) for i, row in enumerate(features)]
        groups = np.concatenate([row_groups(row) for row in features])
        ids, mask, segments, is_branch = concat_trees(parts)
        layout = TreeLayout.build(segments, is_branch, groups)
        labels = ignore_starts(labels_of(ids, None, [mask]), segments[:, 0])
        out: dict[str, Any] = {
            "input_ids": torch.from_numpy(ids)[None],
            "labels": torch.from_numpy(labels)[None],
            "position_ids": torch.from_numpy(layout.positions())[None],
            TREE_KEY: layout,
        }
        for key, want in [(k, groups.shape[0]) for k in self.unit_columns] + [
            (k, int(groups.sum())) for k in self.completion_columns
        ]:
            values = np.concatenate([np.asarray(f[key]).reshape(-1) for f in features])
            if values.shape[0] != want:
                raise PackingError(f"{key!r} has {values.shape[0]} values for {want} units/completions.")
            out[key] = torch.from_numpy(values.astype(np.float32) if values.dtype.kind == "f" else values)
        if self.return_use_cache:
            out["use_cache"] = False
        return out
