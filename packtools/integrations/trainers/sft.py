"""The loss and column settings of a trainer on packed rows: ``Trainer.compute_loss_func``, the kept columns,
and TRL's ``SFTConfig`` for an already-packed dataset.

* :func:`causal_lm_loss`: the summed next-token loss over the predicted tokens of the whole accumulation
  window, installed as the trainer's public ``compute_loss_func`` for a model that takes no loss kwargs.
* :func:`keep_packed_columns`: ``seq_lengths`` and the loss-mask columns kept through
  ``remove_unused_columns`` (``Trainer._signature_columns``, through
  :mod:`packtools.compat.transformers`, recorded so ``unprepare`` undoes it).
* :func:`packed_sft_config` and :func:`check_sft`: an ``SFTTrainer`` that does not prepare the packed rows
  again (read from its public ``args.dataset_kwargs``).
* :func:`refuse_neftune`: the one training argument packed rows cannot honour whatever the trainer (every
  prepare function and :func:`packed_sft_config` call it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any

from ..._optional import is_instance, require
from ...compat.transformers import keep_signature_columns
from ...constants import IGNORE_INDEX, MEDIA_COLUMNS, PACKED_COLUMNS
from ...errors import PackingError


def is_sft_trainer(trainer: Any) -> bool:
    """Whether ``trainer`` is TRL's ``SFTTrainer`` (or a subclass), without importing TRL."""
    return is_instance(trainer, "trl", "SFTTrainer")


def causal_lm_loss(outputs: Any, labels: Any, num_items_in_batch: Any = None) -> Any:
    """Sum of next-token cross-entropies divided by ``num_items_in_batch`` (a ``Trainer.compute_loss_func``).

    Without ``num_items_in_batch`` it divides by the predicted tokens of this batch.  Labels are shifted
    here (position ``i`` predicts ``labels[i + 1]``), like transformers' ``ForCausalLMLoss``.

    >>> import torch
    >>> uniform = {"logits": torch.zeros(1, 3, 4)}  # every token has probability 1/4
    >>> labels = torch.tensor([[-100, 1, 2]])  # two predicted tokens
    >>> round(float(causal_lm_loss(uniform, labels)), 4), round(float(causal_lm_loss(uniform, labels, 4)), 4)
    (1.3863, 0.6931)
    """
    torch = require("torch", "packtools.integrations.trainers.sft.causal_lm_loss")
    logits = outputs["logits"] if isinstance(outputs, Mapping) else outputs[0]
    total, target = summed_next_token_loss(logits, labels)
    count = (target != IGNORE_INDEX).sum() if num_items_in_batch is None else num_items_in_batch
    return total / torch.as_tensor(count, device=total.device).clamp(min=1)


def summed_next_token_loss(logits: Any, labels: Any) -> tuple[Any, Any]:
    """``(summed cross-entropy, targets)`` of ``logits`` against the next token: position ``i`` predicts
    ``labels[i + 1]`` (the targets are ``labels`` shifted by one, ``-100`` at the end and where nothing is
    predicted)."""
    torch = require("torch", "packtools causal-LM loss")
    target = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].to(logits.device)
    total = torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]),
        target.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return total, target


def keep_packed_columns(trainer: Any, extra: Sequence[str] = (), *, owner: Any = None) -> None:
    """Keep ``seq_lengths``, the loss-mask columns and ``extra`` (a vision collator's image columns) through the
    trainer's ``remove_unused_columns``, and the media columns (:data:`~packtools.constants.MEDIA_COLUMNS`) too: a
    dataset whose columns are unknown until its rows come (a streamed ``IterableDataset``) is not refused by name
    when prepared, and the trainer's column removal would drop its pixels or audio from each row before the collator
    sees them, their placeholder tokens training with no error; kept, the collator refuses them by name."""
    if trainer.args.remove_unused_columns:
        keep_signature_columns(trainer, (*PACKED_COLUMNS, *MEDIA_COLUMNS, *extra), owner=owner)


def check_sft(trainer: Any) -> None:
    """Refuse an ``SFTTrainer`` that prepares (re-tokenizes, truncates) the packed dataset again."""
    kwargs = getattr(trainer.args, "dataset_kwargs", None) or {}
    if not kwargs.get("skip_prepare_dataset", False):
        raise PackingError(
            "SFTTrainer prepared the packed dataset again: it rebuilds labels (dropping completion_mask) and "
            "truncates input_ids to max_length without updating seq_lengths. Build the trainer with "
            "args=packtools.integrations.packed_sft_config(...), or SFTConfig(dataset_kwargs={'skip_prepare_dataset': True})."
        )


def packed_sft_config(**kwargs: Any) -> Any:
    """A TRL ``SFTConfig`` for a dataset that is already packed: no packing or preparation again, and a
    collator that keeps the packed sequences apart whichever collator the trainer ends up with.

    It sets ``packing=False`` and ``dataset_kwargs={"skip_prepare_dataset": True}`` (preparation would
    rebuild labels and truncate rows without updating ``seq_lengths``), and by default
    ``padding_free=True`` with ``max_length=None``: an ``SFTTrainer`` built without a ``data_collator``
    then uses TRL's own padding-free collator, which reads ``seq_lengths`` and trains exactly, with or
    without :func:`~packtools.prepare_trainer`, on models whose masks come from ``position_ids`` and that have
    no token-mixing layers (GPT-OSS and hybrids need :func:`~packtools.prepare_trainer`: docs/training.md).  ``padding_free=False`` is for passing
    ``data_collator=PaddingFreeCollator(pad)`` (its options, ``context_parallel``, ``max_tokens``), which TRL
    refuses under ``padding_free=True`` (docs/training.md).  ``pad_to_multiple_of`` under ``padding_free=True``
    needs ``router_aux_loss_coef=0.0``: TRL's SFTTrainer trains a MoE model's router loss by default, and its
    collator's pad tokens would count in it (silently without :func:`~packtools.prepare_trainer`).  Other
    arguments pass through.
    """
    trl = require("trl", "packtools.integrations.packed_sft_config")
    if kwargs.get("packing"):
        raise PackingError(
            "packing=True makes SFTTrainer pack the already packed rows again. Leave packing out.",
            param="packing",
        )
    refuse_neftune(
        SimpleNamespace(neftune_noise_alpha=kwargs.get("neftune_noise_alpha")),
        "packed rows",
        "packed_sft_config",
    )
    padding_free = kwargs.pop("padding_free", True)
    if padding_free not in (True, False):
        raise PackingError(
            f"padding_free={padding_free!r}: say True (TRL's own padding-free collator, reading seq_lengths; "
            "the default) or False (you pass data_collator=packtools.PaddingFreeCollator(pad_token_id)).",
            param="padding_free",
        )
    if padding_free and kwargs.get("max_length") is not None:
        raise PackingError(
            f"max_length={kwargs['max_length']}: the rows are already packed to their length and TRL refuses "
            "max_length under padding_free=True without packing. Leave max_length out (rows are never "
            "truncated again).",
            param="max_length",
        )
    if padding_free and kwargs.get("pad_to_multiple_of") and kwargs.get("router_aux_loss_coef") != 0.0:
        # TRL builds its collator from these arguments, and nothing of packtools sees it without prepare_trainer
        raise PackingError(
            f"pad_to_multiple_of={kwargs['pad_to_multiple_of']} under padding_free=True: TRL's collator pads the "
            f"packed row with pad tokens (one 1-token document each), and SFTTrainer trains a MoE model's router "
            f"loss by default (router_aux_loss_coef=None takes the model config's), in which transformers counts "
            f"every one of them (a packed batch has no attention_mask): the loss and gradients differ from the "
            f"padded batch's with no error. Leave pad_to_multiple_of out, or pass router_aux_loss_coef=0.0 (no "
            f"router loss; a dense model has none, and TRL accepts 0.0 for it).",
            param="pad_to_multiple_of",
        )
    dataset_kwargs = dict(kwargs.pop("dataset_kwargs", None) or {})
    if dataset_kwargs.get("skip_prepare_dataset") is False:
        raise PackingError(
            "dataset_kwargs['skip_prepare_dataset']=False would re-tokenize and truncate packed rows.",
            param="dataset_kwargs",
        )
    dataset_kwargs["skip_prepare_dataset"] = True
    if padding_free:
        kwargs["max_length"] = None
    kwargs.update(packing=False, padding_free=padding_free, dataset_kwargs=dataset_kwargs)
    return trl.SFTConfig(**kwargs)


def refuse_neftune(owner: Any, rows: str, prepare: str) -> None:
    """Raise when ``owner`` (a trainer, or a config's keyword arguments) turns NEFTune on: transformers draws each
    embedding's noise within ``alpha / sqrt(width x hidden size)`` of the batch the embedding layer sees, and a
    packed row is as wide as all its sequences together, so every token would get a smaller noise than in the
    trainer's own batches, with no error.  A trainer's own ``neftune_noise_alpha`` is read first (``Trainer``
    copies it from its arguments when built, and ``train()`` reads that copy), then its ``args``'.  ``rows``
    names the rows (``"packed SFT rows"``), ``prepare`` the prepare function."""
    alpha = getattr(owner, "neftune_noise_alpha", None)
    if alpha is None:
        alpha = getattr(getattr(owner, "args", None), "neftune_noise_alpha", None)
    if alpha is not None:
        raise PackingError(
            f"neftune_noise_alpha={alpha}: transformers' NEFTune draws each embedding's noise within alpha / "
            f"sqrt(width x hidden size) of the batch it sees, and {rows} hold several sequences in one row, so "
            f"every token's noise would be smaller than in the trainer's own batches by the square root of their "
            f"widths' ratio. Set neftune_noise_alpha=None, or train without packing (do not call {prepare}).",
            param="neftune_noise_alpha",
        )
