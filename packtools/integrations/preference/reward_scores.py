"""Each packed document's reward score, read at its own last token through the model's classification head.

Transformers' sequence-classification models score every position with their head (``score``) and pool at
the last non-pad token of each row (``input_ids != pad_token_id``); on a padding-free row that is the row's
last token, not each document's.  :func:`reward_batch` lays a reward micro-batch out as one padding-free row
and records where each document ends; :class:`ScoredRow` runs the model's own forward on it (through DDP's,
so gradients are reduced) with a forward hook on the head, held for that one call, that keeps the head's
per-position scores, and reads each document's score at its last token; the model's pooled output is
ignored.  A model whose head does not score every position of the row is refused by name.
:func:`check_reward_isolation` scores a few sequences through this path and alone (the model's own pooling)
and refuses a model whose packed sequences leak.  The step that uses them: :mod:`packtools.integrations.preference.reward`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..._optional import require
from ...constants import VARLEN_KEYS
from ...errors import PackingError
from ..attention.backends import base_model, token_mixing_layers
from ..attention.isolation import (
    PERTURB_TOLERANCE,
    TOLERANCE,
    autocast_inside,
    backend_hint,
    compute_dtype,
    translate,
)
from ..attention.mixers import POSITIONLESS_MASKS, document_mixers
from .calls import padding_free_layout

_PADDED_KEYS = {"input_ids", "attention_mask", "margin"}
_PACKED_KEYS = {"input_ids", "labels", "position_ids", "margin", "seq_idx", "use_cache", *VARLEN_KEYS}


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
        # In the dtype of the model's own (pooled) output: under bf16/fp16 mixed precision accelerate returns a
        # float32 model's outputs in float32 while the head ran in half precision, and TRL computes the loss on them.
        pooled = getattr(out, "logits", None)
        scores = scored[0][0].index_select(0, self.batch.ends)
        out["logits"] = scores if pooled is None else scores.to(pooled.dtype)
        return out


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
            with autocast_inside(
                inner
            ) as seen:  # the precision the forward computes in (accelerate's wrapper)
                together = packed(tokens)
            alone = torch.stack(
                [model(input_ids=t[None], use_cache=False).logits.reshape(-1)[0] for t in tokens]
            )
            changed = [tokens[0].flip(0) % (vocab - 1) + 1, *tokens[1:]]
            moved = packed(changed)
    except Exception as err:
        if translate(err, type(inner).__name__, inner.config._attn_implementation) is None:
            raise
        raise PackingError(  # transformers' own refusal of the packed row (a token-mixing layer's fallback)
            f"{type(inner).__name__} cannot keep packed sequences apart on this machine: {err} {_fix(inner)}",
            param="model",
        ) from err
    finally:
        model.train(was_training)
    dtype = compute_dtype(inner, seen=seen)
    scale = max(1.0, float(alone.abs().max()))
    diff = float((together - alone).abs().max()) / scale
    perturb = float((moved[1:] - together[1:]).abs().max()) / scale
    tolerance = TOLERANCE.get(dtype, 1e-2)
    if diff > tolerance or perturb > PERTURB_TOLERANCE:
        figures = [f"relative difference {diff:.2e} > tolerance {tolerance:.2e}"] if diff > tolerance else []
        if perturb > PERTURB_TOLERANCE:
            figures.append(
                f"changing one sequence moved the others by {perturb:.2e} > tolerance {PERTURB_TOLERANCE:.2e}"
            )
        raise PackingError(
            f"{type(inner).__name__} scores packed sequences differently from the same sequences alone "
            f"({'; '.join(figures)}): something in it lets packed sequences see each other. "
            f"{_fix(inner)}",
            param="model",
        )
    return max(diff, perturb)


def _fix(model: Any) -> str:
    """What would make ``model`` score packed sequences apart: packtools' per-document layers where it has
    token-mixing layers or builds its masks without ``position_ids`` and they are not in place (a probe called
    before :func:`~packtools.integrations.preference.reward.prepare_reward_trainer`), else the backend's hint."""
    unpacked = "train it padded (without prepare_reward_trainer)"
    mixers = token_mixing_layers(model)
    model_type = getattr(model.config, "model_type", None)
    if mixers or (model_type in POSITIONLESS_MASKS and document_mixers(model) is None):
        what = f"its token-mixing layers {mixers[:3]}" if mixers else "its forward's attention masks"
        return (
            f"packtools keeps {what} per document once prepared: call prepare_reward_trainer(trainer) (or "
            f"packtools.integrations.attention.mixers.run_mixers_per_document(model)) before this probe, or "
            f"{unpacked}."
        )
    return backend_hint(model.config._attn_implementation, unpacked)
