"""Shard-parallel packing: cut inputs into shards, pack each on its own, keep a manifest, rerun idempotently.

A *shard* is a row range of one input file (never more than one file).  With ``shard_rows=N`` a file of ``R``
rows becomes ranges of at least ``N`` rows (one range if ``R < N``), cut at parquet row-group boundaries where
the groups are smaller than ``N`` (see :func:`row_ranges`); with ``shard_rows=None`` each file is one shard.  Packing shards of >= 100k rows independently costs well under 0.01% more rows than one
global plan, so shards can run anywhere, in any order.  Each shard is packed by :func:`packtools.pack_table` and
written atomically to ``OUT/<shard id>.parquet``; the id comes from the input path and the row range, so it is
the same in every run.  The parquet footer records the shard's id, config, input fingerprint (size and mtime)
and stats; ``OUT/manifest.json`` (written atomically at the end) lists every shard, its input, status, output
size and stats, and the totals.  A rerun skips a shard whose output exists with the same id, config, input
fingerprint and (if the manifest lists it) size; anything else is packed again.  Temp files left by a worker
that died while writing are removed at the start of a run (one run at a time per output folder).

>>> import os, tempfile, pyarrow as pa, pyarrow.parquet as pq
>>> d = tempfile.mkdtemp()
>>> pq.write_table(pa.table({"input_ids": [[1, 2, 3], [4, 5], [6]]}), os.path.join(d, "a.parquet"))
>>> report = pack_shards([os.path.join(d, "a.parquet")], os.path.join(d, "out"), max_length=4)
>>> [(s.status, s.stats["rows_out"], s.stats["rows_over_bound"]) for s in report.shards]
[('packed', 2, 0)]
>>> [s.status for s in pack_shards([os.path.join(d, "a.parquet")], os.path.join(d, "out"), 4).shards]
['skipped']
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from .._atomic import atomic_path
from ..constants import MANIFEST
from ..core.arrow import is_list_type
from ..core.pack import pack_table, read_columns
from ..core.plan import check_max_length, check_strategy, plan
from ..errors import PackingError
from ..io.files import read_table, write_table
from .executors import Executor, get_executor

FORMAT = "packtools-shards/1"
META_KEY = b"packtools.shard"
DEFAULT_SHARD_ROWS = 100_000
FAIL_ENV = "PACKTOOLS_FAIL_SHARDS"  # fault injection: "ID_PART[:ATTEMPTS],..." (read by the driver)


@dataclass(frozen=True)
class ShardJob:
    """Everything a worker needs to pack one shard (picklable, small)."""

    shard_id: str
    input: str
    row_start: int
    row_stop: int
    fingerprint: dict[str, int]
    config: dict[str, Any]
    output: str
    attempt: int = 0
    fail_attempts: int = 0


@dataclass
class ShardResult:
    """What happened to one shard: ``packed``, ``skipped`` (already done) or ``failed`` (``error`` says why)."""

    shard_id: str
    input: str
    row_start: int
    row_stop: int
    output: str
    status: str
    attempts: int = 0
    output_bytes: int = 0
    seconds: float = 0.0
    stats: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


@dataclass
class ShardReport:
    """The outcome of :func:`pack_shards`: one :class:`ShardResult` per shard, in input order, and totals."""

    out_dir: str
    config: dict[str, Any]
    executor: str
    shards: list[ShardResult]
    seconds: float

    @property
    def failed(self) -> list[ShardResult]:
        return [s for s in self.shards if s.status == "failed"]

    @property
    def ok(self) -> bool:
        return not self.failed

    @property
    def manifest_path(self) -> str:
        return os.path.join(self.out_dir, MANIFEST)

    def totals(self) -> dict[str, Any]:
        """Sums over the shards that landed; ``rows_over_bound`` is against ``ceil(tokens_kept / max_length)``
        of all of them together, ``rows_over_shard_bounds`` against the sum of the per-shard bounds."""
        done = [s.stats for s in self.shards if s.status != "failed"]
        keys = ("rows_in", "rows_out", "tokens_in", "tokens_kept", "tokens_dropped")
        tot: dict[str, Any] = {k: sum(int(d[k]) for d in done) for k in keys}
        bound = -(-tot["tokens_kept"] // self.config["max_length"])
        tot["lower_bound"] = bound
        tot["rows_over_bound"] = tot["rows_out"] - bound
        tot["rows_over_shard_bounds"] = sum(int(d["rows_over_bound"]) for d in done)
        tot["shards"] = len(self.shards)
        tot["packed"] = sum(s.status == "packed" for s in self.shards)
        tot["skipped"] = sum(s.status == "skipped" for s in self.shards)
        tot["failed"] = len(self.failed)
        return tot


SUFFIXES = (".parquet", ".arrow", ".feather", ".ipc")


def list_inputs(inputs: Sequence[str | os.PathLike[str]]) -> list[str]:
    """Absolute paths of the input files; a folder stands for its ``.parquet``/``.arrow`` files, sorted."""
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    paths: list[str] = []
    for item in inputs:
        p = os.path.abspath(os.fspath(item))
        if not os.path.exists(p):
            raise FileNotFoundError(f"input {p!r} does not exist.")
        if os.path.isdir(p):
            found = sorted(os.path.join(p, n) for n in os.listdir(p) if n.endswith(SUFFIXES))
            if not found:
                raise PackingError(f"input folder {p!r} holds no .parquet or .arrow file.")
            paths.extend(found)
        elif p.endswith(SUFFIXES):
            paths.append(p)
        else:
            raise PackingError(f"input {p!r}: unknown format; give tokenized .parquet or .arrow files.")
    if not paths:
        raise PackingError("inputs is empty; give at least one tokenized .parquet or .arrow file.")
    if len(set(paths)) != len(paths):
        raise PackingError("inputs name the same file twice; every file is packed once.")
    return paths


def check_schema(path: str, columns: Sequence[str] | None) -> None:
    """Fail early (before any shard runs) when the columns to pack are missing or not token lists."""
    schema = pq.read_schema(path) if path.endswith(".parquet") else read_table(path).schema
    names = list(columns) if columns else [n for n in schema.names if n != "seq_lengths"]
    missing = [c for c in names if c not in schema.names]
    if missing:
        raise PackingError(f"columns {missing} are not in {path!r}; it has {schema.names}.")
    not_lists = [n for n in names if not is_list_type(schema.field(n).type)]
    if not_lists:
        raise PackingError(
            f"{path!r}: columns {not_lists} are not token lists, so they cannot be packed. Pack tokenized files "
            f"(name the token columns with columns=[...]), or tokenize first (packtools pack).",
            param="columns",
        )


# -- planning shards ---------------------------------------------------------------------------------
def row_blocks(path: str) -> list[int]:
    """Row counts of a file's natural blocks: parquet row groups (a range inside one decodes all of it), or
    one block for an Arrow IPC file (memory-mapped, sliced for free)."""
    if path.endswith(".parquet"):
        md = pq.ParquetFile(path).metadata
        return [md.row_group(g).num_rows for g in range(md.num_row_groups)] or [0]
    return [read_table(path).num_rows]


def row_ranges(
    num_rows: int, shard_rows: int | None, blocks: Sequence[int] | None = None
) -> list[tuple[int, int]]:
    """Row ranges of at least ``shard_rows`` rows covering ``[0, num_rows)`` (one range if it has fewer).

    Cuts fall on block boundaries (``blocks``: row counts, e.g. parquet row groups) as soon as a range has
    ``shard_rows`` rows and at least as many remain; a stretch of ``2 * shard_rows`` rows or more without a
    boundary is cut evenly inside.  Without blocks: ``max(1, num_rows // shard_rows)`` equal ranges.

    >>> row_ranges(250, 100)
    [(0, 125), (125, 250)]
    >>> row_ranges(250, 100, blocks=[64, 64, 64, 58])
    [(0, 128), (128, 250)]
    >>> row_ranges(50, 100), row_ranges(7, None)
    ([(0, 50)], [(0, 7)])
    """
    if not shard_rows or num_rows <= shard_rows:
        return [(0, num_rows)]
    cuts, pos = [0], 0
    for size in blocks if blocks is not None else [num_rows]:
        pos += size
        if pos - cuts[-1] >= shard_rows and num_rows - pos >= shard_rows:
            cuts.append(pos)
    cuts.append(num_rows)
    ranges = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        k = max(1, (b - a) // shard_rows)
        ranges += [(a + (b - a) * i // k, a + (b - a) * (i + 1) // k) for i in range(k)]
    return ranges


def shard_id(path: str, row_start: int, row_stop: int) -> str:
    """A stable, file-name-safe id from the input's absolute path and the row range."""
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", os.path.splitext(os.path.basename(path))[0])[:60]
    digest = hashlib.sha1(f"{os.path.abspath(path)}:{row_start}:{row_stop}".encode()).hexdigest()[:10]
    return f"{stem}.{row_start}-{row_stop}.{digest}"


def fingerprint(path: str) -> dict[str, int]:
    st = os.stat(path)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _fail_attempts(sid: str) -> int:
    """Fault injection for tests: how many attempts of shard ``sid`` must fail (``FAIL_ENV``)."""
    spec = os.environ.get(FAIL_ENV, "")
    for item in filter(None, (s.strip() for s in spec.split(","))):
        part, _, times = item.partition(":")
        if part and part in sid:
            return int(times) if times else 1_000_000
    return 0


# -- one shard (runs in a worker) --------------------------------------------------------------------
class InjectedFailure(RuntimeError):
    """Raised by a worker when :data:`FAIL_ENV` asks a shard to fail (tests of failure handling)."""


def read_shard(path: str, row_start: int, row_stop: int, columns: Sequence[str] | None) -> pa.Table:
    """Rows ``[row_start, row_stop)`` of a parquet (only the row groups needed) or Arrow IPC file."""
    if path.endswith(".parquet"):
        pf = pq.ParquetFile(path, memory_map=True)
        md = pf.metadata
        groups, first, pos = [], None, 0
        for g in range(md.num_row_groups):
            n = md.row_group(g).num_rows
            if pos < row_stop and pos + n > row_start:
                groups.append(g)
                first = pos if first is None else first
            pos += n
        table = pf.read_row_groups(groups, columns=list(columns) if columns else None)
        return table.slice(row_start - (first or 0), row_stop - row_start)
    table = read_table(path)
    if columns:
        missing = [c for c in columns if c not in table.column_names]
        if missing:
            raise PackingError(f"columns {missing} are not in {path!r}; it has {table.column_names}.")
        table = table.select(list(columns))
    return table.slice(row_start, row_stop - row_start)


def run_shard(job: ShardJob) -> dict[str, Any]:
    """Pack one shard and write it atomically; returns its stats.  Module-level so pools and Ray can run it."""
    start = time.perf_counter()
    if job.attempt < job.fail_attempts:
        raise InjectedFailure(
            f"shard {job.shard_id}: injected failure (attempt {job.attempt + 1}) by ${FAIL_ENV}"
        )
    cfg = job.config
    table = read_shard(job.input, job.row_start, job.row_stop, cfg["columns"])
    _, lengths = read_columns(table, cfg["columns"])
    p = plan(lengths, cfg["max_length"], cfg["strategy"])
    packed = pack_table(table, cfg["max_length"], cfg["strategy"], cfg["columns"], plan=p)
    if fingerprint(job.input) != job.fingerprint:
        raise PackingError(f"input {job.input!r} changed while shard {job.shard_id} was packed; run again.")
    stats = {k: v for k, v in p.summary().items() if k not in ("strategy", "max_length")}
    meta = {
        "format": FORMAT,
        "id": job.shard_id,
        "input": job.input,
        "row_start": job.row_start,
        "row_stop": job.row_stop,
        "fingerprint": job.fingerprint,
        "config": cfg,
        "stats": stats,
    }
    packed = packed.replace_schema_metadata({**(packed.schema.metadata or {}), META_KEY: json.dumps(meta)})
    write_table(packed, job.output)
    return {
        "stats": stats,
        "output_bytes": os.path.getsize(job.output),
        "seconds": time.perf_counter() - start,
    }


# -- the driver ----------------------------------------------------------------------------------------
def _load_manifest(out_dir: str) -> dict[str, dict[str, Any]]:
    try:
        with open(os.path.join(out_dir, MANIFEST)) as fh:
            data = json.load(fh)
        return {s["id"]: s for s in data.get("shards", [])}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _already_done(job: ShardJob, listed: dict[str, Any] | None) -> dict[str, Any] | None:
    """The stored stats if ``job.output`` is a complete output of this very shard and config, else None."""
    if not os.path.exists(job.output):
        return None
    try:
        meta = json.loads((pq.read_schema(job.output).metadata or {})[META_KEY])
    except (OSError, ValueError, KeyError, pa.ArrowException):
        return None
    if (
        meta.get("id") != job.shard_id
        or meta.get("config") != job.config
        or meta.get("fingerprint") != job.fingerprint
    ):
        return None
    size = os.path.getsize(job.output)
    if listed is not None and listed.get("output_bytes") not in (None, size):
        return None
    return {"stats": meta["stats"], "output_bytes": size}


def write_manifest(report: ShardReport) -> str:
    """Write ``OUT/manifest.json`` atomically and return its path."""
    data = {
        "format": FORMAT,
        "config": report.config,
        "executor": report.executor,
        "seconds": round(report.seconds, 3),
        "totals": report.totals(),
        "inputs": list(dict.fromkeys(s.input for s in report.shards)),
        "shards": [
            {"id": s.shard_id, **{k: v for k, v in asdict(s).items() if k != "shard_id"}}
            for s in report.shards
        ],
    }
    for s in data["shards"]:
        s["output"] = os.path.basename(s["output"])
    path = report.manifest_path
    with atomic_path(path) as tmp, open(tmp, "w") as fh:
        json.dump(data, fh, indent=1)
    return path


def pack_shards(
    inputs: Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    max_length: int,
    strategy: str = "bfd",
    columns: Sequence[str] | None = None,
    *,
    shard_rows: int | None = DEFAULT_SHARD_ROWS,
    executor: str | Executor = "local",
    workers: int | None = None,
    address: str | None = None,
    retries: int = 2,
) -> ShardReport:
    """Pack ``inputs`` (tokenized ``.parquet``/``.arrow`` files) shard by shard into ``out_dir``.

    ``executor`` is ``"local"`` (in this process), ``"pool"`` (``workers`` spawned processes) or ``"ray"``
    (one Ray task per shard; ``address`` of a cluster, or a local runtime with ``workers`` CPUs), or an
    :class:`~packtools.pipeline.executors.Executor`.  The output is the same shard by shard whichever runs it.  A shard
    that fails is tried again up to ``retries`` times; one that keeps failing is reported (``status="failed"``,
    ``error``) while the others land.  Returns a :class:`ShardReport`; the manifest is in ``out_dir``.
    """
    max_length = check_max_length(max_length)
    strategy = check_strategy(strategy)
    if isinstance(columns, str):
        columns = [columns]
    if shard_rows is not None and (
        isinstance(shard_rows, bool) or not isinstance(shard_rows, int) or shard_rows < 0
    ):
        raise PackingError(
            f"shard_rows={shard_rows!r} must be a positive int (or None/0: one shard per file)."
        )
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise PackingError(f"retries={retries!r} must be an int >= 0.")
    paths = list_inputs(inputs)
    for p in paths:
        check_schema(p, columns)
    out_dir = os.path.abspath(os.fspath(out_dir))
    os.makedirs(out_dir, exist_ok=True)
    config = {
        "max_length": max_length,
        "strategy": strategy,
        "columns": list(columns) if columns else None,
        "shard_rows": shard_rows or None,
    }
    start = time.perf_counter()
    jobs = []
    for p in paths:
        fp = fingerprint(p)
        blocks = row_blocks(p)
        for a, b in row_ranges(sum(blocks), shard_rows, blocks):
            sid = shard_id(p, a, b)
            out = os.path.join(out_dir, sid + ".parquet")
            jobs.append(ShardJob(sid, p, a, b, fp, config, out, 0, _fail_attempts(sid)))
    for name in os.listdir(out_dir):  # temp files of writers that died (io.write_table's prefix)
        if name.startswith(".packtools-") and name.endswith(".parquet"):
            os.unlink(os.path.join(out_dir, name))
    listed = _load_manifest(out_dir)
    results = {
        j.shard_id: ShardResult(j.shard_id, j.input, j.row_start, j.row_stop, j.output, "failed")
        for j in jobs
    }
    todo = []
    for j in jobs:
        done = _already_done(j, listed.get(j.shard_id))
        if done is not None:
            results[j.shard_id] = replace(results[j.shard_id], status="skipped", **done)
        else:
            if os.path.exists(j.output):  # stale (other config or input): never leave it looking current
                os.unlink(j.output)
            todo.append(j)
    ex = get_executor(executor, workers, address)
    try:
        for attempt in range(retries + 1):
            if not todo:
                break
            failed = []
            for i, outcome in ex.run(run_shard, todo):
                r = results[todo[i].shard_id]
                r.attempts = attempt + 1
                if isinstance(outcome, BaseException):
                    r.error = f"{type(outcome).__name__}: {outcome}"
                    failed.append(replace(todo[i], attempt=attempt + 1))
                else:
                    r.status, r.error = "packed", None
                    r.stats, r.output_bytes, r.seconds = (
                        outcome["stats"],
                        outcome["output_bytes"],
                        outcome["seconds"],
                    )
            todo = failed
    finally:
        if ex is not executor:
            ex.close()
    report = ShardReport(
        out_dir, config, ex.name, [results[j.shard_id] for j in jobs], time.perf_counter() - start
    )
    write_manifest(report)
    return report


def format_report(report: ShardReport) -> str:
    """A short text summary: one line per shard, then the totals."""
    lines = [f"{'shard':<48} {'status':>8} {'rows in':>10} {'rows out':>9} {'over bound':>10}"]
    for s in report.shards:
        st = s.stats
        lines.append(
            f"{s.shard_id:<48} {s.status:>8} {st.get('rows_in', s.row_stop - s.row_start):>10,} "
            f"{st.get('rows_out', 0):>9,} {st.get('rows_over_bound', 0):>10,}"
        )
        if s.error:
            lines.append(f"    error after {s.attempts} attempt(s): {s.error}")
    t = report.totals()
    lines.append(
        f"{t['shards']} shards ({t['packed']} packed, {t['skipped']} skipped, {t['failed']} failed) with "
        f"{report.executor} in {report.seconds:.2f} s: {t['rows_in']:,} rows -> {t['rows_out']:,} packed rows, "
        f"lower bound {t['lower_bound']:,}, {t['rows_over_bound']:,} rows over it "
        f"({100 * t['rows_over_bound'] / max(1, t['lower_bound']):.4f}%)"
    )
    lines.append(f"manifest: {report.manifest_path}")
    return "\n".join(lines)
