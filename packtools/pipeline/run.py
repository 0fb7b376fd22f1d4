"""The file-packing engine behind ``packtools pack`` and :func:`packtools.pack_files`.

One run, whatever executes it:

1. **Discover** the input files and cut them into parts (parquet row groups, JSON-lines byte ranges, whole
   files; :func:`packtools.io.files.split_file`).
2. **Stage** every part on the executor: read it in blocks, tokenize raw rows (or check and cast tokenized
   ones), write its token columns to a staged Arrow file plus a sidecar of row lengths
   (:mod:`packtools.pipeline.stage`).  Staged parts are cached by a key of everything that decides them.
3. **Plan** on the driver, from lengths alone (O(rows) memory, no token touched): apply the ``overlong``
   policy, optionally drop rows without a label token, and make **one global plan** (``plan="shards"``
   instead plans each part on its own, for lengths that do not fit one machine; see
   :data:`PLANS`).
4. **Gather and write** on the executor: the plan cut into blocks of at most ``shard_tokens`` tokens, each
   gathered from the memory-mapped staged files and written as one shard
   (:mod:`packtools.pipeline.gather`).
5. **Install**: ``manifest.json``, ``state.json`` and ``dataset_info.json`` are written and the finished folder
   is renamed to ``out`` (see :mod:`packtools.pipeline.workspace` for the lock and crash safety).

The executor (``local``, ``pool``, ``ray``) decides where stages 2 and 4 run and nothing else: the output
folder is the same bytes whichever runs it, and ``datasets.load_from_disk(out)`` opens it.  The manifest holds
only what decides the output (configuration, input fingerprints, packtools and format versions) and its
statistics, so a rerun whose fingerprint matches does nothing; timings are returned, not written.

Preference data (``prompt``/``chosen``/``rejected``) is staged the same way and then written as pairs by
:func:`packtools.pipeline.preference.write_packed_preference`: each pair's ``[prompt + chosen][prompt +
rejected]`` side by side in a row, never split (``input_ids``, ``completion_mask``, ``seq_lengths``; see
:func:`packtools.dpo.pack_preference`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from .._progress import progress
from ..constants import __version__
from ..core.plan import PackPlan, check_max_length, check_strategy
from ..core.plan import plan as make_plan
from ..errors import PackingError
from ..io.files import InputFile, Part, find_inputs, read_schema, skipped_notes, split_file
from ..io.fingerprint import cache_key
from ..io.manifest import MANIFEST_FORMAT, read_manifest, write_manifest
from .char_drops import check_on_unencodable
from .executors import EXECUTORS, Executor, get_executor, is_transient
from .fast_tokenize import check_audit_rate, check_engine, engine_key, engine_summary
from .formats import FORMATS, input_columns, output_columns
from .gather import WriteJob, run_token, shard_name, write_block, write_dataset_files
from .outcheck import check_out, check_replaceable
from .schema import data_format, known_columns, token_schema
from .stage import load_sidecar, stage_part
from .stage_cache import adopt_cached, stage_jobs
from .summary import tokenizer_timings
from .workspace import Workspace, checkpoint, left_behind_notes, tidy_after_dead_run

OVERLONG = ("truncate", "drop", "split")
#: ``global``: one plan over every row (the default; fewest rows).  ``shards``: each part planned on its own
#: and the plans put one after the other; costs a few rows per part (< 0.01% with parts of >= 100k rows).
PLANS = ("global", "shards")


@dataclass(frozen=True)
class PipelineConfig:
    """Everything that decides the output.  Where it runs (executor, workers) and ``quiet`` do not, and are not
    fingerprinted."""

    max_length: int
    strategy: str = "bfd"
    format: str | None = None
    tokenizer: str | None = None
    overlong: str | None = None
    columns: tuple[str, ...] | None = None
    add_eos: bool = True
    max_prompt_length: int | None = None
    shuffle: bool = False
    seed: int = 0
    shard_tokens: int = 1 << 24
    plan: str = "global"
    drop_unlabeled: bool = False
    part_rows: int = 1 << 17
    part_bytes: int = 1 << 26
    # auto | fast | transformers: the same ids either way (proven); fingerprinted with the engine's version
    tokenizer_engine: str = "auto"
    tokenizer_audit: float = 0.001  # share of rows compared with transformers after the proof
    on_unencodable: str = "report"  # characters the tokenizer cannot encode: report | error

    def __post_init__(self) -> None:
        check_max_length(self.max_length)
        check_engine(self.tokenizer_engine)
        check_audit_rate(self.tokenizer_audit)
        check_on_unencodable(self.on_unencodable)
        check_strategy(self.strategy)
        if self.format is not None and self.format not in FORMATS:
            raise PackingError(
                f"format={self.format!r} is unknown; use one of {', '.join(FORMATS)}.", param="format"
            )
        if self.overlong is not None and self.overlong not in OVERLONG:
            raise PackingError(
                f"overlong={self.overlong!r} is unknown; use one of {', '.join(OVERLONG)}.", param="overlong"
            )
        if self.overlong == "split" and self.strategy == "bfd":
            raise PackingError(
                "overlong='split' needs strategy='bfd_split' (or 'wrapped'); bfd keeps one piece per sequence.",
                param="overlong",
            )
        if self.max_prompt_length is not None and not 0 < self.max_prompt_length < self.max_length:
            raise PackingError(
                f"max_prompt_length={self.max_prompt_length} must be in [1, max_length={self.max_length}).",
                param="max_prompt_length",
            )
        if self.plan not in PLANS:
            raise PackingError(f"plan={self.plan!r} is unknown; use one of {', '.join(PLANS)}.", param="plan")
        for name in ("shard_tokens", "part_rows", "part_bytes"):
            if getattr(self, name) < 1:
                raise PackingError(f"{name} must be >= 1, got {getattr(self, name)}.", param=name)

    @property
    def overlong_policy(self) -> str:
        """``overlong`` or its default: ``truncate`` for bfd, ``split`` for bfd_split and wrapped."""
        return self.overlong or ("truncate" if self.strategy == "bfd" else "split")


@dataclass
class PipelineResult:
    """What a run did: the output folder, its statistics (also in the manifest), whether the manifest made it
    a no-op, and how long each stage took where (``timings``: not in the manifest, which must not depend on
    where the run went)."""

    out: str
    stats: dict[str, Any]
    cached: bool = False
    manifest: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, Any] = field(default_factory=dict)
    #: Things to tell the user that did not fail the run (e.g. files of the old output that could not be removed).
    notes: list[str] = field(default_factory=list)


# -- fingerprint and manifest ------------------------------------------------------------------------------
def fingerprint(files: Sequence[InputFile], config: PipelineConfig) -> dict[str, Any]:
    """What the manifest compares: config, input files (path, size, mtime), tokenizer files, versions."""
    from .tokenizer_dir import tokenizer_fingerprint

    cfg = asdict(config)
    cfg["columns"] = list(config.columns) if config.columns else None
    cfg["overlong"] = config.overlong_policy
    cfg["tokenizer_engine"] = engine_key(config.tokenizer_engine)  # S15: another engine is another output
    tok = tokenizer_fingerprint(config.tokenizer) if config.tokenizer else None
    body = {
        "manifest_format": MANIFEST_FORMAT,
        "packtools_version": __version__,
        "config": cfg,
        "inputs": [f.fingerprint() for f in files],
        "tokenizer_sha256": tok,
    }
    digest = cache_key("pack_files", MANIFEST_FORMAT, config=cfg, inputs=body["inputs"], tokenizer=tok)
    return {"fingerprint": digest, **body}


# -- checks before any work --------------------------------------------------------------------------------
# -- running jobs on an executor ---------------------------------------------------------------------------
def run_jobs(
    ex: Executor, fn: Callable[[Any], Any], jobs: Sequence[Any], desc: str, quiet: bool, retries: int
) -> list[Any]:
    """Run ``fn`` over ``jobs`` on ``ex``; results in job order.  A job whose worker was lost is tried again
    (up to ``retries`` times); any other exception is raised at once (it would fail again)."""
    results: list[Any] = [None] * len(jobs)
    todo = list(range(len(jobs)))
    bar = progress(len(jobs), desc, unit="parts" if desc == "stage" else "shards", quiet=quiet)
    try:
        for attempt in range(retries + 1):
            lost = []
            for k, outcome in ex.run(fn, [jobs[i] for i in todo]):
                i = todo[k]
                if isinstance(outcome, BaseException):
                    if is_transient(outcome) and attempt < retries:
                        lost.append(i)
                        continue
                    raise outcome
                results[i] = outcome
                bar.update(1)
                checkpoint(f"{desc}:{sum(r is not None for r in results)}")
            todo = sorted(lost)
            if not todo:
                break
    finally:
        bar.close()
    return results


# -- planning ----------------------------------------------------------------------------------------------
def apply_overlong(lengths: np.ndarray, max_length: int, policy: str) -> tuple[np.ndarray, dict[str, int]]:
    """Lengths to plan with under ``policy``, and what it cut.

    >>> eff, counts = apply_overlong(np.array([5, 2, 9]), 4, "drop")
    >>> eff.tolist(), counts["rows_dropped_overlong"], counts["tokens_dropped_overlong"]
    ([0, 2, 0], 2, 14)
    """
    over = lengths > max_length
    excess = np.maximum(lengths - max_length, 0)
    counts = {
        "rows_truncated": 0,
        "tokens_truncated": 0,
        "rows_dropped_overlong": 0,
        "tokens_dropped_overlong": 0,
        "rows_split": 0,
    }
    if policy == "truncate":
        counts["rows_truncated"] = int(over.sum())
        counts["tokens_truncated"] = int(excess.sum())
        return np.minimum(lengths, max_length), counts
    if policy == "drop":
        counts["rows_dropped_overlong"] = int(over.sum())
        counts["tokens_dropped_overlong"] = int(lengths[over].sum())
        return np.where(over, 0, lengths), counts
    counts["rows_split"] = int(over.sum())
    return lengths, counts


def plan_parts(eff: np.ndarray, bounds: Sequence[int], config: PipelineConfig) -> PackPlan:
    """One global plan of ``eff`` or, with ``config.plan == "shards"``, one plan per part
    (rows ``bounds[i]:bounds[i + 1]``) put one after the other."""
    if config.plan == "global" or len(bounds) <= 2:
        p = make_plan(eff, config.max_length, config.strategy)
    else:
        plans = [
            make_plan(eff[a:b], config.max_length, config.strategy) for a, b in zip(bounds[:-1], bounds[1:])
        ]
        seg_offsets = np.cumsum([0] + [q.num_segments for q in plans])
        p = PackPlan(
            config.max_length,
            config.strategy,
            np.concatenate([q.seg_source + a for q, a in zip(plans, bounds[:-1])]),
            np.concatenate([q.seg_start for q in plans]),
            np.concatenate([q.seg_length for q in plans]),
            np.concatenate([[0]] + [q.row_offsets[1:] + s for q, s in zip(plans, seg_offsets[:-1])]).astype(
                np.int64
            ),
            eff,
        )
    return p.shuffled(config.seed) if config.shuffle else p


def write_jobs(
    p: PackPlan,
    data: Sequence[str],
    bounds: Sequence[int],
    config: PipelineConfig,
    columns: Sequence[str],
    folder: str,
    run: str = "",
) -> list[WriteJob]:
    """The plan cut into blocks of at most ``shard_tokens`` tokens, one :class:`WriteJob` each."""
    blocks = p.row_blocks(config.shard_tokens) or [(0, 0)]
    starts = np.asarray(bounds[:-1], np.int64)
    jobs = []
    for i, (r0, r1) in enumerate(blocks):
        s0, s1 = int(p.row_offsets[r0]), int(p.row_offsets[r1])
        src = p.seg_source[s0:s1]
        parts = np.unique(np.searchsorted(starts, src, side="right") - 1) if s1 > s0 else np.array([0])
        jobs.append(
            WriteJob(
                os.path.join(folder, shard_name(i, len(blocks), run)),
                config.max_length,
                config.strategy,
                tuple(columns),
                tuple((data[k], int(bounds[k]), int(bounds[k + 1] - bounds[k])) for k in parts),
                src,
                p.seg_start[s0:s1],
                p.seg_length[s0:s1],
                p.row_offsets[r0 : r1 + 1] - s0,
            )
        )
    return jobs


# -- the whole run -----------------------------------------------------------------------------------------
def pack_files(
    inputs: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    max_length: int,
    strategy: str = "bfd",
    *,
    executor: str | Executor = "local",
    workers: int | None = None,
    address: str | None = None,
    retries: int = 2,
    num_proc: int | None = None,
    quiet: bool = True,
    **options: Any,
) -> PipelineResult:
    """Tokenize (if needed), truncate or filter, pack and write ``inputs`` to the folder ``out``.

    ``options`` are the other fields of :class:`PipelineConfig` (``tokenizer``, ``format``, ``overlong``,
    ``columns``, ``add_eos``, ``max_prompt_length``, ``shuffle``, ``seed``, ``shard_tokens``, ``plan``,
    ``drop_unlabeled``, ...); see the module docstring for the stages and the output.  ``executor``
    (``"local"``, ``"pool"`` with ``workers`` processes, ``"ray"`` at ``address`` or a local Ray with
    ``workers`` CPUs, or an :class:`~packtools.pipeline.executors.Executor`) runs the read/tokenize and
    gather/write stages and changes nothing in the output.  ``num_proc=N`` is ``executor="pool",
    workers=N``.  ``quiet=False`` shows progress.

    >>> import os, tempfile, pyarrow as pa, pyarrow.parquet as pq
    >>> d = tempfile.mkdtemp()
    >>> pq.write_table(pa.table({"input_ids": [[1, 2, 3], [4, 5], [6]]}), os.path.join(d, "in.parquet"))
    >>> res = pack_files(os.path.join(d, "in.parquet"), os.path.join(d, "out"), max_length=4)
    >>> res.stats["rows_out"], res.stats["fill"], sorted(os.listdir(res.out))[0].endswith("-00000-of-00001.arrow")
    (2, 0.75, True)
    >>> pack_files(os.path.join(d, "in.parquet"), os.path.join(d, "out"), max_length=4).cached
    True
    """
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    config = PipelineConfig(max_length=max_length, strategy=strategy, **options)
    return run_pipeline(
        inputs,
        out,
        config,
        executor=executor,
        workers=workers,
        address=address,
        retries=retries,
        num_proc=num_proc,
        quiet=quiet,
    )


def run_pipeline(
    inputs: Sequence[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    config: PipelineConfig,
    *,
    executor: str | Executor = "local",
    workers: int | None = None,
    address: str | None = None,
    retries: int = 2,
    num_proc: int | None = None,
    quiet: bool = True,
) -> PipelineResult:
    """:func:`pack_files` with a ready :class:`PipelineConfig`."""
    started = time.perf_counter()
    if isinstance(executor, str) and executor not in EXECUTORS:
        raise PackingError(
            f"executor={executor!r} is unknown; use one of {', '.join(EXECUTORS)}.", param="executor"
        )
    if num_proc is not None and num_proc > 1 and executor == "local":
        executor, workers = "pool", num_proc
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise PackingError(f"retries={retries!r} must be an int >= 0.", param="retries")
    out = os.path.abspath(os.fspath(out))
    if config.tokenizer is not None:
        from .tokenizer_dir import check_tokenizer_dir

        tok_dir = check_tokenizer_dir(config.tokenizer)
        if tok_dir != config.tokenizer:
            config = PipelineConfig(**{**asdict(config), "tokenizer": tok_dir})
    files, skipped = find_inputs(inputs)
    check_out(out, [os.fspath(i) for i in inputs], files)
    fp = fingerprint(files, config)
    if skipped:  # listed in the manifest (not fingerprinted: they decide nothing in the output)
        fp["inputs_skipped"] = [s.to_dict() for s in skipped]
    previous = read_manifest(out)
    if previous is not None and previous.get("fingerprint") == fp["fingerprint"]:
        tidy_after_dead_run(out)  # a run killed after installing this output may have left its work folder
        return PipelineResult(
            out, previous.get("stats", {}), cached=True, manifest=previous, notes=skipped_notes(skipped)
        )
    check_replaceable(out)
    Workspace(out).refuse_if_held()  # before loading the tokenizer: a busy out fails at once
    early: dict[str, Any] = {}  # seconds before staging, itemized in the summary
    fmt = data_format(files, config)
    if fmt == "preference" and config.overlong == "split":
        raise PackingError(
            "overlong='split' does not apply to preference data; use truncate or drop.", param="overlong"
        )
    if fmt != "tokenized":
        if config.tokenizer is None:
            raise PackingError(
                f"format={fmt!r} needs a tokenizer: pass tokenizer=DIR (a local tokenizer folder).",
                param="tokenizer",
            )
        from .stage import freeze_report, preload_tokenizer

        t_tok = time.perf_counter()
        early["setup_s"] = round(t_tok - started, 3)
        tok = preload_tokenizer(  # fails here, once, if it cannot load; workers take the engine it chose
            config.tokenizer, fmt, config.add_eos, config.tokenizer_engine, config.tokenizer_audit,
            config.on_unencodable,
        )  # fmt: skip
        proven = freeze_report(tok.report.to_dict())
        early.update(tokenizer_timings(tok, time.perf_counter() - t_tok))
        columns, types = output_columns(fmt), ["int32"] * len(output_columns(fmt))
        read = set(input_columns(fmt))  # every file's other columns are listed as left out
        left_out = list(dict.fromkeys(n for f in files for n in read_schema(f).names if n not in read))
    else:
        columns, types, left_out = token_schema(files, config)
        proven = None

    ws = Workspace(out)
    ws.acquire()
    try:
        previous = read_manifest(out)  # a run that held the lock may have just written the same output
        if previous is not None and previous.get("fingerprint") == fp["fingerprint"]:
            result = PipelineResult(out, previous.get("stats", {}), cached=True, manifest=previous)
        else:
            result = _run(
                files,
                fmt,
                columns,
                types,
                left_out,
                config,
                fp,
                ws,
                proven,
                executor,
                workers,
                address,
                retries,
                quiet,
            )
            result.timings.update(early)
            result.timings["time_s"] = round(time.perf_counter() - started, 3)
            result.timings["took_over_from"] = ws.took_over
    except Exception as exc:
        with _signals_deferred():
            ws.finish(ok=False, keep_stage=False)  # a fault: leave nothing behind
        explained = _explain(exc, out)
        if explained is exc:
            raise
        raise explained from exc
    except BaseException as exc:  # Ctrl-C, or SIGTERM through the CLI: keep finished parts for the next run
        with _signals_deferred():
            ws.finish(ok=False, keep_stage=True)
        kept = ws.staged_parts()
        note = "no output was written"
        if kept:
            note += (
                f"; {kept} finished part(s) kept in {ws.root} for the next run (delete it to free the space)"
            )
        try:
            exc.packtools_note = note  # type: ignore[attr-defined]
        except AttributeError:
            pass
        raise
    with _signals_deferred():
        ws.finish(ok=True, keep_stage=False)
    result.notes.extend(skipped_notes(skipped) + left_behind_notes(ws))
    return result


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM back while cleaning up (they are delivered right after)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _explain(exc: BaseException, out: str) -> BaseException:
    """OS errors while writing, as one clear line naming the place and the fix."""
    if isinstance(exc, PackingError) or not isinstance(exc, OSError):
        return exc
    place = exc.filename or out
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return PackingError(
            f"no space left on the device while writing {place!r}; free some space or choose another out "
            f"(nothing was left behind).",
            param="out",
        )
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return PackingError(
            f"cannot write {place!r} ({exc.strerror}); choose an out in a folder you can write to.",
            param="out",
        )
    return exc


def _run(
    files: Sequence[InputFile],
    fmt: str,
    columns: list[str],
    types: list[str],
    left_out: list[str],
    config: PipelineConfig,
    fp: dict[str, Any],
    ws: Workspace,
    proven: Any,
    executor: str | Executor,
    workers: int | None,
    address: str | None,
    retries: int,
    quiet: bool,
) -> PipelineResult:
    tok_fp = fp["tokenizer_sha256"]
    parts: list[Part] = [p for f in files for p in split_file(f, config.part_rows, config.part_bytes)]
    jobs = stage_jobs(
        parts,
        fmt,
        columns,
        types,
        tok_fp,
        config.tokenizer,
        config.add_eos,
        ws.stage,
        single_threaded=getattr(executor, "name", executor) != "local",
        tokenizer_engine=config.tokenizer_engine,
        known_columns=known_columns(columns, left_out) if fmt == "tokenized" else None,
        engine_proven=proven,
        audit_rate=config.tokenizer_audit,
        on_unencodable=config.on_unencodable,
    )
    from_cache = adopt_cached(jobs)  # parts `packtools profile --tokenizer` staged: not tokenized again
    timings: dict[str, Any] = {"parts": len(parts), "parts_from_stage_cache": from_cache}
    ex = get_executor(executor, workers, address)
    timings["executor"] = ex.name
    try:
        t0 = time.perf_counter()
        staged = run_jobs(ex, stage_part, jobs, "stage", quiet, retries)
        timings["stage_s"] = round(time.perf_counter() - t0, 3)
        timings["parts_reused"] = sum(bool(s["reused"]) for s in staged)
        timings["parts_mapped"] = sum(s["data"] == j.part.file.path for s, j in zip(staged, jobs))
        os.makedirs(ws.build)
        if fmt == "preference":
            from .preference import write_packed_preference
            from .stage import iter_staged

            t1 = time.perf_counter()
            stats = write_packed_preference(
                iter_staged([s["data"] for s in staged]),
                ws.build,
                config,
                fp["fingerprint"],
                [(j.part.describe(), s["rows"]) for j, s in zip(jobs, staged)],
            )
            timings["write_s"] = round(time.perf_counter() - t1, 3)
            stats.update(strategy="bfd (pairs)", overlong=config.overlong or "truncate", plan="global")
        else:
            t1 = time.perf_counter()
            sidecars = [load_sidecar(j.sidecar) for j in jobs]
            bounds = np.cumsum([0] + [s[0].shape[0] for s in sidecars]).tolist()
            lengths = np.concatenate([s[0] for s in sidecars]).astype(np.int64)
            eff, counts = apply_overlong(lengths, config.max_length, config.overlong_policy)
            rows_unlabeled = 0
            if "labels" in columns:
                first = np.concatenate([s[1] for s in sidecars])
                kept_len = lengths if config.overlong_policy == "split" else eff
                unlabeled = (eff > 0) & (first >= kept_len)
                rows_unlabeled = int(unlabeled.sum())
                if config.drop_unlabeled:
                    eff = np.where(unlabeled, 0, eff)
            del sidecars
            checkpoint("plan")
            p = plan_parts(eff, bounds, config)
            timings["plan_s"] = round(time.perf_counter() - t1, 3)
            t2 = time.perf_counter()
            wjobs = write_jobs(
                p,
                [s["data"] for s in staged],
                bounds,
                config,
                columns,
                ws.build,
                run_token(fp["fingerprint"]),
            )
            run_jobs(ex, write_block, wjobs, "write", quiet, retries)
            timings["write_s"] = round(time.perf_counter() - t2, 3)
            write_dataset_files(ws.build, [os.path.basename(j.path) for j in wjobs], fp["fingerprint"])
            tokens_in = int(lengths.sum())
            stats = {
                "rows_in": int(lengths.shape[0]),
                "rows_empty": int(np.count_nonzero(lengths == 0)),
                "rows_unlabeled": rows_unlabeled,
                "rows_dropped_unlabeled": rows_unlabeled if config.drop_unlabeled else 0,
                **counts,
                "rows_out": p.num_rows,
                "sequences_packed": int(np.count_nonzero(eff)),
                "lower_bound": p.lower_bound,
                "tokens_in": tokens_in,
                "tokens_kept": p.tokens_kept,
                "tokens_dropped": tokens_in - p.tokens_kept,
                "fill": p.fill,
                "shards": len(wjobs),
                "packed": True,
                "strategy": config.strategy,
                "overlong": config.overlong_policy,
                "plan": config.plan,
            }
    finally:
        if ex is not executor:
            ex.close()
    cols = stats.pop("columns", columns)  # preference rows have their own columns
    stats.update(
        {"format": fmt, "max_length": config.max_length, "columns": cols, "columns_left_out": left_out}
    )
    engines = engine_summary([s.get("tokenizer") for s in staged])
    if engines:  # per-part reports (kept in the sidecars), so a rerun after a kill writes the same manifest
        stats["tokenizer"] = engines
    manifest = {**fp, "format": fmt, "stats": stats}
    write_manifest(ws.build, manifest)
    ws.install()
    return PipelineResult(ws.out, stats, cached=False, manifest=manifest, timings=timings)
