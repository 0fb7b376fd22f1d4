"""``prepare_trainer(trainer, context_parallel=N)``: a ``transformers.Trainer`` on context-parallel shards.

The pieces, each from its own module:

* the run's layout (:func:`~packtools.integrations.parallel_layout.rank_layout`): CP groups of ``N``
  consecutive processes, the data-parallel rank and size over the groups; the training loader shards over
  the DP group only, so the ``N`` ranks of a CP group read the same batch;
* the collator: the trainer's :class:`~packtools.PaddingFreeCollator` wrapped in
  :class:`~packtools.batches.context_parallel.ContextParallelCollator` (this rank's share of every batch),
  holding the rows of a ``pack_files`` folder or of ``pack_dataset`` output to their ``max_length`` once padded,
  every row checked before training (:func:`cp_collator`);
* the model: ``packtools_cp`` attention (:mod:`packtools.integrations.cp_attention`) over this process's CP
  group (created here with ``torch.distributed.new_group``, every rank creating every group in order);
* the loss: ``compute_loss`` is the summed next-token loss of the shard on its ``shift_labels`` (no second
  shift) divided by the targets of the whole accumulation window over every rank (counted when ``Trainer``
  fetches the window's micro-batches), times what ``Trainer`` and DDP divide by again (the accumulation
  steps when ``Trainer`` divides, read from its own predicate; the process count, DDP's gradient mean over
  every process: CP peers' gradients are parts of one sum).

Evaluation is refused by name (when scheduled, at ``prepare_trainer``; when called, in
``get_eval_dataloader``): ``Trainer``'s evaluation loader shards rows over every process, so the ranks of a CP
group would hold different rows while ``packtools_cp`` gathers their keys as one row's, and its metric gather
drops "duplicates" by position.  Evaluate in a run without ``context_parallel`` (the same weights, exact:
:func:`packtools.integrations.evaluation.token_mean_loss`).

accelerate's own context parallelism (``ParallelismConfig(cp_size>1)``) is refused by name: its
``maybe_context_parallel`` would cut packtools' shards again as one causal sequence.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any

from .._optional import require
from ..batches.context_parallel import ContextParallelCollator
from ..constants import SEQ_LENGTHS
from ..core.cp_budget import check_rows_fit
from ..errors import PackingError
from ..io.manifest import read_manifest
from .compat import set_attr
from .compat.trl import wrap_method
from .cp_attention import use_cp_attention
from .cp_training import global_count, model_inputs, shifted_token_loss
from .distributed import trainer_divides_by_accumulation
from .parallel_layout import RankLayout


@dataclass
class _WindowTargets:
    """The targets of the accumulation window being run, over every process."""

    targets: int | None = None


def cp_group(layout: RankLayout) -> Any:
    """This process's CP group: ranks ``[dp_rank * N, (dp_rank + 1) * N)`` (``None`` with one process)."""
    torch = require("torch", "packtools context parallelism")
    dist = torch.distributed
    if layout.world == 1:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        raise PackingError(
            f"context_parallel={layout.cp_size} over {layout.world} processes needs torch.distributed "
            f"initialized (launch with torchrun / accelerate launch).",
            param="context_parallel",
        )
    mine = None
    for dp in range(layout.dp_size):
        ranks = list(range(dp * layout.cp_size, (dp + 1) * layout.cp_size))
        group = dist.new_group(ranks)
        if dp == layout.dp_rank:
            mine = group
    return mine


NO_EVAL = (
    "evaluation under context_parallel is not handled by packtools: Trainer's evaluation loader gives the ranks "
    "of a CP group different rows, which packtools_cp would attend across as one row. Evaluate without "
    "context_parallel (eval_strategy='no' here; the saved model in a one-process or data-parallel run, e.g. "
    "packtools.integrations.evaluation.token_mean_loss)"
)


def check_cp_trainer(trainer: Any, layout: RankLayout) -> None:
    """Refuse what packtools' CP under ``Trainer`` does not handle, by name."""
    config = getattr(getattr(trainer, "accelerator", None), "parallelism_config", None)
    if config is not None and (getattr(config, "cp_size", 1) or 1) > 1:
        raise PackingError(
            f"ParallelismConfig(cp_size={config.cp_size}) turns on accelerate's own context parallelism, which "
            f"would cut packtools' per-document shards again as one causal sequence. Set cp_size=1 and pass "
            f"prepare_trainer(trainer, context_parallel={config.cp_size}).",
            param="parallelism_config",
        )
    if layout.tp_size > 1:
        raise PackingError(
            "context_parallel with tensor parallelism is not handled by packtools (CP groups are consecutive "
            "processes, TP groups would overlap them); use one of the two.",
            param="context_parallel",
        )
    if getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "is_fsdp_enabled", False):
        raise PackingError(
            "context_parallel with DeepSpeed or FSDP has not been run with packtools; use DDP (torchrun) with "
            "context_parallel, or context_parallel=None.",
            param="context_parallel",
        )
    strategy = getattr(trainer.args, "eval_strategy", "no")
    strategy = str(getattr(strategy, "value", strategy))
    if strategy != "no":
        why = f" (TrainingArguments(eval_strategy={strategy!r}) schedules it)"
        raise PackingError(NO_EVAL + why, param="eval_strategy")
    from .sft import causal_lm_loss

    config = getattr(getattr(trainer.model, "config", None), "get_text_config", lambda: None)()
    other_loss = [  # the CP loss is the shards' token loss: anything else in the loss would be dropped
        "label_smoothing_factor > 0 (Trainer's label smoother)" if trainer.label_smoother is not None else "",
        "a compute_loss_func of your own" if trainer.compute_loss_func not in (None, causal_lm_loss) else "",
        "a MoE router loss (output_router_logits with router_aux_loss_coef)"
        if getattr(config, "output_router_logits", False) and getattr(config, "router_aux_loss_coef", 0)
        else "",
    ]
    if any(other_loss):
        raise PackingError(
            f"context_parallel computes the loss as the token loss of the shards, so "
            f"{'; '.join(w for w in other_loss if w)} would be left out of it. Drop it, or train without "
            f"context_parallel.",
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
    (:func:`~packtools.integrations.datasets.packing_record`), else a ``pack_files`` folder's (its manifest, next
    to its Arrow files), else ``None``."""
    from .datasets import packing_record

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
    column = _seq_lengths(dataset)
    if limit is not None:
        rows = column if column is not None else _one_sequence_rows(dataset)
        if rows is not None:
            check_rows_fit(rows, layout.cp_size, limit)
    elif column is not None:
        warnings.warn(
            f"context_parallel={layout.cp_size}: the train dataset holds packed rows (seq_lengths) whose packing "
            f"max_length packtools cannot read (neither a pack_files folder nor pack_dataset output), so rows are "
            f"not checked against it once padded for CP: a row can grow by up to {2 * layout.cp_size - 1} tokens "
            f"per document. Pack with pack_dataset(..., context_parallel={layout.cp_size}).",
            stacklevel=4,
        )
    return ContextParallelCollator(  # balanced: the documents' padding spread over the ranks (packtools_cp reads it)
        trainer.data_collator, layout.cp_size, layout.cp_rank, max_length=limit, balance=True
    )


def _seq_lengths(dataset: Any) -> Any:
    """The ``seq_lengths`` column of a ``datasets.Dataset`` in its row order (``None`` when it has none)."""
    if not (hasattr(dataset, "column_names") and hasattr(dataset, "data")):
        return None
    if SEQ_LENGTHS not in (dataset.column_names or []):
        return None
    from .compat.datasets import dataset_table

    table, indices = dataset_table(dataset)
    column = table.column(SEQ_LENGTHS)
    return column if indices is None else column.take(indices)


def _one_sequence_rows(dataset: Any) -> Any:
    """Rows without ``seq_lengths`` (``wrapped`` output) as the collator sees them: one sequence each
    (``[[len(input_ids)], ...]``), or ``None`` without an ``input_ids`` column."""
    if "input_ids" not in (getattr(dataset, "column_names", None) or []):
        return None
    from ..core.arrow import column_lengths
    from .compat.datasets import dataset_table

    table, indices = dataset_table(dataset)
    lengths = column_lengths(table.column("input_ids"))
    return (lengths if indices is None else lengths[indices]).reshape(-1, 1)


def prepare_context_parallel(trainer: Any, layout: RankLayout) -> None:
    """Install the CP collator, attention and loss on ``trainer`` (recorded on it; see the module docstring)."""
    torch = require("torch", "packtools context parallelism")
    check_cp_trainer(trainer, layout)
    group = cp_group(layout)
    collator = cp_collator(trainer, layout)
    set_attr(trainer, "data_collator", collator, owner=trainer)
    use_cp_attention(trainer.model, group, owner=trainer)
    window = _WindowTargets()

    def make_batches(original: Any) -> Any:
        def get_batch_samples(epoch_iterator: Any, num_batches: int, device: Any) -> Any:
            samples, num_items = original(epoch_iterator, num_batches, device)
            count = sum(int((b["shift_labels"] != -100).sum()) for b in samples)
            total = torch.tensor([count], device=device)
            if layout.world > 1:
                total = trainer.accelerator.gather(total).sum()
            window.targets = int(total)
            return samples, num_items

        return get_batch_samples

    def make_loss(original: Any) -> Any:
        def compute_loss(
            model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
        ) -> Any:
            outputs = model(**model_inputs(inputs))
            loss, count = shifted_token_loss(outputs.logits, inputs["shift_labels"])
            if model.training and window.targets is not None:
                divided = trainer_divides_by_accumulation(trainer, num_items_in_batch)
                steps = trainer.current_gradient_accumulation_steps if divided else 1
                loss = loss * (steps * layout.world) / max(window.targets, 1)
            else:  # not reached through Trainer (evaluation is refused): the batch's token mean over every rank
                loss = loss * layout.world / max(global_count(count), 1)
            return (loss, outputs) if return_outputs else loss

        return compute_loss

    wrap_method(trainer, "get_batch_samples", make_batches)
    wrap_method(trainer, "compute_loss", make_loss)
    refuse_evaluation(trainer)


def refuse_evaluation(trainer: Any) -> None:
    """Make ``trainer.get_eval_dataloader`` refuse by name (recorded on the trainer): under CP its loader would
    give the ranks of a group different rows, and a rank would wait on a peer's batch."""

    def refuse_eval(*args: Any, **kwargs: Any) -> Any:
        raise PackingError(NO_EVAL + ".", param="eval_dataset")

    set_attr(trainer, "get_eval_dataloader", refuse_eval, owner=trainer)
