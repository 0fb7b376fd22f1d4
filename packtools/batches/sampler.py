"""Token-budget batching: batches of rows holding at most ``max_tokens`` tokens, balanced across ranks.

Pure NumPy (plus the Numba best-fit-decreasing kernel); it works as
``torch.utils.data.DataLoader(dataset, batch_sampler=...)``.  An epoch is built deterministically from
``(seed, epoch)``:

1. Rows are shuffled, then grouped into batches with best-fit decreasing on their token counts (the kernel that
   packs sequences), so batches are as full as possible; the batch structure depends only on the multiset of
   lengths, so the number of batches is the same every epoch.
2. The number of batches is made a multiple of ``num_replicas``: the biggest batches are split in two (rows
   are repeated, as ``DistributedSampler`` does, only once every batch is one row; with ``repeat_rows=False``
   those rows sit the epoch out instead, different ones every epoch), or with ``drop_last`` the smallest are
   dropped.
3. Batches are sorted by attention cost (sum of squared sequence lengths, per packed segment when
   ``seq_lengths`` is given) and cut into *steps* of ``num_replicas`` batches, so the ranks of a step get
   similar work; inside a step, batches go to ranks longest-processing-time first on the running totals,
   which balances the epoch totals too.  Steps are then shuffled.

:meth:`TokenBudgetBatchSampler.imbalance` reports what was reached.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from .._lazy import lazy_module
from ..core.arrow import check_row_counts, read_list_column
from ..core.plan import as_lengths
from ..errors import EmptyRowsWarning, PackingError, empty_rows_message
from .buckets import bucket_padding, check_buckets, choose_buckets

if TYPE_CHECKING:
    from ..core import kernels
else:  # Numba is imported when a kernel first runs
    kernels = lazy_module("packtools.core.kernels")


def _positive_int(value: object, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise PackingError(f"{name} must be an int >= {minimum}, got {value!r}.")
    return int(value)


class EpochHandle:
    """The ``sampler`` of a packtools batch sampler: only ``set_epoch``, forwarded to that batch sampler.

    accelerate's ``skip_first_batches`` (how a training loop resumes mid-epoch) wraps the loader's batch sampler
    in its ``SkipBatchSampler``, and its loader's ``set_epoch(epoch)`` then reaches the batch sampler only as
    ``batch_sampler.batch_sampler.sampler.set_epoch`` (a torch ``BatchSampler``'s index sampler).  Without a
    ``sampler`` the resumed epoch silently kept the shuffle of the epoch set before (epoch 0 in a new process):
    rows of the checkpoint's epoch trained twice, others not at all.

    >>> s = TokenBudgetBatchSampler([3, 2, 2, 1], max_tokens=4)
    >>> s.sampler.set_epoch(3); s.epoch
    3
    """

    def __init__(self, owner: Any) -> None:
        self.owner = owner

    def set_epoch(self, epoch: int) -> None:
        self.owner.set_epoch(epoch)


def attention_costs(lengths: np.ndarray, seq_lengths: Any = None) -> np.ndarray:
    """Per-row attention cost: the sum of squared sequence lengths (``length**2`` for an unpacked row).

    ``seq_lengths`` is per-row segment lengths: a pyarrow list column (read from its buffers) or a sequence of
    per-row sequences; each row's entries must sum to its length.

    >>> attention_costs(np.array([4, 3]), [[2, 2], [3]]).tolist()
    [8.0, 9.0]
    """
    if seq_lengths is None:
        return lengths.astype(np.float64) ** 2
    if isinstance(seq_lengths, (pa.Array, pa.ChunkedArray)):
        col = read_list_column(seq_lengths, "seq_lengths")
        sums_arr = col.row_sums(np.float64)
        cost = col.row_sums(np.float64, squared=True)
    else:
        rows = [np.asarray(s, np.float64).reshape(-1) for s in seq_lengths]
        sums_arr = np.array([r.sum() for r in rows])
        cost = np.array([(r * r).sum() for r in rows])
    if sums_arr.shape[0] != lengths.shape[0]:
        raise PackingError(
            f"seq_lengths has {sums_arr.shape[0]} rows but lengths has {lengths.shape[0]}; give one entry per row."
        )
    fix = "pass the seq_lengths column of the same rows, in the same order."
    check_row_counts(sums_arr, lengths, "seq_lengths sum to {}", "lengths[{row}] = {}", fix)
    return cost


def _split_in_two(rows: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Split a batch of >= 2 rows into two with nearly equal tokens (greedy, longest first)."""
    order = rows[np.argsort(-lengths[rows], kind="stable")]
    a: list[int] = []
    b: list[int] = []
    ta = tb = 0
    for r in order:
        if ta <= tb:
            a.append(int(r))
            ta += int(lengths[r])
        else:
            b.append(int(r))
            tb += int(lengths[r])
    return np.array(a, np.int64), np.array(b, np.int64)


class TokenBudgetBatchSampler:
    """Yield lists of row indices holding at most ``max_tokens`` tokens each, balanced across replicas.

    ``lengths`` are the rows' token counts (e.g. ``PackedRows.lengths`` or ``ds["input_ids"]`` lengths).
    A row longer than ``max_tokens`` is an error (it would break the memory budget the batch size stands
    for): raise ``max_tokens`` or pack with ``max_length <= max_tokens``.  Rows with no tokens are never
    yielded.  With ``num_replicas > 1`` each rank yields the same number of batches; pass the rank's
    ``rank`` and call :meth:`set_epoch` every epoch on every rank.  Where the batch count cannot be evened out
    by splitting batches (every batch down to one row), rows are repeated, as ``DistributedSampler`` does;
    ``repeat_rows=False`` leaves them out of the epoch instead (drawn from the epoch's shuffle, so other rows
    every epoch; :attr:`dropped` counts them): a repeated row weighs twice in the gradient.

    Static shapes: ``buckets=K`` picks at most ``K`` batch sizes in tokens (:attr:`buckets`) that cost the least
    padding on epoch 0's batches, with ``max_tokens`` (rounded up to ``bucket_multiple_of``) the largest, so
    every epoch's batches fit; ``buckets=[...]`` gives them.  Pass them to
    ``PaddingFreeCollator(pad_to_buckets=sampler.buckets)``; :meth:`padding_share` says what they cost.

    >>> s = TokenBudgetBatchSampler([3, 5, 2, 4, 6], max_tokens=8, shuffle=False)
    >>> len(s), sorted(sorted(b) for b in s)
    (3, [[0, 1], [2, 4], [3]])
    >>> two = [TokenBudgetBatchSampler([3, 5, 2, 4, 6], 8, num_replicas=2, rank=r) for r in (0, 1)]
    >>> [len(x) for x in two], sorted(i for x in two for b in x for i in b)
    ([2, 2], [0, 1, 2, 3, 4])
    """

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        max_tokens: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        num_replicas: int = 1,
        rank: int = 0,
        seq_lengths: Any = None,
        buckets: int | Sequence[int] | None = None,
        bucket_multiple_of: int = 1,
        repeat_rows: bool = True,
    ) -> None:
        self.lengths = as_lengths(lengths)
        self.max_tokens = _positive_int(max_tokens, "max_tokens")
        self.num_replicas = _positive_int(num_replicas, "num_replicas")
        self.rank = _positive_int(rank, "rank", minimum=0)
        if self.rank >= self.num_replicas:
            raise PackingError(f"rank={rank} must be < num_replicas={num_replicas}.")
        self.seed = _positive_int(seed, "seed", minimum=0)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.repeat_rows = bool(repeat_rows)
        self._warned_repeats = False
        too_long = np.flatnonzero(self.lengths > self.max_tokens)
        if too_long.size:
            i = int(too_long[0])
            raise PackingError(
                f"row {i} has {int(self.lengths[i])} tokens, more than max_tokens={self.max_tokens} "
                f"({too_long.size} rows do); raise max_tokens to at least {int(self.lengths.max())} or pack "
                f"with max_length <= max_tokens."
            )
        #: rows of no token: no batch holds them (nothing to train), said once here
        self.num_empty = int(np.count_nonzero(self.lengths == 0))
        if self.num_empty:
            warnings.warn(
                empty_rows_message(
                    self.num_empty, len(self.lengths), "TokenBudgetBatchSampler", "no batch holds them"
                ),
                EmptyRowsWarning,
                stacklevel=2,
            )
        self.costs = attention_costs(self.lengths, seq_lengths)
        self.epoch = 0
        self._cache: tuple[int, list[list[np.ndarray]]] | None = None
        self.buckets = self._choose_buckets(buckets, bucket_multiple_of)

    def _choose_buckets(
        self, buckets: int | Sequence[int] | None, multiple_of: int
    ) -> tuple[int, ...] | None:
        """Bucket sizes: given, or ``K`` chosen from epoch 0's batch totals with ``max_tokens`` on top."""
        if buckets is None:
            return None
        if isinstance(buckets, (int, np.integer)) and not isinstance(buckets, bool):
            k = _positive_int(buckets, "buckets")
            top = -(-self.max_tokens // _positive_int(multiple_of, "bucket_multiple_of")) * int(multiple_of)
            return choose_buckets(self.batch_tokens(0), k, multiple_of=int(multiple_of), top=top)
        sizes = check_buckets(buckets)
        if sizes[-1] < self.max_tokens:
            raise PackingError(
                f"the largest bucket ({sizes[-1]}) is smaller than max_tokens={self.max_tokens}, so a full batch "
                f"would not fit; add a bucket of at least {self.max_tokens} tokens, or pass buckets=K to choose them.",
                param="buckets",
            )
        return sizes

    @property
    def batch_size(self) -> None:
        """``None`` (batches vary in rows).  With ``num_replicas > 1`` reading it raises: the readers of a batch
        sampler's ``batch_size`` are sharding wrappers (accelerate's ``BatchSamplerShard``), and sharding an
        already sharded sampler again would keep ``1/num_replicas`` of each rank's batches."""
        if self.num_replicas > 1:
            raise PackingError(
                f"TokenBudgetBatchSampler(num_replicas={self.num_replicas}) is already sharded across ranks and "
                f"is being wrapped by a sampler that shards again (accelerate's BatchSamplerShard, through "
                f"accelerator.prepare or Trainer): each rank would keep 1/{self.num_replicas} of its batches. "
                f"Under Trainer use packtools.prepare_trainer(trainer, max_tokens=N) (or prepare_dpo_trainer(..., "
                f"max_tokens=N)); in your own loop do not pass this DataLoader to accelerator.prepare.",
                param="batch_sampler",
            )
        return None

    def batch_tokens(self, epoch: int | None = None) -> np.ndarray:
        """Tokens in each batch of ``epoch`` (default: the current one), all ranks, in step order."""
        saved = self.epoch
        self.epoch = self.epoch if epoch is None else _positive_int(epoch, "epoch", minimum=0)
        try:
            steps = self._plan()
        finally:
            self.epoch = saved
        return np.array([int(self.lengths[b].sum()) for step in steps for b in step if b.size], np.int64)

    def padding_share(self) -> float:
        """Share of padding when this epoch's batches are rounded up to :attr:`buckets` (0.0 without buckets)."""
        if self.buckets is None:
            return 0.0
        return bucket_padding(self.batch_tokens(), self.buckets)

    def set_epoch(self, epoch: int) -> None:
        """Use the shuffle of ``epoch`` (call on every rank before iterating)."""
        self.epoch = _positive_int(epoch, "epoch", minimum=0)

    @property
    def sampler(self) -> EpochHandle:
        """What accelerate's loader reaches under ``skip_first_batches`` to set the epoch (:class:`EpochHandle`)."""
        return EpochHandle(self)

    @property
    def dropped(self) -> int:
        """Rows with tokens that no rank's batch holds in this epoch (``drop_last``, or ``repeat_rows=False``
        where the batches could not be evened out); the same count every epoch, other rows."""
        held = np.concatenate([b for step in self._plan() for b in step] or [np.zeros(0, np.int64)])
        return int(np.count_nonzero(self.lengths > 0)) - int(
            np.unique(held).size
        )  # (a repeated row counts once)

    # -- planning --------------------------------------------------------------------------------
    def _batches(self, rng: np.random.Generator) -> list[np.ndarray]:
        rows = np.flatnonzero(self.lengths > 0)
        if self.shuffle:
            rows = rng.permutation(rows)
        if rows.size == 0:
            return []
        sizes = np.ascontiguousarray(self.lengths[rows])
        item_order, offsets = kernels.bfd_assign(sizes, self.max_tokens)
        ordered = rows[item_order]
        return [ordered[offsets[b] : offsets[b + 1]] for b in range(offsets.shape[0] - 1)]

    def _even_out(self, batches: list[np.ndarray], rng: np.random.Generator) -> list[np.ndarray]:
        r = self.num_replicas
        extra = len(batches) % r
        if extra == 0:
            return batches
        tokens = np.array([self.lengths[b].sum() for b in batches])
        if self.drop_last:
            keep = np.sort(np.argsort(-tokens, kind="stable")[: len(batches) - extra])
            return [batches[i] for i in keep]
        need = r - extra
        batches = list(batches)
        while need:
            splittable = [i for i, b in enumerate(batches) if b.size >= 2]
            if not splittable:
                break
            i = max(splittable, key=lambda j: (int(self.lengths[batches[j]].sum()), -j))
            first, second = _split_in_two(batches[i], self.lengths)
            batches[i] = first
            batches.append(second)
            need -= 1
        if need and not self.repeat_rows:
            # every batch is one row: the r - need rows over a multiple of r sit this epoch out, drawn from the
            # epoch's generator (other rows every epoch); nothing is repeated
            out = set(rng.choice(len(batches), size=r - need, replace=False).tolist())
            return [b for i, b in enumerate(batches) if i not in out]
        # every batch is one row: repeat batches, as DistributedSampler repeats samples
        if need and self.rank == 0 and not self._warned_repeats:
            self._warned_repeats = True
            warnings.warn(
                f"TokenBudgetBatchSampler: {need} row(s) of each epoch are repeated to give {r} replicas the same "
                f"number of batches (every batch holds one row, so none can be split): those rows train twice per "
                f"epoch. Pass repeat_rows=False (they sit the epoch out, other rows every epoch) or drop_last=True, "
                f"raise max_tokens so that batches hold several rows, or use a row count divisible by {r}.",
                stacklevel=3,
            )
        return batches + [batches[k % len(batches)] for k in range(need)]

    def _plan(self) -> list[list[np.ndarray]]:
        """Per step, the batch of each rank (computed once per epoch, identical on every rank)."""
        if self._cache is not None and self._cache[0] == self.epoch:
            return self._cache[1]
        rng = np.random.default_rng([self.seed, self.epoch])
        batches = self._even_out(self._batches(rng), rng)
        r = self.num_replicas
        tokens = np.array([self.lengths[b].sum() for b in batches], np.float64)
        costs = np.array([self.costs[b].sum() for b in batches], np.float64)
        # Similar batches share a step: sort by cost (then tokens), cut into groups of r.
        order = np.lexsort((-tokens, -costs))
        weight = costs / max(costs.mean(), 1.0) + tokens / max(tokens.mean(), 1.0) if batches else costs
        load = np.zeros(r)
        steps: list[list[np.ndarray]] = []
        for s in range(0, len(order), r):
            group = order[s : s + r]
            group = group[np.argsort(-weight[group], kind="stable")]
            ranks = np.argsort(load, kind="stable")
            step: list[np.ndarray] = [np.zeros(0, np.int64)] * r
            for g, k in zip(group, ranks):
                step[k] = batches[g]
                load[k] += weight[g]
            steps.append(step)
        if self.shuffle:
            steps = [steps[i] for i in rng.permutation(len(steps))]
        self._cache = (self.epoch, steps)
        return steps

    # -- sampler protocol ------------------------------------------------------------------------
    def __iter__(self) -> Iterator[list[int]]:
        for step in self._plan():
            yield step[self.rank].tolist()

    def __len__(self) -> int:
        return len(self._plan())

    def imbalance(self) -> dict[str, float]:
        """How uneven the work of this epoch is across ranks, and how full batches are.

        ``tokens`` / ``cost``: the busiest rank's epoch total over the mean rank's, minus 1 (0 = perfect).
        ``step_tokens`` / ``step_cost``: the same ratio per step (what synchronous ranks wait on), averaged.
        ``fill``: tokens yielded / (batches * max_tokens).
        """
        steps = self._plan()
        if not steps:
            return {"tokens": 0.0, "cost": 0.0, "step_tokens": 0.0, "step_cost": 0.0, "fill": 1.0}
        tok = np.array([[self.lengths[b].sum() for b in step] for step in steps], np.float64)
        cost = np.array([[self.costs[b].sum() for b in step] for step in steps], np.float64)

        def ratio(x: np.ndarray, axis: int) -> np.ndarray:
            mean = x.mean(axis=axis)
            return np.where(mean > 0, x.max(axis=axis) / np.where(mean > 0, mean, 1.0) - 1.0, 0.0)

        return {
            "tokens": float(ratio(tok.sum(axis=0), 0)),
            "cost": float(ratio(cost.sum(axis=0), 0)),
            "step_tokens": float(ratio(tok, 1).mean()),
            "step_cost": float(ratio(cost, 1).mean()),
            "fill": float(tok.sum() / (tok.size * self.max_tokens)),
        }

    def __repr__(self) -> str:
        return (
            f"TokenBudgetBatchSampler(rows={self.lengths.shape[0]}, max_tokens={self.max_tokens}, "
            f"shuffle={self.shuffle}, seed={self.seed}, epoch={self.epoch}, drop_last={self.drop_last}, "
            f"num_replicas={self.num_replicas}, rank={self.rank})"
        )
