"""The isolation probe's refusals (:mod:`packtools.integrations.isolation`): what leaked, why, and the fix.

Each names the model, its attention backend and what to change; a fix never names the setting already in use.

>>> fix_hint(["input_ids", "position_ids"], (), "paged|eager")[:44]
"Use attn_implementation='sdpa' (or 'flash_at"
>>> "instead of 'sdpa'" in fix_hint(["input_ids", "position_ids"], (), "sdpa")
False
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import PackingError

#: Backends that keep packed sequences apart by themselves (block mask from position_ids, or varlen kernels).
ISOLATING = ("sdpa", "eager", "flex_attention", "packtools_sdpa")


def translate(err: Exception, model_name: str, impl: str | None) -> PackingError | None:
    """transformers' own refusal (a mixer without the kernel that reads seq_idx) as a PackingError."""
    text = str(err)
    if "packed sequences apart" not in text:
        return None
    return PackingError(mixer_refusal(model_name, impl, (), text))


def mixer_refusal(model_name: str, impl: str | None, mixers: Sequence[str], detail: str) -> str:
    layers = f" {list(mixers)[:3]}" if mixers else ""
    return (
        f"{model_name} with attn_implementation={impl!r} cannot keep packed sequences apart on this machine: "
        f"its convolution / state-space / linear-attention layers{layers} separate sequences only with "
        f"seq_idx or cu_seq_lens, which the PyTorch fallback ignores. Fix: prepare the trainer with "
        f"packtools.prepare_trainer / prepare_dpo_trainer, which run those layers one document at a time "
        f"(packtools.integrations.mixers.run_mixers_per_document(model) does it alone), or train on CUDA with "
        f"those kernels installed, or do not pack. "
        f"{detail}"
    )


def exceeded(report: Any) -> list[str]:
    """Each figure of an :class:`~packtools.integrations.isolation.IsolationReport` outside its tolerance, with
    both: what a refusal states (a figure inside its tolerance is never given as the reason)."""
    backward = max(report.backward_tolerance, report.tolerance)
    figures = [
        ("logits of a packed sequence against it alone", max(report.alone_diff), report.tolerance),
        ("relative loss, packed against one by one", report.loss_diff, backward),
        ("relative gradient, packed against one by one", report.grad_diff, backward),
        (
            "change of the other sequences when sequence 0 changes",
            report.perturb_diff,
            report.perturb_tolerance,
        ),
    ]
    return [
        f"{what} {value:.2e} > tolerance {tol:.2e}"
        for what, value, tol in figures
        if value is not None and value > tol
    ]


def collator_name(collator: Any) -> str:
    """The class name of the collator the probe ran (the trainer's, inside collator_check.ProbeRows)."""
    inner = getattr(collator, "collate", collator)
    return type(getattr(inner, "__self__", inner)).__name__


def collator_failed(collator: Any, packed: bool, exc: Exception) -> PackingError:
    """A collator's own exception on the probe's rows, as the refusal naming the collator."""
    name = collator_name(collator)
    what = (
        "packed rows (several sequences a row, with seq_lengths)" if packed else "rows of one sequence each"
    )
    return PackingError(
        f"the data collator ({name}) failed on the isolation probe's {what}: {type(exc).__name__}: "
        f"{str(exc)[:300]}. A collator that cannot batch packed rows cannot keep their sequences apart either; "
        f"pass data_collator=packtools.PaddingFreeCollator(tokenizer.pad_token_id) to the trainer (with "
        f"unpacked=True when every row is one sequence)."
    )


def fix_hint(keys: Sequence[str], mixers: Sequence[str], impl: str | None) -> str:
    if "attention_mask" in keys:
        return (
            "The batch carries an attention_mask, which makes transformers ignore the packed position_ids: the "
            "collator named above adds it (SFTTrainer builds one that does when no data_collator is given). Pass "
            "data_collator=packtools.PaddingFreeCollator(tokenizer.pad_token_id), which never emits one with "
            "packed rows."
        )
    if "position_ids" not in keys and not any(k.startswith("cu_seq_lens") for k in keys):
        return (
            "The batch has no position_ids and no cu_seq_lens, so the model sees one long sequence; keep "
            "them (PaddingFreeCollator(return_position_ids=True, return_flash_attn_kwargs=True))."
        )
    if mixers and "seq_idx" not in keys:
        return (
            f"Its layers {list(mixers)[:3]} mix tokens outside attention and need seq_idx/cu_seq_lens with "
            f"their CUDA kernels (mamba-ssm, causal-conv1d, flash-linear-attention); pass them "
            f"(PaddingFreeCollator(return_seq_idx=True, return_flash_attn_kwargs=True)) or do not pack."
        )
    if impl in ISOLATING or (impl is not None and "flash" in impl):
        return (  # the backend already separates packed sequences: something else in the model does not
            f"{impl!r} attention keeps packed sequences apart, so something else in the model lets them meet: "
            f"positions it builds itself instead of reading position_ids (e.g. multimodal 3-D rotary "
            f"positions), or a custom layer mixing tokens. Do not pack for this model "
            f"(PaddingFreeCollator(padding_free=False, unpacked=True) on unpacked rows)."
        )
    return (
        f"Use attn_implementation='sdpa' (or 'flash_attention_2' on GPU) instead of {impl!r}, or do not pack "
        f"(PaddingFreeCollator(padding_free=False, unpacked=True) on unpacked rows)."
    )
