"""``prepare_trainer``: packed padding-free batches in ``transformers.Trainer`` and TRL's ``SFTTrainer``.

``PaddingFreeCollator`` builds correct batches; what can still go wrong sits in the trainer and the model, and
:func:`prepare_trainer` closes exactly those gaps (docs/training.md lists each risk and what is done about it):

* **Columns.** ``remove_unused_columns`` would drop ``seq_lengths`` (every packed row then trains as one
  sequence) and the loss-mask columns: they are kept (:func:`~packtools.integrations.trainers.sft.keep_packed_columns`).
* **Attention isolation.** Backends that cannot isolate packed sequences are refused up front
  (:func:`~packtools.integrations.attention.backends.check_attention_implementation`), the trainer's own collator
  is checked on a real batch (:mod:`~packtools.integrations.trainers.collator_check`), the model's forward is
  guarded (:func:`~packtools.integrations.trainers.guard.guard_model`) and probed once (:func:`run_probe`).
* **Attention cost.** ``sdpa`` models switch to packtools' per-sequence ``sdpa``
  (:mod:`packtools.integrations.attention.segmented`): ``sum(L_i²)`` per layer instead of ``(sum L_i)²``.
* **Loss denominator.** The summed token loss is divided by the predicted tokens of the whole accumulation
  window: ``Trainer``'s own ``num_items_in_batch`` (exact because the collator sets -100 at every sequence
  start and on padding) for a model that takes loss kwargs, else
  :func:`~packtools.integrations.trainers.sft.causal_lm_loss` as ``compute_loss_func``.

Everything :func:`prepare_trainer` changes goes through :mod:`packtools.compat` and is recorded on the trainer:
:func:`packtools.integrations.unprepare` puts it all back, and a trainer ``prepare_trainer`` refuses is left as it
came.

>>> import tempfile, datasets, transformers
>>> from packtools import PaddingFreeCollator, pack_dataset
>>> from packtools.integrations import unprepare
>>> config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
...                                   num_attention_heads=2, attn_implementation="sdpa")
>>> rows = pack_dataset(datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5], [6, 7, 8, 9]]}), 8)
>>> args = transformers.TrainingArguments(tempfile.mkdtemp(), report_to=[], use_cpu=True)
>>> trainer = transformers.Trainer(transformers.LlamaForCausalLM(config), args, train_dataset=rows,
...                                data_collator=PaddingFreeCollator(0))
>>> prepare_trainer(trainer) is trainer, trainer.model.config._attn_implementation
(True, 'packtools_sdpa')
>>> unprepare(trainer).model.config._attn_implementation
'sdpa'

"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from ..._optional import is_instance, require
from ...batches.vision import image_columns
from ...compat import all_or_nothing, set_attr
from ...constants import AUDIO_COLUMNS, MEDIA_COLUMNS
from ...errors import PackingError
from ..attention.backends import (
    adapt_collator,
    base_model,
    check_attention_implementation,
    segmented_sdpa_until_checked,
    switch_back,
    switches_to_segmented_sdpa,
)
from ..attention.isolation import check_isolation as _check_isolation
from ..attention.isolation import trainer_autocast
from ..attention.mixers import run_mixers_per_document
from ..attention.segmented import SEGMENTED_SDPA
from ..multimodal.models import check_multimodal_model, check_vision_isolation
from ..parallel.distributed import is_sharded, refuse_data_parallel
from ..parallel.layout import check_context_parallel_size, rank_layout
from .collator_check import check_trainer_collator, probe_collator
from .guard import guard_model
from .held import watch_held_models
from .loader import check_train_loader
from .rope_rows import check_rope_rows, rows_per_forward
from .router import check_logits_z_loss
from .sft import check_sft, is_sft_trainer, keep_packed_columns, refuse_neftune
from .step import (
    SFTStep,
    StepPlan,
    check_loss_owner,
    check_router_padding,
    install_step,
    plan_of,
    unknown_trl_step,
    use_causal_lm_loss,
)
from .step_loss import check_loss_mode


def run_probe(
    trainer: Any,
    *extra_models: Any,
    switched: Sequence[Any] = (),
    collator: Any = None,
    packed: bool = True,
    vision: bool = False,
) -> None:
    """Run :func:`packtools.integrations.check_isolation` on the trainer's model (and ``extra_models``) unless sharded.

    ``switched`` are the models :func:`use_segmented_sdpa` switched: if the probe fails, they go back to
    ``sdpa`` and are probed again, so the error names either the model's own leak or packtools' backend.
    ``vision=True`` runs the multimodal probe (:func:`~packtools.integrations.multimodal.models.check_vision_isolation`,
    through the vision tower) instead.
    """
    if is_sharded(trainer):
        warnings.warn(
            "prepare_trainer: the isolation probe was skipped because the model is sharded (DeepSpeed/FSDP) "
            "and cannot be run before train(); run packtools.integrations.check_isolation on an unsharded copy of the "
            "model (same class, config and attn_implementation) to check it.",
            stacklevel=3,
        )
        return
    if vision:
        with trainer_autocast(trainer):
            check_vision_isolation(trainer.model, trainer.data_collator)
        return
    if collator is None:
        collator = probe_collator(trainer.data_collator)

    def probe() -> None:  # at the precision training runs (bf16=True / fp16=True: autocast)
        with trainer_autocast(trainer):
            for model in (trainer.model, *extra_models):
                if model is not None:
                    _check_isolation(model, collator, packed=packed)

    try:
        probe()
    except PackingError:
        if not switched:
            raise
        switch_back(switched)
        probe()  # leaks with plain sdpa too: this error names the cause
        raise PackingError(
            f"packtools' per-sequence sdpa ({SEGMENTED_SDPA!r}) let packed sequences of "
            f"{type(base_model(switched[0])).__name__} leak while its own 'sdpa' keeps them apart; the models "
            f"were switched back to 'sdpa'. Pass segmented_sdpa=False, and please report the model."
        ) from None
    except (AttributeError, TypeError) as err:
        # An attention layer that reads the mask tensor itself (Doge's dynamic mask: ``attention_mask.dtype``)
        # cannot take packtools' per-sequence mask object: such models stay on their own 'sdpa', probed as it is.
        if not switched:
            raise
        switch_back(switched)
        probe()
        warnings.warn(
            f"prepare_trainer: {type(base_model(switched[0])).__name__} cannot run packtools' per-sequence sdpa "
            f"({type(err).__name__}: {str(err)[:120]}); it stays on 'sdpa', which the isolation probe checked.",
            stacklevel=3,
        )


def warn_uncounted_pad_tokens(trainer: Any) -> int:
    """Warn when ``include_num_input_tokens_seen="non_padding"`` would leave real tokens of packed rows uncounted;
    return how many (0: nothing to say, or the rows cannot be read up front).

    A packed batch has no ``attention_mask``, so ``Trainer`` counts its non-padding tokens as ``input_ids !=
    processing_class.pad_token_id``: a real token equal to the pad id (the EOS of data whose pad token is its EOS)
    is not counted, where the same rows unpacked, with their ``attention_mask``, count it.  The packed rows
    (``seq_lengths``) of a ``datasets.Dataset`` are read for that id, in one pass.
    """
    if getattr(trainer.args, "include_num_input_tokens_seen", "no") != "non_padding":
        return 0
    pad = getattr(getattr(trainer, "processing_class", None), "pad_token_id", None)
    names = list(getattr(trainer.train_dataset, "column_names", None) or [])
    if pad is None or "seq_lengths" not in names or "input_ids" not in names:
        return 0
    if not is_instance(trainer.train_dataset, "datasets", "Dataset"):  # a stream: no rows to read up front
        return 0
    from ...compat.datasets import dataset_table

    pc = require("pyarrow.compute", "packtools.integrations.trainers.transformers")
    try:
        table, indices = dataset_table(trainer.train_dataset)
    except PackingError:  # a dataset with a transform: its rows are not the table's
        return 0
    column = table.column("input_ids")
    if indices is not None:
        column = column.take(indices)
    found = int(pc.sum(pc.equal(pc.list_flatten(column), pad)).as_py() or 0)
    if found:
        warnings.warn(
            f"include_num_input_tokens_seen='non_padding': packed batches have no attention_mask, so Trainer counts "
            f"input_ids != pad_token_id ({pad}), and {found:,} tokens of the training rows equal it (an EOS used as "
            f"the pad token?): num_input_tokens_seen will leave them out, where the rows unpacked count them. Give "
            f"the tokenizer a pad token that does not occur in the data, or count 'all' tokens (the collator's "
            f"padding included).",
            stacklevel=3,
        )
    return found


#: Trainer attributes that hold a second model a ``compute_loss`` of the user's own may forward on the batch.
SECOND_MODEL_ATTRS = ("teacher_model", "teacher", "ref_model")


def second_models(trainer: Any) -> list[Any]:
    """The models other than ``trainer.model`` held in :data:`SECOND_MODEL_ATTRS` (a distillation teacher, a
    reference model): ``prepare_trainer`` guards and probes them like the model, so a forward of the packed batch
    that loses its positions is refused there too (``guard.packed_loss_inputs``)."""
    torch = require("torch", "packtools.prepare_trainer")
    found = []
    for name in SECOND_MODEL_ATTRS:
        model = getattr(trainer, name, None)
        if (
            isinstance(model, torch.nn.Module)
            and model is not trainer.model
            and all(model is not m for m in found)
        ):
            found.append(model)
    return found


def refuse_unknown_trl_step(trainer: Any) -> None:
    """Refuse, by name, a TRL trainer whose step packtools does not know (:func:`~.step.unknown_trl_step`): TRL's
    distillation, GKD, GOLD, ORPO, CPO, online-DPO, SDFT, ... trainers compute their loss, forward a teacher or
    reference model, or generate their batches in methods of their own, which packtools has not checked on packed
    batches; prepared, they would fail mid-step or train on documents that see each other (docs/training.md)."""
    found = unknown_trl_step(trainer)
    if found is None:
        return
    name, methods = found
    if name == "trl.trainer.distillation_trainer.DistillationTrainer":
        raise PackingError(
            f"prepare_trainer got a {type(trainer).__name__}: distillation generates its completions and runs the "
            f"student and the teacher in its own methods. Use "
            f"packtools.integrations.rl.distillation.prepare_distillation_trainer(trainer) instead.",
            param="trainer",
        )
    raise PackingError(
        f"prepare_trainer got a {type(trainer).__name__}: TRL's {name} runs its own "
        f"{', '.join(methods)} (its own batches, forwards -- a teacher's or reference model's too -- and loss), "
        f"which packtools has not checked on packed padding-free batches: its documents could attend to each "
        f"other, or its loss and logged numbers differ from its padded step, with no error. Train it without "
        f"packing (its own dataset and collator, no prepare_trainer). packtools packs TRL's SFTTrainer "
        f"(prepare_trainer), DPOTrainer (prepare_dpo_trainer), RewardTrainer (prepare_reward_trainer), KTOTrainer "
        f"(prepare_kto_trainer), GRPOTrainer and RLOOTrainer and their subclasses (prepare_grpo_trainer).",
        param="trainer",
    )


def check_no_media_columns(trainer: Any, vision: bool) -> None:
    """Refuse a text model's train or eval dataset holding image, video or audio columns
    (:data:`~packtools.constants.MEDIA_COLUMNS`), and a vision-language model's holding audio columns (packtools
    packs no audio): ``Trainer``'s ``remove_unused_columns`` drops every column its model's ``forward`` does not
    name before the collator sees the rows, so the media would go with no error and their placeholder tokens train
    without pixels or audio (the collator refuses them only with it off)."""
    datasets = {"train_dataset": trainer.train_dataset}
    if isinstance(trainer.eval_dataset, dict):
        datasets.update({f"eval_dataset[{k!r}]": v for k, v in trainer.eval_dataset.items()})
    else:
        datasets["eval_dataset"] = trainer.eval_dataset
    for name, dataset in datasets.items():
        found = [
            c
            for c in (AUDIO_COLUMNS if vision else MEDIA_COLUMNS)
            if c in (getattr(dataset, "column_names", None) or [])
        ]
        if audio := [c for c in found if c in AUDIO_COLUMNS]:
            raise PackingError(
                f"the {name} holds the audio column(s) {audio}, which packtools does not batch: "
                f"Trainer's remove_unused_columns would drop them with no error, each clip's audio placeholder "
                f"tokens training with no audio. packtools packs no audio: remove the audio samples (their columns "
                f"and placeholder tokens) first, or train them unpacked.",
                param="trainer",
            )
        if found:
            raise PackingError(
                f"the {name} holds the image/video column(s) {found}, and {type(trainer.model).__name__} is a text "
                f"model: Trainer's remove_unused_columns would drop them with no error, each image's placeholder "
                f"tokens training without pixels. Train a vision-language model with "
                f"packtools.batches.MultimodalCollator (docs/vision.md), or remove {found} and their placeholder "
                f"tokens from the rows first.",
                param="trainer",
            )


def prepare_trainer(
    trainer: Any,
    *,
    max_tokens: int | None = None,
    check_isolation: bool = True,
    segmented_sdpa: bool = True,
    context_parallel: int | None = None,
    loss: str = "token",
) -> Any:
    """Make a ``transformers.Trainer`` (or TRL ``SFTTrainer``) train correctly on packed padding-free batches.

    Call it once, after building the trainer and before ``train()``::

        trainer = prepare_trainer(Trainer(model, args, train_dataset=packed,
                                          data_collator=PaddingFreeCollator(pad_token_id)))
        trainer.train()

    It closes the gaps of the module docstring.  A ``PaddingFreeCollator`` as ``data_collator`` is adapted to the
    model's ``forward`` (:func:`~packtools.integrations.attention.backends.adapt_collator`); an ``SFTTrainer`` must
    not prepare the dataset again (:func:`~packtools.integrations.trainers.sft.check_sft`).

    ``check_isolation=True`` (the default) checks the trainer's own ``data_collator`` on a real batch of its train
    dataset, refusing one that merges packed sequences with the fix, then runs
    :func:`packtools.integrations.check_isolation` once through that collator (a few short sequences, packed and
    alone, under ``no_grad``); ``False`` skips both.  ``segmented_sdpa=False`` keeps transformers' ``sdpa``.
    ``max_tokens=N`` batches by a token budget per process (:mod:`packtools.integrations.trainers.loader`: with
    several processes each runs the same number of micro-batches and no row is repeated).  The loaders shard over
    the data-parallel group of :mod:`packtools.integrations.parallel.layout`; layouts packtools does not handle
    are refused by name.

    ``context_parallel=N`` (a positive int) splits every padding-free row across ``N`` consecutive processes per
    document (:mod:`packtools.integrations.trainers.context_parallel`).  ``loss`` is how the token losses of an
    optimizer step are averaged (:mod:`packtools.integrations.trainers.step_loss`): ``"token"`` (the default, the
    trainer's own loss), ``"sample"`` or ``"sqrt"``, computed by packtools, so a loss of the trainer's own is
    refused by name with them.

    The trainer's class becomes a packtools subclass of it (:mod:`packtools.integrations.trainers.step`).
    Vision-language models train packed with ``packtools.batches.MultimodalCollator``
    (:mod:`packtools.integrations.multimodal.models`).  Returns the trainer.
    """
    require("transformers", "packtools.integrations.prepare_trainer")
    loss = check_loss_mode(loss)
    check_context_parallel_size(context_parallel)
    refuse_neftune(trainer, "packed rows", "prepare_trainer")
    if is_instance(trainer, "trl", "DPOTrainer"):
        raise PackingError(
            f"prepare_trainer got a {type(trainer).__name__}: preference pairs need their own batches, loss scaling "
            "and forward. Use packtools.prepare_dpo_trainer(trainer, ...) instead.",
            param="trainer",
        )
    if is_instance(trainer, "trl", "RewardTrainer"):
        raise PackingError(
            f"prepare_trainer got a {type(trainer).__name__}: a reward model's scores are read at each packed "
            "document's own last token, not by the model's pooling. Use "
            "packtools.integrations.preference.reward.prepare_reward_trainer(trainer, ...) instead.",
            param="trainer",
        )
    if is_instance(trainer, "trl", "KTOTrainer"):
        raise PackingError(
            f"prepare_trainer got a {type(trainer).__name__}: KTO's completions and KL sequences need their own "
            "padding-free forward. Use packtools.integrations.preference.kto.prepare_kto_trainer(trainer) instead.",
            param="trainer",
        )
    if is_instance(trainer, "trl", "GRPOTrainer") or is_instance(trainer, "trl", "RLOOTrainer"):
        raise PackingError(
            f"prepare_trainer got a {type(trainer).__name__}: online RL generates its batches and computes its "
            "log-probabilities in its own method. Use packtools.prepare_grpo_trainer(trainer) instead.",
            param="trainer",
        )
    refuse_unknown_trl_step(trainer)
    refuse_data_parallel(trainer, "prepare_trainer")
    plan = plan_of(trainer)
    if plan is not None:  # idempotent with the same options; other options would stack on the first
        if (plan.max_tokens, plan.loss, plan.layout.cp_size) == (max_tokens, loss, context_parallel or 1):
            return trainer
        raise PackingError(
            f"prepare_trainer was already called on this {type(trainer).__name__} with max_tokens="
            f"{plan.max_tokens}, loss={plan.loss!r}, context_parallel={plan.layout.cp_size}; call "
            f"packtools.integrations.unprepare(trainer) before preparing it with other options.",
            param="trainer",
        )
    check_attention_implementation(trainer.model)
    # Gemma 3 on sdpa goes to packtools_sdpa below (use_segmented_sdpa): its collator is checked for that backend
    backend = SEGMENTED_SDPA if segmented_sdpa and switches_to_segmented_sdpa(trainer.model) else None
    spec = check_multimodal_model(trainer.model, trainer.data_collator, backend)
    vision = spec is not None
    if vision and spec.image_blocks and is_sft_trainer(trainer):
        raise PackingError(
            f"{type(trainer).__name__} with a packed {spec.model_type!r} model: MultimodalCollator gives its "
            f"batches each document's masks ready-made (attention_mask, a dict by layer type), and TRL's "
            f"SFTTrainer counts the tokens of a batch with attention_mask.sum(), which a dict has not (it would "
            f"stop at the first step with an AttributeError). Train it with transformers.Trainer (same "
            f"collator, prepare_trainer).",
            param="trainer",
        )
    if (
        vision
        and spec.image_blocks
        and getattr(trainer.args, "include_num_input_tokens_seen", "no") == "non_padding"
    ):
        raise PackingError(
            f"include_num_input_tokens_seen='non_padding' with a packed {spec.model_type!r} model: Trainer counts "
            f"a batch's tokens with attention_mask.sum(), and MultimodalCollator gives {spec.model_type!r} each "
            f"document's masks ready-made (attention_mask, a dict by layer type; it would stop at the first step "
            f"with an AttributeError). Use include_num_input_tokens_seen='all' (packed rows hold padding only at "
            f"the end of a batch, with pad_to_multiple_of) or 'no'.",
            param="include_num_input_tokens_seen",
        )
    if vision and context_parallel not in (None, 1):
        raise PackingError(
            f"context_parallel={context_parallel} with a vision-language model ({type(trainer.model).__name__}): "
            "packtools splits text rows across context-parallel ranks, not the images and 3-D positions a "
            "MultimodalCollator batch carries. Train it with context_parallel=1 (data parallelism only).",
            param="context_parallel",
        )
    if vision and loss != "token":
        raise PackingError(
            f"loss={loss!r} with a vision-language model ({type(trainer.model).__name__}): the per-sequence "
            f"weights are not checked against MultimodalCollator batches (3-D positions); use loss='token'.",
            param="loss",
        )
    check_no_media_columns(trainer, vision)
    layout = rank_layout(trainer, context_parallel)  # refuses a context_parallel that is no positive int
    check_loss_owner(trainer, loss)
    check_router_padding(trainer, max_tokens)
    check_logits_z_loss(trainer.model)
    check_train_loader(trainer, max_tokens)
    check_rope_rows(
        trainer.model,
        trainer.train_dataset,
        rows_per_forward=rows_per_forward(trainer, max_tokens),
        caller="prepare_trainer",
    )
    with all_or_nothing(trainer):
        # TRL's SFTTrainer keeps only input_ids, labels and seq_lengths: the images are kept too
        keep_packed_columns(trainer, image_columns(spec) if vision else ())
        if is_sft_trainer(trainer):
            check_sft(trainer)
        else:
            use_causal_lm_loss(trainer)
        if trainer.args.world_size > 1 and not getattr(trainer.args, "average_tokens_across_devices", True):
            warnings.warn(
                "average_tokens_across_devices=False: each process divides its loss by its own token count, so "
                "processes with fewer tokens weigh more. Set it to True for a token-weighted loss across processes.",
                stacklevel=2,
            )
        warn_uncounted_pad_tokens(trainer)
        collator = adapt_collator(trainer.data_collator, trainer.model)
        if collator is not trainer.data_collator:
            set_attr(trainer, "data_collator", collator, owner=trainer)
        probe_rows, packed = None, True
        # the trainer's own collator on a real batch, then the probe through it (vision: its own probe)
        if check_isolation and not vision:
            probe_rows, packed = check_trainer_collator(trainer)
        second = second_models(trainer)  # a teacher or reference of the user's compute_loss: guarded alike
        for model in (trainer.model, *second):
            run_mixers_per_document(model, owner=trainer)  # before the guard: its mixers are then handled
            guard_model(model, owner=trainer, check_isolation=False)
        watch_held_models(trainer)  # any other model: guarded at its first packed input (held.py)
        with segmented_sdpa_until_checked([trainer.model], segmented_sdpa, owner=trainer) as switched:
            if check_isolation:
                run_probe(
                    trainer, *second, switched=switched, collator=probe_rows, packed=packed, vision=vision
                )
        if layout.cp_size > 1:
            from .context_parallel import prepare_context_parallel

            layout = prepare_context_parallel(trainer, layout)
        install_step(trainer, SFTStep, StepPlan(layout, max_tokens=max_tokens, loss=loss))
    return trainer
