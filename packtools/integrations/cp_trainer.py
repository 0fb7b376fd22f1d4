"""``prepare_trainer(trainer, context_parallel=N)``: a ``transformers.Trainer`` on context-parallel shards.

The pieces, each from its own module:

* the run's layout (:func:`~packtools.integrations.parallel_layout.rank_layout`): CP groups of ``N``
  consecutive processes, the data-parallel rank and size over the groups; the training loader shards over
  the DP group only, so the ``N`` ranks of a CP group read the same batch;
* the collator: the trainer's :class:`~packtools.PaddingFreeCollator` wrapped in
  :class:`~packtools.batches.context_parallel.ContextParallelCollator` (this rank's share of every batch),
  holding the rows of a ``pack_files`` folder to its ``max_length`` once padded (:func:`cp_collator`);
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
from dataclasses import dataclass
from typing import Any

from .._optional import require
from ..batches.context_parallel import ContextParallelCollator
from ..constants import SEQ_LENGTHS
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
    """The ``max_length`` a ``datasets.Dataset`` loaded from a ``pack_files`` folder was packed with (its
    manifest, next to its Arrow files), or ``None`` when it has none."""
    files = getattr(dataset, "cache_files", None) or []
    folders = {os.path.dirname(f["filename"]) for f in files if isinstance(f, dict) and "filename" in f}
    for folder in sorted(folders):
        config = (read_manifest(folder) or {}).get("config") or {}
        if isinstance(config.get("max_length"), int):
            return int(config["max_length"])
    return None


def cp_collator(trainer: Any, layout: RankLayout) -> ContextParallelCollator:
    """This rank's CP collator over the trainer's own.  When the train dataset is a ``pack_files`` folder, its
    rows are held to the folder's ``max_length`` once padded for ``layout.cp_size``: rows packed for this CP size
    (or a multiple of it) fit, others fit or are refused by row, never trained over ``max_length`` silently
    (:func:`~packtools.batches.context_parallel.check_rows_fit`)."""
    dataset = getattr(trainer, "train_dataset", None)
    limit = packed_max_length(dataset)
    if limit is not None:  # every row checked now, before training, not when a batch first reaches it
        _check_all_rows_fit(dataset, layout.cp_size, limit)
    return ContextParallelCollator(trainer.data_collator, layout.cp_size, layout.cp_rank, max_length=limit)


def _check_all_rows_fit(dataset: Any, cp_size: int, limit: int) -> None:
    """:func:`~packtools.batches.context_parallel.check_rows_fit` on every row of a packed ``datasets.Dataset``
    at once (its ``seq_lengths`` offsets and values only), naming the first row that does not fit."""
    import numpy as np
    import pyarrow.compute as pc

    from ..batches.context_parallel import check_rows_fit, cp_padded_lengths

    table = getattr(getattr(dataset, "data", None), "table", None)
    if table is None or SEQ_LENGTHS not in table.column_names:
        return
    column = table.column(SEQ_LENGTHS)
    docs = np.asarray(pc.list_flatten(column).to_numpy(zero_copy_only=False), np.int64)
    counts = np.asarray(pc.list_value_length(column).to_numpy(zero_copy_only=False), np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)])
    padded = np.add.reduceat(np.append(cp_padded_lengths(docs, cp_size), 0), starts[:-1]) * (counts > 0)
    over = np.flatnonzero(padded > limit)
    if over.size:
        row = int(over[0])
        check_rows_fit([docs[starts[row] : starts[row + 1]]], cp_size, limit, first_row=row)


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
