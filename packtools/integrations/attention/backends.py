"""What a model is, for padding-free batches: its attention backend, its token mixers, the inputs it takes.

* :func:`attention_implementation`, :func:`check_attention_implementation`, :func:`is_flash`: the backend
  (``config._attn_implementation``, read through :mod:`packtools.compat.transformers`) and whether
  it keeps packed sequences apart.
* :func:`use_segmented_sdpa` / :func:`switch_back`: the switch to packtools' per-sequence ``sdpa``
  (:mod:`packtools.integrations.attention.segmented`) and back, recorded on an ``owner`` so ``unprepare`` undoes it.
* :func:`token_mixing_layers`: layers that mix tokens outside attention (found by module type).
* :func:`forward_accepts` (the one "does forward take this key" helper) and :func:`adapt_collator`.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Iterator, Sequence
from typing import Any

from ...batches import mrope
from ...batches.collate import SWITCHED_KEYS, PaddingFreeCollator
from ...batches.vision import DocumentBlockMask
from ...compat.transformers import attn_implementation, builds_packed_masks, set_attention
from ...errors import PackingError
from .segmented import SEGMENTED_SDPA, register

#: Backends that build a block-diagonal mask from ``position_ids`` (with no ``attention_mask``, no cache).
MASK_BACKENDS = ("sdpa", "eager", "flex_attention", SEGMENTED_SDPA)


def base_model(model: Any) -> Any:
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
    return attn_implementation(getattr(base_model(model), "config", None))


def forward_accepts(model: Any, key: str, *, named: bool = False) -> bool:
    """Whether the ``forward`` of the (unwrapped) model takes ``key``: by name, or (unless ``named``) through
    ``**kwargs``.

    >>> class M:
    ...     def forward(self, input_ids, **kwargs): ...
    >>> forward_accepts(M(), "seq_idx"), forward_accepts(M(), "seq_idx", named=True)
    (True, False)
    """
    params = inspect.signature(base_model(model).forward).parameters
    if key in params:
        return True
    return not named and any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def sends_seq_idx(model: Any) -> bool:
    """Whether padding-free batches give ``model`` the ``seq_idx`` keyword: its forward names it, or it has
    token-mixing layers (hybrids, which read it to restart per document) and takes it through ``**kwargs``."""
    return forward_accepts(model, "seq_idx", named=True) or (
        bool(token_mixing_layers(model)) and forward_accepts(model, "seq_idx")
    )


def is_flash(implementation: str | None) -> bool:
    """FlashAttention-family backends (``flash_attention_2/3/4``, ``kernels-community/*flash*``), as transformers tells them."""
    return (
        implementation is not None and "flash" in implementation and not implementation.startswith("paged|")
    )


#: Config attributes that make a model multimodal.
_MEDIA_CONFIGS = ("vision_config", "audio_config", "speech_config", "video_config", "vision_tower_config")


def multimodal_parts(model: Any) -> list[str]:
    """What makes ``model`` multimodal (an image / audio tower in its config, ``pixel_values`` in its
    ``forward``); empty for a text model."""
    config = getattr(base_model(model), "config", None)
    parts = [name for name in _MEDIA_CONFIGS if getattr(config, name, None) is not None]
    if callable(getattr(base_model(model), "forward", None)) and forward_accepts(
        model, "pixel_values", named=True
    ):
        parts.append("pixel_values in its forward")
    return parts


def check_multimodal(model: Any) -> None:
    """Refuse a multimodal model whose type is not in :data:`packtools.batches.mrope.VERIFIED_MODEL_TYPES`, naming
    it and why (a verified one passes here; ``prepare_trainer`` then requires its ``MultimodalCollator``)."""
    parts = multimodal_parts(model)
    base = base_model(model)
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    if not parts or model_type in mrope.VERIFIED_MODEL_TYPES:
        return
    why = mrope.unverified_reason(model_type) or (
        " Such models can build their rotary positions from the image grid and the tokens (e.g. Qwen2-VL's 3-D "
        "mRoPE), not from position_ids that restart per sequence, and PaddingFreeCollator does not carry "
        "pixel_values / image_grid_thw."
    )
    raise PackingError(
        f"{type(base).__name__} (model_type {model_type!r}) is a multimodal model ({', '.join(parts)}), and "
        f"packtools has not verified packed batches for it.{why} Train it unpacked with its processor's "
        f"collator. Verified multimodal model types (packed with packtools.batches.MultimodalCollator): "
        f"{list(mrope.VERIFIED_MODEL_TYPES)}.",
        param="model",
    )


#: Forward inputs that bring images (or what a model makes of them) into a multimodal model's packed row.
IMAGE_INPUTS = (
    "pixel_values",
    "pixel_values_videos",
    "pixel_attention_mask",
    "image_sizes",
    "image_grid_thw",
    "mm_encoder_outputs",
    "token_type_ids",
)


def check_image_inputs(model: Any, kwargs: Any, impl: str | None = None) -> None:
    """Refuse a forward that carries any of :data:`IMAGE_INPUTS` into a multimodal model of an unverified type
    (:func:`check_multimodal`'s error: ``guard_model``'s probe packs text only, which such a model may keep apart
    while its image path does not), or into one of :data:`~packtools.batches.mrope.IMAGE_BLOCK_TYPES` (Gemma 3)
    without its documents' masks ready-made (``attention_mask``, a dict by layer type, as ``MultimodalCollator``
    gives it) on a backend that reads them, or into Idefics3 / SmolVLM without its ``pixel_attention_mask``, or
    LLaVA-NeXT / OneVision without its ``image_sizes``.  Text-only forwards pass, and so does a Gemma 3 forward
    whose only image input is an all-zero ``token_type_ids`` without ready-made masks
    (:func:`_text_only_image_blocks`).

    >>> check_image_inputs(object(), {"pixel_values": 1})
    """
    given = [name for name in IMAGE_INPUTS if kwargs.get(name) is not None]
    if not given:
        return
    check_multimodal(model)
    model_type = getattr(getattr(base_model(model), "config", None), "model_type", None)
    if (
        model_type in mrope.TILE_MODEL_TYPES
        and "pixel_values" in given
        and "pixel_attention_mask" not in given
    ):
        raise PackingError(
            f"{type(base_model(model)).__name__} (model_type {model_type!r}) got a packed batch with pixel_values "
            f"but no pixel_attention_mask: the model would read every tile as unpadded (a padded tile's zero "
            f"pixels as image). Collate its packed rows with packtools.batches.MultimodalCollator(model, "
            f"pad_token_id), which carries each row's masks.",
            param="pixel_attention_mask",
        )
    if model_type in mrope.ANYRES_MODEL_TYPES and "pixel_values" in given and "image_sizes" not in given:
        raise PackingError(
            f"{type(base_model(model)).__name__} (model_type {model_type!r}) got a packed batch with pixel_values "
            f"but no image_sizes: each image's tiles and tokens follow from its original size. Collate its packed "
            f"rows with packtools.batches.MultimodalCollator(model, pad_token_id), which carries each row's "
            f"image_sizes (and OneVision's batch_num_images).",
            param="image_sizes",
        )
    if model_type not in mrope.IMAGE_BLOCK_TYPES:
        return
    ready = isinstance(kwargs.get("attention_mask"), dict)
    per_document = ready and any(isinstance(m, DocumentBlockMask) for m in kwargs["attention_mask"].values())
    if per_document and impl != SEGMENTED_SDPA:
        raise PackingError(
            f"{type(base_model(model)).__name__} (model_type {model_type!r}) got each document's masks per "
            f"document (MultimodalCollator(image_masks='per_document')) on attn_implementation={impl!r}, which "
            f"reads masks as whole-row tensors only. Load the model with attn_implementation={SEGMENTED_SDPA!r} "
            f"(packtools.integrations.attention.segmented.register()), or collate with image_masks='dense'.",
            param="attention_mask",
        )
    if not ready and _text_only_image_blocks(given, kwargs):
        return
    if ready and impl in mrope.IMAGE_BLOCK_BACKENDS:
        return
    raise PackingError(
        f"{type(base_model(model)).__name__} (model_type {model_type!r}) got image inputs "
        f"{'with' if ready else 'without'} each document's masks ready-made, on attn_implementation={impl!r}: "
        f"{mrope.IMAGE_BLOCK_REASON}. Collate its packed rows with packtools.batches.MultimodalCollator(model, "
        f"pad_token_id), which gives them (attention_mask by layer type), on "
        f"{list(mrope.IMAGE_BLOCK_BACKENDS)}.",
        param="attention_mask",
    )


#: Config attributes naming a multimodal model's placeholder tokens, and the forward inputs that bring their pixels
#: (or features): a placeholder in ``input_ids`` with none of them trains on its embedding alone.
PLACEHOLDER_INPUTS = (
    ("image_token_id", ("pixel_values", "image_embeds", "mm_encoder_outputs")),
    ("image_token_index", ("pixel_values", "image_embeds", "mm_encoder_outputs")),
    ("video_token_id", ("pixel_values_videos", "video_embeds", "mm_encoder_outputs")),
    ("video_token_index", ("pixel_values_videos", "video_embeds", "mm_encoder_outputs")),
)


#: The config attributes of :data:`PLACEHOLDER_INPUTS` (the isolation probe's random tokens avoid them).
PLACEHOLDER_TOKENS = tuple(attr for attr, _ in PLACEHOLDER_INPUTS)


def check_image_placeholders(model: Any, kwargs: Any) -> None:
    """Refuse a packed forward into a multimodal model whose ``input_ids`` hold an image (or video) placeholder
    token (the config's ``image_token_id`` / ``image_token_index`` / ``video_token_id``) with no pixels for it
    (:data:`PLACEHOLDER_INPUTS`): transformers then embeds the placeholders as text with no error, so rows whose
    images were dropped (their columns removed, the tokens kept; a Gemma 3 text-only batch with an all-zero
    ``token_type_ids``) would train image tokens without images.

    >>> check_image_placeholders(object(), {"input_ids": [[1, 2]]})
    """
    ids = kwargs.get("input_ids")
    config = getattr(base_model(model), "config", None)
    if ids is None or config is None or not hasattr(ids, "__eq__") or not hasattr(ids, "shape"):
        return
    unfed = [
        (attr, inputs, token)
        for attr, inputs in PLACEHOLDER_INPUTS
        if isinstance(token := getattr(config, attr, None), int)
        and not isinstance(token, bool)
        and all(kwargs.get(n) is None for n in inputs)
    ]
    if not unfed:
        return
    anywhere = ids == unfed[0][2]
    for _, _, token in unfed[1:]:
        anywhere = anywhere | (ids == token)
    if not bool(anywhere.any()):  # one host sync on the training path; which token, only when one is there
        return
    for attr, inputs, token in unfed:
        found = ids == token
        if bool(found.any()):
            where = found.nonzero()  # torch: one (row, token) per line; numpy: one array per axis
            at = (
                tuple(int(w[0]) for w in where)
                if isinstance(where, tuple)
                else tuple(int(i) for i in where[0])
            )
            raise PackingError(
                f"{type(base_model(model)).__name__} got a packed batch whose input_ids hold its placeholder token "
                f"{token} ({attr}; at index {at} of input_ids) with no {' / '.join(inputs)}: the model would embed the "
                f"placeholders as text and train them without their images or videos, with no error (their pixel "
                f"columns left out of the rows). Batch vision-language rows with "
                f"packtools.batches.MultimodalCollator(model, pad_token_id), or, to train the text alone, remove "
                f"the placeholder tokens from the rows with their pixels.",
                param="input_ids",
            )


def _text_only_image_blocks(given: Sequence[str], kwargs: Any) -> bool:
    """Whether the image inputs ``given`` to a model of :data:`~packtools.batches.mrope.IMAGE_BLOCK_TYPES` (Gemma 3)
    are ``token_type_ids`` alone with no image token marked (all zero): then transformers' packed masks have no
    image block to look up at the wrong index and are those of a text-only forward, exact per document on
    ``sdpa`` and ``eager``, sliding layers included (``tests/test_vision_gemma3.py``).  Only without ready-made
    masks: a dict ``attention_mask`` reaches the layers as given, which ``eager`` cannot read.

    >>> import numpy as np
    >>> zeros, marked = {"token_type_ids": np.zeros((1, 4))}, {"token_type_ids": np.eye(2)}
    >>> _text_only_image_blocks(["token_type_ids"], zeros), _text_only_image_blocks(["token_type_ids"], marked)
    (True, False)
    """
    return list(given) == ["token_type_ids"] and not bool(kwargs["token_type_ids"].any())


#: Layer types whose layers pool every ``config.compress_rates[type]`` consecutive tokens of a row into one
#: compressed key/value (DeepSeek-V4's compressed sparse and heavily compressed attention): the windows run along
#: the row whatever its documents, and a query attends to the first windows of the row by its ``position_ids``.
ROW_POOLING_LAYER_TYPES = ("compressed_sparse_attention", "heavily_compressed_attention")


def row_pooling_layers(model: Any) -> list[tuple[int, str]]:
    """``(layer index, layer type)`` of the layers of :data:`ROW_POOLING_LAYER_TYPES` in the model's config."""
    config = getattr(base_model(model), "config", None)
    if config is not None and callable(getattr(config, "get_text_config", None)):
        config = config.get_text_config()
    types = getattr(config, "layer_types", None) or ()
    return [(i, t) for i, t in enumerate(types) if t in ROW_POOLING_LAYER_TYPES]


def check_row_pooling(model: Any) -> None:
    """Refuse a model with layers that pool fixed windows of the row (:func:`row_pooling_layers`), whatever its
    backend: a packed row's windows mix its documents (and a later document's queries read the row's first
    windows), with no error.  The isolation probe's rows are shorter than such a window (DeepSeek-V4's heavily
    compressed attention pools 128 tokens), so it measures nothing; this check reads the config instead."""
    found = row_pooling_layers(model)
    if not found:
        return
    config = getattr(base_model(model), "config", None)
    rates = getattr(config, "compress_rates", None) or {}
    layers = ", ".join(f"{i} ({t}{f', {rates[t]} tokens' if t in rates else ''})" for i, t in found)
    raise PackingError(
        f"{type(base_model(model)).__name__} has layers that pool every few consecutive tokens of a row into one "
        f"compressed key/value: layers {layers}. On a packed row those windows take tokens of several documents, "
        f"and each document's queries read the row's first windows, so packed documents would see each other "
        f"with no error (the isolation probe's short rows never fill a window). Train this model unpacked (one "
        f"document per row, padded), or with layer_types of 'sliding_attention' only.",
        param="model",
    )


def check_not_compiled(model: Any) -> None:
    """Refuse a model already wrapped by ``torch.compile``: packtools must hook and check the module itself."""
    if not hasattr(model, "_orig_mod") or not hasattr(model, "_torchdynamo_orig_callable"):
        return
    raise PackingError(
        f"the model was compiled (torch.compile gave a {type(model).__name__}) before packtools saw it, so its "
        f"forward and inputs cannot be checked or adapted for packed batches. Give the Trainer the uncompiled "
        f"model and let it be compiled afterwards: TrainingArguments(torch_compile=True), or torch.compile "
        f"after prepare_trainer; both train exactly.",
        param="model",
    )


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
    check_not_compiled(model)
    check_multimodal(model)
    check_row_pooling(model)
    check_recurrent(model)
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
    if impl == SEGMENTED_SDPA and uses_alibi(model):
        raise PackingError(
            f"{type(base_model(model)).__name__} adds ALiBi position biases to the attention mask tensor itself, "
            f"and {SEGMENTED_SDPA!r} hands attention no whole-row mask tensor (a DocumentMask, built per "
            f"document): packtools does not run ALiBi models on {SEGMENTED_SDPA!r}. Load it with "
            f"attn_implementation='sdpa' (prepare_trainer keeps ALiBi models on 'sdpa', which separates packed "
            f"sequences by their position_ids) or 'eager'.",
            param="model",
        )
    if not is_flash(impl) and not builds_packed_masks():
        raise PackingError(
            f"this transformers version does not build a block-diagonal mask from position_ids, so {impl!r} "
            f"attention would let packed sequences see each other. Upgrade transformers (>= 4.54), or use "
            f"attn_implementation='flash_attention_2'."
        )
    if not is_flash(impl) and not forward_accepts(model, "position_ids", named=True):
        if not (positions_reach_decoder(model) or attention_free(model)):
            raise PackingError(
                f"{type(base_model(model)).__name__}.forward takes no position_ids, so with {impl!r} attention it "
                f"cannot separate packed sequences. Use attn_implementation='flash_attention_2', or do not pack."
            )
        # else: position_ids travel through **kwargs to a decoder that names them, or the model has no
        # attention that would read them; the isolation probe measures the packed batch (prepare_trainer's, or
        # guard_model's at the first packed batch)
    return impl


#: Recurrent model types (no attention) that packtools cannot keep packed documents apart in, and why (checked in
#: transformers 5.25).  Refused by :func:`check_recurrent` whatever the backend: nothing in them reads
#: ``position_ids``, and their recurrent layers cannot be run per document.
UNPACKABLE_RECURRENT = {
    "rwkv": "its RWKV blocks carry their recurrent state from token to token and take no document boundaries; "
    "they return (hidden states, state) tuples that packtools cannot run per document",
    "xlstm": "its xLSTM blocks carry their recurrent state from token to token and take no document boundaries; "
    "they return (hidden states, state) tuples that packtools cannot run per document",
}


def check_recurrent(model: Any) -> None:
    """Refuse a recurrent model type of :data:`UNPACKABLE_RECURRENT`, naming what is missing: its state would run
    from one packed document into the next with no error."""
    base = base_model(model)
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    if model_type not in UNPACKABLE_RECURRENT:
        return
    raise PackingError(
        f"{type(base).__name__} (model_type {model_type!r}) is a recurrent model with no attention: "
        f"{UNPACKABLE_RECURRENT[model_type]}. On a packed row each document's state would start where the "
        f"previous one ended, with no error. Train it unpacked (one document per row, padded); Mamba, "
        f"Falcon-Mamba and Mamba-2 models pack exactly.",
        param="model",
    )


def positions_reach_decoder(model: Any) -> bool:
    """Whether ``position_ids`` can reach the model's decoder though its own ``forward`` does not name them: it
    takes ``**kwargs`` and its decoder (``get_decoder()``) names ``position_ids`` (transformers 5.25's
    WhisperForCausalLM hands its keyword arguments to its decoder).  Whether they do is measured by the probe."""
    base = base_model(model)
    decoder = base.get_decoder() if callable(getattr(base, "get_decoder", None)) else None
    if decoder is None or decoder is base or not callable(getattr(decoder, "forward", None)):
        return False
    return forward_accepts(base, "position_ids") and forward_accepts(decoder, "position_ids", named=True)


def attention_free(model: Any) -> bool:
    """Whether the model has token-mixing layers (:func:`token_mixing_layers`, handled ones included) and no
    attention module (transformers' attention classes set ``is_causal``): its documents are kept apart by running
    those layers per document (:mod:`packtools.integrations.attention.mixers`), and ``position_ids`` mean nothing
    to it (transformers 5.25's Mamba-2).  Whether they are is measured by the probe."""
    base = base_model(model)
    if not callable(getattr(base, "named_modules", None)):
        return False
    if any(hasattr(m, "is_causal") for _, m in base.named_modules()):
        return False
    return bool(token_mixing_layers(base, include_handled=True))


#: Model types whose attention always adds ALiBi biases (others say so in ``config.alibi``, e.g. Falcon).
ALIBI_MODEL_TYPES = ("bloom", "mpt")


def uses_alibi(model: Any) -> bool:
    """Whether the model adds ALiBi position biases to its attention (``config.alibi``, or Bloom / MPT)."""
    config = getattr(base_model(model), "config", None)
    return bool(getattr(config, "alibi", False)) or getattr(config, "model_type", None) in ALIBI_MODEL_TYPES


def switches_to_segmented_sdpa(model: Any) -> bool:
    """Whether :func:`use_segmented_sdpa` switches ``model``: one on ``sdpa`` with ``set_attn_implementation``,
    a text model or one of :data:`~packtools.batches.mrope.SEGMENTED_SDPA_TYPES` (Gemma 3, Idefics3, SmolVLM: their
    vision towers' calls carry no ``cu_seq_lens`` and go to transformers' ``sdpa`` unchanged, their text models run
    each document alone, exact: ``tests/test_vision_gemma3.py``, ``tests/test_vision_idefics3.py``), and no ALiBi
    model (:func:`uses_alibi`).  Other composite (multimodal) configs are not verified on ``packtools_sdpa`` and stay
    on ``sdpa``.

    >>> switches_to_segmented_sdpa(object())
    False
    """
    base = base_model(model)
    config = getattr(base, "config", None)
    if attention_implementation(model) != "sdpa" or not hasattr(base, "set_attn_implementation"):
        return False
    parts = getattr(config, "sub_configs", None)
    if parts and getattr(config, "model_type", None) not in mrope.SEGMENTED_SDPA_TYPES:
        return False
    # every part on sdpa (a vision tower loaded on another backend keeps it: the switch names one for all)
    if parts and any(
        getattr(getattr(config, name, None), "_attn_implementation", "sdpa") != "sdpa" for name in parts
    ):
        return False
    return not uses_alibi(model)  # ALiBi: check_attention_implementation


def use_segmented_sdpa(model: Any, *, owner: Any = None) -> bool:
    """Switch a text model (or Gemma 3, Idefics3, SmolVLM with images) from ``sdpa`` to packtools' per-sequence ``sdpa``
    (:mod:`packtools.integrations.attention.segmented`); returns whether it switched.

    Models :func:`switches_to_segmented_sdpa` leaves out (other backends, other composite configs, ALiBi models,
    models without ``set_attn_implementation``) are left as they are.  With an ``owner`` (``prepare_trainer``
    passes the trainer) the switch and the registration are recorded, so :func:`packtools.integrations.unprepare`
    switches back; otherwise ``model.set_attn_implementation("sdpa")`` does.  The name is not saved with the
    config.
    """
    if not switches_to_segmented_sdpa(model):
        return False
    set_attention(base_model(model), register(owner=owner), owner=owner)
    return attention_implementation(model) == SEGMENTED_SDPA  # some models keep their own (e.g. Falcon)


def switch_back(models: Sequence[Any]) -> None:
    """Undo :func:`use_segmented_sdpa` on ``models``."""
    for model in models:
        set_attention(base_model(model), "sdpa")


@contextlib.contextmanager
def segmented_sdpa_until_checked(
    models: Sequence[Any], enabled: bool = True, *, owner: Any = None
) -> Iterator[list[Any]]:
    """Switch the ``sdpa`` models among ``models`` (:func:`use_segmented_sdpa`) and yield those switched; if
    the block raises (a refused trainer), switch them back, so the caller's models are left as they came."""
    switched = [m for m in models if m is not None and enabled and use_segmented_sdpa(m, owner=owner)]
    try:
        yield switched
    except BaseException:
        switch_back(switched)
        raise


_MIXER_NAMES = ("Mamba", "DeltaNet", "LinearAttention", "ShortConv", "SSM", "RWKV", "Recurrent")


def token_mixing_layers(model: Any, *, include_handled: bool = False) -> list[str]:
    """Names of the layers that mix tokens outside attention (convolutions, state-space or linear-attention scans).

    Such layers ignore ``position_ids``: they keep packed sequences apart only when given ``seq_idx`` or
    ``cu_seq_lens`` *and* a kernel that reads them (mamba-ssm, causal-conv1d, flash-linear-attention).
    Found by module type: a ``torch.nn.Conv1d`` with a kernel wider than 1 (reported as its parent
    layer) or a class named like a Mamba / DeltaNet / linear-attention / RWKV block that is not an attention
    module (transformers' attention classes set ``is_causal``: Kimi Linear's MLA is ``KimiLinearAttention``).
    Layers that :func:`packtools.integrations.attention.mixers.run_mixers_per_document` runs per document (or with their
    varlen kernels) keep documents apart and are not listed (``include_handled=True`` lists them too).
    """
    found: list[str] = []
    handled: list[str] = []
    modules = dict(base_model(model).named_modules())
    for name, module in modules.items():
        cls = type(module).__name__
        parent = name.rsplit(".", 1)[0] if "." in name else name
        if any(name == f or name.startswith(f + ".") or parent == f for f in found):
            continue
        kernel = getattr(module, "kernel_size", None)
        if cls == "Conv1d" and isinstance(kernel, tuple) and kernel[0] > 1:
            found.append(parent)
        elif (
            any(part in cls for part in _MIXER_NAMES)
            and not cls.endswith(("Model", "ForCausalLM", "Norm"))  # a norm (MambaRMSNorm) mixes no tokens
            and not hasattr(module, "is_causal")
        ):
            found.append(name)
    for name in found:
        forward = vars(modules[name]).get("forward") if name in modules else None
        if getattr(forward, "keeps_documents_apart", False):
            handled.append(name)
    return found if include_handled else [n for n in found if n not in handled]


def adapt_collator(collator: Any, model: Any) -> Any:
    """``collator`` with the keys the model's ``forward`` does not take switched off (and, for padded
    batches, the model's attention backend named, so packed rows are checked against it).

    Applies to a :class:`~packtools.PaddingFreeCollator` (or the one inside an ``ArrowCollator``);
    any other collator is returned as is.  ``position_ids`` is never switched off here: without it
    non-flash backends cannot separate sequences, which :func:`check_attention_implementation` refuses.
    ``use_cache`` stays only where the ``forward`` names it (a model without the parameter has no cache to
    turn off, and the key would travel on through its ``**kwargs``).
    """
    inner = getattr(collator, "collator", collator)
    if not isinstance(inner, PaddingFreeCollator):
        return collator
    changes: dict[str, Any] = {
        switch: False
        for switch, keys in SWITCHED_KEYS.items()
        if switch != "return_position_ids"
        and getattr(inner, switch)
        and not all(forward_accepts(model, key, named=key == "use_cache") for key in keys)
    }
    if not inner.padding_free and inner.attn_implementation is None:  # the model's backend, for its check
        changes["attn_implementation"] = attention_implementation(model)
    if not changes:
        return collator
    adapted = inner.replace(**changes)
    if inner is collator:
        return adapted
    wrapper = copy.copy(collator)
    wrapper.collator = adapted
    return wrapper
