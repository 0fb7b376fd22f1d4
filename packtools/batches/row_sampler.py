"""Fixed-size batches of rows, the same number on every rank, each row once per epoch.

``DistributedSampler`` and accelerate's ``BatchSamplerShard`` (``even_batches=True``) give every rank the same
number of batches by repeating rows from the start of the epoch: with 41 packed rows, 2 rows per batch and 2
ranks, 3 rows are trained twice per epoch.  :class:`RowBatchSampler` never repeats a row: rows are shuffled
(deterministically from ``(seed, epoch)``), cut into batches of ``batch_size`` rows, and when the number of
batches is not a multiple of ``num_replicas`` the batches with the most rows are split in two until it is
(some batches then hold fewer rows; the loss, a token or pair mean over the whole step, is not changed by how
rows are spread over micro-batches).  Batch ``i`` goes to rank ``i % num_replicas``.  When even that cannot
work (``batch_size=1`` and a row count that is not a multiple of ``num_replicas``: no batch can be split),
the last ``dropped`` rows of the epoch's shuffle (fewer than ``num_replicas * batch_size``, different rows
every epoch) sit that epoch out; :attr:`dropped` says how many, and the trainer adapter warns.

A sampler with ``num_replicas > 1`` already shards: reading its ``batch_size``, as accelerate's
``BatchSamplerShard`` does when ``accelerator.prepare`` wraps its loader, raises (each rank would keep
``1/num_replicas`` of its own batches: half the rows of every epoch never trained at 2 processes, no error);
:attr:`rows_per_batch` holds the size.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from ..errors import PackingError
from .sampler import EpochHandle, _positive_int


class RowBatchSampler:
    """Batches of ``batch_size`` row indices for rank ``rank`` of ``num_replicas``; no row repeated.

    >>> two = [RowBatchSampler(5, 2, num_replicas=2, rank=r, shuffle=False) for r in (0, 1)]
    >>> [len(s) for s in two], sorted(i for s in two for b in s for i in b)
    ([2, 2], [0, 1, 2, 3, 4])
    """

    def __init__(
        self,
        num_rows: int,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int = 1,
        rank: int = 0,
    ) -> None:
        self.num_rows = _positive_int(num_rows, "num_rows", minimum=0)
        #: rows per batch (``batch_size`` reads it only where nothing would shard the batches again)
        self.rows_per_batch = _positive_int(batch_size, "batch_size")
        self.num_replicas = _positive_int(num_replicas, "num_replicas")
        self.rank = _positive_int(rank, "rank", minimum=0)
        if self.rank >= self.num_replicas:
            raise PackingError(f"rank={rank} must be < num_replicas={num_replicas}.", param="rank")
        self.kept = self._rows_kept()
        self.dropped = self.num_rows - self.kept
        self.shuffle = bool(shuffle)
        self.seed = _positive_int(seed, "seed", minimum=0)
        self.epoch = 0

    def _rows_kept(self) -> int:
        """The most rows (``<= num_rows``) that split into a multiple of ``num_replicas`` non-empty batches."""
        b, r = self.rows_per_batch, self.num_replicas
        for n in range(self.num_rows, -1, -1):
            batches = -(-n // b)
            if -(-batches // r) * r <= n:  # enough rows to split up to a multiple of r batches
                return n
        return 0

    @property
    def batch_size(self) -> int:
        """``rows_per_batch``.  With ``num_replicas > 1`` reading it raises: its readers are sharding wrappers
        (accelerate's ``BatchSamplerShard``), and sharding these per-rank batches again would keep
        ``1/num_replicas`` of each rank's batches."""
        if self.num_replicas > 1:
            raise PackingError(
                f"RowBatchSampler(num_replicas={self.num_replicas}) is already sharded across ranks and is being "
                f"wrapped by a sampler that shards again (accelerate's BatchSamplerShard, through "
                f"accelerator.prepare or Trainer): each rank would keep 1/{self.num_replicas} of its batches and "
                f"never train the rest. Under Trainer use packtools.prepare_trainer(trainer), whose loader shards "
                f"rows this way; in your own accelerate loop do not pass this DataLoader to accelerator.prepare "
                f"(move batches to the device yourself).",
                param="batch_sampler",
            )
        return self.rows_per_batch

    def set_epoch(self, epoch: int) -> None:
        """Use the shuffle of ``epoch`` (call on every rank before iterating)."""
        self.epoch = _positive_int(epoch, "epoch", minimum=0)

    @property
    def sampler(self) -> EpochHandle:
        """What accelerate's loader reaches under ``skip_first_batches`` to set the epoch (:class:`EpochHandle`)."""
        return EpochHandle(self)

    def batches(self) -> list[np.ndarray]:
        """Every rank's batches of this epoch, in order (batch ``i`` belongs to rank ``i % num_replicas``)."""
        rows = np.arange(self.num_rows, dtype=np.int64)
        if self.shuffle:
            rows = np.random.default_rng([self.seed, self.epoch]).permutation(rows)
        rows = rows[: self.kept]  # the shuffle's last `dropped` rows sit this epoch out
        b = self.rows_per_batch
        out = [rows[i : i + b] for i in range(0, self.kept, b)]
        while len(out) % self.num_replicas:
            i = max(range(len(out)), key=lambda j: (out[j].size, -j))
            half = (out[i].size + 1) // 2
            out[i : i + 1] = [out[i][:half], out[i][half:]]
        return out

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.batches()[self.rank :: self.num_replicas]:
            yield batch.tolist()

    def __len__(self) -> int:
        n = -(-self.kept // self.rows_per_batch)
        return -(-n // self.num_replicas)

    def __repr__(self) -> str:
        return (
            f"RowBatchSampler(rows={self.num_rows}, batch_size={self.rows_per_batch}, shuffle={self.shuffle}, "
            f"seed={self.seed}, epoch={self.epoch}, num_replicas={self.num_replicas}, rank={self.rank})"
        )
