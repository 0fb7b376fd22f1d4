"""TRL's ``RewardTrainer`` without padding: the same loss, metrics and gradients, on real tokens only.

TRL 1.16 pads every chosen and rejected sequence of a batch to the longest and reads each sequence's score at
its last non-pad token (``input_ids != pad_token_id`` in transformers' sequence-classification heads).  On a
padding-free row that rule finds the row's last token, not each document's, so packtools runs each
micro-batch (TRL's padded batch, or packed pair rows from
:func:`packtools.integrations.preference.data.pack_reward_pairs`) as one padding-free row, reads each
document's score at its own last token (:mod:`packtools.integrations.preference.reward_scores`) and hands
TRL's loss code the ``[2 * pairs, 1]`` scores it expects:

* **TRL's loss and metrics unchanged.**  :class:`PackedRewardStep.compute_loss` calls ``RewardTrainer``'s own
  ``compute_loss`` with a stand-in for the model whose call returns the model's output with ``logits`` =
  those scores, chosen of every pair first, then rejected (TRL's ``torch.chunk`` order), and with the
  batch's ``margin`` and an ``attention_mask`` of the row's real tokens (TRL counts ``num_tokens`` from it):
  the margin, ``center_rewards_coefficient``, accuracy, margins and rewards are TRL's code.
* **The step's pair mean.**  As for DPO (``docs/preference.md``): the loss of an optimizer step is the mean
  over all its pairs, over all processes (:class:`StepPairs`); with equal micro-batches (TRL's own) the
  factor is exactly 1.

:class:`PackedRewardStep` is everything packtools changes about a step (swapped in by
:func:`packtools.integrations.trainers.step.install_step`), :class:`RewardPlan` the run's decisions;
:func:`packtools.integrations.unprepare` undoes all.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

from ..._optional import is_instance, require
from ...compat import all_or_nothing
from ...compat.trl import (
    REWARD_METRIC_UNITS,
    check_step_methods,
    keep_signature_columns,
    set_training_data,
    tokenizer_of,
    train_metrics,
    weigh_new_metrics,
)
from ...constants import SEQ_LENGTHS
from ...core.pairs import PAIR_ROW_COLUMNS
from ...errors import PackingError
from ..attention.backends import (
    check_attention_implementation,
    segmented_sdpa_until_checked,
    sends_seq_idx,
)
from ..attention.isolation import trainer_autocast
from ..attention.mixers import run_mixers_per_document
from ..multimodal.models import refuse_multimodal
from ..parallel.distributed import check_loss_path, is_sharded, uneven_gather
from ..parallel.layout import rank_layout
from ..trainers.guard import guard_model, refuse_prompt_learning
from ..trainers.loader import check_train_loader
from ..trainers.rope_rows import check_rope_rows
from ..trainers.sft import refuse_neftune
from ..trainers.step import StepOwner, StepPlan, install_step, pair_mean_share, plan_of, step_pairs
from .reward_scores import ScoredRow, check_reward_isolation, reward_batch, score_head


@dataclass
class StepPairs:
    """The pairs of the optimizer step being run (all processes), counted when its micro-batches are fetched.

    Each micro-batch's loss (TRL's mean over its pairs) is weighed by ``its pairs * accumulation steps *
    data-parallel size / step pairs``: micro-batches of 3 and 1 pairs, 2 accumulation steps, one process

    >>> step = StepPairs(pairs=4)
    >>> [pairs * 2 * 1 / step.pairs for pairs in (3, 1)]  # the step's loss: the mean over its 4 pairs
    [1.5, 0.5]
    """

    pairs: int | None = None
    micro_batches: int = 0  # of the step: the logged metrics' weights (PackedRewardStep.compute_loss)


@dataclass(frozen=True)
class RewardPlan(StepPlan):
    """What ``prepare_reward_trainer`` decided for the run: the step owner's plan (layout, token budget) plus
    whether the model reads ``seq_idx``; held on the trainer as one value (``step.plan_of``)."""

    send_seq_idx: bool = False  # hybrids read sequence boundaries from seq_idx
    step: StepPairs = field(default_factory=StepPairs)  # the one mutable part: this step's pair count


def _pairs_in(batch: dict[str, Any]) -> int:
    if batch.get("cu_seq_lens_q") is not None:
        return (int(batch["cu_seq_lens_q"].numel()) - 1) // 2
    return int(batch["input_ids"].shape[0]) // 2


class PackedRewardStep(StepOwner):
    """packtools' part of a ``RewardTrainer`` step (see the module docstring); swapped in by
    :func:`prepare_reward_trainer` in front of the trainer's own class (``step.install_step``); the training
    loader is :class:`~packtools.integrations.trainers.step.StepOwner`'s."""

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> Any:
        samples, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)  # type: ignore[misc]
        run: RewardPlan = plan_of(self)  # type: ignore[assignment]
        run.step.pairs = step_pairs(self, sum(_pairs_in(b) for b in samples), device)
        run.step.micro_batches = len(samples)
        return samples, num_items

    def compute_loss(
        self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        run: RewardPlan = plan_of(self)  # type: ignore[assignment]
        batch = reward_batch(inputs, run.send_seq_idx)
        training = self.model.training and bool(run.step.pairs)  # type: ignore[attr-defined]
        lengths = {k: len(v) for k, v in train_metrics(self).items()} if training else {}
        with uneven_gather(self.accelerator):  # type: ignore[attr-defined]  # ranks hold different pair counts
            result = super().compute_loss(  # type: ignore[misc]
                ScoredRow(model, batch), dict(batch.view), training or return_outputs, num_items_in_batch
            )
        if not training:
            return result
        loss, outputs = result
        # TRL logs the mean of its micro-batches' pair means: weigh each by its share of the step's pairs
        mine = step_pairs(self, batch.pairs, batch.view["input_ids"].device)
        share = mine * run.step.micro_batches / run.step.pairs
        weigh_new_metrics(self, lengths, {"pairs": share}, REWARD_METRIC_UNITS)
        set_pair_means(self, outputs, lengths, run.step.micro_batches / run.step.pairs)
        loss = pair_mean_share(self, loss, batch.pairs, run.step.pairs, num_items_in_batch)
        return (loss, outputs) if return_outputs else loss


def set_pair_means(trainer: Any, outputs: Any, lengths: dict[str, int], scale: float) -> None:
    """Replace the ``accuracy`` and ``margin`` TRL 1.16's ``RewardTrainer`` just logged by the micro-batch's sums
    over the pairs of every process times ``scale`` (``micro-batches / step pairs``: the step's means once ``log``
    averages its values).

    TRL gathers each process's *own* mean of them and averages those means: right for processes of equal pair
    counts (TRL's batches), not for packed micro-batches, whose processes hold different numbers of pairs (2
    processes of 2 and 3 pairs: accuracy 0.409 logged for 0.455 over the step's pairs, margin of the wrong sign).
    ``outputs.logits``: the micro-batch's scores as TRL reads them (chosen half first)."""
    torch = require("torch", "packtools reward metrics")
    chosen, rejected = torch.chunk(outputs.logits.detach().squeeze(-1).float(), chunks=2)
    sums = torch.stack([(chosen > rejected).float().sum(), (chosen - rejected).sum()])
    if int(trainer.args.world_size) > 1:
        sums = trainer.accelerator.gather(sums[None]).sum(0) / plan_of(trainer).layout.peers
    metrics = train_metrics(trainer)
    for i, key in enumerate(("accuracy", "margin")):
        values = metrics.get(key)
        if values is not None and len(values) == lengths.get(key, 0) + 1:
            values[-1] = float(sums[i]) * scale


def _check_trainer(trainer: Any) -> None:
    if not is_instance(trainer, "trl", "RewardTrainer"):
        raise PackingError(
            f"prepare_reward_trainer expects a trl.RewardTrainer, got {type(trainer).__name__}; for DPOTrainer use "
            f"packtools.prepare_dpo_trainer, for Trainer or SFTTrainer packtools.prepare_trainer.",
            param="trainer",
        )
    from trl import RewardTrainer

    if isinstance(trainer, StepOwner):
        raise PackingError(
            "prepare_reward_trainer was already called on this trainer (it was prepared twice)."
        )
    if type(trainer).compute_loss is not RewardTrainer.compute_loss:
        raise PackingError(
            f"{type(trainer).__name__} overrides compute_loss; packtools runs RewardTrainer's own compute_loss on "
            f"its padding-free scores and cannot know what another compute_loss reads from the model's output "
            f"(its pooled logits would be the row's last token). Move the change into a callback, or train padded.",
            param="trainer",
        )
    refuse_multimodal([trainer.model], "reward forwards")
    refuse_prompt_learning(trainer.model)
    score_head(trainer.model)


def _use_packed_dataset(trainer: Any, dataset: Any) -> None:
    from ...batches.preference import PreferenceCollator

    names = list(getattr(dataset, "column_names", None) or [])
    missing = [c for c in PAIR_ROW_COLUMNS if c not in names]
    if missing:
        raise PackingError(
            f"train_dataset must be pack_reward_pairs output; it lacks {missing} (has {names}).",
            param="train_dataset",
        )
    margins = "margin" in (getattr(trainer.train_dataset, "column_names", None) or [])
    if margins and "margin" not in names:
        raise PackingError(
            "the trainer's dataset has a 'margin' column and the packed rows do not: the margins would be "
            "dropped from the loss. Pack trainer.train_dataset with pack_reward_pairs (it keeps 'margin').",
            param="train_dataset",
        )
    pair_columns = ["margin"] if "margin" in names else []
    collator = PreferenceCollator(tokenizer_of(trainer).pad_token_id, pair_columns, padding_free=True)
    unpacked = trainer.data_collator

    def collate(features: Any) -> Any:  # packed rows ours, TRL's one-pair rows (eval sets) TRL's
        return collator(features) if SEQ_LENGTHS in features[0] else unpacked(features)

    set_training_data(trainer, dataset, collate)
    if trainer.args.remove_unused_columns:
        keep_signature_columns(trainer, [*PAIR_ROW_COLUMNS, *pair_columns])


def prepare_reward_trainer(
    trainer: Any,
    train_dataset: Any = None,
    *,
    max_tokens: int | None = None,
    check_isolation: bool = True,
    segmented_sdpa: bool = True,
) -> Any:
    """Make a TRL ``RewardTrainer`` score its pairs without padding, with TRL's own loss code; returns it.

    Build the trainer as usual, then call this before ``train()``.  Without ``train_dataset`` each of TRL's
    padded micro-batches runs through the model as one padding-free row.  With ``train_dataset=
    pack_reward_pairs(trainer.train_dataset, max_length)`` the trainer trains on packed pair rows instead
    (``per_device_train_batch_size`` rows per micro-batch, or ``max_tokens=N`` tokens per process)::

        trainer = RewardTrainer(model, args=RewardConfig(...), train_dataset=pairs, processing_class=tokenizer)
        prepare_reward_trainer(trainer, pack_reward_pairs(trainer.train_dataset, 4096)).train()

    The loss of an optimizer step is the mean over all its pairs, over all processes (see the module
    docstring).  ``check_isolation=True`` first scores a few sequences packed and alone through this path
    (:func:`check_reward_isolation`) and refuses a model whose packed sequences leak.  ``segmented_sdpa``: as
    in :func:`packtools.prepare_trainer`.  :func:`packtools.integrations.unprepare` undoes everything.
    """
    require("trl", "packtools.prepare_reward_trainer")
    _check_trainer(trainer)
    check_loss_path(trainer, "prepare_reward_trainer")
    refuse_neftune(trainer, "packed reward pairs", "prepare_reward_trainer")
    check_step_methods(trainer)
    layout = rank_layout(trainer)
    if layout.cp_size > 1:
        raise PackingError(
            f"context parallelism (cp={layout.cp_size}) is not supported for reward models; packtools shards "
            f"reward pairs over data parallelism only.",
            param="parallelism_config",
        )
    if max_tokens is not None and train_dataset is None:
        raise PackingError(
            "max_tokens batches packed rows: pass train_dataset=pack_reward_pairs(trainer.train_dataset, ...).",
            param="max_tokens",
        )
    with all_or_nothing(trainer):
        check_train_loader(trainer, max_tokens)
        check_rope_rows(  # the length-dependent RoPE rule on the pairs' lengths, before training (rope_rows)
            trainer.model,
            train_dataset if train_dataset is not None else trainer.train_dataset,
            rows_per_forward=1 if max_tokens is not None else trainer.args.per_device_train_batch_size,
            caller="prepare_reward_trainer",
        )
        run = RewardPlan(layout, max_tokens, send_seq_idx=sends_seq_idx(trainer.model))
        install_step(trainer, PackedRewardStep, run)  # refuses a trainer prepared twice
        run_mixers_per_document(trainer.model, owner=trainer)  # token-mixing layers per document
        check_attention_implementation(trainer.model)
        with segmented_sdpa_until_checked([trainer.model], segmented_sdpa, owner=trainer):
            if check_isolation and is_sharded(trainer):
                warnings.warn(
                    "prepare_reward_trainer: the isolation probe was skipped because the model is sharded "
                    "(DeepSpeed/FSDP); run packtools.integrations.preference.reward_scores.check_reward_isolation on an unsharded copy.",
                    stacklevel=2,
                )
            elif check_isolation:
                with trainer_autocast(trainer):  # at the precision training runs
                    check_reward_isolation(trainer.model, send_seq_idx=run.send_seq_idx)
        guard_model(trainer.model, owner=trainer, check_isolation=False)
        if train_dataset is not None:
            _use_packed_dataset(trainer, train_dataset)
    return trainer
