"""The built-in adversarial set: texts (and conversations built from them) on which inexact tokenizers break.

The fast engine (:mod:`packtools.pipeline.tokenizer.fast`) is compared with transformers on it before it may
tokenize a run (:func:`packtools.pipeline.tokenizer.proof.choose_engine`); so is the lite reference
(:mod:`packtools.pipeline.tokenizer.reference`) and the chat renderer.  What it holds: ``docs/tokenize.md``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

#: the adversarial set's longest text: more tokens than any usual configured truncation
LONG_TEXT_WORDS = 12_000


#: characters where regex engines' classes disagree (\s, \w, \b, POSIX and script classes): fastokens counts
#: U+180E as whitespace and Oniguruma does not; spacing and enclosing combining marks (Indic vowel signs) are
#: word characters for one and not the other; U+00B4 is punctuation in one POSIX class and not in the other
REGEX_CLASS_CHARS = (
    "\u180e", "\u200b", "\ufeff", "\u00b4", "\u0085", "\u1680", "\u2007", "\u202f", "\u205f",
    "\u00ad", "\u061c", "\u093e", "\u0947", "\u0903", "\u09be", "\u09cd", "\u0bbe", "\u0bcd",
    "\u0e31", "\u20dd", "\u0488", "\u0301", "\uff11", "\u2160",
)  # fmt: skip


def regex_class_texts() -> list[str]:
    """Each of :data:`REGEX_CLASS_CHARS` next to spaces, letters, digits and a common word (a piece that crosses
    it merges differently), and ordinary sentences in scripts with combining vowel signs.

    >>> any("X\u180e the" in t for t in regex_class_texts())
    True
    """
    out = []
    for c in REGEX_CLASS_CHARS:
        out.append(f"X{c} the a{c}b {c} the quick the{c} quick 1{c} the 2{c}3 {c}{c} x word{c}")
    out += [
        "Монгол бичиг ᠮᠣᠩᠭᠣᠯ\u180e ᠪᠢᠴᠢᠭ",
        "हिन्दी में लिखा गया एक सामान्य वाक्य है।",
        "বাংলা ভাষায় লেখা একটি সাধারণ বাক্য।",
        "தமிழில் எழுதப்பட்ட ஒரு சாதாரண வாக்கியம்.",
        "ภาษาไทยเขียนโดยไม่มีช่องว่าง",
    ]
    return out


def adversarial_texts(specials: Sequence[str] = (), seed: int = 0) -> list[str]:
    """Texts that break inexact tokenizers: unicode, whitespace runs, digits, special-token strings, empty ones.

    ``specials`` are the tokenizer's added-token strings; they are put inside text, next to each other,
    cut short and repeated.  The list is deterministic for a given ``seed``.

    >>> texts = adversarial_texts(["<|eos|>"])
    >>> "" in texts, any("x<|eos|>y" in t for t in texts)
    (True, True)
    """
    fixed = [
        "",
        " ",
        "  ",
        "\n",
        "\n\n\n",
        "\t \t",
        "\r\n\r\n  \r\n",
        " \u00a0\u2009\u3000\u2028 x",
        "   leading spaces",
        "trailing spaces    ",
        "x" * 2000,
        " " * 3000,
        "\n" * 500 + "end",
        "ab" * 700,
        "0",
        "1234567890123456789",
        "3.14159 2,718 1e-9 0x1F -42 +7 1_000_000",
        "٠١٢٣٤٥ ١٢٣ 一二三 ⅧⅨ ½ ² ①",
        "Hello, World! HELLO world. héllo wörld",
        "it's I'M you'RE they've we'll he'd ’s 's's",
        "naïve café résumé Zürich Ærø Œuvre ß ẞ",
        "e\u0301 a\u0308 n\u0303 (combining marks, not NFC)",
        "日本語のテキストと中文文本，한국어 텍스트。",
        "Русский текст, ελληνικά, עברית, العربية, हिन्दी, ไทย",
        "emoji 🙂🙂🙂 👩‍👩‍👧‍👦 🏳️‍🌈 🇫🇷 ❤️ 1️⃣",
        "\x00\x01\x7f\x1b[31mred\x1b[0m \ufeffbom \ufffd",
        "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n\n\n\tpass\n",
        '<html><body class="x">&nbsp;&#x27;</body></html>',
        "https://example.com/a?b=c&d=e#f user@example.com",
        "MiXeD CaSe camelCase snake_case kebab-case ALLCAPS",
        "....!!!???---___===+++***///\\\\\\|||",
        "a\u200bb\u200cc\u200dd\u2060e",
        "\U0001d54f\U0001d550 \U00020000\U0002a6d6 \U0010fffd",
    ]
    out = list(fixed) + regex_class_texts()
    # One text longer than any usual configured truncation (a tokenizer.json ``truncation`` block must not apply).
    words = ["alpha", "beta", "gamma", "x7", "déjà", "日本", "🙂", "q", "zz", "\n"]
    long_rng = random.Random(seed + 1)
    out.append(" ".join(long_rng.choice(words) for _ in range(LONG_TEXT_WORDS)))
    for s in specials:
        out += [
            s,
            s + s,
            f"x{s}y",
            f" {s} ",
            f"\n{s}\n",
            f"text before {s}text after",
            s[:-1],
            s[1:],
            f"{s[: len(s) // 2]} {s[len(s) // 2 :]}",
        ]
    if len(specials) > 1:
        out.append("".join(specials))
        out.append(" ".join(specials) + " tail")
    rng = random.Random(seed)
    pools = [
        " \t\n\r",
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
        "0123456789",
        "'’.,;:!?()[]{}<>|-_=+*/\\\"#$%&@^`~",
        "éüñçøåßÆœ日本語中文한국어Ωπ😀👍🏽é\u0301\u00a0\u3000",
    ] + list(specials)
    for _ in range(48):
        n = rng.randint(1, 40)
        parts = []
        for _ in range(n):
            pool = rng.choice(pools)
            if pool in specials:
                parts.append(pool)
            else:
                parts.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 6))))
        out.append("".join(parts))
    return out


def adversarial_conversations(texts: Sequence[str]) -> list[list[dict[str, str]]]:
    """Conversations built from ``texts`` (single and multi-turn, with a system turn, empty contents)."""
    convs: list[list[dict[str, str]]] = []
    for i in range(0, len(texts) - 1, 2):
        convs.append([{"role": "user", "content": texts[i]}, {"role": "assistant", "content": texts[i + 1]}])
    for i in range(0, len(texts) - 4, 5):
        convs.append(
            [
                {"role": "system", "content": texts[i]},
                {"role": "user", "content": texts[i + 1]},
                {"role": "assistant", "content": texts[i + 2]},
                {"role": "user", "content": texts[i + 3]},
                {"role": "assistant", "content": texts[i + 4]},
            ]
        )
    return convs
