"""Packed views against written packed rows: build time and memory, data-loader throughput, static shapes.

Usage::

    python benchmarks/bench_view.py                              # W1: 1M rows, max_length 4096 (~1.6 GB on disk)
    python benchmarks/bench_view.py --rows 20000 --batches 200   # a quick check
    python benchmarks/bench_view.py --parts build --skip-trl     # one part, without TRL
    python benchmarks/bench_view.py --markdown view.md --json view.json

Input (as ``bench_pack.py``): ``--rows`` lengths ``max(1, floor(lognormal(5.5, 1.0)))`` from
``default_rng(--seed)``, int32 tokens in ``[0, 32000)`` from ``default_rng(--seed + 1)``, one ``input_ids``
column, saved once with ``save_to_disk`` and opened by every case with ``load_from_disk`` (memory-mapped; page
cache warm), ``max_length=4096``, ``bfd``.

Parts (``--parts``, default all three):

- ``build``: each case in a fresh process (peak RSS is that case's), ``--repeat`` timed calls (TRL: one):
  ``view`` = ``packtools.packed_view(ds, max_length)``; ``pack_dataset`` = ``packtools.pack_dataset(ds,
  max_length)``, which for a memory-mapped dataset writes the packed rows to an Arrow cache file (caching off,
  so every call writes); ``trl`` = ``trl.pack_dataset(ds, max_length, "bfd")`` (caching off).  For the view,
  "added" is the growth of the process's anonymous memory (``RssAnon``) over the call, and ``state`` is
  ``view.state_bytes`` (plan + row mapping + offsets), also per sequence.
- ``loader``: one process.  The same ``TokenBudgetBatchSampler(lengths, --max-tokens, seed=0)`` batches
  (identical lengths, so identical indices) are drawn through ``torch.utils.data.DataLoader`` with
  ``ArrowCollator(data, PaddingFreeCollator(0))`` from (a) the view and (b) ``PackedRows`` over the
  materialized rows (``view.materialize()``, i.e. ``pack_dataset``'s memory-mapped cache file), with 0 and 2
  worker processes (fork), ``--batches`` batches per pass, passes interleaved (view, then materialized),
  ``--loader-repeat`` pairs; reported: best vs best, and the median of the per-pair ratios.  Then an untimed
  pass compares every batch of (a) and (b) tensor by tensor (with 2 workers).
- ``compile``: one process, a tiny Llama (2 layers, hidden 64, vocab 512, sdpa) on the CPU under
  ``torch.compile(dynamic=False)`` with a backend that counts the graphs Dynamo hands it (and runs them
  eagerly: Inductor would compile the same graphs, each far slower on this machine); one epoch, forward and
  backward, ``model(**batch)`` with the whole padding-free batch; Dynamo's recompile limit raised so nothing
  falls back to eager.  Two feeds, each without and with buckets (plus ``pad_cu_seq_lens_to``):
  ``view``: a packed view (``--compile-sequences`` sequences, max_length 512) with a token-budget sampler of
  2048 tokens, ``buckets=4``; ``unpacked``: the same sequences unpacked, 8 per batch in order (what a
  padding-free collator without packing sees), buckets ``choose_buckets(batch totals, 8)``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import print_report, run_case_process, small_llama_config  # noqa: E402
from bench_pack import build_disk, rss_now, rss_peak  # noqa: E402

TARGET_VS_TRL = 50.0
TARGET_VS_CACHE = 10.0
TARGET_ADDED = 64 * 2**20  # plus O(rows): state bytes per sequence are reported
TARGET_LOADER = 0.8


def rss_anon() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


# ---------------------------------------------------------------------------------------------------------
# build
# ---------------------------------------------------------------------------------------------------------
def run_build(case: dict) -> dict:
    import datasets

    datasets.disable_progress_bars()
    datasets.disable_caching()  # no reuse of earlier cache files: every pack_dataset / trl call writes
    ds = datasets.load_from_disk(case["path"])
    tiny = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4], [5, 6]]})
    kind, max_length = case["kind"], case["max_length"]
    if kind == "trl":
        import trl

        trl.pack_dataset(tiny, 4, "bfd")
        fn = lambda: trl.pack_dataset(ds, max_length, "bfd")  # noqa: E731
    else:
        import packtools
        import packtools.core  # the lazy front door does not import it

        packtools.core.warmup()
        if kind == "view":
            packtools.packed_view(tiny, 4)
            fn = lambda: packtools.packed_view(ds, max_length)  # noqa: E731
        else:
            packtools.pack_dataset(tiny, 4)
            fn = lambda: packtools.pack_dataset(ds, max_length)  # noqa: E731
    result: dict = {"rss_input": rss_now(), "times": []}
    for _ in range(case["repeat"]):
        anon = rss_anon()
        t = time.perf_counter()
        out = fn()
        result["times"].append(time.perf_counter() - t)
        result["added"] = rss_anon() - anon
        result["rows"] = len(out)
        if kind == "view":
            result["state"] = out.state_bytes
            result["sequences"] = out.plan.num_sequences
        del out
    result["time"], result["first"] = min(result["times"]), result["times"][0]
    result["peak_rss"] = rss_peak()
    result["load"] = os.getloadavg()[0]
    return result


# ---------------------------------------------------------------------------------------------------------
# loader
# ---------------------------------------------------------------------------------------------------------
def run_loader(case: dict) -> dict:
    import datasets
    import torch

    import packtools
    import packtools.core  # the lazy front door does not import it
    from packtools import PaddingFreeCollator
    from packtools.batches import ArrowCollator, PackedRows, TokenBudgetBatchSampler

    torch.set_num_threads(1)
    datasets.disable_progress_bars()
    datasets.disable_caching()
    packtools.core.warmup()
    ds = datasets.load_from_disk(case["path"])
    view = packtools.packed_view(ds, case["max_length"])
    rows = PackedRows(view.materialize())
    collator = PaddingFreeCollator(0)
    sources = {"view": view, "materialized": rows}

    def loader(name: str, workers: int):
        data = sources[name]
        sampler = TokenBudgetBatchSampler(data.lengths, case["max_tokens"], seed=0)
        return torch.utils.data.DataLoader(
            data, batch_sampler=sampler, collate_fn=ArrowCollator(data, collator), num_workers=workers
        )

    def timed(name: str, workers: int) -> tuple[float, int]:
        t = time.perf_counter()
        tokens = n = 0
        for batch in loader(name, workers):
            tokens += int(batch["input_ids"].shape[1])
            n += 1
            if n == case["batches"]:
                break
        return time.perf_counter() - t, tokens

    result: dict = {"batches": case["batches"], "max_tokens": case["max_tokens"]}
    for workers in (0, 2):
        best: dict[str, tuple[float, int]] = {}
        pairs = []
        for _ in range(case["repeat"]):
            times = {}
            for name in sources:  # interleaved, so both see the same machine load
                t, tokens = timed(name, workers)
                times[name] = t
                if name not in best or t < best[name][0]:
                    best[name] = (t, tokens)
            pairs.append(times["materialized"] / times["view"])
        for name, (t, tokens) in best.items():
            result[f"{name}_{workers}"] = {
                "time": t,
                "batches_per_s": case["batches"] / t,
                "mtok_per_s": tokens / t / 1e6,
            }
        result[f"pair_ratios_{workers}"] = pairs
    compared = 0
    for a, b in zip(loader("view", 2), loader("materialized", 2)):
        assert a.keys() == b.keys()
        for k in a:
            same = torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]
            if not same:
                raise AssertionError(
                    f"batch {compared}: {k} differs between the view and the materialized rows"
                )
        compared += 1
        if compared == case["batches"]:
            break
    result["identical_batches"] = compared
    result["load"] = os.getloadavg()[0]
    return result


# ---------------------------------------------------------------------------------------------------------
# compile
# ---------------------------------------------------------------------------------------------------------
def run_compile(case: dict) -> dict:
    import pyarrow as pa
    import torch
    import torch._dynamo
    from transformers import LlamaForCausalLM

    import packtools
    from packtools import PaddingFreeCollator
    from packtools.batches import ArrowCollator, TokenBudgetBatchSampler, choose_buckets
    from packtools.batches.buckets import bucket_padding

    torch.set_num_threads(1)
    rng = np.random.default_rng(case["seed"])
    lengths = np.clip(rng.lognormal(4.5, 1.0, case["sequences"]).astype(np.int64), 1, 512)
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
    ids = rng.integers(1, 512, int(offsets[-1]), dtype=np.int32)
    table = pa.table({"input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids))})
    view = packtools.packed_view(table, 512)
    unpacked = [{"input_ids": ids[offsets[i] : offsets[i + 1]]} for i in range(len(lengths))]
    config = small_llama_config(512, 2, 4096, use_cache=False)

    def epoch(batches, collator) -> dict:
        torch.manual_seed(0)
        torch._dynamo.reset()
        graphs = []

        def backend(gm, example_inputs):
            graphs.append(len(example_inputs))
            return gm.forward

        model = torch.compile(LlamaForCausalLM(config), backend=backend, dynamic=False)
        shapes = set()
        t = time.perf_counter()
        with torch._dynamo.config.patch(cache_size_limit=100_000, accumulated_cache_size_limit=100_000):
            for feed in batches:
                batch = collator(feed)
                model(**batch).loss.backward()
                shapes.add(tuple(batch["input_ids"].shape))
        return {
            "graphs": len(graphs),
            "shapes": len(shapes),
            "batches": len(batches),
            "time": time.perf_counter() - t,
        }

    result: dict = {}
    sampler = TokenBudgetBatchSampler(view.lengths, 2048, seed=0)
    bucketed = TokenBudgetBatchSampler(view.lengths, 2048, seed=0, buckets=4)
    plain = ArrowCollator(view, PaddingFreeCollator(0))
    static = ArrowCollator(
        view, PaddingFreeCollator(0, pad_to_buckets=bucketed.buckets, pad_cu_seq_lens_to=128)
    )
    result["view_none"] = {**epoch(list(sampler), plain), "padding": 0.0, "buckets": None}
    result["view_buckets"] = {
        **epoch(list(bucketed), static),
        "padding": bucketed.padding_share(),
        "buckets": bucketed.buckets,
    }
    groups = [unpacked[i : i + 8] for i in range(0, len(unpacked), 8)]
    totals = [sum(len(r["input_ids"]) for r in g) for g in groups]
    sizes = choose_buckets(totals, 8)
    result["unpacked_none"] = {  # rows of one sequence each (no seq_lengths): said to the collator
        **epoch(groups, PaddingFreeCollator(0, unpacked=True)),
        "padding": 0.0,
        "buckets": None,
    }
    result["unpacked_buckets"] = {
        **epoch(groups, PaddingFreeCollator(0, unpacked=True, pad_to_buckets=sizes, pad_cu_seq_lens_to=16)),
        "padding": bucket_padding(totals, sizes),
        "buckets": sizes,
    }
    result["load"] = os.getloadavg()[0]
    return result


# ---------------------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------------------
RUNNERS = {"build": run_build, "loader": run_loader, "compile": run_compile}


def gib(x: float) -> str:
    return f"{x / 2**30:.2f}"


def mib(x: float) -> str:
    return f"{x / 2**20:.1f}"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def report(results: dict, args: argparse.Namespace) -> str:
    out = [f"rows: {args.rows:,}, max_length: {args.max_length}, strategy: bfd, source: load_from_disk", ""]
    verdicts = []
    build = results.get("build")
    if build:
        rows = []
        for r in build:
            extra = ""
            if r["kind"] == "view":
                extra = f"state {mib(r['state'])} MiB ({r['state'] / r['sequences']:.1f} B/sequence)"
            rows.append(
                [
                    r["kind"],
                    f"{r['first']:.3f}",
                    f"{r['time']:.3f}",
                    gib(r["peak_rss"]),
                    gib(r["rss_input"]),
                    mib(r["added"]),
                    f"{r['rows']:,}",
                    extra,
                    f"{r['load']:.1f}",
                ]
            )
        out += [
            "### Build",
            "",
            table(
                [
                    "case",
                    "first s",
                    "best s",
                    "peak RSS GiB",
                    "input RSS GiB",
                    "added MiB (RssAnon)",
                    "rows",
                    "view state",
                    "load",
                ],
                rows,
            ),
            "",
        ]
        by = {r["kind"]: r for r in build}
        view = by["view"]
        if "trl" in by:
            ratio = by["trl"]["time"] / view["time"]
            verdicts.append(f"view build vs trl.pack_dataset: {ratio:.1f}x (target >= {TARGET_VS_TRL:.0f}x)")
        ratio = by["pack_dataset"]["time"] / view["time"]
        verdicts.append(
            f"view build vs pack_dataset (cache file): {ratio:.1f}x (target >= {TARGET_VS_CACHE:.0f}x)"
        )
        over = view["added"] - TARGET_ADDED
        verdicts.append(
            f"memory the view adds: {mib(view['added'])} MiB RssAnon; state {mib(view['state'])} MiB = "
            f"{view['state'] / view['sequences']:.1f} B/sequence (target <= 64 MiB + O(rows): "
            f"{'met' if over <= view['state'] else 'missed'})"
        )
    loader = results.get("loader")
    if loader:
        rows = []
        for w in (0, 2):
            v, m = loader[f"view_{w}"], loader[f"materialized_{w}"]
            ratio = v["batches_per_s"] / m["batches_per_s"]
            rows.append(
                [
                    str(w),
                    f"{m['batches_per_s']:.0f}",
                    f"{m['mtok_per_s']:.0f}",
                    f"{v['batches_per_s']:.0f}",
                    f"{v['mtok_per_s']:.0f}",
                    f"{ratio:.2f}",
                ]
            )
            pairs = loader[f"pair_ratios_{w}"]
            verdicts.append(
                f"loader throughput, {w} workers: view / materialized = {ratio:.2f} best vs best, "
                f"{float(np.median(pairs)):.2f} median of {len(pairs)} back-to-back pairs "
                f"({', '.join(f'{x:.2f}' for x in pairs)}) (target >= {TARGET_LOADER})"
            )
        out += [
            "### Data loader",
            "",
            f"{loader['batches']} batches of <= {loader['max_tokens']:,} tokens per pass; "
            f"identical batches checked: {loader['identical_batches']}; load {loader['load']:.1f}",
            "",
            table(
                [
                    "workers",
                    "materialized batches/s",
                    "Mtok/s",
                    "view batches/s",
                    "Mtok/s",
                    "view / materialized",
                ],
                rows,
            ),
            "",
        ]
    comp = results.get("compile")
    if comp:
        rows = []
        for feed in ("view", "unpacked"):
            for mode in ("none", "buckets"):
                r = comp[f"{feed}_{mode}"]
                rows.append(
                    [
                        feed,
                        mode if r["buckets"] is None else f"K={len(r['buckets'])} {list(r['buckets'])}",
                        str(r["batches"]),
                        str(r["shapes"]),
                        str(r["graphs"]),
                        f"{100 * r['padding']:.2f}%",
                        f"{r['time']:.1f}",
                    ]
                )
            k = len(comp[f"{feed}_buckets"]["buckets"])
            verdicts.append(
                f"compilations over an epoch ({feed}): {comp[f'{feed}_buckets']['graphs']} with K={k} buckets "
                f"(target <= {k}), {comp[f'{feed}_none']['graphs']} without"
            )
        out += [
            "### Static shapes (torch.compile(dynamic=False), tiny Llama, CPU)",
            "",
            table(
                ["feed", "buckets", "batches", "distinct shapes", "graphs compiled", "padding", "epoch s"],
                rows,
            ),
            "",
        ]
    return "\n".join(out + ["### Verdicts", ""] + [f"- {v}" for v in verdicts])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-length", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=32768)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--batches", type=int, default=2000)
    ap.add_argument("--loader-repeat", type=int, default=5)
    ap.add_argument("--compile-sequences", type=int, default=800)
    ap.add_argument("--parts", default="build,loader,compile")
    ap.add_argument("--skip-trl", action="store_true")
    ap.add_argument(
        "--data-dir", default=None, help="where the saved dataset goes (default: a temporary folder)"
    )
    ap.add_argument("--markdown", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.case:
        case = json.loads(args.case)
        print("RESULT " + json.dumps(RUNNERS[case["part"]](case)))
        return 0
    parts = args.parts.split(",")
    t0 = time.perf_counter()
    results: dict = {}
    with tempfile.TemporaryDirectory(dir=args.data_dir) as tmp:
        path = os.path.join(tmp, "w1")
        base = {
            "path": path,
            "rows": args.rows,
            "seed": args.seed,
            "order": "shuffled",
            "max_length": args.max_length,
        }
        if "build" in parts or "loader" in parts:
            build_disk(base)
        if "build" in parts:
            kinds = ["view", "pack_dataset"] + ([] if args.skip_trl else ["trl"])
            results["build"] = [
                run_case_process(
                    __file__, {**base, "part": "build", "kind": k, "repeat": 1 if k == "trl" else args.repeat}
                )
                for k in kinds
            ]
        if "loader" in parts:
            results["loader"] = run_case_process(
                __file__,
                {
                    **base,
                    "part": "loader",
                    "max_tokens": args.max_tokens,
                    "batches": args.batches,
                    "repeat": args.loader_repeat,
                },
            )
        if "compile" in parts:
            results["compile"] = run_case_process(
                __file__, {"part": "compile", "seed": args.seed, "sequences": args.compile_sequences}
            )
    text = (
        report(results, args) + f"\n\ntotal wall time {time.perf_counter() - t0:.0f} s, {os.cpu_count()} CPUs"
    )
    print_report(text, args.markdown)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
