"""Where a raw-text ``pack`` spends its time, phase by phase, beside the tokenizer engine alone on the same text.

Usage::

    python benchmarks/bench_phases.py --docs 65000 --vocab llama3 --repeat 3     # ~100 MB of text
    python benchmarks/bench_phases.py --docs 650000 --vocab llama3 --repeat 1    # ~1 GB
    python benchmarks/bench_phases.py --workdir W ...      # keep (and reuse) the data and tokenizer in W
    python benchmarks/bench_phases.py --tokenized-mb 200 --baseline-tree B --repeat 3   # tokenized JSON lines

The data and tokenizers are ``bench_tokenize.py``'s (``--case data``: stdlib pieces as JSONL ``{"text": ...}``,
the real vocabulary built from ``quicktok-v1``'s rank files).  Every case runs in a fresh process, and the cases
alternate within each repeat (engine alone, a first run, a warm run), so a load change on the shared machine
hits all of them; each column is the repeat with the best wall time.

- ``engine alone``: ``fastokens`` loads ``tokenizer.json`` (timed), the texts are read into Python strings
  (timed apart: not the engine's), then ``encode_batch_flat`` over batches of 1,000 texts with the engine's
  default threads (timed: the engine's MB/s, the figure the pipeline is measured against).
- ``first run``: ``run_pipeline`` with an empty ``PACKTOOLS_CACHE_DIR`` (every recorded proof and fact is
  made again; transformers is imported, in the check's child process), timed from the process start; its peak
  RSS, its child's, and the two together sampled every 10 ms (the machine's memory at one time).
- ``warm``: the same command again with that cache folder.
- ``--cli``: also ``packtools pack`` itself (the console script's ``packtools.cli.main.console`` in a fresh
  process, ``main`` in a tree without it, a cache folder of
  its own), first and warm, end to end from the process start: the command starts a first run's check before
  its imports, which ``run_pipeline`` called from Python cannot (``reference_check.start_ahead``).

``--tokenized-mb N``: instead, N MB of already tokenized JSON lines (``{"input_ids": [...]}``, lognormal lengths,
ids below 128,256, seed 0) staged and packed (``max_length`` 2048) by this tree and by the packtools checkout
``--baseline-tree`` (``PYTHONPATH``), beside Arrow's reader alone (``pyarrow.json.read_json``, its threads)
on the same file, each in a fresh process reporting its peak RSS, interleaved; best of ``--repeat``.

Phases (seconds): ``process start + imports`` (the interpreter and ``packtools.pipeline.run``; the parent's
wall less the child's own clock, plus the child's import time), ``setup`` (inputs found, fingerprints),
``tokenizer load`` (reference, facts, the first run's proofs against transformers), ``engine proof`` (the
adversarial verdict), ``verdict on the data`` (the driver's proof on the first rows, which waits for the fast
engine's load), ``stage`` (wall) with the busy seconds of its threads (read + Python strings, encode, write the
staged file, flush), ``plan``, ``gather + write`` (wall) with the busy seconds of gather, write and flush, and
``install and exit``.  Busy seconds overlap (threads), so they add up to more than the wall.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time

from _common import print_report, work_folder

HERE = os.path.dirname(os.path.abspath(__file__))
MAX_LENGTH = 2048


def case_alone(src: str, tok_dir: str) -> dict:
    t0 = time.perf_counter()
    import fastokens
    import pyarrow.json as pj

    t1 = time.perf_counter()
    enc = fastokens.Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
    t2 = time.perf_counter()
    texts = pj.read_json(src).column("text").to_pylist()
    t3 = time.perf_counter()
    mb = sum(len(t.encode()) for t in texts) / 1e6
    enc.encode_batch_flat(["warm-up"], add_special_tokens=True)
    t4 = time.perf_counter()
    tokens = 0
    for i in range(0, len(texts), 1000):
        ids, _ = enc.encode_batch_flat(texts[i : i + 1000], add_special_tokens=True)
        tokens += len(ids)
    t5 = time.perf_counter()
    return {"mb": mb, "tokens": tokens, "import_s": t1 - t0, "load_s": t2 - t1, "read_s": t3 - t2,
            "encode_s": t5 - t4}  # fmt: skip


def _rss_kib(pid: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as fh:
            return next((int(line.split()[1]) for line in fh if line.startswith("VmRSS:")), 0)
    except OSError:
        return 0


def sample_rss(stop: threading.Event, peak: list[int]) -> None:
    """Every 10 ms until ``stop``: the RSS of this process plus its child processes', its peak in ``peak[0]``
    (KiB): the memory the machine holds at one time, where the peaks of each process may not coincide."""
    me = str(os.getpid())
    while not stop.wait(0.01):
        kids: list[str] = []
        for task in os.listdir(f"/proc/{me}/task"):
            try:
                with open(f"/proc/{me}/task/{task}/children") as fh:
                    kids += fh.read().split()
            except OSError:
                continue
        peak[0] = max(peak[0], _rss_kib(me) + sum(_rss_kib(k) for k in kids))


def case_pack(src: str, out: str, tok_dir: str) -> dict:
    stop, peak = threading.Event(), [0]
    sampler = threading.Thread(target=sample_rss, args=(stop, peak), daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    from packtools.pipeline.config import PipelineConfig
    from packtools.pipeline.run import run_pipeline

    t1 = time.perf_counter()
    shutil.rmtree(out, ignore_errors=True)
    res = run_pipeline([src], out, PipelineConfig(max_length=MAX_LENGTH, tokenizer=tok_dir))
    t2 = time.perf_counter()
    import resource

    # peak RSS of this process, and of its children (a first run's check against transformers: one process)
    rss = {who: resource.getrusage(k).ru_maxrss * 1024 / 2**30
           for who, k in (("rss_gb", resource.RUSAGE_SELF), ("child_rss_gb", resource.RUSAGE_CHILDREN))}  # fmt: skip
    stop.set()
    sampler.join()
    rss["sum_rss_gb"] = peak[0] / 2**20
    return {"import_s": t1 - t0, "run_s": t2 - t1, "own_s": t2 - t0, "timings": res.timings,
            "engine": res.stats["tokenizer"]["engine"], "rows_out": res.stats["rows_out"], **rss}  # fmt: skip


def case_cli(src: str, out: str, tok_dir: str) -> dict:
    """``packtools pack`` as a user runs it (the console script's entry ``console``, or ``main`` in a tree
    without one, in this fresh process): a first run starts its check's child before the command's imports,
    which ``run_pipeline`` called from Python cannot, and the process exits as the command's does."""
    stop, peak = threading.Event(), [0]
    sampler = threading.Thread(target=sample_rss, args=(stop, peak), daemon=True)
    sampler.start()
    shutil.rmtree(out, ignore_errors=True)
    import packtools.cli.main as cli

    argv = ["pack", src, "--tokenizer", tok_dir, "--out", out, "--max-length", str(MAX_LENGTH), "--quiet"]
    console = getattr(cli, "console", None)  # the console script's entry, where the tree has one (issue 42)
    if console is not None:
        sys.argv[1:] = argv
    if (console() if console is not None else cli.main(argv)) != 0:
        raise RuntimeError("packtools pack failed")
    stop.set()
    sampler.join()
    return {"sum_rss_gb": peak[0] / 2**20}


def make_tokenized(path: str, mb: int) -> None:
    import numpy as np

    rng = np.random.default_rng(0)
    n = 0
    with open(path, "w") as fh:
        while n < mb * 1_000_000:
            ids = rng.integers(0, 128256, int(rng.lognormal(5.5, 0.8)) + 1)
            line = '{"input_ids": [' + ", ".join(map(str, ids.tolist())) + "]}\n"
            fh.write(line)
            n += len(line)


def case_tokenized(src: str, out: str, way: str) -> dict:
    import resource

    t0 = time.perf_counter()
    if way == "arrow":
        import pyarrow.json as pj

        rows = pj.read_json(src).num_rows
        res_t: dict = {}
    else:
        from packtools.pipeline.run import pack_files

        shutil.rmtree(out, ignore_errors=True)
        res = pack_files(src, out, max_length=MAX_LENGTH)
        rows, res_t = res.stats["rows_in"], res.timings
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30
    return {"s": time.perf_counter() - t0, "rows": rows, "stage_s": res_t.get("stage_s"), "rss_gb": rss}


def tokenized(args: argparse.Namespace, workdir: str) -> list[str]:
    src = os.path.join(workdir, f"tokenized-{args.tokenized_mb}.jsonl")
    if not os.path.exists(src):
        make_tokenized(src, args.tokenized_mb)
    mb = os.path.getsize(src) / 1e6
    here = os.path.dirname(HERE)
    ways = {
        "Arrow's reader (pyarrow.json.read_json)": ("arrow", here),
        "packtools (this tree)": ("pack", here),
    }
    if args.baseline_tree:
        ways[f"packtools ({args.baseline_tree})"] = ("pack", os.path.abspath(args.baseline_tree))
    best: dict[str, dict] = {}
    for rep in range(args.repeat):
        for label, (way, tree) in ways.items():
            env = {**os.environ, "PYTHONPATH": tree}
            r = run_case(env, "tokenized", src, os.path.join(workdir, "out-tok"), way)
            key = "s" if way == "arrow" else "stage_s"
            if label not in best or r[key] < best[label][key]:
                best[label] = r
        print(f"repeat {rep} done", flush=True)
    shutil.rmtree(os.path.join(workdir, "out-tok"), ignore_errors=True)
    with open("/proc/loadavg") as fh:
        load = " ".join(fh.read().split()[:3])
    lines = [
        f"### Tokenized JSON lines: {mb:.0f} MB, best of {args.repeat} interleaved; load average after: {load}",
        "",
        "| way | read / stage (s) | MB/s | end to end (s) | CPU s (process) | peak RSS (GiB) |",
        "|---|---|---|---|---|---|",
    ]
    for label, r in best.items():
        t = r["s"] if r["stage_s"] is None else r["stage_s"]
        lines.append(
            f"| {label} | {t:.2f} | {mb / t:.0f} | {r['wall_s']:.2f} | {r['cpu_s']:.2f} | {r['rss_gb']:.2f} |"
        )
    return lines


def medians(walls: dict[str, list[float]], prefix: str, suffix: str) -> tuple[float, float, float]:
    """The median first run, the median warm run, and the median of each repeat's first / warm (``walls`` in
    repeat order): the two run one after the other, so each such ratio is taken in one state of a machine whose
    speed drifts between repeats.

    >>> medians({"first": [6.0, 4.0, 5.0], "warm": [4.0, 2.0, 4.0]}, "", "")
    (5.0, 4.0, 1.5)
    """
    first, warm = walls[prefix + "first" + suffix], walls[prefix + "warm" + suffix]
    pairs = statistics.median(f / w for f, w in zip(first, warm))
    return statistics.median(first), statistics.median(warm), pairs


def run_case(env: dict, *args: str) -> dict:
    import resource

    cmd = [sys.executable, os.path.abspath(__file__), "--case", *args]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode != 0:
        raise RuntimeError(f"case {args} failed:\n{proc.stderr[-4000:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    res["wall_s"], res["cpu_s"] = wall, cpu  # CPU seconds (user + system): less hostage to the machine's load
    res["sys_s"] = after.ru_stime - before.ru_stime  # the kernel's share: page faults, the page cache
    return res


def phases(r: dict) -> list[tuple[str, float]]:
    t = r["timings"]
    start = r["wall_s"] - r["own_s"] + r["import_s"]  # interpreter start + imports
    stage, write = t.get("stage_phases_s", {}), t.get("write_phases_s", {})
    known = ["setup_s", "tokenizer_load_s", "engine_proof_s", "verdict_s", "stage_s", "plan_s", "write_s"]
    rest = r["wall_s"] - start - sum(t.get(k, 0.0) for k in known)
    return [
        ("process start + imports", start),
        ("setup (inputs, fingerprints)", t.get("setup_s", 0.0)),
        ("tokenizer load (+ first run's proofs vs transformers)", t.get("tokenizer_load_s", 0.0)),
        ("engine proof (adversarial verdict)", t.get("engine_proof_s", 0.0)),
        ("verdict on the data (waits for the engine's load)", t.get("verdict_s", 0.0)),
        ("stage (wall)", t.get("stage_s", 0.0)),
        ("  read + Python strings (busy)", stage.get("read", 0.0)),
        ("  encode (busy)", stage.get("encode", 0.0)),
        ("  write staged file (busy)", stage.get("write", 0.0)),
        ("  flush staged file (busy)", stage.get("flush", 0.0)),
        ("  waiting for the check against transformers (first run)", t.get("reference_check_s", 0.0)),
        ("plan", t.get("plan_s", 0.0)),
        ("gather + write (wall)", t.get("write_s", 0.0)),
        ("  gather (busy)", write.get("gather", 0.0)),
        ("  write shards (busy)", write.get("write", 0.0)),
        ("  flush shards (busy)", write.get("flush", 0.0)),
        ("install, exit, other", rest),
        ("**end to end (wall)**", r["wall_s"]),
        ("CPU seconds, user + system (whole process)", r["cpu_s"]),
        ("  of which system (page faults, page cache)", r.get("sys_s", 0.0)),
        ("peak RSS, the run's process (GiB)", r.get("rss_gb", 0.0)),
        ("peak RSS, its child process (GiB; first run's check)", r.get("child_rss_gb", 0.0)),
        ("peak of the two together, sampled every 10 ms (GiB)", r.get("sum_rss_gb", 0.0)),
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, default=65_000)
    ap.add_argument("--vocab", default="llama3", choices=("bpe32k", "llama3", "qwen3"))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workdir", help="keep the data here (reused when it is already there)")
    ap.add_argument("--markdown", help="also write the table to this file")
    ap.add_argument("--tokenized-mb", type=int, help="tokenized JSON lines of this size instead (see above)")
    ap.add_argument(
        "--baseline-tree", help="also run a packtools checkout in this folder (PYTHONPATH), interleaved"
    )
    ap.add_argument(
        "--cli", action="store_true", help="also time `packtools pack` itself, first and warm (see case_cli)"
    )
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("args", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        cases = {"alone": case_alone, "pack": case_pack, "cli": case_cli, "tokenized": case_tokenized}
        result = cases[args.case](*args.args)
        print(json.dumps(result))
        return 0
    with work_folder(args.workdir, "packtools-bench-phases-") as workdir:
        meta = os.path.join(workdir, f"data-{args.docs}-{args.vocab}.json")
        if args.tokenized_mb:
            print_report("\n".join(tokenized(args, workdir)), args.markdown)
            return 0
        if not os.path.exists(meta):
            cmd = [sys.executable, os.path.join(HERE, "bench_tokenize.py"), "--case", "data", workdir,
                   str(args.docs), args.vocab]  # fmt: skip
            proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
            with open(meta, "w") as fh:
                fh.write(proc.stdout.strip().splitlines()[-1])
        with open(meta) as fh:
            data = json.load(fh)
        src, tok = data["text"], data["tokenizer"]
        best: dict[str, dict] = {}
        walls: dict[str, list[float]] = {}  # every repeat's wall, for the medians
        for tree in [os.path.dirname(HERE)] + ([args.baseline_tree] if args.baseline_tree else []):
            # one untimed run per tree: its Numba cache (a checkout's __pycache__) holds the kernels from then on
            warm_env = {**os.environ, "PACKTOOLS_CACHE_DIR": os.path.join(workdir, "cache-warmup"),
                        "PYTHONPATH": os.path.abspath(tree)}  # fmt: skip
            run_case(warm_env, "pack", data["one"], os.path.join(workdir, "out"), tok)
        for rep in range(args.repeat):
            cache = os.path.join(workdir, f"cache-{rep}")
            shutil.rmtree(cache, ignore_errors=True)
            env = {**os.environ, "PACKTOOLS_CACHE_DIR": cache, "PYTHONPATH": os.path.dirname(HERE)}
            out = os.path.join(workdir, "out")
            runs = {"alone": run_case(env, "alone", src, tok)}
            trees = {"": env}
            if args.baseline_tree:
                base_cache = os.path.join(workdir, f"cache-base-{rep}")
                shutil.rmtree(base_cache, ignore_errors=True)
                tree = os.path.abspath(args.baseline_tree)
                trees[" (baseline)"] = {**os.environ, "PACKTOOLS_CACHE_DIR": base_cache, "PYTHONPATH": tree}
            for suffix, tree_env in trees.items():  # this tree, then the baseline, each first and warm
                runs["first" + suffix] = run_case(tree_env, "pack", src, out, tok)
                runs["warm" + suffix] = run_case(tree_env, "pack", src, out, tok)
                if args.cli:  # the command, with a cache folder of its own
                    cli_cache = tree_env["PACKTOOLS_CACHE_DIR"] + "-cli"
                    shutil.rmtree(cli_cache, ignore_errors=True)
                    cli_env = {**tree_env, "PACKTOOLS_CACHE_DIR": cli_cache}
                    runs["cli first" + suffix] = run_case(cli_env, "cli", src, out, tok)
                    runs["cli warm" + suffix] = run_case(cli_env, "cli", src, out, tok)
            for name, r in runs.items():
                walls.setdefault(name, []).append(r["wall_s"])
                key = "encode_s" if name == "alone" else "wall_s"
                if name not in best or r[key] < best[name][key]:
                    best[name] = r
            with open("/proc/loadavg") as fh:
                now = " ".join(fh.read().split()[:3])
            print(
                f"repeat {rep} (load average after: {now}): "
                + ", ".join(
                    f"{k} {v['wall_s']:.2f} s / {v['cpu_s']:.2f} CPU s"
                    + (f" / peak {v['sum_rss_gb']:.2f} GiB" if "sum_rss_gb" in v else "")
                    for k, v in runs.items()
                ),
                flush=True,
            )
            shutil.rmtree(out, ignore_errors=True)
        with open("/proc/loadavg") as fh:
            load = fh.read().split()[:3]
        alone = best["alone"]
        mb = alone["mb"]
        engine_mbs = mb / alone["encode_s"]
        cols = [k for k in best if k != "alone" and not k.startswith("cli ")]
        lines = [
            f"### {args.docs:,} documents ({mb:.1f} MB of text), {args.vocab}, max_length {MAX_LENGTH}, bfd; "
            f"best of {args.repeat} interleaved; load average after: {' '.join(load)}",
            "",
            "| phase | " + " | ".join(f"{c} (s)" for c in cols) + " |",
            "|---|" + "---|" * len(cols),
        ]
        table = [phases(best[c]) for c in cols]
        for i, (label, _) in enumerate(table[0]):
            lines.append(f"| {label} | " + " | ".join(f"{t[i][1]:.2f}" for t in table) + " |")
        lines += [
            "",
            f"Engine alone (fastokens `encode_batch_flat`, batches of 1,000, default threads, texts in memory): "
            f"encode {alone['encode_s']:.2f} s (**{engine_mbs:.0f} MB/s**); its load {alone['load_s']:.2f} s, "
            f"reading the texts into Python strings {alone['read_s']:.2f} s, import {alone['import_s']:.2f} s.",
            "",
        ]
        for suffix in ("", " (baseline)"):
            if "warm" + suffix not in best:
                continue
            w, f = best["warm" + suffix], best["first" + suffix]
            lines.append(
                f"- CPU seconds{suffix}: warm {w['cpu_s']:.2f}, first run {f['cpu_s']:.2f} "
                f"(**{f['cpu_s'] / w['cpu_s']:.2f}x**); the engine alone's encode + load + read: "
                f"{alone['cpu_s']:.2f} (whole process)."
            )
            lines.append(
                f"- warm{suffix}: {mb / w['wall_s']:.1f} MB/s = **{mb / w['wall_s'] / engine_mbs:.3f}** of the "
                f"engine alone's MB/s (target >= 0.3 at 100 MB); first run / warm = "
                f"**{f['wall_s'] / w['wall_s']:.2f}x** (target <= 1.5x); engine {w['engine']}, rows out "
                f"{w['rows_out']:,}."
            )
            if "cli warm" + suffix in best:
                w, f = best["cli warm" + suffix], best["cli first" + suffix]
                mf, mw, pairs = medians(walls, "cli ", suffix)
                lines.append(
                    f"- `packtools pack`{suffix}, the command from its process start: warm {w['wall_s']:.2f} s / "
                    f"{w['cpu_s']:.2f} CPU s, first run {f['wall_s']:.2f} s / {f['cpu_s']:.2f} CPU s (peak of both "
                    f"processes {f['sum_rss_gb']:.2f} GiB): first run / warm = **{f['wall_s'] / w['wall_s']:.2f}x** "
                    f"(target <= 1.5x), {f['cpu_s'] / w['cpu_s']:.2f}x in CPU seconds; medians of the "
                    f"{len(walls['cli warm' + suffix])} repeats {mf:.2f} / {mw:.2f} s = **{mf / mw:.2f}x**, "
                    f"the pairs' ratios' median {pairs:.2f}x."
                )
            if args.repeat > 1:
                mf, mw, pairs = medians(walls, "", suffix)
                lines.append(
                    f"- medians{suffix} (`run_pipeline`): first {mf:.2f} s, warm {mw:.2f} s = {mf / mw:.2f}x, "
                    f"the pairs' ratios' median {pairs:.2f}x."
                )
        print_report("\n".join(lines), args.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
