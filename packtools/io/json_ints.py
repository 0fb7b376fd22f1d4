"""Already tokenized JSON lines (``{"input_ids": [1, 2, ...], ...}``) read by a Numba scan instead of Arrow's JSON
reader: a block whose every line is one object of the same keys in the same order, each value a list of integers,
becomes the table Arrow would read (``list<int64>`` columns in key order) at several times its speed and with
no intermediate copy.  Anything else — a blank line, another key or key order, a float, ``null``, a string, a
number of more than 18 digits, a non-ASCII byte — makes the scan give up on the block, which the caller then
reads with Arrow as before (its errors, its types).  Nothing is guessed: the scan accepts a strict subset of
JSON, and on that subset its numbers are the ones Arrow reads (``tests/test_json_ints.py`` compares them).

>>> data = b'{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}\\n{"input_ids": [], "labels": []}\\n'
>>> keys = int_list_keys(data)
>>> keys
['input_ids', 'labels']
>>> read_int_lists(data, keys).to_pydict()
{'input_ids': [[1, 2, 3], []], 'labels': [[-100, 2, 3], []]}
>>> read_int_lists(b'{"input_ids": [1.5]}\\n', ["input_ids"]) is None   # a float: Arrow reads the block
True
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa

from ..core.arrow import numeric_array
from .json_cells import CHAT_COLUMNS


def int_list_keys(data: bytes) -> list[str] | None:
    """The keys of the first line of ``data`` when that line is an object whose values are all lists of
    integers and whose keys the scan can match byte for byte (ASCII, no quote or backslash, not a chat
    column); else None (the file is read by Arrow alone)."""
    start = len(data) - len(data.lstrip())
    end = data.find(b"\n", start)
    line = data[start : end if end >= 0 else len(data)]
    if not line.strip().startswith(b"{"):
        return None
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not obj:
        return None
    for key, value in obj.items():
        if not key.isascii() or '"' in key or "\\" in key or key in CHAT_COLUMNS:
            return None
        if not isinstance(value, list) or not all(type(v) is int for v in value):
            return None
    return list(obj)


def read_int_lists(data: bytes, keys: list[str]) -> pa.Table | None:
    """The table of the JSON lines ``data`` if every line is an object of exactly ``keys``, in that order, with
    lists of integers as values (see the module docstring); else None.  A block in which a key holds no value
    at all is also left to Arrow (which types such a column ``list<null>``)."""
    from .._lazy import load_now

    int_list_lines = load_now(
        "packtools.core.kernels"
    ).int_list_lines  # this thread may not be the first to load it

    raw = np.frombuffer(data, np.uint8)
    names = [k.encode() for k in keys]
    key_bytes = np.frombuffer(b"".join(names), np.uint8) if any(names) else np.zeros(0, np.uint8)
    key_starts = np.cumsum([0] + [len(k) for k in names]).astype(np.int64)
    # one scan: each key's values into its own region of room enough for any block (a value takes at least two
    # bytes: a digit and a separator); the columns are views of what was written (pages past it are never touched)
    room = (raw.size + 1) // 2
    # rows at most: a line holds at least `{"key":[]}` and a newline (counting the newlines costs a pass)
    lines = raw.size // (len(names[0]) + 7) + 1
    offsets = np.empty((len(keys), lines + 1), np.int64)
    offsets[:, 0] = np.arange(len(keys), dtype=np.int64) * room
    values = np.empty(room * len(keys), np.int64)
    rows = int_list_lines(raw, key_bytes, key_starts, offsets, values, True)
    if rows <= 0:
        return None
    offsets = offsets[:, : rows + 1]
    counts = offsets[:, -1] - offsets[:, 0]
    if not counts.all():
        return None
    arrays = []
    for c in range(len(keys)):
        local = offsets[c] - offsets[c, 0]
        # numeric_array: not pa.array, which imports pandas (0.25 CPU seconds, in the reading thread)
        vals = numeric_array(values[offsets[c, 0] : offsets[c, -1]], pa.int64())
        if local[-1] < 2**31:
            arrays.append(pa.ListArray.from_arrays(numeric_array(local.astype(np.int32), pa.int32()), vals))
        else:
            arrays.append(pa.LargeListArray.from_arrays(numeric_array(local, pa.int64()), vals))
    return pa.Table.from_arrays(arrays, names=keys)
