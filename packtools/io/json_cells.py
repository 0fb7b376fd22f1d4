"""Chat cells of JSON input kept as each row wrote them.

Arrow's JSON reader unifies nested objects across rows: the keys of other rows are added as null, ``10`` is read
as ``10.0`` next to ``12.5``, a 20-digit integer becomes a float, date-like strings become timestamps.  A chat
template would then render what no row says (a tool call's arguments with other calls' keys, every text part
taken for an image part).  So the chat columns (:data:`CHAT_COLUMNS`) that Arrow did not read as plain strings
hold each row's own value as JSON text instead, marked with :data:`JSON_CELLS`, and :func:`cells` gives the
values back with the JSON's own keys and types.

>>> import pyarrow as pa
>>> t = own_json_cells(pa.table({"messages": [[{"a": 1.0}]]}), lambda: [{"messages": [{"a": 1}]}])
>>> cells(t, "messages")
[[{'a': 1}]]
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pyarrow as pa

#: Columns that hold chat data (the formats' conversational columns and TRL's ``tools``).  Arrow's JSON reader
#: unifies nested objects across rows (keys of other rows added as null, ``10`` read as ``10.0``, a 20-digit
#: integer as a float, date-like strings as timestamps): a template would render what no row says.  Their
#: nested cells are kept as each row's own JSON text instead (see :func:`own_json_cells`, :func:`cells`).
CHAT_COLUMNS = ("messages", "prompt", "completion", "chosen", "rejected", "tools")
#: Field metadata key marking a string column whose cells are JSON texts of the input's own values.
JSON_CELLS = b"packtools.json_cells"


def json_text(value: object) -> str | None:
    return None if value is None else json.dumps(value, ensure_ascii=False)


def own_json_cells(table: pa.Table, objects: Callable[[], list[dict]]) -> pa.Table:
    """``table`` with each :data:`CHAT_COLUMNS` column that Arrow did not read as plain strings replaced by the
    JSON text of each row's own value (``objects()``: the rows as Python parsed them), marked with
    :data:`JSON_CELLS` so :func:`cells` gives the values back as the file wrote them."""
    names = [
        n
        for n in CHAT_COLUMNS
        if n in table.column_names
        and not pa.types.is_string(t := table.schema.field(n).type)
        and not pa.types.is_large_string(t)
    ]
    if not names:
        return table
    rows = objects()
    for name in names:
        field = pa.field(name, pa.large_string(), metadata={JSON_CELLS: b"1"})
        column = pa.array([json_text(row.get(name)) for row in rows], pa.large_string())
        table = table.set_column(table.schema.get_field_index(name), field, column)
    return table


def cells(table: pa.Table, name: str) -> list:
    """Column ``name`` of ``table`` as Python values: a :data:`JSON_CELLS` column's JSON texts parsed (the input's
    own keys and types), any other column as Arrow gives it."""
    field = table.schema.field(name)
    values = table.column(name).to_pylist()
    if field.metadata and field.metadata.get(JSON_CELLS):
        return [None if v is None else json.loads(v) for v in values]
    return values
