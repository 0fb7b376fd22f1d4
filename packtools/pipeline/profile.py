"""Profile raw input (text, chat, prompt/completion, preference) through the same stage as ``packtools pack``.

:func:`profile_files` stages every part as ``pack`` does (:func:`packtools.pipeline.stage.stage_part`, out of
core: only the lengths are held) into the shared stage cache (:mod:`packtools.pipeline.stage_cache`), where a
following ``pack`` of the same inputs, tokenizer, format and ``add_eos`` tokenizes nothing again.

A "sequence" is what ``pack`` packs: one tokenized row (EOS included when ``add_eos``), or for ``preference``
one pair as laid out in a row, ``2 * prompt + chosen + rejected`` (never split).  Tokenized input needs no
stage: its lengths are read from the list offsets (:func:`packtools.profile_lengths`), and packed input's from
its ``seq_lengths``.

>>> import os, tempfile, pyarrow as pa, pyarrow.parquet as pq
>>> d = tempfile.mkdtemp()
>>> pq.write_table(pa.table({"input_ids": [[1, 2, 3], [4]]}), os.path.join(d, "t.parquet"))
>>> res = profile_files(d)
>>> res.format, res.profile.lengths.tolist(), res.stage
('tokenized', [3, 1], None)
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ..errors import PackingError
from ..io.discover import discover
from ..io.files import open_ipc, split_file
from ..profiling.profile import LengthProfile, profile_lengths
from .executors import Executor, executor_name, get_executor, run_jobs
from .formats import output_columns
from .stage import freeze_report, preload_tokenizer, stage_part
from .staged import load_sidecar
from .summary import unencodable_text
from .tokenizer.folder import tokenizer_arg


@dataclass
class ProfiledInput:
    """A profile and how it was read: ``format``, ``stage`` (parts, reused, seconds, cache folder) or None;
    ``notes``: what the stage says as ``pack``'s notes do (a stage cache it could not use, why the tokenizers
    library is not the reference)."""

    profile: LengthProfile
    format: str
    stage: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    def to_text(self) -> str:
        """The lines ``packtools profile`` prints about the stage."""
        if not self.stage:
            return ""
        s = self.stage
        done = s["parts"] - s["reused"]
        lines = [
            f"stage: {s['parts']} part(s), {done} tokenized in {s['stage_s']:.2f} s, {s['reused']} already "
            f"in the stage cache {s['folder']}"
        ]
        if s.get("unencodable"):
            lines.append(
                "unencodable chars: "
                + unencodable_text(
                    s["unencodable"], "`packtools pack --on-unencodable error` stops on them instead."
                )
            )
        if s.get("kept", True):
            lines.append(
                f"  a following `packtools pack` of the same inputs with the same --tokenizer (and --format, "
                f"--no-eos) reuses these {s['parts']} staged part(s) instead of tokenizing again "
                f"(cache: {s['cache_bytes'] / 1e9:.2f} GB of {s['budget_bytes'] / 1e9:g} GB, "
                f"${'PACKTOOLS_STAGE_CACHE_MAX_GB'}; {s['evicted']} old entr(ies) evicted)"
            )
        elif s.get("cache_off"):
            lines.append("  (--no-stage-cache: the staged parts were removed; a pack tokenizes again)")
        lines += [f"  {n}" for n in self.notes]
        return "\n".join(lines)


def _pair_parts(paths: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The prompt, chosen and rejected lengths of every pair of staged preference files (offsets only,
    memory-mapped); a pair as packed is ``2 * prompt + chosen + rejected``."""
    prompt, chosen, rejected = output_columns("preference")
    out: list[list[np.ndarray]] = [[], [], []]
    for path in paths:
        with open_ipc(path) as reader:
            table = reader.read_all()
            for k, c in enumerate((prompt, chosen, rejected)):
                out[k].append(profile_lengths(table, column=c).lengths)
    lp, lc, lr = (np.concatenate(o) if o else np.zeros(0, np.int64) for o in out)
    return lp, lc, lr


def _no_cache_note(folder: str, exc: OSError) -> str:
    return (
        f"stage cache {folder!r} cannot be written ({exc.strerror or exc}): staged into a temporary folder "
        f"instead, not kept for `packtools pack` (set $PACKTOOLS_STAGE_CACHE to a folder you can write)"
    )


def _stage(ex: Any, jobs: list, verdict: dict[str, Any] | None, quiet: bool) -> list[dict[str, Any]]:
    """Stage ``jobs`` under the driver's ``verdict``: entries another engine tokenized are staged again, and
    an audit difference restages the fast engine's entries with transformers (``auto``; ``fast`` stops)."""
    from .tokenizer.proof import EngineDivergence
    from .tokenizer.verdict import drop_disagreeing, restage_after_divergence

    def jobs_for(verdict: dict[str, Any]) -> list:
        return [replace(j, engine_proven=freeze_report(verdict)) for j in jobs]

    while True:
        if verdict is not None:
            drop_disagreeing(jobs, verdict)
        try:
            staged = run_jobs(ex, stage_part, jobs, "stage", quiet, 2)
        except EngineDivergence as exc:  # nothing recorded: profile has no work folder
            verdict, jobs, _ = restage_after_divergence(exc, verdict, jobs_for)
            continue
        if verdict is None or not drop_disagreeing(jobs, verdict):
            return staged


def profile_files(
    inputs: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    tokenizer: str | os.PathLike[str] | None = None,
    *,
    format: str | None = None,
    column: str = "input_ids",
    add_eos: bool = True,
    tokenizer_engine: str = "auto",
    stage_cache: str | os.PathLike[str] | bool | None = None,
    executor: str | Executor = "local",
    workers: int | None = None,
    quiet: bool = True,
    name: str | None = None,
    part_rows: int = 1 << 17,
    part_bytes: int = 1 << 26,
) -> ProfiledInput:
    """Profile the files ``inputs`` as ``pack`` would see them; raw formats are tokenized with ``tokenizer``.

    ``format`` as for ``pack`` (default: from the columns).  ``stage_cache``: the folder for the staged parts
    (default :func:`packtools.pipeline.stage_cache.cache_dir`, which ``pack`` looks in; ``False`` stages into a
    temporary folder removed afterwards).  ``executor``/``workers`` as for :func:`packtools.pack_files`.
    """
    from .config import PipelineConfig, check_options_used
    from .schema import data_format, empty_inputs_notes, known_columns, no_rows_message, token_schema
    from .stage_cache import CacheLock, cache_dir, evict, max_bytes, prepare, stage_jobs

    where = executor_name(executor)  # refused by name before any work
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    if format in (None, "tokenized") and column != "input_ids":  # a named token column: read it as is
        json_file = next((f.path for f in discover(inputs) if f.kind == "json"), None)
        if json_file is not None:
            raise PackingError(
                f"column={column!r} names a column of tokenized .parquet/.arrow files, read from its "
                f"offsets; {json_file!r} is JSON lines, staged as pack stages it and profiled by its rows' lengths "
                f"(every token column of a row has that length): drop --column.",
                param="column",
            )
        return ProfiledInput(profile_lengths(list(inputs), column=column, name=name), "tokenized")
    config = PipelineConfig(
        max_length=1,
        format=format,
        tokenizer=None if tokenizer is None else tokenizer_arg(tokenizer),
        add_eos=add_eos,
        tokenizer_engine=tokenizer_engine,
        part_rows=part_rows,
        part_bytes=part_bytes,
    )
    files = discover(inputs)
    if not files:
        raise PackingError(f"no input files in {[os.fspath(i) for i in inputs]}.", param="paths")
    fmt = data_format(files, config, command="profile")
    # a tokenizer that would change nothing is refused as pack refuses it (tokenized data beside raw columns is
    # told the format that tokenizes them), so that profile measures what pack would pack
    check_options_used(config, fmt, files)
    if fmt == "tokenized" and all(f.kind != "json" for f in files):  # offsets only: nothing to stage
        # the inputs as given: a packed folder's manifest (its max_length) and name come with it
        prof = profile_lengths([os.fspath(i) for i in inputs], column=column, name=name)
        if prof.count == 0:  # Parquet/Arrow files of 0 rows: refused as pack refuses them
            raise PackingError(no_rows_message(files))
        labelled = [f.path for f in files if _has_labels(f.path)] if prof.packed is None else []
        if labelled:  # as a JSON-lines input of the same rows
            bare = next((f.path for f in files if f.path not in labelled), None)
            if bare is not None:
                raise PackingError(
                    f"input {bare!r} has no 'labels' column but {labelled[0]!r} has one: pack refuses inputs whose "
                    f"token columns differ (it needs the same in every file); profile and pack them apart, or give "
                    f"every file labels.",
                    param="paths",
                )
            longest = int(prof.lengths.max()) if prof.count else 1
            prof = LengthProfile(prof.lengths, prof.name, trained=_file_trained_tokens(files, longest))
        return ProfiledInput(prof, fmt)
    left_out: list[str] = []
    notes: list[str] = []
    if fmt == "tokenized":  # token ids in JSON: parsed and checked by the stage, as pack does
        columns, types, left_out = token_schema(files, config)
        tok_dir = proven = None
        ids = config.ids(fmt, None)
    elif tokenizer is None:
        raise PackingError(
            f"the input is {fmt} data (columns of {files[0].path!r}); tokenize it to profile it: pass "
            f"tokenizer=DIR (a local tokenizer folder), the one you will pack with.",
            param="tokenizer",
        )
    else:
        from .tokenizer.folder import check_tokenizer_dir, tokenizer_fingerprint

        tok_dir = check_tokenizer_dir(tokenizer)
        ids = config.ids(fmt, tokenizer_fingerprint(tok_dir))  # what decides the ids, for every stage job
        # fails here, once, if it cannot load; the input's size as pack gives it, so that both choose the same
        # engine (a small input goes to the reference alone) and pack takes these staged parts
        tok = preload_tokenizer(tok_dir, ids, input_bytes=sum(f.size for f in files))
        if tok.reference_why:  # as pack notes it
            notes.append(tok.reference_why)
        columns = output_columns(fmt)
        types = ["int32"] * len(columns)
    keep = stage_cache is not False
    folder = (
        cache_dir(None if stage_cache in (None, True) else stage_cache)
        if keep
        else tempfile.mkdtemp(prefix="packtools-stage-")
    )
    if keep:
        try:
            prepare(folder)
            CacheLock(folder).shared().release()
        except OSError as exc:  # read-only, full, not ours: the run goes on without the cache, saying so
            notes.append(_no_cache_note(folder, exc))
            keep, folder = False, tempfile.mkdtemp(prefix="packtools-stage-")
    parts = [p for f in files for p in split_file(f, part_rows, part_bytes)]
    verdict = None
    # the driver decides the engine once, as pack does (packtools.pipeline.tokenizer.verdict)
    if fmt != "tokenized":
        from .tokenizer.verdict import decide

        verdict = decide(tok, parts, fmt)
        proven = freeze_report(verdict)
    jobs = stage_jobs(
        parts,
        ids,
        columns,
        types,
        folder,
        tokenizer=tok_dir,
        single_threaded=where != "local",
        engine_proven=proven,
        checksum=keep,  # entries of the stage cache, checked by their SHA-256 when pack adopts them
        known_columns=known_columns(columns, left_out) if fmt == "tokenized" else None,  # as pack stages them
    )
    ex = get_executor(executor, workers, None)
    trained = None
    pair_parts = None
    t0 = time.perf_counter()
    try:
        try:
            with CacheLock(folder):  # no eviction under a running stage
                staged = _stage(ex, jobs, verdict, quiet)
        except OSError as exc:
            if not keep or exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES):
                raise
            notes.append(_no_cache_note(folder, exc))  # the cache filled up: stage aside, not kept
            keep, folder = False, tempfile.mkdtemp(prefix="packtools-stage-")
            jobs = [
                replace(j, staged=os.path.join(folder, os.path.basename(j.staged)),
                        sidecar=os.path.join(folder, os.path.basename(j.sidecar)))
                for j in jobs
            ]  # fmt: skip
            staged = _stage(ex, jobs, verdict, quiet)
        stage_s = time.perf_counter() - t0
        notes += empty_inputs_notes(files, jobs, staged)  # no rows at all: refused as pack refuses it
        if fmt == "preference":
            pair_parts = _pair_parts([s["data"] for s in staged])
            lengths = 2 * pair_parts[0] + pair_parts[1] + pair_parts[2]
        else:
            sidecars = [load_sidecar(j.sidecar)[0] for j in jobs]
            lengths = np.concatenate(sidecars) if sidecars else np.zeros(0, np.int64)
            if "labels" in columns:  # chat, prompt/completion: where the trained tokens are
                trained = _trained_tokens([s["data"] for s in staged])
    finally:
        ex.close()
        if not keep:
            shutil.rmtree(folder, ignore_errors=True)
    info: dict[str, Any] = {
        "folder": folder,
        "parts": len(jobs),
        "reused": sum(bool(s["reused"]) for s in staged),
        "stage_s": round(stage_s, 3),
        "kept": keep,
        "cache_off": stage_cache is False,  # --no-stage-cache (a cache it could not use: a note says why)
    }
    from .tokenizer.fast import engine_summary

    engines = engine_summary([s.get("tokenizer") for s in staged])
    if engines and engines.get("unencodable"):  # said as pack says it (the lengths are without them)
        info["unencodable"] = engines["unencodable"]
    if keep:
        keys = [os.path.basename(j.sidecar)[: -len(".npz")] for j in jobs]
        evicted, total = evict(folder, keys)
        info.update(evicted=evicted, cache_bytes=total, budget_bytes=max_bytes())
    if name is None:
        base = os.path.basename(files[0].path) if len(files) == 1 else f"{len(files)} files"
        what = "pairs as packed: 2 x prompt + chosen + rejected" if fmt == "preference" else "tokenized"
        name = f"{base} ({fmt}, {what})"
    return ProfiledInput(
        LengthProfile(lengths, name, trained=trained, pairs=fmt == "preference", pair_parts=pair_parts),
        fmt,
        info,
        notes,
    )


def _has_labels(path: str) -> bool:
    from ..core.arrow import is_list_type
    from ..profiling.packed import file_schema

    schema = file_schema(path)
    return "labels" in schema.names and is_list_type(schema.field("labels").type)


def _file_trained_tokens(files: Sequence[Any], longest: int) -> Any:
    """:class:`~packtools.profiling.trained.TrainedTokens` of the ``labels`` column of tokenized parquet / Arrow
    files (the token rule, the trained share and the pieces ``pack``'s turn split drops depend on them, as for
    JSON lines; their ``input_ids`` values are still never read).  Read in batches of at most
    :data:`LABEL_BATCH_TOKENS` labels (``longest``: the longest row), since each label takes several int64 arrays
    while it is counted: pyarrow's default batch of 65,536 rows held hundreds of millions of them on long rows."""
    import pyarrow.parquet as pq

    from ..io.files import reading
    from ..profiling.trained import TrainedTokens

    rows = max(1, LABEL_BATCH_TOKENS // max(1, longest))
    parts: list[TrainedTokens] = []

    def count(labels: Any) -> None:
        parts.append(TrainedTokens.from_labels(labels))
        if len(parts) >= 64:  # each part holds a count per position: folded as they come
            parts[:] = [TrainedTokens.combine(parts)]

    for f in files:
        if f.kind == "parquet":
            with reading(f.path, "parquet"), pq.ParquetFile(f.path, memory_map=False, pre_buffer=False) as pf:
                for b in pf.iter_batches(batch_size=rows, columns=["labels"]):
                    count(b.column(0))
        else:
            with reading(f.path, "arrow"), open_ipc(f.path) as reader:
                for b in reader.batches():
                    for start in range(0, b.num_rows, rows):
                        count(b.column("labels").slice(start, rows))
    return TrainedTokens.combine(parts)


#: Labels counted at once by :func:`_file_trained_tokens` (a batch of rows, or one longer row).
LABEL_BATCH_TOKENS = 1 << 22


def _trained_tokens(paths: list[str]) -> Any:
    """:class:`~packtools.profiling.trained.TrainedTokens` of the ``labels`` of staged files, in order."""
    from ..profiling.trained import TrainedTokens

    parts = []
    for path in paths:
        with open_ipc(path) as reader:
            parts.append(TrainedTokens.from_labels(reader.read_all().column("labels")))
    return TrainedTokens.combine(parts)
