"""Every touch of ``transformers`` internals on ``prepare_trainer``'s path, checked against :data:`CHECKED`.

Reads:

* ``config._attn_implementation`` (:func:`attn_implementation`): where a model keeps its attention backend;
  ``PretrainedConfig`` has no public getter for it.
* ``transformers.masking_utils.find_packed_sequence_indices`` (:func:`builds_packed_masks`): whether the
  ``sdpa``/``eager``/``flex`` masks separate packed sequences found in ``position_ids``.
* ``transformers.integrations.sdpa_attention`` (:func:`sdpa_functions`): the ``sdpa`` forward and ``repeat_kv``.
* ``Trainer._remove_unused_columns`` / ``Trainer._get_collator_with_removed_columns`` (:func:`training_rows`,
  :func:`training_collator`): the trainer's own column removal, called as training calls it.
* ``Trainer._train_batch_size`` (:func:`found_train_batch_size`): the batch size ``auto_find_batch_size`` retries
  with after an out-of-memory error (no public getter).

Changes, each recorded on its ``owner`` (a trainer) so that :func:`~packtools.compat.unprepare`
undoes them:

* ``Trainer._signature_columns`` (:func:`keep_signature_columns`): packtools' columns added to those
  ``remove_unused_columns`` keeps (filled first by ``Trainer._set_signature_columns_if_needed``).
* the attention registries (:func:`register_attention`): ``AttentionInterface.register`` and
  ``ALL_MASK_ATTENTION_FUNCTIONS.register`` (public); taking an entry out again needs their class-wide
  ``_global_mapping`` (no public ``unregister``), done only when the last owner that needed it is undone.
* a model's backend (:func:`set_attention`, through the public ``set_attn_implementation``).
* a token-mixing layer's ``forward`` (:func:`replace_mixer_forward`): an instance attribute over the method, as
  accelerate's hooks do (``packtools.integrations.attention.mixers`` runs the layer per document).

Also read, for :mod:`packtools.testing`'s real vocabularies: ``transformers.convert_slow_tokenizer.TikTokenConverter``
(:func:`tiktoken_tokenizer`), whose ranks loader is overridden on a subclass so that the ranks come from a local
file, and whose keyword for the special tokens is ``extra_special_tokens`` in transformers 5.

Also relied on, on ``packtools.integrations.attention.mixers``' path: that a decoder hands its keyword arguments to its
layers and their token-mixing layers (and these to their chunked PyTorch scans: :func:`document_scan`), and
``masking_utils.create_causal_mask`` / ``create_sliding_window_causal_mask`` (:func:`packed_position_masks`).

An object without the shape checked here raises :func:`~packtools.compat.unknown_shape` instead
of being patched blindly.  This module imports no packtools layer above ``errors`` (it sits below them).

>>> import transformers, types
>>> from packtools.compat import undo
>>> attn_implementation(transformers.LlamaConfig(attn_implementation="eager"))
'eager'
>>> owner, registry = types.SimpleNamespace(), transformers.AttentionInterface()
>>> register_attention("packtools_doc", lambda *args, **kwargs: None, owner=owner)
'packtools_doc'
>>> "packtools_doc" in registry, undo(owner), "packtools_doc" in registry
(True, ["AttentionInterface['packtools_doc']"], False)
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .._optional import is_instance, require
from . import record, set_attr, unknown_shape, warn_unchecked

#: The ``transformers`` versions whose shapes this module was checked against (lowest and newest CI runs).
CHECKED = "5.15.0 - 5.25.0"
warn_unchecked("transformers", CHECKED)  # once per process, when the installed transformers is outside it
#: Registry entries packtools added, with how many owners still need them.
_HELD: dict[str, int] = {}


def attn_implementation(config: Any) -> str | None:
    """``config._attn_implementation`` (of the text config for composite configs); ``None`` without a config."""
    if config is None:
        return None
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    if is_instance(config, "transformers", "PretrainedConfig") and not hasattr(
        type(config), "_attn_implementation"
    ):
        raise unknown_shape("transformers", CHECKED, f"{type(config).__name__} has no _attn_implementation")
    return getattr(config, "_attn_implementation", None)


def builds_packed_masks() -> bool:
    """Whether transformers' ``sdpa``/``eager``/``flex`` masks separate packed sequences in ``position_ids``."""
    try:
        from transformers import masking_utils
    except ImportError:
        return False
    return hasattr(masking_utils, "find_packed_sequence_indices")


def sdpa_functions() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``(sdpa_attention_forward, repeat_kv)`` of ``transformers.integrations.sdpa_attention``."""
    require("transformers", "packtools segmented sdpa")
    try:
        from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
    except ImportError as err:
        raise unknown_shape(
            "transformers", CHECKED, f"transformers.integrations.sdpa_attention lacks a function ({err})"
        ) from err
    return sdpa_attention_forward, repeat_kv


def _registries() -> tuple[Any, Any, Any]:
    require("transformers", "packtools attention registration")
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    for registry in (AttentionInterface, type(ALL_MASK_ATTENTION_FUNCTIONS)):
        if not isinstance(getattr(registry, "_global_mapping", None), dict) or not hasattr(
            registry, "register"
        ):
            raise unknown_shape(
                "transformers", CHECKED, f"{registry.__name__} has no register / class-wide _global_mapping"
            )
    return AttentionInterface, ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask


def sdpa_mask_function() -> Callable[..., Any]:
    """transformers' ``masking_utils.sdpa_mask`` (the 4-D boolean mask builder of the ``sdpa`` backend)."""
    return _registries()[2]


def register_attention(
    name: str,
    forward: Callable[..., Any],
    *,
    owner: Any = None,
    mask: Callable[..., Any] | None = None,
) -> str:
    """Register ``forward`` as attention ``name`` with ``mask`` (default ``sdpa``'s mask function); returns ``name``.

    With an ``owner``, the entries packtools added are taken out again when the last owner needing them is
    undone; an entry registered without one (or by someone else) stays.
    """
    interface, masks, sdpa_mask = _registries()
    added = name not in interface()
    if added:
        interface.register(name, forward)
    wanted = sdpa_mask if mask is None else mask
    if masks.get(name) is not wanted:  # packtools' own name: its mask function is packtools' choice
        type(masks).register(name, wanted)
    if owner is not None and (added or name in _HELD):
        _HELD[name] = _HELD.get(name, 0) + 1
        record(owner, f"AttentionInterface[{name!r}]", lambda: _release(name))
    return name


def _release(name: str) -> None:
    _HELD[name] -= 1
    if _HELD[name] > 0:
        return
    del _HELD[name]
    interface, masks, _ = _registries()
    interface._global_mapping.pop(name, None)
    type(masks)._global_mapping.pop(name, None)


def set_attention(model: Any, name: str, *, owner: Any = None) -> None:
    """``model.set_attn_implementation(name)``; with an ``owner``, undone by switching back to the old backend."""
    switch = getattr(model, "set_attn_implementation", None)
    if not callable(switch):
        raise unknown_shape("transformers", CHECKED, f"{type(model).__name__} has no set_attn_implementation")
    before = attn_implementation(getattr(model, "config", None))
    switch(name)
    if owner is not None and before is not None and before != name:
        record(owner, f"{type(model).__name__}.attn_implementation", lambda: switch(before))


def _trainer_method(trainer: Any, name: str, params: Sequence[str]) -> Callable[..., Any]:
    method = getattr(trainer, name, None)
    found = list(inspect.signature(method).parameters) if callable(method) else None
    if found is None or any(p not in found for p in params):
        raise unknown_shape(
            "transformers",
            CHECKED,
            f"{type(trainer).__name__} has no {name}({', '.join(params)}) (found {found})",
            "Build it on transformers.Trainer of a version packtools was checked against (see CHECKED), or pass "
            "check_isolation=False (the collator check needs the trainer's column removal).",
        )
    return method


def keep_signature_columns(trainer: Any, columns: Sequence[str], *, owner: Any = None) -> None:
    """Add ``columns`` to the columns ``remove_unused_columns`` keeps (``Trainer._signature_columns``); recorded
    on ``owner`` (default: the trainer)."""
    if "_signature_columns" not in vars(trainer):
        raise unknown_shape(
            "transformers",
            CHECKED,
            f"{type(trainer).__name__} has no _signature_columns (the columns remove_unused_columns keeps)",
            "Pass TrainingArguments(remove_unused_columns=False), or install a transformers version packtools "
            "was checked against (see CHECKED).",
        )
    fill = _trainer_method(trainer, "_set_signature_columns_if_needed", ())
    before = trainer._signature_columns
    fill()
    kept = trainer._signature_columns
    if not isinstance(kept, list):
        raise unknown_shape(
            "transformers", CHECKED, f"_signature_columns is {type(kept).__name__}, not a list"
        )
    trainer._signature_columns = kept + [c for c in columns if c not in kept]
    record(
        trainer if owner is None else owner,
        f"{type(trainer).__name__}._signature_columns",
        lambda: setattr(trainer, "_signature_columns", before),
    )


def found_train_batch_size(trainer: Any) -> int | None:
    """The per-process batch size ``Trainer``'s training loop runs with (``_train_batch_size``: lowered by
    ``auto_find_batch_size`` after an out-of-memory error), or ``None`` where the trainer has none."""
    found = vars(trainer).get("_train_batch_size")
    if found is not None and not isinstance(found, int):
        raise unknown_shape("transformers", CHECKED, f"Trainer._train_batch_size is {type(found).__name__}")
    return found


def training_rows(trainer: Any, dataset: Any) -> Any:
    """``dataset`` with the columns the trainer's training loader removes removed (a ``datasets.Dataset``)."""
    method = _trainer_method(trainer, "_remove_unused_columns", ("dataset", "description"))
    return method(dataset, description="training")


def training_collator(trainer: Any, collator: Any) -> Any:
    """``collator`` wrapped in the trainer's column removal, as its training loader wraps it (other datasets)."""
    method = _trainer_method(trainer, "_get_collator_with_removed_columns", ("data_collator", "description"))
    return method(collator, description="training")


def replace_mixer_forward(module: Any, forward: Callable[..., Any], *, owner: Any) -> Callable[..., Any]:
    """Give a transformers token-mixing layer (a Mamba / DeltaNet / short-convolution module) ``forward`` as an
    instance attribute over its method, recorded on ``owner``; returns the forward it had.

    torch has no public way to run a module's computation differently (a hook sees the inputs and the output, it
    cannot skip the call), and these layers' classes are built for it: transformers decorates their ``forward``
    with ``force_accelerate_hooks``, because accelerate's device hooks replace ``forward`` the same way.  Whatever
    ``forward`` the module has when prepared (accelerate's included) is kept and called.
    """
    if not callable(getattr(module, "forward", None)) or not hasattr(module, "__dict__"):
        raise unknown_shape("transformers", CHECKED, f"{type(module).__name__} has no forward")
    original = module.forward
    set_attr(module, "forward", forward, owner=owner)
    return original


def packed_position_masks(model: Any, inputs_embeds: Any, position_ids: Any) -> dict[str, Any]:
    """The per-layer-type masks of one forward, built from ``position_ids`` by transformers' public mask
    functions (``masking_utils.create_causal_mask`` / ``create_sliding_window_causal_mask``): for models whose
    own forward builds them without ``position_ids`` (GPT-OSS), so packed sequences would see each other."""
    masking = require("transformers", "packtools packed masks").masking_utils
    config = model.config
    # the cache keyword is ``cache`` in 5.25 and ``past_key_values`` in 5.15 (both within CHECKED)
    cache = (
        "cache" if "cache" in inspect.signature(masking.create_causal_mask).parameters else "past_key_values"
    )
    arguments = dict(
        config=config, inputs_embeds=inputs_embeds, attention_mask=None, position_ids=position_ids
    )
    arguments[cache] = None
    names = set(getattr(config, "layer_types", None) or ["full_attention"])
    unknown = names - {"full_attention", "sliding_attention"}
    if unknown:
        raise unknown_shape(
            "transformers", CHECKED, f"{type(model).__name__} has layer types {sorted(unknown)}"
        )
    masks = {"full_attention": masking.create_causal_mask(**arguments)}
    if "sliding_attention" in names:
        masks["sliding_attention"] = masking.create_sliding_window_causal_mask(**arguments)
    return masks


#: Token-mixing layer classes (by a part of the name) whose ``forward`` hands its keyword arguments to the chunked
#: PyTorch scan (``torch_chunk_gated_delta_rule(chunk_size=64, **kwargs)``: Qwen3-Next, Qwen3.5, Qwen3.5-MoE;
#: ``chunk_kimi_delta_attention(chunk_size=64, **kwargs)``: Kimi Linear).  Mamba-2 layers (Nemotron-H, Bamba,
#: Falcon-H1) read theirs from the layer's ``chunk_size`` attribute instead.
CHUNKED_SCANS = ("GatedDeltaNet", "DeltaAttention")


def document_chunk(length: int, chunk: int = 64) -> int:
    """The fewest chunks of at most ``chunk`` tokens that cover a document, of equal size: the chunk size.

    The chunked scans pad every call to a multiple of their chunk, so a document of a few tokens run alone would
    hold a whole chunk (64, or Nemotron-H's 128); the chunked form is exact for any chunk size, so this one gives the
    same result with padding below one token per chunk.

    >>> document_chunk(27), document_chunk(100), document_chunk(300, 128)
    (27, 50, 100)
    """
    chunks = -(-length // chunk)
    return max(1, -(-length // max(chunks, 1)))


@contextlib.contextmanager
def document_scan(module: Any, length: int) -> Iterator[dict[str, int]]:
    """Run one document of ``length`` tokens through a token-mixing layer's chunked PyTorch scan at its own size
    (:func:`document_chunk`): yields the keyword arguments to add to the call (``chunk_size`` for a
    :data:`CHUNKED_SCANS` layer), or sets a Mamba-2 layer's ``chunk_size`` attribute for the call and puts it back.
    Other layers: nothing."""
    if any(part in type(module).__name__ for part in CHUNKED_SCANS):
        yield {"chunk_size": document_chunk(length)}
        return
    old = vars(module).get("chunk_size") if hasattr(module, "__dict__") else None
    if type(old) is not int or old < 1:
        yield {}
        return
    module.chunk_size = document_chunk(length, old)
    try:
        yield {}
    finally:
        module.chunk_size = old


def tiktoken_tokenizer(ranks: dict[bytes, int], specials: Sequence[str], pattern: str) -> Any:
    """A ``tokenizers.Tokenizer`` of the tiktoken-style BPE ``ranks`` (token bytes -> rank) with the regex split
    ``pattern`` and the special tokens ``specials`` (ids after the ranks, in order), byte-level, as transformers'
    ``TikTokenConverter`` converts them; the ranks are handed over in memory, never downloaded."""
    convert = require("transformers.convert_slow_tokenizer", "packtools.testing.real_tokenizer")
    base = getattr(convert, "TikTokenConverter", None)
    params = inspect.signature(base).parameters if base is not None else {}
    if "extra_special_tokens" not in params or not hasattr(base, "load_tiktoken_bpe"):
        raise unknown_shape(
            "transformers",
            CHECKED,
            "convert_slow_tokenizer.TikTokenConverter(extra_special_tokens=...) with load_tiktoken_bpe is missing",
        )

    class LocalRanks(base):  # type: ignore[misc, valid-type]
        @staticmethod
        def load_tiktoken_bpe(_url: str) -> dict[bytes, int]:
            return ranks

    return LocalRanks(vocab_file="local", pattern=pattern, extra_special_tokens=list(specials)).converted()
