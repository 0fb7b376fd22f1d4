"""The suite says when packtools' sources changed while it ran (tests/conftest.py): every fingerprint holds
their hash, so a kill-and-rerun test whose reference run came before an edit fails though nothing is wrong."""

from __future__ import annotations

import os
import time

from conftest import sources_changed_note


def test_an_edit_during_the_run_is_named(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    started = time.time_ns()
    (tmp_path / "b.py").write_text("y = 2\n")
    os.utime(tmp_path / "a.py", ns=(started - 10**9, started - 10**9))  # untouched since the start
    note = sources_changed_note(str(tmp_path), "before", started, "after")
    assert note is not None and "changed while the tests ran" in note
    assert "b.py" in note and "a.py" not in note


def test_unchanged_sources_say_nothing(tmp_path):
    assert sources_changed_note(str(tmp_path), "same", time.time_ns(), "same") is None
