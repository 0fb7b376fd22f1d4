"""What ``bfd_split`` keeps of chat data that trains: the turn-aware split against the fixed cut and ``bfd``.

Usage::

    python benchmarks/bench_chat_split.py                      # 2,000 conversations, Llama 3 vocabulary
    python benchmarks/bench_chat_split.py --convs 500 --lengths 512,1024

Data (seed 0): conversations built from the running interpreter's standard library sources
(``packtools.pipeline.demo.stdlib_definitions``): a system prompt in 3 of 4, then 1 to 6 exchanges whose user
turn is a short question followed by 1 to 4 consecutive source pieces (long code, as in the report that asked
for this) and whose assistant turn is one short piece.  Tokenizer: the Llama 3 vocabulary built offline from the
rank files ``quicktok-v1`` ships, with Meta-Llama-3-8B-Instruct's chat template (``packtools.testing.real_tokenizer``);
``--vocab bpe`` uses ``packtools.testing.tiny_tokenizer``'s byte-level BPE instead (no quicktok needed).

Packed with ``packtools.pack_files`` at each ``max_length``, three ways, from the same staged parts:

- ``bfd``: over-long conversations truncated (their ends dropped).
- ``bfd_split (tokens)``: ``split_at="tokens", drop_unlabeled=False``: cut every ``max_length`` tokens, every
  piece kept (what ``bfd_split`` did before the turn-aware split).
- ``bfd_split (turns)``: the default: cut where assistant turns end, the system prompt carried, pieces without
  a trained token dropped.

Columns: packed rows; tokens kept; trained (label) tokens kept (a sequence's first label is never trained: the
padding-free batch masks it); sequences without a trained token and the tokens in them (compute that trains
nothing); the share of pieces starting inside a turn (``turns_cut``: exchanges longer than a piece); compute
saved = 1 - rows / the fixed cut's rows (rows are the training steps' cost at a fixed row size).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time

SYSTEM = "You are a careful Python reviewer. Answer briefly and show code when it helps."
QUESTIONS = ["What does this code do?", "Can you find the bug here?", "Please review:", "Explain this:"]


def conversations(n: int, seed: int = 0) -> list[dict]:
    from packtools.pipeline.demo import stdlib_definitions

    pieces = [
        t for t in (p.decode("utf-8", "replace") for p in stdlib_definitions(400)) if 40 <= len(t) <= 6000
    ]
    rng = random.Random(seed)
    out = []
    for i in range(n):
        conv = [{"role": "system", "content": SYSTEM}] if i % 4 else []
        for _ in range(rng.randint(1, 6)):
            k = rng.randrange(len(pieces) - 4)
            code = "\n".join(pieces[k : k + rng.randint(1, 4)])
            conv.append({"role": "user", "content": f"{rng.choice(QUESTIONS)}\n```python\n{code}\n```"})
            conv.append({"role": "assistant", "content": rng.choice(pieces)[:800]})
        out.append({"messages": conv})
    return out


def tokenizer(workdir: str, vocab: str) -> str:
    if vocab == "bpe":
        from packtools.testing import CHATML_PLAIN, tiny_tokenizer

        return tiny_tokenizer(os.path.join(workdir, "tok"), CHATML_PLAIN)
    from packtools.testing import OFFICIAL_TEMPLATES, real_tokenizer  # quicktok-v1's rank files

    plain, _ = OFFICIAL_TEMPLATES["llama3-official"]
    return real_tokenizer("llama3", os.path.join(workdir, "tok-llama3"), chat_template=plain)


WAYS = {
    "bfd": {"strategy": "bfd"},
    "bfd_split (tokens)": {"strategy": "bfd_split", "split_at": "tokens", "drop_unlabeled": False},
    "bfd_split (turns)": {"strategy": "bfd_split"},
}


def main(argv: list[str] | None = None) -> int:
    import warnings

    from packtools._format import text_table
    from packtools.integrations.data.drops import TokensDroppedWarning
    from packtools.pipeline import pack_files

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--convs", type=int, default=2000)
    ap.add_argument("--lengths", default="512,1024,4096")
    ap.add_argument("--vocab", choices=("llama3", "bpe"), default="llama3")
    args = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="bench-chat-split-")
    try:
        tok = tokenizer(work, args.vocab)
        src = os.path.join(work, "chat.jsonl")
        with open(src, "w") as fh:
            for row in conversations(args.convs):
                fh.write(json.dumps(row) + "\n")
        warnings.simplefilter("ignore", TokensDroppedWarning)  # bfd's drops are the table's subject
        rows = []
        for m in [int(x) for x in args.lengths.split(",")]:
            base = None
            for name, opts in WAYS.items():
                t0 = time.perf_counter()
                s = pack_files(
                    src, os.path.join(work, f"out-{m}-{len(rows)}"), m, tokenizer=tok, **opts
                ).stats
                secs = time.perf_counter() - t0
                if name == "bfd_split (tokens)":
                    base = s["rows_out"]
                pieces = s.get("pieces", 0)
                rows.append(
                    [
                        f"{m:,}",
                        name,
                        f"{s['rows_out']:,}",
                        f"{s['tokens_kept']:,}",
                        f"{s['tokens_trained_kept']:,} / {s['tokens_trained_in']:,}",
                        f"{s['sequences_untrained']:,}",
                        f"{s['tokens_untrained'] / max(s['tokens_kept'], 1):.1%}",
                        f"{s.get('turns_cut', 0):,} of {pieces:,}" if "turns" in name else "-",
                        f"{1 - s['rows_out'] / base:.1%}" if base and name != "bfd" else "-",
                        f"{secs:.1f}",
                    ]
                )
        print(f"{args.convs:,} conversations, vocabulary {args.vocab}; tokens in: {s['tokens_in']:,}")
        print(
            text_table(
                [
                    [
                        "max_length",
                        "way",
                        "rows",
                        "tokens kept",
                        "trained kept / in",
                        "seqs training nothing",
                        "their tokens",
                        "pieces cut in a turn",
                        "compute saved",
                        "s",
                    ],
                    *rows,
                ]
            )
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
