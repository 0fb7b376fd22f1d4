"""TRL's ``KTOTrainer`` without padding: the same loss, metrics and gradients, on real tokens only.

TRL 1.16's ``KTOTrainer`` runs every forward -- the policy on the batch's completions, the policy and the
reference on the KL term's mismatched ``(prompt, other completion)`` sequences, the reference on the
completions -- as a padded ``[B, T]`` batch through the fused LM head TRL puts on its models, and reads the
per-token ``log_probs``, ``entropy`` and ``mean_logits`` back in that layout.  These are exactly the calls
packtools' padding-free DPO forward takes (:func:`~packtools.integrations.preference.dpo.install_padding_free_forward`):
each call's sequences run as one padding-free row (``position_ids`` restarting per sequence, ``cu_seq_lens``;
no sequence sees another, so a KL sequence never sees the completion it was mismatched from) and the
per-token outputs are scattered back into TRL's padded layout (zero on padding, as TRL's are).  KTO's loss,
the KL estimate, the desirable/undesirable weights and every metric are TRL's code on those outputs.

The micro-batches stay TRL's: KTO builds the KL term's mismatched pairs by rotating the completions inside
each ``per_device_train_batch_size`` batch of its sequential sampler, so packtools does not repack or reorder
them (no packed dataset, no token budget).  The step itself is unchanged, so there is no step class to swap:
what :func:`prepare_kto_trainer` changes is the models' fused-head forward, the forward guard and the
``sdpa`` switch, each recorded on the trainer (:func:`packtools.integrations.unprepare` undoes them).

Refused by name: vision datasets, prompt-learning PEFT, multimodal models, and the MoE router auxiliary loss
(``aux_loss_enabled``: its router statistics over a padded batch were not checked against a padding-free row).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..._optional import is_instance, require
from ...compat import all_or_nothing
from ...compat.trl import fused_forward, is_vision
from ...errors import PackingError
from ..attention.backends import (
    base_model,
    check_attention_implementation,
    segmented_sdpa_until_checked,
)
from ..attention.isolation import trainer_autocast
from ..attention.mixers import run_mixers_per_document
from ..multimodal.models import refuse_multimodal
from ..parallel.distributed import check_loss_path
from ..trainers.guard import guard_model, refuse_prompt_learning
from ..trainers.loader import list_lengths
from ..trainers.rope_rows import check_rope_sequences
from ..trainers.sft import refuse_neftune
from .dpo import _WRAPPED, install_padding_free_forward
from .probe import check_padding_free_forward


def _check_trainer(trainer: Any) -> None:
    if not is_instance(trainer, "trl", "KTOTrainer"):
        raise PackingError(
            f"prepare_kto_trainer expects a trl.KTOTrainer, got {type(trainer).__name__}.", param="trainer"
        )
    if is_vision(trainer):
        raise PackingError(
            "vision KTO data is not supported padding-free; keep TRL's padded batches.", param="train_dataset"
        )
    if getattr(trainer, "aux_loss_enabled", False):
        raise PackingError(
            "the MoE router auxiliary loss is on (aux_loss_enabled: router_aux_loss_coef != 0): packtools has not "
            "checked its router statistics on a padding-free row against TRL's padded batch. Set "
            "router_aux_loss_coef=0.0 in KTOConfig, or train padded.",
            param="router_aux_loss_coef",
        )
    refuse_prompt_learning(trainer.model)


def check_kto_rope_rows(trainer: Any, models: list[Any]) -> None:
    """The length-dependent RoPE rule on KTO's rows before training (:mod:`~packtools.integrations.trainers.rope_rows`):
    every ``per_device_train_batch_size`` rows run as one padding-free row of ``prompt + completion`` sequences
    (and one of ``prompt + KL completion``), each cut to the collator's ``max_length`` as TRL's collator cuts it.
    Nothing for a dataset whose lengths cannot be read up front (a stream): the per-batch check stays."""
    data = trainer.train_dataset
    names = list(getattr(data, "column_names", None) or [])
    if not hasattr(data, "data") or not {"prompt_ids", "completion_ids"} <= set(names):
        return
    prompt = list_lengths(data, "prompt_ids")
    limit = getattr(trainer.data_collator, "max_length", None)
    batch = int(getattr(trainer.args, "per_device_train_batch_size", 1) or 1)
    offsets = np.arange(len(prompt) + 1, dtype=np.int64)
    for column in ("completion_ids", "KL_completion_ids"):  # the two forwards of a micro-batch
        if column not in names:
            continue
        lengths = prompt + list_lengths(data, column)
        if isinstance(limit, int) and limit > 0:
            lengths = np.minimum(lengths, limit)
        for model in models:
            check_rope_sequences(
                model, offsets, lengths, rows_per_forward=batch, caller="prepare_kto_trainer"
            )


def prepare_kto_trainer(trainer: Any, *, check_isolation: bool = True, segmented_sdpa: bool = True) -> Any:
    """Make a TRL ``KTOTrainer`` run its forwards without padding, with TRL's own loss code; returns it.

    Build the trainer as usual, then call this before ``train()``::

        trainer = KTOTrainer(model, ref_model, args=KTOConfig(...), train_dataset=data, processing_class=tok)
        prepare_kto_trainer(trainer).train()

    Every forward of a micro-batch (completions, KL sequences, reference) runs as one padding-free row (see
    the module docstring).  ``check_isolation=True`` first runs a few sequences through the installed forward
    together and alone (:func:`~packtools.integrations.preference.probe.check_padding_free_forward`) and refuses a
    model whose packed sequences leak.  ``segmented_sdpa``: as in :func:`packtools.prepare_trainer`.
    Anything else is refused by name:

    >>> prepare_kto_trainer(object())
    Traceback (most recent call last):
    ...
    packtools.errors.PackingError: prepare_kto_trainer expects a trl.KTOTrainer, got object.
    """
    require("trl", "packtools.prepare_kto_trainer")
    _check_trainer(trainer)
    check_loss_path(trainer, "prepare_kto_trainer")
    refuse_neftune(trainer, "padding-free KTO rows", "prepare_kto_trainer")
    models = [m for m in (trainer.model, trainer.ref_model) if m is not None]
    if any(vars(base_model(m)).get(_WRAPPED) for m in models):
        raise PackingError(
            "prepare_kto_trainer was already called on this trainer (its models run padding-free)."
        )
    refuse_multimodal(models, "KTO forwards")
    # length-dependent RoPE, before training (the guard's hook sees TRL's padded call, not the padding-free row)
    check_kto_rope_rows(trainer, models)
    for model in models:
        check_attention_implementation(model)
        fused_forward(base_model(model))  # TRL's fused LM head must be there to be wrapped
    with all_or_nothing(trainer):
        with segmented_sdpa_until_checked(models, segmented_sdpa, owner=trainer):
            for model in models:
                run_mixers_per_document(model, owner=trainer)  # token-mixing layers per document, as DPO
                install_padding_free_forward(model, owner=trainer)
                if check_isolation:
                    with trainer_autocast(trainer):  # at the precision training runs
                        check_padding_free_forward(model, trainer="KTO")
        for model in models:
            guard_model(model, owner=trainer, check_isolation=False)
    return trainer
