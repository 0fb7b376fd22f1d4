"""What a JSON input that is not UTF-8 is, and the ``iconv`` line that converts it (used by :mod:`packtools.io.json`)."""

from __future__ import annotations

from ..errors import PackingError


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
