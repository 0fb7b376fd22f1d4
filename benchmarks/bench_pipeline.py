"""The file-packing engine: peak memory on a large JSON-lines input (parquet beside it), and the tokenize stage
with 1 and 2 workers.

Usage::

    python benchmarks/bench_pipeline.py                           # full run: >= 1 GB of tokenized JSONL
    python benchmarks/bench_pipeline.py --json-gb 0.2 --tok-rows 20000   # a quick check
    python benchmarks/bench_pipeline.py --skip-json | --skip-tokenize --markdown out.md

(a) **Memory, JSON lines vs parquet.**  ``--json-gb`` GB of tokenized JSON lines (``{"input_ids": [...],
"labels": [...]}``; lengths ``max(1, floor(x))``, ``x ~ lognormal(5.5, 1.0)``, ids uniform in ``[0, 32000)``,
labels = ids with the first half of each row -100, seed 0), and the same rows as one parquet file (row
groups of 65,536).  Each is packed by ``packtools.pack_files(src, out, 4096, "bfd")`` in a fresh subprocess
that reports its own peak RSS (``ru_maxrss``: interpreter, imports and Numba included) and the run's stage
timings.  Target: the JSON run under 1 GiB peak RSS (before this engine JSON was parsed whole, twice).

(b) **Tokenize stage, 1 vs 2 workers.**  The standard library's definitions (the demo corpus; ``--tok-rows``
pieces) as raw ``text`` in ``--tok-files`` parquet files, tokenized by a byte-level BPE (vocab 8,000) trained
here and saved as a transformers folder, packed with ``executor="pool"`` and ``workers=1`` then ``2`` (each
case in a fresh subprocess, interleaved over ``--repeat`` rounds, best kept).  Reported: the stage time
(read + tokenize + write the staged part), its ratio 1 worker / 2 workers, and that both outputs are the same
bytes.  The machine has 2 cores shared with other work; the ratio cannot reach 2: the driver process, the
pool's start-up and the parts' uneven sizes take their share.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import time

import numpy as np
from _common import print_report, work_folder

VOCAB = 32000
TARGET_JSON_RSS_GIB = 1.0


def make_json_and_parquet(folder: str, gigabytes: float, seed: int = 0) -> tuple[str, str, int]:
    """Write ``tokens.jsonl`` (about ``gigabytes`` GB) and the same rows as ``tokens.parquet``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl, parquet = os.path.join(folder, "tokens.jsonl"), os.path.join(folder, "tokens.parquet")
    rng, vals = np.random.default_rng(seed), np.random.default_rng(seed + 1)
    schema = pa.schema([("input_ids", pa.list_(pa.int32())), ("labels", pa.list_(pa.int32()))])
    rows, target = 0, int(gigabytes * 1e9)
    with open(jsonl, "w") as fh, pq.ParquetWriter(parquet, schema) as writer:
        while fh.tell() < target:
            lengths = np.maximum(1, np.floor(rng.lognormal(5.5, 1.0, 8192))).astype(np.int64)
            offsets = np.concatenate(([0], np.cumsum(lengths)))
            ids = vals.integers(0, VOCAB, int(offsets[-1]), dtype=np.int32)
            labels = ids.copy()
            for r in range(len(lengths)):
                labels[offsets[r] : offsets[r] + lengths[r] // 2] = -100
            lines = []
            for r in range(len(lengths)):
                a, b = offsets[r], offsets[r + 1]
                lines.append(
                    '{"input_ids": ['
                    + ",".join(map(str, ids[a:b].tolist()))
                    + '], "labels": ['
                    + ",".join(map(str, labels[a:b].tolist()))
                    + "]}\n"
                )
            fh.write("".join(lines))
            lists = [
                pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(v))
                for v in (ids, labels)
            ]
            writer.write_table(pa.Table.from_arrays(lists, schema=schema), row_group_size=65536)
            rows += len(lengths)
    return jsonl, parquet, rows


def case_pack(src: str, out: str, executor: str, workers: str, tokenizer: str) -> dict:
    import packtools
    import packtools.core  # the lazy front door does not import it

    packtools.core.warmup()
    kwargs = {"executor": executor, "workers": int(workers) if workers != "-" else None}
    if tokenizer != "-":
        kwargs["tokenizer"] = tokenizer
    t = time.perf_counter()
    res = packtools.pack_files(src.split(","), out, 4096, "bfd", **kwargs)
    return {"time": time.perf_counter() - t, "stats": res.stats, "timings": res.timings}


def run_case(*args: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--case", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"case failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def folder_digest(folder: str) -> str:
    """SHA-256 over the data shards (the manifest names the inputs, so it differs between inputs)."""
    h = hashlib.sha256()
    for name in sorted(n for n in os.listdir(folder) if n.startswith("data-")):
        h.update(name.encode())
        with open(os.path.join(folder, name), "rb") as fh:
            for block in iter(lambda: fh.read(1 << 24), b""):
                h.update(block)
    return h.hexdigest()


def build_tokenizer(texts: list[str], path: str) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=8000,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(path)
    return path


def bench_json(workdir: str, gigabytes: float) -> list[str]:
    t = time.perf_counter()
    jsonl, parquet, rows = make_json_and_parquet(workdir, gigabytes)
    sizes = {p: os.path.getsize(p) / 1e9 for p in (jsonl, parquet)}
    print(
        f"wrote {rows:,} rows: {sizes[jsonl]:.2f} GB JSONL, {sizes[parquet]:.2f} GB parquet "
        f"in {time.perf_counter() - t:.0f} s",
        flush=True,
    )
    res = {}
    for name, src in (("JSON lines", jsonl), ("parquet", parquet)):
        out = os.path.join(workdir, "out-" + name.split()[0].lower())
        shutil.rmtree(out, ignore_errors=True)
        res[name] = run_case(src, out, "local", "-", "-")
        res[name]["digest"] = folder_digest(out)
        shutil.rmtree(out)
        print(name, json.dumps({k: v for k, v in res[name].items() if k != "stats"}), flush=True)
    same = res["JSON lines"]["digest"] == res["parquet"]["digest"]
    lines = [
        f"### Peak memory: {rows:,} tokenized rows ({res['parquet']['stats']['tokens_in']:,} tokens), "
        f"max_length 4096, bfd, local executor",
        "",
        "| input | size (GB) | time (s) | stage (s) | write (s) | peak RSS (GiB) | rows out |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, src in (("JSON lines", jsonl), ("parquet", parquet)):
        r = res[name]
        lines.append(
            f"| {name} | {sizes[src]:.2f} | {r['time']:.1f} | {r['timings']['stage_s']:.1f} | "
            f"{r['timings']['write_s']:.1f} | {r['maxrss_gb']:.2f} | {r['stats']['rows_out']:,} |"
        )
    rss = res["JSON lines"]["maxrss_gb"]
    lines += [
        "",
        f"JSON lines peak RSS {rss:.2f} GiB (target < {TARGET_JSON_RSS_GIB} GiB: "
        f"{'met' if rss < TARGET_JSON_RSS_GIB else 'NOT met'}); data shards identical bytes: {same}.",
    ]
    return lines


def bench_tokenize(workdir: str, rows: int, files: int, repeat: int) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from packtools.pipeline.demo import stdlib_definitions

    pieces = [t.decode("utf-8", errors="replace") for t in stdlib_definitions()]
    texts = [pieces[i % len(pieces)] for i in range(rows)]
    tok_dir = build_tokenizer(pieces[::10], os.path.join(workdir, "tokenizer"))
    srcs = []
    for i in range(files):
        srcs.append(os.path.join(workdir, f"texts-{i}.parquet"))
        pq.write_table(pa.table({"text": texts[i::files]}), srcs[-1])
    mb = sum(len(t.encode()) for t in texts) / 1e6
    best: dict[int, dict] = {}
    digests = {}
    for _ in range(repeat):
        for w in (1, 2):
            out = os.path.join(workdir, f"tok-{w}")
            shutil.rmtree(out, ignore_errors=True)
            r = run_case(",".join(srcs), out, "pool", str(w), tok_dir)
            digests[w] = folder_digest(out)
            if w not in best or r["timings"]["stage_s"] < best[w]["timings"]["stage_s"]:
                best[w] = r
            print(f"workers={w}: stage {r['timings']['stage_s']:.2f} s, total {r['time']:.2f} s", flush=True)
    ratio = best[1]["timings"]["stage_s"] / best[2]["timings"]["stage_s"]
    lines = [
        f"### Tokenize stage: {rows:,} texts ({mb:.0f} MB) in {files} parquet files, BPE vocab 8,000, "
        f"executor pool, best of {repeat}",
        "",
        "| workers | stage (s) | MB/s | whole run (s) | tokens |",
        "|---|---|---|---|---|",
    ]
    for w in (1, 2):
        r = best[w]
        lines.append(
            f"| {w} | {r['timings']['stage_s']:.2f} | {mb / r['timings']['stage_s']:.1f} | {r['time']:.2f} | "
            f"{r['stats']['tokens_in']:,} |"
        )
    lines += [
        "",
        f"stage time 1 worker / 2 workers: {ratio:.2f}x; outputs identical bytes: {digests[1] == digests[2]}.",
    ]
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json-gb", type=float, default=1.05)
    ap.add_argument("--tok-rows", type=int, default=200_000)
    ap.add_argument("--tok-files", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--workdir", help="where to put the data (default: a temporary folder, removed after)")
    ap.add_argument("--skip-json", action="store_true")
    ap.add_argument("--skip-tokenize", action="store_true")
    ap.add_argument("--markdown", help="also write the tables to this file")
    ap.add_argument("--case", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        result = case_pack(*args.case)
        result["maxrss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30
        print(json.dumps(result))
        return 0
    lines: list[str] = []
    with work_folder(args.workdir, "packtools-bench-pipeline-") as workdir:
        if not args.skip_json:
            lines += bench_json(workdir, args.json_gb) + [""]
        if not args.skip_tokenize:
            lines += bench_tokenize(workdir, args.tok_rows, args.tok_files, args.repeat)
    print_report("\n".join(lines), args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
