"""TRL's ``DistillationTrainer`` with the student's and the teacher's forwards padding-free.

TRL 1.16's ``DistillationTrainer`` generates completions for its prompts (on-policy), then runs the student and
the teacher on ``cat(prompt_ids, completion_ids)`` -- prompts padded on the left, completions on the right -- through
one method, ``_get_last_hidden_state`` (each model's backbone, ``attention_mask`` over the padding), and compares
their next-token distributions at the completion tokens (its chunked divergence, ``beta`` between forward and
reverse KL).  :func:`prepare_distillation_trainer` makes that method run every sequence of the batch as its own
document of one padding-free row (:func:`~packtools.integrations.rl.rows.unpad_completions`: positions restarting
at 0, ``cu_seq_lens``, no padding), for the student and the teacher alike, and puts each completion token's hidden
state back where TRL reads it.  TRL's loss, logged metrics, generation and loader are its own, unchanged.

Before training, both models are checked: an attention backend that cannot keep documents apart, token-mixing
layers (hybrids), masks built without ``position_ids`` (GPT-OSS), a multimodal student, a sharded model and NEFTune
are refused by name, and :func:`packtools.integrations.check_isolation` runs on each, then
:func:`check_distillation_forward` (TRL's padded forward against the padding-free one on left-padded prompts: models
with absolute position embeddings are refused).  Every forward's inputs are checked as the guard checks a model's
(the backbone is called directly, past the model's own hooks).

Exact: one micro-batch's loss, entropy and gradients, and two optimizer steps, equal TRL's padded ones
(``tests/test_distillation.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..._optional import is_instance, require
from ...compat.trl import trl_last_hidden_state
from ...errors import PackingError
from ..attention.backends import (
    attention_implementation,
    check_attention_implementation,
    token_mixing_layers,
)
from ..attention.isolation import (
    ProbeDiffs,
    autocast_inside,
    compute_dtype,
    trainer_autocast,
)
from ..attention.isolation import check_isolation as _check_isolation
from ..attention.mixers import POSITIONLESS_MASKS
from ..multimodal.models import refuse_multimodal
from ..parallel.distributed import is_sharded, refuse_data_parallel
from ..trainers.guard import check_forward_inputs, check_length_dependent_rope, length_dependent_rope
from ..trainers.sft import refuse_neftune
from ..trainers.step import STEP_METHODS, install_step, overriding_classes, plan_of, qualified_name
from .rows import probe_batch, unpad_completions

#: The methods of TRL's ``DistillationTrainer`` that a subclass may not override: packtools has not checked them.
DISTILLATION_METHODS = (*STEP_METHODS, "_get_last_hidden_state", "_generate_and_score_completions")


@dataclass(frozen=True)
class DistillationPlan:
    """The run's decision, one frozen value on the trainer (``step.plan_of``): which models run padding-free."""

    models: tuple[str, ...] = ("student", "teacher")

    def summary(self) -> str:
        """What the plan trains on, in words.

        >>> DistillationPlan().summary()
        'padding-free rows for the student and the teacher (each sequence its own document)'
        """
        return f"padding-free rows for the {' and the '.join(self.models)} (each sequence its own document)"


def _backbone(model: Any) -> Any:
    """The module TRL's ``_get_last_hidden_state`` calls: the (PEFT-unwrapped) model's ``base_model``."""
    inner = getattr(getattr(model, "base_model", None), "model", None)
    if is_instance(model, "peft", "PeftModel") and inner is not None:
        model = inner
    return model, model.base_model


def padding_free_hidden(model: Any, input_ids: Any, attention_mask: Any, logits_to_keep: int) -> Any:
    """What TRL's ``_get_last_hidden_state`` returns (``[B, logits_to_keep, H]``: the hidden state that predicts
    each completion token), from one padding-free row of the batch's sequences; zeros where no completion token."""
    model, backbone = _backbone(model)
    row = unpad_completions(input_ids, attention_mask, logits_to_keep)
    inputs = {
        "input_ids": row.ids[None],
        "position_ids": row.positions[None],
        "cu_seq_lens_q": row.cu,
        "cu_seq_lens_k": row.cu,
        "max_length_q": row.longest,
        "max_length_k": row.longest,
        "use_cache": False,
    }
    check_forward_inputs(inputs, attention_implementation(model), tuple(token_mixing_layers(model)))
    check_length_dependent_rope(length_dependent_rope(model), inputs)
    hidden = backbone(**inputs).last_hidden_state  # [1, N, H]
    if hidden.shape[1] != row.ids.shape[0]:
        raise PackingError(
            f"{type(model).__name__}'s backbone returned {hidden.shape[1]} positions for {row.ids.shape[0]} tokens; "
            f"models that add virtual tokens (prompt-learning PEFT) cannot run padding-free."
        )
    dest = row.dest[..., None].expand(*row.dest.shape, hidden.shape[-1])
    return hidden.new_zeros(dest.shape).masked_scatter(dest, hidden[0, row.source])


class PackedDistillationStep:
    """The step owner of a prepared ``DistillationTrainer``: its student and teacher forwards, padding-free.

    >>> from packtools.integrations.trainers.step import packed_class
    >>> DistillationTrainer = type("DistillationTrainer", (), {})
    >>> [c.__name__ for c in packed_class(DistillationTrainer, PackedDistillationStep).__mro__[:3]]
    ['PackedDistillationTrainer', 'PackedDistillationStep', 'DistillationTrainer']
    """

    def _get_last_hidden_state(
        self, unwrapped_model: Any, input_ids: Any, attention_mask: Any, logits_to_keep: int, **media: Any
    ) -> Any:
        given = sorted(k for k, v in media.items() if v is not None)
        if given:
            raise PackingError(
                f"the distillation batch carries {given}: packtools' padding-free rows carry text only. Train "
                f"this model padded: packtools.integrations.unprepare(trainer)."
            )
        return padding_free_hidden(unwrapped_model, input_ids, attention_mask, logits_to_keep)


def _check_subclass(trainer: Any) -> None:
    """Refuse a subclass (TRL's or yours) that overrides a method packtools has not checked."""
    for cls, methods in overriding_classes(trainer, DISTILLATION_METHODS):
        if qualified_name(cls) == "trl.trainer.distillation_trainer.DistillationTrainer":  # defines them all
            return
        raise PackingError(
            f"prepare_distillation_trainer got a {type(trainer).__name__}: {qualified_name(cls)} overrides "
            f"{', '.join(methods)}, which packtools has not checked padding-free. Train it padded (without "
            f"prepare_distillation_trainer), or subclass trl.DistillationTrainer without them.",
            param="trainer",
        )


def _check_model(model: Any, role: str) -> None:
    check_attention_implementation(model)
    unwrapped = _backbone(model)[0]
    if getattr(getattr(unwrapped, "config", None), "model_type", None) in POSITIONLESS_MASKS:
        raise PackingError(
            f"the {role} {type(unwrapped).__name__} builds its attention masks without position_ids, and "
            f"prepare_distillation_trainer calls its backbone directly, past the hooks that build them per document: "
            f"the sequences of a padding-free row would attend to each other. Train it padded.",
            param="model" if role == "student" else "teacher_model",
        )
    mixers = list(token_mixing_layers(model))
    if mixers:
        raise PackingError(
            f"the {role} {type(model).__name__} has token-mixing layers {mixers[:3]} that ignore position_ids: "
            f"prepare_distillation_trainer runs attention-only models padding-free. Train it padded.",
            param="model" if role == "student" else "teacher_model",
        )


def check_distillation_forward(trainer: Any, model: Any, role: str) -> float:
    """Compare packtools' padding-free hidden states with TRL's padded ``_get_last_hidden_state`` on a small batch
    with left-padded prompts, at every completion token; raise unless they agree.  Returns the largest difference.

    TRL's padded forward numbers a left-padded prompt's tokens from the row's start; a padding-free row numbers
    them from 0 (as ``generate`` does).  Rotary positions see only differences, so the two agree to rounding;
    learned absolute positions (GPT-2) do not, and the loss, entropy and gradients would differ from TRL's step
    with no error.  No gradients; the model's mode is restored."""
    torch = require("torch", "packtools.prepare_distillation_trainer")
    unwrapped = trainer.accelerator.unwrap_model(model)
    ids, mask, keep = probe_batch(unwrapped)
    base = _backbone(unwrapped)[0]
    training = base.training
    base.eval()
    try:
        with torch.no_grad(), trainer_autocast(trainer), autocast_inside(base) as seen:
            theirs = trl_last_hidden_state(trainer, unwrapped, ids, mask, keep)
            ours = padding_free_hidden(unwrapped, ids, mask, keep)
        real = mask[:, -keep:].bool()
        probe = ProbeDiffs(compute_dtype(base, seen=seen))
        diff = probe.exceeds(ours[real].float(), theirs[real].float())
    finally:
        base.train(training)
    if diff is not None:
        raise PackingError(
            f"the {role} {type(base).__name__}: packtools' padding-free hidden states differ from TRL's padded ones "
            f"by {diff:.3g} on the probe (left-padded prompts); this model cannot run distillation padding-free "
            f"exactly (absolute position embeddings: TRL numbers a left-padded prompt from the row's start; or a "
            f"leak). Train it padded (without prepare_distillation_trainer).",
            param="model" if role == "student" else "teacher_model",
        )
    return probe.worst


def prepare_distillation_trainer(trainer: Any, *, check_isolation: bool = True) -> Any:
    """Make a TRL ``DistillationTrainer`` run its student and teacher forwards padding-free; returns it.

    Call it once, after building the trainer and before ``train()``::

        trainer = prepare_distillation_trainer(DistillationTrainer(model, teacher_model=teacher,
                                                                   args=DistillationConfig(...), ...))
        trainer.train()

    ``check_isolation=False`` skips the probes of both models: the isolation probe, and the comparison with TRL's
    padded forward on left-padded prompts (:func:`check_distillation_forward`, which refuses models with absolute
    position embeddings, e.g. GPT-2).  ``packtools.integrations.unprepare``
    gives the trainer its class back.

    >>> prepare_distillation_trainer(object())  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    packtools.errors.PackingError: prepare_distillation_trainer expects a trl.DistillationTrainer, got object...
    """
    if not is_instance(trainer, "trl", "DistillationTrainer"):
        raise PackingError(
            f"prepare_distillation_trainer expects a trl.DistillationTrainer, got {type(trainer).__name__}; for "
            f"Trainer or SFTTrainer use packtools.prepare_trainer.",
            param="trainer",
        )
    require("torch", "packtools.prepare_distillation_trainer")
    if plan_of(trainer) is not None:
        return trainer
    _check_subclass(trainer)
    refuse_data_parallel(trainer, "prepare_distillation_trainer")
    refuse_neftune(trainer, "padding-free rows", "prepare_distillation_trainer")
    if getattr(trainer, "_is_vlm", False):
        raise PackingError(
            f"prepare_distillation_trainer got a vision-language student ({type(trainer.model).__name__}): "
            f"packtools' padding-free rows carry text only. Train it padded.",
            param="trainer",
        )
    if is_sharded(trainer):
        raise PackingError(
            "prepare_distillation_trainer: the model is sharded (DeepSpeed/FSDP); packtools has not checked the "
            "distillation forwards under sharding. Train it padded.",
            param="trainer",
        )
    models = {"student": trainer.model, "teacher": trainer.teacher_model}
    # a multimodal teacher too (TRL's _is_vlm looks at the student): Qwen-VL's text path needs 3-D positions
    refuse_multimodal(list(models.values()), "distillation forwards")
    for role, model in models.items():
        _check_model(model, role)
    if check_isolation:
        for role, model in models.items():
            _check_isolation(model)
            check_distillation_forward(trainer, model, role)
    install_step(trainer, PackedDistillationStep, DistillationPlan())
    return trainer
