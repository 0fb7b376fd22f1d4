"""The training dataloader of a ``Trainer`` under data parallelism: per-rank batches, each row once per epoch.

:func:`train_loader` is the training loader the step owner's ``get_train_dataloader`` returns
(:mod:`packtools.integrations.trainers.step`).  Its batches come from a rank-aware batch sampler of packtools
(:func:`make_sampler`: a :class:`~packtools.batches.TokenBudgetBatchSampler` per rank with ``max_tokens=N``, else a
:class:`~packtools.batches.row_sampler.RowBatchSampler` of ``per_device_train_batch_size`` rows) that shards over
the **data-parallel** group only (:func:`~packtools.integrations.parallel.layout.rank_layout`), so tensor- and
context-parallel peers draw the same batches.

The loader still goes through ``accelerator.prepare`` (device placement, the data-loader state ``Trainer``
reads), but accelerate's ``BatchSamplerShard`` is made a pass-through (the sampler already shards) that forwards
``set_epoch``, also after ``skip_first_batches`` on resume: every epoch is a deterministic function of
``(seed, epoch)``, so a resumed run sees the batches the uninterrupted run would have (docs/training.md).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from ..._optional import is_instance, require
from ...batches.row_sampler import RowBatchSampler
from ...batches.sampler import TokenBudgetBatchSampler, _positive_int
from ...compat.accelerate import stop_sharding
from ...compat.datasets import dataset_table
from ...compat.transformers import training_collator, training_rows
from ...constants import SEQ_LENGTHS
from ...core.arrow import column_lengths
from ...errors import PackingError

PAIR_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")


class RankBatches:
    """A rank's batch sampler as ``Trainer`` sees it: no ``batch_size``, ``set_epoch`` forwarded.

    >>> from packtools.batches.row_sampler import RowBatchSampler
    >>> batches = RankBatches(RowBatchSampler(5, 2, shuffle=False, num_replicas=2, rank=1))
    >>> len(batches), list(batches)
    (2, [[1], [4]])
    """

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __iter__(self) -> Any:
        return iter(self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)


def list_lengths(dataset: Any, column: str) -> np.ndarray:
    """The lengths of list column ``column`` of a ``datasets.Dataset``, in its row order (after ``select``,
    ``shuffle``, ...)."""
    table, indices = dataset_table(dataset)
    lengths = column_lengths(table.column(column))
    return lengths if indices is None else lengths[indices]


def seq_lengths_column(dataset: Any) -> Any:
    """The ``seq_lengths`` column of a ``datasets.Dataset``, in its row order."""
    table, indices = dataset_table(dataset)
    column = table.column(SEQ_LENGTHS)
    return column if indices is None else column.take(indices)


def row_lengths_and_segments(dataset: Any) -> tuple[np.ndarray, Any]:
    """Per-row token counts and per-row segment lengths (or None) of a training dataset.

    Packed rows (``seq_lengths`` column), a :class:`~packtools.batches.PackedView`, TRL's tokenized preference pairs
    (``prompt_ids`` / ``chosen_ids`` / ``rejected_ids``: a pair is ``[prompt + chosen, prompt + rejected]``)
    or plain rows (``input_ids``).
    """
    pa = require("pyarrow", "packtools.integrations.trainers.loader")
    if hasattr(dataset, "plan") and hasattr(dataset, "seq_lengths"):  # PackedView
        return np.asarray(dataset.lengths, np.int64), dataset.seq_lengths
    names = list(getattr(dataset, "column_names", None) or [])
    if not hasattr(dataset, "data"):
        raise PackingError(
            f"token-budget batches need the row lengths of the training dataset; "
            f"{type(dataset).__name__} is neither a datasets.Dataset nor a packtools.batches.PackedView.",
            param="train_dataset",
        )
    if all(c in names for c in PAIR_COLUMNS) and "input_ids" not in names:
        p, c, r = (list_lengths(dataset, n).astype(np.int64) for n in PAIR_COLUMNS)
        segments = np.stack([p + c, p + r], axis=1).reshape(-1).astype(np.int32)
        offsets = np.arange(0, segments.shape[0] + 1, 2, dtype=np.int32)
        return 2 * p + c + r, pa.ListArray.from_arrays(pa.array(offsets), pa.array(segments))
    if "input_ids" not in names:
        raise PackingError(
            f"the training dataset has no input_ids column (has {names}); token-budget batches need row lengths.",
            param="train_dataset",
        )
    lengths = list_lengths(dataset, "input_ids").astype(np.int64)
    return lengths, seq_lengths_column(dataset) if SEQ_LENGTHS in names else None


def make_sampler(trainer: Any, dataset: Any, max_tokens: int | None, layout: Any) -> Any:
    """The rank's batch sampler for ``dataset``: token-budget batches with ``max_tokens``, else rows.

    ``layout`` (the run's :class:`~packtools.integrations.parallel.layout.RankLayout`, the step plan's) says
    which data-parallel shard this process reads: ``world`` and ``rank`` below are the data-parallel size and
    rank, not the process count and index.
    """
    args = trainer.args
    seed = args.data_seed if getattr(args, "data_seed", None) is not None else args.seed
    world, rank = layout.dp_size, layout.dp_rank
    if max_tokens is None:
        if len(dataset) < world:  # some rank would have no batch, and Trainer no length to train on
            raise PackingError(
                f"{len(dataset)} training row(s) cannot give each of {world} processes a batch without repeating "
                f"rows (a packed dataset holds few rows: each is up to max_length tokens); use more data, fewer "
                f"processes, or pack with a smaller max_length.",
                param="train_dataset",
            )
        sampler = RowBatchSampler(
            len(dataset), args.per_device_train_batch_size, seed=seed, num_replicas=world, rank=rank
        )
        _warn_left_out(
            sampler.dropped,
            rank,
            f"{len(dataset)} training rows in batches of {sampler.rows_per_batch} cannot give {world} processes "
            f"the same number of batches without repeating rows",
            f"Use a row count divisible by {world}, or max_tokens=N (token-budget batches split rows evenly).",
        )
        return sampler
    lengths, segments = row_lengths_and_segments(dataset)
    if int((lengths > 0).sum()) < world:
        raise PackingError(
            f"{int((lengths > 0).sum())} non-empty rows cannot give each of {world} processes a batch without "
            f"repeating rows; use more data or fewer processes.",
            param="train_dataset",
        )
    # repeat_rows=False: a row the batches cannot be evened out with sits the epoch out, as in RowBatchSampler;
    # repeated (the sampler's default, as DistributedSampler does) it trained twice per epoch with no warning
    sampler = TokenBudgetBatchSampler(
        lengths, max_tokens, seed=seed, num_replicas=world, rank=rank, seq_lengths=segments, repeat_rows=False
    )
    # the checkpoint's layout record says it (resume.run_layout): a packtools before repeat_rows=False repeated
    # these rows, in longer epochs whose saved step count must not be skipped in these
    trainer._packtools_rows_left_out = left_out = sampler.dropped
    _warn_left_out(
        left_out,
        rank,
        f"{int((lengths > 0).sum())} training rows in token-budget batches of max_tokens={max_tokens} cannot "
        f"give {world} processes the same number of batches without repeating rows (every batch holds one row)",
        f"Raise max_tokens so that batches hold several rows, or use a row count divisible by {world}.",
    )
    return sampler


def _warn_left_out(left_out: int, rank: int, why: str, fix: str) -> None:
    """Warn once (rank 0) that ``left_out`` rows of each epoch sit it out, because ``why``; ``fix``: what avoids it."""
    if left_out and rank == 0:
        warnings.warn(
            f"{why}: {left_out} row(s) of each epoch's shuffle (different ones every epoch) sit that epoch out. {fix}",
            stacklevel=5,
        )


def _passthrough(prepared: Any, ours: RankBatches) -> Any:
    """Make accelerate's ``BatchSamplerShard`` around ``ours`` yield every batch and forward ``set_epoch``."""
    shard = getattr(prepared, "batch_sampler", None)
    if shard is ours:
        return prepared
    if getattr(shard, "batch_sampler", None) is not ours:
        raise PackingError(
            f"accelerate wrapped packtools' training batch sampler in {type(shard).__name__}, which packtools "
            f"does not know how to keep from sharding it again; please report the accelerate version."
        )
    if getattr(shard, "split_batches", False):
        raise PackingError(
            "accelerator_config.split_batches=True cuts every batch into per-process slices, which would split "
            "packed rows and pairs across processes; packtools shards whole batches. Set split_batches=False.",
            param="split_batches",
        )
    # reached by Trainer through skip_first_batches' SkipBatchSampler too
    stop_sharding(shard, ours.set_epoch)
    return prepared


def is_stream(dataset: Any) -> bool:
    """Whether ``dataset`` is a stream (an ``IterableDataset``, or anything without a length)."""
    return (
        is_instance(dataset, "torch", "IterableDataset")
        or is_instance(dataset, "datasets", "IterableDataset")
        or not hasattr(dataset, "__len__")
    )


def check_stream(dataset: Any, world: int, max_tokens: int | None) -> None:
    """Refuse a streaming training dataset where packtools' per-rank loader is needed (several processes, or
    ``max_tokens``): a stream has no length, so no rank can be given the same number of batches with every row
    once; say what to do instead."""
    if dataset is None or not is_stream(dataset) or (max(world, 1) == 1 and max_tokens is None):
        return
    why = (
        f"under {world} processes"
        if max_tokens is None
        else f"with max_tokens={max_tokens} (token-budget batches)"
    )
    raise PackingError(
        f"the training dataset is a stream ({type(dataset).__name__}) {why}: a stream has no length, so "
        f"packtools cannot give every process the same number of batches with every row trained once (and "
        f"Trainer's own stream sharding repeats or drops rows to even them out). Pack it to a map-style dataset "
        f"first: datasets.Dataset.from_generator(lambda: iter(packed_stream)) (or packtools pack ... --out DIR "
        f"and datasets.load_from_disk(DIR)), then prepare_trainer; or train the stream in one process.",
        param="train_dataset",
    )


def check_sampling_strategy(args: Any, max_tokens: int | None) -> None:
    """Refuse a ``train_sampling_strategy`` other than ``"random"`` where packtools' loader replaces
    ``Trainer``'s sampler (several processes, or ``max_tokens``): its batches come from its own shuffle of
    ``(seed, epoch)``, so ``"sequential"``, ``"group_by_length"`` or ``"batch_rebalance"`` would be ignored."""
    strategy = getattr(args, "train_sampling_strategy", "random")
    if getattr(args, "group_by_length", False) is True:  # transformers before train_sampling_strategy
        strategy = "group_by_length"
    if strategy in (None, "random"):
        return
    where = (
        f"max_tokens={max_tokens} (token-budget batches)"
        if max_tokens is not None
        else f"{args.world_size} processes"
    )
    raise PackingError(
        f"train_sampling_strategy={strategy!r} with {where}: packtools' loader replaces Trainer's sampler here "
        f"(every process the same number of batches, each row once), and it draws its batches from its own "
        f"shuffle of (seed, epoch), so {strategy!r} would be ignored. Leave train_sampling_strategy at 'random' "
        f"(packed rows are already near one length; max_tokens batches rows by their token counts), or train "
        f"in one process without max_tokens, where Trainer's own sampler is kept.",
        param="train_sampling_strategy",
    )


def check_train_loader(trainer: Any, max_tokens: int | None) -> None:
    """Refuse, before training, what :func:`train_loader` cannot serve: a ``max_tokens`` that is not a positive
    int, a streaming dataset under several processes or a token budget; warn that ``dataloader_drop_last`` is
    not applied there (the user asked for rows to be dropped; every row is trained instead)."""
    if max_tokens is not None:
        _positive_int(max_tokens, "max_tokens")
    check_stream(trainer.train_dataset, int(trainer.args.world_size), max_tokens)
    if max_tokens is not None or max(int(trainer.args.world_size), 1) > 1:
        check_sampling_strategy(trainer.args, max_tokens)
        if getattr(trainer.args, "dataloader_drop_last", False):
            warnings.warn(
                "dataloader_drop_last=True is not applied by packtools' training loader (max_tokens or several "
                "processes): it trains every row once per epoch, evening out the processes by splitting batches, "
                "so no last batch is dropped. Set dataloader_drop_last=False to silence this.",
                stacklevel=3,
            )


def train_loader(trainer: Any, max_tokens: int | None, layout: Any, default: Any) -> Any:
    """The training loader of ``trainer`` (see the module docstring); called by the step owner's
    ``get_train_dataloader`` (:mod:`packtools.integrations.trainers.step`).

    Without ``max_tokens`` and with one process, ``Trainer``'s own loader (``default()``) is kept (it repeats
    nothing; a token-budget sampler sharded again by accelerate refuses in its ``batch_size``).  ``layout``: the run's
    :class:`~packtools.integrations.parallel.layout.RankLayout` (the sampler shards over its DP group).
    """
    if max_tokens is None and max(int(trainer.args.world_size), 1) == 1:
        return default()
    torch = require("torch", "packtools.prepare_trainer(max_tokens=...)")
    if trainer.train_dataset is None:
        raise ValueError("Trainer: training requires a train_dataset.")
    dataset, collator = trainer.train_dataset, trainer.data_collator
    check_stream(dataset, int(trainer.args.world_size), max_tokens)
    if hasattr(dataset, "column_names") and hasattr(dataset, "remove_columns"):
        dataset = training_rows(trainer, dataset)
    else:
        collator = training_collator(trainer, collator)
    ours = RankBatches(make_sampler(trainer, dataset, max_tokens, layout))
    args = trainer.args
    params: dict[str, Any] = {
        "batch_sampler": ours,
        "collate_fn": collator,
        "num_workers": args.dataloader_num_workers,
        "pin_memory": args.dataloader_pin_memory,
    }
    if args.dataloader_num_workers > 0:
        params["persistent_workers"] = args.dataloader_persistent_workers
        params["prefetch_factor"] = args.dataloader_prefetch_factor
    loader = torch.utils.data.DataLoader(dataset, **params)
    return _passthrough(trainer.accelerator.prepare(loader), ours)
