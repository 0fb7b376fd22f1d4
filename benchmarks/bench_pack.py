"""Packing speed, memory and row count: packtools against ``trl.pack_dataset``, side by side, in one run.

Usage::

    python benchmarks/bench_pack.py                              # the full run: 1M rows, max_length 4096
    python benchmarks/bench_pack.py --rows 20000                 # a quick check
    python benchmarks/bench_pack.py --skip-trl --strategies bfd  # packtools only, one strategy
    python benchmarks/bench_pack.py --source memory,disk --markdown bench.md --json bench.json

Input: ``--rows`` sequence lengths ``max(1, floor(x))`` with ``x ~ lognormal(mean=5.5, sigma=1.0)`` drawn by
``numpy.random.default_rng(--seed)`` (seed 0 by default; mean ~403 tokens, ~400M tokens for 1M rows), tokens
drawn by ``default_rng(--seed + 1)`` as int32 in ``[0, 32000)``, in one ``input_ids`` ``list<int32>`` column.
``--order``: ``shuffled`` keeps the drawn (random) order, ``sorted`` sorts the lengths ascending.
``--source``: ``memory`` wraps the Arrow table (one chunk) in an in-memory ``datasets.Dataset``; ``disk`` saves
that dataset once with ``save_to_disk`` and every case opens it with ``load_from_disk`` (memory-mapped, 4 files
of 1000-row record batches, what users get from ``map``/``load_dataset``; page cache warm).

Cases, each in its own fresh subprocess (``--case``), so that peak RSS (``ru_maxrss`` of that process, read at its
end) belongs to one case only.  The peak includes the interpreter, the imports and the input itself; ``input``
is the process RSS just before the timed call (input built, warm-ups done), printed next to it:

- ``packtools``: ``packtools.pack_dataset(ds, max_length, strategy)`` end to end (after ``packtools.core.warmup()``
  and a tiny pack to load Numba's on-disk cache and the lazy imports).
- ``trl``: ``trl.pack_dataset(ds, max_length, strategy)`` on the same dataset (after a tiny warm-up pack).
  On the ``disk`` source ``datasets`` caching is disabled in that process so no earlier result is reused; its
  ``map`` then writes the packed rows to a temporary Arrow file, as it does for any on-disk dataset.
- ``plan``: ``packtools.plan(lengths, max_length, strategy)`` on the lengths alone.
- ``memcpy``: ``numpy.copy`` of the token buffer (of each chunk's, for ``disk``), the physical floor for moving
  the tokens; on ``disk`` its first call, like the packers', also maps the file's pages in.

Progress bars of ``datasets`` are disabled everywhere.  Each case process makes ``--repeat`` (default 2) timed
calls; the tables give the first (what a one-off run sees, including the page faults of a fresh output buffer)
and the best.  Peak RSS covers all calls of the process.

Before the cases, fresh processes time ``import packtools`` (and check that it compiles and imports nothing
heavy), ``packtools.core.warmup()`` with an empty Numba cache and with the project's on-disk one, and two runs of
``python -m packtools.cli pack --max-length 2048`` (built-in sample) sharing a fresh ``NUMBA_CACHE_DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np
from _common import print_report, run_case_process, work_folder

STRATEGIES = ("bfd", "bfd_split", "wrapped")
VOCAB = 32000
TARGET_SPEEDUP = 20.0
TARGET_COPY_RATIO = 5.0
TARGET_RSS_RATIO = 0.5
TARGET_PLAN_S = 0.5
TARGET_ROWS_RATIO = 1.0001


# ---------------------------------------------------------------------------------------------------------
# Input
# ---------------------------------------------------------------------------------------------------------
def make_lengths(rows: int, seed: int, order: str) -> np.ndarray:
    """``max(1, floor(lognormal(5.5, 1.0)))`` per row; ``sorted`` sorts them ascending."""
    lengths = np.maximum(1, np.random.default_rng(seed).lognormal(5.5, 1.0, rows).astype(np.int64))
    return np.sort(lengths) if order == "sorted" else lengths


def make_table(lengths: np.ndarray, seed: int):
    import pyarrow as pa

    total = int(lengths.sum())
    values = np.random.default_rng(seed + 1).integers(0, VOCAB, total, dtype=np.int32)
    offsets = np.zeros(lengths.shape[0] + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if total > 2**31 - 1:
        arr = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values))
    else:
        arr = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values))
    return pa.table({"input_ids": arr})


def lower_bound(lengths: np.ndarray, max_length: int, strategy: str) -> tuple[int, int]:
    """Tokens kept by ``strategy`` and the fewest rows that can hold them, from the lengths alone."""
    kept = int(np.minimum(lengths, max_length).sum()) if strategy == "bfd" else int(lengths.sum())
    return kept, -(-kept // max_length)


def rss_now() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def rss_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


# ---------------------------------------------------------------------------------------------------------
# One case, in its own process
# ---------------------------------------------------------------------------------------------------------
def load_dataset_for(case: dict):
    import datasets

    if case["source"] == "disk":
        return datasets.load_from_disk(case["path"])
    return in_memory_dataset(make_lengths(case["rows"], case["seed"], case["order"]), case["seed"])


def in_memory_dataset(lengths: np.ndarray, seed: int):
    """An in-memory ``datasets.Dataset`` over the table; a random fingerprint spares hashing every token."""
    import datasets
    from datasets.fingerprint import generate_random_fingerprint

    return datasets.Dataset(make_table(lengths, seed), fingerprint=generate_random_fingerprint())


def count_tokens(ds) -> int:
    import pyarrow.compute as pc

    col = ds.data.table.column("input_ids")
    return int(pc.sum(pc.list_value_length(col)).as_py() or 0)


def run_case(case: dict) -> dict:
    kind, strategy, max_length = case["kind"], case["strategy"], case["max_length"]
    lengths = make_lengths(case["rows"], case["seed"], case["order"])
    kept, bound = lower_bound(lengths, max_length, strategy or "bfd_split")
    result: dict = {"lower_bound": bound, "tokens_expected": kept}
    times = []
    if kind == "plan":
        import packtools.core

        packtools.core.warmup()
        result["rss_input"] = rss_now()
        for _ in range(case["repeat"]):
            t = time.perf_counter()
            p = packtools.plan(lengths, max_length, strategy)
            times.append(time.perf_counter() - t)
            result.update(rows=p.num_rows, tokens_out=p.tokens_kept)
            del p
    elif kind == "memcpy":
        ds = load_dataset_for(case)
        col = ds.data.table.column("input_ids")
        bufs = [
            c.values.slice(c.offsets[0].as_py(), c.offsets[-1].as_py() - c.offsets[0].as_py())
            for c in col.chunks
        ]
        views = [b.to_numpy(zero_copy_only=True) for b in bufs]
        result["rss_input"] = rss_now()
        for _ in range(case["repeat"]):
            t = time.perf_counter()
            copies = [np.copy(v) for v in views]
            times.append(time.perf_counter() - t)
            result["tokens_out"] = sum(c.shape[0] for c in copies)
            del copies
        result["rows"] = None
    else:
        import datasets

        datasets.disable_progress_bars()
        ds = load_dataset_for(case)
        tiny = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4], [5, 6]]})
        if case["source"] == "disk":
            # No reuse of earlier results on either side: every timed call packs from scratch.
            datasets.disable_caching()
        if kind == "packtools":
            import packtools.core

            packtools.core.warmup()
            packtools.pack_dataset(tiny, 4, strategy)
            fn = packtools.pack_dataset
        else:
            import trl

            trl.pack_dataset(tiny, 4, strategy)
            fn = trl.pack_dataset
        result["rss_input"] = rss_now()
        for _ in range(case["repeat"]):
            t = time.perf_counter()
            out = fn(ds, max_length, strategy)
            times.append(time.perf_counter() - t)
            result.update(rows=len(out), tokens_out=count_tokens(out))
            del out
    result["time"], result["first"], result["times"] = min(times), times[0], times
    result["peak_rss"] = rss_peak()
    result["load"] = os.getloadavg()[0]  # other jobs share the CPUs; 1-minute load average at the end
    return result


def build_disk(case: dict) -> None:
    import datasets

    datasets.disable_progress_bars()
    lengths = make_lengths(case["rows"], case["seed"], case["order"])
    in_memory_dataset(lengths, case["seed"]).save_to_disk(case["path"])


# ---------------------------------------------------------------------------------------------------------
# Compile cost and import checks, in fresh processes
# ---------------------------------------------------------------------------------------------------------
IMPORT_PROBE = """
import json, os, sys, time
t = time.perf_counter()
import packtools
dt = time.perf_counter() - t
from packtools.core import kernels as _kernels  # imported after the timing: import packtools stays lazy
from numba.core.registry import CPUDispatcher
compiled = [n for n, f in vars(_kernels).items() if isinstance(f, CPUDispatcher) and f.signatures]
heavy = [m for m in ("torch", "datasets", "transformers", "matplotlib", "ray") if m in sys.modules]
cache = os.environ.get("NUMBA_CACHE_DIR")
files = sum(len(fs) for _, _, fs in os.walk(cache)) if cache else None
print("RESULT " + json.dumps({"time": dt, "compiled": compiled, "heavy": heavy, "cache_files": files}))
"""

WARMUP_PROBE = """
import json, time
import packtools.core
t = time.perf_counter()
packtools.core.warmup()
print("RESULT " + json.dumps({"time": time.perf_counter() - t}))
"""


def _probe(code: str, env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return json.loads([ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])


def compile_checks() -> list[tuple[str, str]]:
    rows = []
    base = dict(os.environ)
    base.pop("NUMBA_CACHE_DIR", None)
    with tempfile.TemporaryDirectory(prefix="packtools-numba-") as cache:
        fresh = {**base, "NUMBA_CACHE_DIR": cache}
        imp = _probe(IMPORT_PROBE, fresh)
        rows.append(
            (
                "`import packtools` (fresh process, empty Numba cache)",
                f"{imp['time']:.3f} s; kernels compiled: {imp['compiled'] or 'none'}; cache files written: "
                f"{imp['cache_files']}; heavy modules imported: {imp['heavy'] or 'none'}",
            )
        )
        w = _probe(WARMUP_PROBE, fresh)
        rows.append(("`packtools.core.warmup()`, empty Numba cache (compiles)", f"{w['time']:.2f} s"))
    w = _probe(WARMUP_PROBE, base)
    rows.append(("`packtools.core.warmup()`, project's on-disk cache (loads)", f"{w['time']:.2f} s"))
    with tempfile.TemporaryDirectory(prefix="packtools-numba-") as cache:
        env = {**base, "NUMBA_CACHE_DIR": cache}
        cmd = [sys.executable, "-m", "packtools.cli", "pack", "--max-length", "2048"]
        for label in ("first (empty cache)", "second (cache reused)"):
            t = time.perf_counter()
            subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
            rows.append(
                (
                    f"`python -m packtools.cli pack --max-length 2048`, {label}",
                    f"{time.perf_counter() - t:.2f} s",
                )
            )
    return rows


# ---------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------
def gb(x: int | None) -> str:
    return "-" if x is None else f"{x / 2**30:.2f}"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _verdict(label: str, values: dict[str, float], ok, fmt: str) -> str:
    parts = [f"{k} {format(v, fmt)} ({'MET' if ok(v) else 'MISSED'})" for k, v in values.items()]
    return f"{label}: " + ", ".join(parts)


def report(results: list[dict], args: argparse.Namespace) -> tuple[str, list[str]]:
    def find(kind, order, source, strategy):
        for r in results:
            same = (r["kind"], r["order"], r["strategy"]) == (kind, order, strategy)
            if same and r.get("source") in (source, None):
                return r
        return None

    header = ["order", "source", "strategy", "case", "first s", "best s", "peak RSS GiB", "input RSS GiB"]
    header += ["rows", "rows over LB", "rows / LB", "load"]
    rows = []
    for r in results:
        counted = r.get("rows") is not None
        rows.append(
            [r["order"], r.get("source") or "-", r["strategy"] or "-", r["kind"], f"{r['first']:.3f}"]
            + [f"{r['time']:.3f}", gb(r["peak_rss"]), gb(r["rss_input"])]
            + [f"{r['rows']:,}" if counted else "-", f"{r['rows'] - r['lower_bound']:,}" if counted else "-"]
            + [f"{r['rows'] / r['lower_bound']:.5f}" if counted else "-", f"{r['load']:.1f}"]
        )
    table = markdown_table(header, rows)

    rheader = ["order", "source", "strategy", "TRL / packtools time (first, best)"]
    rheader += ["packtools / memcpy time (first, best)", "packtools / TRL peak RSS", "plan s (best)"]
    rrows, verdicts = [], []
    for order in args.order:
        for source in args.source:
            mem = find("memcpy", order, source, None)
            for strategy in args.strategies:
                pt, trl_r, pl = (find(k, order, source, strategy) for k in ("packtools", "trl", "plan"))
                if pt is None:
                    continue
                tag = f"{order}/{source}/{strategy}"
                speed = {k: trl_r[k] / pt[k] for k in ("first", "time")} if trl_r else None
                copy = {k: pt[k] / mem[k] for k in ("first", "time")} if mem else None
                rss = pt["peak_rss"] / trl_r["peak_rss"] if trl_r else None
                rrows.append(
                    [order, source, strategy]
                    + ["-" if speed is None else f"{speed['first']:.1f}x, {speed['time']:.1f}x"]
                    + ["-" if copy is None else f"{copy['first']:.2f}x, {copy['time']:.2f}x"]
                    + ["-" if rss is None else f"{rss:.2f}", "-" if pl is None else f"{pl['time']:.3f}"]
                )
                named = lambda d: {"first call": d["first"], "best": d["time"]}  # noqa: E731
                if strategy == "bfd" and speed is not None:
                    verdicts.append(
                        _verdict(
                            f"{tag} >= {TARGET_SPEEDUP:g}x faster than TRL",
                            named(speed),
                            lambda v: v >= TARGET_SPEEDUP,
                            ".1f",
                        )
                    )
                    verdicts.append(
                        _verdict(
                            f"{tag} peak RSS <= {TARGET_RSS_RATIO:g} x TRL's",
                            {"ratio": rss},
                            lambda v: v <= TARGET_RSS_RATIO,
                            ".2f",
                        )
                    )
                if strategy == "bfd" and copy is not None:
                    verdicts.append(
                        _verdict(
                            f"{tag} within {TARGET_COPY_RATIO:g}x of memcpy",
                            named(copy),
                            lambda v: v <= TARGET_COPY_RATIO,
                            ".2f",
                        )
                    )
                if pl is not None and args.rows >= 1_000_000 and source == args.source[0]:
                    verdicts.append(
                        _verdict(
                            f"{order}/{strategy} plan on {args.rows:,} lengths < {TARGET_PLAN_S:g} s",
                            {"first call": pl["first"], "best": pl["time"]},
                            lambda v: v < TARGET_PLAN_S,
                            ".3f",
                        )
                    )
                if strategy != "wrapped":
                    verdicts.append(
                        _verdict(
                            f"{tag} rows <= {TARGET_ROWS_RATIO} x lower bound "
                            f"({pt['rows'] - pt['lower_bound']} over)",
                            {"rows / LB": pt["rows"] / pt["lower_bound"]},
                            lambda v: v <= TARGET_ROWS_RATIO,
                            ".6f",
                        )
                    )
    return table + "\n\n" + markdown_table(rheader, rrows), verdicts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--max-length", type=int, default=4096)
    parser.add_argument(
        "--strategies", default=",".join(STRATEGIES), help="comma-separated (default: all three)"
    )
    parser.add_argument("--order", default="shuffled,sorted", help="comma-separated: shuffled, sorted")
    parser.add_argument(
        "--source",
        default="memory",
        help="comma-separated: memory (in-memory Dataset), disk (load_from_disk)",
    )
    parser.add_argument("--skip-trl", action="store_true", help="do not run trl.pack_dataset")
    parser.add_argument(
        "--skip-compile", action="store_true", help="skip the import/warmup/CLI compile-cost checks"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=2, help="timed calls per case (default 2)")
    parser.add_argument("--workdir", help="where the disk source is saved (default: a temporary directory)")
    parser.add_argument("--markdown", help="also write the tables to this file")
    parser.add_argument("--json", help="also write the raw results to this file")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.case:
        case = json.loads(args.case)
        if case["kind"] == "build-disk":
            build_disk(case)
            print("RESULT {}")
        else:
            print("RESULT " + json.dumps(run_case(case)), flush=True)
        return 0

    args.strategies = [s for s in args.strategies.split(",") if s]
    args.order = [o for o in args.order.split(",") if o]
    args.source = [s for s in args.source.split(",") if s]
    bad = [s for s in args.strategies if s not in STRATEGIES] + [
        o for o in args.order if o not in ("shuffled", "sorted")
    ]
    bad += [s for s in args.source if s not in ("memory", "disk")]
    if bad:
        parser.error(f"unknown values {bad}")

    started = time.perf_counter()
    compile_rows = [] if args.skip_compile else compile_checks()
    for label, value in compile_rows:
        print(f"{label}: {value}", flush=True)

    base = {"rows": args.rows, "max_length": args.max_length, "seed": args.seed, "repeat": args.repeat}
    results = []
    with work_folder(args.workdir, "bench-pack-") as workdir:
        for order in args.order:
            lengths = make_lengths(args.rows, args.seed, order)
            print(
                f"\n{order}: {args.rows:,} rows, {int(lengths.sum()):,} tokens, mean {lengths.mean():.1f}, "
                f"max {lengths.max():,}, {int((lengths > args.max_length).sum()):,} longer than {args.max_length}",
                flush=True,
            )
            for source in args.source:
                case0 = {**base, "order": order, "source": source, "strategy": None}
                if source == "disk":
                    case0["path"] = os.path.join(workdir, f"{order}-{args.rows}")
                    if not os.path.exists(case0["path"]):
                        run_case_process(__file__, {**case0, "kind": "build-disk"})
                kinds = ["memcpy"]
                for strategy in args.strategies:
                    kinds += [("packtools", strategy)] + ([] if args.skip_trl else [("trl", strategy)])
                for item in kinds:
                    kind, strategy = (item, None) if isinstance(item, str) else item
                    r = run_case_process(__file__, {**case0, "kind": kind, "strategy": strategy})
                    results.append(r)
                    print(
                        f"  {source:6s} {kind:9s} {strategy or '-':9s} {r['first']:8.3f} / {r['time']:.3f} s  peak {gb(r['peak_rss'])} GiB "
                        f"(input {gb(r['rss_input'])})  rows {r.get('rows')}",
                        flush=True,
                    )
            for strategy in args.strategies:
                r = run_case_process(
                    __file__, {**base, "order": order, "source": None, "kind": "plan", "strategy": strategy}
                )
                results.append(r)
                print(
                    f"  plan   {strategy:9s} {r['first']:8.3f} / {r['time']:.3f} s  rows {r['rows']:,}",
                    flush=True,
                )

    bad_tokens = [r for r in results if r["kind"] != "memcpy" and r["tokens_out"] != r["tokens_expected"]]
    for r in bad_tokens:
        print(
            f"WARNING: {r['kind']} {r['order']} {r['strategy']} kept {r['tokens_out']} tokens, expected {r['tokens_expected']}"
        )
    tables, verdicts = report(results, args)
    cmd = "python benchmarks/bench_pack.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = [
        f"command: `{cmd.strip()}`",
        f"machine: {os.cpu_count()} CPUs, total wall time {time.perf_counter() - started:.0f} s",
        "",
    ]
    if compile_rows:
        text += [markdown_table(["compile / import check", "result"], [list(r) for r in compile_rows]), ""]
    text += [tables, "", "Targets:"] + [f"- {v}" for v in verdicts]
    print_report("\n".join(text), args.markdown)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
