"""Chat cells of JSON input kept as each row wrote them.

Arrow's JSON reader unifies nested objects across rows: the keys of other rows are added as null, ``10`` is read
as ``10.0`` next to ``12.5``, a 20-digit integer becomes a float, date-like strings become timestamps.  A chat
template would then render what no row says (a tool call's arguments with other calls' keys, every text part
taken for an image part).  So the chat columns (:data:`CHAT_COLUMNS`) that Arrow did not read as plain strings
hold JSON text instead, marked in the field's metadata (:data:`JSON_CELLS`): for JSON lines, each row's own line
as the file holds it (``b"row"``: the cell is the row's object, the column's value is its key; the lines are one
buffer shared by every such column, nothing parsed while reading); for JSON arrays, the value itself (``b"value"``).
:func:`cells` gives the values back with the JSON's own keys and types.

>>> import pyarrow as pa
>>> t = own_json_cells(pa.table({"messages": [[{"a": 1.0}]]}), lambda: large_strings([b'{"messages": [{"a": 1}]}']))
>>> cells(t, "messages")
[[{'a': 1}]]
>>> field, array = value_column("tools", [[{"a": 10}], None])
>>> cells(pa.Table.from_arrays([array], schema=pa.schema([field])), "tools")
[[{'a': 10}], None]
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

import numpy as np
import pyarrow as pa

#: Columns that hold chat data (the formats' conversational columns and TRL's ``tools``).
CHAT_COLUMNS = ("messages", "prompt", "completion", "chosen", "rejected", "tools")
#: Field metadata key marking a column of JSON texts: ``b"row"`` (the row's whole object) or ``b"value"``.
JSON_CELLS = b"packtools.json_cells"


def large_strings(parts: Sequence[bytes], valid: np.ndarray | None = None) -> pa.Array:
    """UTF-8 byte strings (JSON lines, JSON texts; ``valid``: false where null) as a ``large_string`` array,
    built from its buffers (``pa.array`` on a Python list would import pandas)."""
    offsets = np.zeros(len(parts) + 1, np.int64)
    np.cumsum(np.fromiter(map(len, parts), np.int64, len(parts)), out=offsets[1:])
    bitmap, nulls = None, 0
    if valid is not None and not valid.all():
        bitmap, nulls = pa.py_buffer(np.packbits(valid, bitorder="little")), int((~valid).sum())
    data = pa.py_buffer(b"".join(parts))
    return pa.LargeStringArray.from_buffers(len(parts), pa.py_buffer(offsets), data, bitmap, nulls)


def own_json_cells(table: pa.Table, lines: Callable[[], pa.Array]) -> pa.Table:
    """``table`` with each :data:`CHAT_COLUMNS` column that Arrow did not read as plain strings replaced by
    ``lines()`` (the rows' own JSON lines, :func:`large_strings`), marked ``b"row"`` so :func:`cells` takes the
    column's key from each row's object as the file wrote it."""
    names = []
    for n in CHAT_COLUMNS:
        if n in table.column_names:
            t = table.schema.field(n).type
            if not (pa.types.is_string(t) or pa.types.is_large_string(t)):
                names.append(n)
    if not names:
        return table
    column = lines()
    for name in names:
        field = pa.field(name, pa.large_string(), metadata={JSON_CELLS: b"row"})
        table = table.set_column(table.schema.get_field_index(name), field, column)
    return table


def value_column(name: str, values: Sequence[object]) -> tuple[pa.Field, pa.Array]:
    """Column ``name`` of ``values`` (Python objects) as JSON texts marked ``b"value"``: its field and array."""
    texts = [b"" if v is None else json.dumps(v, ensure_ascii=False).encode() for v in values]
    array = large_strings(texts, np.fromiter((v is not None for v in values), bool, len(values)))
    return pa.field(name, pa.large_string(), metadata={JSON_CELLS: b"value"}), array


def cells(table: pa.Table, name: str) -> list:
    """Column ``name`` of ``table`` as Python values: a :data:`JSON_CELLS` column parsed (the input's own keys
    and types), any other column as Arrow gives it."""
    mode = (table.schema.field(name).metadata or {}).get(JSON_CELLS)
    values = table.column(name).to_pylist()
    if mode == b"row":
        return [None if v is None else json.loads(v).get(name) for v in values]
    if mode is not None:
        return [None if v is None else json.loads(v) for v in values]
    return values
