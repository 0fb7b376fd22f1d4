"""One owner of a training step: what packtools changes about a ``Trainer``'s step, in one class per trainer kind.

``prepare_*`` swaps the trainer's class to a packtools subclass of its own class (:func:`packed_class`:
``PackedTrainer``, ``PackedSFTTrainer``, ``PackedDPOTrainer``, ``Packed<YourTrainer>``) and stores the run's
decisions in one frozen :class:`StepPlan` on the trainer (attribute :data:`PLAN_ATTR`), both recorded, so
``packtools.integrations.unprepare(trainer)`` gives the class back and removes the plan.

The mixins override ``Trainer``'s public step methods and call ``super()``, so the trainer's own class (a user's
``compute_loss``, TRL's ``SFTTrainer`` / ``DPOTrainer.compute_loss``) runs inside them, never replaced:
:class:`StepOwner` (every kind: the loader, evaluation refused under CP, predictions of merged rows refused), :class:`SFTStep` (``Trainer``,
``SFTTrainer``: the step's denominator, CP shards and the ``sample`` / ``sqrt`` loss modes), :class:`DPOStep`
(TRL ``DPOTrainer``: the pair mean of the step).  docs/training.md tabulates each method.

Another trainer kind plugs in with a mixin of its own (a subclass of :class:`StepOwner` overriding the methods it
changes, each calling ``super()``) and ``install_step(trainer, TheMixin, plan)``: TRL's ``RewardTrainer``
(:class:`~packtools.integrations.preference.reward.PackedRewardStep`), ``GRPOTrainer`` / ``RLOOTrainer``
(:class:`~packtools.integrations.rl.grpo.PackedRLStep`, which keeps TRL's loader, so it does not derive from
:class:`StepOwner`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from ..._optional import require
from ...batches.collate import PaddingFreeCollator
from ...batches.context_parallel import CP_KEY
from ...compat import record, set_attr
from ...compat.transformers import found_train_batch_size
from ...compat.trl import count_every_position, train_metrics, weigh_new_metrics
from ...errors import PackingError
from ..attention.backends import base_model
from ..parallel.distributed import trainer_divides_by_accumulation, uneven_gather
from ..parallel.layout import RankLayout
from .guard import UNSHIFTED_LOSS, packed_loss_inputs
from .held import watch_held_models
from .loader import train_loader
from .resume import checkpoint_folder, layout_record, run_layout
from .router import trainer_router_loss_on
from .sft import causal_lm_loss
from .step_loss import targets_and_documents, token_weights, weighted_token_loss

#: The trainer attribute holding its :class:`StepPlan` (set by ``prepare_*``, removed by ``unprepare``).
PLAN_ATTR = "packtools_step"


@dataclass(frozen=True)
class StepPlan:
    """The decisions of one run, taken once by ``prepare_*`` and read by the step owner.

    ``layout``: the run's :class:`~packtools.integrations.parallel.layout.RankLayout` (DP/CP ranks, the CP group,
    the balance choice); ``max_tokens``: the token budget per micro-batch (``None``: rows); ``loss``: the loss
    normalization (:data:`~packtools.integrations.trainers.step_loss.LOSS_MODES`); ``cp_forward``: DPO under CP, what runs
    this rank's shard of a padding-free row (:class:`~packtools.integrations.preference.context_parallel.CPForward`).
    """

    layout: RankLayout
    max_tokens: int | None = None
    loss: str = "token"
    cp_forward: Any = None

    @property
    def cp(self) -> bool:
        return self.layout.cp_size > 1


#: (trainer class, mixin) -> packed class: built once, never per run
_CLASSES: dict[tuple[type, type], type] = {}


def packed_class(base: type, mixin: type) -> type:
    """The packtools subclass of ``base`` with ``mixin``'s step methods first in its MRO (cached).

    >>> class Base:
    ...     def step(self): return "base"
    >>> class Mixin:
    ...     def step(self): return "packed " + super().step()
    >>> cls = packed_class(Base, Mixin)
    >>> cls.__name__, cls().step(), packed_class(Base, Mixin) is cls
    ('PackedBase', 'packed base', True)
    """
    found = _CLASSES.get((base, mixin))
    if found is None:
        name = f"Packed{base.__name__}"
        found = type(name, (mixin, base), {"__module__": __name__, "__qualname__": name})
        _CLASSES[(base, mixin)] = found
    return found


def plan_of(trainer: Any) -> Any:
    """The plan of a prepared trainer (a :class:`StepPlan` or a trainer kind's own frozen plan; ``None`` when
    packtools did not prepare it)."""
    return getattr(trainer, "__dict__", {}).get(PLAN_ATTR)


def install_step(trainer: Any, mixin: type, plan: Any) -> None:
    """Swap ``trainer``'s class to ``packed_class(type(trainer), mixin)`` and store ``plan``; recorded on the
    trainer, so ``unprepare`` restores the class and removes the plan."""
    if plan_of(trainer) is not None or isinstance(trainer, StepOwner):
        raise PackingError(
            f"{type(trainer).__name__} was already prepared by packtools; call "
            f"packtools.integrations.unprepare(trainer) before preparing it again.",
            param="trainer",
        )
    original = type(trainer)
    trainer.__class__ = packed_class(original, mixin)
    vars(trainer)[PLAN_ATTR] = plan

    def restore() -> None:
        trainer.__class__ = original
        vars(trainer).pop(PLAN_ATTR, None)

    record(trainer, f"{original.__name__} -> {trainer.__class__.__name__}", restore)


def _plan(trainer: Any) -> StepPlan:
    found = plan_of(trainer)
    if found is None:  # the class was copied onto another instance, or the plan removed by hand
        raise PackingError(f"{type(trainer).__name__} has no packtools step plan; prepare it with prepare_*.")
    return found


NO_EVAL = (
    "{what} under context_parallel is not handled by packtools: Trainer's evaluation and prediction loaders give "
    "the ranks of a CP group different rows, which packtools_cp would attend across as one row. Evaluate or "
    "predict without context_parallel (the saved model in a one-process or data-parallel run, e.g. "
    "packtools.integrations.trainers.evaluation.token_mean_loss)"
)


def refuse_under_cp(trainer: Any, what: str) -> None:
    """Refuse evaluation or prediction by name when ``trainer``'s plan splits rows over a CP group."""
    if _plan(trainer).cp:
        raise PackingError(NO_EVAL.format(what=what) + ".", param="eval_dataset")


def refuse_merged_predictions(trainer: Any) -> None:
    """Refuse predictions (``predict()``, ``evaluate()`` with ``compute_metrics``) of padding-free batches that
    join several rows: ``Trainer`` would return one flat row per batch, not one per example, and under several
    processes accelerate's even-out batch would be kept (it truncates by the batch dimension, 1 here)."""
    inner = getattr(trainer.data_collator, "collator", trainer.data_collator)  # an ArrowCollator's inner one
    size = int(trainer.args.eval_batch_size)
    if isinstance(inner, PaddingFreeCollator) and inner.padding_free and size > 1:
        raise PackingError(
            f"predictions of padding-free batches with per_device_eval_batch_size={size}: PaddingFreeCollator "
            f"joins the {size} rows of a batch into one flat row, so predictions and label_ids would come back "
            "one row per batch, not per example (and with several processes the batch accelerate repeats to "
            "even out the ranks would be kept). Set TrainingArguments(per_device_eval_batch_size=1): one "
            "example per batch, in order, on any number of processes.",
            param="per_device_eval_batch_size",
        )


def refuse_found_batch_size(trainer: Any, max_tokens: int | None) -> None:
    """Refuse the batch size ``auto_find_batch_size`` lowered after an out-of-memory error where packtools'
    loader serves the batches (``max_tokens``, or several processes): its row sampler and token budget do not
    follow it (the same batches would run again).  With one process and no ``max_tokens`` ``Trainer``'s own
    loader is kept and follows the lowered size, and the layout record names the size trained
    (:func:`~packtools.integrations.trainers.resume.run_layout`), so the retry is exact and allowed."""
    if max_tokens is None and max(int(trainer.args.world_size), 1) == 1:
        return
    args = trainer.args
    found = found_train_batch_size(trainer)
    if not getattr(args, "auto_find_batch_size", False) or found is None:
        return
    asked = int(args.per_device_train_batch_size)
    if found == asked:
        return
    fix = (
        f"set TrainingArguments(per_device_train_batch_size={found}, auto_find_batch_size=False)"
        if max_tokens is None
        else f"lower max_tokens={max_tokens} (the token budget sizes packtools' batches) and set "
        f"auto_find_batch_size=False"
    )
    raise PackingError(
        f"auto_find_batch_size set the training batch size from per_device_train_batch_size={asked} to "
        f"{found} (lowered after an out-of-memory error, or the size in the resumed checkpoint's "
        f"trainer_state.json): packtools sizes its batches and records them in each "
        f"checkpoint from per_device_train_batch_size and max_tokens, so the retry would train other batches "
        f"than the ones it logs and records (and a resume would skip the wrong rows). To train with a smaller "
        f"batch, {fix}.",
        param="auto_find_batch_size",
    )


class StepOwner:
    """What packtools changes in every prepared trainer's step: the training loader, the refusal of predictions
    of merged padding-free rows (:func:`refuse_merged_predictions`) and, under context parallelism, the refusal
    of evaluation and prediction (see the module docstring)."""

    def get_train_dataloader(self) -> Any:
        plan = _plan(self)
        refuse_found_batch_size(self, plan.max_tokens)
        return train_loader(self, plan.max_tokens, plan.layout, super().get_train_dataloader)

    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``, refusing to resume under another data layout than the checkpoint's and recording
        this run's layout in the state each checkpoint saves (:mod:`~packtools.integrations.trainers.resume`);
        both when training begins, after a hyperparameter trial set its arguments and before the first step."""
        plan = _plan(self)
        folder = checkpoint_folder(self, resume_from_checkpoint)
        record = layout_record(lambda: run_layout(self, plan.layout, plan.max_tokens), folder)
        self.add_callback(record)
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self.remove_callback(record)

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        refuse_under_cp(self, "evaluate()")
        return super().evaluate(*args, **kwargs)

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        refuse_under_cp(self, "predict()")
        return super().predict(*args, **kwargs)

    def prediction_step(
        self, model: Any, inputs: Any, prediction_loss_only: bool, ignore_keys: Any = None
    ) -> Any:
        if not prediction_loss_only:
            refuse_merged_predictions(self)
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    def get_eval_dataloader(self, *args: Any, **kwargs: Any) -> Any:
        refuse_under_cp(self, "evaluation")
        return super().get_eval_dataloader(*args, **kwargs)

    def get_test_dataloader(self, *args: Any, **kwargs: Any) -> Any:
        refuse_under_cp(self, "prediction")
        return super().get_test_dataloader(*args, **kwargs)


def _cp_group(plan: StepPlan, batch: dict[str, Any]) -> Any:
    return plan.layout.cp_group if CP_KEY in batch else None


def window_weight(trainer: Any, samples: list[Any], plan: StepPlan, device: Any) -> Any:
    """The denominator ``D`` of the step (:mod:`~packtools.integrations.trainers.step_loss`): the token weights of every
    micro-batch of the window summed over every process (tensor-parallel peers, which hold the same batch, once).
    ``token``: an int64 count, as ``Trainer``'s own ``num_items_in_batch``."""
    torch = require("torch", "packtools.prepare_trainer")
    local = 0.0
    for batch in samples:
        targets, doc = targets_and_documents(batch)
        local += float(token_weights(targets, doc, plan.loss, _cp_group(plan, batch)).sum())
    dtype = torch.int64 if plan.loss == "token" else torch.float64
    total = torch.tensor(round(local) if plan.loss == "token" else local, dtype=dtype, device=device)
    if int(trainer.args.world_size) > 1:
        total = trainer.accelerator.gather(total).sum()
        total = total // plan.layout.tp_size if plan.loss == "token" else total / plan.layout.tp_size
    return total


def cp_loss_inputs(inputs: dict[str, Any], plan: StepPlan) -> dict[str, Any]:
    """A CP shard as the trainer's own ``compute_loss`` takes it: ``labels`` and ``shift_labels`` both the
    already-shifted targets (no second shift), the shard checked to be cut for this run's layout."""
    shard = inputs[CP_KEY]
    bound = getattr(shard, "bound", None)
    if bound is not plan.layout and bound == plan.layout:
        # cut in a data-loader worker: the same layout, copied without its process group (which stays here)
        shard = replace(shard, bound=plan.layout)
    elif bound is not plan.layout:
        raise PackingError(
            "a context-parallel shard cut for another parallel layout (or for none) reached a trainer prepared "
            "with context_parallel: cut batches with the trainer's own collator (prepare_trainer sets it: "
            "ContextParallelCollator(inner, layout=<the trainer's layout>)).",
            param="data_collator",
        )
    return {
        "input_ids": inputs["input_ids"],
        "position_ids": inputs["position_ids"],
        CP_KEY: shard,
        "labels": inputs["shift_labels"],
        "shift_labels": inputs["shift_labels"],
        "use_cache": False,
    }


@contextmanager
def model_given_labels(model: Any, owner: str | None) -> Iterator[None]:
    """While a compute_loss of the user's own (class ``owner``; ``None``: nothing checked) runs on a CP shard,
    refuse a forward of the shard without ``labels``: that loss is computed outside the model, from the batch's
    labels, which under CP are the shard's already-shifted targets (its chunks are not adjacent), so the causal
    shift such a loss makes would train each token on the token two ahead, with no error.  Refuse one without
    ``num_items_in_batch`` too (TRL's fused forward aside): the model's loss is then the shard's own mean.  (A
    forward of the shard's tokens without its :data:`CP_KEY`, from any method and into any guarded model, is the
    guard's to refuse: :func:`~packtools.integrations.trainers.guard.check_packed_ids_forward`.)"""
    if owner is None:
        yield
        return

    def check(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if kwargs.get(CP_KEY) is not None and kwargs.get("labels") is None:
            raise PackingError(
                f"{owner}.compute_loss called the model on a context-parallel shard without labels, to compute "
                f"the loss itself: under context_parallel the batch's labels (and shift_labels) are already the "
                f"next-token targets of the rank's shard, whose chunks are not adjacent tokens of the row, so a "
                f"loss that shifts the labels itself trains each token on the token two ahead, with no error. "
                f"Pass the labels to the model (model(**inputs), or super().compute_loss(...)) and build on "
                f"outputs.loss, or train without context_parallel.",
                param="context_parallel",
            )
        if (
            kwargs.get(CP_KEY) is not None
            and kwargs.get("num_items_in_batch") is None
            and not kwargs.get(
                "fused_lm_head"  # TRL's SFTTrainer: per-token log-probs, divided by the step's targets by TRL
            )
        ):
            raise PackingError(
                f"{owner}.compute_loss called the model on a context-parallel shard without num_items_in_batch: "
                f"the model's loss is then the mean over this rank's shard, and the step the mean of the shards' "
                f"means (weighted by how CP cut the row), not the row's token mean, with no error. Call "
                f"super().compute_loss(model, inputs, return_outputs, num_items_in_batch), or pass "
                f"num_items_in_batch=num_items_in_batch to the model and multiply its loss by "
                f"self.accelerator.num_processes as Trainer does; or train without context_parallel.",
                param="context_parallel",
            )

    inner = getattr(model, "module", model)  # DDP's module: a call of the wrapper or of the model itself
    handle = inner.register_forward_pre_hook(check, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


class SFTStep(StepOwner):
    """The step of a ``transformers.Trainer`` or TRL ``SFTTrainer`` on packed rows (see the module docstring)."""

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> Any:
        samples, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        plan = _plan(self)
        if samples and (plan.cp or plan.loss != "token"):
            num_items = window_weight(self, samples, plan, device)
        return samples, num_items

    def prediction_step(
        self, model: Any, inputs: Any, prediction_loss_only: bool, ignore_keys: Any = None
    ) -> Any:
        # a prediction_step of the trainer's own forwards the batch too: its forwards keep positions
        watch_held_models(self)  # a model set on the trainer since prepare_trainer: checked too
        with packed_loss_inputs(inputs, f"{loss_owner(self, 'prediction_step')}.prediction_step"):
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    def training_step(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        # a training_step of the trainer's own may forward the batch itself, outside compute_loss: its forwards
        # keep positions (and a CP shard its key) too, into a model set on the trainer since prepare_trainer too
        watch_held_models(self)
        with packed_loss_inputs(inputs, f"{loss_owner(self, 'training_step')}.training_step"):
            return super().training_step(model, inputs, *args, **kwargs)

    def compute_loss(
        self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        plan = _plan(self)
        own = None
        if CP_KEY in inputs:
            inputs = cp_loss_inputs(inputs, plan)
            own = own_compute_loss(self)
        if plan.loss != "token":
            with packed_loss_inputs(inputs, "packtools' loss"):  # its forward: the inputs' own keys
                return _weighted_loss(self, model, inputs, return_outputs, num_items_in_batch)
        with (
            packed_loss_inputs(inputs, f"{loss_owner(self)}.compute_loss"),  # its forwards keep positions
            model_given_labels(model, own),
        ):
            result = super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        count_every_position(self, inputs)  # SFTTrainer's num_tokens: every row of the batch, not one
        return result


def _weighted_loss(trainer: Any, model: Any, inputs: Any, return_outputs: bool, num_items: Any) -> Any:
    """The ``sample`` / ``sqrt`` loss of a micro-batch (a CP shard as :func:`cp_loss_inputs` gives it):
    ``sum_t w_t CE_t / D`` times what ``Trainer`` and DDP divide by again (the processes of the DP x CP world;
    the accumulation steps when ``Trainer`` divides)."""
    plan = _plan(trainer)
    targets, doc = targets_and_documents(inputs)
    weights = token_weights(targets, doc, plan.loss, _cp_group(plan, inputs))
    outputs = model(**{k: v for k, v in inputs.items() if k not in ("labels", "shift_labels")})
    total = weighted_token_loss(outputs.logits, targets, weights)
    if model.training and num_items is not None:
        divided = trainer_divides_by_accumulation(trainer, num_items)
        steps = trainer.current_gradient_accumulation_steps if divided else 1
        processes = plan.layout.dp_size * plan.layout.cp_size
        loss = total * (steps * processes / max(float(num_items), 1e-12))
    else:  # evaluation: this batch's mean in the mode
        loss = total / weights.sum().clamp(min=1e-12)
    return (loss, outputs) if return_outputs else loss


class DPOStep(StepOwner):
    """The step of a TRL ``DPOTrainer`` on padding-free or packed pairs: the loss of an optimizer step is the mean
    over all its pairs, over every process (:mod:`packtools.integrations.preference.dpo`)."""

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> Any:
        samples, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        pairs = sum(int(b["completion_mask"].shape[0]) // 2 for b in samples)
        if samples:  # the step's units over every process, for the metrics' weights (compute_loss)
            units = sum(metric_units(b) for b in samples)
            self._packtools_step_units = (len(samples), step_units(self, units, device))
        return samples, step_pairs(self, pairs, device)

    def compute_loss(
        self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        training = self.model.training and bool(num_items_in_batch)
        lengths = {k: len(v) for k, v in train_metrics(self).items()} if training else {}
        with uneven_gather(self.accelerator):  # per-pair metrics: ranks hold different numbers of pairs
            result = super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        if not training:
            return result
        weigh_micro_batch_metrics(self, inputs, lengths)
        loss = result[0] if return_outputs else result
        pairs = int(inputs["completion_mask"].shape[0]) // 2
        loss = pair_mean_share(self, loss, pairs, int(num_items_in_batch), num_items_in_batch)
        return (loss, result[1]) if return_outputs else loss


#: The units of :data:`~packtools.compat.trl.DPO_METRIC_UNITS`, in :func:`metric_units`' order.
UNITS = ("pairs", "chosen", "rejected", "tokens")


def metric_units(batch: dict[str, Any]) -> Any:
    """``[pairs, chosen tokens, rejected tokens, completion tokens]`` of a DPO micro-batch in TRL's layout
    (``completion_mask`` ``[2 * pairs, T]``, chosen rows first; a token counts where TRL's metrics count it,
    ``completion_mask[..., 1:]``), an int64 tensor."""
    torch = require("torch", "packtools DPO metrics")
    mask = batch["completion_mask"][..., 1:]
    chosen, rejected = mask.chunk(2, dim=0)
    counts = [mask.shape[0] // 2, int(chosen.sum()), int(rejected.sum()), int(mask.sum())]
    return torch.tensor(counts, dtype=torch.int64, device=mask.device)


def step_units(trainer: Any, units: Any, device: Any) -> Any:
    """``units`` (:func:`metric_units`, summed) over every process, tensor- and context-parallel peers once."""
    units = units.to(device)
    if int(trainer.args.world_size) > 1:
        units = trainer.accelerator.gather(units[None]).sum(0) // _plan(trainer).layout.peers
    return units


def weigh_micro_batch_metrics(trainer: Any, inputs: dict[str, Any], lengths: dict[str, int]) -> None:
    """Make TRL's logged DPO metrics the step's means over its pairs (or tokens), not means of micro-batch means.

    TRL appends each micro-batch's mean (over every process) and ``log`` averages the values: right for micro-batches
    of equal sizes, TRL's own, not for packed rows or batches split across processes, whose pair counts differ
    (a pair of a 1-pair micro-batch weighed twice one of a 2-pair one).  Each new value is multiplied by
    ``its units x micro-batches / step units`` (:data:`~packtools.compat.trl.DPO_METRIC_UNITS`).
    """
    found = getattr(trainer, "_packtools_step_units", None)
    if found is None:
        return
    micro_batches, total = found
    mine = step_units(trainer, metric_units(inputs), total.device)
    factors = {
        unit: float(mine[i]) * micro_batches / float(total[i]) if int(total[i]) else 1.0
        for i, unit in enumerate(UNITS)
    }
    weigh_new_metrics(trainer, lengths, factors)


def step_pairs(trainer: Any, pairs: int, device: Any) -> int:
    """The pairs of the optimizer step over every process: ``pairs`` (this process's, every micro-batch of the
    window) summed over the processes, tensor- and context-parallel peers (which hold the same pairs) once."""
    torch = require("torch", "packtools pair-mean steps")
    total = torch.tensor(pairs, device=device)
    if int(trainer.args.world_size) > 1:
        total = trainer.accelerator.gather(total).sum() // _plan(trainer).layout.peers
    return int(total)


def pair_mean_share(trainer: Any, loss: Any, pairs: int, step_pairs: int, num_items: Any) -> Any:
    """``loss``, the trainer's own mean over a micro-batch's ``pairs``, as its share of the mean over the
    ``step_pairs`` of the optimizer step (DPO and reward steps; ``num_items``: the ``num_items_in_batch``
    ``Trainer`` passes, which its predicate reads).

    It undoes what ``training_step`` divides by (read from ``Trainer``'s own predicate) and DDP's mean over the
    data-parallel group (not over tensor-parallel peers); context-parallel peers' gradients are parts of one
    gradient (preference.context_parallel: identity-backward sums), so DDP's mean over them is undone too.
    """
    layout = _plan(trainer).layout
    divided = trainer_divides_by_accumulation(trainer, num_items)
    steps = trainer.current_gradient_accumulation_steps if divided else 1
    loss = loss * (pairs * steps * layout.dp_size / step_pairs)
    if layout.cp_size > 1:  # the gradient times cp_size, the value (logged) kept the step mean
        extra = loss * (layout.cp_size - 1)
        loss = loss + (extra - extra.detach())
    return loss


def own_compute_loss(trainer: Any) -> str | None:
    """The name of the class that overrides ``compute_loss`` between the trainer's class and ``Trainer`` /
    ``SFTTrainer`` / ``DPOTrainer`` (a user's subclass), or ``None``."""
    known = {
        "transformers.trainer.Trainer",
        "trl.trainer.sft_trainer.SFTTrainer",
        "trl.trainer.dpo_trainer.DPOTrainer",
    }
    for cls, _ in overriding_classes(trainer, ("compute_loss",)):
        return None if qualified_name(cls) in known else cls.__name__
    return None


def qualified_name(cls: type) -> str:
    """``module.Class`` of ``cls``.

    >>> qualified_name(dict)
    'builtins.dict'
    """
    return f"{cls.__module__}.{cls.__qualname__}"


def overriding_classes(trainer: Any, methods: Sequence[str]) -> Iterator[tuple[type, list[str]]]:
    """Each class of ``trainer``'s hierarchy (packtools' step owners left out) that defines one of ``methods``,
    nearest first, with those it defines.

    >>> A = type("A", (), {"compute_loss": None}); B = type("B", (A,), {"training_step": None})
    >>> [(c.__name__, m) for c, m in overriding_classes(B(), ("compute_loss", "training_step"))]
    [('B', ['training_step']), ('A', ['compute_loss'])]
    """
    for cls in type(trainer).__mro__:
        if issubclass(cls, StepOwner):
            continue
        found = [m for m in methods if m in vars(cls)]
        if found:
            yield cls, found


def loss_owner(trainer: Any, method: str = "compute_loss") -> str:
    """The name of the class whose ``method`` runs under packtools' step owner (``Trainer`` at least)."""
    return next((cls.__name__ for cls, _ in overriding_classes(trainer, (method,))), type(trainer).__name__)


#: The methods in which a trainer builds its batches, forwards its models and computes its loss.
STEP_METHODS = (
    "compute_loss",
    "_compute_loss",
    "training_step",
    "_prepare_inputs",
    "get_train_dataloader",
    "_get_train_sampler",
    "get_batch_samples",
    "prediction_step",
)

#: TRL's classes whose step methods ``prepare_trainer`` knows (checked against packed batches by the tests).
KNOWN_TRL_STEPS = frozenset({"trl.trainer.sft_trainer.SFTTrainer", "trl.trainer.base_trainer._BaseTrainer"})


def unknown_trl_step(trainer: Any) -> tuple[str, list[str]] | None:
    """The first class of TRL's in ``trainer``'s class hierarchy that overrides a step method (:data:`STEP_METHODS`)
    and is not one ``prepare_trainer`` knows (:data:`KNOWN_TRL_STEPS`), as ``(module.Class, [methods])``; ``None``
    if there is none.  A user's subclass is not TRL's: its ``compute_loss`` runs under the guard's checks.

    >>> unknown_trl_step(object()) is None
    True
    """
    for cls, methods in overriding_classes(trainer, STEP_METHODS):
        name = qualified_name(cls)
        if cls.__module__.split(".")[0] == "trl" and name not in KNOWN_TRL_STEPS:
            return name, methods
    return None


def other_losses(trainer: Any) -> list[str]:
    """What shapes ``trainer``'s loss besides its model's causal-LM loss, each named for a refusal: a
    ``compute_loss_func`` of the user's own, ``Trainer``'s label smoother, a MoE router loss; ``[]`` if none."""
    found = [
        "a compute_loss_func of your own" if trainer.compute_loss_func not in (None, causal_lm_loss) else "",
        "label_smoothing_factor > 0 (Trainer's label smoother)" if trainer.label_smoother is not None else "",
        "a MoE router loss (output_router_logits with router_aux_loss_coef)"
        if trainer_router_loss_on(trainer)
        else "",
    ]
    return [f for f in found if f]


def check_router_padding(trainer: Any, max_tokens: int | None) -> None:
    """Refuse, by name, a MoE router loss beside a collator that adds filler tokens to a packed batch.

    transformers' ``load_balancing_loss_func`` leaves padding out of the router statistics only through
    ``attention_mask``, and a packed batch has none (it would merge the packed sequences): every filler token of
    ``pad_to_multiple_of``, ``pad_to_buckets`` or the right-padding of ``padding_free=False`` rows would count
    as routed, and the aux loss and every gradient would differ from the padded batch's without an error.  A
    padding-free batch without filler holds the padded batch's real tokens, so its router loss is the same."""
    if not trainer_router_loss_on(trainer):
        return
    collator = trainer.data_collator
    for attr in (
        "collator",
        "text",
    ):  # packtools' wrappers: ArrowCollator's, then MultimodalCollator's text one
        inner = getattr(collator, attr, None)
        collator = inner if callable(inner) else collator
    rows = int(getattr(trainer.args, "per_device_train_batch_size", 1) or 1)
    found = [
        f"pad_to_multiple_of={collator.pad_to_multiple_of}"
        if getattr(collator, "pad_to_multiple_of", None)
        else "",
        f"pad_to_buckets={list(collator.pad_to_buckets)}"
        if getattr(collator, "pad_to_buckets", None)
        else "",
        "padding_free=False with several rows per batch (the shorter rows are right-padded)"
        if getattr(collator, "padding_free", True) is False and (max_tokens is not None or rows > 1)
        else "",
    ]
    found = [f for f in found if f]
    if found:
        raise PackingError(
            f"a MoE router loss (output_router_logits with router_aux_loss_coef) beside {'; '.join(found)} in "
            f"{type(trainer.data_collator).__name__}: a packed batch has no attention_mask, so transformers counts every "
            f"filler token in the router's load-balancing statistics and the loss and gradients differ from the "
            f"padded batch's. Drop the padding (padding-free batches without filler are exact), or set "
            f"output_router_logits=False in the model's config (or build it with router_aux_loss_coef=0.0).",
            param="router_aux_loss_coef",
        )


def check_loss_owner(trainer: Any, loss: str) -> None:
    """Refuse, by name, a loss of the trainer's own next to a loss mode packtools computes (``sample`` /
    ``sqrt``): the two would both own the loss, and packtools will not replace the trainer's silently."""
    if loss == "token":
        return
    own = own_compute_loss(trainer)
    loss_type = getattr(trainer.args, "loss_type", None)
    found = [
        f"{own}.compute_loss (a compute_loss of your own)" if own else "",
        f"loss_type={loss_type!r} (SFTConfig)" if loss_type not in (None, "nll") else "",
    ]
    found = [f for f in found if f] + other_losses(trainer)
    if found:
        raise PackingError(
            f"loss={loss!r} is computed by packtools (each trained token weighted by its document's length), so "
            f"{'; '.join(found)} would be replaced. Keep it with loss='token' (the trainer's own "
            f"loss, honoured), or drop it.",
            param="loss",
        )


def use_causal_lm_loss(trainer: Any) -> None:
    """Give a trainer whose model takes no loss kwargs (so ``Trainer`` cannot pass it ``num_items_in_batch``), or
    whose model's loss does not shift its labels (:data:`UNSHIFTED_LOSS`), packtools'
    :func:`~packtools.integrations.trainers.sft.causal_lm_loss` as ``compute_loss_func`` (``Trainer``'s public
    hook, recorded), unless it has a loss function or label smoother of its own."""
    config = getattr(base_model(trainer.model), "config", None)
    unshifted = getattr(config, "model_type", None) in UNSHIFTED_LOSS
    if (
        (getattr(trainer, "model_accepts_loss_kwargs", True) and not unshifted)
        or trainer.compute_loss_func is not None
        or trainer.label_smoother is not None
    ):
        return
    set_attr(trainer, "compute_loss_func", causal_lm_loss, owner=trainer)
