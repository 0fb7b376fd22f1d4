"""A slow, obviously-correct pure-Python packer: the oracle the Numba kernels are tested against.

It follows the definitions word for word, with no data structure cleverness: O(items x bins).
"""

from __future__ import annotations


def reference_rows(lengths: list[int], max_length: int, strategy: str) -> list[list[tuple[int, int, int]]]:
    """Packed rows as lists of segments ``(source, start, length)``."""
    if strategy == "wrapped":
        rows: list[list[tuple[int, int, int]]] = []
        room = 0
        for source, length in enumerate(lengths):
            start = 0
            while start < length:
                if room == 0:
                    rows.append([])
                    room = max_length
                take = min(room, length - start)
                rows[-1].append((source, start, take))
                start += take
                room -= take
        return rows

    items = []
    for source, length in enumerate(lengths):
        if length == 0:
            continue  # empty sequences are dropped
        if strategy == "bfd":
            items.append((source, 0, min(length, max_length)))
        elif strategy == "bfd_split":
            for start in range(0, length, max_length):
                items.append((source, start, min(max_length, length - start)))
        else:
            raise ValueError(strategy)

    # Longest first; Python's sort is stable, so ties keep dataset order.
    items.sort(key=lambda item: -item[2])
    bins: list[dict] = []
    for step, item in enumerate(items):
        size = item[2]
        fitting = [b for b in bins if b["space"] >= size]
        if fitting:
            # Smallest remaining space; among equals, the bin that reached that space first.
            best = min(fitting, key=lambda b: (b["space"], b["since"]))
        else:
            best = {"items": [], "space": max_length, "since": step}
            bins.append(best)
        best["items"].append(item)
        best["space"] -= size
        best["since"] = step
    return [b["items"] for b in bins]


def reference_pack(
    sequences: list[list[int]], max_length: int, strategy: str
) -> tuple[list[list[int]], list[list[int]]]:
    """Packed token rows and their per-row segment lengths."""
    rows = reference_rows([len(s) for s in sequences], max_length, strategy)
    tokens = [[t for src, start, n in row for t in sequences[src][start : start + n]] for row in rows]
    seq_lengths = [[n for _, _, n in row] for row in rows]
    return tokens, seq_lengths
