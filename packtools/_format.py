"""The one fixed-width text-table renderer and its column groups (profiler, pipeline summaries, CLI, demo).

>>> print(text_table([["strategy", "bfd", "wrapped"], ["rows", "3", "12"]]))
strategy  bfd  wrapped
----------------------
rows        3       12
>>> print(text_table([["m", "rows", "fill"], ["512", "9", "99%"]], groups=["", "bfd", "bfd"]))
        bfd
m    rows  fill
---------------
512     9   99%
"""

from __future__ import annotations

from collections.abc import Sequence


def text_table(
    cells: Sequence[Sequence[str]], *, groups: Sequence[str] | None = None, first_left: bool = True
) -> str:
    """Render ``cells`` (the first row is the header) as aligned text, with a rule under the header.

    The first column is left-aligned (unless ``first_left=False``), the others right-aligned.  ``groups``
    gives one label per column; consecutive equal labels are centred over their columns on a line above.
    """
    cells = [[str(c) for c in row] for row in cells]
    ncol = len(cells[0])
    widths = [max(len(row[i]) for row in cells) for i in range(ncol)]
    spans = group_spans(groups or [])
    for g, a, b in spans:  # widen a group's last column so its label fits
        room = sum(widths[a : b + 1]) + 2 * (b - a)
        if len(g) > room:
            widths[b] += len(g) - room

    def line(row: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 and first_left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))
        ).rstrip()

    lines = [line(row) for row in cells]
    rule = "-" * max(len(s) for s in lines)
    lines.insert(1, rule)
    if spans:
        top = "  ".join(
            g.center(sum(widths[a : b + 1]) + 2 * (b - a)) if g else " " * widths[a] for g, a, b in spans
        )
        lines.insert(0, top.rstrip())
    return "\n".join(lines)


def group_spans(groups: Sequence[str]) -> list[tuple[str, int, int]]:
    """``(label, first column, last column)`` of each run of equal labels (an empty label: its column alone)."""
    spans: list[tuple[str, int, int]] = []
    for i, g in enumerate(groups):
        if spans and spans[-1][0] == g and g:
            spans[-1] = (g, spans[-1][1], i)
        else:
            spans.append((g, i, i))
    return spans
