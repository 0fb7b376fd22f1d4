"""TRL's ``DPOTrainer`` without padding: the same loss, metrics and gradients, on real tokens only.

TRL 1.16 turns ``padding_free=True`` off for DPO and pads every chosen and rejected sequence of a batch to the
longest.  :func:`prepare_dpo_trainer` keeps TRL's loss code as it is and changes only what runs through the
model: the fused-LM-head forward TRL installs is wrapped (:func:`install_padding_free_forward`) so that the
backbone and LM head run on the real tokens only, as one row with ``position_ids`` restarting per sequence and
``cu_seq_lens``, and the per-token outputs are scattered back into TRL's padded ``[2 * pairs, T]`` layout (zero
on padding, as TRL's are).  The step owner (:class:`~packtools.integrations.trainers.step.DPOStep`) makes the
loss of an optimizer step the mean over all its pairs, over all processes.  What each part does, the guards,
several processes and what it is tested against: ``docs/preference.md``.
"""

from __future__ import annotations

from typing import Any

from ..._optional import require
from ...compat import all_or_nothing, set_attr
from ...compat.trl import (
    check_step_methods,
    fused_forward,
    is_vision,
    keep_signature_columns,
    set_training_data,
    tokenizer_of,
    wrap_fused_forward,
)
from ...constants import SEQ_LENGTHS
from ...core.pairs import PAIR_ROW_COLUMNS
from ...core.shared_pairs import PROMPT_LENGTHS
from ...errors import PackingError
from ..attention.backends import (
    attention_implementation,
    check_attention_implementation,
    segmented_sdpa_until_checked,
    sends_seq_idx,
    token_mixing_layers,
)
from ..attention.backends import base_model as _base_model
from ..attention.isolation import trainer_autocast
from ..attention.tree import check_tree_model
from ..multimodal.models import refuse_multimodal
from ..parallel.distributed import check_loss_path
from ..parallel.layout import rank_layout
from ..trainers.collator_check import check_preference_collator
from ..trainers.guard import (
    check_forward_inputs,
    check_length_dependent_rope,
    guard_model,
    length_dependent_rope,
    refuse_prompt_learning,
)
from ..trainers.loader import check_train_loader
from ..trainers.rope_rows import check_rope_rows
from ..trainers.sft import refuse_neftune
from ..trainers.step import DPOStep, StepPlan, install_step, plan_of
from ..trainers.transformers import run_mixers_per_document, run_probe
from .calls import padded_preference_call, padding_free_layout, scatter_per_token
from .context_parallel import check_cp_dpo, prepare_dpo_context_parallel
from .probe import check_padding_free_forward
from .shared_prompt import prepare_shared_prompt

_WRAPPED = "_packtools_padding_free"


def collator_truncation(trainer: Any, pairs: Any) -> int | None:
    """The length TRL's preference collator cuts each ``prompt + chosen`` / ``prompt + rejected`` sequence to
    (its ``max_length``, ``DPOConfig.max_length``: keep_start or keep_end, either way at most that many tokens)
    when ``pairs`` are TRL's tokenized pairs, which it collates; ``None`` otherwise (packtools' packed rows are
    not cut)."""
    names = list(getattr(pairs, "column_names", None) or [])
    if "input_ids" in names or not all(c in names for c in ("prompt_ids", "chosen_ids", "rejected_ids")):
        return None
    limit = getattr(trainer.data_collator, "max_length", None)
    return limit if isinstance(limit, int) and limit > 0 else None


def _padding_free_forward(model: Any, inner: Any, trainer: Any = None) -> Any:
    torch = require("torch", "packtools.prepare_dpo_trainer")
    mixers = tuple(token_mixing_layers(model))
    send_seq_idx = sends_seq_idx(model)
    rope = length_dependent_rope(model)  # the guard's hook sees TRL's padded call, not this row: checked here

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
        check_length_dependent_rope(rope, flat)
        plan = None if trainer is None else plan_of(trainer)
        cp = None if plan is None else plan.cp_forward  # context parallelism: this rank's shard, the row back
        out = inner(fused_lm_head=True, **flat) if cp is None else cp(inner, flat, lengths)
        # Flat output i scores token i + 1; padded (b, j) scores token j + 1 of sequence b.
        target = valid[:, 1:]
        index = (starts[:, None] + torch.arange(width - 1, device=ids.device)[None, :])[target]
        refusal = "models that add virtual tokens (prompt-learning PEFT) cannot run padding-free."
        scatter_per_token(out, flat_ids.shape[0], target, index, refusal)
        return out

    return forward


def install_padding_free_forward(model: Any, *, owner: Any = None) -> None:
    """Wrap the fused-LM-head forward that TRL put on ``model`` (once) so it runs one padding-free row.

    The change is recorded on ``owner`` (the trainer, under :func:`prepare_dpo_trainer`; by default the base
    model itself, undone by :func:`packtools.compat.undo` on it).

    >>> from trl.trainer.utils import add_fused_lm_head
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from packtools.compat import undo
    >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
    ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    >>> add_fused_lm_head(model); trl_forward = vars(model)["forward"]
    >>> install_padding_free_forward(model); vars(model)["forward"] is trl_forward
    False
    >>> _ = undo(model); vars(model)["forward"] is trl_forward
    True
    """
    base = _base_model(model)
    if vars(base).get(_WRAPPED):
        return
    trainer = owner  # the forward reads the trainer's step plan (context parallelism) once it is prepared
    owner = base if owner is None else owner
    wrap_fused_forward(base, lambda inner: _padding_free_forward(base, inner, trainer), owner=owner)
    set_attr(base, _WRAPPED, True, owner=owner)


def _check_trainer(trainer: Any) -> None:
    if not hasattr(trainer, "precompute_ref_logps") or not hasattr(trainer, "loss_types"):
        raise PackingError(
            f"prepare_dpo_trainer expects a trl.DPOTrainer, got {type(trainer).__name__}; for Trainer or "
            f"SFTTrainer use packtools.prepare_trainer."
        )
    if is_vision(trainer):
        raise PackingError("vision preference data is not supported padding-free; keep TRL's padded batches.")
    refuse_prompt_learning(trainer.model, param=None)


def _use_packed_dataset(trainer: Any, dataset: Any, shared: bool) -> None:
    from ...batches.preference import REF_COLUMNS, PreferenceCollator

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
    collator = PreferenceCollator(tokenizer_of(trainer).pad_token_id, pair_columns, padding_free=False)
    unpacked = trainer.data_collator

    def collate(features: Any) -> Any:  # packed rows ours, TRL's one-pair rows (eval sets) TRL's
        return collator(features) if SEQ_LENGTHS in features[0] else unpacked(features)

    set_training_data(trainer, dataset, collate)
    if trainer.args.remove_unused_columns:  # the columns the collator needs survive Trainer's column removal
        tree = [PROMPT_LENGTHS] if shared else []  # the prompt lengths of prompt-shared rows
        keep_signature_columns(trainer, [*PAIR_ROW_COLUMNS, *pair_columns, *tree])


def prepare_dpo_trainer(
    trainer: Any,
    train_dataset: Any = None,
    *,
    max_tokens: int | None = None,
    check_isolation: bool = True,
    segmented_sdpa: bool = True,
    share_prompt: bool | None = None,
    context_parallel: int | None = None,
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

    The loss of an optimizer step is the mean over all pairs of the step, over all processes.  ``max_tokens=N``
    batches whole pairs (or whole packed pair rows) by a token budget per process, balanced across processes
    by attention cost; with several processes and no ``max_tokens`` each process gets
    ``per_device_train_batch_size`` rows per micro-batch, the same number of micro-batches everywhere, and no
    row is repeated (:mod:`packtools.integrations.trainers.loader`).
    With ``check_isolation=True`` (the default) the policy and the reference model first go through
    :func:`packtools.integrations.check_isolation` (tiny inputs, no gradients): a model whose packed sequences leak is
    refused before training; ``check_isolation=False`` skips it.  ``segmented_sdpa``: as in
    :func:`packtools.prepare_trainer`.

    With ``share_prompt=True`` (the default when ``train_dataset`` comes from ``pack_preference(...,
    share_prompt=True)``) each pair's prompt runs through the model once, on packtools' tree attention
    (:mod:`packtools.integrations.preference.shared_prompt`); models it cannot serve are refused by name.

    ``context_parallel=N`` (under ``torchrun``, ``N`` dividing the processes) splits every padding-free row
    across ``N`` consecutive processes, per sequence, on ``packtools_cp`` attention; each pair stays on one
    CP group and the loss is the pair mean over the data-parallel groups (:mod:`packtools.integrations.preference.context_parallel`).
    """
    require("trl", "packtools.prepare_dpo_trainer")
    _check_trainer(trainer)
    check_loss_path(trainer, "prepare_dpo_trainer")
    refuse_neftune(trainer, "padding-free DPO rows", "prepare_dpo_trainer")
    if plan_of(trainer) is not None:
        raise PackingError("prepare_dpo_trainer was already called on this trainer.")
    check_step_methods(trainer)
    with all_or_nothing(trainer):  # a refused trainer is left as TRL built it
        models = [m for m in (trainer.model, trainer.ref_model) if m is not None]
        refuse_multimodal(models, "DPO forwards")
        shared = share_prompt
        if shared is None:  # rows of pack_preference(..., share_prompt=True) carry prompt lengths
            shared = PROMPT_LENGTHS in list(getattr(train_dataset, "column_names", None) or [])
        # the length-dependent RoPE rule on the pairs' lengths, before training (rope_rows); prompt-shared rows
        # too: their seq_lengths are each branch's prompt + completion, the runs the tree's positions make
        pairs = train_dataset if train_dataset is not None else trainer.train_dataset
        batch = 1 if max_tokens is not None else trainer.args.per_device_train_batch_size
        for model in models:
            check_rope_rows(
                model,
                pairs,
                rows_per_forward=batch,
                caller="prepare_dpo_trainer",
                truncated_to=collator_truncation(trainer, pairs),
            )
        layout = rank_layout(trainer, context_parallel)  # refuses what it cannot account for, by name
        if layout.cp_size > 1:
            check_cp_dpo(trainer, layout, shared)
        if shared and getattr(trainer, "aux_loss_enabled", False):
            raise PackingError(
                "share_prompt=True with the MoE router loss on (aux_loss_enabled: router_aux_loss_coef != 0): a "
                "shared prompt runs through the router once, where TRL's padded batch routes it for the chosen "
                "and for the rejected completion, so the load-balancing loss and its gradients would change. "
                "Pack without sharing (pack_preference(..., share_prompt=False), or prepare_dpo_trainer(..., "
                "share_prompt=False)), or set router_aux_loss_coef=0.0 in DPOConfig.",
                param="share_prompt",
            )
        if shared:  # the tree's own refusal, by name, before any generic probe runs
            for model in models:
                check_tree_model(model)
        for model in models:
            check_attention_implementation(model)
            if not shared:  # token-mixing layers per document (integrations.attention.mixers)
                run_mixers_per_document(model, owner=trainer)
        if check_isolation:  # the user's collator must keep every sequence in its own row (collator_check)
            check_preference_collator(trainer)
        with segmented_sdpa_until_checked(models, segmented_sdpa, owner=trainer) as switched:
            if check_isolation:
                run_probe(trainer, trainer.ref_model, switched=switched)
            for model in models:
                fused_forward(_base_model(model))  # TRL's fused LM head must be there to be wrapped
            if not shared:
                for model in models:
                    install_padding_free_forward(model, owner=trainer)
            if check_isolation and not shared:  # the probe again, through the forward training calls
                with trainer_autocast(trainer):  # at the precision training runs
                    for model in models:
                        check_padding_free_forward(model)
        if shared:
            with trainer_autocast(trainer):  # the tree probe at the precision training runs
                prepare_shared_prompt(trainer, models, check_isolation)
        guard_model(
            trainer.model, owner=trainer, check_isolation=False
        )  # recorded on the trainer (unprepare removes the hook)
        if trainer.ref_model is not None:
            guard_model(trainer.ref_model, owner=trainer, check_isolation=False)
        if train_dataset is not None:
            _use_packed_dataset(trainer, train_dataset, shared)
        cp_forward = None
        if layout.cp_size > 1:
            layout, cp_forward = prepare_dpo_context_parallel(trainer, layout, models)
        check_train_loader(trainer, max_tokens)
        install_step(trainer, DPOStep, StepPlan(layout, max_tokens=max_tokens, cp_forward=cp_forward))
    return trainer
