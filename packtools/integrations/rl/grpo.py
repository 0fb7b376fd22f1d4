"""TRL's ``GRPOTrainer`` and ``RLOOTrainer`` with every log-probability forward padding-free.

TRL 1.16 computes the policy's, the old policy's (``num_iterations > 1``, or generation and optimization out of
step) and the reference model's (``beta > 0``) per-token log-probabilities in one method,
``_get_per_token_logps_and_entropies``, on a padded ``[B, P + C]`` batch (prompts left-padded, completions
right-padded, the prompt repeated for every completion).  :func:`prepare_grpo_trainer` swaps the trainer's class
for a packtools subclass of it (:class:`PackedRLStep` first in its MRO) whose version of that method runs each
forward chunk TRL asks for (``batch_size`` sequences, as TRL chunks) as one prompt-shared row on the tree
attention (:func:`~packtools.integrations.rl.rows.share_prompts`: the equal prompts of the chunk once, the
default wherever the models can serve it) or one plain padding-free row
(:func:`~packtools.integrations.rl.rows.unpad_completions`), and scatters the log-probabilities
and entropies back into TRL's ``[B, C]`` layout, zero where TRL's are zero.  TRL's ``_compute_loss`` (every
``loss_type``, ``importance_sampling_level``, ``top_entropy_quantile``, the KL term, the MoE aux loss),
``_generate_and_score_completions`` and ``Trainer``'s accumulation run unchanged.

The layout is decided once, in ``prepare_grpo_trainer`` (:func:`choose_layout`, the ``share_prompt`` argument:
``"auto"`` by default), kept in the :class:`RLPlan` with its reason and logged; no step re-derives it.  There is
no row budget here: each forward TRL asks for is one row, and a prompt-shared row never holds more tokens (nor
attention pairs) than the plain row of the same sequences (a prompt of ``p`` tokens held by ``k`` sequences is
``p - 1 + k`` tokens instead of ``k p``), so a group never "does not fit" the shared layout; a group cut across
forwards (TRL's shuffled micro-batches) shares its prompt within each forward, exactly.

Positions restart at 0 for every sequence (what ``generate`` gives a left-padded prompt).  TRL's padded forward
numbers a left-padded prompt's tokens from the row's start instead; rotary positions only see differences, so
the two agree to float rounding, and the isolation probe (run by ``prepare_grpo_trainer``) compares TRL's padded
method and packtools' on a small batch with left padding, so a model with absolute positions is refused there.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

from ..._optional import require
from ...batches.tree import TREE_KEY
from ...compat import all_or_nothing
from ...compat.trl import (
    GRPO_LOSS_TYPES,
    RL_MEDIA_PARAMS,
    refuse_headless_base_model,
    rl_trainer_kind,
    trl_logps,
)
from ...errors import PackingError
from ..attention.backends import (
    attention_implementation,
    base_model,
    check_attention_implementation,
    segmented_sdpa_until_checked,
    sends_seq_idx,
    token_mixing_layers,
)
from ..attention.isolation import ProbeDiffs, autocast_inside, compute_dtype, trainer_autocast
from ..attention.mixers import POSITIONLESS_MASKS, run_mixers_per_document
from ..attention.tree import check_tree_model, use_tree_attention
from ..multimodal.models import refuse_multimodal
from ..parallel.distributed import refuse_data_parallel
from ..trainers.guard import (
    check_forward_inputs,
    check_length_dependent_rope,
    length_dependent_rope,
    refuse_prompt_learning,
)
from ..trainers.sft import refuse_neftune
from ..trainers.step import install_step, plan_of
from .groups import GroupBalancedSampler, choose_balance, prompt_token_counter
from .rows import Row, probe_batch, share_prompts, unpad_completions


@dataclass(frozen=True)
class RLPlan:
    """The per-run decisions of ``prepare_grpo_trainer``, one frozen value on the trainer, stored with the class
    swap by the one step owner (:func:`packtools.integrations.trainers.step.install_step`, read by ``step.plan_of``)."""

    trl_class: type  # GRPOTrainer or RLOOTrainer: whose padded method the probe compares against
    share_prompt: bool  # equal prompts of a forward run once, on the tree attention
    seq_idx: bool  # the model's token-mixing layers read seq_idx
    layout_reason: str = ""  # why this layout (the share_prompt argument and what the models allow)
    balance_groups: bool = False  # the sampler moves whole groups to balance the ranks' prompt tokens
    balance_reason: str = ""  # why (or why not)

    def summary(self) -> str:
        """One line for the log and the user: the layout of every log-probability forward, the ranks' groups,
        and why.

        >>> RLPlan(object, True, False, "the models can serve it", False, "one process").summary()
        "prompt-shared rows (each forward's equal prompts once, tree attention): the models can serve it; groups: one process"
        """
        layout = (
            "prompt-shared rows (each forward's equal prompts once, tree attention)"
            if self.share_prompt
            else "plain padding-free rows (each prompt once per completion)"
        )
        return f"{layout}: {self.layout_reason}; groups: {self.balance_reason}"


def _back(value: Any, row: Row, name: str) -> Any:
    """``[1, N - 1]`` per-token outputs of the flat row -> TRL's ``[B, C]`` (zeros where no completion token)."""
    if value.shape[-1] != row.ids.shape[0] - 1:
        raise PackingError(
            f"the model's {name} has {value.shape[-1]} positions for {row.ids.shape[0]} tokens; models that add "
            f"virtual tokens (prompt-learning PEFT) cannot run padding-free."
        )
    # masked_scatter keeps the result connected to the model even when no completion token is real (TRL's way).
    return value.new_zeros(row.dest.shape).masked_scatter(row.dest, value[0, row.source])


def _row_inputs(row: Row, plan: RLPlan, model: Any) -> dict[str, Any]:
    torch = require("torch", "packtools.prepare_grpo_trainer")
    inputs = {"input_ids": row.ids[None], "labels": row.labels[None], "position_ids": row.positions[None]}
    # A length-dependent rotary embedding rotates every sequence of the row for its longest one (the model is
    # not guarded: its forward's hook would not see these rows' lengths either way).
    check_length_dependent_rope(length_dependent_rope(model), inputs)
    if row.tree is not None:
        inputs[TREE_KEY] = row.tree
        return inputs
    inputs.update(
        cu_seq_lens_q=row.cu, cu_seq_lens_k=row.cu, max_length_q=row.longest, max_length_k=row.longest
    )
    if plan.seq_idx:  # Mamba-2 style layers read only seq_idx in their kernels
        lengths = (row.cu[1:] - row.cu[:-1]).long()
        n = lengths.shape[0]
        inputs["seq_idx"] = torch.repeat_interleave(
            torch.arange(n, dtype=torch.int32, device=row.ids.device), lengths
        )[None]
    check_forward_inputs(inputs, attention_implementation(model), tuple(token_mixing_layers(model)))
    return inputs


def padding_free_logps(
    trainer: Any, model: Any, batch: tuple[Any, Any, int], *, batch_size: Any, entropy: bool, aux: bool
) -> tuple[Any, Any, Any]:
    """What TRL's ``_get_per_token_logps_and_entropies`` returns, each chunk of ``batch_size`` sequences of
    ``batch = (input_ids, attention_mask, logits_to_keep)`` run as one padding-free (or prompt-shared) row."""
    torch = require("torch", "packtools.prepare_grpo_trainer")
    plan: RLPlan = plan_of(trainer)  # type: ignore[assignment]
    input_ids, attention_mask, keep = batch
    size = batch_size or input_ids.size(0)
    logps, entropies, aux_losses = [], [], []
    for start in range(0, input_ids.size(0), size):
        ids, mask = input_ids[start : start + size], attention_mask[start : start + size]
        row = (share_prompts if plan.share_prompt else unpad_completions)(ids, mask, keep)
        inputs = _row_inputs(row, plan, model)
        if aux:
            inputs["output_router_logits"] = True
        with trainer.accelerator.autocast():
            out = model(**inputs, fused_lm_head=True)
        if row.tree is not None:  # the forward went through the tree attention, or this raises
            row.tree.reads.take(None, "prepare_grpo_trainer (prompt-shared rows)")
        logps.append(_back(out.log_probs, row, "log_probs"))
        if entropy:
            entropies.append(_back(out.entropy, row, "entropy"))
        if aux:
            aux_losses.append(out.aux_loss)
    return (
        torch.cat(logps, dim=0),
        torch.cat(entropies, dim=0) if entropy else None,
        torch.stack(aux_losses).mean() if aux else None,
    )


class PackedRLStep:
    """The step owner of a prepared ``GRPOTrainer`` / ``RLOOTrainer``: its log-probability forwards, padding-free.

    ``prepare_grpo_trainer`` makes it the first class of the trainer's own (``step.install_step``):

    >>> from packtools.integrations.trainers.step import packed_class
    >>> GRPOTrainer = type("GRPOTrainer", (), {})
    >>> [c.__name__ for c in packed_class(GRPOTrainer, PackedRLStep).__mro__[:3]]
    ['PackedGRPOTrainer', 'PackedRLStep', 'GRPOTrainer']
    """

    def _get_per_token_logps_and_entropies(  # noqa: PLR0913 - TRL's signature, media arguments refused by name
        self,
        model: Any,
        input_ids: Any,
        attention_mask: Any,
        logits_to_keep: int,
        batch_size: Any = None,
        compute_entropy: bool = False,
        compute_aux_loss: bool = False,
        **media: Any,
    ) -> tuple[Any, Any, Any]:
        unknown = sorted(set(media) - set(RL_MEDIA_PARAMS))
        if unknown:
            raise TypeError(f"_get_per_token_logps_and_entropies got unexpected arguments {unknown}")
        given = sorted(k for k, v in media.items() if v is not None)
        if given:
            raise PackingError(
                f"the GRPO/RLOO batch carries {given}: packtools' padding-free rows carry text only (images are not "
                f"supported). Train this model padded: packtools.integrations.unprepare(trainer)."
            )
        return padding_free_logps(
            self,
            model,
            (input_ids, attention_mask, logits_to_keep),
            batch_size=batch_size,
            entropy=compute_entropy,
            aux=compute_aux_loss,
        )

    def _get_train_sampler(self, dataset: Any = None) -> Any:
        """TRL's sampler; under data parallelism (``RLPlan.balance_groups``) its generation batches' whole groups
        reordered to balance the ranks' prompt tokens (:class:`~packtools.integrations.rl.groups.GroupBalancedSampler`)."""
        sampler = super()._get_train_sampler(dataset)  # type: ignore[misc]
        plan: RLPlan = plan_of(self)  # type: ignore[assignment]
        if not plan.balance_groups:
            return sampler
        return GroupBalancedSampler(
            sampler,
            group=int(self.num_generations),  # type: ignore[attr-defined]
            block=int(self.args.generation_batch_size),  # type: ignore[attr-defined]
            ranks=int(self.accelerator.num_processes),  # type: ignore[attr-defined]
            prompt_tokens=prompt_token_counter(self, self.train_dataset if dataset is None else dataset),  # type: ignore[attr-defined]
        )


def check_rl_forward(trainer: Any, model: Any, entropy: bool) -> float:
    """Compare packtools' log-probabilities (and entropies) with TRL's padded method on a small batch; raise
    unless they agree, and unless changing every other sequence (a sibling sharing the prompt included) leaves
    the first sequence's values where they were.  Returns the largest difference.  No gradients; the model's
    mode is restored."""
    torch = require("torch", "packtools.prepare_grpo_trainer")
    plan: RLPlan = plan_of(trainer)  # type: ignore[assignment]
    ids, mask, keep = probe_batch(model)
    base = base_model(model)
    training = base.training
    base.eval()
    name = type(base).__name__
    try:
        with torch.no_grad():
            with autocast_inside(base) as seen:
                theirs = trl_logps(plan.trl_class, trainer, model, ids, mask, keep, compute_entropy=entropy)
                ours = padding_free_logps(
                    trainer, model, (ids, mask, keep), batch_size=None, entropy=entropy, aux=False
                )
            # The tolerance of the precision the forwards compute in: _install runs this under the trainer's
            # autocast, and a model whose forward accelerate wrapped enters it itself (read from inside: seen),
            # where a float32 model trained with bf16=True / fp16=True computes in half precision.
            probe = ProbeDiffs(compute_dtype(base, seen=seen))
            for what, a, b in (("log-probabilities", ours[0], theirs[0]), ("entropies", ours[1], theirs[1])):
                if a is None:
                    continue
                diff = probe.exceeds(a, b)
                if diff is not None:
                    raise PackingError(
                        f"{name}: packtools' padding-free {what} differ from TRL's padded ones by {diff:.3g} on the "
                        f"isolation probe (left-padded prompts); this model cannot run GRPO/RLOO padding-free "
                        f"exactly (absolute position embeddings, or a leak). Train it padded, and please report it."
                    )
            moved = ids.clone()
            moved[1:, -keep:] = (moved[1:, -keep:] + 1) % int(base.config.get_text_config().vocab_size)
            moved[2:] = (moved[2:] + 1) % int(base.config.get_text_config().vocab_size)
            again = padding_free_logps(
                trainer, model, (moved, mask, keep), batch_size=None, entropy=False, aux=False
            )
            diff = float((again[0][0] - ours[0][0]).abs().max())
            if diff > probe.tol:
                raise PackingError(
                    f"{name}: changing the other sequences of a padding-free GRPO row moved the first sequence's "
                    f"log-probabilities by {diff:.3g}; tokens leak across sequences. Train it padded."
                )
    finally:
        base.train(training)
    return probe.worst


def _check_models(trainer: Any, models: list[Any]) -> bool:
    """Refusals by name; returns whether the models' token-mixing layers need ``seq_idx``."""
    if getattr(trainer.args, "use_liger_kernel", False):
        raise PackingError(
            "use_liger_kernel=True: Liger's kernels were not checked on padding-free GRPO/RLOO rows; set "
            "use_liger_kernel=False, or train padded.",
            param="use_liger_kernel",
        )
    refuse_neftune(trainer, "padding-free GRPO/RLOO rows", "prepare_grpo_trainer")
    loss_type = getattr(trainer, "loss_type", None)
    if hasattr(trainer, "loss_type") and loss_type not in GRPO_LOSS_TYPES:
        raise PackingError(
            f"loss_type={loss_type!r} is not one packtools checked ({', '.join(GRPO_LOSS_TYPES)}); train padded.",
            param="loss_type",
        )
    refuse_multimodal(models, "GRPO/RLOO rows")
    seq_idx = False
    for model in models:
        refuse_headless_base_model(base_model(model), type(trainer).__name__, "GRPO/RLOO")
        refuse_prompt_learning(model)
        check_attention_implementation(model)
        seq_idx = seq_idx or sends_seq_idx(model)
    return seq_idx


#: The attention implementations transformers' continuous-batching generation runs on (5.x,
#: ``ContinuousMixin.switch_to_cb_friendly_attn``): these, and FlashAttention's.
CONTINUOUS_BATCHING_ATTENTION = ("sdpa", "eager", "paged|eager")


def refuse_continuous_batching(trainer: Any, plan: RLPlan) -> None:
    """Refuse TRL's ``use_transformers_continuous_batching`` (or the deprecated ``use_transformers_paged``) when
    the attention packtools installed on the policy for its forwards is one transformers' continuous batching
    cannot generate with (``packtools_tree``, ``packtools_sdpa``): TRL generates with the same model, so the
    first step would stop inside ``generate_batch`` on an error naming an implementation the user never chose."""
    if not getattr(trainer, "use_transformers_continuous_batching", False):
        return
    impl = attention_implementation(trainer.model) or ""
    if impl in CONTINUOUS_BATCHING_ATTENTION or ("flash" in impl and not impl.startswith("paged|")):
        return
    layout = "prompt-shared rows" if plan.share_prompt else "plain rows on packtools' per-sequence sdpa"
    raise PackingError(
        f"use_transformers_continuous_batching=True (or use_transformers_paged=True): transformers' continuous "
        f"batching generates only with sdpa, eager or FlashAttention, and packtools runs the policy on {impl!r} "
        f"({layout}). Use prepare_grpo_trainer(trainer, share_prompt=False, segmented_sdpa=False) (plain rows on "
        f"the model's own attention), or set use_transformers_continuous_batching=False.",
        param="use_transformers_continuous_batching",
    )


def prompt_sharing_refusal(trainer: Any, models: list[Any]) -> str | None:
    """Why this run's forwards cannot share prompts on the tree attention (the first reason found), or ``None``.

    The refusals of ``share_prompt=True``: an MoE aux loss (TRL's load-balancing loss counts every prompt token
    of every completion, a shared prompt counts once); a model :func:`check_tree_model` refuses (token-mixing
    layers outside attention, which would run the shared row as one sequence, sliding-window or chunked layers,
    ALiBi, softcapping, no ``position_ids``); a model whose forward builds its masks without ``position_ids``
    (:data:`~packtools.integrations.attention.mixers.POSITIONLESS_MASKS`, served per document on plain rows)."""
    if getattr(trainer, "aux_loss_enabled", False):
        return (
            "an MoE aux loss: TRL's load-balancing loss counts every prompt token of every completion, a shared "
            "prompt counts once"
        )
    for model in models:
        try:
            check_tree_model(model)
        except PackingError as err:
            return str(err)
        config = getattr(base_model(model), "config", None)
        if getattr(config, "model_type", None) in POSITIONLESS_MASKS:
            return (
                f"{type(base_model(model)).__name__} builds its attention masks without position_ids (served per "
                f"document on plain rows only)"
            )
    return None


def choose_layout(trainer: Any, models: list[Any], share_prompt: bool | str) -> tuple[bool, str]:
    """``(share, reason)``: the layout of every log-probability forward of the run, decided once.

    ``"auto"`` shares when :func:`prompt_sharing_refusal` finds nothing, else plain padding-free rows (the
    reason says why); ``True`` shares or raises that reason by name; ``False`` forces plain rows."""
    if not (isinstance(share_prompt, bool) or share_prompt == "auto"):
        raise PackingError(
            f"share_prompt={share_prompt!r}: expected True, False or 'auto'.", param="share_prompt"
        )
    if share_prompt is False:
        return False, "share_prompt=False (asked)"
    refusal = prompt_sharing_refusal(trainer, models)
    if share_prompt is True:
        if refusal is not None:
            raise PackingError(
                f"share_prompt=True: {refusal.rstrip('.')}; use share_prompt=False.", param="share_prompt"
            )
        return True, "share_prompt=True (asked)"
    if refusal is not None:
        return False, f"share_prompt='auto' and the prompt cannot be shared: {refusal}"
    return True, "share_prompt='auto' and the models can serve the tree attention"


def _install(
    trainer: Any, models: list[Any], plan: RLPlan, *, check_isolation: bool, segmented_sdpa: bool
) -> None:
    """Install ``plan`` on ``trainer`` and probe its models; all or nothing (a refused trainer is left as TRL
    built it)."""
    with all_or_nothing(trainer):
        install_step(trainer, PackedRLStep, plan)  # the class swap and the plan, undone by unprepare
        # token-mixing layers per document (attention.mixers), as prepare_trainer does
        if not plan.share_prompt:
            for model in models:
                run_mixers_per_document(model, owner=trainer)
        with (
            segmented_sdpa_until_checked(models, segmented_sdpa and not plan.share_prompt, owner=trainer),
            trainer_autocast(trainer),  # the tree probe too, at the precision training runs
        ):
            for model in models:
                if plan.share_prompt:
                    use_tree_attention(model, check_isolation=check_isolation, owner=trainer)
                if check_isolation:
                    check_rl_forward(trainer, model, entropy=model is trainer.model)


def prepare_grpo_trainer(
    trainer: Any,
    *,
    check_isolation: bool = True,
    segmented_sdpa: bool = True,
    share_prompt: bool | str = "auto",
    balance_groups: bool | str = "auto",
) -> Any:
    """Make a TRL ``GRPOTrainer`` or ``RLOOTrainer`` compute every log-probability forward padding-free; returns it.

    Build the trainer as usual, then call this before ``train()``::

        trainer = prepare_grpo_trainer(GRPOTrainer(model, reward_funcs=reward, args=GRPOConfig(...),
                                                   train_dataset=prompts))
        trainer.train()

    The policy, the old policy and the reference model (a separate model or the policy under a disabled PEFT
    adapter) forward only real tokens, one padding-free row per forward chunk TRL asks for; TRL's loss code, its
    generation and its metrics are unchanged (see the module docstring).

    ``share_prompt`` decides the rows, once for the run (:func:`choose_layout`): ``"auto"`` (the default) runs
    each distinct prompt of a forward once, its completions after it on packtools' tree attention, wherever the
    models can serve it, and plain padding-free rows otherwise (models the tree cannot serve, MoE models with an
    aux loss: :func:`prompt_sharing_refusal`); ``True`` shares or raises that reason by name; ``False`` forces
    plain rows; where ``"auto"`` chose shared rows and the tree attention then fails its isolation probe (a
    backend not run here before, e.g. flash-attn's varlen kernel on a GPU), the run falls back to plain rows,
    probed on their own, with the probe's message as the reason (logged at WARNING).  The choice and its reason
    are in ``RLPlan.summary()`` (``plan_of(trainer)``), logged on the
    ``packtools`` logger at INFO.  ``balance_groups`` (data parallelism; decided once,
    :func:`~packtools.integrations.rl.groups.choose_balance`): ``"auto"`` (the default) keeps each group on one rank
    and reorders the groups of each generation batch so the ranks carry nearly equal prompt tokens, wherever TRL's
    sampler gives whole groups per rank (else TRL's order, the reason in the summary); ``True`` balances or raises
    by name; ``False`` keeps TRL's order.  On plain rows a hybrid model's token-mixing layers run per document
    (:func:`~packtools.integrations.attention.mixers.run_mixers_per_document`).  ``segmented_sdpa`` switches ``sdpa``
    models to packtools' per-sequence ``sdpa`` (cost ``sum L_i^2``).  With ``check_isolation=True`` (the default)
    each model first runs :func:`check_rl_forward`: packtools' values must equal TRL's padded ones on a small
    batch, and no sequence may see another.  Refused by name: another trainer, a TRL version outside
    :data:`~packtools.compat.trl.RL_CHECKED`, an unknown ``loss_type``, ``use_liger_kernel``, ``neftune_noise_alpha``
    (NEFTune's noise scales with the width of the batch it sees, which a padding-free row changes), a model TRL's
    fused LM head cannot run (Llama 4), multimodal models or image batches, prompt-learning adapters, attention backends that cannot isolate
    packed sequences, TRL's continuous-batching generation on an attention packtools installed
    (:func:`refuse_continuous_batching`).  ``packtools.integrations.unprepare(trainer)`` restores the trainer as
    TRL built it.
    """
    require("trl", "packtools.prepare_grpo_trainer")
    if plan_of(trainer) is not None:
        raise PackingError("prepare_grpo_trainer was already called on this trainer.")
    trl_class, _ = rl_trainer_kind(trainer)
    refuse_data_parallel(trainer, "prepare_grpo_trainer")
    models = [m for m in (trainer.model, getattr(trainer, "ref_model", None)) if m is not None]
    with all_or_nothing(trainer):
        seq_idx = _check_models(trainer, models)
        share, reason = choose_layout(trainer, models, share_prompt)
        balance, balance_reason = choose_balance(trainer, balance_groups)
    plan = RLPlan(trl_class, share, seq_idx, reason, balance, balance_reason)
    with all_or_nothing(trainer):
        try:
            _install(trainer, models, plan, check_isolation=check_isolation, segmented_sdpa=segmented_sdpa)
        except PackingError as err:
            if not (share and share_prompt == "auto"):
                raise
            # "auto": the tree's probes refused a model the static checks let through (a backend not yet run
            # here, e.g. flash-attn's varlen kernel on a GPU); plain rows are probed on their own, and the plan
            # says why.
            why = f"share_prompt='auto' and the tree attention failed its probe ({str(err).rstrip('.')})"
            plan = replace(plan, share_prompt=False, layout_reason=why)
            _install(trainer, models, plan, check_isolation=check_isolation, segmented_sdpa=segmented_sdpa)
            logging.getLogger("packtools").warning("packtools: prepare_grpo_trainer: %s", plan.summary())
        refuse_continuous_batching(trainer, plan)
    logging.getLogger("packtools").info("packtools: prepare_grpo_trainer: %s", plan.summary())
    return trainer
