"""Every touch of ``accelerate`` internals by packtools, checked against :data:`CHECKED`.

* ``BatchSamplerShard`` (:func:`stop_sharding`): packtools' per-rank batch sampler already shards, so the
  shard accelerate wraps it in is told it is alone (``num_processes = 1``, ``process_index = 0``) and gets a
  ``set_epoch`` that reaches packtools' sampler (accelerate's ``DataLoaderShard.set_epoch`` forwards to its
  batch sampler only when that has one; ``Trainer`` also reaches it through ``SkipBatchSampler`` on resume).
  The shard belongs to the loader packtools' own ``get_train_dataloader`` builds, so nothing is left to undo.
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
