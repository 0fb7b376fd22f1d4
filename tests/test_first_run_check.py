"""A first run stages on a provisional reference while transformers is checked in a child process (issue 42).

The driver of a first run with a tokenizer (no recorded verdict that the ``tokenizers`` library gives
transformers' ids) stages plain text on that library's tokenizer while a child process loads the folder through
transformers (without torch) and hands back transformers' ids, which the driver compares with its own provisional
reference (:class:`packtools.pipeline.tokenizer.reference_check.ReferenceCheck`); it waits for the check before
anything is planned or installed (:func:`packtools.pipeline.run._settle_reference`):

- the child's transformers runs without torch and gives the class and ids transformers gives with it;
- a late difference (a reference that differs from transformers, injected here together with a fast engine that
  agrees with it, so that every proof on the data passes) is never installed: every part is staged again by
  transformers, the difference recorded, no adversarial verdict recorded on it; without the check the wrong
  ids would have been installed (negative control);
- a run killed between the stage and the check installs nothing and records nothing; the next run checks again
  (and reuses the killed run's parts under the same pending check);
- a child that crashes or is killed leaves the check to the driver, which says so; the ids and records are the
  same;
- the records a first run leaves in the cache folder are the ones the check before the stage left.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
from _pipeline_data import CORPUS, EOS, build_tokenizer, corrupt_fast_engine, load

from packtools import pack_files
from packtools.pipeline.tokenizer import fast as fast_tokenize
from packtools.pipeline.tokenizer import reference, reference_check
from packtools.pipeline.tokenizer.batch import BatchTokenizer
from packtools.pipeline.tokenizer.folder import tokenizer_fingerprint
from packtools.pipeline.tokenizer.verdict import PROVISIONAL, VERDICT_FILE

pytestmark = pytest.mark.skipif(fast_tokenize.engine_version() is None, reason="fastokens not installed")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXTS = [f"{CORPUS[i % len(CORPUS)]} number {i}" for i in range(600)]
CHILD_PAYS = reference_check.child_pays


@pytest.fixture
def tok(tmp_path):
    return build_tokenizer(str(tmp_path / "tok"))


@pytest.fixture(autouse=True)
def _child_pays(monkeypatch):
    """This test process has imported transformers (the helpers load it), where a run checks before the stage;
    these tests are about the run that has not (a fresh ``packtools pack``)."""
    monkeypatch.setattr(reference_check, "child_pays", lambda: True)


def _write(folder, texts) -> str:
    """``texts`` in three JSON-lines files of ``folder`` (three parts, in this order)."""
    os.makedirs(folder)
    for k in range(3):
        with open(os.path.join(folder, f"part-{k}.jsonl"), "w") as fh:
            fh.writelines(json.dumps({"text": t}) + "\n" for t in texts[k * 200 : (k + 1) * 200])
    return str(folder)


def _docs(out) -> list[list[int]]:
    """The packed documents' ids, sorted (packing reorders them)."""
    from datasets import load_from_disk

    from packtools.core import unpack

    return sorted(list(map(int, s)) for s in unpack(load_from_disk(str(out)).data.table)["input_ids"])


def _expected(tok_dir, texts) -> list[list[int]]:
    """transformers' ids of ``texts`` with EOS, sorted."""
    t = load(tok_dir)
    eos = t.convert_tokens_to_ids(EOS)
    return sorted(ids + [eos] for ids in t(texts)["input_ids"])


def _records(cache) -> dict[str, object]:
    """The cache folder's records: relative path -> content (JSON without its own checksum, else bytes)."""
    found = {}
    for root, _, files in os.walk(cache):
        for name in files:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, cache)
            if name.endswith(".json") and not rel.startswith("fast-engine"):
                with open(path) as fh:
                    body = json.load(fh)
                body.pop("sha256", None)
                found[rel] = body
            else:
                with open(path, "rb") as fh:
                    found[rel] = fh.read()
    return found


def _shifted(encodings):
    """The encodings with the first id of each non-empty one moved (as corrupt_fast_engine moves it)."""
    out = []
    for e in encodings:
        ids = list(e.ids)
        if ids:
            ids[0] = (ids[0] + 1) % 300
        out.append(SimpleNamespace(ids=ids))
    return out


class _OffBackend:
    """The tokenizers library's tokenizer with other ids than transformers' (the first id of every text moved)."""

    def __init__(self, real) -> None:
        self._real = real

    def encode_batch(self, texts, add_special_tokens=True):
        return _shifted(self._real.encode_batch(texts, add_special_tokens=add_special_tokens))

    encode_batch_fast = encode_batch

    def __getattr__(self, name):
        return getattr(self._real, name)


def _differing_reference(monkeypatch) -> None:
    """The lite reference differs from transformers, and the fast engine agrees with it: every proof that
    compares the engine with the reference passes; only the check against transformers can see it."""
    real = reference.LiteReference.__init__

    def init(self, tokenizer_dir, file=None):
        real(self, tokenizer_dir, file)
        self.backend = _OffBackend(self.backend)

    monkeypatch.setattr(reference.LiteReference, "__init__", init)
    corrupt_fast_engine(monkeypatch, lambda t: True)


def test_a_late_difference_is_staged_again_by_transformers_never_installed(tok, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("PACKTOOLS_CACHE_DIR", str(cache))
    _differing_reference(monkeypatch)
    src = _write(tmp_path / "in", TEXTS)
    res = pack_files(src, tmp_path / "out", max_length=64, tokenizer=tok, quiet=True)
    assert _docs(res.out) == _expected(tok, TEXTS)  # transformers' ids, not the reference's
    report = res.stats["tokenizer"]
    assert report["engine"] == "transformers" and report["parts_by_engine"] == {"transformers": 3}
    assert "differed from transformers on the built-in adversarial set" in report["reason"]
    assert res.timings["parts_restaged"] == 3
    assert (
        res.timings["reference_check_by"] == reference_check.BY_CHILD
    )  # the child's ids, the driver's verdict
    fp = tokenizer_fingerprint(tok)
    with open(reference._verdict_path(fp)) as fh:
        assert json.load(fh)["same"] is False  # recorded: the next run loads transformers as its reference
    assert reference.load_verified(tok, fp) is None
    # the adversarial set was proven against the differing reference only: nothing is recorded as proven
    assert not os.listdir(cache / "engine-proof") if (cache / "engine-proof").exists() else True
    # the next run, with the difference recorded, has transformers as its reference from the start
    again = pack_files(src, tmp_path / "out2", max_length=64, tokenizer=tok, quiet=True)
    assert _docs(again.out) == _expected(tok, TEXTS)


def test_negative_control_without_the_check_the_differing_ids_would_be_installed(tok, tmp_path, monkeypatch):
    monkeypatch.setenv("PACKTOOLS_CACHE_DIR", str(tmp_path / "cache"))
    _differing_reference(monkeypatch)
    monkeypatch.setattr(
        reference_check.ReferenceCheck, "result", lambda self: None
    )  # a check that never objects
    src = _write(tmp_path / "in", TEXTS)
    res = pack_files(src, tmp_path / "out", max_length=64, tokenizer=tok, quiet=True)
    assert _docs(res.out) != _expected(tok, TEXTS)
    assert res.stats["tokenizer"]["engine"].startswith(fast_tokenize.ENGINE_MODULE)


def test_a_kill_between_the_stage_and_the_check_installs_and_records_nothing(tok, tmp_path, monkeypatch):
    cache, out, log = tmp_path / "cache", str(tmp_path / "out"), str(tmp_path / "log")
    monkeypatch.setenv("PACKTOOLS_CACHE_DIR", str(cache))  # the runs' cache, and where the paths below point
    src = _write(tmp_path / "in", TEXTS)
    args = ["pack", src, "--tokenizer", tok, "--max-length", "64", "--out", out]
    env = {**os.environ, "PYTHONPATH": ROOT, "PACKTOOLS_CACHE_DIR": str(cache)}
    paused = os.path.join(ROOT, "tests", "_paused_run.py")
    proc = subprocess.Popen([sys.executable, paused, log, "reference-check", *args, "--quiet"], env=env)
    deadline = time.monotonic() + 120
    while not (os.path.exists(log) and "reference-check" in open(log).read().split()):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    seen = open(log).read().split()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert "stage:3" in seen and "plan" not in seen  # every part staged, none planned
    assert not os.path.exists(out)
    fp = tokenizer_fingerprint(tok)
    assert reference._verdict_path(fp).startswith(str(cache))
    assert not os.path.exists(reference._verdict_path(fp))  # the check's finding was not recorded
    assert not (cache / "engine-proof").exists() or not os.listdir(cache / "engine-proof")
    work = tmp_path / ".out.packtools" / "stage"
    assert json.loads((work / VERDICT_FILE).read_text())["basis"]["reference"] == PROVISIONAL
    # the next run checks again (nothing was recorded), reusing the killed run's parts under that same check
    done = subprocess.run(
        [sys.executable, "-m", "packtools.cli", *args], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "reused from an interrupted run" in " ".join(done.stdout.split())
    with open(reference._verdict_path(fp)) as fh:
        assert json.load(fh)["same"] is True
    assert _docs(out) == _expected(tok, TEXTS)
    assert (
        "reference" not in json.loads((work / VERDICT_FILE).read_text())["basis"] if work.exists() else True
    )


def test_a_first_run_records_what_the_check_before_the_stage_recorded(tok, tmp_path, monkeypatch):
    src = _write(tmp_path / "in", TEXTS)
    before = (
        tmp_path / "cache-before"
    )  # the check in the tokenizer's load, as BatchTokenizer made directly does
    monkeypatch.setenv("PACKTOOLS_CACHE_DIR", str(before))
    direct = BatchTokenizer(tok, "text")
    assert direct.reference_engine == "transformers" and direct.reference_check is None
    now = tmp_path / "cache-now"
    monkeypatch.setenv("PACKTOOLS_CACHE_DIR", str(now))
    first = pack_files(src, tmp_path / "out", max_length=64, tokenizer=tok, quiet=True)
    assert _records(now) == _records(before)
    assert set(_records(now)) >= {p for p in _records(before) if p.startswith(("reference", "engine-proof"))}
    assert any(p.startswith("engine-proof") for p in _records(now))
    assert sum(p.startswith("reference") for p in _records(now)) == 2  # the verdict and the copy's finding
    # a warm run takes them: the lite reference checked, the adversarial verdict recorded, the same counts
    warm = pack_files(src, tmp_path / "out2", max_length=64, tokenizer=tok, quiet=True)
    assert warm.stats["tokenizer"]["checked"] == first.stats["tokenizer"]["checked"]
    assert "reference_check_s" in first.timings and "reference_check_s" not in warm.timings
    assert first.timings["reference_check_by"] == reference_check.BY_CHILD
    assert _docs(warm.out) == _docs(first.out) == _expected(tok, TEXTS)


@pytest.mark.parametrize(("executor", "checks_later"), [("local", True), ("pool", False)])
def test_only_a_local_run_stages_on_a_provisional_reference(
    tok, tmp_path, monkeypatch, executor, checks_later
):
    """A pool's (or Ray's) workers build their own tokenizers: with no verdict recorded yet each would load
    transformers, so such a run checks before it stages, as before."""
    from packtools.pipeline import run

    seen = []

    class Stop(Exception):
        pass

    def inputs(*args, check_later=False):
        seen.append(check_later)
        raise Stop

    monkeypatch.setattr(run, "_inputs", inputs)
    with pytest.raises(Stop):
        pack_files(_write(tmp_path / "in", TEXTS), tmp_path / "out", 64, tokenizer=tok, executor=executor)
    assert seen == [checks_later]


def test_the_child_loads_the_same_tokenizer_without_torch(tok):
    """transformers in the child runs in its tokenizer-only mode (torch unimportable there) and gives the class,
    EOS id and ids (with and without special tokens) that transformers gives here, with torch importable."""
    from packtools.pipeline.tokenizer.adversarial import adversarial_texts

    texts = adversarial_texts([EOS])[:40] + TEXTS[:20]
    check = reference_check.ReferenceCheck(tok, tokenizer_fingerprint(tok))
    check.start(reference.LiteReference(tok), texts, None)
    assert check.result() is None and check.how == reference_check.BY_CHILD
    here = load(tok)
    assert check.child_saw == {"torch": False, "class": type(here).__name__}
    import torch  # noqa: F401 - importable in this process: the child's transformers did not see it

    theirs = reference.transformers_ids(here, texts)
    child = subprocess.run(
        [sys.executable, "-m", reference_check.CHILD_MODULE, tok],
        input=json.dumps({"texts": texts, "copy": None}),
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": ROOT},
        check=True,
    )
    answer = json.loads(child.stdout)
    assert answer["torch"] is False
    assert {"eos_id": answer["eos_id"], "ids": answer["ids"]} == theirs


def _crashing_child(monkeypatch):
    monkeypatch.setattr(reference_check, "CHILD_MODULE", "packtools.no_such_module")  # `python -m` exits 1


def _killed_child(monkeypatch):
    real = reference_check.start_child

    def start_and_kill(tokenizer_dir):
        child = real(tokenizer_dir)
        child.send_signal(signal.SIGKILL)
        return child

    monkeypatch.setattr(reference_check, "start_child", start_and_kill)


@pytest.mark.parametrize(
    ("break_child", "why"),
    [(_crashing_child, "the child process exited with code 1"), (_killed_child, "exited with code -9")],
)
def test_a_child_that_crashes_or_is_killed_leaves_the_check_to_the_driver(
    tok, tmp_path, monkeypatch, break_child, why
):
    src = _write(tmp_path / "in", TEXTS)
    before = tmp_path / "cache-before"  # the check in the tokenizer's load (main's path)
    monkeypatch.setenv("PACKTOOLS_CACHE_DIR", str(before))
    BatchTokenizer(tok, "text")
    now = tmp_path / "cache-now"
    monkeypatch.setenv("PACKTOOLS_CACHE_DIR", str(now))
    break_child(monkeypatch)
    res = pack_files(src, tmp_path / "out", max_length=64, tokenizer=tok, quiet=True)
    by = res.timings["reference_check_by"]
    assert by.startswith("in the driver: ") and why in by  # never silent
    assert _records(now) == _records(before)
    assert _docs(res.out) == _expected(tok, TEXTS)


def test_a_late_difference_is_found_when_the_driver_checks_by_itself(tok, tmp_path, monkeypatch):
    """The driver's own check (a failed child) sees the injected difference as the child's answer does."""
    monkeypatch.setenv("PACKTOOLS_CACHE_DIR", str(tmp_path / "cache"))
    _differing_reference(monkeypatch)
    _crashing_child(monkeypatch)
    res = pack_files(
        _write(tmp_path / "in", TEXTS), tmp_path / "out", max_length=64, tokenizer=tok, quiet=True
    )
    assert res.timings["reference_check_by"].startswith("in the driver: ")
    assert res.timings["parts_restaged"] == 3 and res.stats["tokenizer"]["engine"] == "transformers"
    assert _docs(res.out) == _expected(tok, TEXTS)


def test_a_process_that_imported_transformers_checks_before_the_stage(tok, tmp_path, monkeypatch):
    """No child where transformers is imported already (its import is most of the check's cost): the check
    before the stage, with the same records and ids."""
    src = _write(tmp_path / "in", TEXTS)
    monkeypatch.setenv("PACKTOOLS_CACHE_DIR", str(tmp_path / "cache-child"))
    with_child = pack_files(src, tmp_path / "out", max_length=64, tokenizer=tok, quiet=True)
    monkeypatch.setattr(reference_check, "child_pays", CHILD_PAYS)  # the real decision
    assert "transformers" in sys.modules
    monkeypatch.setenv("PACKTOOLS_CACHE_DIR", str(tmp_path / "cache-here"))
    same = shutil.copytree(
        tok, tmp_path / "tok-copy"
    )  # the same files (a tokenizer not loaded in this process yet)
    here = pack_files(src, tmp_path / "out2", max_length=64, tokenizer=same, quiet=True)
    assert "reference_check_by" in with_child.timings and "reference_check_by" not in here.timings
    assert _records(tmp_path / "cache-here") == _records(tmp_path / "cache-child")
    assert _docs(here.out) == _docs(with_child.out) == _expected(tok, TEXTS)


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (absent, or a zombie nobody has reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_the_child_ends_when_its_driver_is_killed(tok):
    """A driver killed while its check's child still loads transformers leaves no process behind: the child
    reads its request to the end of a pipe nobody writes to any more, and ends."""
    driver = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, sys, signal\n"
            "from packtools.pipeline.tokenizer.reference_check import ReferenceCheck\n"
            "check = ReferenceCheck(sys.argv[1], 'f' * 64)\n"
            "print(check.child_pid, flush=True)\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n",
            tok,
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    child = int(driver.stdout.readline())
    driver.wait()
    assert driver.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 120
    while not _gone(child):
        assert time.monotonic() < deadline, f"the check's child {child} outlived its driver"
        time.sleep(0.1)


def _child_copy_finding(tok, copy, state) -> list:
    """The child's answer on ``copy``, compared with the driver's serialized state's SHA-256 ``state``."""
    child = subprocess.run(
        [sys.executable, "-m", reference_check.CHILD_MODULE, tok],
        input=json.dumps({"texts": TEXTS[:3], "copy": copy, "state": state}),
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": ROOT},
        check=True,
    )
    return json.loads(child.stdout)["copy"]


def test_the_child_finds_a_copy_identical_only_where_it_loads_as_tokenizer_json(tok, tmp_path):
    """The child loads only the copy and compares its state with the driver's provisional reference's (its
    SHA-256, :func:`reference_check.state_sha256`): the very file -> identical; one merge dropped (the same
    vocabulary) -> not identical; a copy but no state -> no finding (the driver then finds it itself)."""
    lite = reference.LiteReference(tok)
    state = reference_check.state_sha256(lite)
    same = str(tmp_path / "same.json")
    shutil.copyfile(os.path.join(tok, "tokenizer.json"), same)
    with open(same, encoding="utf-8") as fh:
        spec = json.load(fh)
    assert len(spec["model"]["merges"]) > 1
    spec["model"]["merges"] = spec["model"]["merges"][:-1]
    other = str(tmp_path / "other.json")
    with open(other, "w", encoding="utf-8") as fh:
        json.dump(spec, fh)
    assert _child_copy_finding(tok, same, state) == [reference.file_sha256(same), True]
    assert _child_copy_finding(tok, other, state) == [reference.file_sha256(other), False]
    assert _child_copy_finding(tok, same, None) is None
    # the same finding the driver makes with both tokenizers in memory
    assert reference.copy_identical(lite, other) == (reference.file_sha256(other), False)
    assert reference.copy_identical(lite, same) == (reference.file_sha256(same), True)


def test_a_run_stopped_right_after_its_verdict_leaves_no_provisional_part_to_reuse(
    tok, tmp_path, monkeypatch
):
    """A run that finds parts staged on a provisional reference it does not take back drops them before it
    records its own verdict: stopped in between, the next run would take that verdict back and reuse the
    parts, never checked (verdict.left_provisional's rule, broken by the order of the two steps)."""
    from packtools.pipeline import run, stage

    monkeypatch.setenv("PACKTOOLS_CACHE_DIR", str(tmp_path / "cache"))
    src, out = _write(tmp_path / "in", TEXTS), tmp_path / "out"

    class Stop(BaseException):  # an interruption (as Ctrl-C): the run keeps its staged parts
        pass

    def stop(*args, **kwargs):
        raise Stop

    with (
        monkeypatch.context() as m
    ):  # the first run: staged on the provisional reference, stopped before its check
        m.setattr(run, "_settle_reference", stop)
        with pytest.raises(Stop):
            pack_files(src, out, max_length=64, tokenizer=tok, quiet=True)
    work = tmp_path / ".out.packtools" / "stage"
    assert json.loads((work / VERDICT_FILE).read_text())["basis"]["reference"] == PROVISIONAL
    pending = [t for t in stage._TOKENIZERS.values() if t.reference_check is not None]
    for t in pending:  # settled: the next runs stage on no provisional reference (its check passes)
        t.settle_reference(lambda why: None)
    with monkeypatch.context() as m:  # a run that does not take the verdict back, stopped right after its own
        m.setattr(run, "give_back_freed_memory", stop)
        with pytest.raises(Stop):
            pack_files(src, out, max_length=64, tokenizer=tok, quiet=True)
    third = pack_files(src, out, max_length=64, tokenizer=tok, quiet=True)
    assert third.timings["parts_reused"] == 0
    assert _docs(out) == _expected(tok, TEXTS)


def test_a_tokenizer_load_that_fails_stops_the_child_it_started(tok, tmp_path, monkeypatch):
    """The child is started as the driver's tokenizer starts loading; a load that fails after that (here its
    facts) stops it, instead of leaving it waiting on its stdin for as long as the exception is kept (a
    notebook's last traceback holds the tokenizer being built, and the child with it: transformers in memory)."""
    from packtools.pipeline.tokenizer import batch

    monkeypatch.setenv("PACKTOOLS_CACHE_DIR", str(tmp_path / "cache"))
    started = []

    class Recorded(reference_check.ReferenceCheck):
        def __init__(self, *args) -> None:
            super().__init__(*args)
            started.append(self)

    def broken_facts(*args):
        raise RuntimeError("facts unreadable")

    monkeypatch.setattr(batch, "ReferenceCheck", Recorded)
    monkeypatch.setattr(batch, "load_facts", broken_facts)
    with pytest.raises(RuntimeError, match="facts unreadable") as caught:
        BatchTokenizer(tok, "text", wait_for_engine=False, input_bytes=1 << 30, check_later=True)
    assert caught.traceback and len(started) == 1 and started[0].child_pid is not None
    child = started[0]._child
    deadline = time.monotonic() + 60
    while child.poll() is None:
        assert time.monotonic() < deadline, "the check's child outlived the failed load"
        time.sleep(0.1)


def test_the_child_runs_this_packtools_whatever_the_working_folder_holds(tok, tmp_path, monkeypatch):
    """``python -m`` puts the working folder first on the child's path: a folder holding another packtools
    checkout would run *its* check (another protocol, or none).  The child runs this very packtools."""
    other = tmp_path / "elsewhere" / "packtools"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("raise ImportError('another packtools, from the working folder')\n")
    monkeypatch.chdir(other.parent)
    with pytest.raises(subprocess.CalledProcessError):  # what `python -m` there runs (the negative control)
        subprocess.run(
            [sys.executable, "-m", reference_check.CHILD_MODULE, tok],
            input="",
            capture_output=True,
            env={**os.environ, "PYTHONPATH": ROOT},
            check=True,
        )
    check = reference_check.ReferenceCheck(tok, tokenizer_fingerprint(tok))
    check.start(reference.LiteReference(tok), TEXTS[:5], None)
    assert check.result() is None and check.how == reference_check.BY_CHILD


# -- a tokenizers release without a method the lite reference calls ------------------------------------------
def _tokenizers_without(monkeypatch, *missing) -> None:
    """``tokenizers.Tokenizer`` as a release that renamed or removed the methods ``missing`` would be: neither the
    class nor the tokenizers it loads have them; every other method is the installed library's.  transformers,
    whose modules are imported already, keeps the class it imported (as it keeps working with the release its
    own requirement allows)."""
    import tokenizers

    real = tokenizers.Tokenizer

    class Wrapped:
        def __init__(self, inner) -> None:
            self._inner = inner

        def __getattr__(self, name):
            if name in missing:
                raise AttributeError(f"'tokenizers.Tokenizer' object has no attribute {name!r}")
            return getattr(self._inner, name)

    def forward(name):
        return lambda self, *args, **kwargs: getattr(self._inner, name)(*args, **kwargs)

    members = {
        name: forward(name)
        for name in dir(real)
        if not name.startswith("_") and name not in missing and callable(getattr(real, name))
    }
    if "from_file" in members:
        members["from_file"] = staticmethod(lambda path: lacking(real.from_file(path)))
    lacking = type("Tokenizer", (Wrapped,), members)
    monkeypatch.setattr(tokenizers, "Tokenizer", lacking)


@pytest.mark.parametrize(
    "missing",
    [
        ("from_file",),
        ("no_truncation",),
        ("no_padding",),
        ("token_to_id",),
        ("encode_batch",),  # the chat labels read its offsets; encode_batch_fast alone is not enough
        ("to_str",),  # called by the first run's check, in its thread
    ],
)
def test_a_tokenizers_without_a_method_the_reference_calls_falls_back_to_transformers_saying_why(
    tok, tmp_path, monkeypatch, missing
):
    """A future tokenizers without one of the methods the lite reference calls: transformers is the reference,
    the run's notes say why (the method, the version), and the ids are transformers'.  Never an AttributeError,
    and never the lite reference installed unchecked: here it would give other ids (and the fast engine agree
    with it), which only its check against transformers can see."""
    expected = _expected(tok, TEXTS)  # (transformers' tokenizer modules imported before the library changes)
    monkeypatch.setenv("PACKTOOLS_CACHE_DIR", str(tmp_path / "cache"))
    _differing_reference(monkeypatch)
    _tokenizers_without(monkeypatch, *missing)
    src = _write(tmp_path / "in", TEXTS)
    for run in ("first", "second"):
        res = pack_files(src, tmp_path / run, max_length=64, tokenizer=tok, quiet=True)
        assert _docs(res.out) == expected, run
        said = [n for n in res.notes if f"has no Tokenizer.{missing[0]}" in n]
        assert said and "transformers is loaded as the reference" in said[0], (run, res.notes)
        assert "reference_check_by" not in res.timings  # no provisional reference, nothing to check
    bt = BatchTokenizer(tok, "text")
    assert bt.reference_engine == "transformers" and missing[0] in bt.reference_why
    with pytest.raises(reference.LiteUnavailable, match=f"Tokenizer.{missing[0]}"):
        reference.LiteReference(tok)
    assert BatchTokenizer(tok, "text", engine="transformers").reference_why is None  # not asked for: no note


def test_a_reference_without_encode_batch_fast_encodes_with_encode_batch(tok, tmp_path, monkeypatch):
    """``encode_batch_fast`` (ids without offsets) is an extra: without it the lite reference encodes with
    ``encode_batch``, the same ids, and nothing is said."""
    expected = _expected(tok, TEXTS)
    monkeypatch.setenv("PACKTOOLS_CACHE_DIR", str(tmp_path / "cache"))
    _tokenizers_without(monkeypatch, "encode_batch_fast")
    res = pack_files(
        _write(tmp_path / "in", TEXTS), tmp_path / "out", max_length=64, tokenizer=tok, quiet=True
    )
    assert _docs(res.out) == expected and res.notes == []
    assert res.timings["reference_check_by"] == reference_check.BY_CHILD
    bt = BatchTokenizer(tok, "text")
    assert bt.reference_why is None and bt.reference_engine == "tokenizers (checked equal to transformers)"


def test_a_check_whose_request_fails_is_made_by_the_driver_never_read_as_a_pass(tok, tmp_path, monkeypatch):
    """The check's thread could not ask its child (here the reference's state cannot be serialized): the driver
    checks by itself and says why; the thread never dies before comparing, which read as a pass and installed
    a differing reference's ids."""
    monkeypatch.setenv("PACKTOOLS_CACHE_DIR", str(tmp_path / "cache"))
    _differing_reference(monkeypatch)

    def unserializable(lite):
        raise RuntimeError("no state")

    monkeypatch.setattr(reference_check, "state_sha256", unserializable)
    res = pack_files(
        _write(tmp_path / "in", TEXTS), tmp_path / "out", max_length=64, tokenizer=tok, quiet=True
    )
    assert _docs(res.out) == _expected(tok, TEXTS)
    by = res.timings["reference_check_by"]
    assert by == "in the driver: the request to the child process failed (RuntimeError: no state)", by
    assert res.stats["tokenizer"]["engine"] == "transformers" and res.timings["parts_restaged"] == 3


def _recording(monkeypatch) -> tuple[list, list]:
    """The children ``reference_check`` starts, and those its checks take from :func:`start_ahead`'s."""
    started, taken = [], []
    start, take = reference_check.start_child, reference_check.take_ahead
    monkeypatch.setattr(reference_check, "start_child", lambda d: started.append(start(d)) or started[-1])
    monkeypatch.setattr(reference_check, "take_ahead", lambda d: taken.append(take(d)) or taken[-1])
    return started, taken


def test_the_check_takes_the_child_the_run_started_ahead(tok, tmp_path, monkeypatch):
    """A first run starts the check's child once its inputs are found, before its fingerprints and its tokenizer
    (``start_ahead``); the tokenizer's check takes that very child (no second one), and the run's ids and
    records are those of a check with a child of its own.  A warm run starts none."""
    monkeypatch.setenv("PACKTOOLS_CACHE_DIR", str(tmp_path / "cache"))
    started, taken = _recording(monkeypatch)
    src = _write(tmp_path / "in", TEXTS)
    first = pack_files(src, tmp_path / "out", max_length=64, tokenizer=tok, quiet=True)
    assert len(started) == 1 and taken == started and started[0].returncode == 0
    assert first.timings["reference_check_by"] == reference_check.BY_CHILD
    assert _docs(first.out) == _expected(tok, TEXTS)
    assert reference_check._AHEAD == {}
    started.clear()
    pack_files(src, tmp_path / "out2", max_length=64, tokenizer=tok, quiet=True)
    assert started == []


def test_a_child_started_ahead_that_the_tokenizer_does_not_take_is_stopped(tok, tmp_path, monkeypatch):
    """Where the run's tokenizer checks otherwise (here: as a process that imported transformers does, before
    the stage), the child started ahead is stopped when the tokenizer is loaded, not left waiting on its
    stdin; the run checks in the driver and its ids are transformers'."""
    from packtools.pipeline.tokenizer import batch

    monkeypatch.setenv("PACKTOOLS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(batch.BatchTokenizer, "_checks_later", lambda self, *a: False)
    started, taken = _recording(monkeypatch)
    out = pack_files(
        _write(tmp_path / "in", TEXTS), tmp_path / "out", max_length=64, tokenizer=tok, quiet=True
    )
    assert len(started) == 1 and taken == []
    assert started[0].returncode is not None  # stopped (killed, reaped) by the run
    assert "reference_check_by" not in out.timings and reference_check._AHEAD == {}
    assert _docs(out.out) == _expected(tok, TEXTS)


def test_packtools_pack_starts_the_check_before_its_imports(tok, tmp_path, monkeypatch):
    """``packtools pack INPUT --tokenizer DIR --out DIR`` starts the check's child before it builds its parser
    (which imports numpy, pyarrow and the kernels); an in-memory ``--out FILE.parquet`` or a pool starts none."""
    from packtools.cli import main as cli

    monkeypatch.setenv("PACKTOOLS_CACHE_DIR", str(tmp_path / "cache"))
    started, taken = _recording(monkeypatch)
    waiting = []
    build = cli.build_parser
    monkeypatch.setattr(cli, "build_parser", lambda: waiting.append(list(reference_check._AHEAD)) or build())
    src = _write(tmp_path / "in", TEXTS)
    for extra in (
        ["--out", str(tmp_path / "x.parquet")],
        ["--out", str(tmp_path / "p"), "--executor", "pool"],
    ):
        cli._check_ahead(["pack", os.path.join(src, "part-0.jsonl"), "--tokenizer", tok, *extra])
    assert started == []
    argv = ["pack", src, "--tokenizer", tok, "--out", str(tmp_path / "out"), "--max-length", "64", "--quiet"]
    assert cli.main(argv) == 0
    assert waiting == [[os.path.realpath(tok)]] and len(started) == 1 and taken == started
    assert _docs(tmp_path / "out") == _expected(tok, TEXTS)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="forks")
def test_a_forked_process_neither_takes_nor_stops_its_parents_child(tok, tmp_path, monkeypatch):
    """A process forked from the one that started a child ahead (a pool's worker) inherits the record of it,
    but neither takes the child nor stops it (at its exit, or when its own run ends)."""
    monkeypatch.setenv("PACKTOOLS_CACHE_DIR", str(tmp_path / "cache"))
    assert reference_check.start_ahead(tok)
    child = reference_check._AHEAD[os.path.realpath(tok)][1]
    pid = os.fork()
    if pid == 0:  # the forked process
        ok = reference_check.take_ahead(tok) is None
        reference_check.stop_ahead()
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert child.poll() is None  # still the parent's, still waiting for its texts
    assert reference_check.take_ahead(tok) is child
    reference_check._stop(child)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="forks")
def test_a_process_forked_while_another_thread_starts_a_child_ahead_can_start_ahead_itself(
    tmp_path, monkeypatch
):
    """A process forked while another thread holds ``start_ahead``'s lock (a pool's worker forked while a run
    in another thread starts its child ahead) inherits the lock held by a thread it does not have: its own
    ``start_ahead`` returns (here for a folder without tokenizer files) instead of waiting forever."""
    monkeypatch.setenv("PACKTOOLS_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "empty").mkdir()
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with reference_check._AHEAD_LOCK:
            held.set()
            release.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(60)
        pid = os.fork()
        if pid == 0:  # the forked process: start_ahead in a thread, so that a wait for ever ends in a failure
            code = 1
            try:
                done = threading.Event()

                def start() -> None:
                    assert reference_check.start_ahead(str(tmp_path / "empty")) is False
                    done.set()

                threading.Thread(target=start, daemon=True).start()
                code = 0 if done.wait(20) else 1
            finally:
                os._exit(code)
    finally:
        release.set()
        holder.join()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_arguments_the_early_look_cannot_read_are_refused_once_by_the_command(tok, tmp_path, capsys):
    """``packtools pack``'s early look at its options starts nothing and says nothing where it cannot read them:
    the command's own parser says what is wrong, once."""
    from packtools.cli import main as cli

    bad = ["pack", str(tmp_path / "in.jsonl"), "--tokenizer", tok, "--out", str(tmp_path / "o"), "--num-proc"]
    with pytest.raises(SystemExit):
        cli.main(bad)
    err = capsys.readouterr().err
    assert err.count("usage:") == 1 and "--num-proc: expected one argument" in err
    assert reference_check._AHEAD == {}


@pytest.mark.parametrize(
    "bad",
    [
        ["--out", "OUT", "missing.jsonl"],  # an input that is not there: run_pipeline fails before its try
        ["--out", "OUT", "IN", "--max-length", "0"],  # refused by the command before its run
        ["--out", "OUT", "IN", "--help"],  # the parser prints its help and exits
        ["--out", "OUT", "IN", "--no-such-flag"],  # the parser refuses it
    ],
)
def test_packtools_pack_stops_the_child_it_started_ahead_whatever_ends_the_command(
    tok, tmp_path, monkeypatch, bad
):
    """A command that ends before its run takes or stops the child it started ahead (an input that is not there,
    options the command refuses, ``--help``) stops it as it returns: a process that calls ``main`` more than once
    (a notebook, a test session) keeps no child waiting on its stdin until it exits."""
    from packtools.cli import main as cli

    monkeypatch.setenv("PACKTOOLS_CACHE_DIR", str(tmp_path / "cache"))
    started, _ = _recording(monkeypatch)
    src = os.path.join(_write(tmp_path / "in", TEXTS), "part-0.jsonl")
    swap = {"OUT": str(tmp_path / "out"), "IN": src, "missing.jsonl": str(tmp_path / "missing.jsonl")}
    argv = ["pack", "--tokenizer", tok, *(swap.get(a, a) for a in bad)]
    try:
        assert cli.main(argv) != 0
    except SystemExit as exc:
        assert bad[-1] == "--help" or exc.code != 0
    assert len(started) == 1, "the early look started no child: the test proves nothing"
    assert started[0].returncode is not None and reference_check._AHEAD == {}


def test_runs_starting_ahead_at_once_start_one_child_and_leave_none_behind(tok, tmp_path, monkeypatch):
    """Two runs in threads of one process (the same tokenizer, first runs) ask for a child ahead at once: one
    child is started and waits for the folder; a second one, started meanwhile and overwritten in the record,
    would be stopped by nothing (kept alive by ``subprocess``'s list of running children, waiting on its stdin
    until the process exits)."""
    monkeypatch.setenv("PACKTOOLS_CACHE_DIR", str(tmp_path / "cache"))
    started, both_in = [], threading.Event()
    start = reference_check.start_child

    def slow_start(d):
        started.append(start(d))
        if len(started) == 2:
            both_in.set()
        both_in.wait(2)  # the other thread's start joins this one, unless it waits outside
        return started[-1]

    monkeypatch.setattr(reference_check, "start_child", slow_start)
    threads = [threading.Thread(target=reference_check.start_ahead, args=(tok,)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    waiting = [child for _, child in reference_check._AHEAD.values()]
    reference_check.stop_ahead()
    for child in started:
        reference_check._stop(child)
    assert len(started) == 1 and waiting == started


def test_a_check_thread_ended_by_what_is_not_an_exception_fails_the_run_never_a_pass(
    tok, tmp_path, monkeypatch
):
    """The check's thread ended before comparing by a ``BaseException`` that is not an ``Exception`` (here a
    ``SystemExit`` from its request): the run fails saying so; it is never read as a pass (which installed a
    differing reference's ids and recorded it as the same as transformers)."""
    monkeypatch.setenv("PACKTOOLS_CACHE_DIR", str(tmp_path / "cache"))
    _differing_reference(monkeypatch)

    def leaves(self):
        raise SystemExit("gone")

    monkeypatch.setattr(reference_check.ReferenceCheck, "_ask", leaves)
    started, _ = _recording(monkeypatch)
    with pytest.raises(BaseException, match="gone"):
        pack_files(_write(tmp_path / "in", TEXTS), tmp_path / "out", max_length=64, tokenizer=tok, quiet=True)
    assert not (tmp_path / "out").exists()
    assert reference.unchecked(tokenizer_fingerprint(tok))  # nothing recorded: the next run checks again
    assert started and all(c.returncode is not None for c in started)  # its child stopped


def test_packtools_pack_with_a_relative_tokenizer_path_hands_its_child_to_the_run(tok, tmp_path, monkeypatch):
    """``--tokenizer`` as a user types it (relative, through a link, a trailing slash) names the folder the run
    resolves to an absolute path: the run's check takes the child the command started (one child, no second)."""
    from packtools.cli import main as cli

    monkeypatch.setenv("PACKTOOLS_CACHE_DIR", str(tmp_path / "cache"))
    os.symlink(tok, tmp_path / "link")
    monkeypatch.chdir(tmp_path)
    started, taken = _recording(monkeypatch)
    src = os.path.relpath(_write(tmp_path / "in", TEXTS))
    assert (
        cli.main(["pack", src, "--tokenizer", "./link/", "--out", "out", "--max-length", "64", "--quiet"])
        == 0
    )
    assert len(started) == 1 and taken == started and reference_check._AHEAD == {}
    assert _docs(tmp_path / "out") == _expected(tok, TEXTS)


@pytest.mark.parametrize("folder", ["missing", "empty"])
def test_no_child_is_started_ahead_for_a_folder_without_tokenizer_files(tmp_path, monkeypatch, folder):
    """A ``--tokenizer`` that is mistyped or holds no tokenizer files starts no child (it would import
    transformers only to be stopped): the run says what is wrong with the folder."""
    monkeypatch.setenv("PACKTOOLS_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "empty").mkdir()
    started, _ = _recording(monkeypatch)
    assert reference_check.start_ahead(str(tmp_path / folder)) is False
    assert started == [] and reference_check._AHEAD == {}


def test_a_child_started_on_a_guess_of_the_input_is_stopped_once_the_run_knows_the_reference_suffices(
    tok, tmp_path, monkeypatch
):
    """``packtools pack`` guesses the input's size from its options (unknown for a folder, or where an option's
    value reads as an input) and starts a child; the run, which knows the size, stops it where the reference
    tokenizes that input alone (no check wanted), rather than let it import transformers beside the run."""
    from packtools.pipeline.tokenizer import load

    monkeypatch.setenv("PACKTOOLS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(load, "OVERLAP_MIN_BYTES", 0)  # a vocabulary large enough for the reference alone
    started, _ = _recording(monkeypatch)
    assert reference_check.start_ahead(tok, "auto", None)  # the command: the size unknown
    assert reference_check.start_ahead(tok, "auto", 1000) is False  # the run: a small input
    assert len(started) == 1 and started[0].returncode is not None and reference_check._AHEAD == {}
    assert reference_check.start_ahead(tok, "fast", 1000)  # the fast engine asked for: checked, a child
    reference_check.stop_ahead()
