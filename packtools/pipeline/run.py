"""The file-packing engine behind ``packtools pack`` and :func:`packtools.pack_files`.

One run, whatever executes it (``docs/pipeline.md``, "One engine, any executor"):

1. **Discover** the input files and cut them into parts (:func:`packtools.io.files.split_file`).
2. **Stage** every part on the executor: its token columns and a sidecar of row lengths, cached by a key of
   everything that decides them (:mod:`packtools.pipeline.stage`).
3. **Plan** on the driver, from lengths alone (O(rows) memory, no token touched): the ``overlong`` policy,
   unlabeled rows and **one global plan**, or one per part (:mod:`packtools.pipeline.planning`).
4. **Gather and write** on the executor: blocks of at most ``shard_tokens`` tokens gathered from the
   memory-mapped staged files, one shard each (:mod:`packtools.pipeline.gather`).
5. **Install**: the manifest and the ``datasets`` files written, the finished folder renamed to ``out``
   (:mod:`packtools.pipeline.workspace`: the lock and crash safety).

The executor (``local``, ``pool``, ``ray``) decides where stages 2 and 4 run and nothing else: the output
folder is the same bytes whichever runs it.  The manifest holds only what decides the output and its
statistics, so a rerun whose fingerprint matches does nothing; timings are returned, not written.  Preference
data is staged the same way and written as whole pairs by
:func:`packtools.pipeline.preference.write_packed_preference`.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .._atomic import discard
from .._interrupts import held
from ..errors import PackingError
from ..io.discover import InputFile, find_inputs, skipped_notes
from ..io.files import Part, read_schema, split_file
from ..io.manifest import read_manifest, write_manifest
from ..io.pages import give_back_freed_memory
from .config import PipelineConfig, PipelineResult, check_options_used, fingerprint
from .executors import Executor, executor_name, get_executor, run_jobs
from .formats import input_columns, optional_columns, output_columns
from .gather import block_steps, run_token, write_dataset_files
from .outcheck import check_out, check_replaceable, manifest_stamp, output_damage
from .planning import (
    check_something_trains,
    join_kernels,
    load_kernels_ahead,
    plan_parts,
    row_plan,
    write_jobs,
)
from .schema import data_format, empty_inputs_notes, known_columns, refuse_image_columns, token_schema
from .stage import StageJob, freeze_report, iter_staged, stage_part
from .stage_cache import adopt_cached, evicted_error, keep_in_place, stage_jobs
from .staged import load_sidecar, sidecar_tool_opener, sidecar_turns
from .summary import tokenizer_timings
from .tokenizer.fast import engine_summary
from .tokenizer.proof import EngineDivergence
from .tokenizer.reference_check import start_ahead, stop_ahead
from .tokenizer.spec import IdsSpec
from .tokenizer.verdict import (
    basis,
    decide,
    drop_all,
    drop_disagreeing,
    left_provisional,
    provisional,
    record,
    recorded,
    reference_fallback,
    restage_after_divergence,
)
from .workspace import Workspace, checkpoint, left_behind_notes, tidy_after_dead_run


@dataclass(frozen=True)
class RunInputs:
    """What the driver decided about the inputs before taking the lock: their format, the token columns to
    write (with their value types) and the columns left out, what decides the ids (``ids``: built once here,
    handed to every stage job), and the tokenizer engine it proved (raw input)."""

    files: Sequence[InputFile]
    columns: list[str]
    types: list[str]
    left_out: list[str]
    ids: IdsSpec
    proven: Any = None  # stage.freeze_report of the engine chosen at load; None for tokenized input
    #: why transformers, not the tokenizers library, is the reference (BatchTokenizer.reference_why): a note
    reference_why: str | None = None

    @property
    def fmt(self) -> str:
        return self.ids.format


@dataclass(frozen=True)
class Execution:
    """Where and how the parallel stages run; nothing here changes the output."""

    executor: str | Executor = "local"
    workers: int | None = None
    address: str | None = None
    retries: int = 2
    quiet: bool = True

    @property
    def name(self) -> str:
        """The executor's name (``local``, ``pool``, ``ray``, or an :class:`Executor`'s own): what the run asks of
        where its stages run (load ahead in the driver, single-threaded jobs) is read here, one way."""
        return executor_name(self.executor)


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
    ``drop_unlabeled``, ``context_parallel`` (rows budgeted for context parallelism:
    :mod:`packtools.core.cp_budget`), ...); see the module docstring for the stages and the output.  ``executor``
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
    executor_name(executor)  # a known name or an Executor, else refused by name
    if num_proc is not None and (isinstance(num_proc, bool) or not isinstance(num_proc, int) or num_proc < 1):
        raise PackingError(
            f"num_proc={num_proc!r} must be a positive int (1: this process; N: a pool of N).",
            param="num_proc",
        )
    if num_proc is not None and num_proc > 1 and executor == "local":
        executor, workers = "pool", num_proc
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise PackingError(f"retries={retries!r} must be an int >= 0.", param="retries")
    how = Execution(executor, workers, address, retries, quiet)
    out = os.path.abspath(os.fspath(out))
    if config.tokenizer is not None:
        from .tokenizer.folder import check_tokenizer_dir

        tok_dir = check_tokenizer_dir(config.tokenizer)
        if tok_dir != config.tokenizer:
            config = PipelineConfig(**{**asdict(config), "tokenizer": tok_dir})
    files, skipped = find_inputs(inputs)
    # a first run checks the reference while it stages only where its stage jobs share the driver's tokenizer: a
    # pool's or Ray's workers would each load transformers meanwhile (no verdict recorded yet)
    local = how.name == "local"
    if local and config.tokenizer is not None:  # the check's child imports transformers from now on
        start_ahead(config.tokenizer, config.tokenizer_engine, sum(f.size for f in files))
    try:
        check_out(out, [os.fspath(i) for i in inputs], files)
        fp = fingerprint(files, config)
        if skipped:  # listed in the manifest (not fingerprinted: they decide nothing in the output)
            fp["inputs_skipped"] = [s.to_dict() for s in skipped]
        stamp = manifest_stamp(out)  # before the manifest is read: a run that installs after it changes it
        previous = read_manifest(out)
        same = previous is not None and previous.get("fingerprint") == fp["fingerprint"]
        # files deleted or damaged since: rebuilt (its stats count them)
        damage = output_damage(out, previous) if same else []
        if same and not damage:
            # a run killed after installing this output may have left its work folder
            tidy_after_dead_run(out)
            warn_pipeline_drops(previous.get("stats", {}))
            return PipelineResult(
                out, previous.get("stats", {}), cached=True, manifest=previous, notes=skipped_notes(skipped)
            )
        check_replaceable(out)
        Workspace(out).refuse_if_held()  # before loading the tokenizer: a busy out fails at once
        # early: seconds before staging, itemized in the summary
        found, early = _inputs(files, config, fp["tokenizer_sha256"], started, check_later=local)
    finally:  # a child started ahead that the run's tokenizer did not take (cached, chat, tokenized, failed)
        if config.tokenizer is not None:
            stop_ahead(config.tokenizer)

    ws = Workspace(out)
    ws.acquire()
    try:
        # a run that held the lock may have just written the same output; where none installed one since the
        # damage was found (the manifest is the same file), that damage stands: the shards are not read again
        still_damaged = bool(damage) and stamp is not None and manifest_stamp(out) == stamp
        previous = None if still_damaged else read_manifest(out)
        if (
            previous is not None
            and previous.get("fingerprint") == fp["fingerprint"]
            and not output_damage(out, previous)
        ):
            result = PipelineResult(out, previous.get("stats", {}), cached=True, manifest=previous)
        else:
            result = _run(found, config, fp, ws, how)
            result.timings.update(early)
            result.timings["time_s"] = round(time.perf_counter() - started, 3)
            result.timings["took_over_from"] = ws.took_over
    except Exception as exc:
        with signals_deferred():
            ws.finish(ok=False, keep_stage=False)  # a fault: leave nothing behind
        explained = explain_os_error(exc, out)
        if explained is exc:
            raise
        raise explained from exc
    except BaseException as exc:  # Ctrl-C, or SIGTERM through the CLI: keep finished parts for the next run
        with signals_deferred():
            ws.finish(ok=False, keep_stage=True)
        note_interrupted(exc, ws)
        raise
    with signals_deferred():
        ws.finish(ok=True, keep_stage=False)
    result.notes.extend(skipped_notes(skipped) + left_behind_notes(ws))
    if damage and not result.cached:
        result.notes.append(f"{out} {'; '.join(damage)}: packed again")
    warn_pipeline_drops(result.stats)
    return result


#: A tokenized ``attention_mask`` column: checked while staging (a 0 is padding, refused by row), then left out
#: of the output, since an all-ones mask carries nothing and ``PaddingFreeCollator`` refuses one beside
#: ``seq_lengths``.
MASK = "attention_mask"
MASK_NOTE = (
    "column 'attention_mask' left out of the output: it is 1 on every token (no padding), so it carries nothing, "
    "and PaddingFreeCollator refuses an attention_mask beside seq_lengths (packed sequences are told apart by "
    "seq_lengths)"
)


def warn_pipeline_drops(stats: dict[str, Any]) -> None:
    """A :class:`~packtools.integrations.data.drops.TokensDroppedWarning` when the run's overlong policy cut tokens
    (as :func:`packtools.pack_dataset` warns; ``packtools pack`` prints it)."""
    import warnings

    from ..integrations.data.drops import TokensDroppedWarning, pipeline_drop_message

    text = pipeline_drop_message(stats)
    if text is not None:
        warnings.warn(text, TokensDroppedWarning, stacklevel=3)


# -- a failed or interrupted run: signals held back while it cleans up, OS errors said as one line ----------
@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM back while cleaning up (they are delivered right after): their handlers in Python
    by :func:`~packtools._interrupts.held` (the main thread runs them even for a signal that another thread of
    the process received, which the main thread's mask does not hold back), the OS's default action by the
    main thread's mask."""
    main = threading.current_thread() is threading.main_thread()
    with held():
        if not main or not hasattr(signal, "pthread_sigmask"):
            yield
            return
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def explain_os_error(exc: BaseException, out: str) -> BaseException:
    """OS errors while writing, as one clear line naming the place and the fix.

    >>> err = explain_os_error(OSError(errno.ENOSPC, "No space left on device", "/data/x.arrow"), "/data")
    >>> print(err)
    no space left on the device while writing '/data/x.arrow'; free some space or choose another out
    (nothing was left behind).
    >>> err.param
    'out'
    """
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


def note_interrupted(exc: BaseException, ws: Workspace) -> None:
    """Say on ``exc`` (``packtools_note``, which the CLI prints) what an interrupted run kept for the next one."""
    kept = ws.staged_parts()
    note = "no output was written"
    if kept:
        note += f"; {kept} finished part(s) kept in {ws.root} for the next run (delete it to free the space)"
    with contextlib.suppress(AttributeError):
        exc.packtools_note = note  # type: ignore[attr-defined]


def _inputs(
    files: Sequence[InputFile],
    config: PipelineConfig,
    tokenizer_fp: str | None,
    started: float,
    *,
    check_later: bool = False,
) -> tuple[RunInputs, dict[str, Any]]:
    """The format and columns of ``files``, what decides their ids (``tokenizer_fp``: the hash of the
    tokenizer's files), the tokenizer loaded and its engine proved once (raw input), and the seconds that took.
    ``check_later``: a first run may stage on a provisional reference (:func:`_settle_reference`)."""
    early: dict[str, Any] = {}
    fmt = data_format(files, config)
    check_options_used(config, fmt, files)
    if fmt == "preference" and config.overlong == "split":
        raise PackingError(
            "overlong='split' does not apply to preference data; use truncate or drop.", param="overlong"
        )
    if fmt == "preference" and config.strategy != "bfd":
        raise PackingError(  # a pair is the packing unit: it is never split, nor wrapped into a stream
            f"strategy={config.strategy!r} does not apply to preference data: each pair is packed whole "
            f"(bfd by pairs), over-long pairs truncated or dropped (overlong='truncate' or 'drop'); use "
            f"strategy='bfd'.",
            param="strategy",
        )
    if fmt == "preference" and config.context_parallel > 1:
        raise PackingError(  # pair rows are not CP-budgeted offline; prepare_dpo_trainer pads them at batch time
            f"context_parallel={config.context_parallel} does not apply to preference data when packing: pair rows "
            f"are not budgeted for CP padding offline. Pack with context_parallel=1 and train with "
            f"prepare_dpo_trainer(trainer, train_dataset=packed, context_parallel={config.context_parallel}), "
            f"which pads each sequence at batch time.",
            param="context_parallel",
        )
    ids = config.ids(fmt, tokenizer_fp)  # what decides the ids: this one value, down to every stage job
    if fmt == "tokenized":
        refuse_image_columns(files, config)
        columns, types, left_out = token_schema(files, config)
        return RunInputs(files, columns, types, left_out, ids), early
    if config.tokenizer is None:
        raise PackingError(
            f"format={fmt!r} needs a tokenizer: pass tokenizer=DIR (a local tokenizer folder).",
            param="tokenizer",
        )
    from .stage import freeze_report, preload_tokenizer

    t_tok = time.perf_counter()
    early["setup_s"] = round(t_tok - started, 3)
    tok = preload_tokenizer(  # fails here, once, if it cannot load; workers take the engine it chose
        config.tokenizer, ids, input_bytes=sum(f.size for f in files), check_later=check_later
    )
    proven = freeze_report(tok.report.to_dict())
    early.update(tokenizer_timings(tok, time.perf_counter() - t_tok))
    columns, types = output_columns(fmt), ["int32"] * len(output_columns(fmt))
    # every file's other columns are listed as left out
    read = set(input_columns(fmt) + optional_columns(fmt))
    left_out = list(dict.fromkeys(n for f in files for n in read_schema(f).names if n not in read))
    return RunInputs(files, columns, types, left_out, ids, proven, tok.reference_why), early


def _verdict(
    found: RunInputs, config: PipelineConfig, parts: Sequence[Part], ws: Workspace, ids_key: dict[str, Any]
) -> tuple[dict[str, Any] | None, dict[str, Any] | None, bool]:
    """The run's tokenizer engine (:mod:`packtools.pipeline.tokenizer.verdict`): the one a killed run recorded in this
    work folder, else proven now on the first rows across ``parts``; recorded before any part is staged.  On a
    provisional reference (a first run's, :func:`_settle_reference`) the verdict rests on it.  The third value:
    the folder's parts were staged on a provisional reference this run does not take back (none is reused): the
    verdict is then not recorded here, but by the caller after it dropped them, so that a run stopped in between
    leaves the provisional verdict, which no later run takes back.  ``(None, None, False)`` for tokenized input."""
    if found.fmt == "tokenized":
        return None, None, False
    from .stage import preload_tokenizer

    tok = preload_tokenizer(config.tokenizer, found.ids, check_later=True)  # the driver's (_inputs loaded it)
    rests_on = basis(config.tokenizer, found.fmt, config.tokenizer_engine, parts, ids=ids_key)
    if tok.reference_check is not None:
        rests_on = provisional(rests_on)
    verdict = recorded(ws.stage, rests_on)
    stale = False
    if verdict is None:
        stale = left_provisional(ws.stage, rests_on)
        verdict = decide(tok, parts, found.fmt)
        # stale: recorded by the caller once those parts are dropped (stopped before: none is reused)
        if not stale:
            record(ws.stage, verdict, rests_on)
    return verdict, rests_on, stale


def _reference_pending(found: RunInputs, config: PipelineConfig) -> Any:
    """The check of the provisional reference the driver's tokenizer still has to settle
    (:func:`_settle_reference`; :class:`~packtools.pipeline.tokenizer.reference_check.ReferenceCheck`), or None."""
    from .stage import preload_tokenizer

    return preload_tokenizer(config.tokenizer, found.ids, check_later=True).reference_check


def _settle_reference(
    found: RunInputs,
    config: PipelineConfig,
    ws: Workspace,
    jobs: Sequence[StageJob],
    verdict: dict[str, Any],
    rests_on: dict[str, Any],
) -> tuple[dict[str, Any], dict[str, Any], int] | None:
    """Before anything of a first run is planned or installed: wait for the check of the provisional reference
    its parts were staged on (:meth:`~packtools.pipeline.tokenizer.batch.BatchTokenizer.settle_reference`).  Where
    it gave transformers' ids, the verdict is recorded again on the settled basis (a kill from here reuses the
    parts) and None is returned.  Where it differs, every staged part is dropped (their ids came from it) and a
    fallback verdict recorded, before the difference itself is; returns that verdict, its basis and how many
    parts were dropped, for every part to be staged again by transformers."""
    from .stage import preload_tokenizer

    tok = preload_tokenizer(config.tokenizer, found.ids, check_later=True)
    if tok.reference_check is None:
        return None
    checkpoint("reference-check")
    settled = {k: v for k, v in rests_on.items() if k != "reference"}  # verdict.provisional's label off
    late: list[tuple[dict[str, Any], dict[str, Any], int]] = []

    def restage(why: str) -> None:
        dropped = drop_all(jobs)
        again = reference_fallback(verdict, why)
        record(ws.stage, again, settled)
        late.append((again, settled, dropped))

    if tok.settle_reference(restage) is None:
        record(ws.stage, verdict, settled)
        return None
    return late[0]


def busy_seconds(outcomes: Sequence[Any]) -> dict[str, float]:
    """The busy seconds per phase of a stage's jobs (their ``phases``, summed; they overlap in threads)."""
    total: dict[str, float] = {}
    for out in outcomes:
        for k, v in (out.get("phases") or {}).items() if isinstance(out, dict) else ():
            total[k] = round(total.get(k, 0.0) + v, 4)
    return total


#: inputs at least this large load Numba and the run's kernels in a thread while they stage
KERNELS_AHEAD_MIN_BYTES = 32 << 20


def _run(
    found: RunInputs, config: PipelineConfig, fp: dict[str, Any], ws: Workspace, how: Execution
) -> PipelineResult:
    """Stage, plan, write and install, holding the lock of ``ws``."""
    fmt, columns = found.fmt, found.columns
    parts: list[Part] = [p for f in found.files for p in split_file(f, config.part_rows, config.part_bytes)]
    # the kernels load beside a stage long enough to hide it (beside a short one they compete with it),
    # started before the driver's verdict, which mostly waits for the fast engine's load (it releases the GIL)
    big = sum(f.size for f in found.files) >= KERNELS_AHEAD_MIN_BYTES
    warming = (
        load_kernels_ahead(config.strategy, found.types)
        if how.name == "local" and fmt != "preference" and big
        else None
    )
    t_verdict = time.perf_counter()
    try:
        verdict, rests_on, stale = _verdict(found, config, parts, ws, fp["config"]["ids"])
    except BaseException:
        join_kernels(warming, unwanted=True)  # nothing of the run loads kernels after it returns
        raise
    verdict_s = round(time.perf_counter() - t_verdict, 3)
    # the tokenizer's load freed its parse of tokenizer.json: not kept beside the stage
    if verdict is not None:
        give_back_freed_memory()

    def jobs_for(verdict: dict[str, Any] | None) -> list[StageJob]:
        return stage_jobs(
            parts,
            found.ids,
            columns,
            found.types,
            ws.stage,
            tokenizer=config.tokenizer,
            single_threaded=how.name != "local",
            known_columns=known_columns(columns, found.left_out) if fmt == "tokenized" else None,
            engine_proven=freeze_report(verdict) if verdict is not None else None,
        )

    jobs = jobs_for(verdict)
    dropped = 0
    # staged on a reference never checked, or found different: dropped before the verdict is recorded
    if stale:
        dropped = drop_all(jobs)
        record(ws.stage, verdict, rests_on)
    from_killed_run = {j.sidecar for j in jobs if os.path.exists(j.sidecar)}
    from_cache, cache_notes = adopt_cached(jobs)  # parts `packtools profile` staged: not tokenized again
    timings: dict[str, Any] = {
        "parts": len(parts),
        "parts_from_stage_cache": len(from_cache),
        "verdict_s": verdict_s,  # the driver's proof on the data's first rows (it waits for the engine's load)
    }
    if verdict is not None:
        timings["parts_restaged"] = dropped + drop_disagreeing(jobs, verdict)
    ex = get_executor(how.executor, how.workers, how.address)
    timings["executor"] = how.name
    check_pending = _reference_pending(found, config) if verdict is not None else None
    try:
        t0 = time.perf_counter()
        done: list[float] = []
        while True:
            try:
                staged = run_jobs(ex, stage_part, jobs, "stage", how.quiet, how.retries, finished=done)
                landed = drop_disagreeing(jobs, verdict) if verdict is not None else 0
                if landed:  # (a part of a stopped worker that landed after the fallback is staged again)
                    timings["parts_restaged"] = timings.get("parts_restaged", 0) + landed
                    continue
                t_check = time.perf_counter()
                late = (
                    _settle_reference(found, config, ws, jobs, verdict, rests_on)
                    if verdict is not None
                    else None
                )
                # a first run's wait for its check against transformers (in stage_s)
                if check_pending is not None:
                    timings["reference_check_s"] = round(time.perf_counter() - t_check, 3)
                    timings["reference_check_by"] = check_pending.how  # the child, or the driver and why
                    check_pending = None
                if late is None:
                    break
                # the first run's provisional reference differed from transformers: every part again, by it
                verdict, rests_on, dropped = late
                jobs = jobs_for(verdict)
                timings["parts_restaged"] = timings.get("parts_restaged", 0) + dropped
                done.clear()
            except EngineDivergence as exc:
                # the audit of a part found the fast engine wrong on this data: the whole run goes to
                # transformers, recorded first (a kill from here on reruns under it), then every part the fast
                # engine tokenized is staged again
                verdict, jobs, dropped = restage_after_divergence(
                    exc, verdict, jobs_for, functools.partial(record, ws.stage, rests_on=rests_on)
                )
                timings["parts_restaged"] = timings.get("parts_restaged", 0) + dropped
                done.clear()
        gone = keep_in_place([s["data"] for s in staged])  # cache entries read in place, evicted meanwhile
        if gone:
            again = [jobs[i] for i in gone]
            discard(*(j.sidecar for j in again))
            restaged = run_jobs(ex, stage_part, again, "stage", how.quiet, how.retries)
            for i, s in zip(gone, restaged):
                staged[i] = s
            cache_notes.append(
                f"{len(gone)} stage cache entr(ies) this run had adopted from `packtools profile` were removed "
                f"from the cache meanwhile (another run trimmed it): their part(s) were tokenized again"
            )
        timings["stage_s"] = round(time.perf_counter() - t0, 3)
        timings["stage_phases_s"] = busy_seconds(staged)
        # when the first part was read and tokenized (the CLI says how long after the process started)
        if done:
            timings["first_part_at"] = done[0]
        # where each part came from: this run, a killed run's work folder, the stage cache
        reused = [bool(s["reused"]) for s in staged]
        timings["parts_reused"] = sum(r and j.sidecar in from_killed_run for r, j in zip(reused, jobs))
        timings["parts_from_stage_cache"] = sum(r and j.sidecar in from_cache for r, j in zip(reused, jobs))
        timings["parts_mapped"] = sum(s["data"] == j.part.file.path for s, j in zip(staged, jobs))
        cache_notes += empty_inputs_notes(found.files, jobs, staged)
        cache_notes += [
            f"part {j.part.describe()} that an interrupted run left was damaged ({s['damaged']}): staged again"
            for j, s in zip(jobs, staged)
            if s.get("damaged")
        ]
        os.makedirs(ws.build)
        if fmt == "preference":
            from .preference import write_packed_preference

            t1 = time.perf_counter()
            stats = write_packed_preference(
                iter_staged([s["data"] for s in staged]),
                ws.build,
                config,
                fp["fingerprint"],
                [(j.part.describe(), s["rows"]) for j, s in zip(jobs, staged)],
            )
            timings["write_s"] = round(time.perf_counter() - t1, 3)
            sums = stats.pop("shard_sums")
            stats.update(strategy="bfd (pairs)", overlong=config.overlong or "truncate", plan="global")
        else:
            t1 = time.perf_counter()
            join_kernels(warming)  # the plan calls the kernels it loads
            turns = [sidecar_turns(j.sidecar) for j in jobs]
            rows = row_plan([load_sidecar(j.sidecar) for j in jobs], columns, config, [t[0] for t in turns])
            check_something_trains(rows, fmt)
            checkpoint("plan")
            heads = np.concatenate(
                [
                    h if h.shape[0] == n else np.zeros(n, np.int64)
                    for (_, h, _), n in zip(turns, np.diff(rows.bounds))
                ]
            )
            closing = next((c for _, _, c in turns if c.size), np.zeros(0, np.int64))
            opener = next(
                (o for o in (sidecar_tool_opener(j.sidecar) for j in jobs) if o.size), np.zeros(0, np.int64)
            )
            # an all-ones attention_mask (the stage refused one with 0s) carries nothing: not written
            kept = [c for c in columns if c != MASK]
            if len(kept) < len(columns):
                cache_notes.append(MASK_NOTE)
            data = rows.split_labelled(
                [s["data"] for s in staged],
                kept,
                config,
                heads,
                ws.stage,
                fp["fingerprint"][:16],
                closing=closing,
                tool_opener=opener,
            )
            p = plan_parts(rows.eff, rows.bounds, config)
            if config.strategy == "wrapped":
                rows.count_wrapped(p, data)
            timings["plan_s"] = round(time.perf_counter() - t1, 3)
            t2 = time.perf_counter()
            wjobs = write_jobs(p, data, rows.bounds, config, kept, ws.build, run=run_token(fp["fingerprint"]))
            written = run_jobs(ex, block_steps(), wjobs, "write", how.quiet, how.retries)
            timings["write_s"] = round(time.perf_counter() - t2, 3)
            timings["write_phases_s"] = busy_seconds(written)
            write_dataset_files(ws.build, [os.path.basename(j.path) for j in wjobs], fp["fingerprint"])
            # each shard's size and CRC-32 as written: a rerun checks them before it calls the output done
            sums = {os.path.basename(j.path): [w["bytes"], w["crc32"]] for j, w in zip(wjobs, written)}
            stats = rows.stats(p, len(wjobs), config)
    except FileNotFoundError as exc:
        said = evicted_error(exc)
        if said is None:
            raise
        raise said from exc
    finally:
        if ex is not how.executor:
            ex.close()
        # a run that planned has joined it already; a failed or interrupted one stops it after its current step
        # (nothing of the run loads kernels after it returns)
        join_kernels(warming, unwanted=True)
    cols = stats.pop("columns", None) or [c for c in columns if c != MASK]  # preference rows: their own
    left_out = found.left_out + ([MASK] if MASK in columns and fmt != "preference" else [])
    stats.update(
        {"format": fmt, "max_length": config.max_length, "columns": cols, "columns_left_out": left_out}
    )
    engines = engine_summary([s.get("tokenizer") for s in staged])
    if engines:  # per-part reports (kept in the sidecars), so a rerun after a kill writes the same manifest
        stats["tokenizer"] = engines
    manifest = {**fp, "format": fmt, "stats": stats, "shards": sums}
    write_manifest(ws.build, manifest)
    ws.install()
    notes = cache_notes + ([found.reference_why] if found.reference_why else [])
    if fp.get("tokenizer_sha256") and fmt != "tokenized":
        from .tokenizer.reference import copy_removed_note

        removed = copy_removed_note(fp["tokenizer_sha256"])  # why this run's tokenizer load was the slow one
        if removed is not None:
            notes.append(removed)
            timings["tokenizer_copy_removed"] = True
    return PipelineResult(ws.out, stats, cached=False, manifest=manifest, timings=timings, notes=notes)
