"""The isolation probe: does this model, with this attention backend and these batch keys, keep packed sequences apart?

Padding-free training is right only when every layer that mixes tokens (attention, but also the convolutions
and state-space or linear-attention scans of hybrid models) stops at sequence boundaries.  When one does not,
nothing crashes: the loss just trains on the wrong context.  :func:`check_isolation` runs a few short
sequences through the model twice -- packed into one batch exactly as the collator and the trainer adapter
would feed them, and each sequence alone -- and compares the logits; it also changes the tokens of the first
sequence and checks that the logits of the others do not move.  The model runs in eval mode (no dropout),
without gradients unless ``backward=True``, and its train/eval flags are restored afterwards.

**Refusals** (:func:`fix_hint`) say what leaked, why, and the fix: each names the model, its attention backend and
what to change; a fix never names the setting already in use.

>>> fix_hint(["input_ids", "position_ids"], (), "paged|eager")[:44]
"Use attn_implementation='sdpa' (or 'flash_at"
>>> "instead of 'sdpa'" in fix_hint(["input_ids", "position_ids"], (), "sdpa")
False
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..._optional import require
from ...batches.collate import PaddingFreeCollator
from ...errors import PackingError
from ..trainers.rows import locate_rows, sequence_spans
from ..trainers.sft import summed_next_token_loss
from .backends import (
    MASK_BACKENDS,
    PLACEHOLDER_TOKENS,
    adapt_collator,
    attention_implementation,
    base_model,
    forward_accepts,
    is_flash,
    token_mixing_layers,
)

#: Sequence lengths of the probe batch (two packed rows of two sequences each).
DEFAULT_LENGTHS = (5, 9, 3, 7)
#: Relative tolerances by dtype (times ``max(1, largest |logit|)``) for packed-against-alone differences, which
#: carry rounding noise (different kernels, shapes and summation orders): leaks in float32 show at ~1e-4 and above.
TOLERANCE = {"float64": 1e-9, "float32": 1e-5, "bfloat16": 5e-2, "float16": 2e-2}
#: Relative tolerance, in every dtype, for the perturbation signal: the same batch run twice with only the first
#: sequence's tokens changed.  The other sequences' computations are then the same operations on the same values,
#: so an isolated model moves them by exactly 0 whatever the dtype; any leak moves some logit by at least one
#: rounding step of its dtype (~4e-3 x |logit| in bfloat16), far above this.
PERTURB_TOLERANCE = 1e-6
#: Off the CPU, a forward need not be bitwise reproducible (mixture-of-experts blocks sum experts with unordered
#: atomic adds on CUDA): the probe then runs the same inputs twice and takes this many times the largest
#: difference between the two runs (the model's own run-to-run noise) as the floor of both tolerances.  A leak
#: moves logits by the size of other sequences' contributions (1e-2 and more), far above a few rounding steps.
NOISE_FACTOR = 10.0
#: ``backward=True`` allows relative loss/gradient differences this many times :data:`TOLERANCE`: gradients sum all
#: tokens and layers, so their rounding noise exceeds the logits'; a leak moves them far more.
BACKWARD_FACTOR = 10.0


@dataclass(frozen=True, kw_only=True)
class IsolationReport:
    """What :func:`check_isolation` ran and measured.

    ``alone_diff[i]``: largest ``|logit|`` difference of sequence ``i`` between the packed batch and the
    sequence run alone; ``perturb_diff``: largest change of the other sequences' logits when the tokens of
    sequence 0 change; ``loss_diff`` / ``grad_diff`` (``backward=True``): relative differences of the summed
    token loss and of the parameter gradients, packed against one by one (divided by ``max(1, |loss|)`` and
    ``max(1, largest |gradient|)``).  :attr:`leaks`: any of them above its tolerance.
    """

    model: str
    backend: str | None
    dtype: str
    device: str
    lengths: tuple[int, ...]
    keys: tuple[str, ...]
    alone_diff: tuple[float, ...]
    perturb_diff: float
    tolerance: float
    loss_diff: float | None = None
    grad_diff: float | None = None
    perturb_tolerance: float = 0.0
    noise: float | None = None
    backward_tolerance: float = 0.0

    @property
    def max_diff(self) -> float:
        """The largest of all measured differences."""
        extra = [d for d in (self.loss_diff, self.grad_diff) if d is not None]
        return max([*self.alone_diff, self.perturb_diff, *extra])

    @property
    def leaks(self) -> bool:
        return bool(exceeded(self))

    def __str__(self) -> str:
        lines = [
            f"{self.model} attn_implementation={self.backend!r} {self.dtype} on {self.device}",
            f"batch keys: {', '.join(self.keys)}",
            f"sequence lengths: {list(self.lengths)}",
            "max |packed - alone| per sequence: " + ", ".join(f"{d:.1e}" for d in self.alone_diff),
            f"max change of other sequences when sequence 0 changes: {self.perturb_diff:.1e} "
            f"(tolerance {self.perturb_tolerance:.1e})",
        ]
        if self.loss_diff is not None:
            lines.append(
                f"relative loss difference: {self.loss_diff:.1e}; relative gradient difference: {self.grad_diff:.1e} "
                f"(tolerance {max(self.backward_tolerance, self.tolerance):.1e})"
            )
        lines.append(
            "run-to-run noise not measured (the CPU forward is exact)"
            if self.noise is None
            else f"run-to-run noise (the same inputs run twice): {self.noise:.1e}; tolerances at least "
            f"{NOISE_FACTOR:g} x that"
        )
        verdict = "LEAKS" if self.leaks else "isolated"
        lines.append(f"tolerance {self.tolerance:.1e}: {verdict}")
        return "\n".join(lines)


def max_abs_diff(got: Any, reference: Any) -> float:
    """The largest ``|got - reference|`` of two tensors, compared in float32."""
    return float((got.float() - reference.float()).abs().max())


def compute_dtype(model: Any, default: Any = None, seen: Sequence[str] = ()) -> str:
    """The dtype ``model``'s forward computes in here, by name (a key of :data:`TOLERANCE`), which every probe's
    tolerance follows: the autocast dtype where autocast is on for the device of its weights (a float32 model
    trained with ``bf16=True`` runs in bfloat16 under :func:`trainer_autocast`), else its first floating
    parameter's dtype (``default``, then float32, for a model without one).  ``seen``: what
    :func:`autocast_inside` recorded during a forward of the probe; its first entry, when there is one, wins.

    >>> import torch
    >>> model = torch.nn.Linear(2, 2)
    >>> compute_dtype(model)
    'float32'
    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     compute_dtype(model)
    'bfloat16'
    """
    if seen:
        return seen[0]
    torch = require("torch", "packtools.integrations.check_isolation")
    param = next((p for p in base_model(model).parameters() if p.is_floating_point()), None)
    if param is not None and torch.is_autocast_enabled(param.device.type):
        dtype = torch.get_autocast_dtype(param.device.type)
    else:
        dtype = param.dtype if param is not None else (default or torch.float32)
    return str(dtype).replace("torch.", "")


@contextmanager
def autocast_inside(model: Any) -> Iterator[list[str]]:
    """Record, while the block runs, the compute dtype each forward of ``model`` runs in, seen from inside it: a
    forward pre-hook on its first submodule with floating weights appends :func:`compute_dtype` there.

    It sees what :func:`compute_dtype` cannot from outside: an autocast the model's own ``forward`` enters, as
    accelerate's ``prepare_model`` wraps it under ``bf16=True`` / ``fp16=True`` (TRL's reference models), so a
    probe called on such a model directly judges at the precision it computes in.  Nothing is recorded for a
    model without such a submodule (a bare layer): :func:`compute_dtype` from outside is then all there is.

    >>> import torch
    >>> class Wrapped(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.inner = torch.nn.Linear(2, 2)
    ...     @torch.autocast("cpu", dtype=torch.bfloat16)
    ...     def forward(self, x):
    ...         return self.inner(x)
    >>> model = Wrapped()
    >>> with autocast_inside(model) as seen:
    ...     _ = model(torch.ones(1, 2))
    >>> compute_dtype(model), seen
    ('float32', ['bfloat16'])
    """
    require("torch", "packtools.integrations.check_isolation")
    base = base_model(model)
    inner = next(
        (m for m in base.modules() if m is not base and any(p.is_floating_point() for p in m.parameters())),
        None,
    )
    seen: list[str] = []
    handle = (
        None if inner is None else inner.register_forward_pre_hook(lambda m, a: seen.append(compute_dtype(m)))
    )
    try:
        yield seen
    finally:
        if handle is not None:
            handle.remove()


def trainer_autocast(trainer: Any) -> AbstractContextManager[Any]:
    """The trainer's mixed-precision autocast (accelerate's ``Accelerator.autocast``; none without an accelerator).
    The prepare functions run their probes under it, so a float32 model trained with ``bf16=True`` / ``fp16=True``
    is probed at the precision and on the kernels training runs (packtools' flash paths take half-precision CUDA
    inputs only), at that precision's tolerance (:func:`compute_dtype`)."""
    accelerator = getattr(trainer, "accelerator", None)
    return accelerator.autocast() if accelerator is not None else nullcontext()


class ProbeDiffs:
    """What the tree and padding-free RL probes compare: each packed output against its reference (the sequence
    run alone, TRL's padded batch), a difference above ``tol`` times the reference's scale (``max(1, |ref|)``)
    being a leak; ``worst`` keeps the largest difference seen.  ``tol`` follows the compute dtype
    (:func:`compute_dtype`): ``1e-4`` in float32 (and float64), ``3e-2`` in half precision."""

    def __init__(self, dtype: str) -> None:
        self.tol = 1e-4 if dtype in ("float32", "float64") else 3e-2
        self.worst = 0.0

    def exceeds(self, got: Any, reference: Any) -> float | None:
        """The largest ``|got - reference|`` where it exceeds the tolerance, else ``None``."""
        diff = max_abs_diff(got, reference)
        self.worst = max(self.worst, diff)
        return diff if diff > self.tol * max(1.0, float(reference.abs().max())) else None


def _probe_tokens(base: Any, total: int, rng: np.random.Generator) -> np.ndarray:
    emb = base.get_input_embeddings() if hasattr(base, "get_input_embeddings") else None
    vocab = getattr(emb, "num_embeddings", None)
    config = getattr(base, "config", None)
    if vocab is None and config is not None:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        vocab = getattr(text, "vocab_size", None)
    if not vocab:
        raise PackingError(
            f"cannot tell the vocabulary size of {type(base).__name__} (no input embeddings, no "
            f"config.vocab_size); the isolation probe needs token ids the model accepts."
        )
    special = set()
    if config is not None:
        # and a multimodal model's placeholders: one without its pixels is refused (check_image_placeholders)
        for name in ("pad_token_id", "bos_token_id", "eos_token_id", *PLACEHOLDER_TOKENS):
            value = getattr(config, name, None)
            special.update(value if isinstance(value, (list, tuple)) else [value])
    ids = np.arange(int(vocab), dtype=np.int64)
    ids = ids[~np.isin(ids, [v for v in special if isinstance(v, int)])]
    return rng.choice(ids, size=total, replace=True)


def _check_lengths(lengths: Sequence[int]) -> tuple[int, ...]:
    out = tuple(int(n) for n in lengths)
    if len(out) < 2 or min(out) < 2 or any(isinstance(n, bool) for n in lengths):
        raise PackingError(
            f"lengths={list(lengths)!r}: the probe needs at least two sequences of >= 2 tokens each.",
            param="lengths",
        )
    return out


def _rows(seqs: list[np.ndarray], packed: bool = True) -> list[dict[str, Any]]:
    """The sequences as two packed rows (first half, second half), in order; one row each if not ``packed``."""
    if not packed:
        return [{"input_ids": s.tolist()} for s in seqs]
    half = (len(seqs) + 1) // 2
    rows = []
    for part in (seqs[:half], seqs[half:]):
        if part:
            rows.append({"input_ids": np.concatenate(part).tolist(), "seq_lengths": [len(s) for s in part]})
    return rows


def _spans(rows: list[dict[str, Any]], input_ids: Any, name: str) -> list[tuple[int, int, int]]:
    """``(batch_row, start, stop)`` of each probe sequence in the collated batch."""
    where = locate_rows(input_ids, [np.asarray(r["input_ids"]) for r in rows])
    if where is None:
        raise PackingError(
            f"the collator's batch (input_ids of shape {tuple(input_ids.shape)}) does not hold the probe's "
            f"{len(rows)} rows in order, either flat ([1, T]) or one per row ([B, T], padded): it merges, "
            f"reorders or cuts rows, so the isolation probe cannot check {name}. Use "
            f"packtools.PaddingFreeCollator."
        )
    return sequence_spans(where, [row.get("seq_lengths") or [len(row["input_ids"])] for row in rows])


def _logits(out: Any, name: str) -> Any:
    logits = getattr(out, "logits", None)
    if logits is None and isinstance(out, (tuple, list)) and out:
        logits = out[0]
    if logits is None or getattr(logits, "ndim", 0) != 3:
        raise PackingError(
            f"{name} returned no [batch, tokens, vocab] logits; the isolation probe checks causal language "
            f"models. For another head, pass check_isolation=False to prepare_trainer and check it yourself."
        )
    return logits


def check_isolation(
    model: Any,
    collator: Callable[[list[dict[str, Any]]], dict[str, Any]] | None = None,
    *,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    seed: int = 0,
    atol: float | None = None,
    backward: bool = False,
    raise_on_leak: bool = True,
    packed: bool = True,
    measure_noise: bool | None = None,
) -> IsolationReport:
    """Check that ``model`` keeps packed sequences apart; return an :class:`IsolationReport`.

    A few sequences of ``lengths`` tokens (random ids from the model's vocabulary, special tokens left
    out) are packed into two rows, collated by ``collator`` (default: ``PaddingFreeCollator`` with the
    model's pad token), filtered to the keys the model's ``forward`` accepts (as :func:`~packtools.integrations.prepare_trainer`
    does), and run with ``use_cache=False`` and no ``attention_mask``; each sequence is also run alone.
    ``backward=True`` also compares the summed token loss and the parameter gradients (without touching
    ``.grad``).  A custom ``collator`` must keep the rows and their sequences in order (flat, or one batch row
    per row, right- or left-padded: :func:`locate_rows`).  ``packed=False`` gives it one sequence per row
    (no ``seq_lengths``), as an unpacked dataset would.

    ``atol`` defaults to a tolerance by dtype (:data:`TOLERANCE`, times the largest ``|logit|`` when that
    exceeds 1) for the packed-against-alone differences; the perturbation signal is judged against ~0 in every
    dtype (:data:`PERTURB_TOLERANCE` times the same scale, or ``atol`` if smaller), so a leak too small to stand
    out of half-precision rounding in the alone comparison is still caught.  ``measure_noise`` (default: on
    every device but the CPU, whose forward is bitwise reproducible) floors both at the model's own run-to-run
    noise (:data:`NOISE_FACTOR`).

    Raises :class:`PackingError` naming the model class, the backend and the fix when sequences leak
    (or when transformers refuses the packed batch); ``raise_on_leak=False`` returns the report instead.

    >>> import torch, transformers
    >>> config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
    ...     num_hidden_layers=1, num_attention_heads=2, attn_implementation="eager")
    >>> _ = torch.manual_seed(0)
    >>> report = check_isolation(transformers.LlamaForCausalLM(config))
    >>> report.leaks, report.perturb_diff, max(report.alone_diff) < 1e-5
    (False, 0.0, True)
    >>> from packtools import PaddingFreeCollator
    >>> no_positions = PaddingFreeCollator(0, return_position_ids=False)  # eager then sees one long row
    >>> check_isolation(transformers.LlamaForCausalLM(config), no_positions)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    packtools.errors.PackingError: LlamaForCausalLM with attn_implementation='eager' lets packed sequences see each other...
    """
    torch = require("torch", "packtools.integrations.check_isolation")
    lengths = _check_lengths(lengths)
    base = base_model(model)
    impl = attention_implementation(model)
    name = type(base).__name__
    config = getattr(base, "config", None)
    pad = getattr(config, "pad_token_id", None) if config is not None else None
    if collator is None:
        collator = PaddingFreeCollator(pad if isinstance(pad, int) else 0, unpacked=not packed)
    collator = adapt_collator(collator, model)
    param = next(iter(base.parameters()), None)
    device = param.device if param is not None else torch.device("cpu")
    rng = np.random.default_rng(seed)
    tokens = _probe_tokens(base, sum(lengths), rng)
    seqs = np.split(tokens, np.cumsum(lengths)[:-1])
    other = _probe_tokens(base, lengths[0], rng)
    cache = {"use_cache": False} if forward_accepts(base, "use_cache") else {}

    def run_packed(parts: list[np.ndarray]) -> tuple[Any, Any, tuple[str, ...], list[tuple[int, int, int]]]:
        rows = _rows(parts, packed)
        try:
            batch = dict(collator(rows))
        except PackingError:
            raise
        except Exception as exc:  # noqa: BLE001 - another library's collator: named, with the fix
            raise collator_failed(collator, packed, exc) from exc
        if "input_ids" not in batch:
            raise PackingError(f"the collator returned no 'input_ids' (keys {sorted(batch)}).")
        spans = _spans(rows, batch["input_ids"], name)
        labels = batch.pop("labels", None)
        batch = {k: v.to(device) if hasattr(v, "to") else v for k, v in batch.items()}
        try:
            # the batch may hold use_cache=False already; a forward that takes no use_cache gets none
            out = model(**{k: v for k, v in batch.items() if k != "use_cache"}, **cache)
        except (ValueError, NotImplementedError) as err:
            translated = translate(err, name, impl)
            if translated is not None:
                raise translated from err
            raise
        return _logits(out, name), labels, tuple(batch), spans

    def run_alone(seq: np.ndarray) -> Any:
        return _logits(model(input_ids=torch.as_tensor(seq[None], device=device), **cache), name)[0]

    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            with autocast_inside(model) as seen:
                logits, _, keys, spans = run_packed(list(seqs))
            moved, _, _, moved_spans = run_packed([other, *seqs[1:]])
            alone = [run_alone(s) for s in seqs]
        diffs = tuple(max_abs_diff(logits[r, a:b], al) for (r, a, b), al in zip(spans, alone))
        perturb = max(
            max_abs_diff(logits[r, a:b], moved[mr, ma:mb])
            for (r, a, b), (mr, ma, mb) in zip(spans[1:], moved_spans[1:])
        )
        scale = max(1.0, max(float(al.float().abs().max()) for al in alone))
        # The compute dtype (the weights', or autocast's: the caller's or the one the model's forward enters, as
        # accelerate's mixed-precision wrapper does), not the logits' (some heads upcast them to float32).
        dtype = compute_dtype(base, logits.dtype, seen)
        tol = float(atol) if atol is not None else TOLERANCE.get(dtype, 1e-5) * scale
        perturb_tol = min(tol, PERTURB_TOLERANCE * scale)
        backward_tol = float(atol) if atol is not None else TOLERANCE.get(dtype, 1e-5) * BACKWARD_FACTOR
        noise = None
        if measure_noise if measure_noise is not None else device.type != "cpu":
            with torch.no_grad():
                again, _, _, _ = run_packed(list(seqs))
                noise = max(
                    max(max_abs_diff(logits[r, a:b], again[r, a:b]) for r, a, b in spans),
                    max(max_abs_diff(run_alone(s), al) for s, al in zip(seqs, alone)),
                )
            tol, perturb_tol = max(tol, NOISE_FACTOR * noise), max(perturb_tol, NOISE_FACTOR * noise)
            backward_tol = max(backward_tol, NOISE_FACTOR * noise)
        loss_diff = grad_diff = None
        if backward:
            loss_diff, grad_diff = _compare_backward(torch, base, run_packed, run_alone, seqs)
    finally:
        for module, training in modes:
            module.training = training
    report = IsolationReport(
        model=name,
        backend=impl,
        dtype=dtype,
        device=str(device),
        lengths=lengths,
        keys=keys,
        alone_diff=diffs,
        perturb_diff=perturb,
        tolerance=tol,
        loss_diff=loss_diff,
        grad_diff=grad_diff,
        perturb_tolerance=perturb_tol,
        backward_tolerance=backward_tol,
        noise=noise,
    )
    if report.leaks and raise_on_leak:
        mixers = token_mixing_layers(model)
        if mixers and "seq_idx" in keys:
            # transformers before 5.20 runs these layers' PyTorch fallback on seq_idx without refusing (later ones
            # raise, see translate below): the same refusal, from the measured leak.
            raise PackingError(
                mixer_refusal(name, impl, mixers, f"packed logits move by {perturb:.1e}.\n{report}")
            )
        raise PackingError(
            f"{name} with attn_implementation={impl!r} lets packed sequences see each other: "
            f"{'; '.join(exceeded(report))} (batch keys {list(keys)} from {collator_name(collator)}). "
            f"{fix_hint(keys, mixers, impl)} (prepare_trainer(..., check_isolation=False) "
            f"skips this check; training would then be silently wrong.)\n{report}"
        )
    return report


def _compare_backward(
    torch: Any,
    base: Any,
    run_packed: Callable[..., Any],
    run_alone: Callable[..., Any],
    seqs: list[np.ndarray],
) -> tuple[float, float]:
    params = [p for p in base.parameters() if p.requires_grad]
    if not params:
        return 0.0, 0.0
    logits, labels, _, _ = run_packed(list(seqs))
    packed_loss, _ = summed_next_token_loss(logits, labels)
    packed_grads = torch.autograd.grad(packed_loss, params, allow_unused=True)
    alone_loss = 0.0
    alone_grads = [None] * len(params)
    for seq in seqs:
        loss, _ = summed_next_token_loss(run_alone(seq)[None], torch.as_tensor(seq[None]))
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        alone_loss += float(loss.detach())
        alone_grads = [g if a is None else (a if g is None else a + g) for a, g in zip(alone_grads, grads)]
    grad_diff, grad_scale = 0.0, 1.0
    for a, b in zip(packed_grads, alone_grads):
        if a is None and b is None:
            continue
        a = torch.zeros_like(b) if a is None else a
        b = torch.zeros_like(a) if b is None else b
        grad_diff = max(grad_diff, max_abs_diff(a, b))
        grad_scale = max(grad_scale, float(b.float().abs().max()))
    loss_diff = abs(float(packed_loss.detach()) - alone_loss) / max(1.0, abs(alone_loss))
    return loss_diff, grad_diff / grad_scale


# -- probe refusals ------------------------------------------------------------------------------------------
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
        f"(packtools.integrations.attention.mixers.run_mixers_per_document(model) does it alone), or train on CUDA with "
        f"those kernels installed, or do not pack. "
        f"{detail}"
    )


def exceeded(report: Any) -> list[str]:
    """Each figure of an :class:`~packtools.integrations.attention.isolation.IsolationReport` outside its tolerance, with
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
    return backend_hint(
        impl, "do not pack (PaddingFreeCollator(padding_free=False, unpacked=True) on unpacked rows)"
    )


def backend_hint(impl: str | None, unpacked: str) -> str:
    """The fix for a leak that is not the batch's: another backend where ``impl`` does not separate packed
    sequences itself, else (it does: suggesting another would not help) what else in the model lets them meet.
    ``unpacked``: how to train this trainer without packing."""
    if impl in MASK_BACKENDS or is_flash(impl):  # the backends that keep packed sequences apart by themselves
        return (  # the backend already separates packed sequences: something else in the model does not
            f"{impl!r} attention keeps packed sequences apart, so something else in the model lets them meet: "
            f"positions it builds itself instead of reading position_ids (e.g. multimodal 3-D rotary "
            f"positions), or a custom layer mixing tokens. Another attention backend would not help: "
            f"{unpacked}."
        )
    return (
        f"Use attn_implementation='sdpa' (or 'flash_attention_2' on GPU) instead of {impl!r}, or {unpacked}."
    )
