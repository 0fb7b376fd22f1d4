"""The run's tokenizer engine: decided once by the driver, recorded in the run's work folder, handed to every job
(what a run does with it, and why: ``docs/tokenize.md``, *Engines*).

1. **Decide** (:func:`decide`), before any part is staged: the tokenizer's engine is proven on the run's own data,
   the first :data:`~packtools.pipeline.tokenizer.fast.PROOF_ROWS` rows of each column read across the parts in
   order.  A difference falls back to transformers (``auto``) or stops naming the row (``fast``).
2. **Record** (:func:`record`): the verdict and what it rests on (:func:`basis`), checksummed and flushed, in
   ``WORK/stage/engine-verdict.json``; a rerun after a kill takes it back (:func:`recorded`) where its basis is
   unchanged, so the parts it reuses and those it stages share one verdict.
3. **Hand on**: every :class:`~packtools.pipeline.stage.StageJob` carries the verdict as a value
   (``engine_proven``) and tokenizes with exactly that engine
   (:meth:`packtools.pipeline.tokenizer.batch.BatchTokenizer.start_part`).
4. **Never a mix**: an audit raising :class:`~packtools.pipeline.tokenizer.proof.EngineDivergence` makes the
   driver record :func:`fall_back` and restage every part the fast engine tokenized (``auto``), or stop
   (``fast``), in :func:`restage_after_divergence`; a part whose report disagrees with the verdict is never
   reused (:func:`drop_disagreeing`).
5. **A provisional reference** (:meth:`~packtools.pipeline.tokenizer.batch.BatchTokenizer.settle_reference`): the
   basis says so (:func:`provisional`) until the check passes; a difference drops every part (:func:`drop_all`)
   and records :func:`reference_fallback`; a verdict left on a provisional basis that a later run does not take
   back reuses no part (:func:`left_provisional`).

>>> v = {"engine": "fastokens 0.3.5", "requested": "auto", "reason": "ok", "checked": {}}
>>> fall_back(v, "line 9: ...")["engine"], fall_back(v, "line 9: ...")["reason"][:52]
('transformers', 'fallback: the fast engine differed from transformers')
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..._atomic import atomic_path
from ...io.files import Part, iter_part

if TYPE_CHECKING:
    from .proof import EngineDivergence

#: the verdict's file in the run's ``stage/`` folder
VERDICT_FILE = "engine-verdict.json"
#: the basis's ``reference`` while the driver's reference is provisional (:func:`provisional`)
PROVISIONAL = "tokenizers, provisional (checked against transformers before the install)"


def basis(
    tokenizer_dir: str,
    fmt: str,
    requested: str,
    parts: Sequence[Part] = (),
    ids: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What a verdict rests on: the content of every tokenizer file, the format, the requested engine with
    the installed engine's version (:func:`packtools.pipeline.tokenizer.fast.engine_key`), the ``parts`` whose
    first rows it was proven on (path, size, mtime, range) and ``ids``, the run's
    :meth:`packtools.pipeline.tokenizer.spec.IdsSpec.key`: a rerun after an upgrade proves the engine again."""
    from .fast import engine_key
    from .folder import tokenizer_file_hashes

    return {
        "tokenizer_files": tokenizer_file_hashes(tokenizer_dir),
        "format": fmt,
        "engine": engine_key(requested),
        "parts": [p.fingerprint() for p in parts],
        "ids": ids,
    }


def decide(tok: Any, parts: Sequence[Part], fmt: str) -> dict[str, Any]:
    """The run's verdict: ``tok``'s engine (a :class:`~packtools.pipeline.tokenizer.batch.BatchTokenizer` made in the
    driver) proven on the first rows of each column across ``parts``; raises (``fast``) on a difference."""
    from ..formats import input_columns, optional_columns
    from .fast import PROOF_ROWS

    tok.wait_for_fast()
    tok.start_part("driver-proof")
    need = PROOF_ROWS
    for part in parts:
        if need <= 0 or tok.fast is None:
            break
        columns = input_columns(fmt) + optional_columns(fmt)  # tools too, as staged
        with contextlib.closing(iter_part(part, 1000, columns)) as read:
            for where, table in read:
                table = table.slice(0, need)
                tok(table, where)
                need -= table.num_rows
                if need <= 0 or tok.fast is None:
                    break
    verdict = tok.report.to_dict()
    verdict["checked"] = {**verdict["checked"], "data_proof_rows": tok.proof.proof_rows}
    if tok.drops is not None:
        tok.drops.take()  # the proof's rows are counted again by the part that stages them
    return verdict


def fall_back(verdict: dict[str, Any], what: str) -> dict[str, Any]:
    """The verdict after the audit of a part found the fast engine differing from transformers (``what``)."""
    return {
        **verdict,
        "engine": "transformers",
        "reason": f"fallback: the fast engine differed from transformers on the data ({what}); every part is "
        f"tokenized by transformers",
    }


def restage_after_divergence(
    exc: EngineDivergence,
    verdict: dict[str, Any] | None,
    jobs_for: Callable[[dict[str, Any]], list[Any]],
    keep: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[dict[str, Any], list[Any], int]:
    """Never a mix, after the audit of a part raised ``exc``: under ``auto`` on the fast engine the run's verdict
    falls back to transformers (:func:`fall_back`), kept first by ``keep`` where the run records it (``pack``'s
    work folder: a kill from here on reruns under it), ``jobs_for`` builds the jobs that carry it, and every part
    the fast engine staged is dropped (:func:`drop_disagreeing`) to be staged again.  Returns the verdict, the jobs
    and how many parts were dropped.  ``fast``, no verdict, or transformers already: ``exc`` is raised.  The one
    restage of ``pack`` (:mod:`packtools.pipeline.run`) and ``profile`` (:mod:`packtools.pipeline.profile`)."""
    if verdict is None or verdict["requested"] != "auto" or verdict["engine"] == "transformers":
        raise exc
    verdict = fall_back(verdict, exc.what)
    if keep is not None:
        keep(verdict)
    jobs = jobs_for(verdict)
    return verdict, jobs, drop_disagreeing(jobs, verdict)


def _digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def record(folder: str, verdict: dict[str, Any], rests_on: dict[str, Any]) -> None:
    """Write ``verdict`` and what it ``rests_on`` (:func:`basis`) to ``folder``, checksummed, flushed to disk."""
    body = {"verdict": verdict, "basis": rests_on}
    with atomic_path(os.path.join(folder, VERDICT_FILE)) as tmp, open(tmp, "w") as fh:
        json.dump({**body, "sha256": _digest(body)}, fh, sort_keys=True)


def recorded(folder: str, rests_on: dict[str, Any]) -> dict[str, Any] | None:
    """The verdict an earlier (killed) run recorded in ``folder``, if it is whole and rests on ``rests_on``."""
    try:
        with open(os.path.join(folder, VERDICT_FILE)) as fh:
            saved = json.load(fh)
        body = {"verdict": saved["verdict"], "basis": saved["basis"]}
        if saved["sha256"] != _digest(body) or saved["basis"] != rests_on:
            return None
        return dict(saved["verdict"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def provisional(rests_on: dict[str, Any]) -> dict[str, Any]:
    """What a verdict rests on while the driver's reference is a provisional one (the first run's
    :meth:`~packtools.pipeline.tokenizer.batch.BatchTokenizer.settle_reference` has not settled it yet): the basis
    says so, so that only a run under the same pending check takes it back; once settled the verdict is recorded
    again on ``rests_on`` itself."""
    return {**rests_on, "reference": PROVISIONAL}


def left_provisional(folder: str, rests_on: dict[str, Any]) -> bool:
    """Whether ``folder`` holds a verdict recorded on a provisional reference that this run does not take back
    (:func:`recorded` gave None for ``rests_on``): its parts were staged on a reference never checked, or found
    different, so none of them is reused."""
    try:
        with open(os.path.join(folder, VERDICT_FILE)) as fh:
            saved = json.load(fh)
        return saved["basis"].get("reference") == PROVISIONAL and saved["basis"] != rests_on
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def reference_fallback(verdict: dict[str, Any], why: str) -> dict[str, Any]:
    """The verdict after the check of a provisional reference found it different from transformers (``why``)."""
    return {**verdict, "engine": "transformers", "reason": f"fallback: {why}"}


def drop_all(jobs: Sequence[Any]) -> int:
    """Remove every staged part of ``jobs`` (staged on a reference that proved different), so that each is staged
    again; returns how many there were."""
    from ..staged import drop_staged

    dropped = 0
    for job in jobs:
        if os.path.exists(job.sidecar):
            drop_staged(job)
            dropped += 1
    return dropped


def drop_disagreeing(jobs: Sequence[Any], verdict: dict[str, Any]) -> int:
    """Remove the staged parts of ``jobs`` that a transformers ``verdict`` cannot keep (tokenized by another
    engine, or with no readable report), so they are staged again; returns how many."""
    from ..staged import drop_staged, sidecar_report

    if verdict["engine"] != "transformers":
        return 0
    dropped = 0
    for job in jobs:
        if not os.path.exists(job.sidecar):
            continue
        try:
            report = sidecar_report(job.sidecar)
        except Exception:  # noqa: BLE001 - a damaged sidecar: staged again
            report = None
        if report is None or report.get("engine") != "transformers":
            drop_staged(job)
            dropped += 1
    return dropped
