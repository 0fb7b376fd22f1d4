"""Every change packtools makes to a TRL ``DPOTrainer`` and its models, checked, recorded, undoable.

:func:`packtools.prepare_dpo_trainer` changes a live trainer in four ways, each only through this module and
each recorded on the trainer (:func:`~packtools.compat.set_attr` with ``owner=trainer``), so
:func:`packtools.compat.unprepare` puts the trainer back as TRL built it:

* **The fused-LM-head forward.**  TRL's ``add_fused_lm_head`` sets an instance ``forward`` on the (base) model;
  :func:`wrap_fused_forward` replaces that instance attribute with packtools' padding-free or prompt-shared
  forward around it.  Module hooks cannot do this job on every checked version: PEFT 0.18's ``LoraModel.forward``
  calls ``model.forward(...)`` directly, which runs no hook of the base model.
* **``compute_loss`` and ``get_batch_samples``** (:func:`check_step_methods`): their signatures are checked; the step
  owner (:class:`packtools.integrations.trainers.step.DPOStep`, the trainer's class swapped to a subclass of its own)
  overrides them and calls ``super()``.
* **The kept columns** (:func:`~packtools.compat.transformers.keep_signature_columns`): packed pair rows add
  their columns to those ``Trainer``'s ``remove_unused_columns`` keeps.
* **The dataset and collator** (``train_dataset``, ``data_collator``: public attributes, recorded all the same).

:func:`packtools.integrations.preference.reward.prepare_reward_trainer` swaps a subclass onto a ``RewardTrainer``
(:func:`packtools.integrations.trainers.step.install_step`) whose ``compute_loss`` calls ``RewardTrainer.compute_loss`` with
a stand-in for the model; it relies on TRL 1.16's ``compute_loss`` calling ``model(**inputs)`` once and reading
only ``outputs.logits`` (``[2 * pairs, 1]``, chosen then rejected), ``inputs["margin"]`` and
``inputs["attention_mask"]`` (its token count), which :func:`check_step_methods` cannot see: the CHECKED range
and the side-by-side tests hold it.

Each function checks the shape it relies on and raises :func:`~packtools.compat.unknown_shape`
otherwise.  The tokenizer is read from the public ``processing_class`` (not ``DPOTrainer._tokenizer``).
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from typing import Any

from ..errors import PackingError
from . import set_attr, unknown_shape, version, warn_unchecked, within
from .transformers import keep_signature_columns as keep_signature_columns

#: The TRL versions whose ``DPOTrainer`` shapes this module was checked against (lowest and newest CI runs).
CHECKED = "1.16.0 - 1.16.0"
warn_unchecked("trl", CHECKED)  # once per process, when the installed trl is outside it
#: The transformers versions whose ``Trainer`` internals (``_signature_columns``, ``get_batch_samples``) were checked.
TRANSFORMERS_CHECKED = "5.15.0 - 5.25.0"

#: Parameters of the trainer methods packtools wraps, as the checked versions define them.
_METHOD_PARAMS = {
    "compute_loss": ("model", "inputs", "return_outputs", "num_items_in_batch"),
    "get_batch_samples": ("epoch_iterator", "num_batches", "device"),
}


def _unknown(what: str, library: str = "trl") -> Exception:
    checked = CHECKED if library == "trl" else TRANSFORMERS_CHECKED
    return unknown_shape(library, checked, what)


def fused_forward(base: Any) -> Callable[..., Any]:
    """The fused-LM-head forward TRL set on ``base`` (an instance attribute); raises if there is none."""
    found = vars(base).get("forward")
    params = inspect.signature(found, follow_wrapped=False).parameters.values() if callable(found) else ()
    takes = any(p.name == "fused_lm_head" or p.kind is p.VAR_KEYWORD for p in params)
    if not takes:
        raise unknown_shape(
            "trl",
            CHECKED,
            f"{type(base).__name__} has no fused LM head (an instance forward taking fused_lm_head, as TRL's "
            f"add_fused_lm_head sets)",
            "Build the DPOTrainer first (it adds the head to its models), then call "
            "packtools.prepare_dpo_trainer(trainer).",
        )
    refuse_headless_base_model(base, "DPOTrainer", "DPO")
    return found


def refuse_headless_base_model(base: Any, trainer_name: str, what: str) -> None:
    """Refuse a model TRL's fused LM head cannot run: the head calls ``base.base_model`` for the backbone's
    hidden states, and a model whose ``base_model`` is itself (Llama 4's ``base_model_prefix`` names no
    submodule) returns its own output there, which fails inside TRL's forward (TRL's unprepared run too)."""
    if getattr(base, "base_model", None) is base:
        raise PackingError(
            f"TRL's fused LM head cannot run {type(base).__name__}: it calls model.base_model for the backbone's "
            f"hidden states, and this model's base_model is the model itself (its base_model_prefix "
            f"{getattr(base, 'base_model_prefix', None)!r} names no submodule), so {trainer_name}'s forward fails "
            f"on it. packtools cannot pack {what} for it; train it with TRL's own batches once TRL supports it.",
            param="model",
        )


def wrap_fused_forward(
    base: Any, make: Callable[[Callable[..., Any]], Callable[..., Any]], *, owner: Any
) -> None:
    """Replace TRL's fused forward on ``base`` with ``make(inner)`` bound to ``base``; recorded on ``owner``."""
    inner = fused_forward(base)
    set_attr(base, "forward", types.MethodType(make(inner), base), owner=owner)


def check_step_methods(trainer: Any) -> None:
    """Refuse a trainer whose ``compute_loss`` or ``get_batch_samples`` does not take the parameters of the
    checked versions: the step owner (:mod:`packtools.integrations.trainers.step`) overrides both and calls
    them through ``super()``, so it would call them wrongly."""
    for name, expected in _METHOD_PARAMS.items():
        method = getattr(trainer, name, None)
        params = tuple(inspect.signature(method).parameters) if callable(method) else ()
        if params != expected:
            library = "trl" if name == "compute_loss" else "transformers"
            raise _unknown(f"{type(trainer).__name__}.{name} takes {params}, not {expected}", library)


def set_training_data(trainer: Any, dataset: Any, collator: Callable[..., Any]) -> None:
    """Point ``trainer`` at ``dataset`` and ``collator`` (public attributes), recorded for unprepare."""
    set_attr(trainer, "train_dataset", dataset, owner=trainer)
    set_attr(trainer, "data_collator", collator, owner=trainer)


def tokenizer_of(trainer: Any) -> Any:
    """The tokenizer of a ``DPOTrainer``, from its public ``processing_class`` (a processor's ``.tokenizer``).

    >>> from types import SimpleNamespace as NS
    >>> tokenizer_of(NS(processing_class=NS(tokenizer=NS(pad_token_id=0)))).pad_token_id
    0
    """
    found = getattr(trainer, "processing_class", None)
    found = getattr(found, "tokenizer", found)
    if getattr(found, "pad_token_id", None) is None:
        raise _unknown(f"{type(trainer).__name__}.processing_class has no tokenizer with a pad_token_id")
    return found


_SFT_TRAINER = "trl.trainer.sft_trainer.SFTTrainer"


def count_every_position(trainer: Any, inputs: Any) -> None:
    """Make a TRL ``SFTTrainer``'s logged ``num_tokens`` count every position of a packed training batch.

    TRL 1.16's ``SFTTrainer.compute_loss`` adds, in training, ``position_ids.size(1)`` of a batch without an
    ``attention_mask`` (gathered over the processes, divided by its ``_tp_size``) to ``_total_train_tokens``: the
    width of its own flat padding-free row ``[1, T]``.  A batch of several rows (``PaddingFreeCollator(
    padding_free=False)``'s ``[B, T]``, a ``(3 | 4, B, T)`` position tensor) holds ``input_ids.numel()``
    positions, of which TRL counted one row's width (47 tokens logged for 75 in the regression test): this adds
    the rest, on every process (one gather, as TRL's).  Call it after ``SFTTrainer.compute_loss``; it does nothing
    for other trainers or in evaluation, and adds 0 for a batch with an ``attention_mask`` (TRL counted its mask).
    The gather runs on every process whatever its batch holds: ``PaddingFreeCollator(padding_free=False)`` gives
    a batch of single-sequence rows an ``attention_mask`` and one with a packed row none, so at one step the
    processes may hold either (a gather on some only left the others waiting: 2 processes hung).
    """
    if not any(f"{c.__module__}.{c.__qualname__}" == _SFT_TRAINER for c in type(trainer).__mro__):
        return
    if not trainer.model.training:
        return
    metrics = getattr(trainer, "_metrics", None)
    if (
        not isinstance(getattr(trainer, "_total_train_tokens", None), (int, float))
        or not isinstance(getattr(trainer, "_tp_size", None), int)
        or not isinstance(metrics, dict)
        or "train" not in metrics
    ):
        raise _unknown(
            f"{type(trainer).__name__} has no _total_train_tokens / _tp_size / _metrics['train'] (its logged num_tokens)"
        )
    import torch

    ids, positions = inputs.get("input_ids"), inputs.get("position_ids")
    counted = "attention_mask" in inputs or ids is None or positions is None  # TRL's count is the batch's
    device = trainer.accelerator.device if ids is None else ids.device
    rest = torch.tensor(0 if counted else ids.numel() - positions.size(1), device=device)
    trainer._total_train_tokens += trainer.accelerator.gather(rest).sum().item() // trainer._tp_size
    metrics["train"]["num_tokens"] = [trainer._total_train_tokens]  # what TRL logs, set before this call


#: What each per-micro-batch metric of TRL 1.16's ``DPOTrainer.compute_loss`` is a mean over: the micro-batch's
#: pairs (over every process), its chosen completion tokens, its rejected ones, or all its completion tokens.
DPO_METRIC_UNITS = {
    "rewards/chosen": "pairs",
    "rewards/rejected": "pairs",
    "rewards/accuracies": "pairs",
    "rewards/margins": "pairs",
    "logps/chosen": "pairs",
    "logps/rejected": "pairs",
    "logits/chosen": "chosen",
    "mean_token_accuracy": "chosen",
    "logits/rejected": "rejected",
    "entropy": "tokens",
}


def train_metrics(trainer: Any) -> dict[str, list[float]]:
    """A TRL trainer's training metrics: ``_metrics["train"]``, one list per key, one value appended per
    micro-batch, averaged by ``log`` (TRL 1.16's ``DPOTrainer`` and ``SFTTrainer``)."""
    metrics = getattr(trainer, "_metrics", None)
    found = metrics.get("train") if isinstance(metrics, dict) else None
    if not isinstance(found, dict):
        raise _unknown(f"{type(trainer).__name__} has no _metrics['train'] (the metrics it logs)")
    return found


#: The same for TRL 1.16's ``RewardTrainer.compute_loss``: ``mean_reward`` is over both scores of each pair of
#: every process; ``accuracy`` and ``margin`` are means of each process's own mean (not over the pairs of every
#: process: ``preference.reward.set_pair_means`` recomputes them); ``min_reward`` / ``max_reward`` are extremes,
#: not means: left as TRL logs them.
REWARD_METRIC_UNITS = {"mean_reward": "pairs"}


def weigh_new_metrics(
    trainer: Any, lengths: dict[str, int], factors: dict[str, float], units: dict[str, str] = DPO_METRIC_UNITS
) -> None:
    """Multiply the value each metric of ``units`` (key -> unit) appended since ``lengths`` (the lists' lengths
    before ``compute_loss``) by ``factors[unit]``: TRL's ``log`` averages its values over the micro-batches, so a
    micro-batch's mean weighs ``its units / mean units`` once scaled by ``its units x micro-batches / step units``."""
    metrics = train_metrics(trainer)
    for key, unit in units.items():
        values = metrics.get(key)
        if values is not None and len(values) == lengths.get(key, 0) + 1:
            values[-1] = values[-1] * factors[unit]


def is_vision(trainer: Any) -> bool:
    """Whether a ``DPOTrainer`` was built on image data (``DPOTrainer._is_vision_dataset``, set in its constructor)."""
    found = vars(trainer).get("_is_vision_dataset")
    if not isinstance(found, bool):
        raise _unknown(
            f"{type(trainer).__name__} has no _is_vision_dataset flag (got {type(found).__name__})"
        )
    return found


#: The TRL versions whose ``GRPOTrainer`` / ``RLOOTrainer`` shapes :mod:`packtools.integrations.rl` was checked
#: against: outside it ``prepare_grpo_trainer`` refuses (it replaces a private method of theirs).
RL_CHECKED = "1.16.0 - 1.16.0"
#: ``GRPOConfig.loss_type`` values of the checked versions (TRL's ``_compute_loss`` runs them unchanged).
GRPO_LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")
#: ``_get_per_token_logps_and_entropies`` as the checked GRPOTrainer and RLOOTrainer define it.
RL_LOGPS_PARAMS = (
    "self",
    "model",
    "input_ids",
    "attention_mask",
    "logits_to_keep",
    "batch_size",
    "compute_entropy",
    "compute_aux_loss",
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)
#: The media arguments of that method: packtools' rows carry text only, so a call with any of them is refused.
RL_MEDIA_PARAMS = RL_LOGPS_PARAMS[8:]
_RL_LOGPS = "_get_per_token_logps_and_entropies"


def rl_trainer_kind(trainer: Any) -> tuple[type, str]:
    """``(TRL's class, its name)`` for a ``GRPOTrainer`` / ``RLOOTrainer`` (or a subclass) of a checked TRL version.

    Refuses another trainer, a TRL version outside :data:`RL_CHECKED`, a log-probability method of another
    shape, and a user subclass that overrides that method (packtools would replace it)."""
    import trl

    found = next((c for c in (trl.GRPOTrainer, trl.RLOOTrainer) if isinstance(trainer, c)), None)
    if found is None:
        raise PackingError(
            f"prepare_grpo_trainer expects a trl.GRPOTrainer or trl.RLOOTrainer, got {type(trainer).__name__}; "
            f"for DPOTrainer use packtools.prepare_dpo_trainer, for Trainer/SFTTrainer packtools.prepare_trainer."
        )
    installed = version("trl") or "?"
    if not within(installed, RL_CHECKED):
        raise unknown_shape(
            "trl",
            RL_CHECKED,
            f"{found.__name__}'s log-probability forward (_get_per_token_logps_and_entropies) is replaced by "
            f"packtools and was only checked on these versions",
            "Install a trl version in that range, or train padded (do not call prepare_grpo_trainer).",
        )
    method = getattr(found, _RL_LOGPS, None)
    params = tuple(inspect.signature(method).parameters) if callable(method) else ()
    if params != RL_LOGPS_PARAMS:
        raise _unknown(f"{found.__name__}.{_RL_LOGPS} takes {params}, not {RL_LOGPS_PARAMS}")
    mine = getattr(type(trainer), _RL_LOGPS)
    if mine is not method:
        raise PackingError(
            f"{type(trainer).__name__} overrides {_RL_LOGPS}; packtools computes those log-probabilities itself and "
            f"would replace yours. Move the change elsewhere (e.g. _compute_loss), or do not call "
            f"prepare_grpo_trainer."
        )
    return found, found.__name__


def trl_logps(base: type, trainer: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
    """TRL's own padded ``_get_per_token_logps_and_entropies`` of class ``base`` (the isolation probe's reference)."""
    return getattr(base, _RL_LOGPS)(trainer, model, *args, **kwargs)


#: TRL's distillation trainer, whose padded ``_get_last_hidden_state`` is the distillation probe's reference.
DISTILLATION_TRAINER = "trl.trainer.distillation_trainer.DistillationTrainer"


def trl_last_hidden_state(trainer: Any, model: Any, *args: Any) -> Any:
    """TRL's own padded ``DistillationTrainer._get_last_hidden_state`` (the distillation probe's reference), found
    in the trainer's class hierarchy (a subclass's override is refused before this runs)."""
    for cls in type(trainer).__mro__:
        if f"{cls.__module__}.{cls.__qualname__}" == DISTILLATION_TRAINER:
            return cls._get_last_hidden_state(trainer, model, *args)
    raise _unknown(f"{type(trainer).__name__} is no {DISTILLATION_TRAINER}")
