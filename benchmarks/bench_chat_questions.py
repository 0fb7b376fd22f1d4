"""Whether the pieces of a turn-aware split keep the questions their answers reply to (issue 40).

Usage::

    python benchmarks/bench_chat_questions.py                          # 3,000 conversations, Qwen 3 vocabulary
    python benchmarks/bench_chat_questions.py --convs 300 --vocab bpe --lengths 512,2048

Data: ``packtools.testing.chat_conversations`` (seed 0), the newcomer's workflow of findings/newcomer-2026-12c.md
§3: system prompts in 4 of 5 conversations, 1 to 6 exchanges, pasted code in 12% of user turns, tool calls
(call, JSON result, answer) in 30% of exchanges, a reply of 1,500-3,000 words in 3%.  Tokenizer: the Qwen 3
vocabulary built offline from ``quicktok-v1``'s rank files (``packtools.testing.real_tokenizer``) with a plain ChatML
template (``--vocab bpe``: ``packtools.testing.tiny_tokenizer``'s byte-level BPE).  Packed with ``pack_files(..., "bfd_split")``.

Columns, over the packed sequences (each counted independently of packtools' own statistics):

- ``at tool``: sequences whose own tokens (after a copied system prompt) start with a tool message: its
  answer trains without the user's question;
- ``after head``: replies whose first trained token comes right after a copied system prompt (a continuation
  of a reply trained in a context that never existed: review-2026-12c C1);
- ``question end``: replies whose sequence holds the end of their question but not its start (the question
  was longer than what the piece had room for);
- ``q. dropped``: packtools' ``questions_dropped`` (the summary's "answers without their question").
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time


def _find(row: list[int], part: list[int], start: int = 0) -> int:
    for i in range(start, len(row) - len(part) + 1):
        if row[i : i + len(part)] == part:
            return i
    return -1


def count(ids: list[list[int]], labels: list[list[int]], marks: dict[str, list[int]]) -> dict[str, int]:
    """The columns of the module docstring over packed sequences (``marks``: the token ids of ChatML's
    ``system``, ``user`` and ``tool`` message starts and of ``<|im_end|>\\n``)."""
    out = {"replies": 0, "at tool": 0, "after head": 0, "question end": 0}
    for row, lab in zip(ids, labels):
        own = 0
        if row[: len(marks["system"])] == marks["system"]:
            own = _find(row, marks["end"]) + len(marks["end"])
        out["at tool"] += row[own : own + len(marks["tool"])] == marks["tool"]
        user = _find(row, marks["user"], own)
        for i in range(max(own, 1), len(row)):
            if lab[i] != -100 and (lab[i - 1] == -100 or i == own):
                out["replies"] += 1
                if own and i == own:
                    out["after head"] += 1
                elif (user < 0 or user > i) and row[own : own + 1] != marks["tool"][:1]:
                    out["question end"] += 1
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--convs", type=int, default=3000)
    p.add_argument("--vocab", choices=["qwen3", "bpe"], default="qwen3")
    p.add_argument("--lengths", default="2048,6976")
    args = p.parse_args(argv)

    import datasets
    from transformers import AutoTokenizer

    from packtools.core import unpack
    from packtools.pipeline import pack_files
    from packtools.testing import CHATML_PLAIN, chat_conversations, real_tokenizer, tiny_tokenizer

    root = tempfile.mkdtemp(prefix="chat-questions-")
    tok_dir = os.path.join(root, "tok")
    if args.vocab == "qwen3":
        real_tokenizer("qwen3", tok_dir, CHATML_PLAIN)  # quicktok-v1's rank files
    else:
        tiny_tokenizer(tok_dir, CHATML_PLAIN)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    enc = lambda t: tok(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    marks = {r: enc(f"<|im_start|>{r}\n") for r in ("system", "user", "tool")} | {"end": enc("<|im_end|>\n")}
    src = os.path.join(root, "chat.jsonl")
    with open(src, "w") as fh:
        fh.writelines(json.dumps({"messages": c}) + "\n" for c in chat_conversations(args.convs))
    print(f"{'max_length':>10} {'pieces':>7} {'cut':>6} {'replies':>8} {'at tool':>8} {'after head':>10} "
          f"{'question end':>12} {'q. dropped':>10} {'trained kept':>13} {'s':>6}")  # fmt: skip
    for length in (int(x) for x in args.lengths.split(",")):
        out = os.path.join(root, f"out{length}")
        t0 = time.perf_counter()
        st = pack_files(src, out, length, "bfd_split", tokenizer=tok_dir, quiet=True).stats
        seconds = time.perf_counter() - t0
        seqs = unpack(datasets.load_from_disk(out).data.table)
        c = count(seqs.column("input_ids").to_pylist(), seqs.column("labels").to_pylist(), marks)
        print(f"{length:>10,} {st.get('pieces', 0):>7,} {st.get('turns_cut', 0):>6,} {c['replies']:>8,} "
              f"{c['at tool']:>8,} {c['after head']:>10,} {c['question end']:>12,} "
              f"{st.get('questions_dropped', 'n/a'):>10} {st['tokens_trained_kept']:>13,} {seconds:>6.1f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
