"""Tokenizer engines compared on the same text and threads, ids compared document by document: fastokens
(packtools' engine), gigatoken, quicktok and the ``tokenizers`` library (packtools' reference; whatever version the
interpreter has, e.g. 0.23.x beside transformers and 1.0's release candidate in a separate environment).  The
script needs only NumPy, pyarrow and the engines it measures (no packtools), so it runs in any environment.

Usage::

    python benchmarks/bench_engines.py DOCS.jsonl TOKENIZER_DIR --repeat 3        # fastokens, gigatoken if installed
    python benchmarks/bench_engines.py DOCS.jsonl TOKENIZER_DIR --engines fastokens,tokenizers
    python benchmarks/bench_engines.py DOCS.jsonl TOKENIZER_DIR --repeat 3 --ids-dir IDS \\
        --env /work/venv/bin/python=fastokens,tokenizers --env /tmp/tok10/bin/python=tokenizers

``DOCS.jsonl`` holds ``{"text": ...}`` lines (``bench_tokenize.py --case data`` or ``bench_phases.py --workdir``
writes one); ``TOKENIZER_DIR`` a ``tokenizer.json``.  The texts are read into memory once per process (not timed);
then, per repeat and alternating between the engines, each engine is loaded fresh (load timed) and the whole text
encoded in batches of 1,000, the ids flattened to NumPy (timed with the encode):

- fastokens ``encode_batch_flat``, without and then with special tokens on the same instance (the second pass
  runs warm, its caches filled by the first: the first pass is the one to set beside a single pass);
- gigatoken ``encode_batch`` (an awkward array, flattened), without special tokens (it adds none), and its own
  JSONL reader + encode (``encode_files``);
- quicktok: ``quicktok.import_tokenizer`` of the ``tokenizer.json`` into a temporary data folder (its own
  verification on its stress suite; timed as its one-time import), then ``get_encoding`` (the load of every later
  run) and ``encode_batch(texts, threads=N, with_special=True)`` (added-token strings in the text become their
  ids, as in the ``tokenizers`` library; it adds no BOS: compared with the others' ids without special tokens);
- tokenizers ``Tokenizer.from_file`` with truncation and padding off, then ``encode_batch_fast`` where the
  version has it (0.23.x; else ``encode_batch``), ``add_special_tokens=True``, as packtools' reference calls
  it (``packtools.pipeline.tokenizer.batch``); each encoding's ``ids`` (``ids_array`` where the version has it)
  concatenated.  With special tokens only (0.23.x encodes ~1 MB/s here: a second pass would double the run),
  or also without (``--special both``, e.g. on the adversarial set of the proof, a few hundred kB).

Threads: ``--threads N`` (default: the machine's cores) sets ``RAYON_NUM_THREADS`` (tokenizers' pool),
``FASTOKENS_BPE_THREADS`` and ``TOKENIZERS_PARALLELISM=true`` before any engine is imported; gigatoken keeps
its own default.

``--env PY=ENGINES`` (repeatable): each repeat runs this script once under every interpreter in turn (a fresh
process, ``--repeat 1``), so environments with different library versions are interleaved on the same texts and
threads; the table gives the best and the median of the repeats, with the load average at each start.
``--ids-dir`` (one folder per data and tokenizer) writes every engine's ids (``<engine> <version>.special-<0|1>.ids.npy`` and ``.lengths.npy``;
the first repeat's) and the ids found there are compared document by document in one process at the end, every
pair with the same special-token setting; an engine is adoptable only with zero differences.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ENGINES = ("fastokens", "gigatoken", "quicktok", "tokenizers")
BATCH = 1000


def set_threads(threads: int) -> None:
    """Every engine's thread count, before it is imported (the pools read the environment once)."""
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    os.environ["FASTOKENS_BPE_THREADS"] = str(threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "true"


def load_average() -> str:
    with open("/proc/loadavg") as fh:
        return " ".join(fh.read().split()[:3])


def version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed(dist)
    except PackageNotFoundError:
        return "?"


def flat_ids(rows: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The ids of a list of per-document arrays, flattened, and each document's length."""
    lengths = np.fromiter((r.shape[0] for r in rows), np.int64, len(rows))
    return (np.concatenate(rows).astype(np.uint32) if rows else np.zeros(0, np.uint32)), lengths


def run_fastokens(texts: list[str], path: str, keep: Callable, ids: dict) -> None:
    import fastokens

    name = f"fastokens {version('fastokens')}"
    t = time.perf_counter()
    fast = fastokens.Tokenizer.from_file(path)
    keep(f"{name} load", time.perf_counter() - t)
    for special in (False, True):
        t = time.perf_counter()
        flat, lengths = [], []
        for i in range(0, len(texts), BATCH):
            values, offsets = fast.encode_batch_flat(texts[i : i + BATCH], add_special_tokens=special)
            flat.append(np.frombuffer(values, np.uint32))
            lengths.append(np.diff(np.frombuffer(offsets, np.uint64).astype(np.int64)))
        keep(f"{name} encode_batch_flat (special tokens {special})", time.perf_counter() - t)
        ids[(name, special)] = (np.concatenate(flat), np.concatenate(lengths))


def run_gigatoken(texts: list[str], path: str, keep: Callable, ids: dict, docs: str) -> None:
    import awkward as ak
    import gigatoken

    name = f"gigatoken {version('gigatoken')}"
    t = time.perf_counter()
    with open(path, "rb") as fh:
        giga = gigatoken.Tokenizer.from_json(fh.read())
    keep(f"{name} load", time.perf_counter() - t)
    t = time.perf_counter()
    flat, lengths = [], []
    for i in range(0, len(texts), BATCH):
        arr = giga.encode_batch(texts[i : i + BATCH])
        flat.append(np.asarray(ak.flatten(arr)))
        lengths.append(np.asarray(ak.num(arr)))
    keep(f"{name} encode_batch (special tokens False)", time.perf_counter() - t)
    ids[(name, False)] = (np.concatenate(flat).astype(np.uint32), np.concatenate(lengths).astype(np.int64))
    t = time.perf_counter()
    giga.encode_files(gigatoken.JsonlFileSource([docs], field="text"))
    keep(f"{name} encode_files (its JSONL reader + encode)", time.perf_counter() - t)


def run_quicktok(texts: list[str], path: str, keep: Callable, ids: dict, threads: int) -> None:
    import quicktok

    name = f"quicktok {version('quicktok-v1')}"
    with tempfile.TemporaryDirectory() as data:
        t = time.perf_counter()
        quicktok.import_tokenizer(path, "bench", data_dir=data)
        keep(f"{name} import_tokenizer (one-time, verified)", time.perf_counter() - t)
        t = time.perf_counter()
        quick = quicktok.get_encoding("bench", data_dir=data)
        keep(f"{name} load", time.perf_counter() - t)
    t = time.perf_counter()
    flat, lengths = [], []
    for i in range(0, len(texts), BATCH):
        values, offsets = quick.encode_batch(texts[i : i + BATCH], threads=threads, with_special=True)
        flat.append(np.asarray(values, np.uint32))
        lengths.append(np.diff(np.asarray(offsets, np.int64)))
    keep(f"{name} encode_batch (special tokens False)", time.perf_counter() - t)
    ids[(name, False)] = (np.concatenate(flat), np.concatenate(lengths))


def run_tokenizers(
    texts: list[str], path: str, keep: Callable, ids: dict, specials: tuple[bool, ...]
) -> None:
    import tokenizers

    name = f"tokenizers {tokenizers.__version__}"
    t = time.perf_counter()
    tok = tokenizers.Tokenizer.from_file(path)
    if hasattr(tok, "no_truncation"):  # 0.x: methods; 1.0: properties (None turns them off)
        tok.no_truncation()
        tok.no_padding()
    else:
        tok.truncation = None
        tok.padding = None
    keep(f"{name} load", time.perf_counter() - t)
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    as_array = hasattr(tokenizers.Encoding, "ids_array")
    how = f"{encode.__name__} + {'ids_array' if as_array else 'ids'}"
    for special in specials:
        t = time.perf_counter()
        rows: list[np.ndarray] = []
        for i in range(0, len(texts), BATCH):
            encodings = encode(texts[i : i + BATCH], add_special_tokens=special)
            if as_array:
                rows.extend(e.ids_array for e in encodings)
            else:
                rows.extend(np.array(e.ids, np.uint32) for e in encodings)
        ids[(name, special)] = flat_ids(rows)
        keep(f"{name} {how} (special tokens {special})", time.perf_counter() - t)


def measure(args: argparse.Namespace, engines: list[str]) -> tuple[dict[str, list[float]], dict, float, int]:
    """Every engine's seconds per step over ``args.repeat`` interleaved repeats, in this process."""
    import pyarrow.json as pj

    texts = pj.read_json(args.docs).column("text").to_pylist()
    mb = sum(len(t.encode()) for t in texts) / 1e6
    path = os.path.join(args.tokenizer, "tokenizer.json")
    seconds: dict[str, list[float]] = {}
    ids: dict[tuple[str, bool], tuple[np.ndarray, np.ndarray]] = {}

    def keep(name: str, s: float) -> None:
        seconds.setdefault(name, []).append(s)

    for _ in range(args.repeat):
        for engine in engines:
            if engine == "fastokens":
                run_fastokens(texts, path, keep, ids)
            elif engine == "gigatoken":
                run_gigatoken(texts, path, keep, ids, args.docs)
            elif engine == "quicktok":
                run_quicktok(texts, path, keep, ids, args.threads)
            else:
                run_tokenizers(texts, path, keep, ids, (True, False) if args.special == "both" else (True,))
    return seconds, ids, mb, len(texts)


def save_ids(folder: str, ids: dict) -> None:
    os.makedirs(folder, exist_ok=True)
    for (name, special), (values, lengths) in ids.items():
        stem = os.path.join(folder, f"{name}.special-{int(special)}")
        np.save(stem + ".ids.npy", values)
        np.save(stem + ".lengths.npy", lengths)


def read_ids(folder: str) -> dict:
    out = {}
    for f in sorted(Path(folder).glob("*.ids.npy")):
        stem = str(f)[: -len(".ids.npy")]
        name, special = os.path.basename(stem).rsplit(".special-", 1)
        out[(name, special == "1")] = (np.load(f), np.load(stem + ".lengths.npy"))
    return out


def differing(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> list[int]:
    """The documents whose ids differ between two (flat ids, lengths) pairs of the same documents."""
    (av, al), (bv, bl) = a, b
    if al.shape != bl.shape:
        raise SystemExit(f"the ids cover {al.shape[0]:,} and {bl.shape[0]:,} documents: not the same texts")
    starts_a, starts_b = np.cumsum(al) - al, np.cumsum(bl) - bl
    return [
        i
        for i in range(al.shape[0])
        if al[i] != bl[i]
        or not np.array_equal(av[starts_a[i] : starts_a[i] + al[i]], bv[starts_b[i] : starts_b[i] + bl[i]])
    ]


def compare(ids: dict) -> None:
    keys = sorted(ids)
    for x, a in enumerate(keys):
        for b in keys[x + 1 :]:
            if a[1] == b[1]:
                differ = differing(ids[a], ids[b])
                print(f"documents whose ids differ ({a[0]} vs {b[0]}, special tokens {a[1]}): {len(differ):,}"
                      + (f"; first: {differ[:5]}" if differ else ""))  # fmt: skip


def report(seconds: dict[str, list[float]], mb: float, docs: int, head: str) -> None:
    runs = max(len(v) for v in seconds.values())
    print(f"{docs:,} documents, {mb:.1f} MB, {runs} interleaved repeats, {head}")
    print("| step | best s | median s | best MB/s |\n|---|---|---|---|")
    for name, values in seconds.items():
        best = min(values)
        rate = "" if name.endswith(" load") or "(one-time" in name else f"{mb / best:.1f}"
        print(f"| {name} | {best:.2f} | {statistics.median(values):.2f} | {rate} |")


def across_envs(args: argparse.Namespace) -> None:
    """Each repeat, this script under every ``--env`` interpreter in turn (one repeat each, fresh processes)."""
    seconds: dict[str, list[float]] = {}
    loads, meta = [], {}
    child_env = {**os.environ, "RAYON_NUM_THREADS": str(args.threads)}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeat):
            for k, spec in enumerate(args.env):
                python, _, engines = spec.partition("=")
                out = os.path.join(tmp, f"{r}-{k}.json")
                cmd = [python, os.path.abspath(__file__), args.docs, args.tokenizer, "--repeat", "1"]
                cmd += ["--engines", engines or "fastokens", "--threads", str(args.threads), "--json", out]
                cmd += ["--special", args.special]
                if r == 0 and args.ids_dir:
                    cmd += ["--ids-dir", args.ids_dir]
                loads.append(load_average())
                subprocess.run(cmd, check=True, env=child_env)
                with open(out) as fh:
                    got = json.load(fh)
                meta = got
                for name, values in got["seconds"].items():
                    seconds.setdefault(name, []).extend(values)
    report(
        seconds,
        meta["mb"],
        meta["docs"],
        f"{args.threads} threads, load average at each start: {'; '.join(loads)}",
    )
    if args.ids_dir:
        compare(read_ids(args.ids_dir))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("docs")
    ap.add_argument("tokenizer")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--engines", default=None, help=f"comma-separated, of {', '.join(ENGINES)} "
                    "(default: fastokens, and gigatoken where it is installed)")  # fmt: skip
    ap.add_argument("--special", choices=("true", "both"), default="true",
                    help="tokenizers: with special tokens only (packtools' raw-text call) or also without")  # fmt: skip
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--ids-dir", help="write every engine's ids here (and compare all the ids found there)")
    ap.add_argument("--env", action="append", default=[], metavar="PYTHON=ENGINES",
                    help="interleave this interpreter's run of ENGINES with the other --env ones")  # fmt: skip
    ap.add_argument("--json", help=argparse.SUPPRESS)  # a child's result, for --env
    args = ap.parse_args()
    set_threads(args.threads)
    if args.env:
        across_envs(args)
        return 0
    if args.engines is None:
        import importlib.util

        engines = ["fastokens"] + (["gigatoken"] if importlib.util.find_spec("gigatoken") else [])
    else:
        engines = [e.strip() for e in args.engines.split(",") if e.strip()]
        unknown = sorted(set(engines) - set(ENGINES))
        if unknown:
            ap.error(f"--engines: unknown {', '.join(unknown)}; choose from {', '.join(ENGINES)}")
    load = load_average()
    seconds, ids, mb, docs = measure(args, engines)
    if args.ids_dir:
        save_ids(args.ids_dir, ids)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"seconds": seconds, "mb": mb, "docs": docs}, fh)
        return 0
    report(
        seconds,
        mb,
        docs,
        f"{args.threads} threads, load average {load} at the start, {load_average()} at the end",
    )
    compare(read_ids(args.ids_dir) if args.ids_dir else ids)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
