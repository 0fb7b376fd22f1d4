"""Characters a byte-level BPE tokenizer cannot encode, counted as the data is tokenized.

A byte-level BPE trained without the byte alphabet has no token for some bytes: transformers silently leaves
them out of the ids, and the fast engine refuses the text (``docs/tokenize.md``, *Characters the tokenizer cannot
encode*).  The ids packtools writes stay transformers' ids; :class:`DropCounter` says which characters were left
out, how often and in which rows, for the summary and the manifest, or stops the run when asked to
(``on_unencodable='error'``).

>>> spec = {"model": {"type": "BPE", "vocab": {c: i for i, c in enumerate(byte_alphabet()) if c != "\u0109"}},
...         "pre_tokenizer": {"type": "ByteLevel"}}
>>> missing_bytes(spec)
[9]
>>> c = DropCounter(missing_bytes(spec))
>>> c.scan(["a\\tb\\t", "no tab"], lambda i: f"row {i}")
>>> c.report()["chars"], c.report()["rows"]
({'\\\\t': 2}, 1)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ...errors import PackingError, check_choice

ON_UNENCODABLE = ("report", "error")
FIRST_ROWS = 5  # rows named in the report


def byte_alphabet() -> list[str]:
    """The character byte-level BPE uses for each byte value 0..255 (printable Latin-1 bytes stand for
    themselves, the others for the code points from 256 on, in byte order)."""
    keep = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    out, extra = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


def _byte_level(spec: dict[str, Any]) -> bool:
    def kinds(node: Any) -> list[str]:
        if not isinstance(node, dict):
            return []
        if node.get("type") == "Sequence":
            return [k for child in node.get("pretokenizers", []) for k in kinds(child)]
        return [str(node.get("type"))]

    return (spec.get("model") or {}).get("type") == "BPE" and "ByteLevel" in kinds(spec.get("pre_tokenizer"))


def missing_bytes(spec: dict[str, Any]) -> list[int]:
    """Byte values without a token in a byte-level BPE's vocabulary (``spec``: a parsed tokenizer.json); empty
    for a complete vocabulary and for tokenizers that are not byte-level BPE."""
    if not _byte_level(spec):
        return []
    vocab = spec["model"].get("vocab") or {}
    return [b for b, c in enumerate(byte_alphabet()) if c not in vocab]


def check_on_unencodable(value: str) -> str:
    use = "'report' (count and report characters the tokenizer cannot encode) or 'error' (stop at the first one)"
    return check_choice("on_unencodable", value, ON_UNENCODABLE, use)


def describe_bytes(missing: Sequence[int]) -> str:
    """``missing`` byte values as ranges, naming the common whitespace among them.

    >>> describe_bytes([0, 1, 2, 9, 10, 200])
    '6 bytes (0x00-0x02, 0x09-0x0a, 0xc8; among them tab, newline)'
    """
    runs: list[str] = []
    for b in sorted(missing):
        if runs and runs[-1][1] == b - 1:
            runs[-1] = (runs[-1][0], b)
        else:
            runs.append((b, b))
    shown = ", ".join(f"0x{a:02x}" if a == b else f"0x{a:02x}-0x{b:02x}" for a, b in runs[:12])
    if len(runs) > 12:
        shown += ", ..."
    names = [n for b, n in _NAMED.items() if b in set(missing)]
    return f"{len(missing)} byte{'s' if len(missing) != 1 else ''} ({shown}" + (
        f"; among them {', '.join(names)})" if names else ")"
    )


_NAMED = {9: "tab", 10: "newline", 13: "carriage return", 32: "space"}


class DropCounter:
    """Counts the characters of texts that contain a byte in ``missing`` (outside added-token strings)."""

    def __init__(self, missing: Sequence[int], specials: Sequence[str] = (), on_unencodable: str = "report"):
        self.missing = sorted(missing)
        self.on_unencodable = check_on_unencodable(on_unencodable)
        self._specials = sorted((s for s in specials if s), key=len, reverse=True)
        self._keep = bytes(b for b in range(256) if b not in set(self.missing))  # translate() deletes these
        self.chars: dict[str, int] = {}
        self.rows = 0
        self.first_rows: list[str] = []

    def _hits(self, text: str) -> bytes:
        return text.encode("utf-8", "surrogatepass").translate(None, self._keep)

    def scan(self, texts: Sequence[str], where: Callable[[int], str]) -> None:
        """Count the unencodable characters of ``texts``; ``where(i)`` names text ``i`` (for the report)."""
        if not self._hits("".join(texts)):  # the usual case: one pass over the batch
            return
        for i, text in enumerate(texts):
            if not self._hits(text):
                continue
            for s in self._specials:  # added tokens are matched before the byte-level model
                text = text.replace(s, "")
            found = [c for c in text if self._hits(c)]
            if not found:
                continue
            if self.on_unencodable == "error":
                raise PackingError(
                    f"{where(i)}: the tokenizer has no token for {_chars(found)} (byte-level vocabulary without "
                    f"{describe_bytes(self.missing)}), so transformers would leave them out of the ids; "
                    f"use a tokenizer trained with the full byte alphabet, remove those characters, or pass "
                    f"on_unencodable='report' to drop them as transformers does and have them counted.",
                    param="on_unencodable",
                )
            for c in found:
                self.chars[c] = self.chars.get(c, 0) + 1
            self.rows += 1
            if len(self.first_rows) < FIRST_ROWS:
                self.first_rows.append(where(i))

    def report(self) -> dict[str, Any]:
        """What was left out so far: ``chars`` (repr of each character -> count), ``rows``, ``first_rows``."""
        chars = {repr(c)[1:-1]: n for c, n in sorted(self.chars.items(), key=lambda kv: (-kv[1], kv[0]))}
        return {
            "missing_bytes": [f"0x{b:02x}" for b in self.missing],
            "chars": chars,
            "count": sum(self.chars.values()),
            "rows": self.rows,
            "first_rows": list(self.first_rows),
        }

    def take(self) -> dict[str, Any] | None:
        """The report of what was counted since the last call (None if nothing), and start counting afresh."""
        if not self.rows:
            return None
        out = self.report()
        self.chars, self.rows, self.first_rows = {}, 0, []
        return out


def _chars(found: Sequence[str]) -> str:
    uniq = sorted(set(found))
    return ", ".join(f"{c!r} (U+{ord(c):04X})" for c in uniq[:8]) + (" ..." if len(uniq) > 8 else "")


def merge_reports(reports: Sequence[dict[str, Any] | None]) -> dict[str, Any] | None:
    """One report for a run from its parts' reports (None: nothing left out in that part)."""
    done = [r for r in reports if r]
    if not done:
        return None
    chars: dict[str, int] = {}
    for r in done:
        for c, n in r["chars"].items():
            chars[c] = chars.get(c, 0) + n
    first = [w for r in done for w in r["first_rows"]][:FIRST_ROWS]
    return {
        "missing_bytes": done[0]["missing_bytes"],
        "chars": dict(sorted(chars.items(), key=lambda kv: (-kv[1], kv[0]))),
        "count": sum(chars.values()),
        "rows": sum(r["rows"] for r in done),
        "first_rows": first,
    }
