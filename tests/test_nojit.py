"""Run the kernel tests again with NUMBA_DISABLE_JIT=1: the kernels' pure-Python semantics must agree."""

import os
import subprocess
import sys
from pathlib import Path


def test_kernels_without_jit():
    env = dict(os.environ, NUMBA_DISABLE_JIT="1")
    root = Path(__file__).parent
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(root / "test_kernels.py")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout
