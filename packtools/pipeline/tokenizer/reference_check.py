"""A first run's check of its provisional reference against transformers, in a child process (issue 42).

A first run with a tokenizer (no recorded verdict that the ``tokenizers`` library gives transformers' ids,
:mod:`packtools.pipeline.tokenizer.reference`) stages plain text on that library's tokenizer as a *provisional*
reference, and waits for this check only before anything is planned or installed (``run._settle_reference``).
The check's expensive half, importing transformers and loading the folder through it, runs in a child process
started as the driver's tokenizer starts loading, or ahead of it (:func:`start_ahead`: ``packtools pack`` before
its imports, ``pack_files`` once its inputs are found), so it holds neither the driver's GIL nor its memory (where
transformers is not imported in the driver yet, :func:`child_pays`):

- the child (``python -m packtools.pipeline.tokenizer.reference_check DIR``, from this very packtools whatever
  the working folder holds, :func:`main`) loads the folder
  through transformers with ``torch`` made unimportable first (a ``None`` entry in ``sys.modules``: ``import
  torch`` raises ``ImportError`` and ``importlib.util.find_spec`` finds nothing, so transformers runs in its
  tokenizer-only mode, the one it has without torch installed).  torch cannot change a tokenizer's ids, and
  importing it was most of the check's cost (transformers 5.25 imports it with any tokenizer load and does not
  honour ``USE_TORCH=0``).  It then reads the adversarial texts, the fast engine's copy of tokenizer.json and
  the SHA-256 of the driver's provisional reference's serialized state (:func:`state_sha256`) from its stdin and
  writes, as JSON to its stdout, transformers' EOS id and ids of the texts with and without special
  tokens (:func:`~packtools.pipeline.tokenizer.reference.transformers_ids`), and whether the copy loads as
  tokenizer.json's very tokenizer (:func:`~packtools.pipeline.tokenizer.reference.copy_identical`, the copy
  loaded after transformers' tokenizer is freed, its state compared with that SHA-256: tokenizer.json is not
  loaded a second time).  It writes nothing else anywhere.
- the driver (:class:`ReferenceCheck`, a thread that waits on the child with the GIL released) compares those
  ids with its *own* provisional reference (:func:`~packtools.pipeline.tokenizer.reference.compare`): the
  decision is the driver's, made on content.  It records the finding only once the stage is done and every part
  staged on a reference that proved different is dropped; a run killed before that records nothing.
- a child that cannot start, fails, is killed, or answers nothing readable leaves the check to the driver
  (transformers loaded in the driver, torch with it, as before the check moved); :attr:`ReferenceCheck.how` says
  which, and why, and the run's timings carry it.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

from ... import _gc
from .folder import tokenizer_files, tokenizer_fingerprint
from .reference import (
    LiteReference,
    _verdict_path,
    _versions,
    compare,
    copy_identical,
    transformers_ids,
    unchecked,
    write_copy_finding,
    write_verdict,
)

#: the module the child runs (``python -m``)
CHILD_MODULE = __name__
#: how long the driver waits for the child's answer before it checks by itself
CHILD_TIMEOUT_S = 600.0
#: how the child runs :data:`CHILD_MODULE`: as ``python -m`` does, but without the working folder first on its
#: path (``-m`` puts it there, so a folder holding another packtools checkout would run *its* module; ``-P``
#: is Python 3.11's; ``-c`` puts an empty entry there, dropped, and nothing else under ``PYTHONSAFEPATH``)
_RUN_CHILD = "import runpy, sys; sys.path[:1] = [p for p in sys.path[:1] if p]; sys.argv[:] = sys.argv[1:]; runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)"  # fmt: skip
#: :attr:`ReferenceCheck.how` when the child answered
BY_CHILD = "child process (transformers without torch)"


#: children started ahead of their check (:func:`start_ahead`), by the tokenizer folder's real path, with the id
#: of the process that started them: a process's resource, as ``pipeline.stage`` keeps its loaded tokenizers;
#: taken by that folder's :class:`ReferenceCheck`, else stopped by :func:`stop_ahead` (the run, once its tokenizer
#: has decided) or at the interpreter's exit
_AHEAD: dict[str, tuple[int, subprocess.Popen[bytes]]] = {}
#: held while :func:`start_ahead` looks for a folder's child and starts one: runs in threads of one process
#: starting at once start one child (a second, overwritten in :data:`_AHEAD`, would be stopped by nothing)
_AHEAD_LOCK = threading.Lock()


def _new_ahead_lock() -> None:
    """A lock anew in a forked process: a fork while another thread held it would leave it held by a thread the
    forked process does not have (its :func:`start_ahead` would wait for ever).  Its records stay (see
    :func:`take_ahead`)."""
    global _AHEAD_LOCK
    _AHEAD_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_ahead_lock)


def child_pays() -> bool:
    """Whether the check is worth a child process: transformers is not imported in this process yet.  Its import
    (torch's with it) is most of the check's cost; a process that has paid it already (a training script, a
    notebook, a test session) loads only the folder, and checks before the stage as without a child."""
    return "transformers" not in sys.modules


def start_child(tokenizer_dir: str) -> subprocess.Popen[bytes] | None:
    """The child process of the check of ``tokenizer_dir``, started now (it imports transformers and loads the
    folder, then waits for its texts on stdin); None where it cannot be started."""
    import packtools

    root = os.path.dirname(os.path.dirname(os.path.abspath(packtools.__file__)))  # this very packtools
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    try:
        return subprocess.Popen(
            [sys.executable, "-c", _RUN_CHILD, CHILD_MODULE, tokenizer_dir],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": path},
        )
    except OSError:
        return None


def start_ahead(tokenizer_dir: str, engine: str = "auto", input_bytes: int | None = None) -> bool:
    """Start the check's child for ``tokenizer_dir`` now, ahead of the run's tokenizer, where a first run will
    likely want it: tokenizer files in the folder, transformers not imported here (:func:`child_pays`), the cache
    on and no verdict recorded for this tokenizer and these versions, an ``engine`` other than transformers, and
    an input (``input_bytes``; None: unknown) the reference does not tokenize alone.  Its child then imports
    transformers on the core that the driver leaves idle while it imports numpy, pyarrow and the kernels
    (``packtools pack``) or finds its inputs (``pack_files``).  Only a head start: the tokenizer decides
    (:meth:`~packtools.pipeline.tokenizer.batch.BatchTokenizer`), and the run stops a child it did not take.
    A child waiting for the folder that ``input_bytes`` now rules out (started where the size was unknown) is
    stopped.  Returns whether a child is waiting for the folder."""
    from .load import reference_suffices

    key = os.path.realpath(tokenizer_dir)
    if reference_suffices(tokenizer_dir, engine, input_bytes):  # the reference alone tokenizes this input
        # a child started on a guess (packtools pack: an input folder, its size unknown) is stopped
        stop_ahead(tokenizer_dir)
        return False
    with _AHEAD_LOCK:
        if key in _AHEAD:
            return True
        if engine == "transformers" or not child_pays() or not tokenizer_files(tokenizer_dir):
            return False  # (no tokenizer files: a mistyped or empty folder, which the run names)
        try:
            if not unchecked(tokenizer_fingerprint(tokenizer_dir)):
                return False
        except OSError:  # an unreadable folder: the run says why
            return False
        child = start_child(tokenizer_dir)
        if child is None:
            return False
        if not _AHEAD:
            atexit.register(stop_ahead)
        _AHEAD[key] = (os.getpid(), child)
    return True


def take_ahead(tokenizer_dir: str) -> subprocess.Popen[bytes] | None:
    """The child :func:`start_ahead` started for ``tokenizer_dir`` in this process, now the caller's (None: none)."""
    pid, child = _AHEAD.pop(os.path.realpath(tokenizer_dir), (None, None))
    return child if pid == os.getpid() else None


def stop_ahead(tokenizer_dir: str | None = None) -> None:
    """Stop the children started ahead and not taken: the one of ``tokenizer_dir``, or (None) all of them."""
    keys = list(_AHEAD) if tokenizer_dir is None else [os.path.realpath(tokenizer_dir)]
    for key in keys:
        pid, child = _AHEAD.pop(key, (None, None))
        if child is not None and pid == os.getpid():  # a forked process does not stop its parent's child
            _stop(child)


def _stop(child: subprocess.Popen[bytes]) -> None:
    if child.poll() is None:
        child.kill()
    child.communicate()


class ReferenceCheck:
    """The first run's check of a provisional lite reference against transformers (see the module docstring).

    Made (which starts the child) as the driver's tokenizer starts loading; :meth:`start` hands it the provisional
    reference ``lite``, the adversarial ``texts`` and the fast engine's ``copy`` of tokenizer.json once the driver
    has them, and a thread then waits for the child's answer and compares; :meth:`cancel` where the driver does
    not stage on a provisional reference after all.  :meth:`result` waits for the comparison;
    :meth:`record_finding` records it, as :func:`~packtools.pipeline.tokenizer.reference.record` would have.
    """

    def __init__(self, tokenizer_dir: str, tokenizer_fp: str) -> None:
        self.tokenizer_dir, self.tokenizer_fp = tokenizer_dir, tokenizer_fp
        self._child = take_ahead(tokenizer_dir) or start_child(tokenizer_dir)
        self.lite: LiteReference | None = None
        self.copy: str | None = None
        self._texts: list[str] = []
        self._tok: Any = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        #: who gave transformers' ids: :data:`BY_CHILD`, or the driver (with the reason the child did not)
        self.how = BY_CHILD
        #: what the child's transformers loaded: ``{"torch": is_torch_available(), "class": the tokenizer's
        #: class name}`` (None: the child did not answer)
        self.child_saw: dict[str, Any] | None = None
        #: None: the same ids; else where they first differ (set by the thread)
        self.difference: str | None = None
        self._copy_sha: str | None = None
        self._copy_identical = False
        #: records that rest on this check (the adversarial verdicts proven against ``lite``), written on a pass
        self.on_pass: list[Callable[[], None]] = []

    @property
    def child_pid(self) -> int | None:
        """The child process's id (None where none could be started)."""
        return self._child.pid if self._child is not None else None

    def cancel(self) -> None:
        """Stop the child: nothing is staged on a provisional reference after all."""
        if self._child is not None:
            _stop(self._child)

    def start(self, lite: LiteReference, texts: list[str], copy: str | None) -> None:
        """Compare ``lite`` with transformers on ``texts`` (and ``copy`` with tokenizer.json) in a thread."""
        self.lite, self._texts, self.copy = lite, texts, copy
        # not a daemon: its work is finite, and a daemon loading transformers at the interpreter's exit can abort
        self._thread = threading.Thread(target=self._run, name="packtools-reference-check", daemon=False)
        self._thread.start()

    def _ask(self) -> tuple[dict[str, Any] | None, str]:
        """The child's answer, or None and why there is none (the child is then gone)."""
        child = self._child
        if child is None:
            return None, "no child process could be started"
        assert self.lite is not None
        state = state_sha256(self.lite) if self.copy is not None else None
        request = json.dumps({"texts": self._texts, "copy": self.copy, "state": state}).encode("utf-8")
        try:
            out, err = child.communicate(request, timeout=CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            child.kill()
            child.communicate()
            return None, f"the child process gave no answer in {CHILD_TIMEOUT_S:.0f} s"
        if child.returncode != 0:
            last = err.decode("utf-8", "replace").strip().splitlines()[-1:]
            return None, f"the child process exited with code {child.returncode}" + (
                f": {last[0]}" if last else ""
            )
        try:
            answer = json.loads(out)
            if "error" not in answer:
                answer["eos_id"], answer["ids"]["special"], answer["ids"]["plain"]  # noqa: B018 - all there
        except (ValueError, TypeError, KeyError):
            return None, "the child process's answer was unreadable"
        if "error" in answer:
            return None, f"transformers could not load it in the child process ({answer['error']})"
        return answer, BY_CHILD

    def _run(self) -> None:
        """The thread: whatever ends it before it has compared is handed to :meth:`result`, which raises it;
        a thread that died quietly would read as the same ids (:attr:`difference` None)."""
        try:
            self._compare()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller of result()
            self.cancel()
            self._error = exc

    def _compare(self) -> None:
        assert self.lite is not None
        try:
            answer, self.how = self._ask()
        except Exception as exc:  # noqa: BLE001 - never a thread that dies before comparing (read as a pass)
            self.cancel()
            answer, self.how = None, f"the request to the child process failed ({type(exc).__name__}: {exc})"
        try:
            if answer is None:  # the driver checks by itself, as it did before the check moved
                from .folder import load_tokenizer

                self.how = f"in the driver: {self.how}"
                tok = load_tokenizer(self.tokenizer_dir)
                tok(
                    ["x"], add_special_tokens=True
                )  # its backend in the state __call__ uses (BatchTokenizer.tok)
                self._tok = tok
                answer = transformers_ids(tok, self._texts)
            else:
                self.child_saw = {"torch": answer.get("torch"), "class": answer.get("class")}
        except BaseException as exc:  # noqa: BLE001 - handed to the caller of result()
            self._error = exc
            return
        try:
            self.difference = compare(self.lite, answer, self._texts)
        except Exception as exc:  # noqa: BLE001 - the library cannot run it: not the same
            self.difference = f"the tokenizers library cannot run it ({type(exc).__name__}: {exc})"
        if self.difference is None and self.copy is not None:
            found = answer.get("copy")
            if isinstance(found, list) and len(found) == 2 and found[1] in (True, False):
                self._copy_sha, self._copy_identical = found
            else:  # the driver's own answer, or the child's missing
                self._copy_sha, self._copy_identical = copy_identical(self.lite, self.copy)

    def transformers(self) -> Any:
        """transformers' tokenizer of the folder where the driver loaded it (a failed child), else None."""
        return self._tok

    def result(self) -> str | None:
        """Wait for the check: None where the lite reference gives transformers' ids, else where it differs."""
        assert self._thread is not None, "ReferenceCheck.start was not called"
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self.difference

    def record_finding(self) -> None:
        """Record the finding as :func:`~packtools.pipeline.tokenizer.reference.record` does (best effort: an
        unwritable cache means the next run checks again); on a pass, the copy's finding too (a copy that is not
        identical is removed)."""
        path = _verdict_path(self.tokenizer_fp)
        if path is None or self.lite is None:
            return
        same = self.difference is None
        try:
            write_verdict(path, {"same": same, "eos_id": self.lite.eos_id, **_versions()})
        except OSError:
            return
        if same and self.copy is not None:
            write_copy_finding(self.tokenizer_fp, self.copy, self._copy_sha, self._copy_identical)


def state_sha256(lite: LiteReference) -> str:
    """The SHA-256 of the serialized state of ``lite`` (loaded from tokenizer.json): what the child compares the
    fast engine's copy with (:func:`~packtools.pipeline.tokenizer.reference.copy_identical`), so that it loads
    the copy only, not tokenizer.json a second time (the driver's provisional reference is that very load)."""
    import hashlib

    return hashlib.sha256(lite.backend.to_str().encode("utf-8")).hexdigest()


def main(argv: list[str] | None = None) -> int:
    """The child: transformers' answer for the folder ``argv[0]`` (see the module docstring), as JSON on stdout;
    ``{"error": ...}`` where transformers cannot load it or the request is unreadable."""
    (tokenizer_dir,) = sys.argv[1:] if argv is None else argv
    sys.modules.setdefault("torch", None)  # type: ignore[arg-type]  # unimportable: transformers loads tokenizers only
    with _gc.paused():  # transformers' import and its parse of tokenizer.json: no cycles worth a collection
        answer = _answer(tokenizer_dir)
    sys.stdout.write(json.dumps(answer))
    sys.stdout.flush()
    return 0


def _answer(tokenizer_dir: str) -> dict[str, Any]:
    """:func:`main`'s answer for the folder."""
    try:
        from transformers.utils import is_torch_available

        from ...io.pages import give_back_freed_memory
        from .folder import load_tokenizer

        tok = load_tokenizer(tokenizer_dir)
        gc.collect()
        give_back_freed_memory()  # transformers' parse of tokenizer.json (~150 MB), freed once loaded
        request = json.load(sys.stdin)
        answer = transformers_ids(tok, request["texts"])
        answer["torch"], answer["class"] = is_torch_available(), type(tok).__name__
        del tok
        gc.collect()
        give_back_freed_memory()  # transformers' tokenizer gone before the copy loads: one in memory at a time
        copy, state = request.get("copy"), request.get("state")
        answer["copy"] = list(copy_identical(state, copy)) if copy and isinstance(state, str) else None
    except Exception as exc:  # noqa: BLE001 - the driver checks by itself, saying why
        answer = {"error": f"{type(exc).__name__}: {exc}"}
    return answer


if __name__ == "__main__":
    status = main()
    sys.stderr.flush()
    # the answer is written and flushed, and the child holds nothing else: it ends without the interpreter's
    # teardown of transformers' modules (~0.1 s), which the driver's wait for its exit would otherwise include
    os._exit(status)
