import os
import time

# One intra-op thread for torch and BLAS in the test process and the processes it starts (set before numpy and torch
# are imported): the exactness tests compare a packed run with a padded or one-by-one run of other shapes, and with
# several threads the two reduce in different orders, so rounding (~1e-7) differs run to run; over two RL steps
# (generation, normalized advantages) it grew to 7e-5 relative in CI. A caller's own setting is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile(
    "nojit", max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("nojit" if os.environ.get("NUMBA_DISABLE_JIT") == "1" else "ci")


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def pytest_configure(config):
    """Keep packtools' user caches (the stage cache `packtools profile` fills, the tokenizer reference verdicts)
    out of the home folder and fresh for every run: a cache left by an earlier run, or by an earlier test of
    this one through another name, must never decide what a test sees. Subprocesses inherit the variables.
    Under pytest-xdist each worker gets folders of its own: the workers inherit the controller's environment, and
    two processes filling one stage cache would each see the other's entries (a caller's own setting is kept)."""
    import tempfile

    root = tempfile.mkdtemp(prefix="packtools-test-caches-")
    inherited = os.environ.get("PACKTOOLS_TEST_CACHES")  # the folders an xdist controller chose
    for name, sub in (("PACKTOOLS_STAGE_CACHE", "stage"), ("PACKTOOLS_CACHE_DIR", "cache")):
        if inherited and os.environ.get(name) == os.path.join(inherited, sub):
            del os.environ[name]
        os.environ.setdefault(name, os.path.join(root, sub))
    os.environ["PACKTOOLS_TEST_CACHES"] = root
    from packtools.io.fingerprint import source_hash

    config.stash[_SOURCES] = (source_hash.__wrapped__(), time.time_ns())


#: packtools' source hash and the time when the session began (pytest_configure).
_SOURCES = pytest.StashKey[tuple[str, int]]()


def sources_changed_note(root: str, start_hash: str, started_ns: int, now_hash: str) -> str | None:
    """What to tell the tester when packtools' sources (the ``.py`` files under ``root``) hash to ``now_hash``
    at the end of the session but to ``start_hash`` at its start (else None).  Every cache key, stage file name,
    shard name and manifest fingerprint includes that hash (``packtools.io.fingerprint.source_hash``), so a
    file edited, added or removed while the tests ran makes a rerun differ from a reference run made before the
    edit: the kill-and-rerun tests then fail with other shard names and no part reused (10 did so under
    pytest-xdist while a source file was edited in the checkout being tested), though nothing is wrong."""
    if start_hash == now_hash:
        return None
    newer = sorted(
        os.path.relpath(os.path.join(folder, n), root)
        for folder, _, names in os.walk(root)
        for n in names
        if n.endswith(".py") and os.stat(os.path.join(folder, n)).st_mtime_ns >= started_ns
    )
    which = f" (changed since the start: {', '.join(newer[:5])})" if newer else " (a file added or removed)"
    return (
        f"packtools' sources under {root} changed while the tests ran{which}: runs before and after the change "
        f"have other fingerprints, so tests comparing a rerun with an earlier reference run (kill-and-rerun, "
        f"caches) fail without a bug. Run the tests again on a tree nobody edits meanwhile."
    )


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _SOURCES not in config.stash:
        return
    import packtools
    from packtools.io.fingerprint import source_hash

    start_hash, started = config.stash[_SOURCES]
    note = sources_changed_note(
        os.path.dirname(os.path.abspath(packtools.__file__)), start_hash, started, source_hash.__wrapped__()
    )
    if note:
        terminalreporter.write_sep("=", "packtools sources changed during the run", red=True)
        terminalreporter.write_line(note, red=True)


@pytest.fixture(autouse=True)
def _own_packtools_cache(tmp_path_factory, monkeypatch):
    """Each test gets an empty packtools cache (recorded reference and proof verdicts): a verdict recorded by
    another test, or by an earlier run in ~/.cache, must not skip the proof a test breaks on purpose."""
    monkeypatch.setenv("PACKTOOLS_CACHE_DIR", str(tmp_path_factory.mktemp("packtools-cache")))


@pytest.fixture(autouse=True)
def _own_loaded_tokenizers():
    """Each test starts with no tokenizer loaded by another (``pipeline.stage`` keeps one per folder path and
    content for the process).  pytest >= 9 removes a passing test's ``tmp_path`` at its end and hands the same
    path to the next parametrized case, so a tokenizer folder rebuilt there with the same files would reuse the
    earlier case's tokenizer, loaded under that case's patches and cache folder (six tokenizer-check tests failed
    so, in order, and passed alone)."""
    import sys

    stage = sys.modules.get("packtools.pipeline.stage")
    if stage is not None:
        stage._TOKENIZERS.clear()
    yield
