"""Profiling lengths vs reading the token column: time and peak memory, side by side.

Usage::

    python benchmarks/bench_profile.py                      # 10M rows, files under bench_out/
    python benchmarks/bench_profile.py --rows 1000000 --repeat 2
    python benchmarks/bench_profile.py --keep               # keep the generated files for the next run

Writes a synthetic dataset once (``--rows`` rows, lognormal lengths with mean ~15 tokens, random int32 token
ids in ``input_ids``) as parquet (snappy, 1M-row row groups) and as an uncompressed Arrow IPC file, then runs
each case in a fresh subprocess (so peak RSS is the case's own): first once untimed (warm-up: imports, Numba
cache, page cache), then ``--repeat`` times, and prints the median wall time and the peak RSS.  Each case is
timed twice: ``warm`` with the file in the page cache, and ``cold`` after evicting the file's pages from the
cache with ``posix_fadvise(DONTNEED)`` (only this benchmark's files; nothing else is dropped), as on a first
run over a large dataset.

Cases, for each format:
- ``read column``: the baseline, read the whole ``input_ids`` column (values included), then
  ``LengthProfile(lengths)`` (so both cases end with the same profile).
- ``profile_lengths``: ``packtools.profile_lengths(path)``.
On the Arrow file, ``+ tradeoffs`` also runs ``LengthProfile.tradeoffs`` for 4 candidates (12 plans).

``--stage`` measures instead what ``packtools profile --tokenizer`` saves the following ``pack``: raw text
(``--rows`` JSON lines, lognormal word counts) and a byte-level BPE trained offline; each step in a fresh
process: ``pack`` alone (empty stage cache), then ``profile`` (which stages into the cache) and ``pack`` again
(same inputs and tokenizer, into another ``--out``).  Prints each step's stage seconds and whole time, how many
parts pack took from the cache, and checks that both packs wrote the same bytes::

    python benchmarks/bench_profile.py --stage --rows 200000
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

CANDIDATES = [16, 32, 64, 128]


def make_files(rows: int, directory: str) -> tuple[str, str]:
    os.makedirs(directory, exist_ok=True)
    pq_path = os.path.join(directory, f"profile_{rows}.parquet")
    ipc_path = os.path.join(directory, f"profile_{rows}.arrow")
    if os.path.exists(pq_path) and os.path.exists(ipc_path):
        return pq_path, ipc_path
    rng = np.random.default_rng(0)
    schema = pa.schema([("input_ids", pa.list_(pa.int32()))])
    step = 1_000_000
    start = time.perf_counter()
    with (
        pq.ParquetWriter(pq_path + ".tmp", schema) as pw,
        pa.OSFile(ipc_path + ".tmp", "wb") as sink,
        pa.ipc.new_file(sink, schema) as iw,
    ):
        for lo in range(0, rows, step):
            n = min(step, rows - lo)
            lens = np.clip(rng.lognormal(2.5, 0.6, n), 0, 512).astype(np.int64)
            offsets = np.concatenate(([0], np.cumsum(lens))).astype(np.int32)
            values = rng.integers(0, 32000, int(offsets[-1]), dtype=np.int32)
            table = pa.table({"input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))})
            pw.write_table(table, row_group_size=step)
            iw.write_table(table, max_chunksize=step)
    os.replace(pq_path + ".tmp", pq_path)
    os.replace(ipc_path + ".tmp", ipc_path)
    print(
        f"wrote {rows:,} rows in {time.perf_counter() - start:.1f} s: {pq_path} "
        f"({os.path.getsize(pq_path) / 2**20:,.0f} MiB), {ipc_path} ({os.path.getsize(ipc_path) / 2**20:,.0f} MiB)"
    )
    return pq_path, ipc_path


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mib() -> float:
    """This process's peak RSS (VmHWM; ru_maxrss would also count the parent's, inherited through exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def evict(path: str) -> None:
    """Drop this file's pages from the page cache (after flushing them), nothing else."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run_case(case: str, path: str, cold: bool) -> dict:
    """Runs inside the subprocess."""
    import pyarrow.parquet  # noqa: F401  (both cases need it; imported before the baseline RSS)

    from packtools import profile_lengths
    from packtools.core.arrow import column_lengths
    from packtools.profiling import LengthProfile

    if cold:
        evict(path)
    base = rss_mib()
    start = time.perf_counter()
    if case == "read column":
        if path.endswith(".parquet"):
            table = pq.read_table(path, columns=["input_ids"])
        else:
            with pa.OSFile(path, "rb") as f:  # a plain read: every byte of the column comes into memory
                table = pa.ipc.open_file(f).read_all()
        total = LengthProfile(column_lengths(table.column("input_ids"))).total_tokens
    elif case == "profile_lengths":
        total = profile_lengths(path).total_tokens
    elif case == "+ tradeoffs":
        p = profile_lengths(path)
        p.tradeoffs(CANDIDATES)
        total = p.total_tokens
    else:
        raise SystemExit(f"unknown case {case!r}")
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "peak_mib": peak_rss_mib(), "after_imports_mib": base, "tokens": total}


def measure(case: str, path: str, repeat: int, cold: bool) -> dict:
    runs = []
    for i in range(repeat + 1):
        cmd = [sys.executable, __file__, "--case", case, "--path", path] + (["--cold"] if cold else [])
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        if i:  # the first run is the warm-up
            runs.append(json.loads(out.strip().splitlines()[-1]))
    return {
        "seconds": statistics.median(r["seconds"] for r in runs),
        "peak_mib": max(r["peak_mib"] for r in runs),
        "after_imports_mib": min(r["after_imports_mib"] for r in runs),
        "tokens": runs[0]["tokens"],
    }


STAGE_STEP = """
import json, sys, time
t0 = time.perf_counter()
step, data, tok, out = sys.argv[1:5]
if step == "profile":
    from packtools.pipeline.profile import profile_files
    res = profile_files(data, tok)
    print(json.dumps({"stage_s": res.stage["stage_s"], "time_s": time.perf_counter() - t0,
                      "from_cache": res.stage["reused"], "parts": res.stage["parts"]}))
else:
    from packtools import pack_files
    res = pack_files(data, out, 1024, "bfd_split", tokenizer=tok)
    print(json.dumps({"stage_s": res.timings["stage_s"], "time_s": time.perf_counter() - t0,
                      "from_cache": res.timings["parts_from_stage_cache"], "parts": res.timings["parts"]}))
"""


def stage_bench(rows: int, folder: str) -> None:
    """``pack`` alone vs ``profile`` then ``pack`` (see the module docstring)."""
    import filecmp
    import shutil

    from packtools.testing import TOKENIZER_CORPUS, tiny_tokenizer

    os.makedirs(folder, exist_ok=True)
    tok = tiny_tokenizer(os.path.join(folder, "tok"))
    data = os.path.join(folder, f"text-{rows}.jsonl")
    if not os.path.exists(data):
        rng = np.random.default_rng(0)
        words = np.array(" ".join(TOKENIZER_CORPUS).split())
        with open(data, "w") as fh:
            for _ in range(rows):
                fh.write(
                    json.dumps({"text": " ".join(rng.choice(words, int(rng.lognormal(3.5, 1.0)) + 1))}) + "\n"
                )
    cache = os.path.join(folder, "stage-cache")
    for d in (cache, os.path.join(folder, "out-a"), os.path.join(folder, "out-b")):
        shutil.rmtree(d, ignore_errors=True)
    env = {**os.environ, "PACKTOOLS_STAGE_CACHE": cache}

    def step(name: str, out: str) -> dict:
        cmd = [sys.executable, "-c", STAGE_STEP, name, data, tok, os.path.join(folder, out)]
        return json.loads(subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout)

    alone = step("pack", "out-a")
    prof = step("profile", "")
    after = step("pack", "out-b")
    print(
        f"{rows:,} texts ({os.path.getsize(data) / 1e6:.1f} MB JSON lines), BPE vocab 400, each step a fresh process"
    )
    print(f"{'step':<28} {'stage (s)':>9} {'whole (s)':>9} {'parts from cache':>17}")
    for name, r in (("pack alone", alone), ("profile --tokenizer", prof), ("pack after profile", after)):
        print(f"{name:<28} {r['stage_s']:>9.2f} {r['time_s']:>9.2f} {r['from_cache']:>10} of {r['parts']}")
    a, b = os.path.join(folder, "out-a"), os.path.join(folder, "out-b")
    same = all(
        filecmp.cmp(os.path.join(a, n), os.path.join(b, n), shallow=False)
        for n in os.listdir(a)
        if n != "manifest.json"
    )
    print(
        f"pack's stage after profile / alone: {after['stage_s'] / alone['stage_s']:.3f}x; profile + pack / pack "
        f"alone (whole): {(prof['time_s'] + after['time_s']) / alone['time_s']:.2f}x; same output bytes: {same}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--dir", default="bench_out")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--keep", action="store_true", help="keep the generated files")
    ap.add_argument("--stage", action="store_true", help="profile --tokenizer then pack: the stage reused")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--cold", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.stage:
        stage_bench(args.rows, args.dir)
        return
    if args.case:
        print(json.dumps(run_case(args.case, args.path, args.cold)))
        return
    pq_path, ipc_path = make_files(args.rows, args.dir)
    print(f"{args.rows:,} rows; median of {args.repeat} runs after a warm-up, each in a fresh process")
    header = (
        f"{'file':<8} {'cache':<5} {'case':<17} {'time (s)':>9} {'peak RSS (MiB)':>15} "
        f"{'RSS over imports':>17} {'time ratio':>11}"
    )
    print(header)
    print("-" * len(header))
    tokens = set()
    for label, path, cases in (
        ("parquet", pq_path, ["read column", "profile_lengths"]),
        ("arrow", ipc_path, ["read column", "profile_lengths", "+ tradeoffs"]),
    ):
        for cold in (False, True):
            results = {
                case: measure(case, path, args.repeat, cold) for case in cases if not (cold and "+" in case)
            }
            base = results["read column"]["seconds"]
            tokens |= {r["tokens"] for r in results.values()}
            assert len(tokens) == 1, f"cases disagree on the token count: {tokens}"
            for case, r in results.items():
                print(
                    f"{label:<8} {'cold' if cold else 'warm':<5} {case:<17} {r['seconds']:>9.3f} "
                    f"{r['peak_mib']:>15,.0f} {r['peak_mib'] - r['after_imports_mib']:>17,.0f} "
                    f"{r['seconds'] / base:>10.3f}x"
                )
    print(f"tokens: {tokens.pop():,}; tradeoffs: {len(CANDIDATES)} candidates x 3 strategies")
    if not args.keep:
        for p in (pq_path, ipc_path):
            os.unlink(p)


if __name__ == "__main__":
    main()
