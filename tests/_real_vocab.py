"""Real LLM vocabularies for the tests: the builder and the chat templates are ``packtools.testing``'s
(:func:`~packtools.testing.real_tokenizer`, from the rank files of ``quicktok-v1``; five template families, each
plain and ``{% generation %}``-tagged), re-exported under the tests' names; here only what the tests alone use, a
generated multilingual adversarial corpus and conversations made of it."""

from __future__ import annotations

import random

from packtools.testing import FAMILY_TEMPLATES as TEMPLATES  # noqa: F401
from packtools.testing import OFFICIAL_TEMPLATES as OFFICIAL  # noqa: F401
from packtools.testing import real_tokenizer as build  # noqa: F401

BUILD_VERSION = (
    1  # bump when the conversion changes (the tests' on-disk cache of built folders is keyed by it)
)


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
