"""TRL's ``DPOTrainer`` without padding: the same loss, metrics and gradients, on real tokens only.

TRL 1.16 turns ``padding_free=True`` off for DPO and pads every chosen and rejected sequence of a batch to the
longest.  :func:`prepare_dpo_trainer` keeps TRL's loss code as it is and changes only what runs through the
model:

* **One padding-free row.**  TRL calls the model with its padded ``[2 * pairs, T]`` layout and reads per-token
  log-probabilities back in that layout.  The model's forward is wrapped so that the backbone and LM head run
  on the real tokens only, as one row with ``position_ids`` restarting per sequence and ``cu_seq_lens``
  (FlashAttention varlen, or the block-diagonal mask of ``sdpa``/``eager``), and the per-token outputs are
  scattered back into the padded layout (they are zero on padding, as TRL's are).  Padding costs a few
  integer tensors, never a forward.  The policy, a separate reference model, the reference under a disabled
  PEFT adapter and the reference log-probabilities precomputed later (``evaluate``) all go through it.
* **Packed pairs.**  With ``train_dataset=`` the output of :func:`packtools.dpo.pack_preference`, micro-batches are
  whole packed rows (``per_device_train_batch_size`` rows, so a steady token count); a
  :class:`~packtools.batches.preference.PreferenceCollator` lays their pairs out the way TRL's loss expects.
* **Gradient accumulation.**  TRL averages its loss over the pairs of each micro-batch and ``Trainer`` divides
  by the number of micro-batches, which weighs pairs unevenly when micro-batches hold different numbers of
  pairs.  Here the loss of an optimizer step is **the mean over all pairs of the step** (over all processes):
  ``Trainer`` prefetches the micro-batches of a step, their pairs are counted (summed across processes), and
  each micro-batch's loss is rescaled by ``its pairs / step pairs`` (times the factors ``Trainer`` and DDP
  divide by: the number of processes, and the accumulation steps only when the installed ``Trainer``'s own
  predicate says ``training_step`` divides, :func:`~packtools.integrations.distributed.trainer_divides_by_accumulation`).
  With equal micro-batches this is TRL's loss exactly; the logged ``loss`` is the step mean.
* **Several processes.**  Ranks hold different numbers of pairs; TRL's gathers of per-pair metrics are made
  size-safe (:func:`~packtools.integrations.distributed.uneven_gather`), and the training loader gives every
  process the same number of micro-batches without repeating a pair (``max_tokens=N`` for token-budget
  batches of whole pairs; :mod:`packtools.integrations.budget_loader`).
* **Guards.**  Those of :func:`packtools.prepare_trainer`: the attention backend must isolate packed sequences
  (:func:`~packtools.integrations.transformers.check_attention_implementation`), the forward runs with
  ``use_cache=False`` (:func:`~packtools.integrations.transformers.guard_model`) and the flat call is checked
  for an ``attention_mask`` next to packed positions
  (:func:`~packtools.integrations.transformers.check_forward_inputs`).

Use fp32 (``bf16=False``: TRL's configs default to ``bf16=True``, which on CPU autocasts the reference model)
to compare against the padded trainer bit for bit.
"""

from __future__ import annotations

import inspect
import types
from typing import Any

from .._optional import require
from ..constants import SEQ_LENGTHS
from ..errors import PackingError
from .budget_loader import install_train_loader
from .collator_check import check_preference_collator
from .distributed import check_loss_path, trainer_divides_by_accumulation, uneven_gather
from .dpo_calls import padded_preference_call
from .dpo_probe import check_padding_free_forward
from .transformers import (
    _base_model,
    attention_implementation,
    check_attention_implementation,
    check_forward_inputs,
    forward_accepts,
    guard_model,
    run_probe,
    segmented_sdpa_until_checked,
    token_mixing_layers,
)

_WRAPPED = "_packtools_padding_free"
_PATCHED = "_packtools_dpo"
#: Per-token fields of TRL's fused LM head output, scattered back to the padded layout.
PER_TOKEN = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")
PAIR_ROW_COLUMNS = ("input_ids", "completion_mask", SEQ_LENGTHS)


def padding_free_layout(attention_mask: Any) -> tuple[Any, Any, Any]:
    """``(lengths, valid, cu_seq_lens)`` of a right-padded ``[B, T]`` mask; raises if it is not right-padded.

    >>> import torch
    >>> lengths, valid, cu = padding_free_layout(torch.tensor([[1, 1, 1], [1, 1, 0]]))
    >>> lengths.tolist(), cu.tolist()
    ([3, 2], [0, 3, 5])
    """
    torch = require("torch", "packtools.prepare_dpo_trainer")
    lengths = attention_mask.sum(1)
    valid = torch.arange(attention_mask.shape[1], device=attention_mask.device)[None, :] < lengths[:, None]
    if not torch.equal(valid, attention_mask.bool()):
        raise PackingError(
            "the preference batch is not right-padded (its attention_mask has holes or left padding); packtools "
            "flattens TRL's DataCollatorForPreference layout. Use TRL's collator or packtools.dpo.PreferenceCollator."
        )
    if bool((lengths == 0).any()):
        raise PackingError("the preference batch has an empty sequence; every sequence needs a token.")
    cu = torch.zeros(lengths.shape[0] + 1, dtype=torch.int32, device=attention_mask.device)
    torch.cumsum(lengths, 0, out=cu[1:])
    return lengths, valid, cu


def _padding_free_forward(model: Any, inner: Any) -> Any:
    torch = require("torch", "packtools.prepare_dpo_trainer")
    mixers = tuple(token_mixing_layers(model))
    # seq_idx goes to models that name it, or that take **kwargs and have token-mixing layers (hybrids).
    names = inspect.signature(_base_model(model).forward).parameters
    send_seq_idx = "seq_idx" in names or (bool(mixers) and forward_accepts(model, "seq_idx"))

    def forward(self: Any, *args: Any, fused_lm_head: bool = False, **kwargs: Any) -> Any:
        call = padded_preference_call(args, kwargs, fused_lm_head)
        if call is None:
            return inner(*args, fused_lm_head=fused_lm_head, **kwargs)
        ids, mask, labels, kwargs = call
        lengths, valid, cu = padding_free_layout(mask)
        n_seq, width = ids.shape
        flat_ids = ids[valid]
        flat_labels = labels[valid].clone()
        starts = cu[:-1].long()
        flat_labels[starts] = -100  # the previous sequence's last position must not predict this token
        positions = torch.arange(flat_ids.shape[0], device=ids.device) - torch.repeat_interleave(
            starts, lengths
        )
        longest = int(lengths.max())
        if send_seq_idx:  # Mamba-2 style layers read only seq_idx in their kernels
            kwargs["seq_idx"] = torch.repeat_interleave(
                torch.arange(n_seq, dtype=torch.int32, device=ids.device), lengths
            )[None]
        flat = {
            "input_ids": flat_ids[None],
            "labels": flat_labels[None],
            "position_ids": positions[None],
            "cu_seq_lens_q": cu,
            "cu_seq_lens_k": cu,
            "max_length_q": longest,
            "max_length_k": longest,
            **kwargs,
        }
        flat["use_cache"] = False
        check_forward_inputs(flat, attention_implementation(self), mixers)
        out = inner(fused_lm_head=True, **flat)
        # Flat output i scores token i + 1; padded (b, j) scores token j + 1 of sequence b.
        target = valid[:, 1:]
        index = (starts[:, None] + torch.arange(width - 1, device=ids.device)[None, :])[target]
        for name in PER_TOKEN:
            value = getattr(out, name, None)
            if value is None:
                continue
            if value.shape[-1] != flat_ids.shape[0] - 1:
                raise PackingError(
                    f"the model's {name} has {value.shape[-1]} positions for {flat_ids.shape[0]} tokens; models "
                    f"that add virtual tokens (prompt-learning PEFT) cannot run padding-free."
                )
            full = value.new_zeros((n_seq, width - 1))
            full[target] = value[0, index]
            out[name] = full
        return out

    return forward


def _check_fused_head(model: Any) -> None:
    base = _base_model(model)
    if "forward" not in vars(base):
        raise PackingError(
            f"{type(base).__name__} has no fused LM head: build the DPOTrainer first (it adds one), then call "
            f"packtools.prepare_dpo_trainer(trainer)."
        )


def install_padding_free_forward(model: Any) -> None:
    """Wrap the fused-LM-head forward that TRL put on ``model`` (once) so it runs one padding-free row."""
    base = _base_model(model)
    if vars(base).get(_WRAPPED):
        return
    _check_fused_head(model)
    inner = base.forward
    base.forward = types.MethodType(_padding_free_forward(base, inner), base)
    base.forward.__func__._packtools_inner = inner
    object.__setattr__(base, _WRAPPED, True)


def uninstall_padding_free_forward(model: Any) -> None:
    """Undo :func:`install_padding_free_forward` (TRL's fused-head forward comes back)."""
    base = _base_model(model)
    if vars(base).get(_WRAPPED):
        forward = vars(base)["forward"]
        base.forward = forward._packtools_inner
        object.__delattr__(base, _WRAPPED)


def _check_trainer(trainer: Any) -> None:
    if not hasattr(trainer, "precompute_ref_logps") or not hasattr(trainer, "loss_types"):
        raise PackingError(
            f"prepare_dpo_trainer expects a trl.DPOTrainer, got {type(trainer).__name__}; for Trainer or "
            f"SFTTrainer use packtools.prepare_trainer."
        )
    if getattr(trainer, "_is_vision_dataset", False):
        raise PackingError("vision preference data is not supported padding-free; keep TRL's padded batches.")
    peft_config = getattr(trainer.model, "peft_config", None) or {}
    if any(getattr(c, "is_prompt_learning", False) for c in peft_config.values()):
        raise PackingError(
            "prompt-learning PEFT adapters add virtual tokens in front of every sequence, which a padding-free "
            "row cannot hold; use LoRA-style adapters."
        )


def _count_step_pairs(trainer: Any) -> None:
    """Count the pairs of each optimizer step when ``Trainer`` prefetches its micro-batches."""
    torch = require("torch", "packtools.prepare_dpo_trainer")
    original = trainer.get_batch_samples

    def get_batch_samples(epoch_iterator: Any, num_batches: int, device: Any) -> Any:
        samples, num_items = original(epoch_iterator, num_batches, device)
        pairs = torch.tensor(sum(int(b["completion_mask"].shape[0]) // 2 for b in samples), device=device)
        if trainer.args.world_size > 1:
            pairs = trainer.accelerator.gather(pairs).sum()
        trainer._packtools_step_pairs = int(pairs)
        return samples, num_items

    trainer.get_batch_samples = get_batch_samples


def _mean_over_step(trainer: Any) -> None:
    """Rescale each training micro-batch's loss (a mean over its pairs) to its share of the step's mean."""
    original = trainer.compute_loss

    def compute_loss(
        model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        with uneven_gather(trainer.accelerator):  # per-pair metrics: ranks hold different numbers of pairs
            result = original(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        step_pairs = getattr(trainer, "_packtools_step_pairs", None)
        if not trainer.model.training or not step_pairs:
            return result
        loss = result[0] if return_outputs else result
        pairs = int(inputs["completion_mask"].shape[0]) // 2
        # Undo what training_step divides by (read from Trainer's own predicate) and DDP's mean over processes.
        divided = trainer_divides_by_accumulation(trainer, num_items_in_batch)
        steps = trainer.current_gradient_accumulation_steps if divided else 1
        scale = pairs * steps * max(trainer.args.world_size, 1) / step_pairs
        loss = loss * scale
        return (loss, result[1]) if return_outputs else loss

    trainer.compute_loss = compute_loss


def _use_packed_dataset(trainer: Any, dataset: Any) -> None:
    from ..batches.preference import REF_COLUMNS, PreferenceCollator

    names = list(getattr(dataset, "column_names", None) or [])
    missing = [c for c in PAIR_ROW_COLUMNS if c not in names]
    if missing:
        raise PackingError(
            f"train_dataset must be packtools.dpo.pack_preference output; it lacks {missing} (has {names}).",
            param="train_dataset",
        )
    pair_columns = []
    if trainer.precompute_ref_logps:
        absent = [c for c in REF_COLUMNS if c not in names]
        if absent:
            raise PackingError(
                f"precompute_ref_log_probs=True but the packed rows lack {absent}: pack the trainer's own "
                f"dataset, which TRL gave the reference log-probs, with pack_preference(trainer.train_dataset, "
                f"max_length, columns={list(REF_COLUMNS)}).",
                param="train_dataset",
            )
        pair_columns = list(REF_COLUMNS)
    collator = PreferenceCollator(trainer._tokenizer.pad_token_id, pair_columns, padding_free=False)
    unpacked = trainer.data_collator

    def collate(features: Any) -> Any:  # packed rows ours, TRL's one-pair rows (eval sets) TRL's
        return collator(features) if SEQ_LENGTHS in features[0] else unpacked(features)

    trainer.train_dataset = dataset
    trainer.data_collator = collate
    if trainer.args.remove_unused_columns:
        trainer._set_signature_columns_if_needed()
        kept = list(trainer._signature_columns or [])
        trainer._signature_columns = kept + [c for c in (*PAIR_ROW_COLUMNS, *pair_columns) if c not in kept]


def prepare_dpo_trainer(
    trainer: Any,
    train_dataset: Any = None,
    *,
    max_tokens: int | None = None,
    check_isolation: bool = True,
    segmented_sdpa: bool = True,
    share_prompt: bool | None = None,
) -> Any:
    """Make a TRL ``DPOTrainer`` run without padding, with TRL's own loss code; returns the trainer.

    Build the trainer as usual (any dataset TRL takes), then call this before ``train()``.  Without
    ``train_dataset`` each micro-batch of TRL's pairs runs through the model as one padding-free row.  With
    ``train_dataset=packtools.dpo.pack_preference(trainer.train_dataset, max_length, ...)`` the trainer trains on
    packed pair rows instead (TRL 1.16 cannot take a tokenized or packed dataset in its constructor, so the
    packed rows come in here; pack ``trainer.train_dataset`` with ``columns=["ref_chosen_logps",
    "ref_rejected_logps"]`` when ``precompute_ref_log_probs=True``)::

        trainer = DPOTrainer(model, args=DPOConfig(...), train_dataset=pairs, processing_class=tokenizer)
        packed = pack_preference(trainer.train_dataset, max_length=4096)
        prepare_dpo_trainer(trainer, train_dataset=packed).train()

    The loss of an optimizer step is the mean over all pairs of the step, over all processes (see the module
    docstring).  ``max_tokens=N`` batches whole pairs (or whole packed pair rows) by a token budget per process,
    balanced across processes by attention cost; with several processes and no ``max_tokens`` each process
    gets ``per_device_train_batch_size`` rows per micro-batch, the same number of micro-batches everywhere, and
    no row is repeated (:mod:`packtools.integrations.budget_loader`).
    With ``check_isolation=True`` (the default) the policy and the reference model first go through
    :func:`packtools.integrations.check_isolation` (tiny inputs, no gradients): a model whose packed sequences leak is
    refused before training; ``check_isolation=False`` skips it.

    With ``segmented_sdpa=True`` (the default) ``sdpa`` models are switched to packtools' per-sequence
    ``sdpa`` (:func:`~packtools.integrations.transformers.use_segmented_sdpa`): the flat row's attention then
    costs ``sum(L_i²)`` like FlashAttention varlen, not ``(sum L_i)²`` under a block-diagonal mask, with the
    same result.  FlashAttention and ``eager`` models are left as they are.

    With ``share_prompt=True`` (the default when ``train_dataset`` comes from ``pack_preference(...,
    share_prompt=True)``) each pair's prompt runs through the model once, on packtools' tree attention
    (:mod:`packtools.integrations.shared_dpo`); models it cannot serve are refused by name.
    """
    require("trl", "packtools.prepare_dpo_trainer")
    _check_trainer(trainer)
    check_loss_path(trainer)
    if vars(trainer).get(_PATCHED):
        raise PackingError("prepare_dpo_trainer was already called on this trainer.")
    models = [m for m in (trainer.model, trainer.ref_model) if m is not None]
    from .shared_dpo import check_tree_models, keep_tree_columns, prepare_shared_prompt, shares_prompt

    shared = shares_prompt(train_dataset) if share_prompt is None else share_prompt
    if shared:  # the tree's own refusal, by name, before any generic probe runs
        check_tree_models(models)
    for model in models:
        check_attention_implementation(model)
    if check_isolation:  # the user's collator must keep every sequence in its own row (collator_check)
        check_preference_collator(trainer)
    with segmented_sdpa_until_checked(models, segmented_sdpa) as switched:
        if check_isolation:
            run_probe(trainer, trainer.ref_model, switched=switched)
        for model in models:
            _check_fused_head(model)
        if not shared:
            for model in models:
                install_padding_free_forward(model)
        if (
            check_isolation and not shared
        ):  # the same probe through the forward training calls (seq_idx and all)
            try:
                for model in models:
                    check_padding_free_forward(model)
            except PackingError:
                for model in models:
                    uninstall_padding_free_forward(model)
                raise
    if shared:
        prepare_shared_prompt(trainer, models, check_isolation)
    guard_model(trainer.model)
    if trainer.ref_model is not None:
        guard_model(trainer.ref_model)
    if train_dataset is not None:
        _use_packed_dataset(trainer, train_dataset)
        keep_tree_columns(trainer)
    install_train_loader(trainer, max_tokens)
    _count_step_pairs(trainer)
    _mean_over_step(trainer)
    object.__setattr__(trainer, _PATCHED, True)
    return trainer
