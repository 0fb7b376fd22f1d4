"""A first run's check of its provisional reference against transformers, in a child process (issue 42).

A first run with a tokenizer (no recorded verdict that the ``tokenizers`` library gives transformers' ids,
:mod:`packtools.pipeline.tokenizer.reference`) stages plain text on that library's tokenizer as a *provisional*
reference, and waits for this check only before anything is planned or installed (``run._settle_reference``).
The check's expensive half, importing transformers and loading the folder through it, runs in a child process
started as the driver's tokenizer starts loading, so it holds neither the driver's GIL nor its memory (where
transformers is not imported in the driver yet, :func:`child_pays`):

- the child (``python -m packtools.pipeline.tokenizer.reference_check DIR``, from this very packtools whatever
  the working folder holds, :func:`main`) loads the folder
  through transformers with ``torch`` made unimportable first (a ``None`` entry in ``sys.modules``: ``import
  torch`` raises ``ImportError`` and ``importlib.util.find_spec`` finds nothing, so transformers runs in its
  tokenizer-only mode, the one it has without torch installed).  torch cannot change a tokenizer's ids, and
  importing it was most of the check's cost (transformers 5.25 imports it with any tokenizer load and does not
  honour ``USE_TORCH=0``).  It speaks JSON lines over its stdin and stdout: it reads the adversarial texts and
  writes transformers' EOS id and ids of the texts with and without special tokens
  (:func:`~packtools.pipeline.tokenizer.reference.transformers_ids`); then, freed of transformers' tokenizer,
  it waits for a second request, the fast engine's copy of tokenizer.json and the SHA-256 of the driver's
  provisional reference's serialized state (:func:`state_sha256`), and writes whether the copy loads as
  tokenizer.json's very tokenizer (:func:`~packtools.pipeline.tokenizer.reference.copy_identical`, the copy
  loaded alone and its state compared with that SHA-256: tokenizer.json is not loaded a second time).  The end
  of its stdin ends it.  It writes nothing else anywhere.
- the driver (:class:`ReferenceCheck`, a thread that waits on the child with the GIL released) compares those
  ids with its *own* provisional reference (:func:`~packtools.pipeline.tokenizer.reference.compare`): the
  decision is the driver's, made on content.  It records the finding only once the stage is done and every part
  staged on a reference that proved different is dropped; a run killed before that records nothing.  Only a
  pass asks for the copy's finding, at that settle: it does not decide this run's ids (it lets later runs load
  their reference from the copy), so the child finds it while the run plans and writes its output (a phase
  that leaves a core free), not while the data is staged (both cores busy); the run waits for it before it
  returns (:meth:`ReferenceCheck.finish`).  (The driver hashes its reference's state before the stage, while
  it waits for the fast engine's load: at the settle that held the GIL the run's next steps need.)
- a child that cannot start, fails, is killed, or answers nothing readable leaves the check to the driver
  (transformers loaded in the driver, torch with it, as before the check moved); :attr:`ReferenceCheck.how` says
  which, and why, and the run's timings carry it.
"""

from __future__ import annotations

import gc
import json
import os
import selectors
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from ...io.pages import give_back_freed_memory
from .reference import (
    LiteReference,
    _verdict_path,
    _versions,
    compare,
    copy_identical,
    transformers_ids,
    write_copy_finding,
    write_verdict,
)

#: the module the child runs (``python -m``)
CHILD_MODULE = __name__
#: how long the driver waits for the child's answer before it checks by itself
CHILD_TIMEOUT_S = 600.0
#: how the child runs :data:`CHILD_MODULE`: as ``python -m`` does, but without the working folder first on its
#: path (``-m`` puts it there, so a folder holding another packtools checkout would run *its* module; ``-P``
#: is Python 3.11's)
_RUN_CHILD = "import runpy, sys; del sys.path[0]; sys.argv[:] = sys.argv[1:]; runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)"  # fmt: skip
#: :attr:`ReferenceCheck.how` when the child answered
BY_CHILD = "child process (transformers without torch)"


def child_pays() -> bool:
    """Whether the check is worth a child process: transformers is not imported in this process yet.  Its import
    (torch's with it) is most of the check's cost; a process that has paid it already (a training script, a
    notebook, a test session) loads only the folder, and checks before the stage as without a child."""
    return "transformers" not in sys.modules


def start_child(tokenizer_dir: str) -> subprocess.Popen[bytes] | None:
    """The child process of the check of ``tokenizer_dir``, started now (it imports transformers and loads the
    folder, then waits for its texts on stdin; its stderr goes to a temporary file, read where it fails); None
    where it cannot be started."""
    import packtools

    root = os.path.dirname(os.path.dirname(os.path.abspath(packtools.__file__)))  # this very packtools
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    try:
        errors = tempfile.TemporaryFile()
    except OSError:
        return None
    try:
        child = subprocess.Popen(
            [sys.executable, "-c", _RUN_CHILD, CHILD_MODULE, tokenizer_dir],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=errors,
            env={**os.environ, "PYTHONPATH": path},
        )
    except OSError:
        errors.close()
        return None
    child.stderr = errors  # what it writes there, read back where it fails (ReferenceCheck._gone)
    return child


class ReferenceCheck:
    """The first run's check of a provisional lite reference against transformers (see the module docstring).

    Made (which starts the child) as the driver's tokenizer starts loading; :meth:`start` hands it the provisional
    reference ``lite``, the adversarial ``texts`` and the fast engine's ``copy`` of tokenizer.json once the driver
    has them, and a thread then waits for the child's answer and compares; :meth:`cancel` where the driver does
    not stage on a provisional reference after all.  :meth:`result` waits for the comparison;
    :meth:`record_finding` records it, as :func:`~packtools.pipeline.tokenizer.reference.record` would have (the
    copy's finding from a thread it starts); :meth:`finish` waits for that thread.
    """

    def __init__(self, tokenizer_dir: str, tokenizer_fp: str) -> None:
        self.tokenizer_dir, self.tokenizer_fp = tokenizer_dir, tokenizer_fp
        self._child = start_child(tokenizer_dir)
        self._unread = b""  # what the child wrote past the line last read
        self._state: str | None = None  # the SHA-256 of lite's serialized state (state_sha256)
        #: the last line the child wrote to its stderr, once it has ended (why it failed, where it did)
        self.errors: list[str] = []
        self.lite: LiteReference | None = None
        self.copy: str | None = None
        self._texts: list[str] = []
        self._tok: Any = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._copy_thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._answered = self._released = False  # (release)
        #: who gave transformers' ids: :data:`BY_CHILD`, or the driver (with the reason the child did not)
        self.how = BY_CHILD
        #: what the child's transformers loaded: ``{"torch": is_torch_available(), "class": the tokenizer's
        #: class name}`` (None: the child did not answer)
        self.child_saw: dict[str, Any] | None = None
        #: None: the same ids; else where they first differ (set by the thread)
        self.difference: str | None = None
        #: records that rest on this check (the adversarial verdicts proven against ``lite``), written on a pass
        self.on_pass: list[Callable[[], None]] = []

    @property
    def child_pid(self) -> int | None:
        """The child process's id (None where none could be started)."""
        return self._child.pid if self._child is not None else None

    def cancel(self) -> None:
        """Stop the child: nothing is staged on a provisional reference after all."""
        if self._child is not None and self._child.poll() is None:
            self._child.kill()
        self._end_child()

    def _end_child(self) -> None:
        """Close the child's stdin (the end of its requests: it exits), reap it, and keep the last lines it wrote
        to its stderr (:attr:`errors`)."""
        child = self._child
        if child is None or child.returncode is not None and child.stderr is None:
            return
        for stream in (child.stdin, child.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
        try:
            child.wait(timeout=CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        if child.stderr is not None:
            try:
                child.stderr.seek(0)
                self.errors = child.stderr.read().decode("utf-8", "replace").strip().splitlines()[-1:]
            except OSError:
                pass
            child.stderr.close()
            child.stderr = None

    def start(self, lite: LiteReference, texts: list[str], copy: str | None) -> None:
        """Compare ``lite`` with transformers on ``texts`` (and ``copy`` with tokenizer.json) in a thread."""
        self.lite, self._texts, self.copy = lite, texts, copy
        # not a daemon: its work is finite, and a daemon loading transformers at the interpreter's exit can abort
        self._thread = threading.Thread(target=self._run, name="packtools-reference-check", daemon=False)
        self._thread.start()

    def _exchange(self, request: dict[str, Any]) -> dict[str, Any] | None:
        """Send ``request`` to the child as one JSON line and read its one-line answer, both within
        :data:`CHILD_TIMEOUT_S` (a child that takes longer is killed); None where there is no answer."""
        child = self._child
        assert child is not None and child.stdin is not None and child.stdout is not None
        deadline = time.monotonic() + CHILD_TIMEOUT_S
        data = memoryview(json.dumps(request).encode("utf-8") + b"\n")
        fd = child.stdin.fileno()
        os.set_blocking(fd, False)
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_WRITE)
            while data:
                if not self._wait(sel, deadline):
                    return None
                try:
                    data = data[os.write(fd, data) :]
                except BlockingIOError:
                    continue
                except OSError:  # gone (a broken pipe): its answer, or its end, says why
                    break
        line = self._read_line(child.stdout.fileno(), deadline)
        if line is None:
            return None
        try:
            answer = json.loads(line)
        except ValueError:
            return None
        return answer if isinstance(answer, dict) else None

    def _wait(self, sel: selectors.BaseSelector, deadline: float) -> bool:
        """Wait for ``sel`` until ``deadline``; past it the child is killed (:meth:`_gone` says so)."""
        left = deadline - time.monotonic()
        if left > 0 and sel.select(left):
            return True
        self._child.kill()  # type: ignore[union-attr]
        self._timed_out = True
        return False

    def _read_line(self, fd: int, deadline: float) -> bytes | None:
        """The child's next line (without waiting past ``deadline``); None at its end or past the deadline."""
        buf = self._unread
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in buf:
                if not self._wait(sel, deadline):
                    return None
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    self._unread = b""
                    return None
                buf += chunk
        line, _, self._unread = buf.partition(b"\n")
        return line

    _timed_out = False

    def _gone(self) -> str:
        """Why the child gave no answer (it is reaped here)."""
        child = self._child
        assert child is not None
        self._end_child()
        if self._timed_out:
            return f"the child process gave no answer in {CHILD_TIMEOUT_S:.0f} s"
        if child.returncode != 0:
            return f"the child process exited with code {child.returncode}" + (
                f": {self.errors[-1]}" if self.errors else ""
            )
        return "the child process's answer was unreadable"

    def _ask(self) -> tuple[dict[str, Any] | None, str]:
        """The child's answer (transformers' ids), or None and why there is none (the child is then gone)."""
        if self._child is None:
            return None, "no child process could be started"
        answer = self._exchange({"texts": self._texts})
        if answer is None:
            return None, self._gone()
        try:
            if "error" not in answer:
                answer["eos_id"], answer["ids"]["special"], answer["ids"]["plain"]  # noqa: B018 - all there
        except (TypeError, KeyError):
            self._end_child()
            return None, "the child process's answer was unreadable"
        if "error" in answer:
            self._end_child()
            return None, f"transformers could not load it in the child process ({answer['error']})"
        return answer, BY_CHILD

    def _run(self) -> None:
        assert self.lite is not None
        if (
            self.copy is not None
        ):  # for the copy's finding; here, while the driver waits for the fast engine's
            self._state = state_sha256(self.lite)  # load, not at the settle, where it held the GIL 0.16 s
        answer, self.how = self._ask()
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
        with self._lock:
            self._answered = True
            end = self._released or self.difference is not None  # no copy's finding will be asked for
        if end:
            self._end_child()

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
        identical is removed), found by a thread started here (:meth:`finish` waits for it)."""
        path = _verdict_path(self.tokenizer_fp)
        same = self.difference is None
        if path is not None and self.lite is not None:
            try:
                write_verdict(path, {"same": same, "eos_id": self.lite.eos_id, **_versions()})
            except OSError:
                path = None
        if path is None or not same or self.copy is None:
            self._end_child()
            return
        self._copy_thread = threading.Thread(
            target=self._find_copy, name="packtools-reference-copy", daemon=False
        )
        self._copy_thread.start()

    def _find_copy(self) -> None:
        """The copy's finding, by the child where it answered the check (else by the driver), recorded."""
        assert self.lite is not None and self.copy is not None
        found = None
        if self.how == BY_CHILD and self._child is not None and self._child.poll() is None:
            answer = self._exchange({"copy": self.copy, "state": self._state})
            found = answer.get("copy") if answer is not None else None
        self._end_child()
        if isinstance(found, list) and len(found) == 2 and found[1] in (True, False):
            sha, identical = found
        else:  # the driver's own answer, or the child's missing
            sha, identical = copy_identical(self.lite, self.copy)
        write_copy_finding(self.tokenizer_fp, self.copy, sha, identical)

    def release(self) -> None:
        """A run that stops before its settle: the child is ended once it has answered (it would otherwise wait
        for the copy's request as long as this process lives).  A settle later still records the finding, the
        copy's found by the driver."""
        with self._lock:
            self._released = True
            end = self._answered or self._thread is None
        if end:
            self._end_child()

    def finish(self) -> None:
        """Wait for the copy's finding (:meth:`record_finding` started it), and for the child to end."""
        if self._copy_thread is not None:
            self._copy_thread.join()
        else:
            self._end_child()


def state_sha256(lite: LiteReference) -> str:
    """The SHA-256 of the serialized state of ``lite`` (loaded from tokenizer.json): what the child compares the
    fast engine's copy with (:func:`~packtools.pipeline.tokenizer.reference.copy_identical`), so that it loads
    the copy only, not tokenizer.json a second time (the driver's provisional reference is that very load)."""
    import hashlib

    return hashlib.sha256(lite.backend.to_str().encode("utf-8")).hexdigest()


def _request() -> dict[str, Any] | None:
    """The driver's next request (a JSON line on stdin); None at the end of stdin (nothing more, or the driver
    is gone)."""
    line = sys.stdin.buffer.readline()
    return json.loads(line) if line.strip() else None


def _answer(answer: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    """The child: transformers' answer for the folder ``argv[0]`` (see the module docstring), as JSON lines on
    stdout; ``{"error": ...}`` where transformers cannot load it or a request is unreadable."""
    (tokenizer_dir,) = sys.argv[1:] if argv is None else argv
    sys.modules.setdefault("torch", None)  # type: ignore[arg-type]  # unimportable: transformers loads tokenizers only
    try:
        from transformers.utils import is_torch_available

        from .folder import load_tokenizer

        tok = load_tokenizer(tokenizer_dir)
        gc.collect()
        give_back_freed_memory()  # transformers' parse of tokenizer.json (~150 MB), freed once loaded
        request = _request()
        if request is None:
            return 0
        answer = transformers_ids(tok, request["texts"])
        answer["torch"], answer["class"] = is_torch_available(), type(tok).__name__
    except Exception as exc:  # noqa: BLE001 - the driver checks by itself, saying why
        _answer({"error": f"{type(exc).__name__}: {exc}"})
        return 0
    _answer(answer)
    del tok, answer
    gc.collect()
    give_back_freed_memory()  # transformers' tokenizer gone before the copy loads: one in memory at a time
    try:
        request = _request()
        if request is None:
            return 0
        copy, state = request.get("copy"), request.get("state")
        found = list(copy_identical(state, copy)) if copy and isinstance(state, str) else None
    except Exception as exc:  # noqa: BLE001 - the driver finds it by itself
        _answer({"error": f"{type(exc).__name__}: {exc}"})
        return 0
    _answer({"copy": found})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
