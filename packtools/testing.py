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
"""

from __future__ import annotations

import json
import os
import random
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
