"""TRL's ``RewardTrainer`` without padding: the same loss, metrics and gradients, on real tokens only.

TRL 1.16 pads every chosen and rejected sequence of a batch to the longest and reads each sequence's score at
its last non-pad token (``input_ids != pad_token_id`` in transformers' sequence-classification heads).  On a
padding-free row that rule finds the row's last token, not each document's, so packtools reads the scores
itself and hands TRL's loss code the ``[2 * pairs, 1]`` scores it expects:

* **One padding-free row.**  Each micro-batch -- TRL's padded ``[2B, T]`` batch, or packed pair rows from
  :func:`packtools.integrations.preference_data.pack_reward_pairs` -- runs through the model as one row
  (``position_ids`` restarting per sequence and ``cu_seq_lens``: FlashAttention varlen, or the block-diagonal
  mask of ``sdpa`` / ``eager``).  The model's own forward runs (through DDP's, so gradients are reduced), and
  its classification head (``score``) scores every position of the row; a forward hook on the head, held for
  that one call, keeps those per-position scores, and the score of each document is read at its own last
  token.  The model's own pooled output (the row's last non-pad token) is ignored.
* **TRL's loss and metrics unchanged.**  :class:`PackedRewardStep.compute_loss` calls ``RewardTrainer``'s own
  ``compute_loss`` with a stand-in for the model whose call returns the model's output with ``logits`` =
  those scores, chosen of every pair first, then rejected (TRL's ``torch.chunk`` order), and with the
  batch's ``margin`` and an ``attention_mask`` of the row's real tokens (TRL counts ``num_tokens`` from it):
  the margin, ``center_rewards_coefficient``, accuracy, margins and rewards are TRL's code.
* **The step's pair mean.**  As for DPO (:mod:`packtools.integrations.trl`): ``get_batch_samples`` counts the
  pairs of an optimizer step over all processes, and each micro-batch's loss (TRL's mean over its pairs) is
  weighed by ``its pairs / step pairs`` times what ``Trainer`` and DDP divide by, so the step's loss is the
  mean over all its pairs.  With equal micro-batches (TRL's own) the factor is exactly 1.
* **Guards.**  The attention backend must isolate packed sequences, the forward runs with
  ``use_cache=False`` and is checked for an ``attention_mask`` next to packed positions
  (:func:`~packtools.integrations.guard.guard_model`), and :func:`check_reward_isolation` scores a few
  sequences packed and alone through this very path before training.

Everything packtools changes about a step is the one class :class:`PackedRewardStep`, swapped onto the
trainer (:func:`~packtools.integrations.compat.classes.swap_class`); the run's decisions are one frozen
:class:`RewardRun` under ``trainer._packtools_reward``; :func:`packtools.integrations.unprepare` undoes all.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .._optional import is_instance, require
from ..constants import SEQ_LENGTHS
from ..errors import PackingError
from .backends import (
    base_model,
    check_attention_implementation,
    forward_accepts,
    multimodal_parts,
    segmented_sdpa_until_checked,
    token_mixing_layers,
)
from .budget_loader import install_train_loader
from .compat import all_or_nothing, set_attr
from .compat.classes import swap_class
from .compat.trl import keep_signature_columns, set_training_data, tokenizer_of
from .distributed import check_loss_path, trainer_divides_by_accumulation, uneven_gather
from .dpo_calls import padding_free_layout
from .guard import guard_model
from .isolation import PERTURB_TOLERANCE, TOLERANCE
from .parallel_layout import rank_layout

RUN = "_packtools_reward"
#: Columns of packed reward pair rows (``pack_reward_pairs``); ``margin`` rides along when the data has it.
REWARD_ROW_COLUMNS = ("input_ids", "completion_mask", SEQ_LENGTHS)
_PADDED_KEYS = {"input_ids", "attention_mask", "margin"}
_PACKED_KEYS = {"input_ids", "labels", "position_ids", "margin", "seq_idx"}
_PACKED_KEYS |= {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}


@dataclass
class StepPairs:
    """The pairs of the optimizer step being run (all processes), counted when its micro-batches are fetched."""

    pairs: int | None = None


@dataclass(frozen=True)
class RewardRun:
    """What ``prepare_reward_trainer`` decided for the run, held on the trainer as one value."""

    layout: Any  # RankLayout: the data-parallel size the loss is averaged over
    send_seq_idx: bool  # hybrids read sequence boundaries from seq_idx
    step: StepPairs = field(default_factory=StepPairs)  # the one mutable part: this step's pair count


@dataclass(frozen=True)
class RewardBatch:
    """One micro-batch as one padding-free row: the model's inputs, each document's last token, TRL's view."""

    flat: dict[str, Any]  # model inputs: input_ids [1, N], position_ids, cu_seq_lens_*, max_length_*
    ends: Any  # [2P] index into the row of each document's last token: chosen of every pair, then rejected
    view: dict[str, Any]  # what RewardTrainer.compute_loss reads: attention_mask (real tokens), margin

    @property
    def pairs(self) -> int:
        return int(self.ends.shape[0]) // 2


def _unexpected(inputs: dict[str, Any], allowed: set[str], layout: str) -> None:
    extra = sorted(k for k in inputs if k not in allowed and k != "use_cache")
    if extra:
        raise PackingError(
            f"the reward batch ({layout}) carries {extra}, which packtools' padding-free forward would not pass "
            f"to the model; use TRL's DataCollatorForPreference or packtools' collator for pack_reward_pairs rows."
        )


def reward_batch(inputs: dict[str, Any], send_seq_idx: bool = False) -> RewardBatch:
    """The padding-free row of a reward micro-batch: TRL's padded ``[2B, T]`` batch (chosen rows, then
    rejected) or packed pair rows (``cu_seq_lens_q``: chosen, rejected, chosen, ...).

    >>> import torch
    >>> b = reward_batch({"input_ids": torch.tensor([[5, 6, 7], [8, 0, 0]]),
    ...                   "attention_mask": torch.tensor([[1, 1, 1], [1, 0, 0]])})
    >>> b.flat["input_ids"].tolist(), b.flat["position_ids"].tolist(), b.ends.tolist()
    ([[5, 6, 7, 8]], [[0, 1, 2, 0]], [2, 3])
    """
    torch = require("torch", "packtools.prepare_reward_trainer")
    ids = inputs["input_ids"]
    if inputs.get("cu_seq_lens_q") is not None:
        _unexpected(inputs, _PACKED_KEYS, "packed pair rows")
        cu = inputs["cu_seq_lens_q"]
        if ids.shape[0] != 1 or (cu.numel() - 1) % 2:
            raise PackingError(
                f"a packed reward batch must be one row of whole pairs; got input_ids {tuple(ids.shape)} with "
                f"{cu.numel() - 1} sequences."
            )
        ends = cu[1:].long() - 1
        ends = torch.cat([ends[0::2], ends[1::2]])  # pair order -> TRL's: every chosen, then every rejected
        lengths = (cu[1:] - cu[:-1]).long()
        flat = {
            "input_ids": ids,
            "position_ids": inputs["position_ids"],
            "cu_seq_lens_q": cu,
            "cu_seq_lens_k": cu,
        }
    else:
        _unexpected(inputs, _PADDED_KEYS, "padded")
        if inputs.get("attention_mask") is None or ids.dim() != 2 or ids.shape[0] % 2:
            raise PackingError(
                "a reward batch is either TRL's padded layout (input_ids and attention_mask of [2 * pairs, T]) "
                "or packed pair rows (cu_seq_lens_q); this one is neither."
            )
        lengths, valid, cu = padding_free_layout(inputs["attention_mask"])
        starts = cu[:-1].long()
        n = int(cu[-1])
        positions = torch.arange(n, device=ids.device) - torch.repeat_interleave(starts, lengths)
        ids = ids[valid][None]
        ends = cu[1:].long() - 1
        flat = {"input_ids": ids, "position_ids": positions[None], "cu_seq_lens_q": cu, "cu_seq_lens_k": cu}
    longest = int(lengths.max())
    flat.update(max_length_q=longest, max_length_k=longest, use_cache=False)
    if send_seq_idx:
        order = torch.arange(lengths.shape[0], dtype=torch.int32, device=ids.device)
        flat["seq_idx"] = torch.repeat_interleave(order, lengths)[None]
    view = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if inputs.get("margin") is not None:
        view["margin"] = inputs["margin"]
    return RewardBatch(flat, ends, view)


def score_head(model: Any) -> Any:
    """The sequence-classification head (``score``) of ``model`` (under PEFT / DDP wrappers); refused by name
    when the model has none."""
    inner = base_model(model)
    head = getattr(inner, "score", None)
    if head is None or not callable(head):
        raise PackingError(
            f"{type(inner).__name__} has no 'score' head, so packtools cannot score each packed document at its "
            f"own last token. Reward models padding-free need an AutoModelForSequenceClassification with a "
            f"'score' head (LlamaForSequenceClassification, Qwen3ForSequenceClassification, ...).",
            param="model",
        )
    return head


class ScoredRow:
    """Stands in for the model in ``RewardTrainer.compute_loss``: calling it runs the batch's padding-free row
    through ``model`` and returns the model's output with ``logits`` = each document's score, read from the
    head's per-position output at the document's own last token."""

    def __init__(self, model: Any, batch: RewardBatch) -> None:
        self.model, self.batch = model, batch

    def __call__(self, **kwargs: Any) -> Any:
        head = score_head(self.model)
        scored: list[Any] = []
        handle = head.register_forward_hook(lambda module, args, output: scored.append(output))
        try:
            out = self.model(**self.batch.flat)
        finally:
            handle.remove()
        n = int(self.batch.flat["input_ids"].shape[1])
        if len(scored) != 1 or getattr(scored[0], "ndim", 0) != 3 or tuple(scored[0].shape[:2]) != (1, n):
            shapes = [tuple(getattr(s, "shape", ())) for s in scored]
            raise PackingError(
                f"{type(base_model(self.model)).__name__}'s 'score' head ran {len(scored)} time(s) with outputs "
                f"{shapes}, not once over the {n} positions of the packed row: this model pools before its head, "
                f"so packtools cannot read each document's score. Train it padded (without prepare_reward_trainer)."
            )
        out["logits"] = scored[0][0].index_select(0, self.batch.ends)
        return out


def _pairs_in(batch: dict[str, Any]) -> int:
    if batch.get("cu_seq_lens_q") is not None:
        return (int(batch["cu_seq_lens_q"].numel()) - 1) // 2
    return int(batch["input_ids"].shape[0]) // 2


class PackedRewardStep:
    """packtools' part of a ``RewardTrainer`` step (see the module docstring); swapped in by
    :func:`prepare_reward_trainer` in front of the trainer's own class."""

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> Any:
        torch = require("torch", "packtools.prepare_reward_trainer")
        samples, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)  # type: ignore[misc]
        run: RewardRun = vars(self)[RUN]
        pairs = torch.tensor(sum(_pairs_in(b) for b in samples), device=device)
        if self.args.world_size > 1:  # type: ignore[attr-defined]
            pairs = self.accelerator.gather(pairs).sum() // run.layout.peers  # type: ignore[attr-defined]
        run.step.pairs = int(pairs)
        return samples, num_items

    def compute_loss(
        self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        run: RewardRun = vars(self)[RUN]
        batch = reward_batch(inputs, run.send_seq_idx)
        with uneven_gather(self.accelerator):  # type: ignore[attr-defined]  # ranks hold different pair counts
            result = super().compute_loss(  # type: ignore[misc]
                ScoredRow(model, batch), dict(batch.view), return_outputs, num_items_in_batch
            )
        if not self.model.training or not run.step.pairs:  # type: ignore[attr-defined]
            return result
        loss = result[0] if return_outputs else result
        divided = trainer_divides_by_accumulation(self, num_items_in_batch)
        steps = self.current_gradient_accumulation_steps if divided else 1  # type: ignore[attr-defined]
        loss = loss * (batch.pairs * steps * run.layout.dp_size / run.step.pairs)
        return (loss, result[1]) if return_outputs else loss


def check_reward_isolation(
    model: Any, lengths: Sequence[int] = (5, 9, 3, 7), seed: int = 0, send_seq_idx: bool = False
) -> float:
    """Score a few sequences packed into one row (the path training takes) and each alone (the model's own
    pooled score); raise :class:`PackingError` when they differ, or when changing the first sequence moves the
    others' scores.  Returns the largest difference.  No gradients, eval mode (restored)."""
    torch = require("torch", "packtools.prepare_reward_trainer")
    if len(lengths) % 2:
        raise PackingError(f"the probe scores pairs: give an even number of lengths, got {list(lengths)}.")
    inner = base_model(model)
    pad = inner.config.get_text_config().pad_token_id
    vocab = int(inner.get_input_embeddings().weight.shape[0])
    gen = torch.Generator().manual_seed(seed)
    device = next(inner.parameters()).device
    tokens = [torch.randint(1, vocab, (n,), generator=gen) for n in lengths]
    tokens = [torch.where(t == pad, (t % (vocab - 1)) + 1, t).to(device) for t in tokens]

    def packed(seqs: list[Any]) -> Any:
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long, device=device)
        mask = torch.zeros_like(ids)
        for i, s in enumerate(seqs):
            ids[i, : len(s)], mask[i, : len(s)] = s, 1
        batch = reward_batch({"input_ids": ids, "attention_mask": mask}, send_seq_idx)
        return ScoredRow(model, batch)().logits.reshape(-1)  # in row order

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            together = packed(tokens)
            alone = torch.stack(
                [model(input_ids=t[None], use_cache=False).logits.reshape(-1)[0] for t in tokens]
            )
            changed = [tokens[0].flip(0) % (vocab - 1) + 1, *tokens[1:]]
            moved = packed(changed)
    finally:
        model.train(was_training)
    dtype = str(together.dtype).replace("torch.", "")
    scale = max(1.0, float(alone.abs().max()))
    diff = float((together - alone).abs().max()) / scale
    perturb = float((moved[1:] - together[1:]).abs().max()) / scale
    if diff > TOLERANCE.get(dtype, 1e-2) or perturb > PERTURB_TOLERANCE:
        raise PackingError(
            f"{type(inner).__name__} scores packed sequences differently from the same sequences alone (largest "
            f"relative difference {diff:.2e}; changing one sequence moved the others by {perturb:.2e}): its "
            f"attention ({inner.config._attn_implementation!r}) or a token-mixing layer lets packed sequences see "
            f"each other. Use attn_implementation='sdpa', 'eager' or 'flash_attention_2', or train padded.",
            param="model",
        )
    return max(diff, perturb)


def _check_trainer(trainer: Any) -> None:
    if not is_instance(trainer, "trl", "RewardTrainer"):
        raise PackingError(
            f"prepare_reward_trainer expects a trl.RewardTrainer, got {type(trainer).__name__}; for DPOTrainer use "
            f"packtools.prepare_dpo_trainer, for Trainer or SFTTrainer packtools.prepare_trainer.",
            param="trainer",
        )
    from trl import RewardTrainer

    if isinstance(trainer, PackedRewardStep):
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
    inner = base_model(trainer.model)
    if multimodal_parts(trainer.model):
        raise PackingError(
            f"{type(inner).__name__} is a multimodal model: the padding-free reward forward carries text rows only.",
            param="model",
        )
    peft_config = getattr(trainer.model, "peft_config", None) or {}
    if any(getattr(c, "is_prompt_learning", False) for c in peft_config.values()):
        raise PackingError(
            "prompt-learning PEFT adapters add virtual tokens in front of every sequence, which a padding-free "
            "row cannot hold; use LoRA-style adapters.",
            param="model",
        )
    score_head(trainer.model)


def _use_packed_dataset(trainer: Any, dataset: Any) -> None:
    from ..batches.preference import PreferenceCollator

    names = list(getattr(dataset, "column_names", None) or [])
    missing = [c for c in REWARD_ROW_COLUMNS if c not in names]
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
        keep_signature_columns(trainer, [*REWARD_ROW_COLUMNS, *pair_columns])


def _sends_seq_idx(model: Any) -> bool:
    names = inspect.signature(base_model(model).forward).parameters
    return "seq_idx" in names or (bool(token_mixing_layers(model)) and forward_accepts(model, "seq_idx"))


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
    check_loss_path(trainer)
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
        swap_class(trainer, PackedRewardStep, owner=trainer)  # refuses a trainer prepared twice
        run = RewardRun(layout, _sends_seq_idx(trainer.model))
        check_attention_implementation(trainer.model)
        with segmented_sdpa_until_checked([trainer.model], segmented_sdpa, owner=trainer):
            if check_isolation and (trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled):
                warnings.warn(
                    "prepare_reward_trainer: the isolation probe was skipped because the model is sharded "
                    "(DeepSpeed/FSDP); run packtools.integrations.reward.check_reward_isolation on an unsharded copy.",
                    stacklevel=2,
                )
            elif check_isolation:
                check_reward_isolation(trainer.model, send_seq_idx=run.send_seq_idx)
        guard_model(trainer.model, owner=trainer)
        if train_dataset is not None:
            _use_packed_dataset(trainer, train_dataset)
        install_train_loader(trainer, max_tokens, owner=trainer, layout=layout)
        set_attr(trainer, RUN, run, owner=trainer)
    return trainer
