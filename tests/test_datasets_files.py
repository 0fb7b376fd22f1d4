"""S18: ``pack_dataset``'s cache is keyed on the Arrow files behind a dataset too, not only on its
``_fingerprint``: files replaced under an unchanged ``state.json`` are packed again."""

from __future__ import annotations

import glob
import os
import shutil
import time

import pytest

from packtools import pack_dataset

datasets = pytest.importorskip("datasets")


def test_replaced_arrow_files_under_the_same_state_json_are_packed_again(tmp_path):
    saved, other = str(tmp_path / "s"), str(tmp_path / "other")
    datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5], [6]]}).save_to_disk(saved)
    datasets.Dataset.from_dict({"input_ids": [[7, 8], [9], [10, 11, 12]]}).save_to_disk(other)
    first = pack_dataset(datasets.load_from_disk(saved), 4)
    assert sorted(t for row in first["input_ids"] for t in row) == [1, 2, 3, 4, 5, 6]
    assert pack_dataset(datasets.load_from_disk(saved), 4)["input_ids"] == first["input_ids"]  # cached: same
    time.sleep(0.01)
    (mine,) = glob.glob(os.path.join(saved, "data-*.arrow"))
    (theirs,) = glob.glob(os.path.join(other, "data-*.arrow"))
    shutil.copyfile(theirs, mine)  # other rows, the same state.json (and so the same _fingerprint)
    again = datasets.load_from_disk(saved)
    assert again._fingerprint == datasets.load_from_disk(saved)._fingerprint
    packed = pack_dataset(again, 4)
    assert sorted(t for row in packed["input_ids"] for t in row) == [7, 8, 9, 10, 11, 12]
