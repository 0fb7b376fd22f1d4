"""Real LLM vocabularies for the tests, built offline from the BPE rank files the ``quicktok-v1`` package ships
(Llama 3: 128k ranks + 256 specials; Qwen 2.5/3: 151k ranks + 26 specials), converted with transformers'
``TikTokenConverter`` (ranks -> vocab and merges, the model's regex split, byte-level, ``extra_special_tokens``),
then given what the model's own tokenizer.json has: ``ignore_merges`` and a BOS post-processor for Llama 3, an
NFC normalizer and no ``ignore_merges`` for Qwen.  Plus chat templates of five families, each in a plain form
(packtools finds assistant turns by incremental rendering) and a tagged copy (``{% generation %}`` around
exactly the same text), and a generated multilingual adversarial corpus."""

from __future__ import annotations

import os
import random
import struct

LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
QWEN_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
BUILD_VERSION = 1  # bump when the conversion below changes (the on-disk cache is keyed by it)
EXTRA_CHAT = ["[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "<start_of_turn>", "<end_of_turn>",
              "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]  # fmt: skip


def _data_dir() -> str:
    import quicktok

    return os.path.join(os.path.dirname(quicktok.__file__), "data")


def read_ranks(name: str) -> tuple[dict[bytes, int], list[tuple[int, str]]]:
    """quicktok's ``<name>.vocab`` (u32 count, then u16 length + bytes + u32 rank) and ``<name>.special``."""
    with open(os.path.join(_data_dir(), name + ".vocab"), "rb") as fh:
        raw = fh.read()
    (n,), at, ranks = struct.unpack_from("<I", raw), 4, {}
    for _ in range(n):
        (length,) = struct.unpack_from("<H", raw, at)
        token = raw[at + 2 : at + 2 + length]
        (rank,) = struct.unpack_from("<I", raw, at + 2 + length)
        ranks[token] = rank
        at += 6 + length
    with open(os.path.join(_data_dir(), name + ".special"), "rb") as fh:
        raw = fh.read()
    (n,), at, specials = struct.unpack_from("<I", raw), 4, []
    for _ in range(n):
        tid, length = struct.unpack_from("<IH", raw, at)
        specials.append((tid, raw[at + 6 : at + 6 + length].decode()))
        at += 6 + length
    return ranks, specials


def build(name: str, path: str, chat_template: str | None = None) -> str:
    """Build vocabulary ``name`` (``llama3`` or ``qwen3``) into the folder ``path`` (save_pretrained)."""
    from tokenizers import normalizers, processors
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks, specials = read_ranks(name)
    first_special = min(t for t, _ in specials)
    assert first_special == len(ranks), (
        first_special,
        len(ranks),
    )  # specials follow the ranks, as in the models

    class Converter(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(_url):  # the ranks come from quicktok's file, not a tiktoken download
            return ranks

    names = [s for _, s in sorted(specials)]
    tok = Converter(
        vocab_file=name, pattern=LLAMA3_REGEX if name == "llama3" else QWEN_REGEX, extra_special_tokens=names
    ).converted()
    extra = [s for s in EXTRA_CHAT if tok.token_to_id(s) is None]
    if name == "llama3":
        bos = "<|begin_of_text|>"
        tok.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(
                    single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))]
                ),
            ]
        )
        kwargs = {"bos_token": bos, "eos_token": "<|eot_id|>"}
    else:
        tok.normalizer = normalizers.NFC()
        tok.model.ignore_merges = False
        kwargs = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=chat_template, **kwargs)
    if extra:
        fast.add_special_tokens({"additional_special_tokens": extra})
    fast.save_pretrained(path)
    for i, s in specials:
        assert fast.convert_tokens_to_ids(s) == i, s
    return path


# -- chat templates: plain, and a tagged copy marking the text incremental rendering gives each assistant turn --
def _tagged(assistant: str) -> str:
    return "{% generation %}" + assistant + "{% endgeneration %}"


def _templates() -> dict[str, tuple[str, str]]:
    """name -> (plain, tagged): each assistant turn is ``header`` + ``body``, the generation prompt is
    ``header``, and the tagged copy wraps ``body``: the text incremental rendering gives the turn."""

    def family(head: str, user: str, header: str, body: str) -> tuple[str, str]:
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
        "llama3": family(
            "{{ bos_token }}",
            llama_user,
            "<|start_header_id|>assistant<|end_header_id|>\n\n",
            "{{ m['content'] | trim }}<|eot_id|>",
        ),
        "qwen3-think": family(
            "",
            chatml_user,
            "<|im_start|>assistant\n",
            "<think>\n{{ m.get('reasoning_content', '') | trim }}\n</think>\n\n{{ m['content'] }}<|im_end|>\n",
        ),
        "mistral": family("{{ bos_token }}", mistral_user, "", "{{ m['content'] }}{{ eos_token }}"),
        "gemma": family(
            "{{ bos_token }}",
            gemma_user,
            "<start_of_turn>model\n",
            "{{ m['content'] | trim }}<end_of_turn>\n",
        ),
        "phi": family("", phi_user, "<|assistant|>\n", "{{ m['content'] }}<|end|>\n"),
    }


TEMPLATES = _templates()

# The official Meta-Llama-3-8B-Instruct and Gemma templates as their tokenizer configs ship them (plain), and
# tagged copies that render the same text with {% generation %} around what incremental rendering gives the turn.
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
OFFICIAL = {
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


# -- the corpus ------------------------------------------------------------------------------------------------
_SCRIPTS = [
    "The quick brown fox jumps over the lazy dog. It's 3.14159, isn't it? I'M SURE you'RE right.",
    "Příliš žluťoučký kůň úpěl ďábelské ódy. Zażółć gęślą jaźń. Árvíztűrő tükörfúrógép.",
    "Съешь же ещё этих мягких французских булок, да выпей чаю. Ελληνικά: ξεσκεπάζω την ψυχοφθόρα βδελυγμία.",
    "نص عربي مع أرقام ١٢٣٤٥ وعلامات ترقيم، أليس كذلك؟ טקסט בעברית עם ניקוד: שָׁלוֹם.",
    "हिन्दी पाठ, தமிழ் உரை, বাংলা লেখা, ภาษาไทยไม่มีช่องว่าง, ພາສາລາວ, ᠮᠣᠩᠭᠣᠯ",
    "日本語の文章とカタカナ、ひらがな。中文文本，标点符号。한국어 텍스트와 자모 ᄀᄁᄂ.",
    "emoji 🙂👍🏽👩‍👩‍👧‍👦🏳️‍🌈🇯🇵 ❤️‍🔥 1️⃣ and CJK ext 𠀀𠀁𪚥 math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "combining: e\u0301 a\u0308 o\u0302\u0323 (not NFC); precomposed: é ä ộ; Hangul NFD: \u1100\u1161\u11a8",
    "def f(x):\n\treturn {'k': [1, 2, 3]}  # tab-indented\n\n\nclass A:\n    pass\r\n",
    '<div class="x">&nbsp;&lt;tag&gt;</div> https://example.com/a?b=c&d=e#f  user@example.org',
    "numbers 1234567890 12 345 6789 0.5 -42 1e10 0x1F 1,000,000 ١٢٣ ٤٥٦",
    "whitespace:\u00a0nbsp\u2009thin\u3000ideographic\u2028line\u2029para\u0085nel\u200bzw\ufeffbom",
]
_WORDS = [w for s in _SCRIPTS for w in s.split()]


def corpus(n: int, seed: int = 0, specials: tuple[str, ...] = ()) -> list[str]:
    """``n`` generated texts: script samples, shuffled words, whitespace runs, special-token strings inside
    text, control characters, long runs; deterministic for a seed."""
    rng = random.Random(seed)
    out = list(_SCRIPTS)
    ws = [" ", "  ", "\t", "\n", "\n\n", "\r\n", " \n ", "   \t  "]
    while len(out) < n:
        kind = rng.random()
        if kind < 0.5:
            words = [rng.choice(_WORDS) for _ in range(rng.randint(1, 60))]
            out.append("".join(w + rng.choice(ws if rng.random() < 0.2 else [" "]) for w in words))
        elif kind < 0.7 and specials:
            out.append(
                f"{rng.choice(_WORDS)}{rng.choice(specials)}{rng.choice(_WORDS)} {rng.choice(specials)}"
            )
        elif kind < 0.85:
            out.append("".join(chr(rng.choice([rng.randint(0x20, 0x7E), rng.randint(0xA0, 0x2FFF),
                                               rng.randint(0x3000, 0x9FFF), rng.randint(0x1F300, 0x1FAFF)]))
                               for _ in range(rng.randint(1, 80))))  # fmt: skip
        else:
            out.append(
                rng.choice(ws) * rng.randint(1, 50) + rng.choice(_WORDS) + "\x00\x1b[0m" * rng.randint(0, 2)
            )
    return out[:n]


def conversations(texts: list[str], seed: int = 0) -> list[list[dict[str, str]]]:
    """Single and multi-turn conversations (some with a system turn, some with reasoning) from ``texts``."""
    rng = random.Random(seed)
    convs, i = [], 0
    while i + 6 < len(texts):
        conv = []
        if rng.random() < 0.3:
            conv.append({"role": "system", "content": texts[i]})
            i += 1
        for _ in range(rng.randint(1, 3)):
            conv.append({"role": "user", "content": texts[i]})
            answer = {"role": "assistant", "content": texts[i + 1]}
            if rng.random() < 0.5:
                answer["reasoning_content"] = texts[i + 2]
            conv.append(answer)
            i += 3
        convs.append(conv)
    return convs
