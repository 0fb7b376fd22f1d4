"""``prepare_trainer(trainer, context_parallel=N)``: a ``transformers.Trainer`` on context-parallel shards.

The pieces, each from its own module:

* the run's layout (:func:`~packtools.integrations.parallel.layout.rank_layout`): CP groups of ``N``
  consecutive processes, the data-parallel rank and size over the groups, this process's CP group created once
  (:meth:`~packtools.integrations.parallel.layout.RankLayout.with_cp_group`); the training loader shards over
  the DP group only, so the ``N`` ranks of a CP group read the same batch;
* the collator: the trainer's :class:`~packtools.PaddingFreeCollator` wrapped in
  :class:`~packtools.batches.context_parallel.ContextParallelCollator` given the layout, every row checked
  against the packing ``max_length`` before training (:func:`cp_collator`);
* the model: ``packtools_cp`` attention (:mod:`packtools.integrations.attention.context_parallel`), gathering over the group
  of the layout each shard carries;
* the step (:class:`~packtools.integrations.trainers.step.SFTStep`): the trainer's own ``compute_loss`` on the
  shard's targets, divided by the targets of the whole accumulation window over every rank (``Trainer``'s
  multiplication by the process count and DDP's gradient mean then cancel: CP peers' gradients are parts of one sum).

Evaluation and prediction are refused by name (when scheduled, at ``prepare_trainer``; when called, by the step
owner), with the reason and the fix of :data:`~packtools.integrations.trainers.step.NO_EVAL`.

accelerate's own context parallelism (``ParallelismConfig(cp_size>1)``) is refused by name: its
``maybe_context_parallel`` would cut packtools' shards again as one causal sequence.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from ...batches.context_parallel import ContextParallelCollator
from ...compat import set_attr
from ...constants import SEQ_LENGTHS
from ...core.cp_budget import check_rows_fit
from ...errors import PackingError
from ...io.manifest import read_manifest
from ..attention.context_parallel import use_cp_attention
from ..parallel.distributed import is_sharded
from ..parallel.layout import RankLayout
from .loader import list_lengths, seq_lengths_column
from .step import NO_EVAL, other_losses


def check_cp_trainer(trainer: Any, layout: RankLayout) -> None:
    """Refuse what packtools' CP under ``Trainer`` does not handle, by name (accelerate's own CP: refused by
    :func:`~packtools.integrations.parallel.layout.rank_layout`, which made ``layout``)."""
    if layout.tp_size > 1:
        raise PackingError(
            "context_parallel with tensor parallelism is not handled by packtools (CP groups are consecutive "
            "processes, TP groups would overlap them); use one of the two.",
            param="context_parallel",
        )
    if is_sharded(trainer):
        raise PackingError(
            "context_parallel with DeepSpeed or FSDP has not been run with packtools; use DDP (torchrun) with "
            "context_parallel, or context_parallel=None.",
            param="context_parallel",
        )
    strategy = getattr(trainer.args, "eval_strategy", "no")
    strategy = str(getattr(strategy, "value", strategy))
    if strategy != "no":
        why = f" (TrainingArguments(eval_strategy={strategy!r}) schedules it)"
        raise PackingError(NO_EVAL.format(what="evaluation") + why, param="eval_strategy")
    seen = getattr(trainer.args, "include_num_input_tokens_seen", "no")
    if seen not in ("no", False, None):
        raise PackingError(
            f"include_num_input_tokens_seen={seen!r} under context_parallel would count each rank's shard with its "
            f"CP padding as input tokens; set it to 'no' (the packed rows' token counts are in pack's summary).",
            param="include_num_input_tokens_seen",
        )
    if not getattr(trainer, "model_accepts_loss_kwargs", True):
        raise PackingError(
            f"context_parallel passes the CP shard's targets and the window's target count to the model's own "
            f"loss, but {type(trainer.model).__name__}'s forward takes no loss kwargs (num_items_in_batch); use "
            f"a *ForCausalLM model, or train without context_parallel.",
            param="context_parallel",
        )
    if not getattr(trainer.args, "average_tokens_across_devices", True):
        raise PackingError(
            "context_parallel with average_tokens_across_devices=False: each rank would divide by its own share "
            "of the row's targets; set it to True (the default).",
            param="average_tokens_across_devices",
        )
    other_loss = other_losses(trainer)  # these see the shard's targets as unshifted labels, or sum per shard
    if other_loss:
        raise PackingError(
            f"context_parallel hands each rank a shard with already-shifted targets, so "
            f"{'; '.join(other_loss)} would shift them again or sum per shard instead of per "
            f"row. Drop it (a compute_loss of your own is honoured), or train without context_parallel.",
            param="context_parallel",
        )
    collator = trainer.data_collator
    if not callable(getattr(collator, "replace", None)) or not getattr(collator, "padding_free", False):
        raise PackingError(
            f"context_parallel needs data_collator=packtools.PaddingFreeCollator(pad_token_id) (padding-free), "
            f"got {type(collator).__name__}: CP shards one padding-free row per batch.",
            param="data_collator",
        )


def packed_max_length(dataset: Any) -> int | None:
    """The ``max_length`` a ``datasets.Dataset`` was packed with: ``pack_dataset``'s
    (:func:`~packtools.integrations.data.datasets.packing_record`), else a ``pack_files`` folder's (its manifest, next
    to its Arrow files), else ``None``."""
    from ..data.datasets import packing_record

    record = packing_record(dataset)
    if record is not None:
        return record["max_length"]
    files = getattr(dataset, "cache_files", None) or []
    folders = {os.path.dirname(f["filename"]) for f in files if isinstance(f, dict) and "filename" in f}
    for folder in sorted(folders):
        config = (read_manifest(folder) or {}).get("config") or {}
        if isinstance(config.get("max_length"), int):
            return int(config["max_length"])
    return None


def cp_collator(trainer: Any, layout: RankLayout) -> ContextParallelCollator:
    """This rank's CP collator over the trainer's own.  When the train dataset's packing ``max_length`` is known
    (:func:`packed_max_length`: a ``pack_files`` folder's manifest, or ``pack_dataset``'s record), every row is
    held to it once padded for ``layout.cp_size`` -- checked now, all rows at once, before training: rows packed
    for this CP size (or a multiple of it) fit, others fit or are refused by row
    (:func:`~packtools.core.cp_budget.check_rows_fit`), never trained over ``max_length`` silently.  Packed rows
    whose ``max_length`` packtools cannot know are cut as they are, with a warning saying so."""
    dataset = getattr(trainer, "train_dataset", None)
    limit = packed_max_length(dataset)
    names = getattr(dataset, "column_names", None) or []
    packed = SEQ_LENGTHS in names and hasattr(dataset, "data")  # packed rows of a datasets.Dataset
    if limit is not None:
        if packed:
            check_rows_fit(seq_lengths_column(dataset), layout.cp_size, limit)
        elif "input_ids" in names:  # rows without seq_lengths (wrapped output): one sequence each
            check_rows_fit(list_lengths(dataset, "input_ids").reshape(-1, 1), layout.cp_size, limit)
    elif packed:
        warnings.warn(
            f"context_parallel={layout.cp_size}: the train dataset holds packed rows (seq_lengths) whose packing "
            f"max_length packtools cannot read (neither a pack_files folder nor pack_dataset output), so rows are "
            f"not checked against it once padded for CP: a row can grow by up to {2 * layout.cp_size - 1} tokens "
            f"per document. Pack with pack_dataset(..., context_parallel={layout.cp_size}).",
            stacklevel=4,
        )
    return ContextParallelCollator(trainer.data_collator, max_length=limit, layout=layout)


def prepare_context_parallel(trainer: Any, layout: RankLayout) -> RankLayout:
    """Check the trainer, create the layout's CP group, and install the CP collator and attention (recorded on the
    trainer); returns the layout holding its group (the step plan's)."""
    check_cp_trainer(trainer, layout)
    layout = layout.with_cp_group()
    set_attr(trainer, "data_collator", cp_collator(trainer, layout), owner=trainer)
    use_cp_attention(trainer.model, owner=trainer)
    return layout
