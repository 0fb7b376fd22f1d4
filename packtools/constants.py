"""Names and numbers shared by every layer: column names, the label ignore index, file names, versions."""

from __future__ import annotations

#: The package version (also the project's version in ``pyproject.toml``); part of every cache key.
__version__ = "0.1.0"

#: Label value that losses ignore (PyTorch's ``ignore_index`` and transformers' convention).
IGNORE_INDEX = -100
#: Column of packed rows holding each row's segment lengths.
SEQ_LENGTHS = "seq_lengths"
#: Per-token 0/1 column of completion tokens (TRL's name; packed preference rows carry it).
COMPLETION_MASK = "completion_mask"
#: Per-token 0/1 columns that mark the tokens to learn (completion-only / assistant-only loss).
MASK_COLUMNS = (COMPLETION_MASK, "assistant_masks")
#: Per-token columns a padding-free batch is built from (what the loaders and views read; integers).
TOKEN_COLUMNS = ("input_ids", "labels", *MASK_COLUMNS)
#: Per-sample image columns of processed vision-language rows: they travel whole with their sample (never cut per
#: token), so only the vision path of ``pack_dataset`` packs them (``docs/vision.md``).
IMAGE_COLUMNS = ("pixel_values", "image_grid_thw")
#: The per-tile mask of Idefics3 / SmolVLM rows (``(tiles, size, size)``, 1 on an image's pixels): packed whole with
#: ``pixel_values`` (``pack_dataset``) and carried by ``MultimodalCollator`` for those types.
PIXEL_MASK = "pixel_attention_mask"
#: The processors' per-sample video pixel columns: packtools packs images only (video positions are not verified),
#: so rows holding them are refused by name on every path, ``leave_out`` and ``columns=`` included.  (Their
#: companions ``second_per_grid_ts`` / ``video_metadata`` are ordinary columns there: a text dataset may name a
#: column so, and left out alone they drop no pixels; ``MultimodalCollator`` refuses them too.)
VIDEO_COLUMNS = ("pixel_values_videos", "video_grid_thw")
#: The any-resolution processors' (LLaVA-NeXT, LLaVA-OneVision) per-sample columns beside ``pixel_values``
#: ``(images, tiles, channels, size, size)``: each image's original ``(height, width)`` (its token count follows from
#: it) and, OneVision, the images of each sample.  Packed whole with the sample, in row order, like the pixels.
#: Like ``PIXEL_MASK`` and the video companions, they are ordinary columns to the text collators (``leave_out`` may list
#: them): no collator drops them while keeping the pixels (``pixel_values`` is refused there even when listed, and
#: ``MultimodalCollator`` carries them for the types that read them whatever ``leave_out`` says), so left out alone they
#: drop no pixels (``tests/test_vision_guard_images.py``).
ANYRES_COLUMNS = ("image_sizes", "batch_num_images")
#: Per-sample pixel columns (images and videos): left out of a batch or a packing, each image's or video's
#: placeholder tokens would stay in ``input_ids`` and train without pixels, so no path drops them silently.
PIXEL_COLUMNS = (*IMAGE_COLUMNS, *VIDEO_COLUMNS)
#: The audio processors' per-sample feature columns (Qwen2-Audio / Qwen-Omni ``input_features`` +
#: ``feature_attention_mask``, Gemma / Voxtral / Granite-style ``input_features_mask``, Phi-4-multimodal
#: ``audio_*``, raw-waveform ``input_values`` with its ``padding_mask`` (Apertus 1.5, OmniASR, VibeVoice-ASR,
#: MOSS-Transcribe-Diarize in transformers 5.25), audio codes ``audio_input_ids`` + ``audio_input_ids_mask``
#: (Higgs Audio V2, Inkling)): packtools packs no audio, so rows holding them are refused by name on every path,
#: ``leave_out`` and ``columns=`` included, as videos are (left out, each clip's placeholder tokens would stay in
#: ``input_ids`` and train with no audio).
AUDIO_COLUMNS = (
    "input_features",
    "feature_attention_mask",
    "input_features_mask",
    "audio_input_features",
    "audio_embed_sizes",
    "audio_attention_mask",
    "input_values",
    "input_values_mask",
    "padding_mask",
    "audio_input_ids",
    "audio_input_ids_mask",
)
#: Per-sample media columns (pixels and audio) that no path may leave out of a batch or a packing silently.
MEDIA_COLUMNS = (*PIXEL_COLUMNS, *AUDIO_COLUMNS)
#: Columns packed rows carry that a model's ``forward`` does not name (kept through ``remove_unused_columns``).
PACKED_COLUMNS = (SEQ_LENGTHS, *MASK_COLUMNS)
#: The keyword arguments that carry a padding-free row's document boundaries to a varlen attention call
#: (transformers' flash-attention kwargs; what ``PaddingFreeCollator(return_flash_attn_kwargs=True)`` adds).
VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
#: Input formats of the offline pipeline.
INPUT_FORMATS: tuple[str, ...] = ("text", "prompt_completion", "messages", "preference", "tokenized")
#: File name of the pipeline's manifest in an output folder.
MANIFEST = "manifest.json"
