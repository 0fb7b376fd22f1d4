"""`packtools._lazy.lazy_module` read from several threads at once: each thread sees the whole module.

Python 3.11's ``importlib.util.LazyLoader`` marks a module loaded before running it, so a second thread reading
an attribute meanwhile saw a half-run module (``AttributeError`` on a kernel)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import types

from packtools._lazy import lazy_module

SLOW = "_packtools_test_slow_module"
GATE = "_packtools_test_gate"


def test_a_second_thread_waits_for_the_first_threads_load(tmp_path, monkeypatch):
    """One thread starts loading a lazy module whose top level waits on a gate; a read from another thread
    meanwhile waits for the load and sees the module's names, and the module runs once."""
    gate = types.ModuleType(GATE)
    gate.started, gate.proceed, gate.runs = threading.Event(), threading.Event(), []
    monkeypatch.setitem(sys.modules, GATE, gate)
    (tmp_path / f"{SLOW}.py").write_text(
        f"import sys\ngate = sys.modules[{GATE!r}]\ngate.runs.append(1)\ngate.started.set()\n"
        "gate.proceed.wait(60)\nVALUE = 42\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        slow = lazy_module(SLOW)
        assert gate.runs == []  # nothing ran yet
        first: list[int] = []
        loader = threading.Thread(target=lambda: first.append(slow.VALUE))
        loader.start()
        assert gate.started.wait(60)  # `loader` is now inside the module's top level
        release = threading.Timer(0.2, gate.proceed.set)  # lets the load finish while this thread reads
        release.start()
        try:
            assert slow.VALUE == 42
        finally:
            gate.proceed.set()
            release.cancel()
            loader.join(60)
        assert first == [42] and gate.runs == [1]
    finally:
        sys.modules.pop(SLOW, None)


def test_two_threads_pack_files_at_once_in_a_fresh_process(tmp_path):
    """The reported failure: two threads of one fresh process (kernels not imported yet) each run
    ``pack_files``; both finish and write the same rows."""
    code = textwrap.dedent(
        f"""
        import os, threading
        import pyarrow as pa, pyarrow.parquet as pq
        import packtools
        from packtools.io.files import mapped_table

        d = {str(tmp_path)!r}
        src = os.path.join(d, "in.parquet")
        pq.write_table(pa.table({{"input_ids": [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]}}), src)
        errors, barrier = [], threading.Barrier(2)

        def pack(i):
            barrier.wait()
            try:
                packtools.pack_files(src, os.path.join(d, f"out{{i}}"), max_length=4)
            except Exception as e:
                errors.append(repr(e))

        threads = [threading.Thread(target=pack, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        rows = []
        for i in range(2):
            out = os.path.join(d, f"out{{i}}")
            arrows = sorted(f for f in os.listdir(out) if f.endswith(".arrow"))
            rows.append([mapped_table(os.path.join(out, f)).column("input_ids").to_pylist() for f in arrows])
        print(rows[0] == rows[1] and sum(len(r) for r in rows[0]) > 0)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True", done.stdout + done.stderr


def test_the_stand_in_pickles_as_the_module_it_stands_for():
    """Ray (cloudpickle) and dill pickle a module by name; a function they pickle by value (one made in a
    notebook) that reads a stand-in pickles it too: it unpickles as the module, and pickling it imports
    nothing."""
    import importlib
    import pickle

    sys.modules.pop("colorsys", None)
    stand_in = lazy_module("colorsys")
    data = pickle.dumps(stand_in)
    assert "colorsys" not in sys.modules  # not imported by the pickling
    assert pickle.loads(data) is importlib.import_module("colorsys")
    assert stand_in.rgb_to_hsv(1.0, 0.0, 0.0) == (0.0, 1.0, 1.0)
