"""The run's tokenizer engine is decided once, by the driver (packtools.pipeline.tokenizer.verdict), and every part of the
run, on every executor and after a kill, is tokenized under that one verdict (issue 29: F1, F2, F5, S7).

Divergences are injected at the fast engine's own boundary (tests/_diverge.py wraps ``fastokens.Tokenizer``;
packtools is not touched), in the test process and, through a ``sitecustomize`` on ``PYTHONPATH``, in the pool's
spawned workers and in subprocess runs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from _diverge import install, site_folder
from _pipeline_data import CORPUS, build_tokenizer

from packtools import PackingError, pack_files
from packtools.pipeline.tokenizer import fast as fast_tokenize
from packtools.pipeline.tokenizer import verdict
from packtools.pipeline.tokenizer.verdict import VERDICT_FILE

needs_engine = pytest.mark.skipif(fast_tokenize.engine_version() is None, reason="fastokens not installed")
pytestmark = needs_engine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(str(tmp_path_factory.mktemp("tok") / "tok"))


@pytest.fixture
def diverging(tmp_path, monkeypatch):
    """fastokens gives another first id for every row with 'zebra', here and in every process started now."""
    folder = site_folder(str(tmp_path / "site"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([folder, ROOT, os.environ.get("PYTHONPATH", "")]))
    import fastokens

    monkeypatch.setattr(fastokens, "Tokenizer", fastokens.Tokenizer)  # undone after the test
    install()


def _write(path, texts):
    with open(path, "w") as fh:
        fh.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    return str(path)


def _docs(out) -> list[list[int]]:
    from datasets import load_from_disk

    from packtools.core import unpack

    return [list(map(int, s)) for s in unpack(load_from_disk(str(out)).data.table)["input_ids"]]


def _zebra_after_first_file(tmp_path):
    """A small first file (10 clean rows) and a second whose 21st row (the run's 31st) and every 25th after it
    mention a zebra: the run's first 256 rows see one; a proof of the first part alone would not."""
    a = _write(tmp_path / "a.jsonl", [CORPUS[i % len(CORPUS)] for i in range(10)])
    b = _write(
        tmp_path / "b.jsonl",
        [("a zebra " if i % 25 == 20 else "") + CORPUS[i % len(CORPUS)] for i in range(500)],
    )
    return [a, b]


EXECUTORS = [
    "local",
    pytest.param("pool", marks=pytest.mark.slow),
    # one xdist group: one local Ray cluster at a time
    pytest.param("ray", marks=[pytest.mark.slow, pytest.mark.xdist_group("ray")]),
]


@pytest.mark.parametrize("executor", EXECUTORS)
def test_a_divergence_in_the_runs_first_rows_sends_every_part_to_transformers(
    tok, tmp_path, diverging, executor
):
    if executor == "ray":
        pytest.importorskip("ray")
    inputs = _zebra_after_first_file(tmp_path)
    opts = dict(
        tokenizer=tok, tokenizer_audit=0.0, executor=executor, workers=None if executor == "local" else 2
    )
    ref = pack_files(inputs, tmp_path / "ref", 256, tokenizer_engine="transformers", **opts)
    res = pack_files(inputs, tmp_path / "auto", 256, **opts)
    report = res.stats["tokenizer"]
    assert report["parts_by_engine"] == {"transformers": 2}, report
    assert "zebra" in report["reason"]
    assert _docs(res.out) == _docs(ref.out)
    with pytest.raises(PackingError, match="zebra"):
        pack_files(inputs, tmp_path / "fast", 256, tokenizer_engine="fast", **opts)


@pytest.mark.slow
def test_negative_control_without_the_drivers_verdict_the_pool_keeps_diverging_ids(
    tok, tmp_path, diverging, monkeypatch
):
    """The driver's proof switched off (its verdict is the engine chosen on the adversarial set alone): the
    pool's parts keep the fast engine's ids, which differ from transformers'."""
    inputs = _zebra_after_first_file(tmp_path)
    opts = dict(tokenizer=tok, tokenizer_audit=0.0, executor="pool", workers=2)
    ref = pack_files(inputs, tmp_path / "ref", 256, tokenizer_engine="transformers", **opts)
    chosen = fast_tokenize.EngineReport(
        f"{fast_tokenize.ENGINE_MODULE} {fast_tokenize.engine_version()}", "the adversarial set only", "auto"
    )
    monkeypatch.setattr("packtools.pipeline.run.decide", lambda tok, parts, fmt: chosen.to_dict())
    res = pack_files(inputs, tmp_path / "auto", 256, **opts)
    assert "transformers" not in res.stats["tokenizer"]["parts_by_engine"]
    assert _docs(res.out) != _docs(ref.out)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_an_audited_divergence_restages_every_fast_part_or_stops(tok, tmp_path, diverging, executor):
    """Past the driver's proof rows only the audit can see a difference; it sends the whole run to
    transformers (auto: parts the fast engine already staged are staged again, never kept) or stops (fast)."""
    if executor == "ray":
        pytest.importorskip("ray")
    texts = [CORPUS[i % len(CORPUS)] for i in range(300)]
    a = _write(tmp_path / "a.jsonl", texts)
    b = _write(tmp_path / "b.jsonl", [("a zebra " if i == 150 else "") + t for i, t in enumerate(texts)])
    opts = dict(
        tokenizer=tok, tokenizer_audit=1.0, executor=executor, workers=None if executor == "local" else 2
    )
    ref = pack_files([a, b], tmp_path / "ref", 256, tokenizer_engine="transformers", **opts)
    res = pack_files([a, b], tmp_path / "auto", 256, **opts)
    report = res.stats["tokenizer"]
    assert report["parts_by_engine"] == {"transformers": 2}, report
    assert "zebra" in report["reason"] and "line 151" in report["reason"]
    assert _docs(res.out) == _docs(ref.out)
    with pytest.raises(PackingError, match="line 151.*zebra"):
        pack_files([a, b], tmp_path / "fast", 256, tokenizer_engine="fast", **opts)


def test_a_fast_part_landing_after_the_fallback_is_staged_again_and_counted(
    tok, tmp_path, diverging, monkeypatch
):
    """A pool's worker stopped by the divergence can land its fast part after the fallback dropped the fast
    parts: it is dropped and staged again, and counted with them in ``parts_restaged`` (the run's summary says
    how many parts were staged again).  Here the landing is made in order: the first part's fast sidecar, set
    aside when the second part diverged, is put back once the restage is done."""
    import shutil

    from packtools.pipeline import run as run_module
    from packtools.pipeline.tokenizer.proof import EngineDivergence

    texts = [CORPUS[i % len(CORPUS)] for i in range(300)]
    a = _write(tmp_path / "a.jsonl", texts)
    b = _write(tmp_path / "b.jsonl", [("a zebra " if i == 150 else "") + t for i, t in enumerate(texts)])
    real, calls, aside = run_module.run_jobs, [], str(tmp_path / "fast-sidecar")

    def landing_late(ex, fn, jobs, *args, **kwargs):
        if args[0] != "stage":
            return real(ex, fn, jobs, *args, **kwargs)
        calls.append(len(jobs))
        try:
            out = real(ex, fn, jobs, *args, **kwargs)
        except EngineDivergence:
            shutil.copy(jobs[0].sidecar, aside)  # the clean first part, staged by the fast engine
            raise
        if len(calls) == 2:
            shutil.copy(aside, jobs[0].sidecar)  # ... lands now, over the restaged one
        return out

    monkeypatch.setattr(run_module, "run_jobs", landing_late)
    res = pack_files([a, b], tmp_path / "auto", 256, tokenizer=tok, tokenizer_audit=1.0)
    assert len(calls) == 3  # diverged; restaged; the late fast part staged again
    assert res.stats["tokenizer"]["parts_by_engine"] == {"transformers": 2}
    assert res.timings["parts_restaged"] == 2  # the first part, dropped at the fallback and again on landing


def test_profile_restages_every_fast_part_after_an_audited_divergence_or_stops(tok, tmp_path, diverging):
    """``packtools profile`` stages as ``pack`` does, through the same restage: an audit difference (past the
    driver's proof rows, in the second file, where every row mentions a zebra: the default audit rate samples
    some) sends every part to transformers (auto; the clean first part's fast entry is staged again, never
    kept beside it) or stops (fast)."""
    from packtools.pipeline.profile import profile_files
    from packtools.pipeline.staged import sidecar_report

    a = _write(tmp_path / "a.jsonl", [CORPUS[i % len(CORPUS)] for i in range(300)])
    b = _write(tmp_path / "b.jsonl", ["a zebra " + CORPUS[i % len(CORPUS)] for i in range(10_000)])
    res = profile_files([a, b], tok, stage_cache=str(tmp_path / "cache"))
    sidecars = sorted(p for p in os.listdir(res.stage["folder"]) if p.endswith(".npz"))
    reports = [sidecar_report(os.path.join(res.stage["folder"], p)) for p in sidecars]
    assert len(reports) == res.stage["parts"] == 2
    assert [r["engine"] for r in reports] == ["transformers", "transformers"], reports
    assert all("zebra" in r["reason"] for r in reports)
    with pytest.raises(PackingError, match="zebra"):
        profile_files([a, b], tok, tokenizer_engine="fast", stage_cache=str(tmp_path / "fast"))


def test_the_verdict_file_is_checked_by_content_and_basis(tok, tmp_path):
    rests_on = verdict.basis(tok, "text", "auto")
    v = {"engine": "transformers", "requested": "auto", "reason": "fallback: x", "checked": {}}
    verdict.record(str(tmp_path), v, rests_on)
    assert verdict.recorded(str(tmp_path), rests_on) == v
    assert verdict.recorded(str(tmp_path), {**rests_on, "format": "messages"}) is None  # another basis
    path = tmp_path / VERDICT_FILE
    body = json.loads(path.read_text())
    body["verdict"]["engine"] = "fastokens 0.3.5"  # edited: its checksum no longer matches
    path.write_text(json.dumps(body))
    assert verdict.recorded(str(tmp_path), rests_on) is None
    path.write_text("")  # cut
    assert verdict.recorded(str(tmp_path), rests_on) is None


@pytest.mark.slow
def test_a_rerun_after_sigkill_keeps_the_killed_runs_verdict(tok, tmp_path):
    """F2: the killed run fell back (its proof rows had a diverging row); the rerun reuses its staged part and
    stages the others under the same recorded verdict, even though, run without the divergence, its own proof
    would have chosen the fast engine."""
    import time

    texts = [("a zebra " if i == 3 else "") + CORPUS[i % len(CORPUS)] for i in range(800)]
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = str(tmp_path / "in.parquet")
    pq.write_table(pa.table({"text": texts}), src, row_group_size=200)  # 4 parts
    out, log = str(tmp_path / "out"), str(tmp_path / "log")
    args = ["pack", src, "--tokenizer", tok, "--max-length", "256", "--part-rows", "200", "--out", out]
    paused = os.path.join(ROOT, "tests", "_paused_run.py")
    site = site_folder(str(tmp_path / "site"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([site, ROOT])}
    proc = subprocess.Popen([sys.executable, paused, log, "stage:1", *args, "--quiet"], env=env)
    deadline = time.monotonic() + 120
    while not (os.path.exists(log) and "stage:1" in open(log).read().split()):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    work = tmp_path / ".out.packtools" / "stage"
    assert json.loads((work / VERDICT_FILE).read_text())["verdict"]["engine"] == "transformers"
    clean = {**os.environ, "PYTHONPATH": ROOT}  # the rerun's fastokens does not diverge
    cmd = [sys.executable, "-m", "packtools.cli", *args]
    done = subprocess.run(cmd, env=clean, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "reused from an interrupted run" in " ".join(done.stdout.split())
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    report = manifest["stats"]["tokenizer"]
    assert report["parts_by_engine"] == {"transformers": 4} and "zebra" in report["reason"]
    # negative control: the same rerun into a fresh folder decides anew and, without the divergence, goes fast
    done = subprocess.run([*cmd[:-1], str(tmp_path / "fresh")], env=clean, capture_output=True, text=True)
    fresh = json.loads((tmp_path / "fresh" / "manifest.json").read_text())["stats"]["tokenizer"]
    assert "transformers" not in fresh["parts_by_engine"]


def test_a_code_or_library_change_invalidates_staged_parts_and_outputs(tok, tmp_path, monkeypatch):
    """S9: the same command after a code change (same version number) or a tokenizers upgrade neither says
    "cached" nor adopts parts `profile` staged with the old code."""
    from packtools.io import fingerprint
    from packtools.pipeline.profile import profile_files
    from packtools.pipeline.tokenizer import spec

    monkeypatch.setenv("PACKTOOLS_STAGE_CACHE", str(tmp_path / "stage-cache"))
    src = _write(tmp_path / "d.jsonl", [CORPUS[i % len(CORPUS)] for i in range(50)])
    profile_files(src, tok)
    first = pack_files(src, tmp_path / "out", 128, tokenizer=tok)
    assert first.timings["parts_from_stage_cache"] == 1
    assert pack_files(src, tmp_path / "out", 128, tokenizer=tok).cached  # nothing changed
    monkeypatch.setattr(fingerprint, "source_hash", lambda: "edited-checkout")
    monkeypatch.setattr(spec, "source_hash", fingerprint.source_hash)
    edited = pack_files(src, tmp_path / "out", 128, tokenizer=tok)
    assert not edited.cached and edited.timings["parts_from_stage_cache"] == 0
    real = spec.library_versions()
    monkeypatch.setattr(spec, "library_versions", lambda: (*real[:1], ("tokenizers", "99.0"), *real[2:]))
    upgraded = pack_files(src, tmp_path / "out", 128, tokenizer=tok)
    assert not upgraded.cached and upgraded.manifest["fingerprint"] != edited.manifest["fingerprint"]


def test_a_regex_class_difference_is_caught_by_the_adversarial_set(tmp_path):
    """S4: fastokens' \\s includes U+180E, Oniguruma's does not; with a custom Split regex the built-in
    adversarial set (which now holds such characters next to words) sends the run to transformers."""
    from _regex_tokenizer import build

    from packtools.pipeline.tokenizer.batch import BatchTokenizer

    path = build(str(tmp_path / "tok"))
    tok = BatchTokenizer(path, "text")
    assert tok.report.engine == "transformers" and "adversarial set" in tok.report.reason
    texts = [("X\u180e the " if i >= 3000 and i % 100 == 0 else "") + CORPUS[i % 5] for i in range(4000)]
    src = _write(tmp_path / "d.jsonl", texts)
    res = pack_files(src, tmp_path / "o", 4096, tokenizer=path)
    ref = pack_files(src, tmp_path / "r", 4096, tokenizer=path, tokenizer_engine="transformers")
    assert _docs(res.out) == _docs(ref.out)


def test_the_verdict_rests_on_the_runs_ids_spec(tok, tmp_path, monkeypatch):
    """A killed run's verdict is reused only under the same IdsSpec: after a library upgrade or a code change the
    rerun (whose staged parts all change key) proves the engine again instead of taking the old verdict."""
    from packtools.pipeline import run
    from packtools.pipeline.tokenizer import spec

    seen = []
    real_recorded = run.recorded
    monkeypatch.setattr(
        run, "recorded", lambda folder, rests_on: seen.append(rests_on) or real_recorded(folder, rests_on)
    )
    src = _write(tmp_path / "d.jsonl", [CORPUS[i % len(CORPUS)] for i in range(20)])
    pack_files(src, tmp_path / "a", 128, tokenizer=tok)
    real = spec.library_versions()
    monkeypatch.setattr(spec, "library_versions", lambda: (*real[:1], ("tokenizers", "99.0"), *real[2:]))
    pack_files(src, tmp_path / "b", 128, tokenizer=tok)
    assert (
        seen[0]["ids"]["libraries"]["tokenizers"] != "99.0"
        and seen[1]["ids"]["libraries"]["tokenizers"] == "99.0"
    )
    # ("reference" marks a first run's provisional reference: a run whose tokenizer this process had not
    # loaded under these libraries yet checks it, packtools.pipeline.tokenizer.verdict.provisional)
    assert {k: v for k, v in seen[0].items() if k not in ("ids", "reference")} == {
        k: v for k, v in seen[1].items() if k not in ("ids", "reference")
    }
