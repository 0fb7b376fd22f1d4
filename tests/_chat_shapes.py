"""Chat corpora of the shapes the 2026-12c findings split badly, generated from the standard library (seeded).

``newcomer_chats``: the newcomer's workflow (findings/newcomer-2026-12c.md §3): system prompts in 4 of 5
conversations (one short, one long, one French, one describing tools), 1 to 6 exchanges, user turns that paste
code now and then, tool calls (an assistant message that only calls a tool, the tool's JSON result, then the
answer), and now and then a reply longer than a piece.  ``answers_without_question`` counts, in packed
output, the replies trained in a sequence that holds no user message before them: the context loss the
turn-aware split exists to avoid.
"""

from __future__ import annotations

import json
import random

SYSTEMS = [
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
WORDS = (
    "packing sequences into rows keeps every token the model trains on while the attention mask keeps "
    "documents apart and the loss counts each label once per step of the optimizer"
).split()


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _code(rng: random.Random, chars: int) -> str:
    lines, n = [], 0
    while n < chars:
        i = rng.randrange(10_000)
        line = f"def f{i}(x, y={rng.randrange(100)}):\n    return x * {i} + y  # {rng.choice(WORDS)}\n"
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


def newcomer_chats(n: int, seed: int = 0, long_reply: float = 0.03) -> list[list[dict[str, str]]]:
    """``n`` conversations of the newcomer's shape (see the module docstring)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        conv = [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.8 else []
        for _ in range(rng.randint(1, 6)):
            conv.extend(_exchange(rng, long_reply))
        out.append(conv)
    return out


def answers_without_question(ids_rows, labels_rows, user_opener: list[int]) -> tuple[int, int]:
    """``(replies, replies with no user message before them in their sequence)`` over packed sequences: a
    reply is where a trained label follows an untrained one (a sequence's first token is never trained)."""
    k = len(user_opener)
    replies = orphans = 0
    for ids, labels in zip(ids_rows, labels_rows):
        seen_user = False
        for i in range(1, len(ids)):
            if ids[i - 1 : i - 1 + k] == user_opener:
                seen_user = True
            if labels[i] != -100 and labels[i - 1] == -100:
                replies += 1
                orphans += not seen_user
    return replies, orphans
