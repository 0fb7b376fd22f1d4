"""Thin adapter: packed padding-free batches in ``transformers.Trainer`` and TRL's ``SFTTrainer``.

``PaddingFreeCollator`` builds correct batches; what can still go wrong sits in the trainer and the model,
and this module closes exactly those gaps, nothing more:

* **Columns.** ``Trainer`` drops dataset columns that the model's ``forward`` does not name
  (``remove_unused_columns=True``), which silently removes ``seq_lengths`` (every packed row then looks like
  one long sequence) and ``completion_mask`` / ``assistant_masks``.  :func:`prepare_trainer` adds them to
  the trainer's kept columns, so ``remove_unused_columns`` can stay on.
* **Attention isolation.** FlashAttention-family kernels use ``cu_seq_lens_*`` (or derive segments from
  ``position_ids``); ``sdpa``, ``eager`` and ``flex_attention`` build a block-diagonal mask from
  ``position_ids`` -- but only when no ``attention_mask`` and no KV cache are passed.  A forward pre-hook
  (:func:`guard_model`) passes ``use_cache=False`` in training and whenever the caller did not choose, and raises
  :class:`~packtools.errors.PackingError` on the inputs that make transformers attend across sequences:
  a 2-D ``attention_mask`` next to packed ``position_ids``; ``cu_seq_lens_*`` without ``position_ids`` on a
  non-flash backend (which ignores them); several packed rows without ``cu_seq_lens_*`` on a flash backend
  (transformers infers segments from ``position_ids`` only for one row).  Backends that cannot isolate
  packed sequences (paged attention, custom kernels) are refused up front.
* **Attention cost.** Under a block-diagonal mask a padding-free row of ``N`` tokens costs ``N²`` per
  attention layer.  :func:`prepare_trainer` switches ``sdpa`` models to packtools' per-sequence ``sdpa``
  (:mod:`packtools.integrations.segmented`, :func:`use_segmented_sdpa`), which costs ``sum(L_i²)`` like
  FlashAttention varlen and gives the same result; ``segmented_sdpa=False`` keeps transformers' ``sdpa``.
* **Loss denominator.** ``Trainer`` prefetches the ``gradient_accumulation_steps`` batches of an optimizer
  step, counts ``labels[..., 1:] != -100`` over all of them (``num_items_in_batch``) and passes that count
  to the model, whose causal-LM loss is then ``sum of token losses / count`` -- the token-weighted mean over
  the whole accumulation window, with no further division by the number of steps.  Because the collator
  sets -100 at every sequence start (position 0 included) and on padding, that count is exactly the number
  of predicted tokens, whether or not the count skips column 0.  This only happens when the model accepts
  loss kwargs (every ``*ForCausalLM`` does); for a model that does not, :func:`prepare_trainer` installs
  :func:`causal_lm_loss` as ``compute_loss_func``, which uses the same count.  With several processes
  ``average_tokens_across_devices=True`` (the default) makes the count global.

TRL's ``SFTTrainer`` needs three settings for an already-packed dataset; :func:`packed_sft_config` sets them.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from .._optional import require
from ..constants import IGNORE_INDEX, PACKED_COLUMNS
from ..errors import PackingError
from .segmented import SEGMENTED_SDPA, register

#: Dataset columns the collator reads that a model's ``forward`` does not name.
#: Backends that build a block-diagonal mask from ``position_ids`` (with no ``attention_mask``, no cache).
MASK_BACKENDS = ("sdpa", "eager", "flex_attention", SEGMENTED_SDPA)
VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
_HOOK_ATTR = "_packtools_guard"


def _base_model(model: Any) -> Any:
    """The transformers model under PEFT / DDP wrappers."""
    for _ in range(4):
        if hasattr(model, "get_base_model"):
            model = model.get_base_model()
        elif hasattr(model, "module") and not hasattr(model, "config"):
            model = model.module
        else:
            break
    return model


def attention_implementation(model: Any) -> str | None:
    """``config._attn_implementation`` of a model (of its text model for composite configs)."""
    config = getattr(_base_model(model), "config", None)
    if config is None:
        return None
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    return getattr(config, "_attn_implementation", None)


def is_flash(implementation: str | None) -> bool:
    """FlashAttention-family backends (``flash_attention_2/3/4``, ``kernels-community/*flash*``), as transformers tells them."""
    return (
        implementation is not None and "flash" in implementation and not implementation.startswith("paged|")
    )


def _masks_from_positions() -> bool:
    """Whether transformers' sdpa/eager/flex masks separate packed sequences found in ``position_ids``."""
    try:
        from transformers import masking_utils
    except ImportError:
        return False
    return hasattr(masking_utils, "find_packed_sequence_indices")


def check_attention_implementation(model: Any) -> str:
    """Return the model's attention backend, or raise :class:`PackingError` if it cannot isolate packed sequences.

    >>> class Cfg:
    ...     _attn_implementation = "sdpa"
    >>> class M:
    ...     config = Cfg()
    ...     def forward(self, input_ids=None, position_ids=None, **kwargs): ...
    >>> check_attention_implementation(M())
    'sdpa'
    >>> Cfg._attn_implementation = "paged|eager"
    >>> check_attention_implementation(M())  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    packtools.errors.PackingError: attention implementation 'paged|eager' cannot keep packed sequences apart...
    """
    impl = attention_implementation(model)
    if impl is None:
        raise PackingError(
            f"{type(model).__name__} has no config._attn_implementation, so packtools cannot tell whether its "
            f"attention keeps packed sequences apart. Use a transformers model loaded with "
            f"attn_implementation='flash_attention_2', 'sdpa', 'eager' or 'flex_attention'."
        )
    if not is_flash(impl) and impl not in MASK_BACKENDS:
        raise PackingError(
            f"attention implementation {impl!r} cannot keep packed sequences apart: only FlashAttention-family "
            f"kernels (which read cu_seq_lens) and {', '.join(MASK_BACKENDS)} (which build a block-diagonal mask "
            f"from position_ids) do. Load the model with attn_implementation='flash_attention_2' (GPU) or 'sdpa', "
            f"or call model.set_attn_implementation('sdpa')."
        )
    if not is_flash(impl) and not _masks_from_positions():
        raise PackingError(
            f"this transformers version does not build a block-diagonal mask from position_ids, so {impl!r} "
            f"attention would let packed sequences see each other. Upgrade transformers (>= 4.54), or use "
            f"attn_implementation='flash_attention_2'."
        )
    if not is_flash(impl):
        forward = _base_model(model).forward
        if "position_ids" not in inspect.signature(forward).parameters:
            raise PackingError(
                f"{type(_base_model(model)).__name__}.forward takes no position_ids, so with {impl!r} attention it "
                f"cannot separate packed sequences. Use attn_implementation='flash_attention_2', or do not pack."
            )
    return impl


def use_segmented_sdpa(model: Any) -> bool:
    """Switch a text model from ``sdpa`` to packtools' per-sequence ``sdpa``; returns whether it switched.

    Padding-free rows then cost ``sum(L_i²)`` per attention layer instead of ``(sum L_i)²``, with the same
    result (see :mod:`packtools.integrations.segmented`).  Other backends, composite (multimodal) configs and
    models without ``set_attn_implementation`` are left as they are.  ``model.set_attn_implementation("sdpa")``
    switches back; the name is not saved with the config.
    """
    base = _base_model(model)
    config = getattr(base, "config", None)
    if attention_implementation(model) != "sdpa" or not hasattr(base, "set_attn_implementation"):
        return False
    if getattr(config, "sub_configs", None):
        return False
    base.set_attn_implementation(register())
    return attention_implementation(model) == SEGMENTED_SDPA  # some models keep their own (e.g. Falcon)


def switch_back(models: Sequence[Any]) -> None:
    """Undo :func:`use_segmented_sdpa` on ``models``."""
    for model in models:
        _base_model(model).set_attn_implementation("sdpa")


@contextlib.contextmanager
def segmented_sdpa_until_checked(models: Sequence[Any], enabled: bool = True) -> Iterator[list[Any]]:
    """Switch the ``sdpa`` models among ``models`` (:func:`use_segmented_sdpa`) and yield those switched; if
    the block raises (a refused trainer), switch them back, so the caller's models are left as they came."""
    switched = [m for m in models if m is not None and enabled and use_segmented_sdpa(m)]
    try:
        yield switched
    except BaseException:
        switch_back(switched)
        raise


_MIXER_NAMES = ("Mamba", "DeltaNet", "LinearAttention", "ShortConv", "SSM", "RWKV", "Recurrent")


def token_mixing_layers(model: Any) -> list[str]:
    """Names of the layers that mix tokens outside attention (convolutions, state-space or linear-attention scans).

    Such layers ignore ``position_ids``: they keep packed sequences apart only when given ``seq_idx`` or
    ``cu_seq_lens`` *and* a kernel that reads them (mamba-ssm, causal-conv1d, flash-linear-attention).
    Found by module type: a ``torch.nn.Conv1d`` with a kernel wider than 1 (reported as its parent
    layer) or a class named like a Mamba / DeltaNet / linear-attention / RWKV block.
    """
    found: list[str] = []
    for name, module in _base_model(model).named_modules():
        cls = type(module).__name__
        parent = name.rsplit(".", 1)[0] if "." in name else name
        if any(name == f or name.startswith(f + ".") or parent == f for f in found):
            continue
        kernel = getattr(module, "kernel_size", None)
        if cls == "Conv1d" and isinstance(kernel, tuple) and kernel[0] > 1:
            found.append(parent)
        elif any(part in cls for part in _MIXER_NAMES) and not cls.endswith(("Model", "ForCausalLM")):
            found.append(name)
    return found


def forward_accepts(model: Any, key: str) -> bool:
    """Whether the ``forward`` of the (unwrapped) model takes ``key`` (by name or through ``**kwargs``)."""
    params = inspect.signature(_base_model(model).forward).parameters
    return key in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def adapt_collator(collator: Any, model: Any) -> Any:
    """``collator`` with the keys the model's ``forward`` does not take switched off.

    Applies to a :class:`~packtools.PaddingFreeCollator` (or the one inside an ``ArrowCollator``);
    any other collator is returned as is.  ``position_ids`` is never switched off here: without it
    non-flash backends cannot separate sequences, which :func:`check_attention_implementation` refuses.
    """
    from ..batches.collate import SWITCHED_KEYS, PaddingFreeCollator

    inner = getattr(collator, "collator", collator)
    if not isinstance(inner, PaddingFreeCollator):
        return collator
    changes = {
        switch: False
        for switch, keys in SWITCHED_KEYS.items()
        if switch != "return_position_ids"
        and getattr(inner, switch)
        and not all(forward_accepts(model, key) for key in keys)
    }
    if not changes:
        return collator
    adapted = inner.replace(**changes)
    if inner is collator:
        return adapted
    wrapper = copy.copy(collator)
    wrapper.collator = adapted
    return wrapper


def has_restarts(position_ids: Any, attention_mask: Any = None) -> bool:
    """True when some row of ``position_ids`` steps by anything but +1 between two attended tokens.

    That is how transformers recognizes packed sequences; with ``attention_mask`` only steps between two
    unmasked tokens count, so left or right padding is not mistaken for packing.  Works on NumPy and torch.

    >>> import numpy as np
    >>> has_restarts(np.array([[0, 1, 2, 0, 1]])), has_restarts(np.array([[0, 1, 2, 3, 4]]))
    (True, False)
    >>> has_restarts(np.array([[1, 1, 0, 1, 2]]), attention_mask=np.array([[0, 0, 1, 1, 1]]))
    False
    """
    broken = (position_ids[..., 1:] - position_ids[..., :-1]) != 1
    if attention_mask is not None:
        broken = broken & (attention_mask[..., 1:] != 0) & (attention_mask[..., :-1] != 0)
    return bool(broken.any())


def check_forward_inputs(
    kwargs: Mapping[str, Any], implementation: str | None, mixers: tuple[str, ...] = ()
) -> None:
    """Raise :class:`PackingError` on keyword inputs that make transformers attend across packed sequences.

    Inputs of generation (a cache passed in) are not checked.  Only the suspicious combinations read
    tensor values (one host sync); correct padding-free batches are checked from their keys alone.

    >>> import numpy as np
    >>> check_forward_inputs({"position_ids": np.array([[0, 1, 0]])}, "sdpa")
    >>> check_forward_inputs(
    ...     {"position_ids": np.array([[0, 1, 0]]), "attention_mask": np.array([[1, 1, 1]])}, "sdpa"
    ... )  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    packtools.errors.PackingError: the batch has packed position_ids (they restart inside a row) and an attention_mask...
    """
    if kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None:
        return
    pos = kwargs.get("position_ids")
    mask = kwargs.get("attention_mask")
    if pos is not None and getattr(pos, "ndim", 0) != 2:
        return  # multimodal rotary positions (e.g. [3, B, T]): not ours to judge
    if pos is not None and mask is not None and getattr(mask, "ndim", 0) == 2 and has_restarts(pos, mask):
        raise PackingError(
            "the batch has packed position_ids (they restart inside a row) and an attention_mask: transformers "
            "then ignores position_ids and every token attends across the sequence boundaries of its row. Drop "
            "'attention_mask' from packed batches (packtools.PaddingFreeCollator never returns it with packed "
            "rows); check that the collator is not wrapped in one that adds it."
        )
    if (
        mixers
        and kwargs.get("seq_idx") is None
        and kwargs.get("cu_seq_lens_q") is None
        and (any(kwargs.get(k) is not None for k in VARLEN_KEYS) or (pos is not None and has_restarts(pos)))
    ):
        raise PackingError(
            f"the batch is packed but has neither seq_idx nor cu_seq_lens, and the model's layers "
            f"{list(mixers)[:3]} mix tokens outside attention: they ignore position_ids and would run every "
            f"packed row as one sequence. Keep seq_idx and cu_seq_lens in the batch "
            f"(PaddingFreeCollator(return_seq_idx=True, return_flash_attn_kwargs=True)), or do not pack."
        )
    flash = is_flash(implementation)
    if pos is None and not flash and any(kwargs.get(k) is not None for k in VARLEN_KEYS):
        raise PackingError(
            f"the batch has cu_seq_lens/max_length but no position_ids: the {implementation!r} attention ignores "
            f"cu_seq_lens and needs position_ids to separate packed sequences. Keep 'position_ids' in the batch."
        )
    if (
        flash
        and pos is not None
        and mask is None
        and pos.shape[0] > 1
        and any(kwargs.get(k) is None for k in VARLEN_KEYS)
        and has_restarts(pos)
    ):
        raise PackingError(
            f"the batch holds {pos.shape[0]} packed rows without cu_seq_lens: with {implementation!r} transformers "
            f"infers sequences from position_ids only for a single row, so these rows would attend across "
            f"sequences. Use PaddingFreeCollator(padding_free=True) (one flat row with cu_seq_lens)."
        )


def guard_model(model: Any) -> Any:
    """Register (once) a forward pre-hook on ``model`` that checks packed inputs and disables the KV cache.

    The hook raises :class:`PackingError` through :func:`check_forward_inputs`, and passes
    ``use_cache=False`` when the caller did not choose (or when training): transformers' ``sdpa``/``eager``
    backends detect packed sequences only without a cache, and ``LlamaConfig`` and friends default to
    ``use_cache=True``.  Register it on the outermost module that the trainer calls (a PEFT model forwards
    to its base with ``.forward``, which skips hooks on the base).  Returns the hook handle.
    """
    # vars(), not getattr(): PEFT models forward unknown attributes to the base model, whose hook they skip.
    handle = vars(model).get(_HOOK_ATTR)
    if handle is not None:
        return handle

    mixers = tuple(token_mixing_layers(model))

    def hook(
        module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        impl = attention_implementation(module)
        check_forward_inputs(kwargs, impl, mixers)
        generating = kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None
        if not generating and (kwargs.get("use_cache") is None or module.training):
            kwargs["use_cache"] = False
        return args, kwargs

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    object.__setattr__(model, _HOOK_ATTR, handle)
    return handle


def causal_lm_loss(outputs: Any, labels: Any, num_items_in_batch: Any = None) -> Any:
    """Sum of next-token cross-entropies divided by ``num_items_in_batch`` (a ``Trainer.compute_loss_func``).

    Without ``num_items_in_batch`` it divides by the predicted tokens of this batch.  Labels are shifted
    here (position ``i`` predicts ``labels[i + 1]``), like transformers' ``ForCausalLMLoss``.
    """
    torch = require("torch", "packtools.integrations.transformers.causal_lm_loss")
    logits = outputs["logits"] if isinstance(outputs, Mapping) else outputs[0]
    target = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].to(logits.device)
    total = torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]),
        target.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    count = (target != IGNORE_INDEX).sum() if num_items_in_batch is None else num_items_in_batch
    return total / torch.as_tensor(count, device=total.device).clamp(min=1)


def _keep_columns(trainer: Any) -> None:
    if not trainer.args.remove_unused_columns:
        return
    if hasattr(trainer, "_set_signature_columns_if_needed"):
        trainer._set_signature_columns_if_needed()
    columns = getattr(trainer, "_signature_columns", None)
    if columns is None:  # an unknown Trainer version: keep every column rather than drop ours
        trainer.args.remove_unused_columns = False
        return
    trainer._signature_columns = list(columns) + [c for c in PACKED_COLUMNS if c not in columns]


def _check_sft(trainer: Any) -> None:
    if not getattr(trainer, "_skip_prepare_dataset", True):
        raise PackingError(
            "SFTTrainer prepared the packed dataset again: it rebuilds labels (dropping completion_mask) and "
            "truncates input_ids to max_length without updating seq_lengths. Build the trainer with "
            "args=packtools.integrations.transformers.packed_sft_config(...), or SFTConfig(dataset_kwargs={'skip_prepare_dataset': True})."
        )


def _probe_collator(collator: Any) -> Any:
    """The trainer's PaddingFreeCollator (returning tensors), or None for the probe's default."""
    from ..batches.collate import PaddingFreeCollator

    inner = getattr(collator, "collator", collator)
    if not isinstance(inner, PaddingFreeCollator):
        return None
    return inner if inner.return_tensors == "pt" else inner.replace(return_tensors="pt")


def run_probe(
    trainer: Any, *extra_models: Any, switched: Sequence[Any] = (), collator: Any = None, packed: bool = True
) -> None:
    """Run :func:`packtools.integrations.check_isolation` on the trainer's model (and ``extra_models``) unless sharded.

    ``switched`` are the models :func:`use_segmented_sdpa` switched: if the probe fails, they go back to
    ``sdpa`` and are probed again, so the error names either the model's own leak or packtools' backend.
    """
    if getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "is_fsdp_enabled", False):
        warnings.warn(
            "prepare_trainer: the isolation probe was skipped because the model is sharded (DeepSpeed/FSDP) "
            "and cannot be run before train(); run packtools.integrations.check_isolation on an unsharded copy of the "
            "model (same class, config and attn_implementation) to check it.",
            stacklevel=3,
        )
        return
    from .isolation import check_isolation

    if collator is None:
        collator = _probe_collator(trainer.data_collator)

    def probe() -> None:
        for model in (trainer.model, *extra_models):
            if model is not None:
                check_isolation(model, collator, packed=packed)

    try:
        probe()
    except PackingError:
        if not switched:
            raise
        switch_back(switched)
        probe()  # leaks with plain sdpa too: this error names the cause
        raise PackingError(
            f"packtools' per-sequence sdpa ({SEGMENTED_SDPA!r}) let packed sequences of "
            f"{type(_base_model(switched[0])).__name__} leak while its own 'sdpa' keeps them apart; the models "
            f"were switched back to 'sdpa'. Pass segmented_sdpa=False, and please report the model."
        ) from None


def prepare_trainer(
    trainer: Any, *, max_tokens: int | None = None, check_isolation: bool = True, segmented_sdpa: bool = True
) -> Any:
    """Make a ``transformers.Trainer`` (or TRL ``SFTTrainer``) train correctly on packed padding-free batches.

    Call it once, after building the trainer and before ``train()``::

        trainer = prepare_trainer(Trainer(model, args, train_dataset=packed,
                                          data_collator=PaddingFreeCollator(pad_token_id)))
        trainer.train()

    It checks the attention backend (:func:`check_attention_implementation`), keeps ``seq_lengths`` and the
    loss-mask columns through ``remove_unused_columns``, guards the model's forward (:func:`guard_model`:
    ``use_cache=False``, contamination errors), makes sure the loss is divided by the predicted tokens of the
    whole accumulation window (see the module docstring), and for ``SFTTrainer`` that the dataset was not
    prepared again.  A ``PaddingFreeCollator`` as ``data_collator`` is adapted to the model's ``forward``
    (keys it does not take are switched off, :func:`adapt_collator`).

    With ``check_isolation=True`` (the default) it first checks the trainer's own ``data_collator`` on a real
    batch of its train dataset and refuses one that merges packed sequences, with the fix
    (:mod:`packtools.integrations.collator_check`), then runs :func:`packtools.integrations.check_isolation` once through
    that collator: a few short sequences through the model, packed as the collator packs them and alone, under
    ``no_grad`` (well under a second for small models; a few forward passes of ~24 tokens for large ones),
    and raises :class:`~packtools.errors.PackingError` if packed sequences leak into each other.
    ``check_isolation=False`` skips both.

    With ``segmented_sdpa=True`` (the default) an ``sdpa`` model is switched to packtools' per-sequence
    ``sdpa`` (:func:`use_segmented_sdpa`): a padding-free row's attention then costs ``sum(L_i²)`` like
    FlashAttention varlen instead of ``(sum L_i)²`` under the block-diagonal mask, with the same result
    (the probe runs on it).  ``max_tokens=N`` batches by a token budget per process; with several processes
    every process runs the same number of micro-batches and no row is repeated
    (:mod:`packtools.integrations.budget_loader`).  Returns the trainer.
    """
    require("transformers", "packtools.integrations.transformers.prepare_trainer")
    check_attention_implementation(trainer.model)
    _keep_columns(trainer)
    if hasattr(trainer, "_skip_prepare_dataset"):
        _check_sft(trainer)
    if (
        not getattr(trainer, "model_accepts_loss_kwargs", True)
        and trainer.compute_loss_func is None
        and trainer.label_smoother is None
        and not hasattr(trainer, "_skip_prepare_dataset")
    ):
        trainer.compute_loss_func = causal_lm_loss
    if trainer.args.world_size > 1 and not getattr(trainer.args, "average_tokens_across_devices", True):
        warnings.warn(
            "average_tokens_across_devices=False: each process divides its loss by its own token count, so "
            "processes with fewer tokens weigh more. Set it to True for a token-weighted loss across processes.",
            stacklevel=2,
        )
    trainer.data_collator = adapt_collator(trainer.data_collator, trainer.model)
    if check_isolation:  # the trainer's own collator on a real batch, then the probe through it
        from .collator_check import check_trainer_collator

        probe_collator, packed = check_trainer_collator(trainer)
    from .budget_loader import install_train_loader

    install_train_loader(trainer, max_tokens)
    guard_model(trainer.model)
    with segmented_sdpa_until_checked([trainer.model], segmented_sdpa) as switched:
        if check_isolation:
            run_probe(trainer, switched=switched, collator=probe_collator, packed=packed)
    return trainer


def packed_sft_config(**kwargs: Any) -> Any:
    """A TRL ``SFTConfig`` for a dataset that is already packed and a ``PaddingFreeCollator``.

    TRL rejects a custom collator when ``padding_free`` is on (and ``packing=True`` turns it on), and with
    preparation on it rebuilds labels and truncates rows, so this sets ``packing=False``,
    ``padding_free=False`` (the collator does the padding-free batching) and
    ``dataset_kwargs={"skip_prepare_dataset": True}``; other arguments pass through.  Then::

        trainer = prepare_trainer(SFTTrainer(model, args=packed_sft_config(output_dir="out"),
                                             train_dataset=packed, processing_class=tokenizer,
                                             data_collator=PaddingFreeCollator(tokenizer.pad_token_id)))
    """
    trl = require("trl", "packtools.integrations.transformers.packed_sft_config")
    for key in ("packing", "padding_free"):
        if kwargs.get(key):
            raise PackingError(
                f"{key}=True makes SFTTrainer pack or collate again (and reject a custom data_collator); the "
                f"dataset is already packed and PaddingFreeCollator batches it. Leave {key} out."
            )
    dataset_kwargs = dict(kwargs.pop("dataset_kwargs", None) or {})
    if dataset_kwargs.get("skip_prepare_dataset") is False:
        raise PackingError(
            "dataset_kwargs['skip_prepare_dataset']=False would re-tokenize and truncate packed rows."
        )
    dataset_kwargs["skip_prepare_dataset"] = True
    kwargs.update(packing=False, padding_free=False, dataset_kwargs=dataset_kwargs)
    return trl.SFTConfig(**kwargs)
