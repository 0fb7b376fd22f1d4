"""JSON input read in blocks: JSON lines (parsed by Arrow, block by block; blocks of token-id lists by a Numba
scan, :mod:`packtools.io.json_ints`) and files holding one JSON array (parsed object by object).  Memory is
bounded by the block size and the longest line or object, never by the file size; every byte is parsed once.
Errors name the file and its real line number: the slow Python parse that finds the culprit runs only when
Arrow has already refused a block.

>>> import os, tempfile
>>> path = os.path.join(tempfile.mkdtemp(), "rows.jsonl")
>>> _ = open(path, "w").write('{"text": "a"}\\n{"text": "b"}\\n{"text": "c"}\\n')
>>> [(k, t.num_rows) for k, t in iter_json_lines(path, block_bytes=20)]  # k: lines after the first
[(0, 1), (1, 1), (2, 1)]
>>> _ = open(path, "w").write('{"text": "a"}\\n{"text": "b",}\\n')
>>> list(iter_json_lines(path))
Traceback (most recent call last):
...
packtools.errors.PackingError: input '...rows.jsonl' line 2 column 14: malformed JSON (Expecting property name enclosed in double quotes); fix or remove that line.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import re
from collections.abc import Iterator
from typing import IO

import numpy as np
import pyarrow as pa

from ..errors import PackingError
from .json_cells import CHAT_COLUMNS, large_strings, own_json_cells, value_column
from .json_ints import int_list_keys, read_int_lists

BLOCK_BYTES = 1 << 24
#: An object longer than this (in characters) is reported as malformed rather than read on to the end.
MAX_OBJECT_CHARS = 1 << 27
_WRAPPED = re.compile(rb'^\s*\{\s*"(?:[^"\\]|\\.)*"\s*:\s*\[')


def is_json_array(path: str) -> bool:
    """Whether the file holds one JSON array of objects (``[...]``, or ``{"name": [...]}`` wrapping one)
    rather than JSON lines (one object per line)."""
    with open(path, "rb") as fh:
        head = fh.read(1 << 16)
    head = head.lstrip(b" \t\r\n\xef\xbb\xbf")
    if head[:1] == b"[":
        return True
    if head[:1] != b"{" or not _WRAPPED.match(head):
        return False
    first = head.split(b"\n", 1)[0]
    try:
        json.loads(first)
        return False  # the first line is a whole object: JSON lines
    except ValueError:
        return True


def utf16_name(raw: bytes) -> str | None:
    """``"UTF-16"`` / ``"UTF-16LE"`` / ``"UTF-16BE"`` (or ``"UTF-32"``) when ``raw`` (a file's first bytes or
    one of its lines) looks like that encoding: a byte-order mark, or a NUL beside most ASCII characters.

    >>> utf16_name('{"a": 1}'.encode("utf-16")), utf16_name('{"a": 1}'.encode("utf-16-le")), utf16_name(b'{"a": 1}')
    ('UTF-16', 'UTF-16LE', None)
    """
    if raw.startswith((b"\xff\xfe\x00\x00", b"\x00\x00\xfe\xff")):
        return "UTF-32"
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        return "UTF-16"
    body = raw.strip(b"\x00")
    if len(body) >= 2 and raw.count(b"\x00") * 3 >= len(raw):
        odd = raw[1::2].count(0) >= raw[0::2].count(0)
        return "UTF-16LE" if odd else "UTF-16BE"
    return None


def not_utf8(path: str, line: int, raw: bytes, start: int, end: int) -> PackingError:
    wide = utf16_name(raw)
    how = (
        f"the file looks {wide}-encoded; re-encode it as UTF-8 (iconv -f {wide} -t UTF-8 IN > OUT)"
        if wide
        else "re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8 IN > OUT, for a Latin-1 file) or remove "
        "that line"
    )
    return PackingError(
        f"input {path!r} line {line}: bytes {raw[start:end]!r} at column {start + 1} are not UTF-8; {how}."
    )


def _find_bad_line(path: str, data: bytes, first_line: int) -> PackingError | None:
    """The error for the first line of ``data`` that is not one UTF-8 JSON object (error path only)."""
    for i, raw in enumerate(data.split(b"\n")):
        line = first_line + i
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            return not_utf8(path, line, raw, exc.start, exc.end)
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            wide = utf16_name(raw)
            if wide:
                return not_utf8(path, line, raw, raw.index(b"\x00"), raw.index(b"\x00") + 1)
            return PackingError(
                f"input {path!r} line {line} column {exc.colno}: malformed JSON ({exc.msg}); fix or remove that line."
            )
        if not isinstance(obj, dict):
            return PackingError(
                f"input {path!r} line {line}: each JSON line must be an object ({{...}}), got {type(obj).__name__}."
            )
    return None


def _valid_utf8(table: pa.Table, data: bytes | memoryview) -> bool:
    """Whether the JSON ``data`` that Arrow parsed into ``table`` is UTF-8 (Arrow's JSON reader takes invalid
    bytes inside strings as they are).  Arrow's own check of every string is faster than decoding ``data``;
    field names are not in that check, so a name that shows a replacement character decodes ``data`` to tell an
    invalid byte from a real U+FFFD.  ASCII ``data`` needs neither (the caller checks that first)."""
    try:
        table.validate(full=True)
        if "\ufffd" in table.schema.to_string():
            str(data, "utf-8")
    except (pa.ArrowInvalid, UnicodeDecodeError):
        return False
    return True


def _arrow_json_error(path: str, data: bytes, first_line: int, exc: Exception) -> PackingError:
    """Arrow's refusal of valid JSON (Python's parser took every line), as a line number and what to change."""
    msg = str(exc).replace("JSON parse error: ", "").strip()
    where = f"lines {first_line}+"
    found = re.search(r"in row (\d+)", msg)
    if found:  # Arrow counts objects: the row-th non-blank line
        rows = [i for i, raw in enumerate(data.split(b"\n")) if raw.strip()]
        k = int(found.group(1))
        if k < len(rows):
            where = f"line {first_line + rows[k]}"
        msg = msg[: found.start()].strip()
    if "surrogate" in msg:
        fix = (
            "a lone UTF-16 surrogate escape (such as \\ud800) is not a character and cannot be read; replace or "
            "remove it"
        )
    elif "changed from" in msg:
        fix = (
            "a key holds values of different types in different rows (e.g. a message's content as a list of parts "
            "in one row and a string in another); one column has one type: make them all strings or all lists"
        )
    else:
        fix = "fix that line"
    return PackingError(f"input {path!r} {where}: JSON that Arrow cannot read ({msg}); {fix}.")


def count_lines(path: str, stop: int) -> int:
    """Newlines in the first ``stop`` bytes of ``path`` (read in blocks; used to number lines on errors)."""
    n = 0
    with open(path, "rb") as fh:
        left = stop
        while left > 0:
            chunk = fh.read(min(left, 1 << 24))
            if not chunk:
                break
            n += chunk.count(b"\n")
            left -= len(chunk)
    return n


def _rows_from(path: str, first: int, base: LineBase | None) -> Iterator[tuple[int, bytes]]:
    """``(line, text)`` of each row of a JSON lines file from line ``first`` (1-based) on, blank lines (which the
    reader skips) left out; ``base``: a known line start at or before ``first``, where the reading starts."""
    with open(path, "rb") as fh:
        n = 1
        if base is not None and base.value <= first:
            fh.seek(base.start)
            n = base.value
        for line in fh:
            if n >= first and line.strip():
                yield n, line
            n += 1


def row_line(path: str, first: int, k: int, base: LineBase | None = None) -> int:
    """The line of the ``k``-th row (0-based) of a JSON lines file counted from line ``first`` (1-based, the line
    of a row): blank lines, which the reader skips, hold no row.  ``base``: a known line start at or before
    ``first`` (the part's), where the reading starts.  Read on errors and reports only."""
    for n, _ in itertools.islice(_rows_from(path, first, base), k, None):
        return n
    return first + k  # past the end (the file changed since): the rows counted as lines


def row_texts(path: str, first: int, k: int, base: LineBase | None = None) -> Iterator[bytes]:
    """The text of the rows from row ``k`` on (0-based, as :func:`row_line` counts them from line ``first``) of a
    JSON lines file, blank lines skipped.  Read on errors only."""
    for _, line in itertools.islice(_rows_from(path, first, base), k, None):
        yield line


def line_ranges(path: str, part_bytes: int) -> list[tuple[int, int]]:
    """Byte ranges ``[start, stop)`` of about ``part_bytes`` each, cut just after a newline, covering the file."""
    size = os.path.getsize(path)
    cuts = [0]
    with open(path, "rb") as fh:
        while cuts[-1] + part_bytes < size:
            fh.seek(cuts[-1] + part_bytes)
            fh.readline()
            pos = fh.tell()
            if pos >= size:
                break
            cuts.append(pos)
    cuts.append(size)
    return list(zip(cuts[:-1], cuts[1:]))


class LineBase:
    """The line number of byte ``start`` of a file, counted only when first asked for (errors need it)."""

    def __init__(self, path: str, start: int) -> None:
        self.path, self.start = path, start

    @functools.cached_property
    def value(self) -> int:
        return 1 if self.start == 0 else 1 + count_lines(self.path, self.start)


class _Blocks:
    """The bytes ``[start, stop)`` of a file as blocks that end just after a newline, read into one buffer
    reused for every block: a fresh 16 MiB ``bytes`` per read costs page faults (and, on a VM whose balloon
    hands freed pages back to the host, system time), which a reused buffer does not.  Each block is the
    ``block_bytes`` from the end of the previous one cut at its last newline (a line longer than that: the
    buffer grows by ``block_bytes`` until it holds a newline or the end), the same blocks as reading each
    afresh; the unfinished last line is moved to the front of the buffer for the next block.

    A block (:meth:`next`) is a view of the buffer, valid only until the next call: a consumer that keeps
    anything past that keeps a copy (Arrow's JSON reader builds its own buffers: ``tests/test_io_json.py``
    checks a table is unchanged by later reads)."""

    def __init__(self, fh: IO[bytes], size: int, block_bytes: int) -> None:
        self.fh, self.left, self.block_bytes = fh, size, block_bytes
        self.buf = bytearray(min(block_bytes, size))
        self.filled = 0  # bytes of the buffer read and not yet given out (the front: the unfinished line)

    def next(self) -> tuple[bytearray, int] | None:
        """``(buffer, end)``: the next block is ``buffer[:end]``; None after the last."""
        want = self.block_bytes
        while True:
            room = min(want, self.filled + self.left)
            if room > len(self.buf):  # a line longer than the buffer (rare): a bigger one, the front copied
                grown = bytearray(room)
                memoryview(grown)[: self.filled] = memoryview(self.buf)[: self.filled]
                self.buf = grown
            self._fill(room)
            if self.filled == 0:
                return None
            if self.left == 0:  # the end (or a file cut short meanwhile: iter_part says so)
                return self.buf, self.filled
            end = self.buf.rfind(b"\n", 0, self.filled) + 1
            if end:
                return self.buf, end
            want += self.block_bytes  # no newline yet: read on

    def _fill(self, room: int) -> None:
        view = memoryview(self.buf)
        while self.filled < room:
            n = self.fh.readinto(view[self.filled : room])
            if not n:
                self.left = 0
                break
            self.filled += n
            self.left -= n

    def keep_tail(self, end: int) -> None:
        """Move the bytes after the block ``buffer[:end]`` (the unfinished line) to the front of the buffer."""
        view = memoryview(self.buf)
        tail = self.filled - end
        view[:tail] = view[end : self.filled]  # memoryview assignment is a memmove: overlap is safe
        self.filled = tail


_SPACE = re.compile(rb"[ \t\n\r\x0b\x0c]*")  # what bytes.lstrip() strips


def _ends_with_newline(buf: bytearray, end: int) -> bool:
    """Whether ``buf[:end]`` without its trailing spaces, tabs and CRs ends with a newline."""
    i = end
    while i and buf[i - 1] in b" \t\r":
        i -= 1
    return i > 0 and buf[i - 1] == 0x0A


def iter_json_lines(
    path: str, start: int = 0, stop: int | None = None, block_bytes: int = BLOCK_BYTES
) -> Iterator[tuple[int, pa.Table]]:
    """Yield ``(k, table)`` for blocks of the JSON lines in bytes ``[start, stop)``: the block's first row is
    on line ``LineBase(path, start).value + k``.  ``start`` must be 0 or just after a newline (see
    :func:`line_ranges`).  Blank lines are skipped (rows are numbered as lines when there are none).  The blocks
    are read into one reused buffer (:class:`_Blocks`); every table yielded owns its data."""
    import pyarrow.json as pj

    stop = os.path.getsize(path) if stop is None else stop
    base = LineBase(path, start)
    rel = 0  # newlines between `start` and the current block
    int_keys: list[str] | None | bool = False  # token-id lines' keys (json_ints), from the first block
    with open(path, "rb", buffering=0) as fh:
        fh.seek(start)
        blocks = _Blocks(fh, max(stop - start, 0), block_bytes)
        while (got := blocks.next()) is not None:
            buf, end = got
            # valid until blocks.keep_tail, nothing below keeps it; read-only as `bytes` was (the same Numba
            # specialization of the scan, and no consumer can write into the buffer)
            data = memoryview(buf)[:end].toreadonly()
            lead = _SPACE.match(buf, 0, end).end()  # blank lines (and spaces) before the first row
            if lead < end and int_keys is False:
                first_end = buf.find(b"\n", lead, end)
                int_keys = int_list_keys(bytes(data[lead : first_end if first_end >= 0 else end]))
            fast = read_int_lists(data, int_keys) if lead < end and int_keys else None
            if fast is not None:  # every line of the block an object of token-id lists (read by Numba)
                yield rel, fast
                # the scan takes no blank line: a newline ends every row but an unterminated last one
                rel += fast.num_rows - (0 if _ends_with_newline(buf, end) else 1)
                blocks.keep_tail(end)
                continue
            if lead < end:
                try:
                    options = pj.ReadOptions(block_size=max(end + 1, 1 << 20), use_threads=False)
                    table = pj.read_json(pa.BufferReader(pa.py_buffer(data)), read_options=options)
                except pa.ArrowInvalid as exc:
                    text = bytes(data)  # the error path: a copy
                    err = _find_bad_line(path, text, base.value + rel)
                    if err is None and "changed from" in str(exc) and _in_chat_column(str(exc)):
                        # valid JSON whose chat cells differ in type (a content string here, parts there):
                        # Python's reading of the block, chat cells as their own JSON (see _table)
                        objs = [json.loads(raw) for raw in _lines(path, text, None)]
                        yield rel + buf.count(b"\n", 0, lead), _table(path, objs, base.value + rel)
                        rel += buf.count(b"\n", 0, end)
                        blocks.keep_tail(end)
                        continue
                    raise (err or _arrow_json_error(path, text, base.value + rel, exc)) from None
                # ASCII (no byte over 127) needs no UTF-8 check; numpy's max reads the view without a copy
                if np.frombuffer(data, np.uint8).max() > 127 and not _valid_utf8(table, data):
                    err = _find_bad_line(path, bytes(data), base.value + rel)
                    raise (err or PackingError(f"input {path!r}: not UTF-8.")) from None
                rows = table.num_rows
                # own_json_cells calls the line reader at once (before the buffer is reused); its lines are copies
                table = own_json_cells(table, lambda d=data, n=rows: large_strings(_lines(path, bytes(d), n)))
                yield rel + buf.count(b"\n", 0, lead), table
            rel += buf.count(b"\n", 0, end)
            blocks.keep_tail(end)


class _TextWindow:
    """The part of a UTF-8 file not parsed yet, as text, refilled on demand; knows its line numbers."""

    def __init__(self, path: str, fh: IO[bytes], read_bytes: int) -> None:
        self.path, self.fh, self.read_bytes = path, fh, read_bytes
        self.buf, self.pos, self.line, self.eof, self.raw = "", 0, 1, False, b""

    def line_at(self, pos: int) -> int:
        return self.line + self.buf.count("\n", 0, pos)

    def more(self) -> bool:
        """Append the next bytes of the file (decoded); False at the end of the file."""
        if self.eof:
            return False
        chunk = self.fh.read(self.read_bytes)
        data = self.raw + chunk
        if not chunk:
            self.eof = True
            if not data:
                return False
        try:
            text, self.raw = data.decode("utf-8"), b""
        except UnicodeDecodeError as exc:
            if chunk and exc.reason == "unexpected end of data":  # a character cut by the read
                text, self.raw = data[: exc.start].decode("utf-8"), data[exc.start :]
            else:
                head = data[: exc.start].decode("utf-8", "replace")
                line = self.line_at(len(self.buf)) + head.count("\n")
                column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1)
                raise not_utf8(
                    self.path, line, data[exc.start - column :], column, column + exc.end - exc.start
                ) from None
        self.line = self.line_at(self.pos)
        self.buf = self.buf[self.pos :] + text
        self.pos = 0
        return True

    def peek(self) -> str:
        """The next non-blank character ("" at the end of the file)."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in " \t\r\n\ufeff":
                self.pos += 1
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self.more():
                return ""


def iter_json_array(
    path: str, block_rows: int = 1000, read_bytes: int = 1 << 20
) -> Iterator[tuple[int, pa.Table]]:
    """Yield ``(line of the block's first object, table)`` for blocks of ``block_rows`` objects of a file that
    holds one JSON array of objects, or one object whose only key holds that array (``{"data": [...]}``)."""
    decoder = json.JSONDecoder()
    with open(path, "rb") as fh:
        w = _TextWindow(path, fh, read_bytes)
        wrapped = w.peek() == "{"
        if wrapped:  # {"data": [...]}: one key whose value is the array
            w.pos += 1
            w.peek()
            try:
                key, w.pos = decoder.raw_decode(w.buf, w.pos)
            except json.JSONDecodeError:
                key = None
            if not isinstance(key, str) or w.peek() != ":":
                raise PackingError(f"input {path!r}: expected JSON lines or one JSON array of objects.")
            w.pos += 1
        if w.peek() != "[":
            raise PackingError(f"input {path!r}: expected JSON lines or one JSON array of objects.")
        w.pos += 1
        rows: list[dict] = []
        first, count = 0, 0
        while (c := w.peek()) != "]":
            if count and c != "":
                if c != ",":
                    raise PackingError(
                        f"input {path!r} line {w.line_at(w.pos)}: expected ',' or ']' after an object of the array, "
                        f"got {c!r}; fix the file."
                    )
                w.pos += 1
                c = w.peek()
            if c == "":
                raise PackingError(
                    f"input {path!r} line {w.line_at(w.pos)}: the JSON array is not closed (no ']'); is the file cut?"
                )
            while True:
                try:
                    obj, end = decoder.raw_decode(w.buf, w.pos)
                    break
                except json.JSONDecodeError as exc:
                    if len(w.buf) - w.pos < MAX_OBJECT_CHARS and w.more():
                        continue  # the object may only be cut by the read
                    raise PackingError(
                        f"input {path!r} line {w.line_at(exc.pos)} column {exc.colno}: malformed JSON ({exc.msg}); "
                        f"fix that object."
                    ) from None
            if not isinstance(obj, dict):
                raise PackingError(
                    f"input {path!r} line {w.line_at(w.pos)}: the array must hold objects, got {type(obj).__name__}."
                )
            if not rows:
                first = w.line_at(w.pos)
            rows.append(obj)
            count += 1
            w.pos = end
            if len(rows) >= block_rows:
                yield first, _table(path, rows, first)
                rows = []
        w.pos += 1
        if wrapped and w.peek() != "}":
            raise PackingError(
                f"input {path!r} line {w.line_at(w.pos)}: after the array, expected the '}}' that closes the object "
                f"around it (one key holding the array of rows)."
            )
        if rows:
            yield first, _table(path, rows, first)


def _in_chat_column(message: str) -> bool:
    """Whether Arrow's "Column(/name/...) changed from" refusal is about one of :data:`CHAT_COLUMNS`."""
    found = re.search(r"Column\(/([^/)]*)", message)
    return found is not None and found.group(1) in CHAT_COLUMNS


def _lines(path: str, data: bytes, rows: int | None) -> list[bytes]:
    """The non-blank lines of ``data`` (a block Arrow has read as ``rows`` rows)."""
    lines = [raw for raw in data.split(b"\n") if raw.strip()]
    if rows is not None and len(lines) != rows:  # Arrow and Python disagree on what the block holds
        raise PackingError(
            f"input {path!r}: a block read as {rows} rows by Arrow holds {len(lines)} JSON lines; is the file "
            f"being written while it is read?"
        )
    return lines


def _table(path: str, rows: list[dict], line: int) -> pa.Table:
    # every object's keys (from_pylist takes the first's)
    keys = list(dict.fromkeys(k for row in rows for k in row))
    # nested chat cells: each row's own value, as JSON (see json_cells); plain strings stay strings
    chat = [
        k
        for k in keys
        if k in CHAT_COLUMNS
        and any(row.get(k) is not None and not isinstance(row.get(k), str) for row in rows)
    ]
    fields, arrays = [], []
    try:
        for k in keys:
            field, array = (
                value_column(k, [row.get(k) for row in rows])
                if k in chat
                else (None, pa.array([row.get(k) for row in rows]))
            )
            fields.append(field or pa.field(k, array.type))
            arrays.append(array)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise PackingError(
            f"input {path!r} objects from line {line}: values of one key disagree in type ({exc}); fix the data."
        ) from None
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))
