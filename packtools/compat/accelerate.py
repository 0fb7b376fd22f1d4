"""Every touch of ``accelerate`` internals by packtools, checked against :data:`CHECKED`.

* ``BatchSamplerShard`` (:func:`stop_sharding`): packtools' per-rank batch sampler already shards, so the
  shard accelerate wraps it in is told it is alone (``num_processes = 1``, ``process_index = 0``) and gets a
  ``set_epoch`` that reaches packtools' sampler (accelerate's ``DataLoaderShard.set_epoch`` forwards to its
  batch sampler only when that has one; ``Trainer`` also reaches it through ``SkipBatchSampler`` on resume).
  The shard belongs to the loader packtools' own ``get_train_dataloader`` builds, so nothing is left to undo.
* ``BatchSamplerShard``'s even-out rows (:func:`batches_with_first_seen`): with ``even_batches=True`` (its
  default) it fills the last round of batches with rows from the start of the epoch, so every process gets as
  many full batches; those repeated rows come after every row of the epoch in the order the shard deals them
  out (what ``Accelerator.gather_for_metrics`` relies on to cut them), which tells each batch's repeated rows
  from its position alone.
* ``Accelerator.gather`` (:func:`replaced_gather`): an instance attribute over the method for the duration of
  a block, deleted again afterwards.

An object without the shape checked here raises :func:`~packtools.compat.unknown_shape`.

>>> from accelerate.data_loader import BatchSamplerShard
>>> from torch.utils.data import BatchSampler
>>> shard = BatchSamplerShard(BatchSampler(range(4), 1, False), num_processes=2, process_index=1)
>>> list(shard)
[[1], [3]]
>>> stop_sharding(shard, print)
>>> list(shard), shard.set_epoch(7)
7
([[0], [1], [2], [3]], None)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from . import unknown_shape, warn_unchecked

#: The ``accelerate`` versions whose shapes this module was checked against (lowest and newest CI runs).
CHECKED = "1.10.1 - 1.16.0"
warn_unchecked("accelerate", CHECKED)  # once per process, when the installed accelerate is outside it
_SHARD = ("batch_sampler", "num_processes", "process_index", "split_batches")


def stop_sharding(shard: Any, set_epoch: Callable[[int], None]) -> None:
    """Make accelerate's ``BatchSamplerShard`` yield every batch of its sampler and forward ``set_epoch``."""
    missing = [a for a in _SHARD if a not in getattr(shard, "__dict__", {})]
    if type(shard).__name__ != "BatchSamplerShard" or missing:
        raise unknown_shape(
            "accelerate",
            CHECKED,
            f"the training loader's batch sampler is a {type(shard).__name__}"
            + (f" without {missing}" if missing else "")
            + ", not the BatchSamplerShard packtools keeps from sharding its per-rank batches again",
        )
    shard.num_processes = 1
    shard.process_index = 0
    shard.set_epoch = set_epoch


@contextlib.contextmanager
def replaced_gather(accelerator: Any, gather: Callable[[Any], Any]) -> Iterator[None]:
    """Within the block, ``accelerator.gather`` is ``gather``; the method is back afterwards."""
    if not callable(getattr(type(accelerator), "gather", None)) or "gather" in vars(accelerator):
        raise unknown_shape(
            "accelerate", CHECKED, f"{type(accelerator).__name__}.gather is not a plain method"
        )
    accelerator.gather = gather
    try:
        yield
    finally:
        del accelerator.gather


def batches_with_first_seen(loader: Any) -> Iterator[tuple[list[int], int]] | None:
    """For each batch a prepared ``loader`` (accelerate's ``DataLoaderShard``) yields on this process, in order:
    its dataset indices and how many of them, from the start, are rows of the epoch not repeated; the rest repeat
    rows to even out the processes.  ``None`` when accelerate does not share the loader's batches among
    processes (one process: nothing is repeated).

    The shard deals batch ``i`` of its sampler to process ``i % num_processes`` (with ``split_batches``, slice
    ``process_index`` of every batch), so the ``p``-th row of this process's ``j``-th batch is row
    ``(j * num_processes + process_index) * b + p`` of the epoch's order, ``b`` rows per process and batch; the
    rows the shard adds past the end of that order are repeats.  The indices come from iterating the shard again,
    so its sampler must give the same order each time (``SequentialSampler``, ``Trainer``'s evaluation sampler).

    >>> from accelerate.data_loader import BatchSamplerShard
    >>> from torch.utils.data import BatchSampler, DataLoader
    >>> shard = BatchSamplerShard(BatchSampler(range(5), 2, False), num_processes=2, process_index=1)
    >>> list(batches_with_first_seen(DataLoader(range(5), batch_sampler=shard)))
    [([2, 3], 2), ([1, 2], 0)]
    """
    shard = getattr(loader, "batch_sampler", None)
    if type(shard).__name__ != "BatchSamplerShard":
        return None
    missing = [a for a in (*_SHARD, "batch_size") if a not in getattr(shard, "__dict__", {})]
    if missing or (shard.num_processes > 1 and not shard.batch_size):
        raise unknown_shape(
            "accelerate",
            CHECKED,
            "the loader's BatchSamplerShard "
            + (f"lacks {missing}" if missing else "has no batch_size (a batch sampler of its own)")
            + ", so the rows it repeats to even out the processes cannot be told apart",
        )
    if shard.num_processes <= 1:
        return None
    processes, rank = int(shard.num_processes), int(shard.process_index)
    per_process = int(shard.batch_size) // (processes if shard.split_batches else 1)
    total = (
        len(shard.batch_sampler.sampler) if hasattr(shard.batch_sampler, "sampler") else len(loader.dataset)
    )

    def batches() -> Iterator[tuple[list[int], int]]:
        for j, indices in enumerate(shard):
            start = (j * processes + rank) * per_process
            yield list(indices), max(0, min(len(indices), total - start))

    return batches()
