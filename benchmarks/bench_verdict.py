"""What the run-wide engine verdict and the content checks cost: ``packtools pack`` of raw text, this tree beside
a baseline tree, in one run, alternating (issue 29).

Usage::

    git archive e50e36b | tar -x -C /tmp/base          # the tree to compare with
    python benchmarks/bench_verdict.py --baseline-tree /tmp/base --docs 20000 --repeat 3
    python benchmarks/bench_verdict.py --baseline-tree /tmp/base --profile-then-pack   # adoption from the cache
    python benchmarks/bench_verdict.py --baseline-tree /tmp/base --chat --docs 50000  # chat conversations
    python benchmarks/bench_verdict.py --baseline-tree /tmp/base --vocab llama3 --docs 650000   # 1 GB, Llama 3

Each case is a fresh ``python -m packtools.cli pack`` process (``PYTHONPATH`` = the tree), with its own empty
``$PACKTOOLS_STAGE_CACHE`` and a ``$PACKTOOLS_CACHE_DIR`` warmed by one run first (recorded verdicts, as in a
user's second run); the wall time of the whole process is taken, best of ``--repeat``, and the ratio
this/baseline printed.  Data: the demo's standard-library pieces as JSONL ``{"text": ...}``; the tokenizer a
byte-level BPE trained locally, or a real vocabulary with ``--vocab`` (``benchmarks/bench_tokenize.py``'s).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _data(folder: str, docs: int, kind: str = "text", vocab: str = "bpe32k") -> tuple[str, str]:
    sys.path.insert(0, os.path.join(HERE, "benchmarks"))
    sys.path.insert(0, HERE)
    import bench_tokenize as bt  # the same corpus and tokenizers as the tokenize benchmark

    made = bt.make_data(folder, docs, vocab)
    return made[kind], made["tokenizer"]


def _pack(tree: str, src: str, tok: str, out: str, env: dict[str, str], profile: bool) -> float:
    run_env = {**env, "PYTHONPATH": tree}
    if profile:
        subprocess.run([sys.executable, "-m", "packtools.cli", "profile", src, "--tokenizer", tok],
                       env=run_env, check=True, capture_output=True)  # fmt: skip
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "packtools.cli", "pack", src, "--tokenizer", tok, "--out", out,
         "--max-length", "2048", "--quiet"],
        env=run_env, check=True, capture_output=True,
    )  # fmt: skip
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline-tree", required=True)
    ap.add_argument("--docs", type=int, default=20_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--profile-then-pack", action="store_true", help="time pack after a profile (adoption)")
    ap.add_argument("--chat", action="store_true", help="chat rows (messages) instead of raw text")
    ap.add_argument(
        "--vocab", default="bpe32k", help="bench_tokenize.py's vocabularies: bpe32k, llama3, qwen3, ..."
    )
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="bench-verdict-")
    try:
        src, tok = _data(work, args.docs, "chat" if args.chat else "text", args.vocab)
        size = os.path.getsize(src) / 1e6
        trees = {"this": HERE, "baseline": os.path.abspath(args.baseline_tree)}
        best = {name: float("inf") for name in trees}
        for name, tree in trees.items():  # warm each tree's verdict caches once
            env = {**os.environ, "PACKTOOLS_CACHE_DIR": os.path.join(work, f"cache-{name}")}
            env["PACKTOOLS_STAGE_CACHE"] = os.path.join(work, f"warm-stage-{name}")
            _pack(tree, src, tok, os.path.join(work, f"warm-{name}"), env, False)
        for i in range(args.repeat):
            for name, tree in trees.items():
                env = {**os.environ, "PACKTOOLS_CACHE_DIR": os.path.join(work, f"cache-{name}")}
                env["PACKTOOLS_STAGE_CACHE"] = os.path.join(work, f"stage-{name}-{i}")
                out = os.path.join(work, f"out-{name}-{i}")
                best[name] = min(best[name], _pack(tree, src, tok, out, env, args.profile_then_pack))
        case = "profile, then pack (timed)" if args.profile_then_pack else "pack"
        case += " (chat)" if args.chat else " (raw text)"
        print(f"{case}: {args.docs:,} rows, {size:.1f} MB of JSONL, best of {args.repeat}")
        print(json.dumps({k: round(v, 3) for k, v in best.items()}))
        print(f"this / baseline: {best['this'] / best['baseline']:.3f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
