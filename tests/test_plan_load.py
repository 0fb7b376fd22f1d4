"""T2: a cut or corrupted plan file is one PackingError naming the file and the fix, not a raw zip/numpy error."""

from __future__ import annotations

import numpy as np
import pytest

from packtools import plan
from packtools.core.plan import PackPlan
from packtools.errors import PackingError


@pytest.mark.parametrize("damage", ["cut in half", "0 bytes", "random bytes", "one bit flipped", "one array"])
def test_a_damaged_plan_file_names_the_file(tmp_path, damage):
    p = plan(np.random.default_rng(0).integers(1, 50, 1000), 64)
    good = tmp_path / "plan.npz"
    p.save(str(good))
    data = good.read_bytes()
    bad = tmp_path / "bad.npz"
    if damage == "cut in half":
        bad.write_bytes(data[: len(data) // 2])
    elif damage == "0 bytes":
        bad.write_bytes(b"")
    elif damage == "random bytes":
        bad.write_bytes(np.random.default_rng(1).bytes(500))
    elif damage == "one bit flipped":
        flipped = bytearray(data)
        flipped[len(flipped) // 3] ^= 1
        bad.write_bytes(bytes(flipped))
    else:
        np.save(str(tmp_path / "one.npy"), np.arange(3))
        bad = tmp_path / "one.npy"
    with pytest.raises(PackingError, match="cannot be read as a packtools plan") as info:
        PackPlan.load(str(bad))
    assert repr(str(bad)) in str(info.value) and "make the plan again" in str(info.value)
    assert "pickled" not in str(info.value)
    # control: the intact file loads the same plan
    assert PackPlan.load(str(good)).num_rows == p.num_rows


def test_a_missing_plan_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="plan file .* does not exist"):
        PackPlan.load(str(tmp_path / "nope.npz"))
